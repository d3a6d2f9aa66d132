//! The engine: carries out plans over any reader and writer.

pub mod convert;
pub mod copy;
pub mod direct;
pub mod example;
pub mod read_sums;
pub mod save;
pub mod verify;

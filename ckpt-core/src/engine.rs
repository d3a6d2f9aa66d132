//! The engine: carries out plans over any reader and writer.

pub(crate) mod convert;
pub(crate) mod copy;
pub(crate) mod direct;
pub(crate) mod example;
pub(crate) mod read_sums;
pub(crate) mod save;
pub(crate) mod verify;

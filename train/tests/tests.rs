//! Integration tests of the trainer, one binary with themed modules.

mod util;

mod accuracy;
mod checkpoints;
mod parallel;

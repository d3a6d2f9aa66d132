//! End-to-end tests of the `ckpt` binary, one module per theme.

mod util;

mod inspect_verify;
mod merge;
mod python;
mod reshard;
mod train_infer;

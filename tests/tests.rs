//! End-to-end tests of the `ckpt` binary, one module per theme.

mod util;
mod writers_golden;

mod bad_inputs;
mod cli;
mod compress;
mod compress_v2;
mod crash;
mod deepspeed;
mod deepspeed_write;
mod direct_write;
mod dtensor;
mod gguf;
mod hf;
mod inspect_verify;
mod maxtext;
mod megatron;
mod megatron_optim;
mod merge;
mod mindspore;
mod moe;
mod orbax;
mod pictures;
mod python;
mod readme;
mod reshard;
mod serving;
mod split_rules;
mod storage;
mod tensorboard;
mod torch;
mod train_infer;
mod trainers;
mod ucp;
mod zero_pictures;

//! Checkpoint writers: a copy plan rewritten into a framework's layout (names, files
//! per rank, rows cut, views of the same bytes) and the files written beside the
//! engine's (trackers, args, metadata the framework's loader reads). The top floor of
//! ckpt-core: a writer may use the checkpoint, the engine, the formats' file codecs and
//! the algebra; nothing below imports a writer (docs/architecture.md, "The write
//! side"). The byte encoders themselves are the formats' (`formats/<name>.rs`, behind
//! [`TensorWriter`](crate::formats::writer::TensorWriter)).

pub(crate) mod megatron;
pub(crate) mod megatron_dist;
pub(crate) mod ucp;

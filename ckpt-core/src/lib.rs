//! ckpt-core: the layout algebra, the checkpoint formats, copy planning and the
//! streaming copy engine shared by every ckpt tool.
//!
//! A tensor has a global shape and a [`layout::TensorLayout`] on a
//! [`layout::mesh::Mesh`]; each rank holds [`layout::Piece`]s of it. A checkpoint on
//! disk ([`Checkpoint`]) is a set of such pieces in files of any format ckpt reads; a
//! [`layout::plan::CopyPlan`] says, from metadata alone, which bytes go where to produce
//! any other set of pieces, a [`write::Writer`] lays those pieces out as an output
//! format, and [`engine::copy::execute`] carries the plan out streaming.
//!
//! The public API is grouped by layer, each group a module (docs/architecture.md, "The
//! public API"):
//!
//! - [`layout`]: the algebra (dtypes, regions and runs, meshes, layouts, strategy files,
//!   coverage, copy plans, the pieces' sources);
//! - [`formats`]: the file formats, one module each (readers, their writers of single
//!   files, detection, checksums, atomic outputs);
//! - [`checkpoint`]: [`Checkpoint`], what a set of files is, and its constants;
//! - [`engine`]: the copy, verify, convert (`.ckptz`) and per-rank save/load;
//! - [`write`](mod@write): the checkpoint writers behind [`write::Writer`];
//! - [`hf`]: Hugging Face model families and configs;
//! - [`present`] and [`draw`]: reports and pictures;
//! - [`launch`], [`fault`], [`storage`]: launchers, crash bookkeeping, object stores.
//!
//! Only what every caller needs stands at the root: [`Checkpoint`], [`Error`],
//! [`Result`], [`output_at`].

// The modules' own docs describe their private parts too, for whoever works on them
// (`cargo doc --document-private-items` renders those links); the public docs keep them
// as text.
#![allow(rustdoc::private_intra_doc_links)]

pub mod checkpoint;
pub mod draw;
pub mod engine;
mod error;
pub mod fault;
pub mod formats;
pub mod hf;
mod json;
pub mod launch;
pub mod layout;
pub mod present;
pub mod write;

pub use crate::checkpoint::{Checkpoint, Kind};
pub use crate::error::{Error, Problems, Result};
pub use ckpt_storage as storage;
use ckpt_storage::Output;

/// Where an output goes: a local path as it is, or a URL (`s3://…`) written through a
/// local staging directory that [`Output::publish`] uploads once the writers are done
/// (the directory is removed if the process dies, as every temporary is).
///
/// # Errors
/// A read-only store; an output already at the URL without `force`; no access.
pub fn output_at(path: &std::path::Path, force: bool) -> Result<Output> {
    let out = Output::new(path, force)?;
    if let Some(s) = out.staging() {
        crate::fault::register_temp(s);
    }
    Ok(out)
}

/// Where the one tensor of a single-tensor `torch.save` archive lies (`start..end` of
/// `bytes`), read forward from the archive's start as a DCP chunk in a bucket is read
/// (docs/formats.md, DCP); `None` where that reading refuses the archive. For the fuzz
/// targets: every parser has one.
#[doc(hidden)]
#[must_use]
pub fn torch_save_single_forward(bytes: &[u8]) -> Option<(u64, u64)> {
    formats::torch_save::parse_single_forward(bytes)
        .ok()
        .map(|e| (e.start, e.end))
}

/// The model's sizes a trainer's run config records (Megatron-Bridge's
/// `run_config.yaml` with `section` `model`, NeMo's `context/model.yaml` with
/// `config`): `(num_layers, hidden_size, num_attention_heads)` where it is read as
/// Megatron-LM's args would be; `None` where it is refused. For the fuzz targets: every
/// parser has one.
#[doc(hidden)]
#[must_use]
pub fn run_config_sizes(
    text: &str,
    section: &str,
) -> Option<(Option<u64>, Option<u64>, Option<u64>)> {
    formats::megatron::args_of_run_config_text(
        text,
        section,
        std::path::Path::new("run_config.yaml"),
    )
    .ok()
    .map(|a| (a.num_layers, a.hidden, a.heads))
}

/// Whether `bytes` parse as the Orbax metadata `kind` picks (0: an item's `_METADATA`
/// tree, 1: a zarr v2 `.zarray`, 2: a zarr v3 `zarr.json`, 3: a zarr v3 shard index
/// at the end of `bytes`, `kind / 4 % 4 + 1` inner chunks, a CRC-32C where `kind`'s
/// high bit is set). For the fuzz targets: every parser has one.
#[doc(hidden)]
#[must_use]
pub fn orbax_metadata(kind: u8, bytes: &[u8]) -> bool {
    formats::orbax::parse_metadata(kind, bytes)
}

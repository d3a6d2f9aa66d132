//! ckpt-core: the layout algebra, strategy files, safetensors I/O and copy planning
//! shared by every ckpt tool.
//!
//! A tensor has a global shape and a [`TensorLayout`] on a [`Mesh`]; each rank holds
//! [`Piece`]s of it. A checkpoint on disk ([`Checkpoint`]) is a set of such pieces in
//! safetensors files; a [`CopyPlan`] says, from metadata alone, which bytes go where to
//! produce any other set of pieces, and [`execute`] carries it out streaming.

mod checkpoint;
mod draw;
mod engine;
mod error;
mod fault;
mod formats;
mod hf;
mod json;
mod launch;
mod layout;
mod present;
mod write;

pub use crate::checkpoint::{
    Checkpoint, Kind, CARRIED_FILES, COMPRESSED_INDEX_FILE, COMPRESSED_MODEL_FILE,
    DCP_SHARDING_INFO, INDEX_FILE, MODEL_FILE, OPTIMIZER_FILE, OPTIMIZER_PREFIX, STRATEGY_FILE,
};
pub use crate::checkpoint::{Computations, HfModel, HfTarget, SCALE_INV_SUFFIX};
pub use crate::draw::{
    fold, holder_label, html_report, matching, picture, piece_count, pieces_json, plan_html_report,
    render_text, show, write_html_report, write_plan_html, Canvas, Extent, Fold, Holding,
    PlanReport, SourceRead, TargetReads, TensorPicture,
};
pub use crate::engine::convert::{convert, Conversion, ConvertStats};
pub use crate::engine::copy::{
    assemble, assemble_into, assemble_part_into, execute, execute_with, tensor_parts, CopyStats,
    TensorPart, SLAB_BYTES,
};
pub use crate::engine::example::{
    example_byte, example_strategy, example_tensor, write_example, ExampleModel,
};
pub use crate::engine::save::{
    load_rank, write_integrated, write_integrated_with, write_rank, write_rank_with, LocalTensor,
};
pub use crate::engine::verify::{verify, verify_selected, VerifyDepth};
pub use crate::error::{Error, Problems, Result};
pub use crate::formats::read_small as read_file;
pub use ckpt_storage::{
    commit_staged, is_url, prepare_staged, stage_files, unmirror_text, Error as StorageError,
    Output, Stream as UploadStream,
};

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
pub use crate::checkpoint::MAXTEXT_ITEM;
pub use crate::fault::{bus_error_message, remove_registered_temporaries};
pub use crate::formats::checksum::{
    checksums_enabled, set_checksums_enabled, with_checksums, Checksum, CHECKSUMS_KEY,
};
pub use crate::formats::ckptz::{
    compress_chunk, decompress_chunk, group_bytes, group_of, parse_header as parse_ckptz_header,
    ungroup_bytes, CkptzWriter, CodedChunk, Compression, DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL,
    EXTENSION as CKPTZ_EXTENSION, MAGIC as CKPTZ_MAGIC, MAGIC_V1 as CKPTZ_MAGIC_V1,
};
pub use crate::formats::deepspeed_write::DeepSpeedWriteStats;
pub use crate::formats::detect::{create_writer, sniff};
pub use crate::formats::distcp::{
    metadata_bytes as distcp_metadata, torch_dtype_name, DistcpChunk, DistcpObject,
};
pub use crate::formats::gguf::{parse_gguf, GgmlType};
pub use crate::formats::mindspore_ckpt::{parse_mindspore_ckpt, MindSporeWriter};
pub use crate::formats::mindspore_strategy::{
    looks_like as is_mindspore_strategy, mindspore_target_strategy, parse_mindspore_strategy,
    read_mindspore_strategies, MindSporeParam,
};
pub use crate::formats::output::{
    check_output_outside_inputs, copy_carried, remove_stale_temps, replace_atomically,
    write_file_atomic, StagedDir,
};
pub use crate::formats::safetensors::{
    encode_header, parse_header as parse_safetensors_header, SafetensorsWriter, MAX_HEADER_LEN,
};
pub use crate::formats::writer::{TensorSpec, TensorWriter};
pub use crate::formats::{
    ChunkCache, Decoder, FileFormat, PieceKind, ReadCache, TensorEntry, TensorFile,
};
pub use crate::hf::{
    config_json as hf_config_json, read_config as read_hf_config, Family, Shape as ModelShape,
    TOKENIZER_FILES as HF_TOKENIZER_FILES,
};
pub use crate::launch::{LaunchEnv, Launcher};
pub use crate::layout::coverage::{check_tiling, Defect};
pub use crate::layout::flat::{
    box_to_flat, check_flat_cover, flat_of_box, flat_to_box, numel, FlatBox, FlatDefect,
    FlatLayout, FlatRange, FlatSlot,
};
pub use crate::layout::mesh::{Axis, Mesh};
pub use crate::layout::mindspore::{from_mindspore, MapEntry, MindSporeLayout};
pub use crate::layout::plan::{
    bytes_of, check_cast, rank_metadata, rank_tensors, tensors_read, CopyOp, CopyPlan, FilePlan,
    TargetFile, TargetTensor, TensorPlan, TensorsRead,
};
pub use crate::layout::region::{Dims, Region, Run, Runs};
pub use crate::layout::select::{Selection, Views};
pub use crate::layout::source::{Block, PieceSource, SourcePiece, SourceTensor, StoredView};
pub use crate::layout::split_rules::{is_split_rules, SplitRules};
pub use crate::layout::strategy::{
    dtype_name, parse_dtype, Strategy, STRATEGY_FORMAT, STRATEGY_VERSION,
};
pub use crate::layout::Dtype;
pub use crate::layout::{Piece, Placement, TensorLayout};
pub use crate::present::{
    convert_json, convert_text, human_bytes, inspect_json, inspect_text, merge_plan_json,
    merge_plan_text, placements_text, plan_json, plan_text, verify_json, verify_text, CopySummary,
};
pub use crate::write::dcp::Dcp;
pub use crate::write::deepspeed::write_deepspeed_dp;
pub use crate::write::gguf::{read_bpe_tokenizer, BpeVocab, GgufExport};
pub use crate::write::hf::{HfExport, HF_MAX_SHARD_SIZE};
pub use crate::write::megatron::MegatronLegacy;
pub use crate::write::megatron_bridge::MegatronBridge;
pub use crate::write::megatron_dist::MegatronDist;
pub use crate::write::nemo2::Nemo2;
pub use crate::write::one_file::OneFile;
pub use crate::write::orbax::{OrbaxStep, ORBAX_DEFAULT_ITEM};
pub use crate::write::ranks::{RankOptions, Ranks, MAX_TARGET_RANKS};
pub use crate::write::safetensors::Integrated;
pub use crate::write::sliced::Sliced;
pub use crate::write::ucp::{ucp_finish, ucp_plan, Universal};
pub use crate::write::{TargetLayout, Writer};

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

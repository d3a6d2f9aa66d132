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
mod layout;

// The modules' old places, while their users are moved over.
use engine::{convert, copy, example, save, verify};
use formats::{checksum, output};
use layout::{coverage, mesh, mindspore, plan, region, select, strategy};

pub use crate::checkpoint::{
    Checkpoint, Kind, SourcePiece, SourceTensor, CARRIED_FILES, COMPRESSED_INDEX_FILE,
    COMPRESSED_MODEL_FILE, DCP_SHARDING_INFO, INDEX_FILE, MODEL_FILE, OPTIMIZER_FILE,
    OPTIMIZER_PREFIX, STRATEGY_FILE,
};
pub use crate::checksum::{checksums_enabled, set_checksums_enabled, Checksum, CHECKSUMS_KEY};
pub use crate::convert::{convert, Conversion, ConvertStats};
pub use crate::copy::{assemble, assemble_into, execute, execute_with, CopyStats, SLAB_BYTES};
pub use crate::coverage::{check_tiling, Defect};
pub use crate::draw::{
    fold, holder_label, html_report, matching, picture, pieces_json, render_text, show,
    write_html_report, Canvas, Extent, Fold, Holding, PlanReport, SourceRead, TargetReads,
    TensorPicture,
};
pub use crate::error::{Error, Problems, Result};
pub use crate::example::{
    example_byte, example_strategy, example_tensor, write_example, ExampleModel,
};
pub use crate::fault::{bus_error_message, remove_registered_temporaries};
pub use crate::formats::ckptz::{
    compress_chunk, decompress_chunk, group_bytes, group_of, parse_header as parse_ckptz_header,
    ungroup_bytes, CkptzWriter, Compression, DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL,
    EXTENSION as CKPTZ_EXTENSION, MAGIC as CKPTZ_MAGIC, MAGIC_V1 as CKPTZ_MAGIC_V1,
};
pub use crate::formats::distcp::{metadata_bytes as distcp_metadata, DistcpChunk};
pub use crate::formats::mindspore_ckpt::{parse_mindspore_ckpt, MindSporeWriter};
pub use crate::formats::mindspore_strategy::{
    looks_like as is_mindspore_strategy, mindspore_target_strategy, parse_mindspore_strategy,
    read_mindspore_strategies, MindSporeParam,
};
pub use crate::formats::safetensors::{
    encode_header, parse_header as parse_safetensors_header, SafetensorsWriter, TensorSpec,
    MAX_HEADER_LEN,
};
pub use crate::formats::{sniff, ChunkCache, FileFormat, TensorEntry, TensorFile};
pub use crate::layout::{Piece, Placement, TensorLayout};
pub use crate::mesh::{Axis, Mesh};
pub use crate::mindspore::{from_mindspore, MapEntry, MindSporeLayout};
pub use crate::output::{
    check_output_outside_inputs, copy_carried, remove_stale_temps, replace_atomically,
    write_file_atomic, StagedDir,
};
pub use crate::plan::{
    bytes_of, check_cast, rank_metadata, rank_tensors, CopyOp, CopyPlan, FilePlan, TargetFile,
    TargetTensor, TensorPlan,
};
pub use crate::region::{Region, Run, Runs};
pub use crate::save::{
    load_rank, write_integrated, write_integrated_with, write_rank, write_rank_with, LocalTensor,
};
pub use crate::select::Selection;
pub use crate::strategy::{dtype_name, parse_dtype, Strategy, STRATEGY_FORMAT, STRATEGY_VERSION};
pub use crate::verify::{verify, verify_selected, VerifyDepth};
pub use ::safetensors::Dtype;

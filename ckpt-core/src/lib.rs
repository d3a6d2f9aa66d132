//! ckpt-core: the layout algebra, strategy files, safetensors I/O and copy planning
//! shared by every ckpt tool.
//!
//! A tensor has a global shape and a [`TensorLayout`] on a [`Mesh`]; each rank holds
//! [`Piece`]s of it. A checkpoint on disk ([`Checkpoint`]) is a set of such pieces in
//! safetensors files; a [`CopyPlan`] says, from metadata alone, which bytes go where to
//! produce any other set of pieces, and [`execute`] carries it out streaming.

mod coverage;
mod error;
mod layout;
mod mesh;
mod region;
mod safetensors;
mod strategy;

pub use crate::coverage::{check_tiling, Defect};
pub use crate::error::{Error, Result};
pub use crate::layout::{Piece, Placement, TensorLayout};
pub use crate::mesh::{Axis, Mesh};
pub use crate::region::{Region, Run, Runs};
pub use crate::safetensors::{
    encode_header, write_file_atomic, SafetensorsFile, SafetensorsWriter, TensorEntry, TensorSpec, MAX_HEADER_LEN,
};
pub use crate::strategy::{dtype_name, parse_dtype, Strategy, STRATEGY_FORMAT, STRATEGY_VERSION};
pub use ::safetensors::Dtype;

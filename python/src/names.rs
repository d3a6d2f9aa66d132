//! Names users give and read: dtypes for casts, and the kinds of checkpoint. Shared by
//! `checkpoint`, `load` and `ops` (so neither needs the other for them).

use crate::errors::usage;
use ckpt_core::layout::Dtype;
use ckpt_core::Kind;
use pyo3::prelude::*;

/// A dtype for casting: `bf16`, `f16`/`fp16`, `f32`/`fp32`, `f64`, or a safetensors name.
pub(crate) fn cast_of(py: Python<'_>, s: Option<&str>) -> PyResult<Option<Dtype>> {
    let Some(s) = s else { return Ok(None) };
    let name = match s.to_ascii_lowercase().as_str() {
        "fp16" | "float16" | "half" => "F16".to_string(),
        "fp32" | "float32" | "float" => "F32".to_string(),
        "fp64" | "float64" | "double" => "F64".to_string(),
        "bfloat16" => "BF16".to_string(),
        other => other.to_ascii_uppercase(),
    };
    ckpt_core::layout::strategy::parse_dtype(&name)
        .map(Some)
        .map_err(|e| usage(py, format!("dtype `{s}`: {e}")))
}

/// "sliced", "integrated" or "dcp".
pub(crate) fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Sliced => "sliced",
        Kind::Integrated => "integrated",
        Kind::Dcp => "dcp",
    }
}

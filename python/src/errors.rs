//! ckpt-core's error enum as Python exceptions: one class per kind, defined in
//! `ckpt/errors.py` (plain Python classes, so they pickle across processes).

use ckpt_core::Error;
use pyo3::prelude::*;
use std::path::Path;

/// The Python class (in `ckpt.errors`) for an error.
fn class_of(e: &Error) -> &'static str {
    match e {
        Error::WithPath { source, .. } => class_of(source),
        Error::ChecksumMismatch { .. } | Error::CorruptChunk { .. } => "ChecksumMismatch",
        Error::CoverageGap { .. } => "MissingData",
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => "PathNotFound",
        Error::Ambiguous { .. } => "AmbiguousInput",
        Error::OutputExists { .. } | Error::Storage(ckpt_core::storage::Error::Exists { .. }) => {
            "OutputExists"
        }
        Error::Storage(ckpt_core::storage::Error::NotFound { .. }) => "PathNotFound",
        Error::InvalidMesh { .. } => "UsageError",
        Error::Mismatch { .. } => "Mismatch",
        Error::Unsupported { .. } => "Unsupported",
        Error::Overlap { .. }
        | Error::InvalidLayout { .. }
        | Error::InvalidStrategy { .. }
        | Error::InvalidHeader { .. }
        | Error::InvalidCompressed { .. }
        | Error::InvalidTorch { .. }
        | Error::InvalidTensor { .. }
        | Error::HeaderTooLarge { .. }
        | Error::UnknownInput { .. }
        | Error::Overflow { .. }
        | Error::NoTensors { .. } => "InvalidInput",
        // Several problems: the most telling kind among them (a damaged file, then data
        // missing, then ambiguity), else the first one's.
        Error::Many(p) => [
            "ChecksumMismatch",
            "PathNotFound",
            "MissingData",
            "AmbiguousInput",
        ]
        .into_iter()
        .find(|k| p.0.iter().any(|e| class_of(e) == *k))
        .or_else(|| p.0.first().map(class_of))
        .unwrap_or("CheckpointError"),
        _ => "CheckpointError",
    }
}

/// Raises `class` (a name in `ckpt.errors`) with `message`.
pub(crate) fn raise(py: Python<'_>, class: &str, message: String) -> PyErr {
    raise_with(py, class, message, None)
}

/// [`raise`], with the missing file's path for `PathNotFound` (its `filename`).
fn raise_with(py: Python<'_>, class: &str, message: String, path: Option<&Path>) -> PyErr {
    let made = py
        .import("ckpt.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| match path {
            Some(p) => c.call1((message.clone(), p.to_path_buf())),
            None => c.call1((message.clone(),)),
        });
    match made {
        Ok(v) => PyErr::from_value(v),
        Err(e) => e,
    }
}

/// The file a missing-file error is about.
fn missing_path(e: &Error) -> Option<&Path> {
    match e {
        Error::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => Some(path),
        Error::WithPath { source, .. } => missing_path(source),
        _ => None,
    }
}

/// The Python exception for a ckpt-core error, with the CLI's message.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let class = class_of(&e);
    let path = (class == "PathNotFound")
        .then(|| missing_path(&e))
        .flatten();
    // Objects of a bucket are read through local trees: name the objects.
    raise_with(
        py,
        class,
        ckpt_core::storage::unmirror_text(&e.to_string()),
        path,
    )
}

/// `Result` of ckpt-core into `PyResult`.
pub(crate) trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for ckpt_core::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// A usage error (bad arguments from Python).
pub(crate) fn usage(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, "UsageError", message.into())
}

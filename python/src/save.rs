//! Saving from a training program's memory: the strategy of a state dict, and one
//! rank's `ckpt_<rank>/` written by ckpt-core.

use crate::errors::{usage, IntoPy};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::strategy::{parse_dtype, Strategy};
use ckpt_core::layout::{Placement, TensorLayout};
use pyo3::prelude::*;
use std::path::PathBuf;

/// The strategy (ckpt's `strategy.json`) of tensors laid out on a mesh: `mesh` as
/// `(axis, size)` pairs, each tensor as `(name, dtype, global shape, placements)` with
/// one placement per axis (`"Shard(0)"`, `"Replicate"`). Checked as ckpt checks any
/// strategy file.
#[pyfunction]
pub(crate) fn strategy_json(
    py: Python<'_>,
    mesh: Vec<(String, u64)>,
    tensors: Vec<(String, String, Vec<u64>, Vec<String>)>,
) -> PyResult<String> {
    let mesh = Mesh::new(mesh).py_err(py)?;
    let mut s = Strategy::new(mesh.clone());
    for (name, dtype, shape, placements) in tensors {
        let dtype = parse_dtype(&dtype).map_err(|e| usage(py, format!("tensor `{name}`: {e}")))?;
        let placements = placements
            .iter()
            .map(|p| Placement::parse(p))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| usage(py, format!("tensor `{name}`: {e}")))?;
        let layout = TensorLayout::new(shape, dtype, placements);
        layout.validate(&name, &mesh).py_err(py)?;
        s.insert(name, layout).py_err(py)?;
    }
    Ok(s.to_json())
}

/// Writes rank `rank`'s `dir/ckpt_<rank>/` (model file and `strategy.json`) from
/// `(name, address, bytes)` of its local tensors, without the GIL. Private to `ckpt`:
/// the addresses are those of live contiguous CPU tensors the caller holds for the call.
/// `checksums`: record each tensor's CRC-32C (this call only; other calls, on other
/// threads too, keep their own setting).
#[pyfunction]
#[pyo3(signature = (dir, strategy, rank, tensors, keep_all=false, checksums=true))]
pub(crate) fn write_rank(
    py: Python<'_>,
    dir: PathBuf,
    strategy: &str,
    rank: u64,
    tensors: Vec<(String, usize, usize)>,
    keep_all: bool,
    checksums: bool,
) -> PyResult<PathBuf> {
    let strategy = Strategy::from_json(strategy).py_err(py)?;
    py.detach(|| {
        let views: Vec<(&str, &[u8])> = tensors
            .iter()
            .map(|(name, addr, n)| {
                let bytes: &[u8] = if *n == 0 {
                    &[]
                } else {
                    // SAFETY: `addr` is the start of `n` bytes of a live tensor the caller
                    // holds, unchanged, for the duration of this call (see above).
                    unsafe { std::slice::from_raw_parts(*addr as *const u8, *n) }
                };
                (name.as_str(), bytes)
            })
            .collect();
        ckpt_core::formats::checksum::with_checksums(checksums, || {
            ckpt_core::engine::save::write_rank(&dir, &strategy, rank, &views, keep_all)
        })
    })
    .py_err(py)
}

/// Before the ranks of a save to a URL stage their files: the clean-up after a killed
/// save to it, and the refusal of an existing output (rank 0, once).
#[pyfunction]
pub(crate) fn prepare_remote_output(py: Python<'_>, url: PathBuf) -> PyResult<()> {
    py.detach(|| ckpt_core::storage::prepare_staged(&url).map_err(ckpt_core::Error::from))
        .py_err(py)
}

/// One rank's files, sent part by part to the output at a URL while `write_rank` writes
/// them (nothing visible until the commit); closed without being staged, what was sent
/// is aborted.
#[pyclass(module = "ckpt._ckpt")]
pub(crate) struct RemoteStream(Option<ckpt_core::storage::Stream>);

#[pymethods]
impl RemoteStream {
    /// Aborts the uploads unless `stage_remote` took them over.
    fn close(&self, py: Python<'_>) {
        if let Some(s) = &self.0 {
            py.detach(|| s.abandon());
        }
    }
}

/// Starts streaming the files written under `local` (one rank's local copy of the
/// output at `url`) as writer `writer` (the rank).
#[pyfunction]
pub(crate) fn stream_remote(
    py: Python<'_>,
    local: PathBuf,
    url: PathBuf,
    writer: u64,
) -> PyResult<RemoteStream> {
    py.detach(|| {
        ckpt_core::storage::Stream::start(&local, &url, writer)
            .map(RemoteStream)
            .map_err(ckpt_core::Error::from)
    })
    .py_err(py)
}

/// Uploads one rank's files under `local` to the output at `url` as multipart uploads
/// not yet completed (nothing visible), taking over what `stream` sent while they were
/// written; returns what completes them (JSON).
#[pyfunction]
#[pyo3(signature = (local, url, writer, stream=None))]
pub(crate) fn stage_remote(
    py: Python<'_>,
    local: PathBuf,
    url: PathBuf,
    writer: u64,
    stream: Option<PyRef<'_, RemoteStream>>,
) -> PyResult<String> {
    let stream = stream.as_ref().and_then(|s| s.0.as_ref());
    py.detach(|| {
        ckpt_core::storage::stage_files(&local, &url, writer, stream)
            .map_err(ckpt_core::Error::from)
    })
    .py_err(py)
}

/// Completes every rank's staged uploads (entry files last): the output appears.
#[pyfunction]
pub(crate) fn commit_remote(py: Python<'_>, url: PathBuf, staged: Vec<String>) -> PyResult<()> {
    py.detach(|| ckpt_core::storage::commit_staged(&url, &staged).map_err(ckpt_core::Error::from))
        .py_err(py)
}

//! `ckpt._ckpt.Checkpoint`: an opened, checked checkpoint of any format ckpt reads.

use crate::errors::{usage, IntoPy};
use crate::load::LoadPlan;
use crate::names::{cast_of, kind_name};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::select::Selection;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::Checkpoint;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

/// The options every reading call shares: the inputs and how names are read.
#[derive(Debug)]
pub(crate) struct Source {
    /// Inputs, with any MindSpore strategy files given as `source_strategy`.
    pub(crate) paths: Vec<PathBuf>,
    /// Renaming (`strip_prefix`).
    pub(crate) selection: Selection,
}

impl Source {
    pub(crate) fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        source_strategy: Vec<PathBuf>,
        strip_prefix: Option<String>,
    ) -> PyResult<Source> {
        for s in &source_strategy {
            let bytes = std::fs::read(s).map_err(|e| {
                crate::errors::to_py(
                    py,
                    ckpt_core::Error::Io {
                        path: s.clone(),
                        source: e,
                    },
                )
            })?;
            if !ckpt_core::formats::mindspore_strategy::looks_like(&bytes) {
                return Err(usage(
                    py,
                    format!(
                        "source_strategy {}: not a MindSpore strategy file (protobuf ParallelStrategyMap or its JSON form)",
                        s.display()
                    ),
                ));
            }
        }
        Ok(Source {
            paths: paths.into_iter().chain(source_strategy).collect(),
            selection: Selection::default().with_prefixes(strip_prefix, None),
        })
    }
}

/// Paths from a str, a path, or a list of them.
pub(crate) fn paths_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<PathBuf>> {
    if let Ok(p) = obj.extract::<PathBuf>() {
        return Ok(vec![p]);
    }
    obj.extract::<Vec<PathBuf>>()
}

/// An opened checkpoint: its files are mapped, its layout checked (every element of every
/// tensor held exactly once).
#[pyclass(name = "Checkpoint", module = "ckpt._ckpt", frozen)]
pub(crate) struct PyCheckpoint {
    pub(crate) inner: Arc<Checkpoint>,
}

/// `(axis, size)` pairs of a mesh given as `"dp=2,tp=2"`.
fn mesh_axes(py: Python<'_>, text: &str) -> PyResult<Vec<(String, u64)>> {
    let mesh = Mesh::parse(text).py_err(py)?;
    Ok(mesh
        .axes()
        .iter()
        .map(|a| (a.name.clone(), a.size))
        .collect())
}

/// The reshard target a `to` / `mesh` / `strategy` argument names (at most one).
pub(crate) fn target_of(
    py: Python<'_>,
    to: Option<u64>,
    mesh: Option<&str>,
    strategy: Option<PathBuf>,
) -> PyResult<Option<ckpt_reshard::Target>> {
    let given =
        usize::from(to.is_some()) + usize::from(mesh.is_some()) + usize::from(strategy.is_some());
    if given > 1 {
        return Err(usage(py, "give at most one of to, mesh and strategy"));
    }
    if let Some(n) = to {
        if n == 0 {
            return Err(usage(py, "to=0: a target needs at least one rank"));
        }
        return Ok(Some(ckpt_reshard::Target::To(n)));
    }
    if let Some(m) = mesh {
        return Ok(Some(ckpt_reshard::Target::Mesh(mesh_axes(py, m)?)));
    }
    if let Some(s) = strategy {
        let t = ckpt_reshard::Target::from_strategy_file(&s).py_err(py)?;
        return Ok(Some(t));
    }
    Ok(None)
}

#[pymethods]
impl PyCheckpoint {
    /// Opens `paths` (a directory, file, or list of them).
    /// `lora` (adapter directories) are merged into the weights as they are read, and
    /// `dtype` dequantizes block-scaled FP8 weights (as `ckpt merge --lora`, `--dtype`).
    #[new]
    #[pyo3(signature = (paths, source_strategy=None, strip_prefix=None, lora=vec![], lora_alpha=None, dtype=None))]
    fn new(
        py: Python<'_>,
        paths: &Bound<'_, PyAny>,
        source_strategy: Option<&Bound<'_, PyAny>>,
        strip_prefix: Option<String>,
        lora: Vec<PathBuf>,
        lora_alpha: Option<f64>,
        dtype: Option<&str>,
    ) -> PyResult<PyCheckpoint> {
        let paths = paths_of(paths)?;
        let strategies = match source_strategy {
            Some(s) => paths_of(s)?,
            None => vec![],
        };
        let source = Source::new(py, paths, strategies, strip_prefix)?;
        let cast = Selection::new(&[], &[], cast_of(py, dtype)?).py_err(py)?;
        let computations = ckpt_core::checkpoint::Computations {
            lora,
            lora_alpha,
            quantize_fp8: false,
        };
        let ck = py
            .detach(move || {
                let mut ck = Checkpoint::open_selected(&source.paths, &source.selection)?;
                ck.compute(&computations, &cast)?;
                Ok::<_, ckpt_core::Error>(ck)
            })
            .py_err(py)?;
        Ok(PyCheckpoint {
            inner: Arc::new(ck),
        })
    }

    /// "sliced", "integrated" or "dcp".
    #[getter]
    fn kind(&self) -> &'static str {
        kind_name(self.inner.kind)
    }

    /// The formats of the files read (e.g. `["safetensors"]`), each once.
    #[getter]
    fn formats(&self) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = Vec::new();
        for f in &self.inner.files {
            let n = f.format().name();
            if !out.contains(&n) {
                out.push(n);
            }
        }
        out
    }

    /// `(path, rank or None, format)` of every file read.
    #[getter]
    fn files(&self) -> Vec<(String, Option<u64>, &'static str)> {
        self.inner
            .files
            .iter()
            .zip(&self.inner.ranks)
            .map(|(f, r)| (shown(f.path()), *r, f.format().name()))
            .collect()
    }

    /// The mesh of a sliced checkpoint (`"dp=2,tp=2"`), else None.
    #[getter]
    fn mesh(&self) -> Option<String> {
        self.inner.strategy.as_ref().map(|s| s.mesh.to_string())
    }

    /// The strategy of a sliced checkpoint as JSON (ckpt's `strategy.json`), else None.
    #[getter]
    fn strategy(&self) -> Option<String> {
        self.inner.strategy.as_ref().map(Strategy::to_json)
    }

    /// What could not be checked from these inputs.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.inner.notes.clone()
    }

    /// name -> dict(dtype, shape, placements, pieces=[(file, start, shape)]).
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let ck = &self.inner;
        for (name, t) in &ck.tensors {
            let d = PyDict::new(py);
            d.set_item("dtype", ckpt_core::layout::strategy::dtype_name(t.dtype))?;
            d.set_item("shape", t.shape.clone())?;
            let placements: Option<Vec<String>> = ck.strategy.as_ref().and_then(|s| {
                s.tensors
                    .get(name)
                    .map(|l| l.placements.iter().map(ToString::to_string).collect())
            });
            d.set_item("placements", placements)?;
            let pieces: Vec<(String, Vec<u64>, Vec<u64>)> = t
                .pieces
                .iter()
                .map(|p| {
                    (
                        shown(ck.files[p.file].path()),
                        p.global.start.to_vec(),
                        p.global.shape.to_vec(),
                    )
                })
                .collect();
            d.set_item("pieces", pieces)?;
            out.set_item(name, d)?;
        }
        Ok(out)
    }

    /// The files' own metadata (safetensors' `__metadata__`): one file's as it is;
    /// for several files, the entries every file that has the key agrees on. None when
    /// there is none.
    #[getter]
    fn metadata(&self) -> Option<BTreeMap<String, String>> {
        let mut out: BTreeMap<String, String> = BTreeMap::new();
        let mut conflicting: BTreeSet<String> = BTreeSet::new();
        for f in &self.inner.files {
            for (k, v) in f.metadata() {
                match out.get(k) {
                    Some(w) if w != v => {
                        conflicting.insert(k.clone());
                    }
                    _ => {
                        out.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        out.retain(|k, _| !conflicting.contains(k));
        (!out.is_empty()).then_some(out)
    }

    /// Plans loading whole tensors, or the pieces target `rank` holds under a target
    /// layout (`to`, `mesh`, `strategy`; the source's own strategy when none is given).
    /// `dtype` (`"bf16"`, ...): floating-point tensors converted to it, others as stored.
    #[pyo3(signature = (names=None, rank=None, to=None, mesh=None, strategy=None, dtype=None))]
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        py: Python<'_>,
        names: Option<Vec<String>>,
        rank: Option<u64>,
        to: Option<u64>,
        mesh: Option<&str>,
        strategy: Option<PathBuf>,
        dtype: Option<&str>,
    ) -> PyResult<LoadPlan> {
        let target = target_of(py, to, mesh, strategy)?;
        let cast = cast_of(py, dtype)?;
        LoadPlan::for_rank(py, self.inner.clone(), names, rank, target, cast)
    }

    /// Plans loading boxes of global tensors: `(name, global shape, dtype, start, local
    /// shape)` each (a DTensor's local shard). Every problem (unknown names, other
    /// shapes, impossible casts) is found before any byte is read.
    fn plan_boxes(
        &self,
        py: Python<'_>,
        requests: Vec<crate::load::BoxRequest>,
    ) -> PyResult<LoadPlan> {
        LoadPlan::for_boxes(py, self.inner.clone(), requests)
    }
}

/// A file's path as the user knows it: the object's URL for a file of a bucket (read
/// through a local tree of ckpt's), else the path. A string: `pathlib` would fold a
/// URL's `//`.
fn shown(path: &std::path::Path) -> String {
    ckpt_core::storage::unmirror_text(&path.to_string_lossy())
}

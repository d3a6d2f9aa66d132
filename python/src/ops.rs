//! Whole-checkpoint operations, as the CLI runs them: merge, reshard, verify, compress
//! and decompress. Each returns a dict the Python layer turns into a report object.

use crate::checkpoint::{paths_of, target_of, Source};
use crate::errors::{usage, IntoPy};
use crate::names::cast_of;
use ckpt_core::engine::copy::CopyStats;
use ckpt_core::formats::ckptz::Compression;
use ckpt_core::layout::plan::CopyPlan;
use ckpt_core::layout::select::Selection;
use ckpt_core::Checkpoint;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

fn compression_of(py: Python<'_>, s: Option<&str>) -> PyResult<Option<Compression>> {
    s.map(|s| Compression::parse(s).map_err(|e| usage(py, format!("compress `{s}`: {e}"))))
        .transpose()
}

/// The selection: patterns, cast and renaming.
fn selection(
    py: Python<'_>,
    include: Vec<String>,
    exclude: Vec<String>,
    dtype: Option<&str>,
    strip_prefix: Option<String>,
    add_prefix: Option<String>,
) -> PyResult<Selection> {
    Ok(Selection::new(&include, &exclude, cast_of(py, dtype)?)
        .py_err(py)?
        .with_prefixes(strip_prefix, add_prefix))
}

/// The report of a copying operation, as the CLI's `--json` summary.
fn report<'py>(
    py: Python<'py>,
    stats: &CopyStats,
    shape: (u64, u64),
    seconds: f64,
    output: PathBuf,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tensors", shape.0)?;
    d.set_item("pieces", stats.tensors)?;
    d.set_item("files", shape.1)?;
    d.set_item("bytes_written", stats.bytes_written)?;
    d.set_item("bytes_read", stats.bytes_read)?;
    d.set_item("checksums_verified", stats.checksums_verified)?;
    d.set_item("checksums_unchecked", stats.checksums_unchecked)?;
    d.set_item("seconds", seconds)?;
    d.set_item("output", output)?;
    Ok(d)
}

/// Runs a copying operation without the GIL; returns its stats, distinct tensor names
/// and files of the plan, and the seconds taken.
fn run_copy(
    py: Python<'_>,
    checksums: bool,
    run: impl FnOnce(
            &(dyn Fn(u64) + Sync),
            &dyn Fn(&Checkpoint, &CopyPlan),
        ) -> ckpt_core::Result<CopyStats>
        + Send,
) -> PyResult<(CopyStats, (u64, u64), f64)> {
    let shape = Mutex::new((0u64, 0u64));
    let t = Instant::now();
    let stats = py
        .detach(|| {
            // This call's setting, on this thread only: never the process's.
            ckpt_core::formats::checksum::with_checksums(checksums, || {
                run(&|_| {}, &|_, p: &CopyPlan| {
                    let names: std::collections::BTreeSet<&str> = p
                        .files
                        .iter()
                        .flat_map(|f| f.tensors.iter().map(|t| t.target.name.as_str()))
                        .collect();
                    if let Ok(mut s) = shape.lock() {
                        *s = (names.len() as u64, p.files.len() as u64);
                    }
                })
            })
        })
        .py_err(py)?;
    let shape = shape.into_inner().unwrap_or_default();
    Ok((stats, shape, t.elapsed().as_secs_f64()))
}

/// `ckpt merge`.
#[pyfunction]
#[pyo3(signature = (src, out, *, max_shard_size=None, dtype=None, include=vec![], exclude=vec![],
    strip_prefix=None, add_prefix=None, format="safetensors", one_file=false, force=false,
    compress=None, source_strategy=None, checksums=true, split_qkv=false,
    keep_vocab_padding=false, hf_config=None, hf_arch=None, tokenizer=None, lora=vec![],
    lora_alpha=None, quantize=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn merge<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    out: PathBuf,
    max_shard_size: Option<&Bound<'py, PyAny>>,
    dtype: Option<&str>,
    include: Vec<String>,
    exclude: Vec<String>,
    strip_prefix: Option<String>,
    add_prefix: Option<String>,
    format: &str,
    one_file: bool,
    force: bool,
    compress: Option<&str>,
    source_strategy: Option<&Bound<'py, PyAny>>,
    checksums: bool,
    split_qkv: bool,
    keep_vocab_padding: bool,
    hf_config: Option<PathBuf>,
    hf_arch: Option<String>,
    tokenizer: Option<PathBuf>,
    lora: Vec<PathBuf>,
    lora_alpha: Option<f64>,
    quantize: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let quantize_fp8 = match quantize {
        None => false,
        Some("fp8") => true,
        Some(q) => return Err(usage(py, format!("quantize `{q}`: fp8"))),
    };
    let inputs = Source::new(
        py,
        paths_of(src)?,
        source_strategy
            .map(paths_of)
            .transpose()?
            .unwrap_or_default(),
        None,
    )?
    .paths;
    let max_shard_size = match max_shard_size {
        None => None,
        Some(v) => Some(match v.extract::<u64>() {
            Ok(n) => n,
            Err(_) => {
                let s: String = v.extract()?;
                ckpt_merge::parse_size(&s)
                    .map_err(|e| usage(py, format!("max_shard_size `{s}`: {e}")))?
            }
        }),
    };
    let format = ckpt_merge::MergeFormat::from_name(format).ok_or_else(|| {
        let names = ckpt_merge::MergeFormat::NAMES.map(|(n, _)| n).join(", ");
        usage(py, format!("format `{format}`: {names}"))
    })?;
    // format="gguf": dtype names llama.cpp's type (f32, f16, bf16, q8_0).
    let gguf = format == ckpt_merge::MergeFormat::Gguf;
    let gguf_type = match dtype.filter(|_| gguf) {
        None => None,
        Some(d) => Some(
            ckpt_core::formats::gguf::GgmlType::from_name(d).ok_or_else(|| {
                usage(
                    py,
                    format!("dtype `{d}` with format=\"gguf\": f32, f16, bf16, q8_0"),
                )
            })?,
        ),
    };
    let dtype = dtype.filter(|d| !(gguf && d.eq_ignore_ascii_case("q8_0")));
    // A URL is written through a local staging directory, published at the end.
    let output = ckpt_core::output_at(&out, force).py_err(py)?;
    let req = ckpt_merge::MergeRequest {
        inputs,
        output: output.path().to_path_buf(),
        max_shard_size,
        // As `ckpt merge`: Megatron's fused QKV split on request, its vocabulary padding
        // dropped unless kept.
        selection: selection(py, include, exclude, dtype, strip_prefix, add_prefix)?.with_views(
            ckpt_core::layout::select::Views {
                split_qkv,
                unpad_vocab: !keep_vocab_padding,
                // A Hugging Face model has a tensor a layer.
                per_layer: format == ckpt_merge::MergeFormat::Hf || gguf,
                model_only: format == ckpt_merge::MergeFormat::Hf || gguf,
            },
        ),
        force,
        format,
        one_file,
        share: None,
        compression: compression_of(py, compress)?,
        hf: ckpt_core::checkpoint::HfTarget {
            config: hf_config,
            arch: hf_arch,
        },
        tokenizer,
        computations: ckpt_core::checkpoint::Computations {
            lora,
            lora_alpha,
            quantize_fp8,
        },
        orbax_item: None,
        gguf_type,
    };
    if format != ckpt_merge::MergeFormat::Hf
        && !gguf
        && (req.hf.config.is_some() || req.hf.arch.is_some() || req.tokenizer.is_some())
    {
        return Err(usage(
            py,
            "hf_config, hf_arch and tokenizer go with format=\"hf\" or \"gguf\"",
        ));
    }
    let (stats, shape, secs) = run_copy(py, checksums, |p, on_plan| {
        let stats = ckpt_merge::merge(&req, p, on_plan)?;
        output.publish()?;
        Ok(stats)
    })?;
    report(py, &stats, shape, secs, out)
}

/// `ckpt reshard`.
#[pyfunction]
#[pyo3(signature = (src, out, *, to=None, mesh=None, strategy=None, rank=None, format="ckpt",
    compress=None, dtype=None, include=vec![], exclude=vec![], strip_prefix=None, add_prefix=None,
    keep_all=false, shard=vec![], force=false, source_strategy=None, checksums=true, lora=vec![],
    lora_alpha=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn reshard<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    out: PathBuf,
    to: Option<u64>,
    mesh: Option<&str>,
    strategy: Option<PathBuf>,
    rank: Option<u64>,
    format: &str,
    compress: Option<&str>,
    dtype: Option<&str>,
    include: Vec<String>,
    exclude: Vec<String>,
    strip_prefix: Option<String>,
    add_prefix: Option<String>,
    keep_all: bool,
    shard: Vec<(String, usize)>,
    force: bool,
    source_strategy: Option<&Bound<'py, PyAny>>,
    checksums: bool,
    lora: Vec<PathBuf>,
    lora_alpha: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let Some(target) = target_of(py, to, mesh, strategy)? else {
        return Err(usage(py, "give to=, mesh= or strategy="));
    };
    let inputs = Source::new(
        py,
        paths_of(src)?,
        source_strategy
            .map(paths_of)
            .transpose()?
            .unwrap_or_default(),
        None,
    )?
    .paths;
    let format = ckpt_reshard::OutputFormat::from_name(format).ok_or_else(|| {
        let names = ckpt_reshard::OutputFormat::NAMES.map(|(n, _)| n).join(", ");
        usage(py, format!("format `{format}`: {names}"))
    })?;
    let output = ckpt_core::output_at(&out, force).py_err(py)?;
    let req = ckpt_reshard::ReshardRequest {
        inputs,
        output: output.path().to_path_buf(),
        target,
        ranks: rank.map_or(ckpt_reshard::Ranks::All, ckpt_reshard::Ranks::One),
        selection: selection(py, include, exclude, dtype, strip_prefix, add_prefix)?,
        // MindSpore loads each rank's parameters from that rank's file alone.
        keep_all: keep_all || format == ckpt_reshard::OutputFormat::MindSpore,
        force,
        format,
        shard,
        compression: compression_of(py, compress)?,
        computations: ckpt_core::checkpoint::Computations {
            lora,
            lora_alpha,
            quantize_fp8: false,
        },
        orbax_item: None,
        maxtext_unscanned: false,
    };
    if format == ckpt_reshard::OutputFormat::DeepSpeed {
        // DeepSpeed's optimizer files are re-cut by their writer, not planned as copies.
        let t = Instant::now();
        let s = py
            .detach(|| {
                ckpt_core::formats::checksum::with_checksums(checksums, || {
                    let s = ckpt_reshard::reshard_deepspeed(&req)?;
                    output.publish()?;
                    Ok(s)
                })
            })
            .py_err(py)?;
        let d = PyDict::new(py);
        d.set_item("tensors", s.tensors)?;
        d.set_item("pieces", s.tensors)?;
        d.set_item("files", s.files)?;
        d.set_item("bytes_written", s.bytes)?;
        // Each partition's bytes are read once from the source, as they are written.
        d.set_item("bytes_read", s.bytes)?;
        d.set_item("checksums_verified", 0)?;
        d.set_item("checksums_unchecked", 0)?;
        d.set_item("seconds", t.elapsed().as_secs_f64())?;
        d.set_item("output", out)?;
        return Ok(d);
    }
    let (stats, shape, secs) = run_copy(py, checksums, |p, on_plan| {
        let stats = ckpt_reshard::reshard(&req, p, on_plan)?;
        output.publish()?;
        Ok(stats)
    })?;
    report(py, &stats, shape, secs, out)
}

/// `ckpt verify`: the problems found (empty when the checkpoint is sound), with the
/// counts of files and tensors and the notes.
#[pyfunction]
#[pyo3(signature = (src, *, deep=false, checksums=true, source_strategy=None, strip_prefix=None))]
pub(crate) fn verify<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    deep: bool,
    checksums: bool,
    source_strategy: Option<&Bound<'py, PyAny>>,
    strip_prefix: Option<String>,
) -> PyResult<Bound<'py, PyDict>> {
    let s = Source::new(
        py,
        paths_of(src)?,
        source_strategy
            .map(paths_of)
            .transpose()?
            .unwrap_or_default(),
        strip_prefix,
    )?;
    let depth = ckpt_core::engine::verify::VerifyDepth { checksums, deep };
    let t = Instant::now();
    let (ck, problems) = py
        .detach(|| {
            ckpt_core::formats::checksum::with_checksums(checksums, || {
                ckpt_core::engine::verify::verify_selected(&s.paths, &s.selection, depth)
            })
        })
        .py_err(py)?;
    let d = PyDict::new(py);
    d.set_item("files", ck.files.len())?;
    d.set_item("tensors", ck.tensors.len())?;
    let recorded = ck.recorded_checksums();
    d.set_item("checksums", if checksums { recorded } else { 0 })?;
    d.set_item("notes", ck.notes.clone())?;
    d.set_item("seconds", t.elapsed().as_secs_f64())?;
    // The problems, and the exception the first one maps to (raised by the caller).
    let errs: Vec<PyErr> = problems
        .into_iter()
        .map(|e| crate::errors::to_py(py, e))
        .collect();
    let objs: Vec<Bound<'py, PyAny>> = errs
        .into_iter()
        .map(|e| e.into_value(py).into_bound(py).into_any())
        .collect();
    d.set_item("problems", objs)?;
    Ok(d)
}

/// `ckpt inspect`'s text (or its `--json` document, as JSON text), in-process: what the
/// command prints for these inputs.
#[pyfunction]
#[pyo3(signature = (src, *, source_strategy=None, strip_prefix=None, json=false))]
pub(crate) fn inspect<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    source_strategy: Option<&Bound<'py, PyAny>>,
    strip_prefix: Option<String>,
    json: bool,
) -> PyResult<String> {
    let s = Source::new(
        py,
        paths_of(src)?,
        source_strategy
            .map(paths_of)
            .transpose()?
            .unwrap_or_default(),
        strip_prefix,
    )?;
    py.detach(|| -> ckpt_core::Result<String> {
        let (ck, problems) = ckpt_core::engine::verify::verify_selected(
            &s.paths,
            &s.selection,
            ckpt_core::engine::verify::VerifyDepth::default(),
        )?;
        Ok(if json {
            let doc = ckpt_core::present::inspect_json(&ck, &problems);
            serde_json::to_string_pretty(&doc).map_err(|e| ckpt_core::Error::Unsupported {
                problem: format!("inspect: {e}"),
            })?
        } else {
            ckpt_core::present::inspect_text(&ck, &problems)
        })
    })
    .py_err(py)
}

/// `ckpt compress` (`level` given) or `ckpt decompress` (`level` None).
#[pyfunction]
#[pyo3(signature = (src, out, *, compress, level=ckpt_core::formats::ckptz::DEFAULT_LEVEL, chunk_bytes=None, force=false))]
pub(crate) fn convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    out: PathBuf,
    compress: bool,
    level: i32,
    chunk_bytes: Option<u64>,
    force: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let how = if compress {
        if !(1..=22).contains(&level) {
            return Err(usage(py, format!("level {level}: zstd levels are 1 to 22")));
        }
        ckpt_core::engine::convert::Conversion::Compress(Compression {
            level,
            chunk_bytes: chunk_bytes.unwrap_or(ckpt_core::formats::ckptz::DEFAULT_CHUNK_BYTES),
        })
    } else {
        ckpt_core::engine::convert::Conversion::Decompress
    };
    let t = Instant::now();
    let s = py
        .detach(|| ckpt_core::engine::convert::convert(&src, &out, how, force))
        .py_err(py)?;
    let d = PyDict::new(py);
    d.set_item("files", s.files)?;
    d.set_item("copied", s.copied)?;
    d.set_item("raw_bytes", s.raw_bytes)?;
    d.set_item("bytes_read", s.bytes_in)?;
    d.set_item("bytes_written", s.bytes_out)?;
    d.set_item("seconds", t.elapsed().as_secs_f64())?;
    d.set_item("output", out)?;
    Ok(d)
}

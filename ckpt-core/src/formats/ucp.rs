//! DeepSpeed's universal checkpoint (UCP), the tree `deepspeed/checkpoint/ds_to_universal.py`
//! writes from a ZeRO checkpoint and `engine.load_checkpoint` reads with
//! `"checkpoint": {"load_universal": true}` on any data-parallel size: one directory per
//! parameter under `zero/`, each state of it whole in its own `torch.save` file. The
//! layout, read from DeepSpeed 0.19.8's source, is in docs/formats.md ("DeepSpeed
//! universal checkpoint").
//!
//! A tag directory `<tag>/` (named by `latest_universal` beside it) holds
//! - `zero/<param>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`: ZeRO-1/2 write the dict
//!   `{'cat_dim': 0, 'param': tensor}` (the tensor in its own shape); ZeRO-3 writes the
//!   bare tensor, flat (`numel` elements, the shape is in the copied model states'
//!   `param_shapes`);
//! - `zero/<param>/step.pt` (ZeRO-1/2, when the optimizer keeps a step): the bare step
//!   of the parameter's group;
//! - `zero/<name>/fp32.pt` for every other entry of the module's state dict (ZeRO-1/2:
//!   frozen parameters, buffers, tied names): `{'param': tensor.float()}`;
//! - `zero/optimizer_state.pt`: rank 0's `optimizer_state_dict` without its sharded
//!   parts (ZeRO-1/2) or whole (ZeRO-3), with `param_groups` added;
//! - the source's model-states files, copied byte for byte.
//!
//! Reading: every `zero/<param>/<state>.pt` is one whole tensor, `<param>` (fp32) and
//! `optim.<param>.exp_avg[_sq]`, as ckpt names the moments it reads from ZeRO.
//! Writing (`ckpt merge --format ucp`): the tensors go through the copy engine
//! (`crate::write::ucp`); this module writes the rest ([`write_extras`]).

use super::deepspeed::{dict_items, int, list, shapes_of, DeepSpeed, PtFile};
use super::output::{commit_staged_file, create_staged_file, discard_staged_file};
use super::pickle::{Emitter, Value};
use super::torch_save::{describe, is_tensor};
use super::torch_write::{TorchWriter, Wrap};
use super::{FileFormat, TensorFile};
use crate::error::{overflow, Error, IoContext, Result};
use crate::formats::writer::TensorSpec;
use crate::layout::flat::numel;
use crate::layout::Dtype;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The file beside the tag directories naming the universal one `load_checkpoint`
/// loads when `load_universal` is set (DeepSpeed writes `latest` for ZeRO tags).
pub(crate) const LATEST_UNIVERSAL: &str = "latest_universal";
/// The directory of the per-parameter states.
pub(crate) const ZERO_DIR: &str = "zero";
/// The optimizer's global state (hyperparameters, loss scaler, ZeRO's bookkeeping).
pub(crate) const OPTIMIZER_STATE: &str = "optimizer_state.pt";
/// The per-parameter states, in the names of their files; index 0 is the fp32 weight.
pub(crate) const STATES: [&str; 3] = ["fp32", "exp_avg", "exp_avg_sq"];
/// The prefix of optimizer state names (the checkpoint layer's `OPTIMIZER_PREFIX`,
/// as in formats/deepspeed.rs).
const OPTIM_PREFIX: &str = "optim.";

fn err(path: &Path, problem: impl Into<String>) -> Error {
    Error::InvalidUcp {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// ckpt's name of state `k` of `param`.
pub(crate) fn state_name(param: &str, k: usize) -> String {
    if k == 0 {
        param.to_string()
    } else {
        format!("{OPTIM_PREFIX}{param}.{}", STATES[k])
    }
}

/// The file of state `k` of `param`, relative to the tag directory. Parameter names
/// become directory names: one that would leave `zero/` is refused.
///
/// # Errors
/// [`Error::InvalidUcp`]: an empty name, or one with a path separator or `..`.
pub(crate) fn state_file(param: &str, k: usize) -> Result<PathBuf> {
    if param.is_empty() || param.contains(['/', '\\', '\0']) || param == "." || param == ".." {
        return Err(err(
            Path::new(ZERO_DIR),
            format!("tensor `{param}`: its name cannot be a directory name of the universal tree"),
        ));
    }
    Ok(Path::new(ZERO_DIR)
        .join(param)
        .join(format!("{}.pt", STATES[k])))
}

/// Whether `dir` is a universal checkpoint's tag directory: `zero/` with the optimizer
/// state or a parameter's `fp32.pt`.
pub(crate) fn looks_like(dir: &Path) -> bool {
    let zero = dir.join(ZERO_DIR);
    if !zero.is_dir() {
        return false;
    }
    if zero.join(OPTIMIZER_STATE).is_file() {
        return true;
    }
    std::fs::read_dir(&zero).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| e.path().join(format!("{}.pt", STATES[0])).is_file())
    })
}

/// The model-states file a universal tree copied from its source (ZeRO-1/2:
/// `mp_rank_00_model_states.pt`, ZeRO-3: `zero_pp_rank_0_mp_rank_00_model_states.pt`).
fn model_states(dir: &Path) -> Option<PathBuf> {
    [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
    ]
    .iter()
    .map(|n| dir.join(n))
    .find(|p| p.is_file())
}

/// `param_shapes` of a model-states file, in group order: `(group, name, shape)`.
fn param_shapes(m: &PtFile) -> Result<Vec<(usize, String, Vec<u64>)>> {
    let v = m.at(&["param_shapes"])?;
    let mut out = Vec::new();
    for (g, group) in list(m, v, "param_shapes")?.iter().enumerate() {
        for (name, shape) in shapes_of(m, group, "param_shapes")? {
            out.push((g, name, shape));
        }
    }
    Ok(out)
}

/// Reads a universal checkpoint's tag directory: one file per parameter state, each a
/// whole tensor.
///
/// # Errors
/// [`Error::InvalidUcp`] naming the file (and tensor): a parameter without `fp32.pt`,
/// a file that holds neither a tensor nor a dict with `param`, a flat tensor whose
/// element count is not its parameter's; damaged `.pt` files.
pub(crate) fn read(dir: &Path) -> Result<DeepSpeed> {
    let zero = dir.join(ZERO_DIR);
    let mut out = DeepSpeed {
        files: vec![],
        shapes: BTreeMap::new(),
        aliases: vec![],
        notes: vec![],
    };
    // ZeRO-3 stores flat tensors: their shapes are the model states'.
    let declared: BTreeMap<String, Vec<u64>> = match model_states(dir) {
        Some(p) => param_shapes(&PtFile::open(&p)?)?
            .into_iter()
            .map(|(_, n, s)| (n, s))
            .collect(),
        None => BTreeMap::new(),
    };
    let mut params: Vec<PathBuf> = std::fs::read_dir(&zero)
        .at(&zero)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    params.sort();
    if params.is_empty() {
        return Err(err(&zero, "no parameter directories"));
    }
    let mut steps = 0usize;
    for p in params {
        let Some(param) = p.file_name().and_then(|n| n.to_str()).map(String::from) else {
            return Err(err(&p, "a parameter directory whose name is not UTF-8"));
        };
        for (k, state) in STATES.iter().enumerate() {
            let path = p.join(format!("{state}.pt"));
            if !path.is_file() {
                if k == 0 {
                    return Err(err(
                        &path,
                        format!("tensor `{param}`: missing (every parameter directory holds its fp32 weight)"),
                    ));
                }
                continue;
            }
            let name = state_name(&param, k);
            out.files.push(read_state(
                &path,
                &name,
                declared.get(&param),
                &mut out.shapes,
            )?);
        }
        steps += usize::from(p.join("step.pt").is_file());
    }
    if steps > 0 {
        out.notes.push(format!(
            "{}: the optimizer's step ({steps} step.pt) and zero/{OPTIMIZER_STATE} (hyperparameters, loss scaler) are not carried",
            dir.display()
        ));
    }
    Ok(out)
}

/// One state file: the tensor under `param` of its dict, or the bare tensor.
fn read_state(
    path: &Path,
    name: &str,
    declared: Option<&Vec<u64>>,
    shapes: &mut BTreeMap<String, (Dtype, Vec<u64>)>,
) -> Result<TensorFile> {
    let f = PtFile::open(path)?;
    let v = match f.root.get("param") {
        Some(v) => v,
        None if is_tensor(&f.root) => &f.root,
        None => {
            return Err(err(
                path,
                format!(
                    "tensor `{name}`: the file holds {}, neither a tensor nor a dict with `param`",
                    describe(&f.root)
                ),
            ))
        }
    };
    let mut entry = f.tensor(v, name)?;
    let n = numel(&entry.shape)?;
    if let Some(s) = declared {
        let want = numel(s)?;
        if want == n {
            // Same elements in row-major order: the flat tensor is the shaped one.
            entry.shape = s.clone();
        } else if entry.shape.len() == 1 {
            return Err(err(
                path,
                format!("tensor `{name}`: {n} elements, but the model states' param_shapes say {s:?} ({want})"),
            ));
        }
    }
    entry.name = name.to_string();
    entry.offsets = None;
    shapes.insert(name.to_string(), (entry.dtype, entry.shape.clone()));
    let metadata = BTreeMap::from([("format".to_string(), "ucp".to_string())]);
    TensorFile::from_parts(path, f.map, FileFormat::Ucp, vec![entry], metadata)
}

/// The trainable parameters of a ZeRO tag directory: `(group, name, shape)` from its
/// model states' `param_shapes` (ZeRO-3: rank 0's).
///
/// # Errors
/// The model states are missing or have no `param_shapes`.
pub(crate) fn zero_params(tag: &Path, stage: u64) -> Result<Vec<(usize, String, Vec<u64>)>> {
    let name = if stage == 3 {
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    } else {
        "mp_rank_00_model_states.pt"
    };
    param_shapes(&PtFile::open(&tag.join(name))?)
}

/// Rank 0's optimizer states file of a ZeRO tag directory (plain or `bf16_`).
fn rank0_optim(tag: &Path) -> Result<PathBuf> {
    ["", "bf16_"]
        .iter()
        .map(|p| tag.join(format!("{p}zero_pp_rank_0_mp_rank_00_optim_states.pt")))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            err(
                &tag.join("zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                "missing (rank 0's optimizer states give the universal checkpoint's optimizer_state.pt)",
            )
        })
}

/// Writes what a universal tree holds beside the tensors the engine copied, from the
/// ZeRO tag directory `tag` (stage `stage`) into the tag directory `out`:
/// `zero/optimizer_state.pt`, the `step.pt` of the parameters in `params` (ZeRO-1/2),
/// `fp32.pt` of the module's other entries that `keep` keeps (ZeRO-1/2, as
/// `ds_to_universal` writes them: widened to fp32), and the model-states files.
/// Returns notes on what was left out.
///
/// # Errors
/// Missing or damaged source files; values the writer cannot carry (raw bytes in the
/// optimizer state); I/O errors.
pub(crate) fn write_extras(
    tag: &Path,
    stage: u64,
    out: &Path,
    params: &BTreeSet<String>,
    keep: &dyn Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    std::fs::create_dir_all(out.join(ZERO_DIR)).at(&out.join(ZERO_DIR))?;
    let optim = PtFile::open(&rank0_optim(tag)?)?;
    let osd = optim.at(&["optimizer_state_dict"])?;
    let kv = dict_items(osd).ok_or_else(|| {
        err(
            &optim.path,
            format!("`optimizer_state_dict` is {}, not a dict", describe(osd)),
        )
    })?;
    // ds_to_universal: ZeRO-1/2 drop the sharded entries and lift the torch
    // optimizer's param_groups; ZeRO-3 keep everything and add param_groups.
    let (sharded, groups_at): (&[&str], [&str; 2]) = if stage == 3 {
        (&[], ["optimizer_state_dict", "param_groups"])
    } else {
        (
            &[
                "base_optimizer_state",
                "param_slice_mappings",
                "single_partition_of_fp32_groups",
            ],
            ["base_optimizer_state", "param_groups"],
        )
    };
    let groups = osd
        .get(groups_at[0])
        .and_then(|b| b.get(groups_at[1]))
        .cloned()
        .ok_or_else(|| {
            err(
                &optim.path,
                format!(
                    "no `optimizer_state_dict.{}.{}`",
                    groups_at[0], groups_at[1]
                ),
            )
        })?;
    let mut items: Vec<(Value, Value)> = kv
        .iter()
        .filter(|(k, _)| !matches!(k, Value::Str(s) if sharded.contains(&s.as_str())))
        .cloned()
        .collect();
    let pg = Value::Str("param_groups".into());
    match items.iter_mut().find(|(k, _)| *k == pg) {
        Some((_, v)) => *v = groups,
        None => items.push((pg, groups)),
    }
    write_value(
        &optim,
        &Value::Dict(items),
        &out.join(ZERO_DIR).join(OPTIMIZER_STATE),
    )?;
    if stage <= 2 {
        write_steps(tag, &optim, out, params)?;
        notes.extend(write_module_rest(tag, out, params, keep)?);
    }
    drop(optim);
    // The model states, as they are (DeepSpeed loads the module and its bookkeeping
    // from them).
    let mut copied = 0;
    for e in std::fs::read_dir(tag).at(tag)?.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str() else { continue };
        let wanted = if stage == 3 {
            n.starts_with("zero_pp_rank_") && n.ends_with("_model_states.pt")
        } else {
            n.starts_with("mp_rank_") && n.ends_with("_model_states.pt")
        };
        if wanted {
            copy_file(&e.path(), &out.join(n))?;
            copied += 1;
        }
    }
    if copied == 0 {
        return Err(err(tag, "no model-states file to copy"));
    }
    Ok(notes)
}

/// Copies `src` to `dest` through a staged file (complete or absent).
fn copy_file(src: &Path, dest: &Path) -> Result<()> {
    let (tmp, mut file) = create_staged_file(dest)?;
    let r = (|| -> Result<()> {
        let mut from = crate::formats::open_handle(src)?;
        std::io::copy(&mut from, &mut file).at(dest)?;
        commit_staged_file(&file, &tmp, dest)
    })();
    if r.is_err() {
        discard_staged_file(&tmp);
    }
    r
}

/// ZeRO-1/2: each parameter's `step.pt`, its group's step in the torch optimizer's
/// state (`base_optimizer_state.state[g].step`), when there is one.
fn write_steps(tag: &Path, optim: &PtFile, out: &Path, params: &BTreeSet<String>) -> Result<()> {
    let state = optim.opt_at(&["optimizer_state_dict", "base_optimizer_state", "state"]);
    for (g, name, _) in zero_params(tag, 2)? {
        if !params.contains(&name) {
            continue;
        }
        let step = state.and_then(dict_items).and_then(|kv| {
            kv.iter()
                .find(|(k, _)| int(k) == Some(g as u64))
                .and_then(|(_, s)| s.get("step"))
        });
        if let Some(step) = step {
            let dest = out.join(ZERO_DIR).join(&name).join("step.pt");
            std::fs::create_dir_all(out.join(ZERO_DIR).join(&name))
                .at(&out.join(ZERO_DIR).join(&name))?;
            write_value(optim, step, &dest)?;
        }
    }
    Ok(())
}

/// ZeRO-1/2: `{'param': t.float()}` for each entry `t` of the module's state dict that
/// has no fp32 weight of its own (frozen parameters, buffers, tied names), as
/// ds_to_universal writes them.
fn write_module_rest(
    tag: &Path,
    out: &Path,
    params: &BTreeSet<String>,
    keep: &dyn Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    let mut done = 0;
    for e in std::fs::read_dir(tag).at(tag)?.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if !(n.starts_with("mp_rank_") && n.ends_with("_model_states.pt")) {
            continue;
        }
        let m = PtFile::open(&e.path())?;
        let Some(module) = m.opt_at(&["module"]).and_then(dict_items) else {
            continue;
        };
        // Read, not through the mapping: the copy stays in a small buffer however
        // large the tensor.
        let file = crate::formats::open_handle(&m.path)?;
        for (k, v) in module {
            let Value::Str(name) = k else { continue };
            if params.contains(name) || !keep(name) {
                continue;
            }
            let dest = out.join(state_file(name, 0)?);
            if dest.exists() {
                continue;
            }
            let t = m.tensor(v, name)?;
            let shape = t.shape.clone();
            let n = numel(&shape)?;
            let esize = (t.dtype.bitsize() / 8) as u64;
            let supported = matches!(
                t.dtype,
                Dtype::F32
                    | Dtype::F16
                    | Dtype::BF16
                    | Dtype::F64
                    | Dtype::I64
                    | Dtype::I32
                    | Dtype::I16
                    | Dtype::I8
                    | Dtype::U8
                    | Dtype::BOOL
            );
            if !supported || t.dtype.bitsize() % 8 != 0 {
                notes.push(format!(
                    "`{name}` ({}) is not written: no conversion to fp32",
                    crate::layout::strategy::dtype_name(t.dtype)
                ));
                continue;
            }
            if let Some(d) = dest.parent() {
                std::fs::create_dir_all(d).at(d)?;
            }
            let spec = TensorSpec {
                name: "param".into(),
                dtype: Dtype::F32,
                shape,
            };
            let w = TorchWriter::create_wrapped(&dest, &[spec], false, None::<&Wrap>)?;
            // In slabs: a frozen embedding can be large.
            const SLAB: u64 = 1 << 20;
            let (mut src, mut buf) = (Vec::new(), Vec::new());
            let mut at = 0u64;
            while at < n {
                let len = SLAB.min(n - at);
                let from = at
                    .checked_mul(esize)
                    .and_then(|x| x.checked_add(t.start))
                    .ok_or_else(|| overflow(name.as_str()))?;
                src.resize((len * esize) as usize, 0);
                file.read_exact_at(&mut src, from).at(&m.path)?;
                buf.clear();
                to_f32(&src, t.dtype, &mut buf);
                w.write_at(0, at * 4, &buf)?;
                at += len;
            }
            w.finish()?;
            done += 1;
        }
    }
    if done > 0 {
        notes.push(format!(
            "{done} module entr(ies) without fp32 master weights (frozen parameters, buffers, tied names) written as fp32, as ds_to_universal does"
        ));
    }
    Ok(notes)
}

/// Little-endian elements of `dtype` widened to f32, appended to `out`.
fn to_f32(src: &[u8], dtype: Dtype, out: &mut Vec<u8>) {
    use half::{bf16, f16};
    let w = dtype.bitsize() / 8;
    for c in src.chunks_exact(w) {
        let v: f32 = match dtype {
            Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            Dtype::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            Dtype::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            Dtype::F64 => f64::from_le_bytes(c.try_into().unwrap_or_default()) as f32,
            Dtype::I64 => i64::from_le_bytes(c.try_into().unwrap_or_default()) as f32,
            Dtype::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32,
            Dtype::I16 => f32::from(i16::from_le_bytes([c[0], c[1]])),
            Dtype::I8 => f32::from(c[0] as i8),
            _ => f32::from(c[0]),
        };
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Emits `v` as the pickle torch.load reads back, noting each storage it references
/// (a tensor's persistent id `('storage', class, key, location, numel)`).
fn emit(e: &mut Emitter, v: &Value, keys: &mut Vec<String>) -> std::result::Result<(), String> {
    match v {
        Value::Tuple(items) => {
            e.mark();
            for i in items {
                emit(e, i, keys)?;
            }
            e.tuple();
        }
        Value::List(items) => {
            e.empty_list().mark();
            for i in items {
                emit(e, i, keys)?;
            }
            e.appends();
        }
        Value::Dict(kv) => {
            e.empty_dict().mark();
            for (k, x) in kv {
                emit(e, k, keys)?;
                emit(e, x, keys)?;
            }
            e.set_items();
        }
        Value::Call { callable, args } => {
            emit(e, callable, keys)?;
            emit(e, args, keys)?;
            e.reduce();
        }
        Value::Build { object, state } => {
            emit(e, object, keys)?;
            emit(e, state, keys)?;
            e.build();
        }
        Value::PersistentId(id) => {
            match id.items().and_then(|i| i.get(2)) {
                Some(Value::Str(k)) => {
                    if !keys.contains(k) {
                        keys.push(k.clone());
                    }
                }
                _ => {
                    return Err(format!(
                        "a persistent id that is not a storage: {}",
                        describe(id)
                    ))
                }
            }
            emit(e, id, keys)?;
            e.persistent_id();
        }
        other => {
            e.value(other)?;
        }
    }
    Ok(())
}

/// Writes `v` (a value of the file `src`) as a `torch.save` archive at `dest`, with
/// the storages it references copied from `src`.
fn write_value(src: &PtFile, v: &Value, dest: &Path) -> Result<()> {
    let mut e = Emitter::new();
    let mut keys = Vec::new();
    emit(&mut e, v, &mut keys).map_err(|p| {
        err(
            &src.path,
            format!("{p}: not carried into {}", dest.display()),
        )
    })?;
    let pkl = e.finish();
    let file_len = src.map.as_ref().map_or(0, |m| m.len() as u64);
    let mut storages = Vec::with_capacity(keys.len());
    for k in keys {
        let (start, len) = src.archive.storage(&k).ok_or_else(|| {
            err(
                &src.path,
                format!("storage `{k}` is not in the archive (or compressed)"),
            )
        })?;
        if start.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(err(
                &src.path,
                format!("storage `{k}` lies outside the file"),
            ));
        }
        storages.push((k, start, len));
    }
    write_archive(dest, &pkl, &src.path, &storages)
}

/// A `torch.save` archive (stored zip entries, data aligned to 64 bytes as torch
/// aligns them) of `pkl` and `storages` (`(key, start, len)` in the file `from`),
/// written to a staged file and committed.
fn write_archive(
    dest: &Path,
    pkl: &[u8],
    from: &Path,
    storages: &[(String, u64, u64)],
) -> Result<()> {
    use zip::write::SimpleFileOptions;
    let (tmp, file) = create_staged_file(dest)?;
    let r = (|| -> Result<()> {
        let zerr = |e: zip::result::ZipError| Error::Io {
            path: dest.to_path_buf(),
            source: std::io::Error::other(e),
        };
        let mut z = zip::ZipWriter::new(std::io::BufWriter::new(file.try_clone().at(&tmp)?));
        let opts = |len: u64| {
            SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Stored)
                .large_file(len >= u64::from(u32::MAX))
                .with_alignment(64)
        };
        let put = |z: &mut zip::ZipWriter<_>, name: &str, bytes: &[u8]| -> Result<()> {
            z.start_file(format!("archive/{name}"), opts(bytes.len() as u64))
                .map_err(zerr)?;
            z.write_all(bytes).at(dest)
        };
        put(&mut z, "data.pkl", pkl)?;
        put(&mut z, "byteorder", b"little")?;
        // Copied by reads, not through the mapping: memory stays bounded.
        let mut src = crate::formats::open_handle(from)?;
        for (k, start, len) in storages {
            z.start_file(format!("archive/data/{k}"), opts(*len))
                .map_err(zerr)?;
            src.seek(SeekFrom::Start(*start)).at(from)?;
            let copied = std::io::copy(&mut (&mut src).take(*len), &mut z).at(dest)?;
            if copied != *len {
                return Err(err(from, format!("storage `{k}`: the file ends early")));
            }
        }
        put(&mut z, "version", b"3\n")?;
        let mut w = z.finish().map_err(zerr)?;
        w.flush().at(dest)?;
        drop(w);
        commit_staged_file(&file, &tmp, dest)
    })();
    if r.is_err() {
        discard_staged_file(&tmp);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_are_named_as_ckpt_names_zero_moments() {
        assert_eq!(state_name("fc1.weight", 0), "fc1.weight");
        assert_eq!(state_name("fc1.weight", 1), "optim.fc1.weight.exp_avg");
        assert_eq!(state_name("fc1.weight", 2), "optim.fc1.weight.exp_avg_sq");
    }

    #[test]
    fn parameter_names_stay_inside_zero() {
        assert_eq!(
            state_file("a.b", 1).unwrap(),
            Path::new("zero/a.b/exp_avg.pt")
        );
        for bad in ["", "..", "a/b", "../x"] {
            assert!(
                matches!(state_file(bad, 0), Err(Error::InvalidUcp { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn widening_to_f32() {
        let mut out = Vec::new();
        to_f32(&(-3i64).to_le_bytes(), Dtype::I64, &mut out);
        to_f32(
            &half::bf16::from_f32(1.5).to_le_bytes(),
            Dtype::BF16,
            &mut out,
        );
        let got: Vec<f32> = out
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, vec![-3.0, 1.5]);
    }
}

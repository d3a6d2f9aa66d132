//! MindSpore strategy files, both forms MindSpore writes: protobuf
//! (`ParallelStrategyMap` of `mindspore/ccsrc/utils/node_strategy.proto`, usually named
//! `*.ckpt`) and JSON (the same fields; `strategy_ckpt_config` with a `.json` name).
//! Each parameter's `ParallelLayouts` becomes a [`MindSporeLayout`]; the pipeline stage
//! comes from the file (`parallel_strategy_item[0].parallel_strategys.stage`, as
//! MindSpore's own merge takes it) or from a `<stage>-` prefix that
//! `merge_pipeline_strategys` puts on parameter names.

use crate::error::{Error, Result};
use crate::layout::mindspore::{MapEntry, MindSporeLayout};
use crate::layout::source::PieceSource;
use prost::Message;
use std::collections::BTreeMap;
use std::path::Path;

/// One parameter of a MindSpore strategy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MindSporeParam {
    /// Its layout within its stage.
    pub layout: MindSporeLayout,
    /// Its pipeline stage (0 without pipeline parallelism).
    pub stage: u64,
}

#[derive(Clone, PartialEq, Message)]
struct ParallelStrategyMap {
    #[prost(uint32, optional, tag = "1")]
    current_stage: Option<u32>,
    #[prost(message, repeated, tag = "2")]
    parallel_strategy_item: Vec<ParallelStrategyItem>,
    #[prost(message, repeated, tag = "3")]
    parallel_layout_item: Vec<ParallelLayoutItem>,
}

#[derive(Clone, PartialEq, Message)]
struct ParallelStrategyItem {
    #[prost(string, optional, tag = "1")]
    node_name: Option<String>,
    #[prost(message, optional, tag = "2")]
    parallel_strategys: Option<ParallelStrategys>,
}

#[derive(Clone, PartialEq, Message)]
struct ParallelStrategys {
    #[prost(uint32, optional, tag = "1")]
    stage: Option<u32>,
}

#[derive(Clone, PartialEq, Message)]
struct ParallelLayoutItem {
    #[prost(string, optional, tag = "1")]
    param_name: Option<String>,
    #[prost(message, optional, tag = "2")]
    parallel_layouts: Option<ParallelLayouts>,
}

#[derive(Clone, PartialEq, Message)]
struct Dims32 {
    #[prost(uint32, repeated, tag = "1")]
    dim: Vec<u32>,
}

#[derive(Clone, PartialEq, Message)]
struct SignedDims32 {
    #[prost(int32, repeated, tag = "1")]
    dim: Vec<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct Dims64 {
    #[prost(int64, repeated, tag = "1")]
    dim: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
struct ParallelLayouts {
    #[prost(message, repeated, tag = "1")]
    dev_matrix: Vec<Dims32>,
    #[prost(message, repeated, tag = "2")]
    tensor_map: Vec<SignedDims32>,
    #[prost(message, repeated, tag = "3")]
    param_split_shape: Vec<Dims64>,
    #[prost(message, repeated, tag = "4")]
    indices_offset: Vec<Dims64>,
    #[prost(int32, optional, tag = "5")]
    field: Option<i32>,
    #[prost(int32, optional, tag = "6")]
    opt_weight_shard_step: Option<i32>,
    #[prost(int32, optional, tag = "7")]
    opt_weight_shard_size: Option<i32>,
}

fn bad(problem: String) -> Error {
    Error::InvalidStrategy { problem }
}

/// Whether `bytes` look like a MindSpore strategy file (protobuf or JSON).
#[must_use]
pub fn looks_like(bytes: &[u8]) -> bool {
    let text = bytes.trim_ascii_start();
    if text.starts_with(b"{") {
        return std::str::from_utf8(&bytes[..bytes.len().min(4096)]).is_ok_and(|t| {
            t.contains("\"parallel_layout_item\"") || t.contains("\"current_stage\"")
        });
    }
    // Protobuf: field 1 varint (current_stage) or field 2/3 length-delimited first.
    matches!(bytes.first(), Some(0x08 | 0x12 | 0x1a))
        && ParallelStrategyMap::decode(bytes).is_ok_and(|m| !m.parallel_layout_item.is_empty())
}

fn split_stage(name: &str, file_stage: u64) -> (String, u64) {
    match name.split_once('-') {
        Some((s, rest)) if s.chars().all(|c| c.is_ascii_digit()) && !s.is_empty() => {
            (rest.to_string(), s.parse().unwrap_or(file_stage))
        }
        _ => (name.to_string(), file_stage),
    }
}

fn to_u64s(v: &[i64], what: &str, name: &str) -> Result<Vec<u64>> {
    v.iter()
        .map(|&d| {
            u64::try_from(d)
                .map_err(|_| bad(format!("parameter `{name}`: negative {what} value {d}")))
        })
        .collect()
}

fn layout(
    name: &str,
    dev: Vec<u64>,
    map: Vec<MapEntry>,
    split_shape: &[i64],
    step: i64,
    size: i64,
) -> Result<MindSporeLayout> {
    if !split_shape.is_empty() {
        return Err(Error::Unsupported {
            problem: format!(
                "parameter `{name}`: param_split_shape (uneven slices from a sparse or embedding cache op) is not supported"
            ),
        });
    }
    if dev.is_empty() || dev.contains(&0) {
        return Err(bad(format!("parameter `{name}`: device matrix {dev:?}")));
    }
    Ok(MindSporeLayout {
        dev_matrix: dev,
        tensor_map: map,
        opt_shard_step: u64::try_from(step)
            .map_err(|_| bad(format!("parameter `{name}`: opt_weight_shard_step {step}")))?,
        opt_shard_size: u64::try_from(size)
            .map_err(|_| bad(format!("parameter `{name}`: opt_weight_shard_size {size}")))?,
    })
}

/// Parses one strategy file's bytes (protobuf or JSON).
///
/// # Errors
/// Malformed files, unsupported fields in use, a parameter described twice.
pub fn parse_mindspore_strategy(bytes: &[u8]) -> Result<BTreeMap<String, MindSporeParam>> {
    let mut out = BTreeMap::new();
    let mut add = |name: String, p: MindSporeParam| -> Result<()> {
        if out.insert(name.clone(), p).is_some() {
            return Err(bad(format!("parameter `{name}` is described twice")));
        }
        Ok(())
    };
    if bytes.trim_ascii_start().starts_with(b"{") {
        let doc: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| bad(format!("MindSpore JSON strategy is not JSON: {e}")))?;
        let file_stage = doc
            .get("parallel_strategy_item")
            .and_then(|s| s.as_object())
            .and_then(|s| s.values().next())
            .and_then(|v| v.get("stage"))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        let items = doc
            .get("parallel_layout_item")
            .and_then(|v| v.as_object())
            .ok_or_else(|| bad("no `parallel_layout_item` object".into()))?;
        for (raw, item) in items {
            let (name, stage) = split_stage(raw, file_stage);
            let ints = |key: &str| -> Result<Vec<i64>> {
                match item.get(key) {
                    None => Ok(vec![]),
                    Some(v) => v
                        .as_array()
                        .and_then(|a| a.iter().map(serde_json::Value::as_i64).collect())
                        .ok_or_else(|| {
                            bad(format!(
                                "parameter `{name}`: `{key}` must be a list of integers"
                            ))
                        }),
                }
            };
            let map = item
                .get("tensor_map")
                .and_then(|v| v.as_array())
                .ok_or_else(|| bad(format!("parameter `{name}`: no `tensor_map` list")))?
                .iter()
                .map(|e| match e {
                    serde_json::Value::Array(a) => a
                        .iter()
                        .map(serde_json::Value::as_i64)
                        .collect::<Option<Vec<i64>>>()
                        .map(MapEntry::Many),
                    v => v.as_i64().map(MapEntry::One),
                })
                .collect::<Option<Vec<MapEntry>>>()
                .ok_or_else(|| bad(format!("parameter `{name}`: `tensor_map` entries must be integers or lists of integers")))?;
            let num = |key: &str| {
                item.get(key)
                    .and_then(serde_json::Value::as_i64)
                    .unwrap_or(0)
            };
            let l = layout(
                &name,
                to_u64s(&ints("dev_matrix")?, "dev_matrix", &name)?,
                map,
                &ints("param_split_shape")?,
                num("opt_weight_shard_step"),
                num("opt_weight_shard_size"),
            )?;
            add(name, MindSporeParam { layout: l, stage })?;
        }
        return Ok(out);
    }
    let m = ParallelStrategyMap::decode(bytes).map_err(|e| {
        bad(format!(
            "not a MindSpore strategy (ParallelStrategyMap): {e}"
        ))
    })?;
    let file_stage = m
        .parallel_strategy_item
        .first()
        .and_then(|i| i.parallel_strategys.as_ref())
        .and_then(|s| s.stage)
        .map_or(0, u64::from);
    for item in &m.parallel_layout_item {
        let raw = item.param_name.clone().unwrap_or_default();
        let (name, stage) = split_stage(&raw, file_stage);
        let l = item
            .parallel_layouts
            .as_ref()
            .ok_or_else(|| bad(format!("parameter `{name}`: no parallel_layouts")))?;
        // One TensorMap per dimension list: several mean `(("dp", "mp"), ...)` layouts,
        // one entry per non-empty map (as MindSpore's `_convert_to_list` reads them).
        let map: Vec<MapEntry> = if l.tensor_map.len() > 1 {
            l.tensor_map
                .iter()
                .filter(|t| !t.dim.is_empty())
                .map(|t| match &t.dim[..] {
                    [k] => MapEntry::One(i64::from(*k)),
                    ks => MapEntry::Many(ks.iter().map(|&k| i64::from(k)).collect()),
                })
                .collect()
        } else {
            l.tensor_map
                .first()
                .map(|t| t.dim.iter().map(|&k| MapEntry::One(i64::from(k))).collect())
                .unwrap_or_default()
        };
        let dev: Vec<u64> = l
            .dev_matrix
            .first()
            .map(|d| d.dim.iter().map(|&x| u64::from(x)).collect())
            .unwrap_or_default();
        let split: Vec<i64> = l
            .param_split_shape
            .first()
            .map(|d| d.dim.clone())
            .unwrap_or_default();
        let ml = layout(
            &name,
            dev,
            map,
            &split,
            i64::from(l.opt_weight_shard_step.unwrap_or(0)),
            i64::from(l.opt_weight_shard_size.unwrap_or(0)),
        )?;
        add(name, MindSporeParam { layout: ml, stage })?;
    }
    Ok(out)
}

/// Reads and combines strategy files (one per pipeline stage, or one merged file).
///
/// # Errors
/// As [`parse_mindspore_strategy`], with the path; a parameter in two files.
pub fn read_mindspore_strategies(paths: &[&Path]) -> Result<BTreeMap<String, MindSporeParam>> {
    let mut all = BTreeMap::new();
    for p in paths {
        let bytes = super::read_small(p)?;
        for (name, param) in parse_mindspore_strategy(&bytes).map_err(|e| e.with_path(p))? {
            if let Some(old) = all.insert(name.clone(), param.clone()) {
                if old.stage == param.stage {
                    return Err(bad(format!(
                        "{}: parameter `{name}` is also described by another strategy file of stage {}",
                        p.display(),
                        param.stage
                    )));
                }
                // Shared across stages (pipeline_shared): the lowest stage owns it.
                if old.stage < param.stage {
                    all.insert(name, old);
                }
            }
        }
    }
    Ok(all)
}

/// A MindSpore predict strategy as a ckpt [`Strategy`](crate::layout::strategy::Strategy) for the tensors
/// of `source` (which give the global shapes and dtypes).
///
/// # Errors
/// Pipeline stages, parameters the source does not have, layouts that do not fit the
/// source's shapes, or split tensors on different device matrices.
pub fn mindspore_target_strategy(
    params: &BTreeMap<String, MindSporeParam>,
    source: &impl PieceSource,
) -> Result<crate::layout::strategy::Strategy> {
    let mut known = BTreeMap::new();
    for (name, p) in params {
        if p.stage != 0 {
            return Err(Error::Unsupported {
                problem: format!(
                    "parameter `{name}` is in pipeline stage {} of the target strategy: pipeline targets are not supported",
                    p.stage
                ),
            });
        }
        let t = source
            .source_tensors()
            .get(name)
            .ok_or_else(|| Error::InvalidLayout {
                tensor: name.clone(),
                problem: "in the target strategy but not in the source".into(),
            })?;
        let ml =
            crate::layout::mindspore::from_mindspore(name, &p.layout, t.shape.clone(), t.dtype)?;
        known.insert(name.clone(), ml);
    }
    crate::layout::mindspore::common_strategy(&known).ok_or_else(|| Error::Unsupported {
        problem: "the target strategy splits tensors over different device matrices, which one ckpt mesh cannot hold".into(),
    })
}

//! Tensors computed while they are copied (`layout/compute.rs` does the arithmetic):
//! block-scaled FP8 weights dequantized (`--dtype` on an FP8 checkpoint) or quantized
//! (`--quantize fp8`), and PEFT LoRA adapters merged into their base weights (`--lora`).
//! Each turns some tensors of the checkpoint into computed ones, whose pieces name the
//! operation and the boxes of the stored tensors it reads; every writer, the planner
//! and the engine then take them as they take stored tensors, in the same streaming
//! pass.
//!
//! The rules are those of the libraries people check against (tests/fixtures/serving/
//! README.md): DeepSeek-V3's `weight_dequant`, vLLM's and DeepGEMM's
//! `per_block_cast_to_fp8`, PEFT 0.21's `merge_and_unload`.

use super::Checkpoint;
use crate::error::{Error, Result};
use crate::layout::compute::{LowRankUpdate, Operation};
use crate::layout::region::Region;
use crate::layout::select::Selection;
use crate::layout::source::{Compute, ComputeInput, Computed, SourcePiece, SourceTensor};
use crate::layout::strategy::dtype_name;
use crate::layout::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What the output computes besides the copy.
#[derive(Clone, Debug, Default)]
pub struct Computations {
    /// PEFT LoRA adapter directories merged into the weights, in this order (`--lora`).
    pub lora: Vec<PathBuf>,
    /// The `lora_alpha` of adapters that record 0 or none (`--lora-alpha`).
    pub lora_alpha: Option<f64>,
    /// Quantize the linear layers' weights to FP8 with a scale per 128 x 128 block
    /// (`--quantize fp8`).
    pub quantize_fp8: bool,
}

impl Computations {
    /// Whether anything is asked.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.lora.is_empty() && !self.quantize_fp8
    }
}

/// The suffix of a block-scaled FP8 weight's scales (DeepSeek-V3, Qwen3-FP8): the
/// dequantization multiplier per block, despite its name.
pub const SCALE_INV_SUFFIX: &str = "_scale_inv";

/// The block of DeepSeek-V3's and Qwen3's FP8 releases, where the config names none.
const DEFAULT_BLOCK: [u64; 2] = [128, 128];

/// A computed piece over the whole box `global` of a tensor.
fn computed_piece(
    first: &SourcePiece,
    global: Region,
    op: Operation,
    inputs: Vec<ComputeInput>,
) -> SourcePiece {
    SourcePiece {
        file: first.file,
        tensor: first.tensor,
        local: global.clone(),
        global,
        view: None,
        compute: Some(Compute(Arc::new(Computed { op, inputs }))),
    }
}

/// The input `name` of a computed piece: the box `region` of `tensor`, with only the
/// pieces that hold some of it.
fn input(name: &str, tensor: &SourceTensor, region: Region) -> ComputeInput {
    ComputeInput {
        name: name.to_string(),
        tensor: SourceTensor {
            dtype: tensor.dtype,
            shape: tensor.shape.clone(),
            pieces: tensor
                .pieces
                .iter()
                .filter(|p| p.global.overlap(&region).is_some())
                .cloned()
                .collect(),
            copies: Vec::new(),
        },
        region,
    }
}

/// `[rows, cols]` of a 2-D tensor, or an error naming it.
fn matrix(name: &str, t: &SourceTensor, what: &str) -> Result<[u64; 2]> {
    match t.shape[..] {
        [r, c] => Ok([r, c]),
        _ => Err(Error::InvalidTensor {
            tensor: name.to_string(),
            problem: format!("{what} must be a matrix, not of shape {:?}", t.shape),
        }),
    }
}

impl Checkpoint {
    /// Turns the tensors `computations` and `cast` (`--dtype`) name into computed ones:
    /// block-scaled FP8 weights dequantized when a floating-point cast is asked (their
    /// `_scale_inv` tensors and the config's `quantization_config` dropped, with a
    /// note), LoRA adapters merged, weights quantized to FP8. Tensors the selection
    /// left out are not touched.
    ///
    /// Returns `selection` with the tensors computed in a dtype of their own (FP8
    /// weights quantized, their F32 scales) left out of its cast.
    ///
    /// # Errors
    /// An FP8 weight whose scales do not fit its blocks; an adapter that does not fit
    /// the base, or that PEFT's merge would not compute as built here (named).
    pub fn compute(
        &mut self,
        computations: &Computations,
        selection: &Selection,
    ) -> Result<Selection> {
        let cast = selection.cast();
        if let Some(to) = cast.filter(|d| matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32)) {
            self.dequantize_fp8(to)?;
            self.dequantize_ggml(to)?;
        }
        for dir in &computations.lora {
            self.merge_lora(dir, computations.lora_alpha)?;
        }
        let mut fixed = Vec::new();
        if computations.quantize_fp8 {
            fixed = self.quantize_fp8()?;
        }
        Ok(selection.clone().without_cast_of(fixed))
    }

    /// The config kept beside the weights, parsed (`None` when there is none).
    fn carried_config(&self) -> Result<Option<(PathBuf, serde_json::Map<String, Value>)>> {
        let Some(path) = self.carried.get("config.json") else {
            return Ok(None);
        };
        let bytes = crate::formats::read_small(path)?;
        match serde_json::from_slice(&bytes) {
            Ok(Value::Object(map)) => Ok(Some((path.clone(), map))),
            _ => Err(Error::Unsupported {
                problem: format!("{}: not a JSON object", path.display()),
            }),
        }
    }

    /// Replaces the carried `config.json` by `config` (written to a scratch directory
    /// the checkpoint keeps until it is dropped; the input is never modified).
    fn rewrite_config(&mut self, config: &serde_json::Map<String, Value>) -> Result<()> {
        let dir = tempfile::Builder::new()
            .prefix("ckpt-config-")
            .tempdir()
            .map_err(|source| Error::Io {
                path: std::env::temp_dir(),
                source,
            })?;
        let path = dir.path().join("config.json");
        let mut text = serde_json::to_string_pretty(config).unwrap_or_default();
        text.push('\n');
        std::fs::write(&path, text).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        self.carried.insert("config.json".into(), path);
        self.scratch.push(dir);
        Ok(())
    }

    /// The FP8 block the config's `quantization_config.weight_block_size` names:
    /// `Some` when it gives one, `None` when it says `null` (per-tensor scales, as
    /// transformers' FP8 writes them) or the config gives none.
    fn fp8_block(config: Option<&serde_json::Map<String, Value>>) -> Result<Option<[u64; 2]>> {
        let Some(q) = config.and_then(|c| c.get("quantization_config")) else {
            return Ok(None);
        };
        if q.get("quant_method").and_then(Value::as_str) == Some("compressed-tensors") {
            return Self::compressed_tensors_block(q);
        }
        match q.get("weight_block_size") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(b)) => match b[..] {
                [Value::Number(ref r), Value::Number(ref c)] => match (r.as_u64(), c.as_u64()) {
                    (Some(r), Some(c)) if r > 0 && c > 0 => Ok(Some([r, c])),
                    _ => Err(bad_block(b)),
                },
                _ => Err(bad_block(b)),
            },
            Some(other) => Err(Error::Unsupported {
                problem: format!("config.json: quantization_config.weight_block_size is {other}, not [rows, columns]"),
            }),
        }
    }

    /// The block of compressed-tensors' `block` strategy (`config_groups.*.weights.
    /// block_structure`), `None` when no group has one. Groups of different blocks are
    /// refused: which weight is in which group is a matter of their `targets`
    /// patterns, which are not read here.
    fn compressed_tensors_block(q: &Value) -> Result<Option<[u64; 2]>> {
        let mut blocks = Vec::new();
        for (group, scheme) in q
            .get("config_groups")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let weights = scheme.get("weights");
            if weights
                .and_then(|w| w.get("strategy"))
                .and_then(Value::as_str)
                != Some("block")
            {
                continue;
            }
            let b = weights.and_then(|w| w.get("block_structure"));
            let block = match b.and_then(Value::as_array).map(Vec::as_slice) {
                Some([r, c]) => match (r.as_u64(), c.as_u64()) {
                    (Some(r), Some(c)) if r > 0 && c > 0 => [r, c],
                    _ => return Err(bad_block(b.and_then(Value::as_array).map_or(&[], Vec::as_slice))),
                },
                _ => {
                    return Err(Error::Unsupported {
                        problem: format!("config.json: quantization_config.config_groups.{group}.weights.block_structure is {}, not [rows, columns]", b.unwrap_or(&Value::Null)),
                    })
                }
            };
            if !blocks.contains(&block) {
                blocks.push(block);
            }
        }
        match blocks[..] {
            [] => Ok(None),
            [b] => Ok(Some(b)),
            _ => Err(Error::Unsupported {
                problem: format!("config.json: quantization_config.config_groups quantize in blocks of {blocks:?}: weights of several block sizes are not dequantized (which group a weight is in is not read)"),
            }),
        }
    }

    /// The scales of FP8 weight `name` (`m x n`) and how they cover it: the scale
    /// tensor's name, the block each scale covers, and the scales as a matrix of
    /// blocks (a view when stored as a scalar or a vector). `None` when the weight has
    /// no scales beside it.
    fn fp8_scales(
        &self,
        name: &str,
        [m, n]: [u64; 2],
        block: Option<[u64; 2]>,
    ) -> Result<Option<(String, [u64; 2], SourceTensor)>> {
        let candidates = scale_names(name);
        let mut found = candidates.iter().filter(|c| self.tensors.contains_key(*c));
        let Some(scale) = found.next() else {
            return Ok(None);
        };
        if let Some(other) = found.next() {
            return Err(Error::InvalidTensor {
                tensor: name.to_string(),
                problem: format!("has two scale tensors, `{scale}` and `{other}`: which one dequantizes it is not clear (select one out with --exclude)"),
            });
        }
        let s = &self.tensors[scale];
        let blocks = block.unwrap_or(DEFAULT_BLOCK);
        let grid = [m.div_ceil(blocks[0]), n.div_ceil(blocks[1])];
        let numel: u64 = s.shape.iter().product();
        // The grid of blocks the scales' shape says, checked against the config's block
        // where it gives one: a block grid (DeepSeek-V3, Qwen3-FP8), one scale for the
        // whole tensor (transformers with `weight_block_size: null`, compressed-tensors'
        // and ModelOpt's `tensor` strategy), or one per row (compressed-tensors'
        // `channel` strategy, FBGEMM).
        let (cover, grid) = if s.shape == grid {
            (blocks, grid)
        } else if numel == 1 && s.shape.len() <= 2 && block.is_none_or(|b| b[0] >= m && b[1] >= n) {
            ([m, n], [1, 1])
        } else if m > 1
            && (s.shape == [m, 1] || s.shape == [m])
            && block.is_none_or(|b| b == [1, n])
        {
            ([1, n], [m, 1])
        } else {
            let config = match block {
                Some(b) => format!("quantization_config.weight_block_size {b:?} in config.json"),
                None => format!(
                    "no weight_block_size in config.json: {}x{} blocks",
                    blocks[0], blocks[1]
                ),
            };
            return Err(Error::InvalidTensor {
                tensor: scale.clone(),
                problem: format!(
                    "is {} {:?}, but the scales of `{name}` ({m} x {n}) are F32 {grid:?} in blocks ({config}), [] or [1] for one scale per tensor, or [{m}, 1] for one per row: the block size does not fit",
                    dtype_name(s.dtype),
                    s.shape,
                ),
            });
        };
        if !is_float(s.dtype) {
            return Err(Error::InvalidTensor {
                tensor: scale.clone(),
                problem: format!(
                    "is {}: FP8 scales are read as floats (F32, BF16 or F16); other scale types (E8M0 exponents) are not built",
                    dtype_name(s.dtype)
                ),
            });
        }
        Ok(Some((
            scale.clone(),
            cover,
            self.as_matrix(scale, s, grid)?,
        )))
    }

    /// `t` read as the matrix `shape` it holds with unit dimensions added (`[]` as
    /// `[1, 1]`, `[m]` as `[m, 1]`): each piece through a reshaping view of its
    /// stored tensor.
    fn as_matrix(&self, name: &str, t: &SourceTensor, shape: [u64; 2]) -> Result<SourceTensor> {
        if t.shape == shape {
            return Ok(t.clone());
        }
        let widen = |r: &Region| match r.ndim() {
            0 => Region::from_ranges(&[0..1, 0..1]),
            1 => Region::from_ranges(&[r.start[0]..r.end(0), 0..1]),
            _ => r.clone(),
        };
        let pieces = t
            .pieces
            .iter()
            .map(|p| {
                let stored = crate::layout::source::PieceSource::stored_shape(self, p.file, p.tensor);
                if p.view.is_some() || p.compute.is_some() || stored.len() > 1 {
                    return Err(Error::InvalidTensor {
                        tensor: name.to_string(),
                        problem: format!("is stored as {stored:?} pieces that are not whole vectors: scales of shape {:?} are read only from plain stored vectors", t.shape),
                    });
                }
                let view_shape = match stored[..] {
                    [] => vec![1, 1],
                    [len] => vec![len, 1],
                    _ => unreachable!("checked above"),
                };
                Ok(SourcePiece {
                    global: widen(&p.global),
                    local: widen(&p.local),
                    view: Some(Box::new(crate::layout::source::StoredView {
                        shape: view_shape,
                        axes: vec![0, 1],
                    })),
                    ..p.clone()
                })
            })
            .collect::<Result<_>>()?;
        Ok(SourceTensor {
            dtype: t.dtype,
            shape: shape.to_vec(),
            pieces,
            copies: Vec::new(),
        })
    }

    /// FP8 weights (`W` in `F8_E4M3` beside its scales: `W_scale_inv` or, for
    /// `X.weight`, `X.weight_scale`) as computed tensors of `dtype`.
    fn dequantize_fp8(&mut self, dtype: Dtype) -> Result<()> {
        let weights: Vec<String> = self
            .tensors
            .iter()
            .filter(|(n, t)| {
                t.dtype == Dtype::F8_E4M3
                    && scale_names(n).iter().any(|s| self.tensors.contains_key(s))
            })
            .map(|(n, _)| n.clone())
            .collect();
        if weights.is_empty() {
            return Ok(());
        }
        let config = self.carried_config()?;
        let block = Self::fp8_block(config.as_ref().map(|c| &c.1))?;
        let mut covers: BTreeMap<String, usize> = BTreeMap::new();
        let mut activation_scales = 0;
        for name in &weights {
            let w = &self.tensors[name];
            let [m, n] = matrix(name, w, "a scaled FP8 weight")?;
            let Some((scale_name, cover, s)) = self.fp8_scales(name, [m, n], block)? else {
                continue;
            };
            let what = if cover[0] >= m && cover[1] >= n {
                "per tensor".to_string()
            } else if cover == [1, n] && m > 1 {
                "per row".to_string()
            } else {
                format!("in {}x{} blocks", cover[0], cover[1])
            };
            *covers.entry(what).or_default() += 1;
            let op = Operation::BlockDequantize { block: cover };
            let pieces = w
                .pieces
                .iter()
                .map(|p| {
                    let whole = Region::full(&s.shape);
                    let scales = op.input_region(1, &p.global, &whole);
                    let inputs = vec![
                        input(name, w, p.global.clone()),
                        input(&scale_name, &s, scales),
                    ];
                    computed_piece(p, p.global.clone(), op.clone(), inputs)
                })
                .collect();
            let shape = w.shape.clone();
            self.tensors.insert(
                name.clone(),
                SourceTensor {
                    dtype,
                    shape,
                    pieces,
                    copies: Vec::new(),
                },
            );
            self.tensors.remove(&scale_name);
            // A statically quantized layer's activation scale: the dequantized layer
            // takes its input unquantized, and the model without a
            // quantization_config has no place for it.
            if let Some(module) = name.strip_suffix(".weight") {
                if self
                    .tensors
                    .remove(&format!("{module}.input_scale"))
                    .is_some()
                {
                    activation_scales += 1;
                }
            }
        }
        let covers: Vec<String> = covers.iter().map(|(k, v)| format!("{v} {k}")).collect();
        self.notes.push(format!(
            "{} FP8 weights dequantized to {} with their scales ({}; DeepSeek-V3's weight_dequant: FP8 times the F32 scale, rounded once); the scale tensors are left out",
            weights.len(),
            dtype_name(dtype),
            covers.join(", "),
        ));
        if activation_scales > 0 {
            self.notes.push(format!(
                "{activation_scales} activation scales (`input_scale`) of the dequantized layers are left out"
            ));
        }
        if let Some((_, mut config)) = config {
            if config.remove("quantization_config").is_some() {
                self.rewrite_config(&config)?;
                self.notes.push(
                    "config.json: quantization_config removed (the weights are no longer FP8)"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// The Q8_0 tensors of GGUF files (their blocks read as `U8` rows) as computed
    /// tensors of `dtype`, `[rows, blocks * 32]`.
    fn dequantize_ggml(&mut self, dtype: Dtype) -> Result<()> {
        use crate::formats::gguf::{GgmlType, TYPES_KEY};
        use crate::layout::compute::{Q8_0_BLOCK, Q8_0_BYTES};
        // By the names the files store them under: a view may have renamed them
        // (llama.cpp's names as Hugging Face's).
        let mut stored = std::collections::BTreeSet::new();
        for (k, f) in self.files.iter().enumerate() {
            if f.format() != crate::formats::FileFormat::Gguf {
                continue;
            }
            let Some(types) = f.metadata().get(TYPES_KEY) else {
                continue;
            };
            let types: BTreeMap<String, String> =
                serde_json::from_str(types).map_err(|e| Error::Unsupported {
                    problem: format!("{}: metadata `{TYPES_KEY}`: {e}", f.path().display()),
                })?;
            for (i, entry) in f.tensors().iter().enumerate() {
                if types
                    .get(&entry.name)
                    .is_some_and(|t| GgmlType::from_name(t) == Some(GgmlType::Q8_0))
                {
                    stored.insert((k, i));
                }
            }
        }
        let blocks: Vec<String> = self
            .tensors
            .iter()
            .filter(|(_, t)| {
                t.dtype == Dtype::U8
                    && t.pieces.first().is_some_and(|p| {
                        p.compute.is_none() && stored.contains(&(p.file, p.tensor))
                    })
            })
            .map(|(n, _)| n.clone())
            .collect();
        let mut done = 0;
        for name in blocks {
            let Some(t) = self.tensors.get(&name) else {
                continue;
            };
            let [rows, bytes] = matrix(&name, t, "a Q8_0 tensor (its rows of blocks)")?;
            if bytes % Q8_0_BYTES != 0 {
                return Err(Error::InvalidTensor {
                    tensor: name,
                    problem: format!(
                        "rows of {bytes} bytes are not whole Q8_0 blocks of {Q8_0_BYTES}"
                    ),
                });
            }
            let cols = bytes / Q8_0_BYTES * Q8_0_BLOCK;
            let op = Operation::GgmlQ8_0Dequantize;
            let whole = Region::full(&t.shape);
            let pieces = t
                .pieces
                .iter()
                .map(|p| {
                    // A piece of whole blocks (a GGUF holds whole tensors), its box in
                    // values.
                    let (c0, c1) = (p.global.start[1], p.global.end(1));
                    let out = Region::from_ranges(&[
                        p.global.start[0]..p.global.end(0),
                        c0 / Q8_0_BYTES * Q8_0_BLOCK..c1 / Q8_0_BYTES * Q8_0_BLOCK,
                    ]);
                    let need = op.input_region(0, &out, &whole);
                    computed_piece(p, out, op.clone(), vec![input(&name, t, need)])
                })
                .collect();
            self.tensors.insert(
                name,
                SourceTensor {
                    dtype,
                    shape: vec![rows, cols],
                    pieces,
                    copies: Vec::new(),
                },
            );
            done += 1;
        }
        if done > 0 {
            self.notes.push(format!(
                "{done} Q8_0 tensors dequantized to {} (ggml's dequantize_row_q8_0: the block's f16 scale times each i8, exact in f32)",
                dtype_name(dtype)
            ));
        }
        Ok(())
    }

    /// The linear layers' weights quantized to FP8 with a `_scale_inv` per 128 x 128
    /// block, and the `quantization_config` transformers and vLLM read.
    fn quantize_fp8(&mut self) -> Result<Vec<String>> {
        let block = DEFAULT_BLOCK;
        let weights: Vec<String> = self
            .tensors
            .iter()
            .filter(|(n, t)| is_quantized_linear(n, t))
            .map(|(n, _)| n.clone())
            .collect();
        if weights.is_empty() {
            let fp8 = self.tensors.values().any(|t| t.dtype == Dtype::F8_E4M3);
            return Err(Error::Unsupported {
                problem: if fp8 {
                    "--quantize fp8: the weights are FP8 already (with --dtype bf16 they are dequantized first, then quantized again)".into()
                } else {
                    "--quantize fp8: no linear layer's weight (`*_proj.weight` and the like, 2-D, floating point) to quantize".into()
                },
            });
        }
        let fixed: Vec<String> = weights
            .iter()
            .flat_map(|w| [w.clone(), scale_name(w)])
            .collect();
        for name in &weights {
            let w = self.tensors[name].clone();
            let [m, n] = matrix(name, &w, "a weight to quantize")?;
            let whole = Region::full(&w.shape);
            let grid = [m.div_ceil(block[0]), n.div_ceil(block[1])];
            let codes = Operation::BlockQuantize { block };
            let pieces = w
                .pieces
                .iter()
                .map(|p| {
                    let x = codes.input_region(0, &p.global, &whole);
                    computed_piece(p, p.global.clone(), codes.clone(), vec![input(name, &w, x)])
                })
                .collect();
            let scale = Operation::BlockScale { block };
            let grid_box = Region::full(&grid);
            let x = scale.input_region(0, &grid_box, &whole);
            let scale_piece =
                computed_piece(&w.pieces[0], grid_box, scale, vec![input(name, &w, x)]);
            self.tensors.insert(
                name.clone(),
                SourceTensor {
                    dtype: Dtype::F8_E4M3,
                    shape: w.shape.clone(),
                    pieces,
                    copies: Vec::new(),
                },
            );
            self.tensors.insert(
                scale_name(name),
                SourceTensor {
                    dtype: Dtype::F32,
                    shape: grid.to_vec(),
                    pieces: vec![scale_piece],
                    copies: Vec::new(),
                },
            );
        }
        self.notes.push(format!(
            "{} weights quantized to FP8 (E4M3) with a scale per {}x{} block (vLLM's per_block_cast_to_fp8); embeddings, norms, routers and lm_head stay as they are",
            weights.len(),
            block[0],
            block[1]
        ));
        let quantization = serde_json::json!({
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": block,
        });
        let Some((_, mut config)) = self.carried_config()? else {
            self.notes.push(format!(
                "no config.json beside the weights: the model's config needs \"quantization_config\": {quantization} for transformers and vLLM to load the FP8 weights"
            ));
            return Ok(fixed);
        };
        config.insert("quantization_config".into(), quantization);
        self.rewrite_config(&config)?;
        Ok(fixed)
    }

    /// Merges the PEFT LoRA adapter in `dir` (or its `lora_adapter/`, as verl's model
    /// merger writes it into its target directory) into the weights: each targeted
    /// weight becomes a computed tensor (its pieces plus `scale * B @ A`), each saved
    /// module (`modules_to_save`, trained biases) replaces the base's tensor.
    fn merge_lora(&mut self, dir: &Path, alpha: Option<f64>) -> Result<()> {
        let dir = if !dir.join(ADAPTER_CONFIG).exists()
            && dir.join("lora_adapter").join(ADAPTER_CONFIG).exists()
        {
            dir.join("lora_adapter")
        } else {
            dir.to_path_buf()
        };
        let config = AdapterConfig::read(&dir.join(ADAPTER_CONFIG), alpha)?;
        // The adapter's own file (a directory may hold more: training args, merged
        // copies).
        let Some(file) = ADAPTER_FILES
            .iter()
            .map(|f| dir.join(f))
            .find(|f| f.exists())
        else {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: no {} beside {ADAPTER_CONFIG}",
                    dir.display(),
                    ADAPTER_FILES.join(" or ")
                ),
            });
        };
        let adapter = Checkpoint::open(&[file])?;
        let offset = self.files.len();
        let Checkpoint {
            files,
            tensors,
            mirrors,
            ..
        } = adapter;
        self.ranks.extend(std::iter::repeat_n(None, files.len()));
        self.files.extend(files);
        self.mirrors.extend(mirrors);
        let tensors: BTreeMap<String, SourceTensor> = tensors
            .into_iter()
            .map(|(name, mut t)| {
                for p in t
                    .pieces
                    .iter_mut()
                    .chain(t.copies.iter_mut().map(|c| &mut c.1))
                {
                    p.file += offset;
                }
                (name, t)
            })
            .collect();
        let merged = self.merge_adapter(&config, tensors, &dir)?;
        self.notes.push(format!(
            "LoRA adapter {} merged into {merged} weights (r {}, lora_alpha {}{})",
            dir.display(),
            config.r,
            config.lora_alpha,
            if config.use_rslora { ", rsLoRA" } else { "" }
        ));
        Ok(())
    }

    /// Merges an adapter's tensors `tensors` (PEFT's saved names,
    /// `base_model.model.<module>.lora_{A,B}.weight`, their pieces already among the
    /// checkpoint's files) into the weights as [`Checkpoint::merge_lora`] says; `dir`
    /// names where they came from in messages. Returns how many weights were merged.
    pub(super) fn merge_adapter(
        &mut self,
        config: &AdapterConfig,
        mut tensors: BTreeMap<String, SourceTensor>,
        dir: &Path,
    ) -> Result<usize> {
        let at = |name: &str| format!("{}: `{name}`", dir.display());
        // The adapter's modules: `base_model.model.<module>.lora_{A,B}.weight` (and the
        // embedding kind), and saved modules under the same prefix without `lora_`.
        let mut modules: BTreeMap<String, [Option<(String, SourceTensor)>; 2]> = BTreeMap::new();
        let mut saved = Vec::new();
        for (name, t) in std::mem::take(&mut tensors) {
            let Some(rest) = name.strip_prefix(PEFT_PREFIX) else {
                return Err(Error::Unsupported {
                    problem: format!(
                        "{}: not a PEFT adapter's tensor (PEFT names start with `{PEFT_PREFIX}`)",
                        at(&name)
                    ),
                });
            };
            let kind = LORA_KINDS.iter().find_map(|&(suffix, i, embedding)| {
                rest.strip_suffix(suffix)
                    .map(|m| (m.to_string(), i, embedding))
            });
            match kind {
                Some((module, i, embedding)) => {
                    let key = if embedding {
                        format!("{module}\u{0}")
                    } else {
                        module
                    };
                    modules.entry(key).or_default()[i] = Some((name, t));
                }
                None if rest.contains("lora_") || rest.contains("magnitude_vector") => {
                    return Err(Error::Unsupported {
                        problem: format!("{}: a LoRA variant ckpt does not merge (DoRA's magnitude, a LoRA bias, ...): only A and B matrices are built", at(&name)),
                    });
                }
                None => saved.push((rest.to_string(), name, t)),
            }
        }
        let mut merged = 0;
        for (key, [a, b]) in modules {
            let (module, embedding) = match key.strip_suffix('\u{0}') {
                Some(m) => (m.to_string(), true),
                None => (key, false),
            };
            let (Some((a_name, a)), Some((b_name, b))) = (a, b) else {
                return Err(Error::Unsupported {
                    problem: format!(
                        "{}: module `{module}` has only one of lora_A and lora_B",
                        dir.display()
                    ),
                });
            };
            let weight = format!("{module}.weight");
            let Some(w) = self.tensors.get(&weight).cloned() else {
                return Err(Error::InvalidTensor {
                    tensor: weight,
                    problem: format!(
                        "is not in the base, but the adapter {} changes it (`{a_name}`): is it the adapter of another model?",
                        dir.display()
                    ),
                });
            };
            let [rows, cols] = matrix(&weight, &w, "a weight LoRA updates")?;
            let [ar, ac] = matrix(&a_name, &a, "lora_A")?;
            let [br, bc] = matrix(&b_name, &b, "lora_B")?;
            let (r, alpha) = config.rank_and_alpha(&module)?;
            // Linear: B [out, r] @ A [r, in] is W [out, in]; an embedding's update and a
            // fan_in_fan_out weight ([in, out]) take it transposed.
            let transposed = embedding != config.fan_in_fan_out;
            let (out_dim, in_dim) = if transposed {
                (cols, rows)
            } else {
                (rows, cols)
            };
            if ar != r || bc != r || ac != in_dim || br != out_dim {
                return Err(Error::InvalidTensor {
                    tensor: weight,
                    problem: format!(
                        "is {rows} x {cols}, but the adapter {} holds lora_A {ar} x {ac} and lora_B {br} x {bc} with r = {r}: it does not fit this base",
                        dir.display()
                    ),
                });
            }
            if !matches!(w.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
                || !is_float(a.dtype)
                || !is_float(b.dtype)
            {
                return Err(Error::Unsupported {
                    problem: format!("`{weight}` is {}: LoRA merges into BF16, F16 or F32 weights with floating-point adapters", dtype_name(w.dtype)),
                });
            }
            let scale = if config.use_rslora {
                alpha / (r as f64).sqrt()
            } else {
                alpha / r as f64
            } as f32;
            let update = LowRankUpdate {
                scale,
                rank: r,
                transposed,
            };
            self.add_low_rank(&weight, w, update, (&a_name, &a), (&b_name, &b));
            merged += 1;
        }
        for (module, name, t) in saved {
            let Some(base) = self.tensors.get(&module) else {
                return Err(Error::InvalidTensor {
                    tensor: module,
                    problem: format!(
                        "is not in the base, but the adapter {} saves it (`{name}`)",
                        dir.display()
                    ),
                });
            };
            if base.shape != t.shape {
                return Err(Error::InvalidTensor {
                    tensor: module,
                    problem: format!(
                        "is {:?} in the base but {:?} in the adapter {}",
                        base.shape,
                        t.shape,
                        dir.display()
                    ),
                });
            }
            self.tensors.insert(module, t);
        }
        Ok(merged)
    }

    /// `weight` (whose tensor is `w`) plus one more low-rank update: a stored weight
    /// becomes computed, a computed one takes the update after those it has.
    fn add_low_rank(
        &mut self,
        weight: &str,
        w: SourceTensor,
        update: LowRankUpdate,
        a: (&str, &SourceTensor),
        b: (&str, &SourceTensor),
    ) {
        let pieces = w
            .pieces
            .iter()
            .map(|p| {
                // A weight already updated by an earlier adapter: its inputs and
                // updates, one more pair appended (one rounding per adapter, as PEFT
                // merges one after the other).
                let (mut updates, mut inputs) = match p.compute.as_ref().map(|c| (&c.op, &c.inputs))
                {
                    Some((Operation::LowRank { updates }, inputs)) => {
                        (updates.clone(), inputs.clone())
                    }
                    _ => (Vec::new(), vec![input(weight, &w, p.global.clone())]),
                };
                updates.push(update);
                let op = Operation::LowRank { updates };
                let n = inputs.len();
                for (i, (name, t)) in [a, b].into_iter().enumerate() {
                    let region = op.input_region(n + i, &p.global, &Region::full(&t.shape));
                    inputs.push(input(name, t, region));
                }
                computed_piece(p, p.global.clone(), op, inputs)
            })
            .collect();
        self.tensors.insert(
            weight.to_string(),
            SourceTensor {
                dtype: w.dtype,
                shape: w.shape,
                pieces,
                copies: Vec::new(),
            },
        );
    }
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32 | Dtype::F64)
}

fn bad_block(b: &[Value]) -> Error {
    Error::Unsupported {
        problem: format!("config.json: quantization_config.weight_block_size is {b:?}, not two positive integers"),
    }
}

/// `W`'s scales: `W_scale_inv`.
fn scale_name(weight: &str) -> String {
    format!("{weight}{SCALE_INV_SUFFIX}")
}

/// The names the scales of FP8 weight `W` go by: `W_scale_inv` (DeepSeek-V3,
/// Qwen3-FP8, transformers) and, for `X.weight`, `X.weight_scale` (compressed-tensors,
/// FBGEMM, ModelOpt). Both multiply the FP8 values.
fn scale_names(weight: &str) -> Vec<String> {
    let mut names = vec![scale_name(weight)];
    if weight.ends_with(".weight") {
        names.push(format!("{weight}_scale"));
    }
    names
}

/// The weights `--quantize fp8` quantizes: the linear layers' 2-D floating-point
/// weights inside the layers (DeepSeek's and Qwen's FP8 releases keep embeddings,
/// norms, the MoE router and `lm_head` in BF16).
fn is_quantized_linear(name: &str, t: &SourceTensor) -> bool {
    let Some(module) = name.strip_suffix(".weight") else {
        return false;
    };
    let last = module.rsplit('.').next().unwrap_or(module);
    let linear = last.contains("_proj")
        || matches!(
            last,
            "w1" | "w2"
                | "w3"
                | "fc1"
                | "fc2"
                | "c_fc"
                | "c_proj"
                | "dense"
                | "query_key_value"
                | "dense_h_to_4h"
                | "dense_4h_to_h"
        );
    t.shape.len() == 2
        && matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
        && linear
        && module.contains("layers.")
}

/// The adapter's configuration file.
const ADAPTER_CONFIG: &str = "adapter_config.json";

/// The adapter's weights, as PEFT saves them (safetensors unless told otherwise).
const ADAPTER_FILES: [&str; 2] = ["adapter_model.safetensors", "adapter_model.bin"];

/// The prefix PEFT saves its tensors under (`PeftModel.base_model.model`).
pub(super) const PEFT_PREFIX: &str = "base_model.model.";

/// The suffixes of a module's LoRA matrices: which of `[A, B]`, and whether it is an
/// embedding's (`lora_embedding_A` is `[r, num_embeddings]`, its update transposed).
const LORA_KINDS: [(&str, usize, bool); 4] = [
    (".lora_A.weight", 0, false),
    (".lora_B.weight", 1, false),
    (".lora_embedding_A", 0, true),
    (".lora_embedding_B", 1, true),
];

/// `rank_pattern` and `alpha_pattern` of `adapter_config.json`, each in its file order.
#[derive(Debug, Default, serde::Deserialize)]
struct PatternMaps {
    #[serde(default)]
    rank_pattern: OrderedMap,
    #[serde(default)]
    alpha_pattern: OrderedMap,
}

/// A JSON object's entries in the order the text gives them (`null` reads as empty).
#[derive(Debug, Default)]
struct OrderedMap(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for OrderedMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = OrderedMap;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of pattern: number")
            }
            fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<OrderedMap, E> {
                Ok(OrderedMap::default())
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<OrderedMap, A::Error> {
                let mut entries = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, Value>()? {
                    // json.load keeps the last value at the first one's place: a reading
                    // no one means. Refused rather than guessed.
                    if entries.iter().any(|(k, _)| *k == key) {
                        return Err(serde::de::Error::custom(format!(
                            "pattern `{key}` is given twice"
                        )));
                    }
                    entries.push((key, value));
                }
                Ok(OrderedMap(entries))
            }
        }
        d.deserialize_any(Entries)
    }
}

/// What of `adapter_config.json` the merge uses.
#[derive(Debug)]
pub(super) struct AdapterConfig {
    r: u64,
    lora_alpha: f64,
    use_rslora: bool,
    fan_in_fan_out: bool,
    /// `(regex, value)` in the file's key order, first match wins (PEFT's rule).
    rank_pattern: Vec<(regex::Regex, String, u64)>,
    alpha_pattern: Vec<(regex::Regex, String, f64)>,
    path: PathBuf,
}

impl AdapterConfig {
    /// A plain LoRA (or rsLoRA) config of one rank and alpha for every module, as a
    /// trainer recorded it in `path` (verl's `lora_train_meta.json`).
    pub(super) fn plain(r: u64, lora_alpha: f64, use_rslora: bool, path: PathBuf) -> AdapterConfig {
        AdapterConfig {
            r,
            lora_alpha,
            use_rslora,
            fan_in_fan_out: false,
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            path,
        }
    }

    fn read(path: &Path, alpha: Option<f64>) -> Result<AdapterConfig> {
        let bad = |problem: String| Error::Unsupported {
            problem: format!("{}: {problem}", path.display()),
        };
        let bytes = crate::formats::read_small(path)?;
        let Ok(Value::Object(c)) = serde_json::from_slice::<Value>(&bytes) else {
            return Err(bad("not a JSON object".into()));
        };
        let peft_type = c.get("peft_type").and_then(Value::as_str).unwrap_or("");
        if peft_type != "LORA" {
            return Err(bad(format!(
                "peft_type `{peft_type}`: only LoRA adapters (peft_type LORA) are merged"
            )));
        }
        // What changes the merge's arithmetic beyond A, B, r and alpha: refused by
        // name rather than merged wrongly.
        let truthy = |v: &Value| {
            !matches!(v, Value::Null | Value::Bool(false))
                && v != &Value::Object(Default::default())
                && v != &Value::Array(Vec::new())
        };
        for key in [
            "use_dora",
            "lora_bias",
            "use_qalora",
            "use_bdlora",
            "arrow_config",
            "kasa_config",
            "monteclora_config",
            "velora_config",
            "alora_invocation_tokens",
            "target_parameters",
            "trainable_token_indices",
            "layer_replication",
            "megatron_config",
        ] {
            if let Some(v) = c.get(key).filter(|v| truthy(v)) {
                return Err(bad(format!("`{key}` is {v}: that LoRA variant is not built (ckpt merges plain LoRA and rsLoRA)")));
            }
        }
        let r = c
            .get("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("`r` is not a positive integer".into()))?;
        let recorded = c.get("lora_alpha").and_then(Value::as_f64).unwrap_or(0.0);
        let lora_alpha = match alpha {
            Some(a) => a,
            None if recorded == 0.0 => {
                return Err(bad("lora_alpha is 0 or missing: merged as saved, the adapter would change nothing (one trainer writes this); give the alpha it was trained with: --lora-alpha N".into()));
            }
            None => recorded,
        };
        // The patterns in the file's own order: PEFT takes the first that matches in
        // its dict's order, which is the file's (`json.load`). PEFT writes sorted keys,
        // but a config written by other tools or by hand need not be, and serde_json's
        // map would sort it: two overlapping patterns would then pick another rank.
        let ordered: PatternMaps = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("rank_pattern or alpha_pattern: {e}")))?;
        let patterns = |key: &str| -> Result<Vec<(regex::Regex, String, f64)>> {
            let m = match key {
                "rank_pattern" => &ordered.rank_pattern,
                _ => &ordered.alpha_pattern,
            };
            m.0.iter()
                .map(|(k, v)| {
                    // PEFT's get_pattern_key: re.match(rf"(.*\.)?({key})$", name).
                    let re = regex::Regex::new(&format!(r"^(?:.*\.)?(?:{k})$")).map_err(|e| {
                        bad(format!("{key}: `{k}` is not a pattern ckpt reads: {e}"))
                    })?;
                    let v = v
                        .as_f64()
                        .ok_or_else(|| bad(format!("{key}: `{k}` is {v}, not a number")))?;
                    Ok((re, k.clone(), v))
                })
                .collect()
        };
        let rank_pattern = patterns("rank_pattern")?
            .into_iter()
            .map(|(re, k, v)| (re, k, v as u64))
            .collect();
        Ok(AdapterConfig {
            r,
            lora_alpha,
            use_rslora: c
                .get("use_rslora")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            fan_in_fan_out: c
                .get("fan_in_fan_out")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            rank_pattern,
            alpha_pattern: patterns("alpha_pattern")?,
            path: path.to_path_buf(),
        })
    }

    /// The rank and alpha of `module` (its name in the base model): the first
    /// pattern that matches, else the defaults.
    fn rank_and_alpha(&self, module: &str) -> Result<(u64, f64)> {
        let r = self
            .rank_pattern
            .iter()
            .find(|p| p.0.is_match(module))
            .map_or(self.r, |p| p.2);
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|p| p.0.is_match(module))
            .map_or(self.lora_alpha, |p| p.2);
        if r == 0 {
            return Err(Error::Unsupported {
                problem: format!("{}: rank 0 for `{module}`", self.path.display()),
            });
        }
        Ok((r, alpha))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Result<AdapterConfig> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("adapter_config.json");
        std::fs::write(&path, text).unwrap();
        AdapterConfig::read(&path, None)
    }

    /// Two patterns that both match a module: PEFT takes the first in the file's order,
    /// which here is not the sorted order.
    #[test]
    fn overlapping_patterns_follow_the_file_order() {
        let c = config(
            r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                "rank_pattern": {"q_proj": 4, "layers.0.self_attn.q_proj": 8},
                "alpha_pattern": {"self_attn.q_proj": 16, "layers.0.self_attn.q_proj": 32}}"#,
        )
        .unwrap();
        assert_eq!(
            c.rank_and_alpha("model.layers.0.self_attn.q_proj").unwrap(),
            (4, 16.0)
        );
        assert_eq!(
            c.rank_and_alpha("model.layers.1.mlp.up_proj").unwrap(),
            (2, 4.0)
        );
        let c = config(
            r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                "rank_pattern": {"layers.0.self_attn.q_proj": 8, "q_proj": 4}, "alpha_pattern": null}"#,
        )
        .unwrap();
        assert_eq!(
            c.rank_and_alpha("model.layers.0.self_attn.q_proj").unwrap(),
            (8, 4.0)
        );
    }

    #[test]
    fn a_pattern_given_twice_is_refused() {
        let e = config(
            r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                "rank_pattern": {"q_proj": 4, "q_proj": 8}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("adapter_config.json") && e.contains("`q_proj` is given twice"),
            "{e}"
        );
    }
}

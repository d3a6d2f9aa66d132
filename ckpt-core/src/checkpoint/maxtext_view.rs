//! MaxText's parameter tree seen in Hugging Face's names, and back (issue 48).
//!
//! MaxText (its Linen model, `scan_layers=True`, read from the maxtext 0.2.5 wheel;
//! docs/trainers.md, "MaxText") saves `params/params/...`: the token embedding
//! `[vocab, embed]`, the final norm, `logits_dense` `[embed, vocab]`, and every
//! layer's weight stacked on axis 1 (`param_scan_axis`) as `DenseGeneral` kernels,
//! inputs first: the query `[embed, layers, heads, head_dim]`, the output
//! `[heads, layers, head_dim, embed]`, the MLP's `[embed, layers, mlp]`, the norms'
//! scales `[embed, layers]`. Each Hugging Face weight of a layer is a transpose of
//! that layer's box, an [`Operation::Permute`] (a transposed copy is no run of stored
//! bytes), computed in the copy's streaming pass. Llama's query kernel holds
//! Hugging Face's times `1 / sqrt(head_dim)` (MaxText's attention does not scale;
//! `scale_query_layer`), and Llama 3.1's rotates interleaved pairs (MaxText's
//! `LLaMARotaryEmbedding`; `adjust_rope`): both are part of the permutation.
//!
//! The unscanned tree (`scan_layers=False`) has each layer's weights as their own
//! arrays, `decoder.layers_<l>.<the same names>`, of the stacked shapes without the
//! layer axis (the query `[embed, heads, head_dim]`, a norm's scale `[embed]`): the
//! same permutations from the whole array, a norm's scale Hugging Face's weight as it
//! is. `reshard --format maxtext --maxtext-scan-layers false` writes it.

use super::Checkpoint;
use crate::error::{Error, Result};
use crate::hf::{self, Family, Shape};
use crate::layout::compute::Operation;
use crate::layout::region::Region;
use crate::layout::source::{Compute, ComputeInput, Computed, SourcePiece, SourceTensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Where a MaxText Linen model's weights are in its checkpoint's tree: the item key
/// `params`, then Flax's `params` collection.
pub(crate) const MAXTEXT_PREFIX: &str = "params.params.";
/// The tensor a MaxText checkpoint always has, by which it is told apart.
const MAXTEXT_EMBEDDING: &str = "params.params.token_embedder.embedding";
/// The item MaxText saves its TrainState as (`save_checkpoint`'s `{"items": state}`).
pub const MAXTEXT_ITEM: &str = "items";

fn invalid(tensor: &str, problem: String) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem,
    }
}

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

/// What one MaxText weight is to Hugging Face's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// The same array (embedding, final norm).
    Same,
    /// `logits_dense` `[embed, vocab]`, Hugging Face's `lm_head` transposed.
    Head,
    /// A projection into heads, `[embed, layers, heads, head_dim]`: q/k/v.
    IntoHeads { rope: bool, scaled: bool },
    /// The attention output, `[heads, layers, head_dim, embed]`.
    OutOfHeads,
    /// An MLP kernel, `[in, layers, out]`.
    Dense,
    /// A norm's scale, `[features, layers]`.
    Scale,
}

/// One row: the MaxText name under [`MAXTEXT_PREFIX`] (layer weights under
/// `decoder.layers.`), the Hugging Face name (`{l}` the layer) and how they relate.
struct Row {
    maxtext: &'static str,
    hf: &'static str,
    kind: Kind,
}

/// MaxText's Llama (and Mistral: the same tensors), from
/// `LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING` (`checkpoint_conversion/utils/param_mapping.py`)
/// and `models/llama2.py`; the query's scale and rotary rows set per model below.
fn rows(family: Family, rope: bool) -> Vec<Row> {
    let scaled = !matches!(family, Family::Qwen3);
    let r = |maxtext, hf, kind| Row { maxtext, hf, kind };
    let mut v = vec![
        r(
            "token_embedder.embedding",
            "model.embed_tokens.weight",
            Kind::Same,
        ),
        r(
            "decoder.decoder_norm.scale",
            "model.norm.weight",
            Kind::Same,
        ),
        r("decoder.logits_dense.kernel", "lm_head.weight", Kind::Head),
        r(
            "decoder.layers.self_attention.query.kernel",
            "model.layers.{l}.self_attn.q_proj.weight",
            Kind::IntoHeads { rope, scaled },
        ),
        r(
            "decoder.layers.self_attention.key.kernel",
            "model.layers.{l}.self_attn.k_proj.weight",
            Kind::IntoHeads {
                rope,
                scaled: false,
            },
        ),
        r(
            "decoder.layers.self_attention.value.kernel",
            "model.layers.{l}.self_attn.v_proj.weight",
            Kind::IntoHeads {
                rope: false,
                scaled: false,
            },
        ),
        r(
            "decoder.layers.self_attention.out.kernel",
            "model.layers.{l}.self_attn.o_proj.weight",
            Kind::OutOfHeads,
        ),
        r(
            "decoder.layers.mlp.wi_0.kernel",
            "model.layers.{l}.mlp.gate_proj.weight",
            Kind::Dense,
        ),
        r(
            "decoder.layers.mlp.wi_1.kernel",
            "model.layers.{l}.mlp.up_proj.weight",
            Kind::Dense,
        ),
        r(
            "decoder.layers.mlp.wo.kernel",
            "model.layers.{l}.mlp.down_proj.weight",
            Kind::Dense,
        ),
        r(
            "decoder.layers.pre_self_attention_layer_norm.scale",
            "model.layers.{l}.input_layernorm.weight",
            Kind::Scale,
        ),
        r(
            "decoder.layers.post_self_attention_layer_norm.scale",
            "model.layers.{l}.post_attention_layernorm.weight",
            Kind::Scale,
        ),
    ];
    // Qwen3's q/k norms (`QWEN_MAXTEXT_TO_HF_PARAM_MAPPING`), `[head_dim, layers]`.
    if matches!(family, Family::Qwen3) {
        v.push(r(
            "decoder.layers.self_attention.query_norm.scale",
            "model.layers.{l}.self_attn.q_norm.weight",
            Kind::Scale,
        ));
        v.push(r(
            "decoder.layers.self_attention.key_norm.scale",
            "model.layers.{l}.self_attn.k_norm.weight",
            Kind::Scale,
        ));
    }
    v
}

/// Whether MaxText rotates the model's query and key rows as interleaved pairs: its
/// `LLaMARotaryEmbedding`, chosen for `llama3.1*` models (`rope_type: llama3.1`, with
/// Llama 3.1's frequency scaling), which Hugging Face's config says as
/// `rope_scaling.rope_type: llama3`. Every other model (Llama 2 and 3, Mistral,
/// Mixtral, Qwen3) uses `RotaryEmbedding`, `rotate_half` as Hugging Face does.
pub(crate) fn interleaved_rope(config: &Path) -> Result<bool> {
    let text = String::from_utf8_lossy(&crate::formats::read_small(config)?).into_owned();
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Unsupported {
        problem: format!("{}: not JSON: {e}", config.display()),
    })?;
    let scaling = v.get("rope_scaling").or_else(|| v.get("rope_parameters"));
    let kind = scaling
        .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
        .and_then(|t| t.as_str());
    Ok(kind == Some("llama3"))
}

/// The families MaxText's names are known for here.
fn check_family(family: Family, shape: &Shape) -> Result<()> {
    if !matches!(family, Family::Llama | Family::Mistral | Family::Qwen3) || shape.experts > 0 {
        return Err(unsupported(format!(
            "MaxText's tree is known here for Llama, Mistral and Qwen3 (LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM), not {} (Mixtral, Qwen3-MoE and Gemma are not built)",
            family.architecture()
        )));
    }
    if shape.bias || shape.qkv_bias {
        return Err(unsupported(
            "a model with linear or QKV biases: MaxText's Llama and Qwen3 have none".into(),
        ));
    }
    Ok(())
}

/// `{l}` filled.
fn at(pattern: &str, l: u64) -> String {
    pattern.replace("{l}", &l.to_string())
}

/// The scanned tree's layer prefix, and the unscanned tree's (`layers_<l>.`).
const SCANNED_LAYERS: &str = "decoder.layers.";
const UNSCANNED_LAYERS: &str = "decoder.layers_";

/// Layer `l`'s own name in the unscanned tree (`scan_layers=False`: MaxText's
/// `_create_and_register_layer` registers layer `l` as `layers_<l>`;
/// `LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING`'s `params-decoder-layers_{l}-...`) of the
/// scanned row `row` (`decoder.layers.<rest>`).
fn unscanned_name(row: &str, l: u64) -> String {
    let rest = row
        .strip_prefix(SCANNED_LAYERS)
        .expect("a layer row starts with decoder.layers.");
    format!("{UNSCANNED_LAYERS}{l}.{rest}")
}

/// A stacked shape without its layer axis (axis 1): one layer's array in the
/// unscanned tree.
fn unstacked(stacked: &[u64]) -> Vec<u64> {
    let mut s = stacked.to_vec();
    s.remove(1);
    s
}

/// A tensor of `out_shape` computed by `op` from the box `region` of `input` (named
/// `name`), one piece placed at `global` (its computation's coordinates: a tensor of
/// `out_shape`).
fn computed(
    name: &str,
    input: &SourceTensor,
    region: Region,
    op: Operation,
    out_shape: &[u64],
    global: Region,
) -> Result<SourcePiece> {
    let first = input
        .pieces
        .first()
        .ok_or_else(|| invalid(name, "holds no pieces".into()))?;
    let pieces = input
        .pieces
        .iter()
        .filter(|p| p.global.overlap(&region).is_some())
        .cloned()
        .collect();
    Ok(SourcePiece {
        file: first.file,
        tensor: first.tensor,
        global,
        local: Region::full(out_shape),
        view: None,
        compute: Some(Compute(Arc::new(Computed {
            op,
            inputs: vec![ComputeInput {
                name: name.to_string(),
                tensor: SourceTensor {
                    dtype: input.dtype,
                    shape: input.shape.clone(),
                    pieces,
                    copies: Vec::new(),
                },
                region,
            }],
        }))),
    })
}

/// `sqrt(head_dim)` as MaxText's hooks round it: computed in f64, then f32
/// (`np.dtype("float32").type(np.sqrt(head_dim))`), or its inverse so.
fn query_scale(head_dim: u64, to_hf: bool) -> f32 {
    let s = (head_dim as f64).sqrt();
    if to_hf {
        s as f32
    } else {
        (1.0 / s) as f32
    }
}

/// For a layer weight of `kind`, the Hugging Face tensor's shape, MaxText's stacked
/// shape, and the permutation that takes one layer's box of the MaxText tensor
/// (read as `shape`) to the Hugging Face tensor (`axes`).
struct Geometry {
    hf: Vec<u64>,
    maxtext: Vec<u64>,
    /// MaxText's layer box read as this (the layer axis dropped, maybe head_dim split
    /// into pairs).
    shape: Vec<u64>,
    axes: Vec<usize>,
}

fn geometry(kind: Kind, heads: u64, s: &Shape, name: &str) -> Geometry {
    let (e, l, d, f) = (s.hidden, s.layers, s.head_dim, s.ffn);
    match kind {
        Kind::IntoHeads { rope, .. } => {
            let (shape, axes) = if rope {
                // MaxText's row 2j + half is Hugging Face's half * d / 2 + j.
                (vec![e, heads, d / 2, 2], vec![1, 3, 2, 0])
            } else {
                (vec![e, heads, d], vec![1, 2, 0])
            };
            Geometry {
                hf: vec![heads * d, e],
                maxtext: vec![e, l, heads, d],
                shape,
                axes,
            }
        }
        Kind::OutOfHeads => Geometry {
            hf: vec![e, heads * d],
            maxtext: vec![heads, l, d, e],
            shape: vec![heads, d, e],
            axes: vec![2, 0, 1],
        },
        Kind::Dense => {
            // wi: [embed, layers, mlp] -> [mlp, embed]; wo: [mlp, layers, embed].
            let (i, o) = if name.contains(".wo.") {
                (f, e)
            } else {
                (e, f)
            };
            Geometry {
                hf: vec![o, i],
                maxtext: vec![i, l, o],
                shape: vec![i, o],
                axes: vec![1, 0],
            }
        }
        Kind::Scale => {
            // Qwen3's q/k norms scale head_dim; the layer norms the hidden size.
            let n = if name.contains("self_attention.") {
                d
            } else {
                e
            };
            Geometry {
                hf: vec![n],
                maxtext: vec![n, l],
                shape: vec![n],
                axes: vec![0],
            }
        }
        Kind::Same | Kind::Head => unreachable!("not a layer weight"),
    }
}

/// The inverse permutation.
fn inverse(axes: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; axes.len()];
    for (d, &a) in axes.iter().enumerate() {
        inv[a] = d;
    }
    inv
}

impl Checkpoint {
    /// Whether the tensors are a MaxText checkpoint's tree.
    pub(crate) fn is_maxtext(&self) -> bool {
        self.tensors.contains_key(MAXTEXT_EMBEDDING)
    }

    /// Replaces a MaxText checkpoint's tree by the Hugging Face model it is (computed
    /// tensors, see the module's doc); `opt_state.*` and `step` are left out, said in a
    /// note. `rope`: the query and key rows are interleaved pairs.
    ///
    /// # Errors
    /// A family not in the table; an unscanned tree (`layers_0`, ...); a tensor
    /// missing, of another shape than the config gives, or not the model's.
    pub(crate) fn maxtext_to_hf(
        &mut self,
        family: Family,
        shape: &Shape,
        rope: bool,
    ) -> Result<()> {
        check_family(family, shape)?;
        let unscanned_prefix = format!("{MAXTEXT_PREFIX}{UNSCANNED_LAYERS}");
        let scanned_prefix = format!("{MAXTEXT_PREFIX}{SCANNED_LAYERS}");
        let unscanned = self
            .tensors
            .keys()
            .any(|n| n.starts_with(&unscanned_prefix));
        if unscanned {
            if let Some(n) = self.tensors.keys().find(|n| n.starts_with(&scanned_prefix)) {
                return Err(invalid(
                    n,
                    "is a stacked layer weight (scan_layers=True), but the tree also has unscanned layers (decoder.layers_<l>): one MaxText model has one or the other".into(),
                ));
            }
        }
        let mut out: BTreeMap<String, SourceTensor> = BTreeMap::new();
        for row in rows(family, rope) {
            let layer_row = !matches!(row.kind, Kind::Same | Kind::Head);
            if unscanned && layer_row {
                self.unscanned_layers_to_hf(family, shape, &row, &mut out)?;
                continue;
            }
            let name = format!("{MAXTEXT_PREFIX}{}", row.maxtext);
            let Some(t) = self.tensors.remove(&name) else {
                if row.kind == Kind::Head && shape.tied {
                    continue;
                }
                if row.kind == Kind::Head {
                    return Err(invalid(
                        &name,
                        "missing: a MaxText model without logits_dense shares the embedding (logits_via_embedding), but the Hugging Face config says tie_word_embeddings false".into(),
                    ));
                }
                return Err(invalid(
                    &name,
                    format!(
                        "missing: MaxText's {} of {} layers has it",
                        family.architecture(),
                        shape.layers
                    ),
                ));
            };
            if row.kind == Kind::Head && shape.tied {
                return Err(invalid(
                    &name,
                    "is MaxText's own output layer (logits_via_embedding=false), but the Hugging Face config says tie_word_embeddings true: give the config of the untied model".into(),
                ));
            }
            match row.kind {
                Kind::Same => {
                    let want: &[u64] = if row.maxtext.starts_with("token_embedder") {
                        &[shape.vocab, shape.hidden]
                    } else {
                        &[shape.hidden]
                    };
                    let t = if row.maxtext.starts_with("token_embedder")
                        && t.shape.len() == 2
                        && t.shape[0] > shape.vocab
                        && t.shape[1] == shape.hidden
                    {
                        // MaxText pads the vocabulary; Hugging Face's is the config's.
                        let cut = [crate::layout::source::Block {
                            from: 0,
                            len: shape.vocab,
                            to: 0,
                        }];
                        t.regather(0, &cut, shape.vocab)
                    } else {
                        t
                    };
                    if t.shape != want {
                        return Err(invalid(
                            &name,
                            format!("has shape {:?}; the config gives {want:?}", t.shape),
                        ));
                    }
                    out.insert(row.hf.to_string(), t);
                }
                Kind::Head => {
                    let (e, v) = (shape.hidden, shape.vocab);
                    if t.shape.len() != 2 || t.shape[0] != e || t.shape[1] < v {
                        return Err(invalid(
                            &name,
                            format!("has shape {:?}; the config gives [{e}, {v}]", t.shape),
                        ));
                    }
                    let op = Operation::permute(&[e, v], vec![e, v], vec![1, 0], vec![v, e], None)?;
                    let piece = computed(
                        &name,
                        &t,
                        Region::from_ranges(&[0..e, 0..v]),
                        op,
                        &[v, e],
                        Region::full(&[v, e]),
                    )?;
                    out.insert(
                        row.hf.to_string(),
                        SourceTensor {
                            dtype: t.dtype,
                            shape: vec![v, e],
                            pieces: vec![piece],
                            copies: Vec::new(),
                        },
                    );
                }
                kind => {
                    let heads = if row.maxtext.contains(".query.") {
                        shape.heads
                    } else {
                        shape.groups
                    };
                    let heads = if kind == Kind::OutOfHeads {
                        shape.heads
                    } else {
                        heads
                    };
                    let g = geometry(kind, heads, shape, row.maxtext);
                    if t.shape != g.maxtext {
                        return Err(invalid(
                            &name,
                            format!(
                                "has shape {:?}; the config gives {:?} (layers stacked on axis 1)",
                                t.shape, g.maxtext
                            ),
                        ));
                    }
                    let scale = match kind {
                        Kind::IntoHeads { scaled: true, .. } => {
                            Some(query_scale(shape.head_dim, true))
                        }
                        _ => None,
                    };
                    let mut layer_box = t.shape.clone();
                    layer_box[1] = 1;
                    for l in 0..shape.layers {
                        let mut region = Region::full(&t.shape);
                        region.start[1] = l;
                        region.shape[1] = 1;
                        let op = Operation::permute(
                            &layer_box,
                            g.shape.clone(),
                            g.axes.clone(),
                            g.hf.clone(),
                            scale,
                        )?;
                        let piece = computed(&name, &t, region, op, &g.hf, Region::full(&g.hf))?;
                        out.insert(
                            at(row.hf, l),
                            SourceTensor {
                                dtype: t.dtype,
                                shape: g.hf.clone(),
                                pieces: vec![piece],
                                copies: Vec::new(),
                            },
                        );
                    }
                }
            }
        }
        if let Some(extra) = self.tensors.keys().find(|n| n.starts_with(MAXTEXT_PREFIX)) {
            return Err(invalid(
                extra,
                format!(
                    "is not a tensor of MaxText's {} as ckpt knows it (nothing written)",
                    family.architecture()
                ),
            ));
        }
        let left = self.tensors.len();
        if left > 0 {
            self.notes.push(format!(
                "{left} tensors of MaxText's training state (opt_state, step) are not carried"
            ));
        }
        self.tensors = out;
        self.strategy = None;
        self.notes.push(format!(
            "MaxText's {} tree as Hugging Face's {}: each layer's kernels transposed out of {}{}{}",
            if unscanned { "unscanned" } else { "scanned" },
            family.architecture(),
            if unscanned {
                "its own arrays (decoder.layers_<l>)"
            } else {
                "the stacked arrays"
            },
            if matches!(family, Family::Qwen3) {
                ""
            } else {
                "; the query kernel times sqrt(head_dim) (MaxText folds 1/sqrt(head_dim) into it)"
            },
            if rope {
                "; the query and key rows from MaxText's interleaved rotary pairs (LLaMARotaryEmbedding, rope_scaling llama3) to Hugging Face's halves"
            } else {
                ""
            }
        ));
        Ok(())
    }

    /// One row's weights of an unscanned tree (`decoder.layers_<l>.<rest>`, each the
    /// stacked array's layer box without the layer axis), removed from the tensors and
    /// put into `out` under Hugging Face's names: the same transposes as the scanned
    /// tree's, a norm's scale as it is.
    fn unscanned_layers_to_hf(
        &mut self,
        family: Family,
        shape: &Shape,
        row: &Row,
        out: &mut BTreeMap<String, SourceTensor>,
    ) -> Result<()> {
        let heads = if row.kind == Kind::OutOfHeads || row.maxtext.contains(".query.") {
            shape.heads
        } else {
            shape.groups
        };
        let g = geometry(row.kind, heads, shape, row.maxtext);
        let want = unstacked(&g.maxtext);
        let scale = match row.kind {
            Kind::IntoHeads { scaled: true, .. } => Some(query_scale(shape.head_dim, true)),
            _ => None,
        };
        for l in 0..shape.layers {
            let name = format!("{MAXTEXT_PREFIX}{}", unscanned_name(row.maxtext, l));
            let t = self.tensors.remove(&name).ok_or_else(|| {
                invalid(
                    &name,
                    format!(
                        "missing: MaxText's unscanned {} of {} layers has it",
                        family.architecture(),
                        shape.layers
                    ),
                )
            })?;
            if t.shape != want {
                return Err(invalid(
                    &name,
                    format!(
                        "has shape {:?}; the config gives {want:?} (one layer of an unscanned tree)",
                        t.shape
                    ),
                ));
            }
            let hf_name = at(row.hf, l);
            if row.kind == Kind::Scale {
                out.insert(hf_name, t);
                continue;
            }
            let op =
                Operation::permute(&want, g.shape.clone(), g.axes.clone(), g.hf.clone(), scale)?;
            let piece = computed(
                &name,
                &t,
                Region::full(&want),
                op,
                &g.hf,
                Region::full(&g.hf),
            )?;
            out.insert(
                hf_name,
                SourceTensor {
                    dtype: t.dtype,
                    shape: g.hf.clone(),
                    pieces: vec![piece],
                    copies: Vec::new(),
                },
            );
        }
        Ok(())
    }

    /// Replaces a Hugging Face model's tensors by MaxText's scanned parameter tree
    /// (`params.params.*`, the inverse of [`Checkpoint::maxtext_to_hf`]), or with
    /// `unscanned` its unscanned one (`decoder.layers_<l>.*`, `scan_layers=False`), for
    /// an Orbax step MaxText's `load_parameters_path` restores. The config is
    /// `target.config`, or the `config.json` beside the model.
    ///
    /// # Errors
    /// No Hugging Face config; a family not in the table; a tensor missing, of another
    /// shape than the config gives, or not the family's.
    pub fn maxtext_import(&mut self, target: &super::HfTarget, unscanned: bool) -> Result<()> {
        let path = target
            .config
            .clone()
            .or_else(|| self.carried.get("config.json").cloned())
            .ok_or_else(|| unsupported(
                "--format maxtext needs the model's Hugging Face config.json (beside the safetensors files, or --hf-config)".into(),
            ))?;
        let text = String::from_utf8_lossy(&crate::formats::read_small(&path)?).into_owned();
        let (family, shape) = hf::read_config(&text, &path.display().to_string())?;
        family.check(&shape)?;
        check_family(family, &shape)?;
        let rope = interleaved_rope(&path)?;
        let mut out: BTreeMap<String, SourceTensor> = BTreeMap::new();
        let mut used = 0usize;
        for row in rows(family, rope) {
            let name = format!("{MAXTEXT_PREFIX}{}", row.maxtext);
            match row.kind {
                Kind::Same => {
                    let t = self.tensors.get(row.hf).ok_or_else(|| {
                        invalid(
                            row.hf,
                            format!("missing: a {} has it", family.architecture()),
                        )
                    })?;
                    out.insert(name, t.clone());
                    used += 1;
                }
                Kind::Head => {
                    let (v, e) = (shape.vocab, shape.hidden);
                    let Some(t) = self.tensors.get(row.hf) else {
                        if shape.tied {
                            continue;
                        }
                        return Err(invalid(
                            row.hf,
                            "missing: the config says tie_word_embeddings false".into(),
                        ));
                    };
                    if shape.tied {
                        // transformers may save the tied copy; MaxText has none.
                        used += 1;
                        continue;
                    }
                    if t.shape != [v, e] {
                        return Err(invalid(
                            row.hf,
                            format!("has shape {:?}; the config gives [{v}, {e}]", t.shape),
                        ));
                    }
                    let op = Operation::permute(&[v, e], vec![v, e], vec![1, 0], vec![e, v], None)?;
                    let piece = computed(
                        row.hf,
                        t,
                        Region::full(&[v, e]),
                        op,
                        &[e, v],
                        Region::full(&[e, v]),
                    )?;
                    out.insert(
                        name,
                        SourceTensor {
                            dtype: t.dtype,
                            shape: vec![e, v],
                            pieces: vec![piece],
                            copies: Vec::new(),
                        },
                    );
                    used += 1;
                }
                kind => {
                    let heads = if kind == Kind::OutOfHeads || row.maxtext.contains(".query.") {
                        shape.heads
                    } else {
                        shape.groups
                    };
                    let g = geometry(kind, heads, &shape, row.maxtext);
                    let scale = match kind {
                        Kind::IntoHeads { scaled: true, .. } => {
                            Some(query_scale(shape.head_dim, false))
                        }
                        _ => None,
                    };
                    // The Hugging Face tensor read as the permuted layer box; the
                    // inverse permutation gives MaxText's layer box (layer axis 1).
                    let permuted: Vec<u64> = g.axes.iter().map(|&a| g.shape[a]).collect();
                    let back = inverse(&g.axes);
                    let mut layer_box = g.maxtext.clone();
                    layer_box[1] = 1;
                    let one_layer = unstacked(&g.maxtext);
                    let mut pieces = Vec::new();
                    let mut dtype = None;
                    for l in 0..shape.layers {
                        let hf_name = at(row.hf, l);
                        let t = self.tensors.get(&hf_name).ok_or_else(|| {
                            invalid(
                                &hf_name,
                                format!(
                                    "missing: a {} of {} layers has it",
                                    family.architecture(),
                                    shape.layers
                                ),
                            )
                        })?;
                        if t.shape != g.hf {
                            return Err(invalid(
                                &hf_name,
                                format!("has shape {:?}; the config gives {:?}", t.shape, g.hf),
                            ));
                        }
                        if unscanned {
                            // Layer l's own array: the layer box without its axis (a
                            // norm's scale is Hugging Face's weight as it is).
                            let own = format!("{MAXTEXT_PREFIX}{}", unscanned_name(row.maxtext, l));
                            let t = if kind == Kind::Scale {
                                t.clone()
                            } else {
                                let op = Operation::permute(
                                    &g.hf,
                                    permuted.clone(),
                                    back.clone(),
                                    one_layer.clone(),
                                    scale,
                                )?;
                                let piece = computed(
                                    &hf_name,
                                    t,
                                    Region::full(&g.hf),
                                    op,
                                    &one_layer,
                                    Region::full(&one_layer),
                                )?;
                                SourceTensor {
                                    dtype: t.dtype,
                                    shape: one_layer.clone(),
                                    pieces: vec![piece],
                                    copies: Vec::new(),
                                }
                            };
                            out.insert(own, t);
                            used += 1;
                            continue;
                        }
                        if dtype.is_some_and(|d| d != t.dtype) {
                            return Err(invalid(
                                &hf_name,
                                "has another dtype than layer 0's: MaxText stacks the layers in one array".into(),
                            ));
                        }
                        dtype = Some(t.dtype);
                        let op = Operation::permute(
                            &g.hf,
                            permuted.clone(),
                            back.clone(),
                            layer_box.clone(),
                            scale,
                        )?;
                        let mut global = Region::full(&g.maxtext);
                        global.start[1] = l;
                        global.shape[1] = 1;
                        pieces.push(computed(
                            &hf_name,
                            t,
                            Region::full(&g.hf),
                            op,
                            &layer_box,
                            global,
                        )?);
                        used += 1;
                    }
                    if unscanned {
                        continue;
                    }
                    out.insert(
                        name,
                        SourceTensor {
                            dtype: dtype.unwrap_or(crate::layout::Dtype::F32),
                            shape: g.maxtext.clone(),
                            pieces,
                            copies: Vec::new(),
                        },
                    );
                }
            }
        }
        if used != self.tensors.len() {
            let known: Vec<String> = rows(family, rope)
                .iter()
                .flat_map(|r| {
                    if r.hf.contains("{l}") {
                        (0..shape.layers).map(|l| at(r.hf, l)).collect()
                    } else {
                        vec![r.hf.to_string()]
                    }
                })
                .collect();
            if let Some(extra) = self.tensors.keys().find(|n| !known.contains(n)) {
                return Err(invalid(
                    extra,
                    format!(
                        "is not a tensor of MaxText's {} (nothing written)",
                        family.architecture()
                    ),
                ));
            }
        }
        self.tensors = out;
        self.strategy = None;
        self.notes.push(format!(
            "Hugging Face's {} as MaxText's {}{}{}{}",
            family.architecture(),
            if unscanned {
                "unscanned tree (params.params.*, each layer its own arrays: decoder.layers_<l>, scan_layers=False)"
            } else {
                "scanned tree (params.params.*, layers stacked on axis 1)"
            },
            if matches!(family, Family::Qwen3) {
                ""
            } else {
                "; the query kernel times 1/sqrt(head_dim)"
            },
            if rope {
                "; the query and key rows as interleaved rotary pairs (MaxText's llama3.1 models)"
            } else {
                ""
            },
            if shape.tied {
                "; tied: no logits_dense (MaxText's logits_via_embedding=true, normalize_embedding_logits=false)"
            } else {
                ""
            }
        ));
        Ok(())
    }
}

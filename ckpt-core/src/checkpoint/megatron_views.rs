//! Views of a Megatron legacy checkpoint's fused and padded tensors ([`Views`]), as
//! new global tensors whose pieces are cut from the stored ones (nothing is copied
//! until the output is written):
//! - the fused QKV projection split into query, key and value: megatron-core's
//!   `SelfAttention.get_query_key_value_tensors` views the projection's output rows as
//!   `[num_query_groups, (heads/groups + 2) * kv_channels]` and splits each group into
//!   its `heads/groups` query heads, one key head and one value head, `kv_channels`
//!   rows each. So `linear_q` is the groups' query blocks in order (heads in their
//!   natural order), `linear_k` and `linear_v` one block per group.
//! - the vocabulary without the rows that pad it for the tensor-parallel size: the
//!   first `args.vocab_size` of `args.padded_vocab_size` rows of the word embedding and
//!   of the output layer (megatron's `_vocab_size_with_padding` appends the padding).

use super::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::megatron::{grouped_split, is_grouped_weight, Args};
use crate::layout::select::Views;
use crate::layout::source::{Block, SourceTensor};

/// The tensors padded with the vocabulary, by the end of their names (their optimizer
/// state's names hold them too).
const VOCAB_TENSORS: [&str; 2] = ["embedding.word_embeddings.weight", "output_layer.weight"];
/// The fused projection's name part, and the names of its parts.
const QKV: &str = "linear_qkv";
const PARTS: [&str; 3] = ["linear_q", "linear_k", "linear_v"];

/// Whether `name` holds `part` as whole dotted components.
fn holds(name: &str, part: &str) -> bool {
    name.match_indices(part).any(|(i, _)| {
        let before = i == 0 || name.as_bytes()[i - 1] == b'.';
        let after = name[i + part.len()..].is_empty() || name[i + part.len()..].starts_with('.');
        before && after
    })
}

fn unsupported(problem: String) -> Error {
    Error::Unsupported { problem }
}

impl Checkpoint {
    /// Gives the Megatron checkpoint's fused and padded tensors as `views` says; notes
    /// what was done (or kept).
    pub(super) fn megatron_views(&mut self, args: &Args, views: Views) -> Result<()> {
        if let (Some(v), Some(pv)) = (args.vocab, args.padded_vocab) {
            if pv > v && views.unpad_vocab {
                let names = self.names_where(|n| VOCAB_TENSORS.iter().any(|t| holds(n, t)));
                for name in names {
                    self.view(
                        &name,
                        &name,
                        &[Block {
                            from: 0,
                            len: v,
                            to: 0,
                        }],
                        v,
                        pv,
                    )?;
                }
                self.notes.push(format!(
                    "the vocabulary is unpadded from {pv} to {v} rows (args.padded_vocab_size, args.vocab_size; --keep-vocab-padding keeps the padding rows)"
                ));
            } else if pv > v {
                self.notes.push(format!(
                    "the vocabulary is padded from {v} to {pv} rows (args.vocab_size, args.padded_vocab_size); the embedding and output layer keep the padding"
                ));
            }
        }
        if views.per_layer {
            self.ungroup_experts(args)?;
        }
        if views.split_qkv {
            let sizes = (args.heads, args.query_groups, args.kv());
            let (Some(heads), Some(groups), Some(kv)) = sizes else {
                return Err(unsupported(
                    "--split-qkv: the checkpoint's args lack num_attention_heads, num_query_groups or kv_channels".into(),
                ));
            };
            if groups == 0 || heads % groups != 0 {
                return Err(unsupported(format!(
                    "--split-qkv: {heads} attention heads in {groups} query groups do not divide"
                )));
            }
            let per_group = heads / groups;
            let group_rows = (per_group + 2) * kv;
            let [q, k, v] = crate::hf::qkv_blocks(groups, per_group, kv);
            let parts = [
                (PARTS[0], q.0, q.1),
                (PARTS[1], k.0, k.1),
                (PARTS[2], v.0, v.1),
            ];
            let fused = self.names_where(|n| {
                holds(n, &format!("{QKV}.weight")) || holds(n, &format!("{QKV}.bias"))
            });
            for name in fused {
                for (part, blocks, rows) in &parts {
                    let new = name.replacen(&format!("{QKV}."), &format!("{part}."), 1);
                    self.view(&name, &new, blocks, *rows, groups * group_rows)?;
                }
                self.tensors.remove(&name);
                if let Some(s) = &mut self.strategy {
                    s.tensors.remove(&name);
                }
            }
            self.notes.push(format!(
                "fused QKV projections split into {} ({groups} query groups of {per_group} query heads, one key and one value head each, {kv} rows per head)",
                PARTS.join(", ")
            ));
        }
        Ok(())
    }

    /// Gives megatron-core's GroupedMLP weights (`decoder.layers.<l>.mlp.experts.weight1`
    /// `[H, E*F1]` and `weight2` `[E*F, H]`, as an EP 1 model holds them) as each
    /// expert's `linear_fc1.weight` `[F1, H]` and `linear_fc2.weight` `[H, F]` under
    /// SequentialMLP's names and global ids, the tensors a dist_ckpt and a Hugging Face
    /// model hold: GroupedMLP views expert `g`'s part of `weight1` as the run
    /// `g*H*F1..` read as `[H, F1]`, and its `linear_fc1` is that transposed
    /// (`GroupedMLP.sharded_state_dict`; `weight2` likewise with `[F, H]`). The same
    /// stored bytes are read, through a transposed [`crate::layout::source::StoredView`]. A checkpoint
    /// without GroupedMLP weights is left as it is.
    ///
    /// # Errors
    /// A grouped weight of another shape than the args give, or whose pieces are not
    /// runs of whole experts.
    pub fn grouped_experts_as_sequential(&mut self) -> Result<()> {
        if !self.tensors.keys().any(|n| is_grouped_weight(n)) {
            return Ok(());
        }
        let args = self.megatron_state()?.args;
        self.ungroup_experts(&args)
    }

    fn ungroup_experts(&mut self, args: &Args) -> Result<()> {
        let names = self.names_where(is_grouped_weight);
        if names.is_empty() {
            return Ok(());
        }
        let invalid = |name: &str, problem: String| Error::InvalidTensor {
            tensor: name.to_string(),
            problem,
        };
        for name in names {
            let split = grouped_split(&name, args, 1, 0)
                .map_err(|p| invalid(&name, p))?
                .ok_or_else(|| invalid(&name, "not a GroupedMLP weight".into()))?;
            // (grouped_split has checked that args give the expert count.)
            let experts = args.moe.experts.unwrap_or(1);
            let t = &self.tensors[&name];
            if t.shape != split.global {
                return Err(invalid(
                    &name,
                    format!("has shape {:?}, but args give {:?}", t.shape, split.global),
                ));
            }
            // Expert g's run read as `[H, F1]` (`weight1 [H, E*F1]`) or `[F, H]`
            // (`weight2 [E*F, H]`).
            let [h_or_ef, f1_or_h] = split.global[..] else {
                return Err(invalid(&name, "a GroupedMLP weight is 2-D".into()));
            };
            let (prefix, rows, cols, param) = match name.strip_suffix("weight1") {
                Some(prefix) => (prefix, h_or_ef, f1_or_h / experts, "linear_fc1.weight"),
                None => (
                    name.strip_suffix("weight2").unwrap_or(&name),
                    h_or_ef / experts,
                    f1_or_h,
                    "linear_fc2.weight",
                ),
            };
            let files = &self.files;
            let stored = |f: usize, i: usize| files[f].tensors()[i].shape.clone();
            let mut per_expert = Vec::new();
            for g in 0..experts {
                let view = t
                    .transposed_run(g * rows * cols, rows, cols, stored)
                    .map_err(|p| invalid(&name, format!("expert {g}: {p}")))?;
                per_expert.push((format!("{prefix}local_experts.{g}.{param}"), view));
            }
            if let Some(s) = &mut self.strategy {
                if let Some(l) = s.tensors.remove(&name) {
                    for (n, v) in &per_expert {
                        let mut l = l.clone();
                        l.shape.clone_from(&v.shape);
                        s.tensors.insert(n.clone(), l);
                    }
                }
            }
            self.tensors.remove(&name);
            self.tensors.extend(per_expert);
        }
        self.notes.push(
            "GroupedMLP's weight1/weight2 given as each expert's linear_fc1/linear_fc2 (their runs transposed, as megatron-core's dist_ckpt holds them), under global ids".into(),
        );
        Ok(())
    }

    fn names_where(&self, f: impl Fn(&str) -> bool) -> Vec<String> {
        self.tensors.keys().filter(|n| f(n)).cloned().collect()
    }

    /// Adds (or replaces) `new`: blocks along dim 0 of `name`, `rows` long. `name` must
    /// have `want` rows (the args say so; the rules checked it when reading).
    fn view(
        &mut self,
        name: &str,
        new: &str,
        blocks: &[Block],
        rows: u64,
        want: u64,
    ) -> Result<()> {
        let t: &SourceTensor = &self.tensors[name];
        if t.shape.first() != Some(&want) {
            return Err(Error::InvalidTensor {
                tensor: name.to_string(),
                problem: format!(
                    "has shape {:?}, but args give it {want} rows: cannot view it as {new}",
                    t.shape
                ),
            });
        }
        let view = t.regather(0, blocks, rows);
        if let Some(s) = &mut self.strategy {
            if let Some(l) = s.tensors.get(name) {
                let mut l = l.clone();
                l.shape.clone_from(&view.shape);
                s.tensors.insert(new.to_string(), l);
            }
        }
        self.tensors.insert(new.to_string(), view);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::holds;

    #[test]
    fn names_hold_parts_as_whole_components() {
        assert!(holds(
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "linear_qkv.weight"
        ));
        assert!(holds(
            "optim.decoder.layers.0.self_attention.linear_qkv.weight.exp_avg",
            "linear_qkv.weight"
        ));
        assert!(!holds(
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
            "linear_qkv.weight"
        ));
        assert!(holds(
            "embedding.word_embeddings.weight",
            "embedding.word_embeddings.weight"
        ));
        assert!(!holds(
            "x_embedding.word_embeddings.weight",
            "embedding.word_embeddings.weight"
        ));
    }
}

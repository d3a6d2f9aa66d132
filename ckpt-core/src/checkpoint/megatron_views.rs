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
use crate::formats::megatron::Args;
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

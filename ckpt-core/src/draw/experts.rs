//! The expert map of a mixture of experts: which file (rank) holds which expert.
//!
//! A MoE checkpoint names one tensor per expert (`…local_experts.<e>.…` in Megatron,
//! `…deepspeed_experts.<e>.…` in DeepSpeed, `…experts.<e>.…` in Hugging Face's
//! Mixtral and Qwen-MoE), each under its global id. Drawing each tensor on its own
//! shows its TP split but not the expert-parallel one, which is across tensors: this
//! draws, for each family of such tensors (the name with the expert id as `*`), a
//! table of files by experts.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The path components that an expert id follows.
const EXPERT_LISTS: [&str; 3] = ["experts", "local_experts", "deepspeed_experts"];

/// `name` as (its family: the expert id replaced by `*`, the expert id), when it is
/// one expert's tensor.
pub(super) fn expert_of(name: &str) -> Option<(String, u64)> {
    let parts: Vec<&str> = name.split('.').collect();
    let at = parts
        .windows(2)
        .position(|w| EXPERT_LISTS.contains(&w[0]) && w[1].parse::<u64>().is_ok())?;
    let id = parts[at + 1].parse().ok()?;
    let mut family = parts.clone();
    family[at + 1] = "*";
    Some((family.join("."), id))
}

/// One tensor as the map needs it: its name, its element count, and the elements each
/// file holds of it (owned pieces and replicas alike).
pub(super) struct Held {
    pub(super) name: String,
    pub(super) numel: u64,
    pub(super) by_file: Vec<(usize, u64)>,
}

/// The expert maps of `tensors` (files labelled `labels`) that are experts' (families
/// of at least two experts), or an empty string when there are none.
///
/// Each cell says what the file holds of that expert's tensor: `#` all of it, `+` a
/// part (a tensor-parallel or ZeRO piece), `.` nothing.
pub(super) fn expert_maps(labels: &[String], tensors: &[Held]) -> String {
    let mut families: BTreeMap<String, BTreeMap<u64, &Held>> = BTreeMap::new();
    for t in tensors {
        if let Some((family, id)) = expert_of(&t.name) {
            families.entry(family).or_default().insert(id, t);
        }
    }
    let mut out = String::new();
    for (family, experts) in families.iter().filter(|(_, e)| e.len() > 1) {
        // Per file, per expert: elements held.
        let mut held = vec![vec![0u64; experts.len()]; labels.len()];
        let mut whole = Vec::with_capacity(experts.len());
        for (col, t) in experts.values().enumerate() {
            whole.push(t.numel);
            for &(f, n) in &t.by_file {
                held[f][col] += n;
            }
        }
        let ids: Vec<u64> = experts.keys().copied().collect();
        let _ = writeln!(
            out,
            "experts of `{family}`: {} experts, which file holds which (# all, + part, . none)",
            ids.len()
        );
        let width = labels.iter().map(String::len).max().unwrap_or(0).max(6);
        // Column headers: the expert ids, digit by digit (one column per expert).
        let digits = ids.iter().map(|i| i.to_string().len()).max().unwrap_or(1);
        for d in 0..digits {
            let _ = write!(
                out,
                "{:>width$}  ",
                if d + 1 == digits { "expert" } else { "" }
            );
            for i in &ids {
                let s = format!("{i:>digits$}");
                out.push(s.as_bytes()[d] as char);
            }
            out.push('\n');
        }
        for (f, label) in labels.iter().enumerate() {
            if held[f].iter().all(|&n| n == 0) {
                continue;
            }
            let _ = write!(out, "{label:>width$}  ");
            for (col, &n) in held[f].iter().enumerate() {
                out.push(match n {
                    0 => '.',
                    n if n >= whole[col] => '#',
                    _ => '+',
                });
            }
            out.push('\n');
        }
        let none: Vec<&str> = labels
            .iter()
            .enumerate()
            .filter(|(f, _)| held[*f].iter().all(|&n| n == 0))
            .map(|(_, l)| l.as_str())
            .collect();
        if !none.is_empty() {
            let _ = writeln!(out, "{:>width$}  {}", "none:", none.join(", "));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_ids_are_found_in_each_libraries_names() {
        for (name, family, id) in [
            (
                "decoder.layers.0.mlp.experts.local_experts.12.linear_fc1.weight",
                "decoder.layers.0.mlp.experts.local_experts.*.linear_fc1.weight",
                12,
            ),
            (
                "blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.3.fc2.bias",
                "blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.*.fc2.bias",
                3,
            ),
            (
                "model.layers.0.block_sparse_moe.experts.7.w1.weight",
                "model.layers.0.block_sparse_moe.experts.*.w1.weight",
                7,
            ),
        ] {
            assert_eq!(expert_of(name), Some((family.to_string(), id)), "{name}");
        }
        // dist_ckpt's stacked experts and a router are not one expert's.
        assert_eq!(
            expert_of("decoder.layers.mlp.experts.experts.linear_fc1.weight"),
            None
        );
        assert_eq!(expert_of("model.layers.0.mlp.gate.weight"), None);
    }
}

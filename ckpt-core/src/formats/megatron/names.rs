//! What megatron-core's GPT tensors are, by their global names: experts, GroupedMLP
//! weights, buffers. A leaf: the legacy reader and the optimizer-state reader both ask.

/// Whether `name` is a persistent buffer of megatron-core's GPT model, saved in its
/// state dict but not a parameter (no optimizer state): the router's `expert_bias`.
pub(crate) fn is_buffer_name(name: &str) -> bool {
    name.ends_with(".mlp.router.expert_bias")
}

/// Whether `name` is an expert's tensor: a `SequentialMLP` expert's
/// (`…mlp.experts.local_experts.<g>.…`) or a `GroupedMLP` weight.
pub(crate) fn is_expert_name(name: &str) -> bool {
    name.contains(".mlp.experts.local_experts.") || is_grouped_weight(name)
}

/// Whether `name` is a layer's megatron-core `GroupedMLP` weight
/// (`decoder.layers.<l>.mlp.experts.weight1` or `weight2`).
pub(crate) fn is_grouped_weight(name: &str) -> bool {
    name.strip_prefix("decoder.layers.")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(_, tail)| matches!(tail, "mlp.experts.weight1" | "mlp.experts.weight2"))
}

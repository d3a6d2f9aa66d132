//! Megatron's distributed optimizer state (`distrib_optim.pt`) written by megatron-core
//! itself (tests/fixtures/megatron/tp2pp2dp2_distopt, made by
//! scripts/fixtures/megatron_distopt.py: TP=2 x PP=2 x DP=2 on gloo, one real
//! DistributedOptimizer step, save_parameter_state): merged, the fp32 master weights and
//! Adam moments equal what the optimizer held before the save (`optim_full.safetensors`).

use crate::util::{copy_dir, full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron/tp2pp2dp2_distopt")
}

fn legacy() -> String {
    fixtures().join("legacy").display().to_string()
}

fn expected() -> BTreeMap<String, Vec<u8>> {
    full_tensors(&fixtures().join("optim_full.safetensors"))
}

fn legacy_copy(d: &Dir) -> PathBuf {
    let to = d.path("legacy");
    copy_dir(&fixtures().join("legacy"), &to);
    to
}

const OPT_01_001: &str = "iter_0000001/mp_rank_01_001/distrib_optim.pt";

/// Every tensor of both merged files (model.safetensors and optimizer.safetensors).
fn merged(d: &Dir, out: &str) -> BTreeMap<String, Vec<u8>> {
    full_tensors(&d.path(out))
}

#[test]
fn distributed_optimizer_state_merges_byte_exactly() {
    let d = Dir::new();
    let want = expected();
    let states = want.keys().filter(|k| k.starts_with("optim.")).count();
    assert!(states > 0 && states % 3 == 0, "{states}");
    d.ok(&["verify", &legacy()]);
    d.ok(&["merge", &legacy(), "--keep-vocab-padding", "-o", "m"]);
    // The optimizer's states in optimizer.safetensors, the weights beside them.
    assert!(d.path("m/optimizer.safetensors").is_file());
    let got = merged(&d, "m");
    for (k, v) in &want {
        assert_eq!(got.get(k), Some(v), "{k}");
    }
    assert_eq!(
        got.len(),
        want.len(),
        "{:?}",
        got.keys()
            .filter(|k| !want.contains_key(*k))
            .collect::<Vec<_>>()
    );
    // By default the vocabulary's padding rows (64 -> 50, args.vocab_size) go from the
    // states as from the weights: the first 50 rows of 16 F32 each.
    d.ok(&["merge", &legacy(), "-o", "u"]);
    let unpadded = merged(&d, "u");
    for k in [
        "embedding.word_embeddings.weight",
        "optim.embedding.word_embeddings.weight.exp_avg",
        "optim.output_layer.weight.exp_avg_sq",
        "optim.output_layer.weight.fp32",
    ] {
        assert_eq!(unpadded[k], want[k][..50 * 16 * 4], "{k}");
    }
    // One real Adam step: the moments are not zero and the master weight is the weight
    // (fp32 training: the main parameter is the model parameter).
    let w = &want["decoder.layers.0.mlp.linear_fc1.weight"];
    assert_eq!(
        &want["optim.decoder.layers.0.mlp.linear_fc1.weight.fp32"],
        w
    );
    assert!(
        want["optim.decoder.layers.0.mlp.linear_fc1.weight.exp_avg_sq"]
            .iter()
            .any(|&b| b != 0)
    );
}

#[test]
fn distributed_optimizer_state_reshards_like_the_weights() {
    let d = Dir::new();
    let want = expected();
    d.ok(&["reshard", &legacy(), "--to", "4", "-o", "r4"]);
    d.ok(&["merge", "r4", "-o", "m4"]);
    let got = merged(&d, "m4");
    for (k, v) in &want {
        assert_eq!(got.get(k), Some(v), "{k}");
    }
    // And the weights only, as before.
    d.ok(&["merge", &legacy(), "--exclude", "optim.*", "-o", "w"]);
    assert!(!d.path("w/optimizer.safetensors").exists());
}

#[test]
fn a_missing_distrib_optim_file_is_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    std::fs::remove_file(l.join(OPT_01_001)).unwrap();
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("mp_rank_01_001/distrib_optim.pt") && o.stderr.contains("missing"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

#[test]
fn a_truncated_distrib_optim_file_is_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    let f = l.join(OPT_01_001);
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("mp_rank_01_001/distrib_optim.pt")
            && o.stderr.contains("Megatron distributed optimizer state"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

/// A `numel_unpadded` that the rank's parameters do not make (3456 -> 3520 in the pickle,
/// the state tensors left as they are): the buffer layout is refused by name.
#[test]
fn bucket_sizes_that_do_not_add_up_are_named() {
    let d = Dir::new();
    let l = legacy_copy(&d);
    let f = l.join("iter_0000001/mp_rank_00_000/distrib_optim.pt");
    let mut b = std::fs::read(&f).unwrap();
    let key = b"numel_unpadded";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // BINPUT n, then BININT2 3456 (0x0d80, little-endian).
    assert_eq!(&b[at..at + 5], b"q#M\x80\x0d");
    b[at + 3] = 0xc0;
    std::fs::write(&f, b).unwrap();
    let o = d.fails(&["merge", "legacy", "-o", "m"]);
    assert!(
        o.stderr.contains("mp_rank_00_000/distrib_optim.pt")
            && o.stderr.contains("numel_unpadded is 3520")
            && o.stderr
                .contains("bucket sizes do not add up to the parameters"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

/// The optimizer states of a merged dist_ckpt (`got`, dist_ckpt's names: layers stacked
/// along dim 0 under `decoder.layers.<rest>`, the master weight under `master`) against
/// the optimizer's own (`want`, legacy names, one tensor per layer): every state of every
/// parameter byte-equal, with the parameter's shape (`shapes` of `got`, stacked: the
/// layers first). Returns how many were checked.
fn assert_dist_ckpt_states(
    got: &BTreeMap<String, Vec<u8>>,
    shapes: &BTreeMap<String, Vec<u64>>,
    want: &BTreeMap<String, Vec<u8>>,
    want_shapes: &BTreeMap<String, Vec<u64>>,
    master: &str,
) -> usize {
    // megatron-core's local layer spec saves the norms under TransformerEngine's names.
    let dist_name = |rest: &str| {
        for (legacy, te) in [
            ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
            ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
        ] {
            if let Some(tail) = rest.strip_prefix(legacy) {
                return format!("{te}{tail}");
            }
        }
        rest.to_string()
    };
    let mut checked = 0;
    for (name, want_bytes) in want {
        let Some(body) = name.strip_prefix("optim.") else {
            continue;
        };
        let (param, state) = body.rsplit_once('.').unwrap();
        let state = if state == "fp32" { master } else { state };
        let layer = param
            .strip_prefix("decoder.layers.")
            .and_then(|r| r.split_once('.'))
            .map(|(l, rest)| (l.parse::<usize>().unwrap(), dist_name(rest)));
        let (bytes, shape) = match layer {
            // Layer L of the stacked tensor: its L-th equal part.
            Some((l, rest)) => {
                let key = format!("optimizer.state.{state}.decoder.layers.{rest}");
                let all = &got[&key];
                let per = all.len() / 4;
                (
                    all[l * per..(l + 1) * per].to_vec(),
                    shapes[&key][1..].to_vec(),
                )
            }
            None => {
                let key = format!("optimizer.state.{state}.{param}");
                (got[&key].clone(), shapes[&key].clone())
            }
        };
        assert_eq!(&bytes, want_bytes, "{name}");
        assert_eq!(&shape, &want_shapes[name], "{name}");
        checked += 1;
    }
    checked
}

/// Every tensor's shape.
fn shapes_of(path: &Path) -> BTreeMap<String, Vec<u64>> {
    let ck = ckpt_core::Checkpoint::open(&[path.to_path_buf()]).expect("open");
    ck.tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape.clone()))
        .collect()
}

/// dist_ckpt (`--ckpt-format torch_dist`) with the distributed optimizer's state, as
/// megatron-core's own `dist_checkpointing.save` writes it from
/// `DistributedOptimizer.sharded_state_dict(..., fully_reshardable)` (the same run as the
/// legacy files): `optimizer.state.{param,exp_avg,exp_avg_sq}.<name>` are ShardedTensors
/// in model space, layers stacked along dim 0 as the model's, so ckpt reads them as any
/// DCP tensors. Every state of every parameter merges byte-equal to the optimizer's own.
#[test]
fn dist_ckpt_optimizer_states_merge_to_the_optimizers_own() {
    let d = Dir::new();
    let dist = fixtures().join("dist_ckpt").display().to_string();
    d.ok(&["merge", &dist, "-o", "m"]);
    let got = full_tensors(&d.path("m"));
    let want = fixtures().join("optim_full.safetensors");
    let checked = assert_dist_ckpt_states(
        &got,
        &shapes_of(&d.path("m")),
        &expected(),
        &shapes_of(&want),
        "param",
    );
    assert_eq!(checked, 53 * 3);
    // Resharded like any DCP source, the states come back the same.
    d.ok(&["reshard", &dist, "--to", "2", "-o", "r2"]);
    d.ok(&["merge", "r2", "-o", "m2"]);
    assert_eq!(full_tensors(&d.path("m2")), got);
}

/// megatron-core <= 0.15's default sharding type, `fully_sharded_model_space`
/// (tests/fixtures/megatron/tp2pp2dp2_flat, megatron-core 0.15.3, the same tiny GPT and
/// step): `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>` hold each dp rank's
/// `flattened_range` of its TP-local chunk, stored in the reformulated shape
/// `axis_fragmentations + (chunk elements,)`.
fn flat_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron/tp2pp2dp2_flat")
}

fn flat_dist() -> String {
    flat_fixtures().join("dist_ckpt").display().to_string()
}

/// The flattened fixture's dist_ckpt copied into `d`, its `.metadata` edited by `edit`.
fn flat_copy_with(d: &Dir, edit: impl Fn(&mut Vec<u8>)) -> String {
    let to = d.path("dist");
    copy_dir(&flat_fixtures().join("dist_ckpt"), &to);
    let meta = to.join(".metadata");
    let mut b = std::fs::read(&meta).unwrap();
    edit(&mut b);
    std::fs::write(&meta, b).unwrap();
    to.display().to_string()
}

/// Renames every pickled string `from` (SHORT_BINUNICODE) to `to`, of the same length.
fn rename_string(b: &mut [u8], from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut pat = vec![0x8c, u8::try_from(from.len()).unwrap()];
    pat.extend_from_slice(from.as_bytes());
    let mut n = 0;
    let mut i = 0;
    while let Some(at) = b[i..].windows(pat.len()).position(|w| w == pat.as_slice()) {
        b[i + at + 2..i + at + pat.len()].copy_from_slice(to.as_bytes());
        i += at + pat.len();
        n += 1;
    }
    assert!(n > 0, "`{from}` is not in the pickle");
}

/// The states merge to the parameter's real shape (not `[L, tp, 1, numel]`) and bytes,
/// equal to the optimizer's own; resharded, they come back the same.
#[test]
fn flattened_optimizer_states_merge_to_the_optimizers_own() {
    let d = Dir::new();
    let dist = flat_dist();
    d.ok(&["merge", &dist, "-o", "m"]);
    let got = full_tensors(&d.path("m"));
    let want = flat_fixtures().join("optim_full.safetensors");
    let shapes = shapes_of(&d.path("m"));
    let checked = assert_dist_ckpt_states(
        &got,
        &shapes,
        &full_tensors(&want),
        &shapes_of(&want),
        "fp32_param",
    );
    assert_eq!(checked, 53 * 3);
    // The stacked shape itself, and the fused QKV state whose layer 1 two dp ranks split
    // (elements 0..192 and 192..256 of each TP chunk).
    assert_eq!(
        shapes["optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.weight"],
        vec![4, 16, 16]
    );
    assert_eq!(
        shapes["optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"],
        vec![4, 32, 16]
    );
    // The model weights beside them, as in any dist_ckpt.
    assert_eq!(
        shapes["decoder.layers.self_attention.linear_qkv.weight"],
        vec![4, 32, 16]
    );
    d.ok(&["reshard", &dist, "--to", "2", "-o", "r2"]);
    d.ok(&["merge", "r2", "-o", "m2"]);
    assert_eq!(full_tensors(&d.path("m2")), got);
}

/// A `.metadata` without `mcore_data` says nothing of flattening: the model tensor's
/// shape does (the reformulation of it), and the states merge the same.
#[test]
fn without_mcore_data_the_model_tensors_give_the_shapes() {
    let d = Dir::new();
    let dist = flat_copy_with(&d, |b| rename_string(b, "mcore_data", "mcore_datX"));
    d.ok(&["merge", &dist, "-o", "m"]);
    let want = full_tensors(&d.path("m"));
    d.ok(&["merge", &flat_dist(), "-o", "m0"]);
    assert_eq!(want, full_tensors(&d.path("m0")));
}

/// Without `mcore_data` and without the model tensor, a `[1, .., 1, n]`-chunked
/// optimizer state could be flattened or not: refused by name, nothing written.
#[test]
fn a_flattened_state_without_its_model_tensor_is_refused_by_name() {
    let d = Dir::new();
    let key = "decoder.layers.self_attention.linear_proj.weight";
    let dist = flat_copy_with(&d, |b| {
        rename_string(b, "mcore_data", "mcore_datX");
        rename_string(b, key, "decoder.layers.self_attention.linear_proj.weighX");
    });
    let o = d.fails(&["merge", &dist, "-o", "m"]);
    assert!(
        o.stderr.contains(&format!("optimizer.state.exp_avg.{key}"))
            && o.stderr.contains(&format!("no model tensor `{key}`"))
            && o.stderr.contains(".metadata"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
    // With mcore_data the checkpoint says it itself: the model tensor is not needed.
    let d = Dir::new();
    let dist = flat_copy_with(&d, |b| {
        rename_string(b, key, "decoder.layers.self_attention.linear_proj.weighX");
    });
    d.ok(&["merge", &dist, "-o", "m"]);
}

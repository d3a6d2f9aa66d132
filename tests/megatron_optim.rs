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

/// Where the state `state` (`fp32`, `exp_avg`, `exp_avg_sq`) of the legacy-named
/// parameter `param` lies in a dist_ckpt merge: `optim.<key>.<state>`, `<key>` the key
/// of megatron-core's sharded state dict, whose layers are stacked along dim 0 (4
/// layers) and whose norms have TransformerEngine's names (megatron-core's local layer
/// spec saves them so); and for a transformer layer, its index in the stack.
fn dist_ckpt_key(param: &str, state: &str) -> (String, Option<usize>) {
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
    match param
        .strip_prefix("decoder.layers.")
        .and_then(|r| r.split_once('.'))
    {
        Some((l, rest)) => (
            format!("optim.decoder.layers.{}.{state}", dist_name(rest)),
            Some(l.parse().unwrap()),
        ),
        None => (format!("optim.{param}.{state}"), None),
    }
}

/// The bytes of that state in a dist_ckpt merge `got` (layer L: the L-th of 4 equal
/// parts of the stack).
fn dist_ckpt_state(got: &BTreeMap<String, Vec<u8>>, param: &str, state: &str) -> Vec<u8> {
    let (key, layer) = dist_ckpt_key(param, state);
    let all = &got[&key];
    match layer {
        Some(l) => {
            let per = all.len() / 4;
            all[l * per..(l + 1) * per].to_vec()
        }
        None => all.clone(),
    }
}

/// The optimizer states of a merged dist_ckpt (`got`, with `shapes`) against the
/// optimizer's own (`want`, legacy names, one tensor per layer, with `want_shapes`):
/// every state of every parameter byte-equal, with the parameter's shape (the stack's
/// without its first dim for a layer). Returns how many were checked.
fn assert_dist_ckpt_states(
    got: &BTreeMap<String, Vec<u8>>,
    shapes: &BTreeMap<String, Vec<u64>>,
    want: &BTreeMap<String, Vec<u8>>,
    want_shapes: &BTreeMap<String, Vec<u64>>,
) -> usize {
    let mut checked = 0;
    for (name, want_bytes) in want {
        let Some(body) = name.strip_prefix("optim.") else {
            continue;
        };
        let (param, state) = body.rsplit_once('.').unwrap();
        let (key, layer) = dist_ckpt_key(param, state);
        let shape = match layer {
            Some(_) => shapes[&key][1..].to_vec(),
            None => shapes[&key].clone(),
        };
        assert_eq!(&dist_ckpt_state(got, param, state), want_bytes, "{name}");
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
/// DCP tensors, named `optim.<name>.{fp32,exp_avg,exp_avg_sq}` as every optimizer state
/// ckpt reads. Every state of every parameter merges byte-equal to the optimizer's own,
/// into optimizer.safetensors: model.safetensors holds the weights only.
#[test]
fn dist_ckpt_optimizer_states_merge_to_the_optimizers_own() {
    let d = Dir::new();
    let dist = fixtures().join("dist_ckpt").display().to_string();
    d.ok(&["merge", &dist, "-o", "m"]);
    let got = full_tensors(&d.path("m"));
    let weights = full_tensors(&d.path("m/model.safetensors"));
    let states = full_tensors(&d.path("m/optimizer.safetensors"));
    assert!(
        weights.keys().all(|k| !k.starts_with("optim")),
        "{:?}",
        weights.keys()
    );
    // One state per stacked parameter and state (layers stacked: 17 keys, not 53).
    for k in states.keys() {
        let (key, _) = k.strip_prefix("optim.").unwrap().rsplit_once('.').unwrap();
        assert!(weights.contains_key(key), "{k}");
    }
    assert_eq!(states.len(), 17 * 3);
    assert_eq!(weights.len() + states.len(), got.len());
    let want = fixtures().join("optim_full.safetensors");
    let checked = assert_dist_ckpt_states(
        &got,
        &shapes_of(&d.path("m")),
        &expected(),
        &shapes_of(&want),
    );
    assert_eq!(checked, 53 * 3);
    // Resharded like any DCP source, the states come back the same.
    d.ok(&["reshard", &dist, "--to", "2", "-o", "r2"]);
    d.ok(&["merge", "r2", "-o", "m2"]);
    assert_eq!(full_tensors(&d.path("m2")), got);
}

fn dist_ckpt_dp() -> PathBuf {
    fixtures().join("dist_ckpt_dp")
}

/// The same state saved `dp_reshardable` (Megatron-LM's default with the distributed
/// optimizer): one flat tensor per bucket and state, mapped back to the parameters with
/// the buffer layout ckpt computes for distrib_optim.pt. It merges to the same names
/// and shapes as `fully_reshardable`; the Adam moments byte-equal to the optimizer's own
/// (`optim_full.safetensors`: the moments of one step depend on the gradients only,
/// which the generator seeds by name), the fp32 master weights byte-equal to the
/// weights of the same save (fp32 training: the main parameter is a view of the model
/// parameter; dist_ckpt_dp is a later run than the other files, whose fp32 results
/// differ from them in the last bits, so it is compared with itself).
#[test]
fn dist_ckpt_dp_reshardable_states_merge_to_the_optimizers_own() {
    let d = Dir::new();
    let dp = dist_ckpt_dp().display().to_string();
    let full = fixtures().join("dist_ckpt").display().to_string();
    d.ok(&["merge", &dp, "-o", "m"]);
    d.ok(&["merge", &full, "-o", "f"]);
    let got = full_tensors(&d.path("m"));
    let fully = full_tensors(&d.path("f"));
    let names = |t: &BTreeMap<String, Vec<u8>>| -> Vec<(String, usize)> {
        t.iter()
            .filter(|(k, _)| k.starts_with("optim."))
            .map(|(k, v)| (k.clone(), v.len()))
            .collect()
    };
    assert_eq!(names(&got), names(&fully));
    let mut checked = 0;
    for (name, want) in expected() {
        let Some(body) = name.strip_prefix("optim.") else {
            continue;
        };
        let (param, state) = body.rsplit_once('.').unwrap();
        let bytes = dist_ckpt_state(&got, param, state);
        if state == "fp32" {
            // (Compared below with the weights of the same save.)
            assert_eq!(bytes.len(), want.len(), "{name}");
        } else {
            assert_eq!(bytes, want, "{name}");
            assert_eq!(bytes, dist_ckpt_state(&fully, param, state), "{name}");
        }
        checked += 1;
    }
    assert_eq!(checked, 53 * 3);
    // The master weights are the model tensors of the same save, key by key.
    let mut masters = 0;
    for (k, v) in &got {
        if let Some(key) = k
            .strip_prefix("optim.")
            .and_then(|k| k.strip_suffix(".fp32"))
        {
            assert_eq!(Some(v), got.get(key), "{k}");
            masters += 1;
        }
    }
    assert_eq!(
        masters,
        fully.keys().filter(|k| k.ends_with(".fp32")).count()
    );
    assert!(masters > 0);
    // Resharded to 2 ranks (DCP) and merged back: the same.
    d.ok(&["reshard", &dp, "--to", "2", "-o", "r2"]);
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
    let checked = assert_dist_ckpt_states(&got, &shapes, &full_tensors(&want), &shapes_of(&want));
    assert_eq!(checked, 53 * 3);
    // The stacked shape itself, and the fused QKV state whose layer 1 two dp ranks split
    // (elements 0..192 and 192..256 of each TP chunk).
    assert_eq!(
        shapes["optim.decoder.layers.self_attention.linear_proj.weight.exp_avg"],
        vec![4, 16, 16]
    );
    assert_eq!(
        shapes["optim.decoder.layers.self_attention.linear_qkv.weight.exp_avg"],
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

/// Replaces every occurrence of `from` by `to` (same length) in `file`.
fn patch(file: &Path, from: &[u8], to: &[u8]) -> usize {
    assert_eq!(from.len(), to.len());
    let mut b = std::fs::read(file).unwrap();
    let mut n = 0;
    let mut i = 0;
    while let Some(at) = b[i..].windows(from.len()).position(|w| w == from) {
        b[i + at..i + at + to.len()].copy_from_slice(to);
        i += at + to.len();
        n += 1;
    }
    std::fs::write(file, b).unwrap();
    n
}

const BUCKET_1: &str =
    "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_1";

/// A copy of dist_ckpt_dp in `d`, as `dp`, to damage.
fn dp_copy(d: &Dir) -> PathBuf {
    let dir = d.path("dp");
    copy_dir(&dist_ckpt_dp(), &dir);
    dir
}

/// `merge dp` fails with a message naming every one of `needles`, and writes nothing.
fn merge_dp_is_refused(d: &Dir, needles: &[&str]) {
    let o = d.fails(&["merge", "dp", "-o", "m"]);
    assert!(needles.iter().all(|n| o.stderr.contains(n)), "{}", o.stderr);
    assert!(!d.path("m").exists());
}

/// A bucket tensor that the metadata does not hold (renamed to bucket 7): named, as
/// missing, nothing written.
#[test]
fn dp_reshardable_a_missing_bucket_tensor_is_named() {
    let d = Dir::new();
    let dir = dp_copy(&d);
    let from = format!("{BUCKET_1}.exp_avg_sq");
    let to = from.replace("bucket_idx_1", "bucket_idx_7");
    assert!(patch(&dir.join(".metadata"), from.as_bytes(), to.as_bytes()) > 0);
    merge_dp_is_refused(&d, &[&format!("`{from}`: missing"), "dp/.metadata"]);
}

/// A .distcp file cut short, in the middle of the bucket tensors' chunks: named.
#[test]
fn dp_reshardable_a_truncated_bucket_tensor_is_named() {
    let d = Dir::new();
    let f = dp_copy(&d).join("__6_0.distcp");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    merge_dp_is_refused(&d, &["__6_0.distcp", "truncated"]);
}

/// `per_bucket_numel_unpadded` of domain 0 saying 1409 elements for bucket 1 (the
/// pickle's BININT2 1408 -> 1409), the tensors left as they are: the model's parameters
/// make 1408, refused by name.
#[test]
fn dp_reshardable_per_bucket_numel_that_contradicts_the_model_is_named() {
    let d = Dir::new();
    // The fixture's metadata stores that object in __0_0.distcp; its list [2048, 1408]
    // is pickled as BININT2 0x0800, BININT2 0x0580.
    let f = dp_copy(&d).join("__0_0.distcp");
    assert_eq!(patch(&f, b"M\x00\x08M\x80\x05", b"M\x00\x08M\x81\x05"), 1);
    merge_dp_is_refused(
        &d,
        &[
            "dp_group_idx_0.per_bucket_numel_unpadded says [[2048, 1409]]",
            "make buckets of [[2048, 1408]]",
        ],
    );
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

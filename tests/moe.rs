//! Mixture-of-experts checkpoints that megatron-core wrote on gloo ranks
//! (scripts/fixtures/moe_megatron.py, tests/fixtures/moe/megatron/): expert-parallel
//! legacy directories and dist_ckpt's stacked experts merge to every tensor of the
//! model under global expert ids, equal byte for byte to what the generator gathered
//! from every rank (`reference.safetensors`); what is not read yet is refused by name.

use crate::util::{assert_same_tensors, copy_dir, full_tensors, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn case(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/moe/megatron")
        .join(name)
}

/// The model's tensors as the generator gathered them from every rank.
/// A DeepSpeed MoE fixture.
fn ds(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/moe/deepspeed")
        .join(name)
}

fn reference(name: &str) -> BTreeMap<String, Vec<u8>> {
    full_tensors(&case(name).join("reference.safetensors"))
}

/// `ckpt reshard SRC --format megatron --mesh MESH [extra] -o <name>` then its merge
/// (vocabulary padding kept): the output directory and the merged tensors.
fn megatron_reshard_merged(
    d: &Dir,
    src: &Path,
    mesh: &str,
    extra: &[&str],
    name: &str,
) -> (PathBuf, BTreeMap<String, Vec<u8>>) {
    let out = d.path(name);
    let mut args = vec![
        "reshard",
        src.to_str().unwrap(),
        "--format",
        "megatron",
        "--mesh",
        mesh,
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    d.ok(&args);
    let merged = merged_tensors(d, &out, &format!("{name}.merged"), &[]);
    (out, merged)
}

/// `ckpt merge SRC -o <name> --keep-vocab-padding [extra]`: the merged tensors.
fn merged_tensors(d: &Dir, src: &Path, name: &str, extra: &[&str]) -> BTreeMap<String, Vec<u8>> {
    let out = d.path(name);
    let mut args = vec![
        "merge",
        src.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--keep-vocab-padding",
    ];
    args.extend_from_slice(extra);
    d.ok(&args);
    full_tensors(&out)
}

/// EP2 with TP1 (a shared expert and router expert bias), EP2 x TP2, EP2 x PP2
/// (`mp_rank_00_PPP_EEE`), EP4, EP1, EP2 with expert TP 1 under TP 2 (two directories,
/// not four), and megatron-core's GroupedMLP (merged into the grouped weights an EP1
/// model holds): legacy files merged give the model.
#[test]
fn legacy_expert_parallel_checkpoints_merge_to_global_experts() {
    let d = Dir::new();
    for c in [
        "ep2tp1",
        "ep2tp2",
        "ep2pp2",
        "ep4tp1",
        "ep1tp1",
        "ep2tp2etp1",
        "ep2tp4etp2",
        "ep2grouped",
    ] {
        let (got, want) = (
            merged_tensors(&d, &case(c).join("legacy"), c, &[]),
            reference(c),
        );
        assert_same_tensors(&got, &want, c);
        assert!(
            want.keys()
                .any(|k| k.contains("local_experts.3.") || k.ends_with("mlp.experts.weight1")),
            "{c}: the reference has every expert"
        );
    }
    // The EP ranks on the mesh: experts 2 and 3 on expert rank 1.
    let o = d.ok(&["inspect", case("ep2tp1").join("legacy").to_str().unwrap()]);
    assert!(o.stdout.contains("mesh ep=2,tp=1"), "{}", o.stdout);
    let line = o
        .stdout
        .lines()
        .find(|l| l.starts_with("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"))
        .unwrap();
    assert!(line.contains("stage 1"), "{line}");
}

/// dist_ckpt's stacked `[layers, experts, …]` tensors, with --per-layer, one tensor a
/// layer and an expert under the same global ids (dist_ckpt names the norms as
/// Transformer Engine's fused layers do); without it, the stacked tensors as stored.
#[test]
fn dist_ckpt_experts_unstack_to_global_ids() {
    let d = Dir::new();
    let alias = |k: &str| {
        k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
            .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
    };
    for c in [
        "ep2tp1",
        "ep2tp2",
        "ep2pp2",
        "ep4tp1",
        "ep2tp2etp1",
        "ep2tp4etp2",
        "ep2grouped",
    ] {
        let src = case(c).join("dist_ckpt");
        let got = merged_tensors(&d, &src, c, &["--per-layer"]);
        // GroupedMLP saves its experts as SequentialMLP's (its sharded state dict
        // transposes its memory views): the per-expert reference.
        let per_expert = match c {
            "ep2grouped" => full_tensors(&case(c).join("reference_experts.safetensors")),
            _ => reference(c),
        };
        let want: BTreeMap<String, Vec<u8>> = per_expert
            .into_iter()
            .map(|(k, v)| (alias(&k), v))
            .collect();
        assert_same_tensors(&got, &want, c);
        let stacked = d.path(&format!("{c}.stacked"));
        d.ok(&[
            "merge",
            src.to_str().unwrap(),
            "-o",
            stacked.to_str().unwrap(),
        ]);
        assert!(full_tensors(&stacked)
            .contains_key("decoder.layers.mlp.experts.experts.linear_fc1.weight"));
    }
    // GroupedMLP's legacy files with --per-layer: each expert transposed out of the
    // grouped weights, equal to what megatron-core's sharded state dict gives.
    let got = merged_tensors(
        &d,
        &case("ep2grouped").join("legacy"),
        "ep2grouped.legacy",
        &["--per-layer"],
    );
    let want = full_tensors(&case("ep2grouped").join("reference_experts.safetensors"));
    let experts: BTreeMap<String, Vec<u8>> = want
        .into_iter()
        .filter(|(k, _)| k.contains(".local_experts."))
        .collect();
    assert_eq!(experts.len(), 16);
    for (k, v) in &experts {
        assert!(got.get(k) == Some(v), "ep2grouped legacy --per-layer: {k}");
    }
    assert!(!got.keys().any(|k| k.ends_with("mlp.experts.weight1")));
}

/// What is not read yet, and what is wrong, said by name with exit code 1.
#[test]
fn expert_parallel_refusals_are_named() {
    let d = Dir::new();
    let legacy = |c: &str| case(c).join("legacy").to_str().unwrap().to_string();
    // GroupedMLP's experts are read per expert for Hugging Face, but this model has
    // learned absolute position embeddings, which Mixtral has not.
    let o = d.fails(&[
        "merge",
        &legacy("ep2grouped"),
        "--format",
        "hf",
        "--hf-arch",
        "mixtral",
        "-o",
        "out",
    ]);
    assert!(
        o.stderr.contains("absolute position embeddings"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
    // Args of layouts not read (the fixtures' args changed by torch): Transformer
    // Engine's grouped layer, an expert TP size (3) that does not divide TP (4).
    let variants = case("args_variants");
    let o = d.fails(&[
        "merge",
        variants.join("te_grouped").to_str().unwrap(),
        "-o",
        "out",
    ]);
    assert!(o.stderr.contains("TEGroupedMLP"), "{}", o.stderr);
    let o = d.fails(&[
        "merge",
        variants.join("etp3tp4").to_str().unwrap(),
        "-o",
        "out",
    ]);
    assert!(
        o.stderr
            .contains("expert_tensor_parallel_size 3 with tensor_model_parallel_size 4"),
        "{}",
        o.stderr
    );
    // A missing expert-parallel rank.
    copy_dir(&case("ep2tp1").join("legacy"), &d.path("gap"));
    std::fs::remove_dir_all(d.path("gap/iter_0000001/mp_rank_00_001")).unwrap();
    let o = d.fails(&["merge", "gap", "-o", "out"]);
    assert!(
        o.stderr
            .contains("mp_rank_00_001/model_optim_rng.pt: missing"),
        "{}",
        o.stderr
    );
    assert!(o.stderr.contains("ep=1"), "{}", o.stderr);
    // Expert-parallel directory names under args without expert parallelism: the
    // refusal names expert parallelism, not a missing dense rank.
    let rank = case("ep1tp1").join("legacy/iter_0000001/mp_rank_00/model_optim_rng.pt");
    for e in ["000", "001"] {
        let dir = d.path(&format!("noargs/mp_rank_00_{e}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&rank, dir.join("model_optim_rng.pt")).unwrap();
    }
    let o = d.fails(&["merge", "noargs", "-o", "out"]);
    assert!(
        o.stderr.contains("expert_model_parallel_size is 1"),
        "{}",
        o.stderr
    );
    assert!(!d.path("out").exists());
}

/// Mixtral, Qwen2-MoE (gated shared expert) and Qwen3-MoE from megatron-core's MoE
/// checkpoints (EP 2, legacy and dist_ckpt): `--format hf` writes every tensor as
/// transformers' own `save_pretrained` of the same model wrote it (the fixture's `hf/`),
/// and the way back (`reshard HF --format megatron`, TP 2) merges to Megatron's tensors.
/// scripts/moe_hf_check.py loads the exports in transformers and compares the logits.
#[test]
fn moe_families_export_to_hugging_face_and_back() {
    let d = Dir::new();
    let hf = |f: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/moe/hf")
            .join(f)
    };
    for f in ["mixtral", "qwen2_moe", "qwen3_moe"] {
        let want = full_tensors(&hf(f).join("hf/model.safetensors"));
        // Mixtral's also as megatron-core's GroupedMLP (each expert the transpose of a
        // run of the grouped weights), loaded by megatron-core from the dist_ckpt.
        let grouped: &[&str] = if f == "mixtral" {
            &["legacy_grouped"]
        } else {
            &[]
        };
        for &src in ["legacy", "dist_ckpt"].iter().chain(grouped) {
            let out = d.path(&format!("{f}-{src}"));
            d.ok(&[
                "merge",
                hf(f).join(src).to_str().unwrap(),
                "--format",
                "hf",
                "-o",
                out.to_str().unwrap(),
            ]);
            let got = full_tensors(&out.join("model.safetensors"));
            assert_same_tensors(&got, &want, &format!("{f} {src}"));
            let config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
            let fixture: serde_json::Value =
                serde_json::from_slice(&std::fs::read(hf(f).join("hf/config.json")).unwrap())
                    .unwrap();
            assert_eq!(config["architectures"], fixture["architectures"], "{f}");
            assert_eq!(
                config["num_experts_per_tok"], fixture["num_experts_per_tok"],
                "{f}"
            );
        }
        let back = d.path(&format!("{f}-megatron"));
        let exported = d.path(&format!("{f}-legacy"));
        d.ok(&[
            "reshard",
            exported.to_str().unwrap(),
            "--format",
            "megatron",
            "--mesh",
            "tp=2",
            "-o",
            back.to_str().unwrap(),
        ]);
        let (got, want) = (
            merged_tensors(&d, &back, &format!("{f}-merged"), &[]),
            full_tensors(&hf(f).join("reference.safetensors")),
        );
        assert_same_tensors(&got, &want, &format!("{f} back"));
        // The same Hugging Face model as a dist_ckpt: merged back to HF, every tensor.
        let dist = d.path(&format!("{f}-dist"));
        d.ok(&[
            "reshard",
            exported.to_str().unwrap(),
            "--format",
            "megatron-dist",
            "--mesh",
            "tp=2,pp=1",
            "-o",
            dist.to_str().unwrap(),
        ]);
        let again = d.path(&format!("{f}-dist-hf"));
        d.ok(&[
            "merge",
            dist.to_str().unwrap(),
            "--format",
            "hf",
            "-o",
            again.to_str().unwrap(),
        ]);
        assert_eq!(full_tensors(&again), full_tensors(&exported), "{f} dist");
    }
    // A router no Hugging Face family here has (sigmoid scores with an expert bias):
    // refused by name, nothing written.
    let o = d.fails(&[
        "merge",
        case("ep2tp1").join("legacy").to_str().unwrap(),
        "--format",
        "hf",
        "-o",
        "refused",
    ]);
    assert!(o.stderr.contains("sigmoid"), "{}", o.stderr);
    assert!(!d.path("refused").exists());
}

/// Reshards to another expert-parallel size, written back as Megatron legacy files:
/// the directories Megatron-LM names (`mp_rank_TT[_PPP]_EEE`), each with the dense
/// tensors and its own experts under local ids, merging to the model's tensors.
/// scripts/moe_reshard_interop.py loads them in megatron-core and compares the logits.
#[test]
fn expert_parallel_reshards_write_megatrons_directories() {
    let d = Dir::new();
    for (c, mesh, dirs) in [
        (
            "ep2tp1",
            "ep=4",
            vec![
                "mp_rank_00_000",
                "mp_rank_00_001",
                "mp_rank_00_002",
                "mp_rank_00_003",
            ],
        ),
        ("ep4tp1", "ep=1,tp=2", vec!["mp_rank_00", "mp_rank_01"]),
        // Expert TP 1 under TP 2 (two directories) kept by default (its own grid, each
        // file's RNG state its source's), or written with expert TP = TP on request.
        (
            "ep2tp2etp1",
            "ep=2,tp=2",
            vec!["mp_rank_00_000", "mp_rank_01_001"],
        ),
        (
            "ep2tp2etp1",
            "ep=2,tp=2,etp=2",
            vec![
                "mp_rank_00_000",
                "mp_rank_00_001",
                "mp_rank_01_000",
                "mp_rank_01_001",
            ],
        ),
        // Expert TP 1 asked for a model trained with expert TP = TP.
        (
            "ep2tp2",
            "ep=2,tp=2,etp=1",
            vec!["mp_rank_00_000", "mp_rank_01_001"],
        ),
        ("ep2tp2etp1", "ep=1,tp=1", vec!["mp_rank_00"]),
        // GroupedMLP: each EP rank's weight1 rows of the grouped one (the merge back
        // checks the shape each file records, [H, E_l*F1]); under TP 2 its experts are
        // whole (expert TP 1), so the save's two directories.
        ("ep2grouped", "ep=1", vec!["mp_rank_00"]),
        (
            "ep2grouped",
            "ep=4",
            vec![
                "mp_rank_00_000",
                "mp_rank_00_001",
                "mp_rank_00_002",
                "mp_rank_00_003",
            ],
        ),
        (
            "ep2grouped",
            "ep=2,tp=2",
            vec!["mp_rank_00_000", "mp_rank_01_001"],
        ),
        (
            "ep2tp2",
            "ep=2,tp=1,pp=2",
            vec![
                "mp_rank_00_000_000",
                "mp_rank_00_000_001",
                "mp_rank_00_001_000",
                "mp_rank_00_001_001",
            ],
        ),
    ] {
        let (out, got) = megatron_reshard_merged(
            &d,
            &case(c).join("legacy"),
            mesh,
            &[],
            &format!("{c}-{mesh}"),
        );
        let mut found: Vec<String> = std::fs::read_dir(out.join("iter_0000001"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        found.sort();
        assert_eq!(found, dirs, "{c} to {mesh}");
        assert_same_tensors(&got, &reference(c), &format!("{c} to {mesh}"));
    }
    // Written again on its own grid (GroupedMLP under TP 2: two of the four (tp, ep)
    // directories), each file's RNG state from the same rank.
    let (_, got) = megatron_reshard_merged(
        &d,
        &d.path("ep2grouped-ep=2,tp=2"),
        "ep=2,tp=2",
        &[],
        "grouped-again",
    );
    assert_same_tensors(&got, &reference("ep2grouped"), "grouped again");
    // Experts that do not divide, a dense model given an expert-parallel size.
    let o = d.fails(&[
        "reshard",
        case("ep2tp1").join("legacy").to_str().unwrap(),
        "--format",
        "megatron",
        "--mesh",
        "ep=3",
        "-o",
        "x",
    ]);
    assert!(
        o.stderr.contains("4 experts do not divide into 3"),
        "{}",
        o.stderr
    );
    // An expert TP size neither 1 nor TP; GroupedMLP split over TP.
    for (c, mesh, problem) in [
        (
            "ep2tp2",
            "ep=2,tp=2,etp=4",
            "etp=4: the expert tensor-parallel size is written as 1",
        ),
        (
            "ep2grouped",
            "ep=2,tp=2,etp=2",
            "etp=2: GroupedMLP's experts are written whole",
        ),
    ] {
        // A --mesh the source cannot take: a usage error (exit 2).
        let o = d.ckpt(&[
            "reshard",
            case(c).join("legacy").to_str().unwrap(),
            "--format",
            "megatron",
            "--mesh",
            mesh,
            "-o",
            "x",
        ]);
        assert_eq!(o.code, 2, "{}", o.stderr);
        assert!(o.stderr.contains(problem), "{}", o.stderr);
        assert!(!d.path("x").exists());
    }
}

/// Expert-parallel legacy checkpoints written again as megatron-core dist_ckpts
/// (`--format megatron-dist`): the same keys, shapes and bytes as megatron-core's own
/// `dist_checkpointing.save` of the same model (each fixture's `dist_ckpt/`), the
/// experts stacked `[layers, experts, …]` by global id, TP and PP meshes alike.
#[test]
fn expert_parallel_checkpoints_into_dist_ckpts_as_megatron_core_saves_them() {
    let d = Dir::new();
    for (name, mesh) in [
        ("ep2tp1", "tp=1,pp=1"),
        ("ep2tp2", "tp=2,pp=1"),
        ("ep2pp2", "tp=1,pp=2"),
        ("ep4tp1", "tp=2,pp=2"),
        // Expert TP 2 under TP 4.
        ("ep2tp4etp2", "tp=2,pp=1"),
        // GroupedMLP: each expert the transpose of a run of its grouped weights.
        ("ep2grouped", "tp=1,pp=1"),
        ("ep2grouped", "tp=2,pp=2"),
    ] {
        let out = d.path(&format!("{name}.{mesh}"));
        d.ok(&[
            "reshard",
            case(name).join("legacy").to_str().unwrap(),
            "--format",
            "megatron-dist",
            "--mesh",
            mesh,
            "-o",
            out.to_str().unwrap(),
        ]);
        let ours = full_tensors(&out.join("iter_0000001"));
        let theirs = full_tensors(&case(name).join("dist_ckpt"));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, v) in &theirs {
            assert!(&ours[k] == v, "{name}: {k}");
        }
    }
}

/// DeepSpeed's `deepspeed.moe` checkpoints (EP2 with ZeRO-2, the same with
/// `use_data_before_expert_parallelism`, EP4 with ZeRO-1, 4 gloo ranks): the expert
/// groups' fp32 partitions over each expert-parallel rank's expert-data-parallel ranks
/// (DeepSpeed's group rule), under global expert ids, with their Adam moments: every
/// tensor equal to the model's and the optimizer's, gathered by the generator.
#[test]
fn deepspeed_expert_parallel_checkpoints_merge_with_their_moments() {
    let d = Dir::new();
    for c in ["ep2_zero2", "ep2_zero2_dbe", "ep4_zero1"] {
        let out = d.path(c);
        d.ok(&[
            "merge",
            ds(c).join("ckpt").to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        let got = full_tensors(&out);
        let mut want = full_tensors(&ds(c).join("reference.safetensors"));
        want.extend(full_tensors(&ds(c).join("moments.safetensors")));
        assert_eq!(got.len(), want.len(), "{c}");
        for (k, v) in &want {
            let g = got.get(k).or_else(|| got.get(&format!("optim.{k}")));
            assert!(g == Some(v), "{c}: {k}");
        }
    }
    // Without ZeRO (stage 0): the weights whole from `module` and the expert files,
    // every one the model's own; the optimizer (by position only) said, not carried.
    let o = d.ok(&[
        "merge",
        ds("ep2_zero0").join("ckpt").to_str().unwrap(),
        "-o",
        "zero0",
    ]);
    assert!(
        o.stderr.contains("trained without ZeRO (stage 0)") && o.stderr.contains("not carried"),
        "{}",
        o.stderr
    );
    assert_eq!(
        full_tensors(&d.path("zero0")),
        full_tensors(&ds("ep2_zero0").join("reference.safetensors"))
    );
    // A missing expert file of a stage-0 checkpoint.
    copy_dir(&ds("ep2_zero0").join("ckpt"), &d.path("gap0"));
    std::fs::remove_file(d.path("gap0/global_step2/layer_0_expert_3_mp_rank_00_model_states.pt"))
        .unwrap();
    let o = d.fails(&["merge", "gap0", "-o", "x"]);
    assert!(
        o.stderr
            .contains("layer_0_expert_3_mp_rank_00_model_states.pt")
            && o.stderr.contains("missing"),
        "{}",
        o.stderr
    );
    assert!(!d.path("x").exists());
    // A missing expert file.
    copy_dir(&ds("ep2_zero2").join("ckpt"), &d.path("gap"));
    std::fs::remove_file(d.path("gap/global_step2/layer_1_expert_2_mp_rank_00_model_states.pt"))
        .unwrap();
    let o = d.fails(&["merge", "gap", "-o", "x"]);
    assert!(
        o.stderr
            .contains("layer_1_expert_2_mp_rank_00_model_states.pt: DeepSpeed checkpoint: missing"),
        "{}",
        o.stderr
    );
}

/// The model and its Adam moments as DeepSpeed's training run held them.
fn ds_expected(c: &str) -> BTreeMap<String, Vec<u8>> {
    let mut want = full_tensors(&ds(c).join("reference.safetensors"));
    // (Named `optim.<parameter>.exp_avg`, as ckpt names optimizer state.)
    want.extend(full_tensors(&ds(c).join("moments.safetensors")));
    want
}

/// DeepSpeed MoE ZeRO-1/2 checkpoints re-cut for another world and EP size
/// (`reshard --format deepspeed --mesh dp=N,ep=K`; DeepSpeed itself loads them in
/// scripts/moe_deepspeed_interop.py): one optimizer file per new rank, the expert files
/// copied as they are, and every weight and moment read back equal to the training
/// run's. What is not re-cut is refused by name, nothing written.
#[test]
fn deepspeed_expert_parallel_checkpoints_reshard_to_other_ep_sizes() {
    let d = Dir::new();
    for (c, mesh, world) in [
        ("ep2_zero2", "dp=4,ep=4", 4),
        ("ep2_zero2", "dp=2,ep=1", 2),
        ("ep4_zero1", "dp=2,ep=1", 2),
        ("ep2_zero2_dbe", "dp=6,ep=2", 6),
        ("ep4_zero1", "dp=8", 8),
    ] {
        let out = d.path(&format!("{c}-{mesh}"));
        let src = ds(c).join("ckpt");
        d.ok(&[
            "reshard",
            src.to_str().unwrap(),
            "--format",
            "deepspeed",
            "--mesh",
            mesh,
            "-o",
            out.to_str().unwrap(),
        ]);
        let tag = out.join("global_step2");
        for r in 0..world {
            assert!(
                tag.join(format!("zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
                    .is_file(),
                "{c} {mesh}: rank {r}"
            );
        }
        assert!(!tag
            .join(format!("zero_pp_rank_{world}_mp_rank_00_optim_states.pt"))
            .exists());
        for l in 0..2 {
            for e in 0..4 {
                let f = format!("layer_{l}_expert_{e}_mp_rank_00_model_states.pt");
                assert_eq!(
                    std::fs::read(tag.join(&f)).unwrap(),
                    std::fs::read(src.join("global_step2").join(&f)).unwrap(),
                    "{c} {mesh}: {f}"
                );
            }
        }
        let merged = d.path(&format!("{c}-{mesh}.merged"));
        d.ok(&[
            "merge",
            out.to_str().unwrap(),
            "-o",
            merged.to_str().unwrap(),
        ]);
        let (got, want) = (full_tensors(&merged), ds_expected(c));
        assert_same_tensors(&got, &want, &format!("{c} {mesh}"));
    }
    let refused = |src: &Path, mesh: &str, why: &str| {
        let o = d.fails(&[
            "reshard",
            src.to_str().unwrap(),
            "--format",
            "deepspeed",
            "--mesh",
            mesh,
            "-o",
            "x",
        ]);
        assert!(o.stderr.contains(why), "{mesh}: {}", o.stderr);
        assert!(!d.path("x").exists(), "{mesh}");
    };
    let ep2 = ds("ep2_zero2").join("ckpt");
    refused(&ep2, "dp=3,ep=2", "the EP size must divide both");
    refused(&ep2, "dp=6,ep=3", "4 experts on 6 ranks at EP 3");
    refused(&ep2, "dp=4,tp=2", "--mesh dp=N,ep=K");
    refused(&ds("ep2_zero0").join("ckpt"), "dp=2,ep=1", "without ZeRO");
    let dense =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepspeed/zero2_fp32/ckpt");
    refused(&dense, "dp=2,ep=2", "no expert group");
}

/// `inspect --show` over experts draws which file holds which expert: at EP2 x TP2
/// each of an EP rank's two files holds a TP half of its two experts; in DeepSpeed's
/// ZeRO-2 files each expert-data-parallel rank holds whole experts of its partition.
#[test]
fn inspect_draws_which_rank_holds_which_expert() {
    let d = Dir::new();
    let o = d.ok(&[
        "inspect",
        case("ep2tp2").join("legacy").to_str().unwrap(),
        "--show",
        "decoder.layers.0.mlp.experts.local_experts.*.linear_fc1.weight",
    ]);
    let map = "expert  0123\nrank 0  ++..\nrank 1  ++..\nrank 2  ..++\nrank 3  ..++\n";
    assert!(o.stdout.starts_with("experts of `decoder.layers.0.mlp.experts.local_experts.*.linear_fc1.weight`: 4 experts"), "{}", o.stdout);
    assert!(o.stdout.contains(map), "{}", o.stdout);
    // The per-tensor pictures follow, one per expert.
    assert_eq!(o.stdout.matches("\ntensor `").count(), 4, "{}", o.stdout);
    let o = d.ok(&[
        "inspect",
        ds("ep2_zero2").join("ckpt").to_str().unwrap(),
        "--show",
        "blocks.*.moe.deepspeed_moe.experts.deepspeed_experts.*.fc1.weight",
    ]);
    // blocks.0's experts in the first partition of each EP rank's buffer (ranks 0, 1),
    // blocks.1's in the second (ranks 2, 3).
    for map in [
        "expert  0123\nrank 0  ##..\nrank 1  ..##\n none:  rank 2, rank 3\n",
        "expert  0123\nrank 2  ##..\nrank 3  ..##\n none:  rank 0, rank 1\n",
    ] {
        assert!(o.stdout.contains(map), "{}", o.stdout);
    }
}

/// Same input, same bytes with 1 and 4 threads: the EP2 x PP2 merge, its dist_ckpt and
/// EP4 reshards, the ZeRO-0 merge, the torchtitan export, and DeepSpeed's EP2 -> EP4.
#[test]
fn moe_outputs_do_not_depend_on_the_thread_count() {
    let d = Dir::new();
    let src = case("ep2pp2").join("legacy");
    let zero0 = ds("ep2_zero0").join("ckpt");
    let zero2 = ds("ep2_zero2").join("ckpt");
    let titan = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torchtitan/llama");
    let titan_config = titan.join("config.json");
    let titan_dcp = titan.join("dcp");
    let grouped = case("ep2grouped").join("legacy");
    let etp1 = case("ep2tp2etp1").join("legacy");
    let etp2 = case("ep2tp4etp2").join("legacy");
    let grouped_hf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/moe/hf/mixtral/legacy_grouped");
    let distopt = case("ep2dp4_distopt").join("legacy");
    for (args, out) in [
        (vec!["merge", src.to_str().unwrap()], "merged"),
        (
            vec![
                "reshard",
                src.to_str().unwrap(),
                "--format",
                "megatron-dist",
                "--mesh",
                "tp=1,pp=2",
            ],
            "dist",
        ),
        (vec!["merge", zero0.to_str().unwrap()], "zero0"),
        (
            vec![
                "merge",
                titan_dcp.to_str().unwrap(),
                "--format",
                "hf",
                "--hf-config",
                titan_config.to_str().unwrap(),
            ],
            "titan-hf",
        ),
        (
            vec![
                "reshard",
                src.to_str().unwrap(),
                "--format",
                "megatron",
                "--mesh",
                "ep=4,pp=1",
            ],
            "ep4",
        ),
        (
            vec![
                "reshard",
                zero2.to_str().unwrap(),
                "--format",
                "deepspeed",
                "--mesh",
                "dp=4,ep=4",
            ],
            "ds-ep4",
        ),
        (
            vec![
                "reshard",
                grouped.to_str().unwrap(),
                "--format",
                "megatron",
                "--mesh",
                "ep=4",
            ],
            "grouped-ep4",
        ),
        (
            vec![
                "reshard",
                grouped.to_str().unwrap(),
                "--format",
                "megatron",
                "--mesh",
                "ep=2,tp=2",
            ],
            "grouped-tp2",
        ),
        (
            vec![
                "reshard",
                etp1.to_str().unwrap(),
                "--format",
                "megatron",
                "--mesh",
                "ep=2,tp=2",
            ],
            "etp1",
        ),
        (vec!["merge", distopt.to_str().unwrap()], "distopt"),
        // Transposed copies: GroupedMLP's experts one by one.
        (
            vec![
                "reshard",
                grouped.to_str().unwrap(),
                "--format",
                "megatron-dist",
                "--mesh",
                "tp=2,pp=2",
            ],
            "grouped-dist",
        ),
        (
            vec!["merge", grouped_hf.to_str().unwrap(), "--format", "hf"],
            "grouped-hf",
        ),
        (
            vec![
                "reshard",
                etp2.to_str().unwrap(),
                "--format",
                "megatron",
                "--mesh",
                "ep=4,tp=1",
            ],
            "etp2",
        ),
    ] {
        let mut trees = Vec::new();
        for threads in [1, 4] {
            let o = d.path(&format!("{out}-{threads}"));
            let mut a = args.clone();
            a.extend(["-o", o.to_str().unwrap()]);
            d.ok_with_threads(&a, threads);
            let mut files = BTreeMap::new();
            let mut stack = vec![o.clone()];
            while let Some(p) = stack.pop() {
                for e in std::fs::read_dir(&p).unwrap() {
                    let e = e.unwrap().path();
                    if e.is_dir() {
                        stack.push(e);
                    } else {
                        files.insert(
                            e.strip_prefix(&o).unwrap().to_path_buf(),
                            std::fs::read(&e).unwrap(),
                        );
                    }
                }
            }
            trees.push(files);
        }
        assert!(
            !trees[0].is_empty() && trees[0] == trees[1],
            "{out}: 1 and 4 threads differ"
        );
    }
}

/// Megatron's distributed optimizer with experts (a ChainedOptimizer: the dense
/// parameters' state on EP rank 0's directory, each EP rank's experts' state in its
/// own, sharded over the expert-data-parallel group): merged, every fp32 master weight
/// and Adam moment equals what the optimizer itself held (the generator gathered
/// `optim_full.safetensors` from its shards); written back in Megatron's layout only
/// without the optimizer's state (asked for by name); files that do not match the
/// directories named.
#[test]
fn distributed_optimizer_with_experts_merges_to_the_optimizers_own_state() {
    let d = Dir::new();
    let c = case("ep2dp4_distopt");
    let src = c.join("legacy");
    let got = merged_tensors(&d, &src, "merged", &[]);
    let mut want = full_tensors(&c.join("optim_full.safetensors"));
    want.extend(reference("ep2dp4_distopt"));
    assert!(want.contains_key(
        "optim.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight.exp_avg_sq"
    ));
    assert_same_tensors(&got, &want, "ep2dp4_distopt");
    // Megatron's layout: the weights, once the state is left out.
    let o = d.fails(&[
        "reshard",
        src.to_str().unwrap(),
        "--format",
        "megatron",
        "--mesh",
        "ep=4",
        "-o",
        "x",
    ]);
    assert!(o.stderr.contains("--exclude 'optim.*'"), "{}", o.stderr);
    let (_, back) = megatron_reshard_merged(&d, &src, "ep=4", &["--exclude", "optim.*"], "ep4");
    assert_same_tensors(&back, &reference("ep2dp4_distopt"), "to EP4");
    // EP rank 1's directory given EP rank 0's state (dense and expert): named.
    copy_dir(&src, &d.path("swapped"));
    let iter = d.path("swapped/iter_0000001");
    std::fs::copy(
        iter.join("mp_rank_00_000/distrib_optim.pt"),
        iter.join("mp_rank_00_001/distrib_optim.pt"),
    )
    .unwrap();
    let o = d.fails(&["merge", "swapped", "-o", "y"]);
    assert!(
        o.stderr.contains("mp_rank_00_001/distrib_optim.pt")
            && o.stderr.contains("holds a dense optimizer's state, but this rank's directory holds none of its parameters"),
        "{}",
        o.stderr
    );
    assert!(!d.path("y").exists());
}

//! Checkpoints: format, atomic saves, resume (same and other world size), merge.

use crate::util::{max_diff, run};
use ckpt_train::{read_trainer_state, FullTensor, LATEST_FILE};
use std::collections::BTreeMap;
use std::path::Path;

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Issue 5: resume at the same world size is bit-identical to an uninterrupted run.
#[test]
fn resume_same_world_size_is_bit_identical() {
    for extra in [&[][..], &["--shard-optimizer", "--optimizer", "sgd"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let base = [
            &["--mesh", "dp=2,tp=2", "--epochs", "2", "--gather-weights"][..],
            extra,
        ]
        .concat();
        let whole = run(&base);
        let first = run(&[&base[..], &["--max-steps", "30", "--out", &s(&out)]].concat());
        assert_eq!(first.steps, 30);
        let rest = run(&[&base[..], &["--resume", &s(&out)]].concat());
        assert_eq!(rest.start_step, 30);
        assert_eq!(rest.steps, whole.steps);
        assert_eq!(&whole.losses[30..], &rest.losses[..], "{extra:?}");
        let (a, b) = (whole.weights.unwrap(), rest.weights.unwrap());
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
        for (k, v) in &a {
            assert!(
                v.data
                    .iter()
                    .zip(&b[k].data)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{k} differs"
            );
        }
    }
}

/// Issue 5: a sliced checkpoint of 4 ranks resumes on 2 ranks (another mesh) and saves
/// integrated; the loss continues where it was (within 1e-3 of the uninterrupted run,
/// which differs only in reduction order).
#[test]
fn resume_4_to_2_sliced_to_integrated() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let whole = run(&["--ranks", "4", "--epochs", "2", "--no-eval"]);
    run(&[
        "--ranks",
        "4",
        "--epochs",
        "2",
        "--max-steps",
        "25",
        "--out",
        &s(&a),
        "--save",
        "sliced",
        "--no-eval",
    ]);
    let ck = a.join("step_25");
    for r in 0..4 {
        for f in [
            "model.safetensors",
            "strategy.json",
            "config.json",
            "trainer_state.json",
        ] {
            assert!(
                ck.join(format!("ckpt_{r}")).join(f).is_file(),
                "ckpt_{r}/{f}"
            );
        }
    }
    let rest = run(&[
        "--mesh",
        "tp=2",
        "--epochs",
        "2",
        "--resume",
        &s(&ck),
        "--out",
        &s(&b),
        "--save",
        "integrated",
        "--no-eval",
    ]);
    assert!(
        max_diff(&whole.losses[25..], &rest.losses) < 1e-3,
        "{:?} vs {:?}",
        rest.losses,
        &whole.losses[25..]
    );
    let fin = b.join(format!("step_{}", rest.steps));
    assert!(fin.join("model.safetensors").is_file());
    assert!(fin.join("config.json").is_file());
    let st = read_trainer_state(&fin.join("trainer_state.json")).unwrap();
    assert_eq!(
        (st.step, st.epoch, st.batch_in_epoch, st.mesh.as_str()),
        (rest.steps, 2, 0, "tp=2")
    );
    // And back from integrated to 4 ranks again.
    let again = run(&[
        "--ranks",
        "4",
        "--epochs",
        "3",
        "--resume",
        &s(&b),
        "--max-steps",
        "50",
        "--no-eval",
    ]);
    assert_eq!(again.start_step, rest.steps);
}

fn read_safetensors(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let f = ckpt_core::formats::TensorFile::open(path).unwrap();
    f.tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), f.data(i).unwrap().to_vec()))
        .collect()
}

fn bytes(t: &FullTensor) -> Vec<u8> {
    t.data.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Issue 5: a `--ranks 4 --save sliced` checkpoint merged with ckpt merge equals the
/// trainer's own gathered full weights byte for byte (here with tp, so weights are
/// really sliced: mesh dp=2,tp=2, and ZeRO-split optimizer state).
#[test]
fn merged_sliced_checkpoint_equals_gathered_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let r = run(&[
        "--mesh",
        "dp=2,tp=2",
        "--model",
        "vit",
        "--max-steps",
        "3",
        "--batch-size",
        "16",
        "--no-eval",
        "--shard-optimizer",
        "--gather-weights",
        "--out",
        &s(&out),
    ]);
    let merged = dir.path().join("merged");
    let req = ckpt_merge::MergeRequest {
        inputs: vec![out.join("step_3")],
        output: merged.clone(),
        ..Default::default()
    };
    ckpt_merge::merge(&req, &|_| {}, &|_, _| {}).unwrap();
    // Weights in model.safetensors, optimizer state (`optim.*`) beside it.
    let mut got = read_safetensors(&merged.join("model.safetensors"));
    assert!(got.keys().all(|k| !k.starts_with("optim.")));
    let optim = read_safetensors(&merged.join("optimizer.safetensors"));
    assert!(!optim.is_empty() && optim.keys().all(|k| k.starts_with("optim.")));
    got.extend(optim);
    let want = r.weights.unwrap();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, t) in &want {
        assert!(got[k] == bytes(t), "{k} differs");
    }
    assert!(
        want.contains_key("blocks.0.attn.qkv.weight")
            && want.contains_key("optim.blocks.0.attn.qkv.weight.exp_avg")
    );
    // The fused QKV is a blocked shard; ZeRO state nests inside the tp shard.
    let strat = std::fs::read_to_string(out.join("step_3/ckpt_0/strategy.json")).unwrap();
    let st = ckpt_core::layout::strategy::Strategy::from_json(&strat).unwrap();
    let qkv = &st.tensors["blocks.0.attn.qkv.weight"];
    assert_eq!(
        qkv.placements[1],
        ckpt_core::layout::Placement::blocked(0, 3)
    );
    let m = &st.tensors["optim.blocks.0.attn.qkv.weight.exp_avg"];
    assert_eq!(
        m.placements[0],
        ckpt_core::layout::Placement::Shard {
            dim: 0,
            blocks: 3,
            order: 1
        }
    );
    // config.json and trainer_state.json are carried through the merge.
    assert!(merged.join("config.json").is_file() && merged.join("trainer_state.json").is_file());
}

/// Issue 5: --shard-optimizer checkpoints reshard with their optimizer state and resume
/// (dp=4 ZeRO to dp=2 unsplit: the loss goes on as the uninterrupted run's, 1e-3).
#[test]
fn shard_optimizer_checkpoint_reshards_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let whole = run(&[
        "--ranks",
        "4",
        "--epochs",
        "2",
        "--no-eval",
        "--optimizer",
        "sgd",
    ]);
    run(&[
        "--ranks",
        "4",
        "--epochs",
        "2",
        "--max-steps",
        "20",
        "--no-eval",
        "--shard-optimizer",
        "--optimizer",
        "sgd",
        "--out",
        &s(&out),
    ]);
    let rest = run(&[
        "--ranks",
        "2",
        "--epochs",
        "2",
        "--no-eval",
        "--resume",
        &s(&out),
    ]);
    assert!(
        max_diff(&whole.losses[20..], &rest.losses) < 1e-3,
        "{:?} vs {:?}",
        rest.losses,
        &whole.losses[20..]
    );
    // Without the momentum the curve would not continue so closely: check it was loaded.
    let st = read_trainer_state(&out.join("step_20/trainer_state.json")).unwrap();
    assert!(st.shard_optimizer);
}

/// --save-every, --keep and `latest`: only complete checkpoints are visible, a stale
/// `.tmp` from a crash is ignored and replaced.
#[test]
fn save_every_keep_and_latest() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(out.join("step_10.tmp/ckpt_0")).unwrap();
    std::fs::write(
        out.join("step_10.tmp/ckpt_0/model.safetensors"),
        b"half-written",
    )
    .unwrap();
    let r = run(&[
        "--ranks",
        "2",
        "--max-steps",
        "25",
        "--save-every",
        "5",
        "--keep",
        "2",
        "--out",
        &s(&out),
        "--no-eval",
    ]);
    assert_eq!(r.checkpoints.len(), 5);
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    // The run's TensorBoard event file sits beside the steps and is never pruned.
    let events = r.events.as_ref().expect("an event file with --out");
    let events = events.file_name().unwrap().to_str().unwrap();
    assert!(events.starts_with("events.out.tfevents."), "{events}");
    names.retain(|n| n != events);
    assert_eq!(names, vec!["latest", "step_20", "step_25"]);
    assert_eq!(
        std::fs::read_to_string(out.join(LATEST_FILE)).unwrap(),
        "step_25\n"
    );
    let st = read_trainer_state(&out.join("step_25/ckpt_1/trainer_state.json")).unwrap();
    assert_eq!((st.step, st.epoch, st.batch_in_epoch), (25, 1, 3));
    // Every rank directory is self-describing and the checkpoint verifies.
    let (_, problems) = ckpt_core::engine::verify::verify(
        &[out.join("step_25")],
        ckpt_core::engine::verify::VerifyDepth {
            checksums: true,
            deep: true,
        },
    )
    .unwrap();
    assert!(problems.is_empty(), "{problems:?}");
}

/// Resuming from something that is not a checkpoint names the problem.
#[test]
fn resume_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let e = ckpt_train::train(&crate::util::cfg(&["--resume", &s(dir.path())]), false).unwrap_err();
    assert!(e.to_string().contains("trainer_state.json"), "{e}");
    let e = ckpt_train::train(&crate::util::cfg(&["--mesh", "dp=2,pp=2"]), false).unwrap_err();
    assert!(e.to_string().contains("pp"), "{e}");
    let e = ckpt_train::train(&crate::util::cfg(&["--ranks", "3"]), false).unwrap_err();
    assert!(e.to_string().contains("multiple of dp=3"), "{e}");
}

/// The model trained on dp=2,tp=2 loads on any mesh for inference (`load_model`) and
/// gives the accuracy the trainer measured.
#[test]
fn load_model_on_another_mesh_predicts_as_trained() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let r = run(&["--mesh", "dp=2,tp=2", "--epochs", "3", "--out", &s(&out)]);
    let split = ckpt_train::DataSource::Digits(None).load().unwrap();
    for mesh in ["tp=4", "dp=1"] {
        let m = ckpt_core::layout::mesh::Mesh::parse(mesh).unwrap();
        let accs = ckpt_train::run_threads(&m, |d| {
            let (cfg, model) = ckpt_train::load_model(&out, &d, &candle_core::Device::Cpu)?;
            assert_eq!(cfg.kind(), ckpt_train::ModelKind::Mlp);
            let idx: Vec<usize> = (0..split.test.len()).collect();
            let (x, y) = split.test.batch(&idx, &candle_core::Device::Cpu)?;
            let pred = model.forward(&x, false)?.argmax(1)?;
            let ok = pred
                .eq(&y)?
                .to_dtype(candle_core::DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?;
            Ok(ok / idx.len() as f32)
        })
        .unwrap();
        assert!(
            (accs[0] - r.final_accuracy().unwrap()).abs() < 1e-6,
            "{mesh}: {accs:?} vs {:?}",
            r.final_accuracy()
        );
    }
}

/// A save that fails half way (here: rank 0 cannot clear its staging directory) leaves
/// the previous checkpoint complete and `latest` pointing at it; the run resumes from it.
#[test]
fn failed_save_leaves_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("step_10.tmp"), b"not a directory").unwrap();
    let args = [
        "--ranks",
        "2",
        "--max-steps",
        "12",
        "--save-every",
        "5",
        "--out",
        &s(&out),
        "--no-eval",
    ];
    let e = ckpt_train::train(&crate::util::cfg(&args), false).unwrap_err();
    assert!(e.to_string().contains("step_10.tmp"), "{e}");
    assert_eq!(
        std::fs::read_to_string(out.join(LATEST_FILE)).unwrap(),
        "step_5\n"
    );
    assert!(!out.join("step_10").exists());
    let (_, problems) = ckpt_core::engine::verify::verify(
        &[out.join("step_5")],
        ckpt_core::engine::verify::VerifyDepth {
            checksums: true,
            deep: false,
        },
    )
    .unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let r = run(&[
        "--ranks",
        "2",
        "--max-steps",
        "7",
        "--resume",
        &s(&out),
        "--no-eval",
    ]);
    assert_eq!((r.start_step, r.steps), (5, 7));
}

/// Resuming needs no flags repeated: the data set limits come from the trainer state.
#[test]
fn resume_keeps_the_data_limits() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    run(&[
        "--ranks",
        "2",
        "--train-limit",
        "300",
        "--max-steps",
        "3",
        "--out",
        &s(&a),
        "--no-eval",
    ]);
    let r = run(&[
        "--ranks",
        "2",
        "--epochs",
        "2",
        "--resume",
        &s(&a),
        "--out",
        &s(&b),
        "--no-eval",
    ]);
    assert_eq!(r.steps, 8, "2 epochs of 300 images in batches of 64");
    let st = read_trainer_state(&b.join("step_8/trainer_state.json")).unwrap();
    assert_eq!(
        (st.train_limit, st.steps_per_epoch, st.epoch),
        (Some(300), 4, 2)
    );
}

/// A ZeRO checkpoint of dp=2,tp=2 resharded by ckpt-reshard into PyTorch DCP files for
/// dp=1,tp=2 resumes (no strategy file: the layout comes from the DCP offsets) and the
/// loss goes on as the uninterrupted run's (1e-3).
#[test]
fn resume_from_a_resharded_dcp_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (out, dcp) = (dir.path().join("out"), dir.path().join("dcp"));
    let common = [
        "--mesh",
        "dp=2,tp=2",
        "--epochs",
        "2",
        "--no-eval",
        "--shard-optimizer",
    ];
    let whole = run(&common);
    run(&[&common[..], &["--max-steps", "12", "--out", &s(&out)]].concat());
    let req = ckpt_reshard::ReshardRequest {
        inputs: vec![out.join("step_12")],
        output: dcp.clone(),
        target: ckpt_reshard::Target::Mesh(vec![("dp".into(), 1), ("tp".into(), 2)]),
        ranks: ckpt_reshard::Ranks::All,
        selection: ckpt_core::layout::select::Selection::default(),
        keep_all: false,
        force: false,
        format: ckpt_reshard::OutputFormat::Dcp,
        shard: Vec::new(),
        compression: None,
        computations: Default::default(),
        orbax_item: None,
        maxtext_unscanned: false,
    };
    ckpt_reshard::reshard(&req, &|_| {}, &|_, _| {}).unwrap();
    std::fs::remove_file(dcp.join("strategy.json")).ok();
    let rest = run(&[
        "--mesh",
        "tp=2",
        "--epochs",
        "2",
        "--no-eval",
        "--resume",
        &s(&dcp),
    ]);
    assert_eq!(rest.start_step, 12);
    assert!(
        max_diff(&whole.losses[12..], &rest.losses) < 1e-3,
        "{:?} vs {:?}",
        rest.losses,
        &whole.losses[12..]
    );
}

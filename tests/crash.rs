//! Replacing outputs and training saves: the destination names a complete old or new
//! output at every instant, and nothing that holds the only complete copy is deleted.

use crate::util::Dir;
use std::process::Command;

/// The entries of a directory, sorted, less the TensorBoard event files that every
/// `ckpt train` run adds beside its steps (they are not checkpoints and are never pruned).
fn listing(d: &Dir, rel: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d.path(rel))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with("events.out.tfevents."))
        .collect();
    v.sort();
    v
}

#[test]
fn force_replaces_a_directory_or_a_file_with_nothing_left_over() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    d.ok(&["merge", "ex", "-o", "out/m", "--exclude", "embed.*"]);
    d.ok(&["merge", "ex", "-o", "out/m", "--force"]);
    let o = d.ok(&["inspect", "out/m", "--json"]);
    assert!(
        o.stdout.contains("embed.weight"),
        "the new output replaced the old"
    );
    // Onto an existing regular file: it is replaced and no temporary is left.
    std::fs::write(d.path("out/f"), b"old").unwrap();
    d.ok(&["merge", "ex", "-o", "out/f", "--force"]);
    assert!(d.path("out/f/model.safetensors").is_file());
    assert_eq!(listing(&d, "out"), ["f", "m"]);
}

#[test]
fn a_replace_killed_between_its_renames_keeps_the_old_output() {
    // Where the filesystem cannot exchange two paths, the old output is renamed aside
    // first; a crash right then must not lose it (the old code deleted it on the next
    // run as a stale temporary).
    let d = Dir::new();
    d.example("ex", "tp=2");
    d.ok(&["merge", "ex", "-o", "out/m", "--exclude", "embed.*"]);
    let old = std::fs::read(d.path("out/m/model.safetensors")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["merge", "ex", "-o", "out/m", "--force", "-q"])
        .current_dir(d.tmp.path())
        .env("CKPT_TEST_NO_EXCHANGE", "1")
        .env("CKPT_TEST_CRASH_AT", "replace")
        .output()
        .unwrap();
    assert!(!o.status.success(), "the crash point was not reached");
    assert!(!d.path("out/m").exists());
    let aside = listing(&d, "out");
    assert!(aside.iter().any(|n| n.starts_with(".m.old-")), "{aside:?}");
    // The next write of the same output puts the old one back before anything else.
    let o = d.ckpt(&["merge", "ex", "-o", "out/m"]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(o.stderr.contains("out/m already exists"), "{}", o.stderr);
    assert_eq!(
        std::fs::read(d.path("out/m/model.safetensors")).unwrap(),
        old
    );
    assert_eq!(listing(&d, "out"), ["m"]);
}

#[test]
fn resaving_an_existing_step_keeps_latest_complete_and_prunes_by_latest() {
    let d = Dir::new();
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--ranks",
            "2",
            "--save-every",
            "2",
            "--out",
            "run",
            "-q",
        ];
        args.extend_from_slice(extra);
        d.ok(&args);
    };
    train(&["--max-steps", "6"]);
    assert_eq!(listing(&d, "run"), ["latest", "step_2", "step_4", "step_6"]);
    // Leftovers of killed saves are cleaned by the next save.
    std::fs::create_dir_all(d.path("run/step_3.tmp/ckpt_0")).unwrap();
    std::fs::create_dir_all(d.path("run/.step_1.pruned-999999")).unwrap();
    // Resume from step 2 into the same --out: step_4 exists and `latest` names it.
    train(&["--resume", "run/step_2", "--max-steps", "4", "--keep", "1"]);
    assert_eq!(
        std::fs::read_to_string(d.path("run/latest")).unwrap(),
        "step_4\n"
    );
    // --keep 1 keeps the step `latest` names, not the highest number (step_6, from the
    // first run, which the old prune kept while deleting the step `latest` named).
    assert_eq!(listing(&d, "run"), ["latest", "step_4"]);
    d.ok(&["verify", "run"]);
}

#[test]
fn an_input_truncated_while_mapped_is_named_and_nothing_is_left() {
    let d = Dir::new();
    d.ok(&[
        "example", "ex", "--mesh", "tp=2", "--hidden", "256", "--vocab", "4000",
    ]);
    let o = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["merge", "ex", "-o", "out", "-q"])
        .current_dir(d.tmp.path())
        .env(
            "CKPT_TEST_TRUNCATE_BEFORE_COPY",
            "ex/ckpt_1/model.safetensors",
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("ex/ckpt_1/model.safetensors: the file shrank while it was being read"),
        "{stderr}"
    );
    let left: Vec<String> = listing(&d, ".").into_iter().filter(|n| n != "ex").collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Background saves (the default) and `--sync-save` write the same bytes; a background
/// save that fails on one rank is reported, fails the run, and leaves `latest` on the
/// last complete checkpoint.
#[test]
fn background_saves_match_sync_ones_and_a_failed_one_is_never_latest() {
    let d = Dir::new();
    let args = [
        "train",
        "--mesh",
        "dp=2,tp=2",
        "--max-steps",
        "6",
        "--save-every",
        "2",
        "-q",
    ];
    let run = |out: &str, extra: &[&str], env: Option<(&str, &str)>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"));
        cmd.args(args)
            .args(["--out", out])
            .args(extra)
            .current_dir(d.path("."));
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        cmd.output().expect("run ckpt")
    };
    assert!(run("bg", &[], None).status.success());
    assert!(run("sync", &["--sync-save"], None).status.success());
    for step in ["step_2", "step_4", "step_6"] {
        for r in 0..4 {
            let f = format!("{step}/ckpt_{r}/model.safetensors");
            assert_eq!(
                std::fs::read(d.path(&format!("bg/{f}"))).unwrap(),
                std::fs::read(d.path(&format!("sync/{f}"))).unwrap(),
                "{f}"
            );
        }
    }
    // Rank 1's part of step 4 fails.
    let o = run("fail", &[], Some(("CKPT_TEST_SAVE_FAIL", "1:4")));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("writing failed"), "{err}");
    assert_eq!(
        std::fs::read_to_string(d.path("fail/latest")).unwrap(),
        "step_2\n"
    );
    assert!(!d.path("fail/step_4").exists());
    d.ok(&["verify", "fail"]);
}

//! The command line without surprises (issue 35): inputs that would give an empty
//! output refused and named, one rule for list options, usage errors exit 2, `--json`
//! errors, `--help`'s grouping, the index's `total_size`, `merge --rank N`, and the
//! DCP format names.

use crate::util::{copy_dir, Dir};
use std::path::{Path, PathBuf};

fn megatron_dist_ckpt() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron/tp2pp2/dist_ckpt")
}

fn json_of(text: &str) -> serde_json::Value {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

// ---- never silent ----

/// A Megatron dist_ckpt copied without DCP's `.metadata`: `common.pt` beside the
/// `.distcp` files was read as a loose torch.save, merged to 0 tensors with exit 0.
#[test]
fn issue_35_distcp_files_without_metadata_are_refused_naming_it() {
    let d = Dir::new();
    copy_dir(&megatron_dist_ckpt(), &d.path("dist"));
    std::fs::remove_file(d.path("dist/.metadata")).unwrap();
    let missing = Path::new("dist").join(".metadata").display().to_string();
    for args in [
        &["merge", "dist", "-o", "m"][..],
        &["reshard", "dist", "-o", "r", "--to", "2"],
        &["merge", "dist/__0_0.distcp", "-o", "m"],
    ] {
        let o = d.fails(args);
        assert!(
            o.stderr.contains(&missing) && o.stderr.contains("missing"),
            "{args:?}: {}",
            o.stderr
        );
        assert!(!d.path("m").exists() && !d.path("r").exists(), "{args:?}");
    }
    // verify and inspect do not call it fine.
    let o = d.fails(&["verify", "dist"]);
    assert!(o.stdout.contains(&missing), "{}{}", o.stdout, o.stderr);
    assert!(!o.stdout.contains("OK"), "{}", o.stdout);
    let o = d.fails(&["inspect", "dist"]);
    assert!(o.stderr.contains(&missing), "{}", o.stderr);
}

/// A safetensors file of no tensors (a valid header `{}`).
fn write_empty_safetensors(path: &Path) {
    let header = b"{}      ";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn issue_35_an_input_of_no_tensors_is_refused_not_written_empty() {
    let d = Dir::new();
    std::fs::create_dir(d.path("in")).unwrap();
    write_empty_safetensors(&d.path("in/model.safetensors"));
    for args in [
        &["merge", "in", "-o", "m"][..],
        &["reshard", "in", "-o", "m", "--to", "2", "--shard", "*=0"],
    ] {
        let o = d.fails(args);
        assert!(
            o.stderr.contains("no tensors") && o.stderr.contains("model.safetensors"),
            "{args:?}: {}",
            o.stderr
        );
        assert!(!d.path("m").exists(), "{args:?} wrote an output");
    }
    let o = d.fails(&["verify", "in"]);
    assert!(o.stdout.contains("no tensors"), "{}", o.stdout);
    let o = d.fails(&["verify", "in", "--json"]);
    assert_eq!(json_of(&o.stdout)["ok"], false, "{}", o.stdout);
}

/// The user's own selection that keeps nothing is refused too, saying that it was the
/// selection (exit 1: nothing was written).
#[test]
fn issue_35_a_selection_that_keeps_nothing_says_so() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let o = d.fails(&["merge", "ex", "-o", "m", "--include", "nothing.*"]);
    assert!(
        o.stderr
            .contains("--include 'nothing.*' leave none of the input's"),
        "{}",
        o.stderr
    );
    assert!(!d.path("m").exists());
}

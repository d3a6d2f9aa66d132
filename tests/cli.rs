//! The command line without surprises (issue 35): inputs that would give an empty
//! output refused and named, one rule for list options, usage errors exit 2, `--json`
//! errors, `--help`'s grouping, the index's `total_size`, `merge --rank N`, and the
//! DCP format names.

use crate::util::{copy_dir, example_originals, full_tensors, originals_of, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn megatron_dist_ckpt() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron/tp2pp2/dist_ckpt")
}

/// Every file under `dir` (relative path → bytes).
fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
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

// ---- --max-shard-size's index ----

#[test]
fn issue_35_index_total_size_counts_only_the_shards_it_lists() {
    let d = Dir::new();
    d.ok(&[
        "example",
        "ex",
        "--mesh",
        "tp=2",
        "--hidden",
        "16",
        "--vocab",
        "37",
        "--optimizer",
    ]);
    d.ok(&["merge", "ex", "-o", "m", "--max-shard-size", "2kB", "-q"]);
    assert!(d.path("m/optimizer.safetensors").exists());
    let index =
        json_of(&std::fs::read_to_string(d.path("m/model.safetensors.index.json")).unwrap());
    let all = originals_of("tp=2", 2, true);
    let listed: u64 = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| all[k].len() as u64)
        .sum();
    let weights: u64 = all
        .iter()
        .filter(|(k, _)| !k.starts_with("optim."))
        .map(|(_, v)| v.len() as u64)
        .sum();
    assert_eq!(listed, weights);
    assert_eq!(index["metadata"]["total_size"], weights);
    assert!(weights < all.values().map(|v| v.len() as u64).sum::<u64>());
}

// ---- list options ----

#[test]
fn issue_35_list_options_take_one_value_each_repeated_or_comma_separated() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let all = example_originals("tp=2");
    let want: BTreeMap<String, Vec<u8>> = all
        .iter()
        .filter(|(k, _)| k.starts_with("embed.") || k.starts_with("layers.0."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // The input after the option is an input, not a second pattern.
    d.ok(&[
        "merge",
        "--include",
        "embed.*",
        "--include",
        "layers.0.*",
        "ex",
        "-o",
        "a",
        "-q",
    ]);
    d.ok(&[
        "merge",
        "--include",
        "embed.*,layers.0.*",
        "ex",
        "-o",
        "b",
        "-q",
    ]);
    // A comma inside a glob's {..} is the glob's.
    d.ok(&[
        "merge",
        "ex",
        "-o",
        "c",
        "-q",
        "--include",
        "{embed,layers.0}.*",
    ]);
    for out in ["a", "b", "c"] {
        assert_eq!(full_tensors(&d.path(out)), want, "{out}");
    }
    d.ok(&[
        "merge",
        "ex",
        "-o",
        "e",
        "-q",
        "--exclude",
        "embed.*",
        "--exclude",
        "layers.0.*",
    ]);
    let rest: Vec<String> = full_tensors(&d.path("e")).into_keys().collect();
    let want_rest: Vec<String> = all
        .keys()
        .filter(|k| !want.contains_key(*k))
        .cloned()
        .collect();
    assert_eq!(rest, want_rest);
    // The old mistake, several patterns after one --include: the second is an input
    // that does not exist, said to be a pattern (usage, exit 2).
    let o = d.ckpt(&[
        "merge",
        "--include",
        "embed.*",
        "layers.0.*",
        "ex",
        "-o",
        "x",
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("layers.0.*: no such file or directory")
            && o.stderr.contains("--include A --include B"),
        "{}",
        o.stderr
    );
    assert!(!d.path("x").exists());
    // An empty pattern in a list is a usage error.
    let o = d.ckpt(&["merge", "ex", "-o", "x", "--include", "embed.*,"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("empty value"), "{}", o.stderr);
}

#[test]
fn issue_35_shard_rules_repeated_comma_separated_or_in_the_old_spelling() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    d.ok(&["merge", "ex", "-o", "full", "-q"]);
    let rules = ["*.qkv.weight=0", "*.proj.weight=1"];
    d.ok(&[
        "reshard", "full", "-o", "a", "--to", "2", "-q", "--shard", rules[0], "--shard", rules[1],
    ]);
    let joined = rules.join(",");
    d.ok(&[
        "reshard", "full", "-o", "b", "--to", "2", "-q", "--shard", &joined,
    ]);
    // The old spelling, several rules after one --shard, before the input.
    d.ok(&[
        "reshard", "--to", "2", "-q", "--shard", rules[0], rules[1], "full", "-o", "c",
    ]);
    let a = tree(&d.path("a"));
    assert_eq!(tree(&d.path("b")), a);
    assert_eq!(tree(&d.path("c")), a);
    let s = json_of(&std::fs::read_to_string(d.path("a/strategy.json")).unwrap());
    assert_eq!(
        s["tensors"]["layers.0.attn.proj.weight"]["placements"][0],
        "Shard(1)"
    );
    assert_eq!(
        s["tensors"]["layers.0.attn.qkv.weight"]["placements"][0],
        "Shard(0)"
    );
}

// ---- usage errors ----

#[test]
fn issue_35_to_zero_is_said_plainly_and_exits_2() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let o = d.ckpt(&["reshard", "ex", "-o", "r", "--to", "0"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("--to must be at least 1"), "{}", o.stderr);
    assert!(!o.stderr.contains("18446744073709551615"), "{}", o.stderr);
}

#[test]
fn issue_35_a_mesh_axis_the_source_lacks_is_a_usage_error() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let o = d.ckpt(&["reshard", "ex", "-o", "r", "--mesh", "pp=2"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("pp"), "{}", o.stderr);
    assert!(!d.path("r").exists());
}

#[test]
fn issue_35_merge_rank_takes_a_number_with_world_size() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    d.ok(&[
        "merge",
        "ex",
        "-o",
        "whole",
        "--max-shard-size",
        "2kB",
        "-q",
    ]);
    for r in ["0", "1", "2"] {
        d.ok(&[
            "merge",
            "ex",
            "-o",
            "parts",
            "--max-shard-size",
            "2kB",
            "-q",
            "--rank",
            r,
            "--world-size",
            "3",
        ]);
    }
    assert_eq!(tree(&d.path("parts")), tree(&d.path("whole")));
    for (args, says) in [
        (&["--rank", "1"][..], "give --world-size M too"),
        (&["--rank", "3", "--world-size", "3"], "ranks are 0 to 2"),
        (&["--world-size", "3"], "goes with --rank N"),
        (&["--rank", "x"], "not a rank number or `auto`"),
    ] {
        let mut all = vec!["merge", "ex", "-o", "p2", "--max-shard-size", "2kB"];
        all.extend_from_slice(args);
        let o = d.ckpt(&all);
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains(says), "{args:?}: {}", o.stderr);
    }
}

// ---- --json errors ----

#[test]
fn issue_35_json_errors_are_json() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    for (args, code) in [
        (&["merge", "nowhere", "-o", "m", "--json"][..], 1),
        (&["reshard", "nowhere", "-o", "r", "--to", "2", "--json"], 1),
        (&["inspect", "nowhere", "--json"], 1),
        (&["compress", "nowhere", "-o", "z", "--json"], 1),
        (&["reshard", "ex", "-o", "r", "--mesh", "pp=2", "--json"], 2),
        // clap's own usage errors too.
        (&["reshard", "ex", "-o", "r", "--to", "0", "--json"], 2),
        (&["merge", "ex", "--json"], 2),
    ] {
        let o = d.ckpt(args);
        assert_eq!(o.code, code, "{args:?}: {}{}", o.stdout, o.stderr);
        let v = json_of(&o.stdout);
        assert_eq!(v["exit_code"], code, "{args:?}");
        let e = v["error"].as_str().unwrap();
        assert!(!e.is_empty(), "{args:?}");
        if args[1] == "nowhere" {
            assert!(e.contains("nowhere"), "{args:?}: {e}");
        }
        assert!(o.stderr.is_empty(), "{args:?}: {}", o.stderr);
    }
    let o = d.ckpt(&["reshard", "ex", "-o", "r", "--to", "0", "--json"]);
    assert!(
        json_of(&o.stdout)["error"]
            .as_str()
            .unwrap()
            .contains("--to must be at least 1"),
        "{}",
        o.stdout
    );
}

// ---- --help ----

#[test]
fn issue_35_help_shows_the_tools_apart_from_the_demo() {
    let d = Dir::new();
    let o = d.ok(&["--help"]);
    let help = &o.stdout;
    let tools = help.find("Checkpoint tools:").expect(help);
    let demo = help.find("Demo and examples").expect(help);
    assert!(tools < demo, "{help}");
    let line_of = |name: &str| {
        help.lines()
            .position(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not listed:\n{help}"))
    };
    let demo_line = help[..demo].lines().count();
    for tool in [
        "inspect",
        "verify",
        "merge",
        "reshard",
        "compress",
        "decompress",
    ] {
        assert!(line_of(tool) < demo_line, "{tool}:\n{help}");
    }
    for other in ["train", "infer", "demo", "example"] {
        assert!(line_of(other) >= demo_line, "{other}:\n{help}");
    }
    let merge = &help.lines().nth(line_of("merge")).unwrap().to_string();
    assert!(merge.contains("Hugging Face's layout"), "{merge}");
    assert!(!merge.contains("(Hugging Face) checkpoint"), "{merge}");
    // Still commands.
    d.ok(&["example", "--help"]);
    d.ok(&["train", "--help"]);
}

#[test]
fn issue_35_merge_plan_says_what_each_output_file_reads_and_writes_nothing() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let o = d.ok(&[
        "merge",
        "ex",
        "-o",
        "m",
        "--max-shard-size",
        "2kB",
        "--plan",
    ]);
    assert!(!d.path("m").exists(), "--plan wrote an output");
    assert!(
        o.stdout.contains("ex/ckpt_1/model.safetensors (rank 1)"),
        "{}",
        o.stdout
    );
    let o = d.ok(&[
        "merge",
        "ex",
        "-o",
        "m",
        "--max-shard-size",
        "2kB",
        "--plan",
        "--json",
    ]);
    let plan = json_of(&o.stdout);
    assert!(!d.path("m").exists());
    d.ok(&["merge", "ex", "-o", "m", "--max-shard-size", "2kB", "-q"]);
    let planned: Vec<String> = plan["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["output"].as_str().unwrap().to_string())
        .collect();
    let written: Vec<String> = tree(&d.path("m"))
        .into_keys()
        .filter(|k| k.ends_with(".safetensors"))
        .collect();
    let mut sorted = planned.clone();
    sorted.sort();
    assert_eq!(sorted, written);
    let total: u64 = example_originals("tp=2")
        .values()
        .map(|v| v.len() as u64)
        .sum();
    assert_eq!(plan["bytes_written"], total);
    // With --rank N: that process's files only.
    let o = d.ok(&[
        "merge",
        "ex",
        "-o",
        "m2",
        "--max-shard-size",
        "2kB",
        "--plan",
        "--json",
        "--rank",
        "1",
        "--world-size",
        "2",
    ]);
    let mine: Vec<String> = json_of(&o.stdout)["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["output"].as_str().unwrap().to_string())
        .collect();
    let want: Vec<String> = planned.iter().skip(1).step_by(2).cloned().collect();
    assert_eq!(mine, want);
}

// ---- DCP's format names ----

#[test]
fn issue_35_dcp_format_names_say_what_they_mean() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    // (DCP stores one box per tensor: the blocked QKV is left out.)
    let x = "*.qkv.*";
    let o = d.ok(&[
        "reshard",
        "ex",
        "-o",
        "new",
        "--to",
        "2",
        "--format",
        "dcp-safetensors",
        "-q",
        "--exclude",
        x,
    ]);
    assert!(!o.stderr.contains("note: --format dcp"), "{}", o.stderr);
    let o = d.ok(&[
        "reshard",
        "ex",
        "-o",
        "old",
        "--to",
        "2",
        "--format",
        "dcp",
        "-q",
        "--exclude",
        x,
    ]);
    assert!(
        o.stderr
            .contains("--format dcp is read as --format dcp-safetensors")
            && o.stderr.contains("--format distcp"),
        "{}",
        o.stderr
    );
    assert_eq!(tree(&d.path("old")), tree(&d.path("new")));
    assert!(tree(&d.path("new"))
        .keys()
        .any(|k| k.ends_with(".safetensors")));
    d.ok(&[
        "reshard",
        "ex",
        "-o",
        "distcp",
        "--to",
        "2",
        "--format",
        "distcp",
        "-q",
        "--exclude",
        x,
    ]);
    assert!(d.path("distcp/.metadata").exists());
    let mut want = example_originals("tp=2");
    want.retain(|k, _| !k.contains(".qkv."));
    assert_eq!(full_tensors(&d.path("distcp")), want);
    assert_eq!(full_tensors(&d.path("new")), want);
    let o = d.ok(&["reshard", "--help"]);
    let values = o
        .stdout
        .lines()
        .find(|l| l.contains("[default: ckpt]"))
        .unwrap_or_default()
        .to_string();
    assert!(
        values.contains("dcp-safetensors")
            && values.contains("distcp")
            && !values.contains(" dcp,"),
        "{values}"
    );
    // --to's help says which axis it sets.
    assert!(o.stdout.contains("tensor-parallel size"), "{}", o.stdout);
    assert!(o.stdout.contains("data-parallel size"), "{}", o.stdout);
}

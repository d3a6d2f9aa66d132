//! ZeRO checkpoints in pictures: `inspect --json`, `--show` and `--html` report each
//! rank's part of a parameter as the flat element range DeepSpeed gave it, not as the
//! boxes ckpt cuts it into for reading. The expected ranges come from the fixtures' own
//! numbers (tests/fixtures/deepspeed), read by Python's pickle with stand-ins for torch's
//! classes (no torch needed): ZeRO-1/2's `param_slice_mappings` (how many elements of
//! each parameter each rank's partition holds), ZeRO-3's `param_shapes` cut into
//! `ceil(numel / dp)` per rank and checked against the ranks' `fp32_flat_groups`.

use crate::util::Dir;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(v: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/deepspeed/{v}/ckpt"))
}

/// Each parameter's pieces as `(dp rank, first element, elements)`, in rank order, as
/// DeepSpeed partitioned it; prints `{name: [[rank, start, len], ...]}`.
const PARTITIONS: &str = r#"
import collections, glob, json, math, os, pickle, re, sys, zipfile

class Stub:
    def __init__(self, *a, **k):
        self.args = a
    def __setstate__(self, state):
        self.state = state

class Unpickler(pickle.Unpickler):
    def find_class(self, mod, name):
        if name.startswith("_rebuild_tensor"):
            return lambda storage, offset, size, *rest: {"size": list(size)}
        if name.startswith("_rebuild_parameter"):
            return lambda data, *a: data
        if name == "_rebuild_from_type_v2":
            return lambda func, t, args, state: func(*args)
        if (mod, name) == ("torch", "Size"):
            return lambda x=(): list(x)
        if (mod, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return type(name, (Stub,), {})
    def persistent_load(self, pid):
        return None

def load(path):
    with zipfile.ZipFile(path) as z:
        pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
        return Unpickler(z.open(pkl)).load()

tag = glob.glob(os.path.join(sys.argv[1], "global_step*"))[0]
model = load(glob.glob(os.path.join(tag, "*model_states.pt"))[0])
shapes = collections.OrderedDict()
for g in model["param_shapes"]:
    shapes.update(g)
numel = {n: math.prod(s) for n, s in shapes.items()}
optim = {}
for f in glob.glob(os.path.join(tag, "*optim_states.pt")):
    rank = int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)).group(1))
    optim[rank] = load(f)["optimizer_state_dict"]
dp = len(optim)
pieces = {n: [] for n in shapes}
if "param_slice_mappings" in optim[0]:
    # ZeRO-1/2: a parameter's elements run over consecutive ranks' partitions.
    held = {n: 0 for n in shapes}
    for r in range(dp):
        for g in optim[r]["param_slice_mappings"]:
            for n, frag in g.items():
                k = frag.state["numel"]
                pieces[n].append([r, held[n], k])
                held[n] += k
    assert held == numel, (held, numel)
else:
    # ZeRO-3: each parameter alone, ceil(numel / dp) elements per rank.
    parts = {n: -(-k // dp) for n, k in numel.items()}
    for r in range(dp):
        flat = sum(t["size"][0] for t in optim[r]["fp32_flat_groups"])
        assert flat == sum(parts.values()), (flat, parts)
        for n, k in numel.items():
            lo, hi = r * parts[n], min(k, (r + 1) * parts[n])
            if hi > lo:
                pieces[n].append([r, lo, hi - lo])
print(json.dumps({"shapes": shapes, "pieces": pieces}))
"#;

struct Partitions {
    shapes: BTreeMap<String, Vec<u64>>,
    pieces: BTreeMap<String, Vec<(u64, u64, u64)>>,
}

/// DeepSpeed's partitioning of fixture `v`, or `None` (said on the terminal) without
/// a python3.
fn partitions(v: &str) -> Option<Partitions> {
    let py = std::env::var("CKPT_PYTHON").unwrap_or_else(|_| "python3".into());
    let o = match Command::new(&py)
        .args(["-c", PARTITIONS])
        .arg(fixture(v))
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            assert!(std::env::var("CKPT_PYTHON").is_err(), "{py}: {e}");
            // Straight to the terminal: libtest captures `eprintln!` of passing tests.
            let _ = writeln!(
                std::io::stderr(),
                "zero_pictures::*: SKIPPED: no python3 to read the fixtures' partitions ({e})"
            );
            return None;
        }
    };
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let shapes = v["shapes"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, s)| {
            let s = s.as_array().unwrap().iter().map(|d| d.as_u64().unwrap());
            (n.clone(), s.collect())
        })
        .collect();
    let pieces = v["pieces"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, ps)| {
            let ps = ps.as_array().unwrap().iter().map(|p| {
                let p: Vec<u64> = p
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect();
                (p[0], p[1], p[2])
            });
            (n.clone(), ps.collect())
        })
        .collect();
    Some(Partitions { shapes, pieces })
}

/// The dp rank in a ZeRO file name (`[bf16_]zero_pp_rank_D_mp_rank_XX_...`).
fn dp_rank(path: &str) -> u64 {
    let name = Path::new(path).file_name().unwrap().to_string_lossy();
    let rest = name
        .split("zero_pp_rank_")
        .nth(1)
        .unwrap_or_else(|| panic!("{name}"));
    rest.split('_').next().unwrap().parse().unwrap()
}

#[test]
fn json_pieces_are_deepspeeds_partitions() {
    for v in [
        "zero1_fp32",
        "zero2_fp32",
        "zero2_bf16",
        "zero3_fp32",
        "zero3_fp16",
    ] {
        let Some(want) = partitions(v) else {
            return;
        };
        let d = Dir::new();
        let o = d.ok(&["inspect", &fixture(v).display().to_string(), "--json"]);
        let j: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
        let files: Vec<String> = j["files"]
            .as_array()
            .unwrap_or_else(|| panic!("no files in {}", o.stdout))
            .iter()
            .map(|f| f["path"].as_str().unwrap().to_string())
            .collect();
        let tensors = j["tensors"].as_array().unwrap();
        let mut flat_pieces = 0;
        for (name, expected) in &want.pieces {
            let numel: u64 = want.shapes[name].iter().product();
            // The weights and both Adam moments are partitioned alike.
            for tensor in [
                name.clone(),
                format!("optim.{name}.exp_avg"),
                format!("optim.{name}.exp_avg_sq"),
            ] {
                let t = tensors
                    .iter()
                    .find(|t| t["name"] == tensor.as_str())
                    .unwrap_or_else(|| panic!("{v}: no `{tensor}`"));
                let got: Vec<(u64, u64, u64)> = t["pieces"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| {
                        let rank = dp_rank(&files[p["file"].as_u64().unwrap() as usize]);
                        // Labelled by the data-parallel rank of its file.
                        assert_eq!(p["rank"].as_u64(), Some(rank), "{v}: `{tensor}`");
                        match p.get("flat") {
                            Some(f) => {
                                flat_pieces += 1;
                                (rank, f[0].as_u64().unwrap(), f[1].as_u64().unwrap())
                            }
                            // A rank holding the whole parameter: the whole box.
                            None => {
                                assert!(p["start"].as_array().unwrap().iter().all(|x| x == 0));
                                assert_eq!(p["shape"], serde_json::json!(want.shapes[name]));
                                (rank, 0, numel)
                            }
                        }
                    })
                    .collect();
                assert_eq!(&got, expected, "{v}: `{tensor}`");
                for p in t["pieces"].as_array().unwrap() {
                    let len = p.get("flat").map_or(numel, |f| f[1].as_u64().unwrap());
                    let elem = match t["dtype"].as_str() {
                        Some("F32") => 4,
                        Some("F16" | "BF16") => 2,
                        d => panic!("{v}: `{tensor}` of dtype {d:?}"),
                    };
                    assert_eq!(p["bytes"].as_u64(), Some(len * elem), "{v}: `{tensor}`");
                }
            }
        }
        assert!(flat_pieces > 0, "{v}: no flat pieces at all");
    }
}

#[test]
fn show_draws_a_zero3_partition_as_runs_starting_mid_row() {
    let Some(want) = partitions("zero3_fp32") else {
        return;
    };
    // A matrix whose rank-1 part starts inside a row.
    let (name, cols, start) = want
        .pieces
        .iter()
        .find_map(|(n, ps)| {
            let s = &want.shapes[n];
            (s.len() == 2 && ps.len() == 2 && ps[1].1 % s[1] != 0)
                .then(|| (n.clone(), s[1], ps[1].1))
        })
        .expect("a matrix split mid-row in the fixture");
    let d = Dir::new();
    let o = d.ok(&[
        "inspect",
        &fixture("zero3_fp32").display().to_string(),
        "--show",
        &name,
    ]);
    let text = o.stdout;
    // Two holdings, one per rank, each named by its flat range.
    assert!(text.contains("2 piece(s) in 2 file(s)"), "{text}");
    let p = &want.pieces[&name];
    for (r, s, l) in p {
        let line = text
            .lines()
            .find(|line| line.contains(&format!("flat [{s}..{}]", s + l)))
            .unwrap_or_else(|| panic!("no flat [{s}..{}]:\n{text}", s + l));
        assert!(line.contains(&format!("rank {r}")), "{line}");
    }
    // `inspect`'s table counts the pieces as drawn.
    let table = d
        .ok(&["inspect", &fixture("zero3_fp32").display().to_string()])
        .stdout;
    let line = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name.as_str()))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(line.ends_with(&format!("{} pieces", p.len())), "{line}");
    // The row where rank 1 begins is drawn half one rank, half the other: its first
    // `start % cols` columns rank 0's, the rest rank 1's (two characters a column).
    let row = (start / cols) as usize;
    let split = (start % cols) as usize;
    // The grid's lines: `  5 |000000111111|`, a character per half column.
    let grid: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            let (_, cells) = l.split_once(" |")?;
            let cells = cells.strip_suffix('|')?;
            cells.chars().all(|c| c == '0' || c == '1').then_some(cells)
        })
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(grid.len() as u64, want.shapes[&name][0], "{text}");
    let wide = 2 * cols as usize;
    assert_eq!(grid[row].len(), wide, "{text}");
    assert_eq!(
        grid[row],
        format!("{}{}", "0".repeat(2 * split), "1".repeat(wide - 2 * split)),
        "{text}"
    );
}

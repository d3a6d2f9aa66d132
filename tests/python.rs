//! Interoperability with the reference Python stack: numpy + safetensors write the
//! originals, ckpt slices and merges them, Python checks every byte and every
//! `saved_offsets`. Needs `CKPT_PYTHON` (set by scripts/test.sh) or a python3 with
//! numpy and safetensors.

use crate::util::Dir;
use std::process::Command;

fn python() -> String {
    std::env::var("CKPT_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn run_python(d: &Dir, script: &str) -> String {
    let o = Command::new(python())
        .arg("-c")
        .arg(script)
        .current_dir(d.tmp.path())
        .output()
        .expect("run python");
    assert!(
        o.status.success(),
        "python failed (run scripts/test.sh, or pip install numpy safetensors):\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const WRITE_ORIGINALS: &str = r#"
import numpy as np, os
from safetensors.numpy import save_file
rng = np.random.default_rng(7)
t = {
  "embed.weight": rng.standard_normal((37, 12)).astype(np.float32),
  "qkv.weight": rng.standard_normal((18, 12)).astype(np.float16),
  "proj.weight": rng.integers(-1000, 1000, (12, 7)).astype(np.int32),
  "norm.weight": rng.standard_normal((12,)).astype(np.float64),
  "mask": rng.integers(0, 255, (5, 3, 4)).astype(np.uint8),
  "step": np.array(42, dtype=np.int64),
}
os.makedirs("orig", exist_ok=True)
save_file(t, "orig/model.safetensors")
print("ok")
"#;

const CHECK: &str = r#"
import json, glob, numpy as np
from safetensors.numpy import load_file
from safetensors import safe_open
orig = load_file("orig/model.safetensors")
merged = load_file("merged/model.safetensors")
assert sorted(orig) == sorted(merged), (sorted(orig), sorted(merged))
for k in orig:
    a, b = orig[k], merged[k]
    assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), k
# Every single-box rank tensor sits at its saved_offsets in the original (DCP convention).
checked = 0
for f in sorted(glob.glob("sliced/ckpt_*/model.safetensors")):
    with safe_open(f, framework="numpy") as s:
        info = json.loads(s.metadata()["DCP_SHARDING_INFO"])
        for k in s.keys():
            local = s.get_tensor(k)
            if k not in info:
                continue
            off = info[k]["saved_offsets"]
            idx = tuple(slice(o, o + n) for o, n in zip(off, local.shape))
            assert orig[k][idx].tobytes() == local.tobytes(), (f, k, off)
            checked += 1
print("checked", len(orig), "tensors and", checked, "offsets")
"#;

#[test]
fn python_reads_back_every_byte_and_offset() {
    let d = Dir::new();
    assert_eq!(run_python(&d, WRITE_ORIGINALS).trim(), "ok");
    let mut s = ckpt_core::layout::strategy::Strategy::new(
        ckpt_core::layout::mesh::Mesh::parse("dp=2,tp=3").unwrap(),
    );
    let ck = ckpt_core::Checkpoint::open(&[d.path("orig")]).unwrap();
    use ckpt_core::layout::Placement::{self, Replicate};
    let place = |name: &str| -> Placement {
        match name {
            "embed.weight" => Placement::shard(0),
            "qkv.weight" => Placement::blocked(0, 3),
            "proj.weight" => Placement::shard(1),
            "mask" => Placement::shard(2),
            _ => Replicate,
        }
    };
    for (name, t) in &ck.tensors {
        let l = ckpt_core::layout::TensorLayout::new(
            t.shape.clone(),
            t.dtype,
            vec![Replicate, place(name)],
        );
        s.insert(name.clone(), l).unwrap();
    }
    std::fs::write(d.path("predict.json"), s.to_json()).unwrap();
    d.ok(&[
        "reshard",
        "orig",
        "-o",
        "sliced",
        "--strategy",
        "predict.json",
    ]);
    d.ok(&["verify", "sliced"]);
    d.ok(&["merge", "sliced", "-o", "merged"]);
    let out = run_python(&d, CHECK);
    // Owners are the dp=0 ranks 0..3: embed, proj, mask 3 each (torch.chunk(4, 3) leaves
    // rank 2 an empty mask, still listed); norm and step once; qkv is 3 boxes per rank,
    // so it has no offsets.
    assert_eq!(out.trim(), "checked 6 tensors and 11 offsets");
}

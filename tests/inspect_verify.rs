//! `ckpt inspect` and `ckpt verify`, on good and broken checkpoints.

use crate::util::Dir;

#[test]
fn clean_checkpoint_verifies_and_inspects() {
    let d = Dir::new();
    d.example("ex", "dp=2,tp=4");
    let o = d.ok(&["verify", "ex", "--deep"]);
    assert!(
        o.stdout.starts_with("ok: 8 file(s), 12 tensors"),
        "{}",
        o.stdout
    );
    let o = d.ok(&["inspect", "ex", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let qkv = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "layers.0.attn.qkv.weight")
        .unwrap();
    assert_eq!(qkv["shape"], serde_json::json!([48, 16]));
    assert_eq!(qkv["placements"], "dp:Replicate tp:Shard(0,blocks=3)");
    // Replicated data is written once: dp rank 1's files hold nothing.
    let files = v["files"].as_array().unwrap();
    assert_eq!(files.len(), 8);
    assert_eq!(files[4]["bytes"], 0);
    assert!(files[0]["bytes"].as_u64().unwrap() > 0);
}

#[test]
fn missing_rank_file_is_named() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    std::fs::remove_dir_all(d.path("ex/ckpt_2")).unwrap();
    let o = d.fails(&["verify", "ex"]);
    assert!(
        o.stdout
            .contains("rank 2 of 4 is missing (no ckpt_2/model.safetensors among the inputs)"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout
            .contains("tensor `embed.weight`: elements [20..30, 0..16] are missing"),
        "{}",
        o.stdout
    );
}

#[test]
fn truncated_file_is_named() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let f = d.path("ex/ckpt_1/model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let o = d.fails(&["verify", "ex"]);
    let line = o
        .stdout
        .lines()
        .find(|l| l.contains("ckpt_1/model.safetensors"))
        .expect(&o.stdout);
    assert!(
        line.contains("run past the end of the data") && line.contains("truncated file?"),
        "{line}"
    );
}

#[test]
fn header_offsets_past_the_end_are_named() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let f = d.path("ex/ckpt_0/model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(header).unwrap();
    doc["step"]["data_offsets"] = serde_json::json!([0, 1_000_000]);
    let mut h = serde_json::to_string(&doc).unwrap();
    while h.len() < n {
        h.push(' ');
    }
    assert_eq!(h.len(), n, "edited header must keep its length");
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&f, out).unwrap();
    let o = d.fails(&["verify", "ex"]);
    assert!(
        o.stdout.contains(
            "ckpt_0/model.safetensors: tensor `step`: data_offsets [0, 1000000) run past the end"
        ),
        "{}",
        o.stdout
    );
}

#[test]
fn strategy_disagreeing_with_file_shapes_is_named() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    // Every rank's strategy says the embedding has 40 rows; the files hold 37 split in two.
    for r in 0..2 {
        let p = d.path(&format!("ex/ckpt_{r}/strategy.json"));
        let s = std::fs::read_to_string(&p).unwrap().replace("37,", "40,");
        std::fs::write(&p, s).unwrap();
    }
    let o = d.fails(&["verify", "ex"]);
    assert!(
        o.stdout.contains("tensor `embed.weight`: ")
            && o.stdout
                .contains("holds BF16 [19, 16] but the strategy gives rank 0 BF16 [20, 16]"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("strategy_hash"), "{}", o.stdout);
}

#[test]
fn strategy_differing_between_ranks_is_named() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let p = d.path("ex/ckpt_1/strategy.json");
    let s = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"Shard(1)\"", "\"Shard(0)\"");
    std::fs::write(&p, s).unwrap();
    let o = d.fails(&["verify", "ex"]);
    assert!(
        o.stdout
            .contains("ckpt_1/strategy.json: strategy differs from"),
        "{}",
        o.stdout
    );
}

#[test]
fn not_a_checkpoint() {
    let d = Dir::new();
    std::fs::create_dir(d.path("empty")).unwrap();
    let o = d.fails(&["verify", "empty"]);
    assert!(
        o.stdout.contains("empty: no checkpoint here"),
        "{}",
        o.stdout
    );
}

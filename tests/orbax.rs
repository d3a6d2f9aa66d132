//! Orbax (JAX) checkpoints read by every command (issue 48): the fixtures orbax
//! 0.12.8 wrote (tests/fixtures/orbax, README there) merged to their references,
//! the step chosen as docs/orbax.md says (the latest committed one, `--step N`), the
//! uncommitted steps never chosen, and damaged or missing chunks named.

use crate::util::{copy_dir, Dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/orbax")
        .join(rel)
}

/// A safetensors file's tensors: dtype, shape, bytes, by name.
fn tensors(path: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                (
                    format!("{:?}", v.dtype()),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                ),
            )
        })
        .collect()
}

/// `got` holds exactly the reference's tensors: names, dtypes, shapes and bytes.
fn assert_reference(got: &Path, reference: &str, what: &str) {
    let got = tensors(got);
    let want = tensors(&fixture(reference));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, (dtype, shape, bytes)) in &want {
        let (d, s, b) = &got[name];
        assert_eq!((d, s), (dtype, shape), "{what}: {name}");
        assert!(b == bytes, "{what}: {name}: bytes differ");
    }
}

/// The entries of the test's directory: nothing but `keep` may be there after a
/// refusal (no output, no temporary).
fn assert_nothing_written(d: &Dir, keep: &[&str]) {
    let mut left: Vec<String> = std::fs::read_dir(d.tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect();
    left.sort();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn every_fixture_merges_to_its_reference() {
    let cases: [(&str, &[&str], &str); 7] = [
        // A CheckpointManager root: its latest committed step (2).
        ("ocdbt_zarr3/ckpt", &[], "ocdbt_zarr3/reference.safetensors"),
        (
            "ocdbt_zarr3/ckpt",
            &["--step", "1"],
            "ocdbt_zarr3/reference_step1.safetensors",
        ),
        // A step directory, and its item directory.
        (
            "ocdbt_zarr3/ckpt/2",
            &[],
            "ocdbt_zarr3/reference.safetensors",
        ),
        (
            "ocdbt_zarr3/ckpt/1/items",
            &[],
            "ocdbt_zarr3/reference_step1.safetensors",
        ),
        ("ocdbt_zarr2/ckpt", &[], "ocdbt_zarr2/reference.safetensors"),
        (
            "ocdbt_zarr2/ckpt/1/default",
            &["--step", "1"],
            "ocdbt_zarr2/reference.safetensors",
        ),
        // A Checkpointer's directory (step and item at once), no OCDBT.
        (
            "zarr_no_ocdbt/ckpt",
            &[],
            "zarr_no_ocdbt/reference.safetensors",
        ),
    ];
    for (dir, extra, reference) in cases {
        let d = Dir::new();
        let input = fixture(dir);
        let mut args = vec!["merge", input.to_str().unwrap()];
        args.extend(extra);
        args.extend(["-o", "out"]);
        d.ok(&args);
        assert_reference(
            &d.path("out/model.safetensors"),
            reference,
            &format!("merge {dir} {extra:?}"),
        );
    }
}

#[test]
fn inspect_says_which_step_and_why_and_never_takes_an_uncommitted_one() {
    let d = Dir::new();
    let root = fixture("ocdbt_zarr3/ckpt");
    let root = root.to_str().unwrap();
    let o = d.ok(&["inspect", root]);
    let text = &o.stdout;
    assert!(
        text.starts_with("Orbax checkpoint, 1 file(s), 7 tensors"),
        "{text}"
    );
    assert!(
        text.contains("Orbax CheckpointManager save:")
            && text.contains("ckpt/2 (step 2, the highest complete step)"),
        "{text}"
    );
    // Step 3 has all its data but no commit: skipped, and said why; the temporary
    // `4.orbax-checkpoint-tmp` is no step at all.
    assert!(
        text.contains("step 3 skipped:") && text.contains("commit_timestamp_nsecs` is null"),
        "{text}"
    );
    assert!(
        !text.contains("ckpt/3/items") && !text.contains("orbax-checkpoint-tmp"),
        "{text}"
    );
    // JSON: the files' format, beside the kind (how pieces are placed: by offsets).
    let o = d.ok(&["inspect", root, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).expect("json");
    assert_eq!(
        v["formats"],
        serde_json::json!(["Orbax zarr"]),
        "{}",
        o.stdout
    );
    assert_eq!(v["files"][0]["format"], "Orbax zarr", "{}", o.stdout);
    assert!(
        text.contains("params.layer1.kernel    BF16    [4, 8, 6]"),
        "{text}"
    );
    // --step chooses; the notes say so.
    let o = d.ok(&["inspect", root, "--step", "1"]);
    assert!(o.stdout.contains("ckpt/1 (step 1, --step)"), "{}", o.stdout);
    // The uncommitted steps are refused when asked for, and when given.
    let o = d.fails(&["inspect", root, "--step", "3"]);
    assert!(
        o.stderr.contains("ckpt/3: not committed") && o.stderr.contains("commit_success.txt"),
        "{}",
        o.stderr
    );
    let o = d.fails(&["inspect", root, "--step", "4"]);
    assert!(
        o.stderr
            .contains("no Orbax CheckpointManager checkpoint of step 4")
            && o.stderr.contains("steps here: 1, 2, 3"),
        "{}",
        o.stderr
    );
    let step3 = fixture("ocdbt_zarr3/ckpt/3");
    let o = d.fails(&["merge", step3.to_str().unwrap(), "-o", "out"]);
    assert!(o.stderr.contains("not committed"), "{}", o.stderr);
    let step4 = fixture("ocdbt_zarr3/ckpt/4.orbax-checkpoint-tmp");
    let o = d.fails(&["merge", step4.to_str().unwrap(), "-o", "out"]);
    assert!(
        o.stderr
            .contains("not committed: its name ends in `.orbax-checkpoint-tmp`"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &[]);
    // Its item directory given as it is: read, and said.
    let item3 = fixture("ocdbt_zarr3/ckpt/3/items");
    let o = d.ok(&["inspect", item3.to_str().unwrap()]);
    assert!(o.stdout.contains("is not committed"), "{}", o.stdout);
    // An item holds one step: --step must be it.
    let item2 = fixture("ocdbt_zarr3/ckpt/2/items");
    let o = d.fails(&["inspect", item2.to_str().unwrap(), "--step", "1"]);
    assert!(
        o.stderr.contains("the Orbax item of step 2"),
        "{}",
        o.stderr
    );
    let single = fixture("zarr_no_ocdbt/ckpt");
    let o = d.fails(&["inspect", single.to_str().unwrap(), "--step", "1"]);
    assert!(o.stderr.contains("--step 1"), "{}", o.stderr);
}

#[test]
fn verify_and_reshard_read_orbax_too() {
    let d = Dir::new();
    for dir in ["ocdbt_zarr3/ckpt", "ocdbt_zarr2/ckpt", "zarr_no_ocdbt/ckpt"] {
        let p = fixture(dir);
        let o = d.ok(&["verify", p.to_str().unwrap()]);
        assert!(!o.stdout.contains("problem"), "{dir}: {}", o.stdout);
        // Every chunk decoded (orbax records no checksum of its own for the data).
        assert!(
            o.stdout.contains("encoded chunks decoded"),
            "{dir}: {}",
            o.stdout
        );
    }
    let root = fixture("ocdbt_zarr3/ckpt");
    d.ok(&["reshard", root.to_str().unwrap(), "--to", "2", "-o", "r"]);
    d.ok(&["merge", "r", "-o", "back"]);
    assert_reference(
        &d.path("back/model.safetensors"),
        "ocdbt_zarr3/reference.safetensors",
        "reshard to 2 ranks and merge back",
    );
}

/// Chunks decoded on any thread give the same bytes: a merge and a reshard on 1 and on
/// 4 threads write identical files.
#[test]
fn the_same_bytes_on_one_thread_and_on_four() {
    let d = Dir::new();
    let root = fixture("ocdbt_zarr3/ckpt");
    let root = root.to_str().unwrap();
    let mut written = vec![];
    for threads in [1, 4] {
        let (m, r) = (format!("m{threads}"), format!("r{threads}"));
        d.ok_with_threads(&["merge", root, "-o", &m], threads);
        d.ok_with_threads(&["reshard", root, "--to", "2", "-o", &r], threads);
        let read = |p: String| std::fs::read(d.path(&p)).unwrap();
        written.push([
            read(format!("{m}/model.safetensors")),
            read(format!("{r}/ckpt_0/model.safetensors")),
            read(format!("{r}/ckpt_1/model.safetensors")),
        ]);
    }
    assert!(
        written[0] == written[1],
        "1 and 4 threads wrote different bytes"
    );
}

#[test]
fn a_damaged_chunk_is_named_and_nothing_is_written() {
    // zarr v2 chunk files (no OCDBT): a chunk's zstd frame damaged.
    let d = Dir::new();
    copy_dir(&fixture("zarr_no_ocdbt/ckpt"), &d.path("in"));
    let chunk = d.path("in/params.layer0.kernel/1.0");
    let mut b = std::fs::read(&chunk).unwrap();
    b[0] ^= 0xff;
    std::fs::write(&chunk, &b).unwrap();
    let o = d.fails(&["merge", "in", "-o", "out"]);
    assert!(
        o.stderr.contains("params.layer0.kernel/1.0")
            && o.stderr.contains("in/params.layer0.kernel/1.0")
            && o.stderr.contains("tensor `params.layer0.kernel`"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &["in"]);

    // A zarr v3 shard stored out of line in the OCDBT data files: its index's CRC-32C
    // damaged (the last byte of the value, found through the database).
    let d = Dir::new();
    copy_dir(&fixture("ocdbt_zarr3/ckpt"), &d.path("in"));
    let db = ckpt_ocdbt::Database::open(&d.path("in/2/items")).unwrap();
    let ckpt_ocdbt::Value::Stored { path, offset, len } =
        db.find(b"params.layer1.w_big/c/1/0").unwrap().unwrap()
    else {
        panic!("w_big's chunks are stored out of line");
    };
    let mut b = std::fs::read(&path).unwrap();
    b[(offset + len - 1) as usize] ^= 0xff;
    std::fs::write(&path, &b).unwrap();
    let o = d.fails(&["merge", "in", "-o", "out"]);
    assert!(
        o.stderr.contains("array `params.layer1.w_big`")
            && o.stderr.contains("params.layer1.w_big/c/1/0")
            && o.stderr.contains("CRC-32C"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &["in"]);
    // Its zstd frame damaged instead (the index intact): named when decoded.
    b[(offset + len - 1) as usize] ^= 0xff;
    b[offset as usize] ^= 0xff;
    std::fs::write(&path, &b).unwrap();
    let o = d.fails(&["merge", "in", "-o", "out"]);
    assert!(
        o.stderr.contains("tensor `params.layer1.w_big`")
            && o.stderr.contains("params.layer1.w_big/c/1/0")
            && o.stderr.contains("zstd"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &["in"]);
}

/// `verify` decodes every chunk (orbax records no checksum of the data: its zstd
/// frames have no content checksum, its zarr v3 arrays no `crc32c` codec): a chunk
/// whose frame no longer decodes is named (array, chunk key, file) with exit 1, while
/// `inspect` and `verify --fast` (metadata only) still open the item.
#[test]
fn verify_decodes_every_chunk_and_names_a_damaged_one() {
    // A zarr v2 chunk file (no OCDBT): a byte of its compressed block (the literals'
    // Huffman description) flipped.
    let d = Dir::new();
    copy_dir(&fixture("zarr_no_ocdbt/ckpt"), &d.path("in"));
    let chunk = d.path("in/params.layer1.w_big/1.0");
    let mut b = std::fs::read(&chunk).unwrap();
    b[12] ^= 0xff;
    std::fs::write(&chunk, &b).unwrap();
    let o = d.fails(&["verify", "in"]);
    assert!(
        o.stdout.contains("tensor `params.layer1.w_big`")
            && o.stdout.contains("zarr key `params.layer1.w_big/1.0`")
            && o.stdout.contains("in/params.layer1.w_big/1.0")
            && o.stdout.contains("zstd")
            && !o.stdout.contains("ok:"),
        "{}",
        o.stdout
    );
    let o = d.fails(&["verify", "in", "--json"]);
    let doc: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(doc["ok"], false, "{}", o.stdout);
    assert_eq!(doc["problems"].as_array().unwrap().len(), 1, "{}", o.stdout);
    d.ok(&["inspect", "in"]);
    let o = d.ok(&["verify", "--fast", "in"]);
    assert!(!o.stdout.contains("decoded"), "{}", o.stdout);

    // A zarr v3 shard stored out of line in the OCDBT data files: its zstd frame's
    // block damaged (the shard index and its CRC-32C intact).
    let d = Dir::new();
    copy_dir(&fixture("ocdbt_zarr3/ckpt"), &d.path("in"));
    let db = ckpt_ocdbt::Database::open(&d.path("in/2/items")).unwrap();
    let ckpt_ocdbt::Value::Stored {
        path,
        offset,
        len: _,
    } = db.find(b"params.layer1.w_big/c/2/0").unwrap().unwrap()
    else {
        panic!("w_big's chunks are stored out of line");
    };
    let mut b = std::fs::read(&path).unwrap();
    b[offset as usize + 12] ^= 0xff;
    std::fs::write(&path, &b).unwrap();
    let o = d.fails(&["verify", "in"]);
    let data_file = path.file_name().unwrap().to_str().unwrap();
    assert!(
        o.stdout.contains("tensor `params.layer1.w_big`")
            && o.stdout
                .contains("zarr key `params.layer1.w_big/c/2/0, inner chunk [0, 0]`")
            && o.stdout.contains("compressed chunk 2 ")
            && o.stdout.contains(data_file)
            && o.stdout.contains("zstd"),
        "{}",
        o.stdout
    );
    d.ok(&["inspect", "in"]);
    // Step 1's chunks are intact: verified clean, every one decoded.
    let o = d.ok(&["verify", "in", "--step", "1"]);
    assert!(o.stdout.contains("encoded chunks decoded"), "{}", o.stdout);
}

#[test]
fn missing_chunks_are_the_fill_value_or_refused() {
    let d = Dir::new();
    copy_dir(&fixture("zarr_no_ocdbt/ckpt"), &d.path("in"));
    std::fs::remove_file(d.path("in/params.layer0.bias/2")).unwrap();
    let o = d.ok(&["merge", "in", "-o", "out"]);
    // (merge prints its notes on stderr)
    assert!(
        o.stderr
            .contains("array `params.layer0.bias`: 1 chunk(s) not stored"),
        "{}",
        o.stderr
    );
    let got = tensors(&d.path("out/model.safetensors"));
    let want = tensors(&fixture("zarr_no_ocdbt/reference.safetensors"));
    let (bias, want_bias) = (&got["params.layer0.bias"].2, &want["params.layer0.bias"].2);
    // fill_value null: zeros, for elements 8..12 (chunk 2 of [4]).
    assert_eq!(&bias[32..48], &[0u8; 16]);
    assert_eq!(
        (&bias[..32], &bias[48..]),
        (&want_bias[..32], &want_bias[48..])
    );

    // A fill value the dtype cannot hold: the missing chunk is refused.
    let d = Dir::new();
    copy_dir(&fixture("zarr_no_ocdbt/ckpt"), &d.path("in"));
    std::fs::remove_file(d.path("in/step/0")).unwrap();
    let zarray = d.path("in/step/.zarray");
    let text = std::fs::read_to_string(&zarray).unwrap();
    std::fs::write(
        &zarray,
        text.replace("\"fill_value\":null", "\"fill_value\":0.5"),
    )
    .unwrap();
    let o = d.fails(&["merge", "in", "-o", "out"]);
    assert!(
        o.stderr.contains("array `step`")
            && o.stderr.contains("fill value 0.5")
            && o.stderr.contains("inventing"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &["in"]);
}

#[test]
fn a_step_of_several_items_is_read_by_the_one_with_arrays_or_refused() {
    let d = Dir::new();
    copy_dir(&fixture("ocdbt_zarr2/ckpt"), &d.path("root"));
    copy_dir(&d.path("root/1/default"), &d.path("root/1/other"));
    let o = d.fails(&["merge", "root", "-o", "out"]);
    assert!(
        o.stderr.contains("2 items with arrays (default, other)")
            && o.stderr.contains("pass the item directory meant"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &["root"]);
    // `other` holding no array (a string only): `default` is read, and said.
    std::fs::write(
        d.path("root/1/other/_METADATA"),
        r#"{"tree_metadata": {"('note',)": {"key_metadata": [{"key": "note", "key_type": 2}],
            "value_metadata": {"value_type": "string", "skip_deserialize": false}}},
            "use_ocdbt": true, "use_zarr3": false}"#,
    )
    .unwrap();
    let o = d.ok(&["merge", "root", "-o", "out"]);
    assert!(o.stderr.contains("the item holding arrays"), "{}", o.stderr);
    assert_reference(
        &d.path("out/model.safetensors"),
        "ocdbt_zarr2/reference.safetensors",
        "the item with arrays",
    );
}

#[test]
fn damaged_metadata_is_named() {
    let d = Dir::new();
    copy_dir(&fixture("zarr_no_ocdbt/ckpt"), &d.path("in"));
    let zarray = d.path("in/params.layer0.kernel/.zarray");
    let text = std::fs::read_to_string(&zarray).unwrap();
    std::fs::write(&zarray, text.replace("\"order\":\"C\"", "\"order\":\"F\"")).unwrap();
    let o = d.fails(&["inspect", "in"]);
    assert!(
        o.stderr.contains("in/params.layer0.kernel/.zarray")
            && o.stderr.contains("array `params.layer0.kernel`")
            && o.stderr.contains("only C order"),
        "{}",
        o.stderr
    );
    std::fs::write(&zarray, &text).unwrap();
    std::fs::write(d.path("in/_METADATA"), "{\"tree_metadata\": 3}").unwrap();
    let o = d.fails(&["inspect", "in"]);
    assert!(
        o.stderr.contains("in/_METADATA") && o.stderr.contains("not a JSON object"),
        "{}",
        o.stderr
    );
}

// ----------------------------------------------------------------------------------
// Orbax written (`merge --format orbax`): read back by ckpt byte for byte, and (with
// CKPT_PYTHON_JAX) restored by orbax itself (scripts/orbax_write_check.py).

/// Runs `ckpt ARGS` in `d` with `env` set, asserting success.
fn ok_with_env(d: &Dir, args: &[&str], env: &[(&str, &str)]) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(d.tmp.path())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "ckpt {args:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A safetensors file of one tensor per (name, dtype, shape), bytes counting up.
fn write_safetensors(path: &Path, tensors: &[(&str, safetensors::Dtype, &[usize])]) {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dtype, shape)| {
            let n = shape.iter().product::<usize>() * dtype.bitsize() / 8;
            // Bytes every dtype holds as they are (bools: 0 and 1).
            (0..n)
                .map(|i| {
                    if *dtype == safetensors::Dtype::BOOL {
                        (i % 3 == 0) as u8
                    } else {
                        (i * 7 % 61) as u8
                    }
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&data)
        .map(|((name, dtype, shape), bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.to_vec(), bytes);
            (name.to_string(), view.unwrap())
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn merge_to_orbax_writes_a_step_ckpt_reads_back_byte_for_byte() {
    let d = Dir::new();
    let reference = fixture("ocdbt_zarr3/reference.safetensors");
    let src = reference.to_str().unwrap();
    d.ok(&["merge", src, "--format", "orbax", "-o", "root/7"]);
    // The layout orbax's CheckpointManager writes for `save(7, StandardSave(tree))`.
    for f in [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "default/_METADATA",
        "default/commit_success.txt",
        "default/manifest.ocdbt",
    ] {
        assert!(d.path("root/7").join(f).is_file(), "no {f}");
    }
    let meta = std::fs::read_to_string(d.path("root/7/_CHECKPOINT_METADATA")).unwrap();
    assert!(
        meta.contains(r#""default":"orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler""#),
        "{meta}"
    );
    let db = ckpt_ocdbt::Database::open(&d.path("root/7/default")).unwrap();
    let keys: Vec<String> = db
        .list()
        .unwrap()
        .into_iter()
        .map(|e| String::from_utf8(e.key).unwrap())
        .collect();
    assert!(keys.contains(&"step/c".to_string()), "{keys:?}");
    assert!(keys.contains(&"params.layer1.kernel/c/0/0/0".to_string()));
    // Read back from the root, the step and the item: the source's bytes.
    for input in ["root", "root/7", "root/7/default"] {
        let out = format!("back-{}", input.replace('/', "-"));
        d.ok(&["merge", input, "-o", &out]);
        assert_reference(
            &d.path(&out).join("model.safetensors"),
            "ocdbt_zarr3/reference.safetensors",
            input,
        );
    }
    // Chunks along dimension 0 (lowered cap): an array of 16 rows of 32 bytes in 6
    // chunks of 3 rows, the last padded; 64 rows of 128 bytes a chunk each.
    let env = [("CKPT_TEST_ORBAX_CHUNK_BYTES", "100")];
    ok_with_env(
        &d,
        &[
            "merge",
            src,
            "--format",
            "orbax",
            "--orbax-item",
            "items",
            "-o",
            "chunked",
        ],
        &env,
    );
    let db = ckpt_ocdbt::Database::open(&d.path("chunked/items")).unwrap();
    let count = |prefix: &str| {
        db.list()
            .unwrap()
            .iter()
            .filter(|e| e.key.starts_with(prefix.as_bytes()))
            .count()
    };
    assert_eq!(count("params.embed.embedding/c/"), 6);
    assert_eq!(count("params.layer1.w_big/c/"), 64);
    d.ok(&["merge", "chunked", "-o", "back-chunked"]);
    assert_reference(
        &d.path("back-chunked/model.safetensors"),
        "ocdbt_zarr3/reference.safetensors",
        "chunked",
    );
    // The same bytes on one thread and on four.
    d.ok_with_threads(&["merge", src, "--format", "orbax", "-o", "t1"], 1);
    d.ok_with_threads(&["merge", src, "--format", "orbax", "-o", "t4"], 4);
    // Every key's value (the data files' names, in the nodes, are random).
    let values = |out: &str| -> Vec<(Vec<u8>, Vec<u8>)> {
        let db = ckpt_ocdbt::Database::open(&d.path(out).join("default")).unwrap();
        db.list()
            .unwrap()
            .into_iter()
            .map(|e| {
                let bytes = match e.value {
                    ckpt_ocdbt::Value::Inline(b) => b,
                    ckpt_ocdbt::Value::Stored { path, offset, len } => {
                        let all = std::fs::read(path).unwrap();
                        all[offset as usize..(offset + len) as usize].to_vec()
                    }
                };
                (e.key, bytes)
            })
            .collect()
    };
    assert!(values("t1") == values("t4"), "the values differ");
}

#[test]
fn every_dtype_orbax_holds_round_trips() {
    use safetensors::Dtype as D;
    let d = Dir::new();
    let src = d.path("src.safetensors");
    write_safetensors(
        &src,
        &[
            ("m.bool", D::BOOL, &[5]),
            ("m.u8", D::U8, &[3, 3]),
            ("m.i8", D::I8, &[4]),
            ("m.i16", D::I16, &[2, 3]),
            ("m.u16", D::U16, &[3]),
            ("m.i32", D::I32, &[2, 2, 2]),
            ("m.u32", D::U32, &[2]),
            ("m.i64", D::I64, &[3, 1]),
            ("m.u64", D::U64, &[2]),
            ("m.f16", D::F16, &[5, 2]),
            ("m.bf16", D::BF16, &[7]),
            ("m.f32", D::F32, &[2, 3, 4]),
            ("m.f64", D::F64, &[3]),
            ("m.f8e4m3", D::F8_E4M3, &[6]),
            ("m.f8e5m2", D::F8_E5M2, &[6]),
            ("scalar", D::I64, &[]),
        ],
    );
    d.ok(&["merge", "src.safetensors", "--format", "orbax", "-o", "out"]);
    d.ok(&["merge", "out", "-o", "back"]);
    assert_eq!(tensors(&d.path("back/model.safetensors")), tensors(&src));
}

#[test]
fn names_that_form_no_tree_are_refused_and_nothing_is_written() {
    use safetensors::Dtype as D;
    let d = Dir::new();
    write_safetensors(
        &d.path("in.safetensors"),
        &[
            ("a", D::F32, &[2]),
            ("a.b", D::F32, &[2]),
            ("c", D::F32, &[1]),
        ],
    );
    let o = d.fails(&["merge", "in.safetensors", "--format", "orbax", "-o", "out"]);
    assert!(
        o.stderr.contains("tensor `a`") && o.stderr.contains("`a.b`"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &["in.safetensors"]);
    // An empty key, a dtype zarr v3 has no name for, an empty array: named too.
    let d = Dir::new();
    write_safetensors(&d.path("in.safetensors"), &[("x..y", D::F32, &[2])]);
    let o = d.fails(&["merge", "in.safetensors", "--format", "orbax", "-o", "out"]);
    assert!(o.stderr.contains("tensor `x..y`"), "{}", o.stderr);
    write_safetensors(&d.path("in.safetensors"), &[("e", D::F32, &[0, 2])]);
    let o = d.fails(&["merge", "in.safetensors", "--format", "orbax", "-o", "out"]);
    assert!(
        o.stderr.contains("tensor `e`") && o.stderr.contains("no elements"),
        "{}",
        o.stderr
    );
    // Options that do not apply.
    let o = d.fails(&[
        "merge",
        "in.safetensors",
        "--format",
        "orbax",
        "--compress",
        "zstd",
        "-o",
        "out",
    ]);
    assert!(o.stderr.contains("--compress"), "{}", o.stderr);
    let o = d.fails(&[
        "merge",
        "in.safetensors",
        "--format",
        "orbax",
        "--orbax-item",
        "..",
        "-o",
        "out",
    ]);
    assert!(o.stderr.contains("--orbax-item `..`"), "{}", o.stderr);
    // --orbax-item without --format orbax: a usage error.
    let o = d.ckpt(&[
        "merge",
        "in.safetensors",
        "--orbax-item",
        "items",
        "-o",
        "out",
    ]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert_nothing_written(&d, &["in.safetensors"]);
}

/// A ckpt strategy on `axes` (name, size) of `tensors` (name, dtype, shape,
/// placements).
fn strategy_json(axes: &[(&str, u64)], tensors: &[(&str, &str, &[u64], &[&str])]) -> String {
    let axes: Vec<serde_json::Value> = axes
        .iter()
        .map(|(n, s)| serde_json::json!({"name": n, "size": s}))
        .collect();
    let tensors: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .map(|(n, dtype, shape, placements)| {
            let t = serde_json::json!({"dtype": dtype, "shape": shape, "placements": placements});
            (n.to_string(), t)
        })
        .collect();
    serde_json::json!({"format": "ckpt-strategy", "mesh": {"axes": axes}, "tensors": tensors, "version": 1})
        .to_string()
}

/// Every key of an OCDBT database with its value's bytes.
fn db_values(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let db = ckpt_ocdbt::Database::open(dir).unwrap();
    db.list()
        .unwrap()
        .into_iter()
        .map(|e| {
            let bytes = match e.value {
                ckpt_ocdbt::Value::Inline(b) => b,
                ckpt_ocdbt::Value::Stored { path, offset, len } => {
                    let all = std::fs::read(path).unwrap();
                    all[offset as usize..(offset + len) as usize].to_vec()
                }
            };
            (String::from_utf8(e.key).unwrap(), bytes)
        })
        .collect()
}

/// A source of three layouts on a dp=2,tp=4 mesh, as ckpt rank directories (`A`).
fn sharded_source(d: &Dir) {
    use safetensors::Dtype as D;
    write_safetensors(
        &d.path("src.safetensors"),
        &[
            ("p.w", D::F32, &[8, 12]),
            ("p.b", D::BF16, &[12]),
            ("p.v", D::I32, &[16]),
            ("step", D::I64, &[]),
        ],
    );
    let s = strategy_json(
        &[("dp", 2), ("tp", 4)],
        &[
            ("p.w", "F32", &[8, 12], &["Shard(0)", "Shard(1)"]),
            ("p.b", "BF16", &[12], &["Replicate", "Replicate"]),
            ("p.v", "I32", &[16], &["Shard(0)", "Shard(0)"]),
            ("step", "I64", &[], &["Replicate", "Replicate"]),
        ],
    );
    std::fs::write(d.path("a.json"), s).unwrap();
    d.ok(&[
        "reshard",
        "src.safetensors",
        "--strategy",
        "a.json",
        "-o",
        "A",
    ]);
}

/// `reshard --format orbax`: each device's box one chunk (replicated ones once), read
/// back byte for byte, and resharded back to the source's layout unchanged.
#[test]
fn reshard_to_orbax_writes_each_device_box_as_a_chunk_and_back_is_the_identity() {
    let d = Dir::new();
    sharded_source(&d);
    // dp=2,tp=2: p.w's boxes are [4, 6] (P("dp", "tp")), p.v's [4] (P(("dp", "tp"))).
    d.ok(&[
        "reshard", "A", "--format", "orbax", "--mesh", "tp=2", "-o", "O",
    ]);
    for f in [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "default/_METADATA",
        "default/_sharding",
        "default/array_metadatas/process_0",
        "default/commit_success.txt",
        "default/manifest.ocdbt",
    ] {
        assert!(d.path("O").join(f).is_file(), "no {f}");
    }
    let values: BTreeMap<String, Vec<u8>> = db_values(&d.path("O/default")).into_iter().collect();
    let chunks: Vec<&str> = values
        .keys()
        .map(String::as_str)
        .filter(|k| !k.ends_with("zarr.json"))
        .collect();
    assert_eq!(
        chunks,
        [
            "p.b/c/0",
            "p.v/c/0",
            "p.v/c/1",
            "p.v/c/2",
            "p.v/c/3",
            "p.w/c/0/0",
            "p.w/c/0/1",
            "p.w/c/1/0",
            "p.w/c/1/1",
            "step/c"
        ]
    );
    let meta = String::from_utf8(values["p.w/zarr.json"].clone()).unwrap();
    assert!(
        meta.contains(r#""chunk_shape":[4,6]"#) && meta.contains(r#""shape":[8,12]"#),
        "{meta}"
    );
    // Chunk (1, 0) of p.w: rows 4..8, columns 0..6 of the source, then the shard index.
    let src = tensors(&d.path("src.safetensors"));
    let w = &src["p.w"].2;
    let want: Vec<u8> = (4..8)
        .flat_map(|r| w[(r * 12) * 4..(r * 12 + 6) * 4].to_vec())
        .collect();
    let chunk = &values["p.w/c/1/0"];
    assert_eq!(chunk.len(), 96 + 20);
    assert!(chunk[..96] == want[..], "chunk (1, 0) of p.w");
    let sharding = std::fs::read_to_string(d.path("O/default/_sharding")).unwrap();
    // base64("p.w") = "cC53"; P("dp", "tp") on the 2 x 2 mesh.
    assert!(
        sharding.contains(r#""cC53":"{\"sharding_type\": \"NamedSharding\", \"shape\": [2, 2]"#)
            && sharding.contains(r#"\"partition_spec\": [[\"dp\", \"tp\"]]"#),
        "{sharding}"
    );
    // Read back: the source's bytes.
    d.ok(&["merge", "O", "-o", "back"]);
    assert_eq!(tensors(&d.path("back/model.safetensors")), src);
    // A -> orbax (dp=2,tp=2) -> A: every rank file the same bytes.
    d.ok(&["reshard", "O", "--strategy", "a.json", "-o", "A2"]);
    for r in 0..8 {
        let f = format!("ckpt_{r}/model.safetensors");
        let (a, b) = (d.path("A").join(&f), d.path("A2").join(&f));
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "{f} differs after the round trip through Orbax"
        );
    }
    // The same bytes on one thread and on four (every key's value).
    d.ok_with_threads(
        &["reshard", "A", "--format", "orbax", "--to", "4", "-o", "t1"],
        1,
    );
    d.ok_with_threads(
        &["reshard", "A", "--format", "orbax", "--to", "4", "-o", "t4"],
        4,
    );
    let (one, four) = (
        db_values(&d.path("t1/default")),
        db_values(&d.path("t4/default")),
    );
    assert_eq!(
        one.len(),
        4 + 1 + 4 + 1 + 4,
        "{:?}",
        one.iter().map(|v| &v.0).collect::<Vec<_>>()
    );
    assert!(one == four, "1 and 4 threads wrote different values");
    for f in ["_sharding", "_METADATA"] {
        let read = |o: &str| std::fs::read(d.path(o).join("default").join(f)).unwrap();
        assert!(read("t1") == read("t4"), "{f}");
    }
}

/// `reshard --format orbax --orbax-item NAME`: the item directory named so, read back
/// byte for byte; the flag with another format, or another item for MaxText's, is a
/// usage error that writes nothing.
#[test]
fn reshard_to_orbax_writes_the_item_orbax_item_names() {
    let d = Dir::new();
    sharded_source(&d);
    d.ok(&[
        "reshard",
        "A",
        "--format",
        "orbax",
        "--orbax-item",
        "params",
        "--to",
        "2",
        "-o",
        "P",
    ]);
    for f in [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "params/_METADATA",
        "params/_sharding",
        "params/commit_success.txt",
        "params/manifest.ocdbt",
    ] {
        assert!(d.path("P").join(f).is_file(), "no {f}");
    }
    assert!(!d.path("P/default").exists(), "an item `default` too");
    d.ok(&["merge", "P", "-o", "back"]);
    assert_eq!(
        tensors(&d.path("back/model.safetensors")),
        tensors(&d.path("src.safetensors"))
    );
    d.ok(&["merge", "P/params", "-o", "back_item"]);
    assert_eq!(
        tensors(&d.path("back_item/model.safetensors")),
        tensors(&d.path("src.safetensors"))
    );
    let keep = ["src.safetensors", "a.json", "A", "P", "back", "back_item"];
    for args in [
        &["--orbax-item", "params"][..],
        &["--format", "distcp", "--orbax-item", "params"],
        &["--format", "maxtext", "--orbax-item", "params"],
    ] {
        let mut all = vec!["reshard", "A", "--to", "2", "-o", "out"];
        all.extend_from_slice(args);
        let o = d.ckpt(&all);
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains("--orbax-item"), "{args:?}: {}", o.stderr);
        assert_nothing_written(&d, &keep);
    }
    let o = d.fails(&[
        "reshard",
        "A",
        "--format",
        "orbax",
        "--orbax-item",
        "_CHECKPOINT_METADATA",
        "--to",
        "2",
        "-o",
        "out",
    ]);
    assert!(
        o.stderr.contains("--orbax-item `_CHECKPOINT_METADATA`"),
        "{}",
        o.stderr
    );
    assert_nothing_written(&d, &keep);
}

/// A layout JAX cannot shard (a split that does not divide its dimension; blocked
/// shards) and options that do not apply are refused by name, nothing written.
#[test]
fn reshard_to_orbax_refuses_what_jax_cannot_shard_and_writes_nothing() {
    use safetensors::Dtype as D;
    let d = Dir::new();
    write_safetensors(
        &d.path("in.safetensors"),
        &[("p.odd", D::F32, &[10, 4]), ("p.ok", D::F32, &[8])],
    );
    let s = strategy_json(
        &[("tp", 4)],
        &[
            ("p.odd", "F32", &[10, 4], &["Shard(0)"]),
            ("p.ok", "F32", &[8], &["Shard(0)"]),
        ],
    );
    std::fs::write(d.path("uneven.json"), s).unwrap();
    let o = d.fails(&[
        "reshard",
        "in.safetensors",
        "--strategy",
        "uneven.json",
        "--format",
        "orbax",
        "-o",
        "out",
    ]);
    assert!(
        o.stderr.contains("`p.odd`")
            && o.stderr.contains("size 10 is split 4 ways")
            && o.stderr.contains("does not divide"),
        "{}",
        o.stderr
    );
    let s = strategy_json(
        &[("tp", 2)],
        &[
            ("p.odd", "F32", &[10, 4], &["Shard(0,blocks=2)"]),
            ("p.ok", "F32", &[8], &["Shard(0)"]),
        ],
    );
    std::fs::write(d.path("blocks.json"), s).unwrap();
    let o = d.fails(&[
        "reshard",
        "in.safetensors",
        "--strategy",
        "blocks.json",
        "--format",
        "orbax",
        "-o",
        "out",
    ]);
    assert!(
        o.stderr.contains("`p.odd`") && o.stderr.contains("2 blocks"),
        "{}",
        o.stderr
    );
    let o = d.fails(&[
        "reshard",
        "in.safetensors",
        "--strategy",
        "blocks.json",
        "--format",
        "orbax",
        "--rank",
        "0",
        "-o",
        "out",
    ]);
    assert!(o.stderr.contains("--rank"), "{}", o.stderr);
    assert_nothing_written(&d, &["in.safetensors", "uneven.json", "blocks.json"]);
}

/// orbax-checkpoint 0.12.8 restores `--format orbax` outputs (without a target as
/// numpy arrays, through a CheckpointManager, and onto a 4-device CPU mesh with a
/// target) with every array equal to its source, and `reshard --format orbax` outputs
/// (without a target as jax.Arrays sharded as `_sharding` says, as numpy, onto the mesh;
/// `_sharding` byte for byte orbax's): scripts/orbax_write_check.py, with
/// `CKPT_PYTHON_JAX` naming a Python that has jax and orbax-checkpoint.
#[test]
fn orbax_restores_what_merge_writes() {
    let Some(py) = std::env::var_os("CKPT_PYTHON_JAX") else {
        println!(
            "SKIPPED orbax_restores_what_merge_writes: set CKPT_PYTHON_JAX to a python \
             with jax and orbax-checkpoint (e.g. /work/venv-jax/bin/python)"
        );
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let d = Dir::new();
    let o = std::process::Command::new(py)
        .arg(root.join("scripts/orbax_write_check.py"))
        .arg("--ckpt")
        .arg(env!("CARGO_BIN_EXE_ckpt"))
        .arg("--work")
        .arg(d.tmp.path())
        .arg(fixture("ocdbt_zarr3/reference.safetensors"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("PASS"),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

// ----------------------------------------------------------------------------------
// A save by two JAX processes (tests/fixtures/orbax/multiprocess_*: jax.distributed on
// CPU, 2 x 4 devices): each process's chunks in its own `ocdbt.process_<i>/`, the
// item's `manifest.ocdbt` the merged root pointing into both.

const MULTIPROCESS: [(&str, &str); 2] = [
    ("multiprocess_zarr2", "ckpt/1/default"),
    ("multiprocess_zarr3", "ckpt/1/items"),
];

#[test]
fn a_save_of_two_processes_merges_reshards_and_verifies_as_orbax_restores_it() {
    for (fixture_dir, item) in MULTIPROCESS {
        let reference = format!("{fixture_dir}/reference.safetensors");
        // Both processes' databases are there, and the root reads values from each.
        let item_dir = fixture(&format!("{fixture_dir}/{item}"));
        let db = ckpt_ocdbt::Database::open(&item_dir).unwrap();
        let mut from = std::collections::BTreeSet::new();
        for e in db.list().unwrap() {
            if let ckpt_ocdbt::Value::Stored { path, .. } = e.value {
                let rel = path.strip_prefix(&item_dir).unwrap().to_path_buf();
                from.insert(rel.components().next().unwrap().as_os_str().to_owned());
            }
        }
        assert_eq!(
            from.iter().map(|s| s.to_str().unwrap()).collect::<Vec<_>>(),
            ["ocdbt.process_0", "ocdbt.process_1"],
            "{fixture_dir}"
        );
        for dir in [
            format!("{fixture_dir}/ckpt"),
            format!("{fixture_dir}/ckpt/1"),
            format!("{fixture_dir}/{item}"),
        ] {
            let d = Dir::new();
            d.ok(&["merge", fixture(&dir).to_str().unwrap(), "-o", "out"]);
            assert_reference(&d.path("out/model.safetensors"), &reference, &dir);
        }
        let d = Dir::new();
        let root = fixture(&format!("{fixture_dir}/ckpt"));
        let root = root.to_str().unwrap();
        let o = d.ok(&["inspect", root]);
        assert!(
            o.stdout
                .starts_with("Orbax checkpoint, 1 file(s), 8 tensors")
                && o.stdout.contains("params.layer1.w_big")
                && o.stdout.contains("[64, 64]"),
            "{}",
            o.stdout
        );
        let o = d.ok(&["verify", root]);
        assert!(
            o.stdout.contains("encoded chunks decoded") && !o.stdout.contains("problem"),
            "{}",
            o.stdout
        );
        // To another mesh (ckpt's rank directories, and an Orbax step on 4 devices,
        // each device's box a chunk) and back: the reference, byte for byte.
        d.ok(&["reshard", root, "--to", "3", "-o", "r3"]);
        d.ok(&["merge", "r3", "-o", "back3"]);
        assert_reference(
            &d.path("back3/model.safetensors"),
            &reference,
            "via 3 ranks",
        );
        d.ok(&[
            "reshard", root, "--format", "orbax", "--to", "4", "-o", "o4",
        ]);
        d.ok(&["reshard", "o4", "--to", "2", "-o", "r2"]);
        d.ok(&["merge", "r2", "-o", "back2"]);
        assert_reference(
            &d.path("back2/model.safetensors"),
            &reference,
            "via an Orbax step on 4 devices and 2 ranks",
        );
    }
}

#[test]
fn a_missing_or_truncated_process_database_is_named_and_nothing_is_written() {
    for (fixture_dir, item) in MULTIPROCESS {
        let chunk = if fixture_dir.ends_with("zarr3") {
            "params.layer1.w_big/c/4/0"
        } else {
            "params.layer1.w_big/4.0"
        };
        // Process 1's directory gone (a copy without it): the first value it held is
        // named, with its array and the directory; every command refuses.
        let d = Dir::new();
        copy_dir(&fixture(&format!("{fixture_dir}/ckpt")), &d.path("in"));
        let item_in = format!("in/{}", item.strip_prefix("ckpt/").unwrap());
        std::fs::remove_dir_all(d.path(&format!("{item_in}/ocdbt.process_1"))).unwrap();
        for args in [
            &["merge", "in", "-o", "out"][..],
            &["reshard", "in", "--to", "2", "-o", "out"],
            &["inspect", "in"],
            &["verify", "in"],
        ] {
            let o = d.fails(args);
            // (verify reports on stdout, the others on stderr)
            let said = format!("{}{}", o.stdout, o.stderr);
            assert!(
                said.contains("array `params.layer1.w_big`")
                    && said.contains(chunk)
                    && said.contains("ocdbt.process_1/, which holds the part")
                    && said.contains(&item_in),
                "{fixture_dir} {args:?}: {said}"
            );
            assert_nothing_written(&d, &["in"]);
        }

        // A data file of process 1 truncated: the value past its end named, with the
        // file and the array.
        let d = Dir::new();
        copy_dir(&fixture(&format!("{fixture_dir}/ckpt")), &d.path("in"));
        let db = ckpt_ocdbt::Database::open(&d.path(&item_in)).unwrap();
        let ckpt_ocdbt::Value::Stored { path, offset, .. } =
            db.find(chunk.as_bytes()).unwrap().unwrap()
        else {
            panic!("{chunk} is stored out of line");
        };
        assert!(
            path.to_str().unwrap().contains("/ocdbt.process_1/d/"),
            "{}",
            path.display()
        );
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(offset + 10).unwrap();
        let data_file = path.strip_prefix(d.tmp.path()).unwrap();
        for args in [&["merge", "in", "-o", "out"][..], &["verify", "in"]] {
            let o = d.fails(args);
            let said = format!("{}{}", o.stdout, o.stderr);
            assert!(
                said.contains("array `params.layer1.w_big`")
                    && said.contains(chunk)
                    && said.contains(data_file.to_str().unwrap())
                    && said.contains("truncated"),
                "{fixture_dir} {args:?}: {said}"
            );
            assert_nothing_written(&d, &["in"]);
        }

        // The merged root manifest missing, the process databases there (a save cut
        // off before process 0 merged them): refused by name.
        let d = Dir::new();
        copy_dir(&fixture(&format!("{fixture_dir}/ckpt")), &d.path("in"));
        std::fs::remove_file(d.path(&format!("{item_in}/manifest.ocdbt"))).unwrap();
        for input in ["in".to_string(), item_in.clone()] {
            let o = d.fails(&["merge", &input, "-o", "out"]);
            assert!(
                o.stderr.contains("manifest.ocdbt is missing")
                    && o.stderr.contains("ocdbt.process_")
                    && o.stderr.contains("cut off"),
                "{fixture_dir} {input}: {}",
                o.stderr
            );
            assert_nothing_written(&d, &["in"]);
        }
    }
}

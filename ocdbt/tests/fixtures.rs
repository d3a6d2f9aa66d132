//! Every OCDBT database of `tests/fixtures/orbax/` (written by tensorstore 0.1.86 /
//! orbax-checkpoint 0.12.8) opened, listed, and checked against what the fixtures say
//! they hold: `expected.json`, or the zarr metadata and the reference safetensors.

use std::collections::BTreeMap;
use std::path::Path;

use ckpt_ocdbt::{Compression, Database, Error, Value};

use crate::util::{contents, expected, fixture, read_json, safetensors};

#[test]
fn tiny_fixture_as_annotated() {
    let dir = fixture("ocdbt_tiny/db");
    let db = Database::open(&dir).unwrap();
    assert_eq!(db.generation(), 1);
    assert_eq!(db.latest_generation(), 1);
    assert_eq!(db.root_height(), 0);
    let c = db.config();
    assert_eq!(c.uuid, std::array::from_fn(|i| i as u8));
    assert_eq!(c.max_inline_value_bytes, 8);
    assert_eq!(c.max_decoded_node_bytes, 8_388_608);
    assert_eq!(c.version_tree_arity_log2, 4);
    assert_eq!(c.compression, Compression::None);
    let entries = db.list().unwrap();
    let keys: Vec<&[u8]> = entries.iter().map(|e| &e.key[..]).collect();
    assert_eq!(keys, [&b"w/.zarray"[..], b"w/0.0", b"w/0.1"]);
    assert_eq!(entries[0].value, Value::Inline(br#"{"a":1}"#.to_vec()));
    assert_eq!(
        entries[1].value,
        Value::Stored {
            path: dir.join("d/b2100f081d8289ccb86d457ee4a414a3"),
            offset: 0,
            len: 20
        }
    );
    assert_eq!(entries[2].value, Value::Inline(b"xyz".to_vec()));
    let want = expected(&read_json(&fixture("ocdbt_tiny/expected.json"))["latest"]);
    assert_eq!(contents(&db), want);
    assert_eq!(
        db.get(b"w/0.0").unwrap().unwrap(),
        (0..20).collect::<Vec<u8>>()
    );
    for absent in [&b""[..], b"w", b"w/0.00", b"w/0.2", b"x", b"w/.zarra"] {
        assert_eq!(db.get(absent).unwrap(), None, "{absent:?}");
    }
    assert_eq!(db.generations().unwrap(), [1]);
}

#[test]
fn multilevel_fixture_latest_and_generation_5() {
    let exp = read_json(&fixture("ocdbt_multilevel/expected.json"));
    let latest = expected(&exp["latest"]);
    let gen5 = expected(&exp["generation_5"]);
    for (name, compressed) in [("db", true), ("db_uncompressed", false)] {
        let dir = fixture("ocdbt_multilevel").join(name);
        let db = Database::open(&dir).unwrap();
        assert_eq!(
            db.latest_generation(),
            exp["latest_generation"].as_u64().unwrap()
        );
        assert_eq!(db.generation(), 21);
        assert!(db.root_height() >= 2, "{name}: height {}", db.root_height());
        assert_eq!(
            matches!(db.config().compression, Compression::Zstd { .. }),
            compressed
        );
        assert_eq!(db.config().max_decoded_node_bytes, 200);
        assert_eq!(db.config().max_inline_value_bytes, 16);
        assert_eq!(contents(&db), latest, "{name}: latest");
        // Both kinds of values are there.
        let entries = db.list().unwrap();
        assert!(entries.iter().any(|e| matches!(e.value, Value::Inline(_))));
        assert!(entries
            .iter()
            .any(|e| matches!(e.value, Value::Stored { .. })));
        for (k, v) in &latest {
            assert_eq!(db.get(k).unwrap().as_ref(), Some(v), "{name}: get {k:?}");
        }
        for absent in [&b""[..], b"p", b"p.layer0.w/0.0x", b"p.layer9", b"zzz"] {
            assert_eq!(db.get(absent).unwrap(), None);
        }
        // Generation 5 sits in the version tree node the manifest refers to.
        let old = Database::open_generation(&dir, 5).unwrap();
        assert_eq!(old.generation(), 5);
        assert_eq!(contents(&old), gen5, "{name}: generation 5");
        for (k, v) in &gen5 {
            assert_eq!(old.get(k).unwrap().as_ref(), Some(v));
        }
        assert_eq!(db.generations().unwrap(), (1..=21).collect::<Vec<u64>>());
    }
}

#[test]
fn multilevel_fixture_every_generation_opens() {
    for name in ["db", "db_uncompressed"] {
        let dir = fixture("ocdbt_multilevel").join(name);
        let mut commit_times = Vec::new();
        for g in 1..=21 {
            let db = Database::open_generation(&dir, g).unwrap();
            assert_eq!(db.generation(), g);
            commit_times.push(db.commit_time_ns());
            let n = db.list().unwrap().len();
            // Generation 1 is the empty initial manifest.
            assert_eq!(n == 0, g == 1, "{name} generation {g}: {n} keys");
        }
        assert!(commit_times.windows(2).all(|w| w[0] <= w[1]));
        for g in [0, 22, u64::MAX] {
            assert!(matches!(
                Database::open_generation(&dir, g),
                Err(Error::NoSuchGeneration { latest: 21, .. })
            ));
        }
    }
}

/// Bytes per element of a zarr v2 or v3 dtype name.
fn itemsize(dtype: &str) -> usize {
    match dtype {
        "<f4" | "float32" | "<i4" | "int32" => 4,
        "bfloat16" | "<f2" | "float16" => 2,
        other => panic!("dtype {other} not in the fixtures"),
    }
}

fn json_u64s(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Puts a decoded chunk (C order, `chunk` shape) at chunk index `idx` of the full
/// array (C order, `shape`), clipping at the edges.
fn place(full: &mut [u8], shape: &[u64], chunk: &[u64], idx: &[u64], bytes: &[u8], item: usize) {
    let n: u64 = chunk.iter().product();
    assert_eq!(bytes.len() as u64, n * item as u64, "decoded chunk size");
    for e in 0..n {
        // Element e of the chunk -> its global coordinates.
        let (mut rest, mut global, mut inside) = (e, 0u64, true);
        let mut coords = vec![0u64; chunk.len()];
        for d in (0..chunk.len()).rev() {
            coords[d] = idx[d] * chunk[d] + rest % chunk[d];
            rest /= chunk[d];
        }
        for d in 0..shape.len() {
            inside &= coords[d] < shape[d];
            global = global * shape[d] + coords[d];
        }
        if inside {
            let (g, e) = (global as usize * item, e as usize * item);
            full[g..g + item].copy_from_slice(&bytes[e..e + item]);
        }
    }
}

/// The arrays of an orbax item directory read through [`Database`] alone, for zarr v2
/// or v3, compared with the reference; checks chunk counts, chunk value framing
/// (the v3 shard index and its CRC) and where the values live.
fn check_orbax_item(item: &Path, reference: &Path, zarr3: bool) {
    let db = Database::open(item).unwrap();
    assert_eq!(db.generation(), 1, "orbax's merged root has one generation");
    assert_eq!(db.config().max_inline_value_bytes, 1024);
    assert_eq!(db.config().max_decoded_node_bytes, 100_000_000);
    let entries = db.list().unwrap();
    let by_key: BTreeMap<&[u8], &Value> = entries.iter().map(|e| (&e.key[..], &e.value)).collect();
    let meta_name = if zarr3 { "/zarr.json" } else { "/.zarray" };
    let arrays: Vec<String> = entries
        .iter()
        .filter_map(|e| {
            std::str::from_utf8(&e.key)
                .ok()?
                .strip_suffix(meta_name)
                .map(String::from)
        })
        .collect();
    let reference = safetensors(reference);
    let want: Vec<&String> = reference.keys().collect();
    let mut got: Vec<&String> = arrays.iter().collect();
    got.sort();
    assert_eq!(got, want, "arrays of {}", item.display());
    let mut chunk_keys = 0usize;
    for name in &arrays {
        let meta: serde_json::Value = serde_json::from_slice(
            &db.get(format!("{name}{meta_name}").as_bytes())
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        let shape = json_u64s(&meta["shape"]);
        let (chunk, dtype) = if zarr3 {
            assert_eq!(meta["node_type"], "array");
            (
                json_u64s(&meta["chunk_grid"]["configuration"]["chunk_shape"]),
                meta["data_type"].as_str().unwrap(),
            )
        } else {
            assert_eq!(meta["zarr_format"], 2);
            assert_eq!(meta["compressor"]["id"], "zstd");
            (json_u64s(&meta["chunks"]), meta["dtype"].as_str().unwrap())
        };
        let item_size = itemsize(dtype);
        let grid: Vec<u64> = shape
            .iter()
            .zip(&chunk)
            .map(|(s, c)| s.div_ceil(*c))
            .collect();
        let count: u64 = grid.iter().product();
        let mut full = vec![0u8; shape.iter().product::<u64>() as usize * item_size];
        for i in 0..count {
            let mut idx = vec![0u64; grid.len()];
            let mut rest = i;
            for d in (0..grid.len()).rev() {
                idx[d] = rest % grid[d];
                rest /= grid[d];
            }
            let parts: Vec<String> = idx.iter().map(u64::to_string).collect();
            let key = match (zarr3, parts.is_empty()) {
                (true, true) => format!("{name}/c"),
                (true, false) => format!("{name}/c/{}", parts.join("/")),
                (false, true) => format!("{name}/0"),
                (false, false) => format!("{name}/{}", parts.join(".")),
            };
            let value = by_key
                .get(key.as_bytes())
                .unwrap_or_else(|| panic!("{key} missing"));
            chunk_keys += 1;
            // orbax's layout: small values copied inline into the merged root, large
            // ones left in the per-process data files.
            match value {
                Value::Inline(v) => assert!(v.len() <= 1024),
                Value::Stored { path, len, .. } => {
                    assert!(*len > 1024);
                    assert!(
                        path.to_str().unwrap().contains("ocdbt.process_0/d/"),
                        "{}",
                        path.display()
                    );
                }
            }
            let bytes = value.read().unwrap();
            let frame = if zarr3 {
                // One inner chunk per shard: frame, then index (offset, nbytes) + CRC.
                let n = bytes.len();
                let index = &bytes[n - 20..n - 4];
                let crc = u32::from_le_bytes(bytes[n - 4..].try_into().unwrap());
                assert_eq!(crc32c::crc32c(index), crc, "{key}: shard index CRC");
                let off = u64::from_le_bytes(index[..8].try_into().unwrap()) as usize;
                let len = u64::from_le_bytes(index[8..].try_into().unwrap()) as usize;
                assert_eq!(off + len, n - 20, "{key}: shard layout");
                bytes[off..off + len].to_vec()
            } else {
                bytes
            };
            let decoded = zstd::stream::decode_all(&frame[..]).unwrap();
            place(&mut full, &shape, &chunk, &idx, &decoded, item_size);
        }
        let (_, ref_shape, ref_bytes) = &reference[name];
        assert_eq!(ref_shape, &shape, "{name}: shape");
        assert_eq!(&full, ref_bytes, "{name}: values");
    }
    // Metadata + chunks: nothing else in the database.
    assert_eq!(entries.len(), arrays.len() + chunk_keys);
}

#[test]
fn orbax_zarr3_item_equals_reference() {
    let root = fixture("ocdbt_zarr3");
    check_orbax_item(
        &root.join("ckpt/2/items"),
        &root.join("reference.safetensors"),
        true,
    );
    check_orbax_item(
        &root.join("ckpt/1/items"),
        &root.join("reference_step1.safetensors"),
        true,
    );
}

#[test]
fn orbax_zarr2_item_equals_reference() {
    let root = fixture("ocdbt_zarr2");
    check_orbax_item(
        &root.join("ckpt/1/default"),
        &root.join("reference.safetensors"),
        false,
    );
}

#[test]
fn orbax_incomplete_steps_and_per_process_databases_open() {
    let root = fixture("ocdbt_zarr3/ckpt");
    for step in ["1", "2", "3", "4.orbax-checkpoint-tmp"] {
        let item = root.join(step).join("items");
        let merged = Database::open(&item).unwrap();
        let merged = contents(&merged);
        assert!(merged.keys().any(|k| k.ends_with(b"/zarr.json")));
        // The per-process database holds one generation per commit of that host; its
        // latest holds the same keys and values as the merged root.
        let per_process = Database::open(&item.join("ocdbt.process_0")).unwrap();
        assert!(per_process.latest_generation() >= 1);
        assert_eq!(contents(&per_process), merged, "step {step}");
        for g in per_process.generations().unwrap() {
            Database::open_generation(&item.join("ocdbt.process_0"), g)
                .unwrap()
                .list()
                .unwrap();
        }
    }
}

#[test]
fn directory_without_manifest_is_an_io_error_naming_it() {
    let dir = fixture("zarr_no_ocdbt/ckpt");
    match Database::open(&dir) {
        Err(Error::Io { path, source }) => {
            assert_eq!(path, dir.join("manifest.ocdbt"));
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("{other:?}"),
    }
}

/// The fuzz target's seeds (`fuzz/corpus/ocdbt_manifest/`, cut from these fixtures)
/// are what their names say, and decode as such.
#[test]
fn fuzz_seeds_decode() {
    use ckpt_ocdbt::fuzzing;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/ocdbt_manifest");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let b = std::fs::read(&path).unwrap();
        let r = if name.contains("manifest") {
            fuzzing::manifest(&b)
        } else if name.contains("version-node") {
            fuzzing::version_node(&b)
        } else {
            fuzzing::btree_node(&b, 100_000_000, b"")
        };
        assert_eq!(r, Ok(()), "{name}");
        seen += 1;
    }
    assert!(seen >= 5, "{seen} seeds");
}

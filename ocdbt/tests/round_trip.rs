//! What the writer writes, our reader reads back: random key sets (proptest), trees
//! of several levels, values streamed by the caller, an empty database, a rewritten
//! orbax item; and what the writer refuses.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;

use ckpt_ocdbt::{Compression, Database, Error, Value, Writer, WriterOptions};
use proptest::prelude::*;

use crate::util::{contents, fixture};

/// Writes `items` (in the order given; `true` = through [`Writer::reserve`]) and reads
/// them back, checking values, their placement and lookups.
fn write_and_check(
    items: &[(Vec<u8>, Vec<u8>, bool)],
    options: WriterOptions,
    max_inline: u32,
) -> u8 {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let mut w = Writer::create(&dir, options).unwrap();
    for (k, v, reserve) in items {
        if *reserve {
            let r = w.reserve(k, v.len() as u64).unwrap();
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&r.path)
                .unwrap();
            f.write_all_at(v, r.offset).unwrap();
        } else {
            w.put(k, v).unwrap();
        }
    }
    let summary = w.finish().unwrap();
    assert_eq!(summary.keys, items.len() as u64);
    let db = Database::open(&dir).unwrap();
    assert_eq!(db.generation(), 1);
    assert_eq!(db.root_height(), summary.height);
    assert_eq!(db.generations().unwrap(), [1]);
    let want: BTreeMap<Vec<u8>, Vec<u8>> = items
        .iter()
        .map(|(k, v, _)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(contents(&db), want);
    let reserved: BTreeMap<&[u8], bool> = items.iter().map(|(k, _, r)| (&k[..], *r)).collect();
    for e in db.list().unwrap() {
        let inline = !reserved[&e.key[..]] && e.value.len() <= u64::from(max_inline);
        assert_eq!(matches!(e.value, Value::Inline(_)), inline, "{:?}", e.key);
        assert_eq!(db.find(&e.key).unwrap(), Some(e.value));
    }
    // Keys next to the present ones.
    for (k, _, _) in items {
        for probe in [
            [&k[..], b"\0"].concat(),
            [&k[..], b"\xff"].concat(),
            k[..k.len().saturating_sub(1)].to_vec(),
        ] {
            assert_eq!(db.get(&probe).unwrap(), want.get(&probe).cloned());
        }
    }
    summary.height
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    // Few distinct bytes, so that keys share long prefixes (prefix compression and
    // subtree common prefixes are exercised), and any byte now and then.
    prop::collection::vec(
        prop_oneof![
            4 => prop::sample::select(b"ab/.0".to_vec()),
            1 => any::<u8>(),
        ],
        0..24,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_key_sets_round_trip(
        items in prop::collection::btree_map(key(), (prop::collection::vec(any::<u8>(), 0..200), any::<bool>()), 0..150)
            .prop_map(|m| m.into_iter().map(|(k, (v, r))| (k, v, r)).collect::<Vec<_>>())
            .prop_shuffle(),
        max_inline in prop::sample::select(vec![0u32, 4, 64, 1024]),
        max_node in prop::sample::select(vec![0u32, 100, 300, 5000]),
        zstd in any::<bool>(),
    ) {
        let c = if zstd { Compression::Zstd { level: 1 } } else { Compression::None };
        let options = WriterOptions::new()
            .max_inline_value_bytes(max_inline)
            .max_decoded_node_bytes(max_node)
            .compression(c);
        write_and_check(&items, options, max_inline);
    }
}

/// Orbax-like keys: arrays, chunk keys, metadata.
pub(crate) fn orbax_like_items(n_arrays: usize, chunks: usize) -> Vec<(Vec<u8>, Vec<u8>, bool)> {
    let mut items = Vec::new();
    for a in 0..n_arrays {
        let name = format!("params.layer{a}.kernel");
        items.push((
            format!("{name}/.zarray").into_bytes(),
            format!("{{\"a\":{a}}}").into_bytes(),
            false,
        ));
        for c in 0..chunks {
            let len = (a * 37 + c * 11) % 3000;
            let v: Vec<u8> = (0..len).map(|i| (i * 7 + a + c) as u8).collect();
            items.push((
                format!("{name}/{}.{}", c / 4, c % 4).into_bytes(),
                v,
                c % 5 == 0,
            ));
        }
    }
    items.reverse();
    items
}

#[test]
fn multi_level_trees_round_trip() {
    let items = orbax_like_items(60, 40);
    for c in [Compression::None, Compression::Zstd { level: 3 }] {
        let options = WriterOptions::new()
            .max_inline_value_bytes(16)
            .max_decoded_node_bytes(300)
            .compression(c);
        let height = write_and_check(&items, options, 16);
        assert!(height >= 3, "height {height}");
    }
    // Orbax's defaults: one leaf.
    assert_eq!(write_and_check(&items, WriterOptions::new(), 1024), 0);
}

#[test]
fn streamed_values_from_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Writer::create(tmp.path(), WriterOptions::new()).unwrap();
    let big: Vec<Vec<u8>> = (0..4u8)
        .map(|i| vec![i; (1 << 20) + usize::from(i)])
        .collect();
    let rs: Vec<_> = big
        .iter()
        .enumerate()
        .map(|(i, v)| {
            w.reserve(format!("w/{i}").as_bytes(), v.len() as u64)
                .unwrap()
        })
        .collect();
    w.put(b"a/small", b"x").unwrap();
    std::thread::scope(|s| {
        for (r, v) in rs.iter().zip(&big) {
            s.spawn(move || {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&r.path)
                    .unwrap();
                // In two pieces, the second first.
                let h = v.len() / 2;
                f.write_all_at(&v[h..], r.offset + h as u64).unwrap();
                f.write_all_at(&v[..h], r.offset).unwrap();
            });
        }
    });
    let summary = w.finish().unwrap();
    let db = Database::open(tmp.path()).unwrap();
    for (i, (r, v)) in rs.iter().zip(&big).enumerate() {
        let found = db.find(format!("w/{i}").as_bytes()).unwrap().unwrap();
        assert_eq!(
            found,
            Value::Stored {
                path: r.path.clone(),
                offset: r.offset,
                len: r.len
            }
        );
        assert_eq!(&found.read().unwrap(), v);
    }
    assert_eq!(summary.data_file.as_deref(), Some(rs[0].path.as_path()));
    assert_eq!(
        std::fs::metadata(&rs[0].path).unwrap().len(),
        summary.data_file_len
    );
}

#[test]
fn empty_database() {
    let tmp = tempfile::tempdir().unwrap();
    let summary = Writer::create(tmp.path(), WriterOptions::new())
        .unwrap()
        .finish()
        .unwrap();
    assert_eq!(summary.data_file, None);
    assert!(!tmp.path().join("d").exists());
    let db = Database::open(tmp.path()).unwrap();
    assert!(db.list().unwrap().is_empty());
    assert_eq!(db.get(b"").unwrap(), None);
    assert_eq!(db.generations().unwrap(), [1]);
}

#[test]
fn orbax_item_rewritten_reads_the_same() {
    for item in ["ocdbt_zarr3/ckpt/2/items", "ocdbt_zarr2/ckpt/1/default"] {
        let src = Database::open(&fixture(item)).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let mut w = Writer::create(tmp.path(), WriterOptions::new()).unwrap();
        let want = contents(&src);
        for (k, v) in want.iter().rev() {
            w.put(k, v).unwrap();
        }
        w.finish().unwrap();
        assert_eq!(contents(&Database::open(tmp.path()).unwrap()), want);
    }
}

#[test]
fn writer_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("x"), b"").unwrap();
    assert!(matches!(
        Writer::create(tmp.path(), WriterOptions::new()),
        Err(Error::NotEmpty { .. })
    ));
    let dir = tmp.path().join("db");
    assert!(matches!(
        Writer::create(&dir, WriterOptions::new().max_inline_value_bytes(2 << 20)),
        Err(Error::BadOption {
            option: "max_inline_value_bytes",
            ..
        })
    ));
    assert!(matches!(
        Writer::create(
            &dir,
            WriterOptions::new().compression(Compression::Zstd { level: 99 })
        ),
        Err(Error::BadOption { .. })
    ));
    let mut w = Writer::create(&dir, WriterOptions::new()).unwrap();
    assert!(matches!(
        w.put(&vec![b'k'; 65536], b""),
        Err(Error::KeyTooLong { len: 65536, .. })
    ));
    w.put(&vec![b'k'; 65535], b"longest key").unwrap();
    assert!(matches!(
        w.reserve(b"huge", u64::MAX),
        Err(Error::Overflow { .. })
    ));
    w.put(b"a", b"1").unwrap();
    w.put(b"a", b"2").unwrap();
    match w.finish() {
        Err(Error::DuplicateKey { path, key }) => {
            assert_eq!((path, key.as_str()), (dir.clone(), "a"))
        }
        other => panic!("{other:?}"),
    }
    // No manifest: the directory is not a database.
    assert!(!dir.join("manifest.ocdbt").exists());
}

#[test]
fn longest_keys_in_a_multi_level_tree() {
    let items: Vec<(Vec<u8>, Vec<u8>, bool)> = (0..12u8)
        .map(|i| {
            let mut k = vec![b'x'; 65535];
            k[65534] = i;
            k[100] = i / 4;
            (k, vec![i; 3], false)
        })
        .collect();
    let options = WriterOptions::new().max_decoded_node_bytes(1000);
    assert!(write_and_check(&items, options, 1024) >= 1);
}

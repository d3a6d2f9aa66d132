//! The damaged-input catalogue: each damage gives its named error, naming the file
//! (and the object's offset); none panics. Fixtures are damaged in copies.

use std::path::{Path, PathBuf};

use ckpt_ocdbt::fuzzing;
use ckpt_ocdbt::{Compression, Database, Error, ObjectKind, Problem, Writer, WriterOptions};
use proptest::prelude::*;

use crate::util::{copy_dir, fixture};

const TINY_DATA: &str = "d/b2100f081d8289ccb86d457ee4a414a3";
/// The leaf of `ocdbt_tiny` is bytes 20..113 of its data file.
const TINY_LEAF: std::ops::Range<usize> = 20..113;

/// A copy of `ocdbt_tiny/db`.
fn tiny() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    copy_dir(&fixture("ocdbt_tiny/db"), &dir);
    (tmp, dir)
}

fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b);
    std::fs::write(path, b).unwrap();
}

/// Opens and lists: the first error.
fn open_list(dir: &Path) -> Error {
    match Database::open(dir).and_then(|db| db.list()) {
        Ok(_) => panic!("damage not detected"),
        Err(e) => e,
    }
}

fn corrupt(e: Error) -> (PathBuf, u64, ObjectKind, Problem) {
    match e {
        Error::Corrupt {
            path,
            offset,
            object,
            problem,
        } => (path, offset, object, problem),
        other => panic!("not Corrupt: {other:?} ({other})"),
    }
}

/// Replaces `old` by `new` at `at` (checking `old`), then fixes the envelope.
fn patch(b: &mut Vec<u8>, at: usize, old: &[u8], new: &[u8]) {
    assert_eq!(&b[at..at + old.len()], old, "fixture bytes moved");
    b.splice(at..at + old.len(), new.iter().copied());
    fuzzing::reseal(b);
}

/// Position of `needle` in `hay` (the annotated fixture's byte layout).
fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

/// Whether a problem is the one a damage must give.
type Expect = fn(&Problem) -> bool;

#[test]
fn manifest_damage() {
    let (_t, dir) = tiny();
    let m = dir.join("manifest.ocdbt");
    let good = std::fs::read(&m).unwrap();
    let cases: Vec<(&str, Vec<u8>, Expect)> = vec![
        (
            "flipped byte",
            {
                let mut b = good.clone();
                b[40] ^= 0x10;
                b
            },
            |p| matches!(p, Problem::Crc { .. }),
        ),
        (
            "flipped CRC",
            {
                let mut b = good.clone();
                b[96] ^= 1;
                b
            },
            |p| matches!(p, Problem::Crc { .. }),
        ),
        ("truncated", good[..90].to_vec(), |p| {
            matches!(
                p,
                Problem::LengthMismatch {
                    stored: 97,
                    actual: 90
                }
            )
        }),
        (
            "bad magic",
            {
                let mut b = good.clone();
                b[3] = 0;
                b
            },
            |p| {
                matches!(
                    p,
                    Problem::BadMagic {
                        found: 0x0cdb_3a00,
                        expected: 0x0cdb_3a2a
                    }
                )
            },
        ),
        ("empty", Vec::new(), |p| {
            matches!(p, Problem::TooShort { len: 0 })
        }),
        (
            "version 1",
            {
                let mut b = good.clone();
                b[12] = 1;
                fuzzing::reseal(&mut b);
                b
            },
            |p| matches!(p, Problem::UnsupportedVersion(1)),
        ),
        (
            "compression 7",
            {
                let mut b = good.clone();
                b[13] = 7;
                fuzzing::reseal(&mut b);
                b
            },
            |p| matches!(p, Problem::UnknownCompression(7)),
        ),
        (
            "trailing byte",
            {
                let mut b = good.clone();
                b.insert(92, 0);
                fuzzing::reseal(&mut b);
                b
            },
            |p| matches!(p, Problem::TrailingBytes { count: 1 }),
        ),
        (
            "huge num_versions",
            {
                // inline_versions count (1) -> 2^62: refused before anything is allocated.
                let mut b = good.clone();
                let at = find(&b, &[0x01, 0x01, 0x00, 0x00, 0x14]);
                patch(
                    &mut b,
                    at,
                    &[0x01],
                    &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40],
                );
                b
            },
            |p| {
                matches!(
                    p,
                    Problem::TooLarge {
                        field: "num_versions",
                        ..
                    }
                )
            },
        ),
        (
            "bad arity",
            {
                let mut b = good.clone();
                let at = find(&b, &[0x80, 0x80, 0x80, 0x04, 0x04]);
                patch(&mut b, at + 4, &[4], &[17]);
                b
            },
            |p| matches!(p, Problem::Invalid { field, .. } if field == "version_tree_arity_log2"),
        ),
    ];
    for (what, bytes, ok) in cases {
        std::fs::write(&m, &bytes).unwrap();
        let (path, offset, object, problem) = corrupt(open_list(&dir));
        assert_eq!(
            (path.as_path(), offset, object),
            (m.as_path(), 0, ObjectKind::Manifest),
            "{what}"
        );
        assert!(ok(&problem), "{what}: {problem}");
    }
}

#[test]
fn node_and_reference_damage() {
    let (_t, dir) = tiny();
    let m = dir.join("manifest.ocdbt");
    let data = dir.join(TINY_DATA);
    let good_m = std::fs::read(&m).unwrap();
    let good_d = std::fs::read(&data).unwrap();
    // The version's root reference in the manifest: id 0, offset 0x14, length 0x5d.
    let root_at = find(&good_m, &[0x00, 0x14, 0x5d, 0x03]);
    let restore = || {
        std::fs::write(&m, &good_m).unwrap();
        std::fs::write(&data, &good_d).unwrap();
    };

    // A flipped byte inside the leaf: its CRC, naming the data file and the offset.
    edit(&data, |b| b[60] ^= 4);
    let (path, offset, object, problem) = corrupt(open_list(&dir));
    assert_eq!(
        (path, offset, object),
        (data.clone(), 20, ObjectKind::BtreeNode)
    );
    assert!(matches!(problem, Problem::Crc { .. }));
    restore();

    // Truncated data file: the leaf runs past its end.
    edit(&data, |b| b.truncate(100));
    match open_list(&dir) {
        Error::OutOfFile {
            path,
            what,
            offset: 20,
            len: 93,
            file_len: 100,
        } => {
            assert_eq!((path, what), (data.clone(), "B+tree node"));
        }
        other => panic!("{other:?}"),
    }
    restore();

    // Missing data file.
    std::fs::remove_file(&data).unwrap();
    match open_list(&dir) {
        Error::Io { path, .. } => assert_eq!(path, data),
        other => panic!("{other:?}"),
    }
    restore();

    // A huge node length in the manifest's root reference.
    edit(&m, |b| {
        patch(
            b,
            root_at + 2,
            &[0x5d],
            &[0x80, 0x80, 0x80, 0x80, 0x80, 0x20],
        )
    });
    assert!(matches!(
        open_list(&dir),
        Error::NodeTooLarge {
            object: ObjectKind::BtreeNode,
            offset: 20,
            ..
        }
    ));
    restore();

    // Offset + length past 2^63-1.
    edit(&m, |b| {
        patch(
            b,
            root_at + 1,
            &[0x14],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
        )
    });
    let (_, _, object, problem) = corrupt(open_list(&dir));
    assert_eq!(object, ObjectKind::Manifest);
    assert!(matches!(problem, Problem::BadReference { .. }), "{problem}");
    restore();

    // The root announced at height 1, the node says 0.
    edit(&m, |b| {
        patch(b, root_at - 1, &[0x00, 0x00, 0x14], &[0x01, 0x00, 0x14])
    });
    let (path, _, _, problem) = corrupt(open_list(&dir));
    assert_eq!(path, data);
    assert_eq!(
        problem,
        Problem::Height {
            expected: 1,
            found: 0
        }
    );
    restore();

    // A data file path with a `.` component (same length: "d/" -> "./").
    edit(&m, |b| {
        let at = find(b, b"d/b2100f");
        patch(b, at, b"d/", b"./");
    });
    match open_list(&dir) {
        Error::BadDataFilePath {
            path,
            object: ObjectKind::Manifest,
            data_file,
            ..
        } => {
            assert_eq!(path, m);
            assert!(data_file.starts_with("./b2100f"));
        }
        other => panic!("{other:?}"),
    }
    restore();

    // A huge out-of-line value length: the value runs past the data file.
    let leaf = &good_d[TINY_LEAF];
    let lens_at = TINY_LEAF.start + find(leaf, &[0x07, 0x14, 0x03, 0x00, 0x01, 0x00]);
    edit(&data, |b| {
        let mut node = b[TINY_LEAF].to_vec();
        let at = lens_at - TINY_LEAF.start;
        patch(&mut node, at + 1, &[0x14], &[0xff, 0xff, 0xff, 0xff, 0x0f]);
        b.splice(TINY_LEAF, node);
    });
    edit(&m, |b| {
        patch(b, root_at + 2, &[0x5d, 0x03, 0x5d], &[0x61, 0x03, 0x5d])
    });
    match open_list(&dir) {
        Error::Value { key, source } => {
            assert_eq!(key, "w/0.0");
            match *source {
                Error::OutOfFile {
                    path,
                    what: "value",
                    offset: 0,
                    len: 0xffff_ffff,
                    ..
                } => assert_eq!(path, data),
                other => panic!("{other:?}"),
            }
        }
        other => panic!("{other:?}"),
    }
    match Database::open(&dir).unwrap().get(b"w/0.0") {
        Err(e @ Error::Value { .. }) => {
            assert_eq!(e.path(), data);
            assert!(
                matches!(e, Error::Value { ref source, .. } if matches!(**source, Error::OutOfFile { .. }))
            );
        }
        other => panic!("{other:?}"),
    }
    // ... and an inline one larger than an inline value may be.
    restore();
    edit(&data, |b| {
        let mut node = b[TINY_LEAF].to_vec();
        let at = lens_at - TINY_LEAF.start;
        patch(&mut node, at, &[0x07], &[0x80, 0x80, 0x80, 0x01]);
        b.splice(TINY_LEAF, node);
    });
    edit(&m, |b| {
        patch(b, root_at + 2, &[0x5d, 0x03, 0x5d], &[0x60, 0x03, 0x5d])
    });
    let (path, offset, _, problem) = corrupt(open_list(&dir));
    assert_eq!((path, offset), (data.clone(), 20));
    assert!(
        matches!(&problem, Problem::Invalid { field, value: 2_097_152, .. } if field == "value_length[0]"),
        "{problem}"
    );
    restore();

    // Keys out of order: "w/0.0" -> "w/.0.0" is not after "w/.zarray" ... swap the
    // suffix of the second key to sort before the first.
    edit(&data, |b| {
        let mut node = b[TINY_LEAF].to_vec();
        let at = find(&node, b"w/.zarray0.01");
        patch(&mut node, at + 9, b"0", b"!");
        b.splice(TINY_LEAF, node);
    });
    let (_, _, _, problem) = corrupt(open_list(&dir));
    assert_eq!(problem, Problem::KeyOrder { index: 1 });
    restore();

    assert!(Database::open(&dir).unwrap().list().is_ok(), "restored");
}

#[test]
fn generation_not_there() {
    let (_t, dir) = tiny();
    match Database::open_generation(&dir, 2) {
        Err(Error::NoSuchGeneration {
            path,
            generation: 2,
            latest: 1,
        }) => {
            assert_eq!(path, dir.join("manifest.ocdbt"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn decompression_bomb_is_bounded() {
    // A node whose zstd frame decodes to 64 MiB of zeros, in a database aiming nodes at
    // 1 byte: refused at the bound (4 MiB + 4 bytes), not decoded whole.
    let mut node = vec![0x0c, 0xdb, 0x20, 0xde, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    node.extend(zstd::bulk::compress(&vec![0u8; 64 << 20], 3).unwrap());
    node.extend([0; 4]);
    fuzzing::reseal(&mut node);
    assert!(node.len() < 64 << 10);
    assert_eq!(
        fuzzing::btree_node(&node, 1, b""),
        Err(Problem::DecodedTooLarge {
            limit: (4 << 20) + 4
        })
    );
}

/// Every data file of a multi-level database truncated, or with a byte flipped: each
/// damage is either harmless to the generation read (a file it does not use) or a
/// named error; never a panic, never a wrong listing passed off as right.
#[test]
fn multilevel_damage_catalogue() {
    let exp = crate::util::read_json(&fixture("ocdbt_multilevel/expected.json"));
    let latest = crate::util::expected(&exp["latest"]);
    let gen5 = crate::util::expected(&exp["generation_5"]);
    for name in ["db", "db_uncompressed"] {
        let src = fixture("ocdbt_multilevel").join(name);
        let mut files: Vec<PathBuf> = std::fs::read_dir(src.join("d"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        let mut errors = 0;
        for f in &files {
            let rel = f.strip_prefix(&src).unwrap();
            for damage in 0..2 {
                let tmp = tempfile::tempdir().unwrap();
                copy_dir(&src, tmp.path());
                edit(&tmp.path().join(rel), |b| {
                    if damage == 0 {
                        b.truncate(b.len() / 2);
                    } else {
                        let mid = b.len() / 2;
                        b[mid] ^= 0x20;
                    }
                });
                for (g, want) in [(21, &latest), (5, &gen5)] {
                    let r = Database::open_generation(tmp.path(), g).and_then(|db| {
                        db.list()?
                            .into_iter()
                            .map(|e| Ok((e.key, e.value.read()?)))
                            .collect::<Result<std::collections::BTreeMap<_, _>, _>>()
                    });
                    match r {
                        // Untouched by this generation, or a flipped byte inside an
                        // out-of-line value (values carry no checksum in OCDBT).
                        Ok(got) => assert_eq!(
                            got.keys().collect::<Vec<_>>(),
                            want.keys().collect::<Vec<_>>()
                        ),
                        Err(e) => {
                            errors += 1;
                            let msg = e.to_string();
                            assert!(msg.contains(tmp.path().to_str().unwrap()), "{msg}");
                        }
                    }
                }
            }
        }
        // Each data file holds one commit's values and nodes, and most commits' nodes
        // were replaced by later ones: only some damage reaches generations 21 and 5.
        println!("{name}: {errors} of {} reads refused", files.len() * 4);
        assert!(errors > 0, "{name}: no damage detected");
    }
}

fn writer_db(dir: &Path) {
    let mut w = Writer::create(
        dir,
        WriterOptions::new()
            .max_inline_value_bytes(8)
            .max_decoded_node_bytes(150)
            .compression(Compression::None),
    )
    .unwrap();
    for i in 0..60u32 {
        w.put(
            format!("k/{i:03}").as_bytes(),
            &vec![i as u8; (i % 20) as usize],
        )
        .unwrap();
    }
    w.finish().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random damage to a writer-made multi-level database: open, list, get never panic.
    #[test]
    fn random_damage_never_panics(which in any::<bool>(), at in any::<prop::sample::Index>(), mask in 1u8.., cut in any::<bool>(), reseal in any::<bool>()) {
        let tmp = tempfile::tempdir().unwrap();
        writer_db(tmp.path());
        let target = if which {
            tmp.path().join("manifest.ocdbt")
        } else {
            std::fs::read_dir(tmp.path().join("d")).unwrap().next().unwrap().unwrap().path()
        };
        edit(&target, |b| {
            let i = at.index(b.len());
            if cut { b.truncate(i) } else { b[i] ^= mask }
            if reseal && which { fuzzing::reseal(b) }
        });
        if let Ok(db) = Database::open(tmp.path()) {
            let _ = db.list();
            let _ = db.get(b"k/030");
            let _ = db.generations();
        }
    }

    /// Mutations of real objects, resealed so that they reach the body parsers.
    #[test]
    fn resealed_mutations_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), object in 0usize..3) {
        let sources = [
            std::fs::read(fixture("ocdbt_tiny/db/manifest.ocdbt")).unwrap(),
            std::fs::read(fixture("ocdbt_tiny/db").join(TINY_DATA)).unwrap()[TINY_LEAF].to_vec(),
            std::fs::read(fixture("ocdbt_multilevel/db_uncompressed/manifest.ocdbt")).unwrap(),
        ];
        let mut b = sources[object].clone();
        for (i, v) in edits {
            let i = 12 + i.index(b.len() - 16);
            b[i] = v;
        }
        fuzzing::reseal(&mut b);
        let _ = fuzzing::manifest(&b);
        let _ = fuzzing::btree_node(&b, 1 << 16, b"x/");
        let _ = fuzzing::version_node(&b);
    }
}

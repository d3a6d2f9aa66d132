//! The OCDBT decoders (`ckpt-ocdbt`) must never panic, whatever the bytes. The input
//! is decoded as a manifest, a B+tree node and a version tree node: first as it is
//! (the envelope checks: magic, length, CRC-32C, bounded zstd), then with its length
//! field and CRC-32C rewritten to match, so that mutations reach the body parsers.
//! Then the resealed input is the `manifest.ocdbt` of a directory that also holds the
//! `ocdbt_tiny` fixture's data file, and is opened, listed and looked up through
//! `Database`: mutations of the tiny manifest seed walk real nodes and values.
#![no_main]
use ckpt_ocdbt::{fuzzing, Database};

/// The data file `tests/fixtures/orbax/ocdbt_tiny/db/manifest.ocdbt` refers to.
const TINY_DATA_NAME: &str = "d/b2100f081d8289ccb86d457ee4a414a3";
const TINY_DATA: &[u8] =
    include_bytes!("../../tests/fixtures/orbax/ocdbt_tiny/db/d/b2100f081d8289ccb86d457ee4a414a3");

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = fuzzing::manifest(data);
    let _ = fuzzing::btree_node(data, 1 << 16, b"");
    let _ = fuzzing::version_node(data);
    let mut sealed = data.to_vec();
    fuzzing::reseal(&mut sealed);
    let _ = fuzzing::manifest(&sealed);
    // A transitive base path, as nodes reached through orbax's merged root have.
    let _ = fuzzing::btree_node(&sealed, 1 << 16, b"ocdbt.process_0/");
    let _ = fuzzing::version_node(&sealed);

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("manifest.ocdbt"), &sealed).unwrap();
    std::fs::create_dir(dir.path().join("d")).unwrap();
    std::fs::write(dir.path().join(TINY_DATA_NAME), TINY_DATA).unwrap();
    if let Ok(db) = Database::open(dir.path()) {
        // A node may decode to about four times the configured size: keep what the
        // input can make us allocate within the fuzzer's memory limit.
        if db.config().max_decoded_node_bytes <= 1 << 20 {
            let _ = db.list();
            let _ = db.get(b"w/0.0");
            let _ = db.generations();
        }
        let _ = Database::open_generation(dir.path(), 1).map(|db| db.root_height());
    }
});

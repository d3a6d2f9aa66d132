//! Orbax's metadata parsers must never panic, whatever the bytes: an item's
//! `_METADATA` tree, zarr v2's `.zarray`, zarr v3's `zarr.json` and a v3 shard index
//! (byte 0's low two bits pick one; its other bits the index's inner chunk count and
//! CRC-32C). Then, for `_METADATA` and `.zarray`, the input replaces that file of a
//! small item without OCDBT (the `step` array of tests/fixtures/orbax/zarr_no_ocdbt,
//! its `.zarray` and chunk) and the directory is opened as a checkpoint; whatever opens
//! is read whole, piece by piece (decoded through the same interface the copy uses).
//! Seeds: fuzz/corpus/orbax_metadata (the fixtures' files behind their selector byte).
#![no_main]
use ckpt_core::formats::ReadCache;
use ckpt_core::Checkpoint;

const METADATA: &[u8] = br#"{"tree_metadata": {"('step',)": {"key_metadata": [{"key": "step", "key_type": 2}], "value_metadata": {"value_type": "jax.Array", "skip_deserialize": false, "write_shape": []}}}, "use_ocdbt": false, "use_zarr3": false}"#;
const ZARRAY: &[u8] = include_bytes!("../../tests/fixtures/orbax/zarr_no_ocdbt/ckpt/step/.zarray");
const CHUNK: &[u8] = include_bytes!("../../tests/fixtures/orbax/zarr_no_ocdbt/ckpt/step/0");

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let _ = ckpt_core::orbax_metadata(kind, rest);
    if kind % 4 > 1 {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (meta, zarray) = if kind % 4 == 0 {
        (rest, ZARRAY)
    } else {
        (METADATA, rest)
    };
    std::fs::write(dir.path().join("_METADATA"), meta).unwrap();
    std::fs::create_dir(dir.path().join("step")).unwrap();
    std::fs::write(dir.path().join("step/.zarray"), zarray).unwrap();
    std::fs::write(dir.path().join("step/0"), CHUNK).unwrap();
    let Ok(ck) = Checkpoint::open(&[dir.path().to_path_buf()]) else {
        return;
    };
    let mut cache = ReadCache::new();
    for f in &ck.files {
        // Missing chunks are fill values: keep what one input can make us decode small.
        if f.tensor_bytes() > 1 << 20 {
            continue;
        }
        for (i, t) in f.tensors().iter().enumerate() {
            let _ = f.read(i, 0..t.end - t.start, &mut cache);
        }
    }
});

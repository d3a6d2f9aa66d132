//! The `.ckptz` reader must never panic, whatever the bytes: the header parser, and
//! for a file it accepts, reading (decompressing) its tensors and their checksums.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ckpt_core::parse_ckptz_header(data, data.len() as u64);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.ckptz");
    std::fs::write(&p, data).unwrap();
    let Ok(f) = ckpt_core::TensorFile::open(&p) else {
        return;
    };
    let mut cache = ckpt_core::ChunkCache::new();
    for (i, t) in f.tensors().iter().enumerate() {
        // A header may claim a huge tensor in few huge chunks: read a capped prefix and
        // a range across the first chunk edge, not the whole claim.
        let len = (t.end - t.start).min(1 << 16);
        if let Ok(b) = f.read(i, 0..len, &mut cache) {
            assert_eq!(b.len() as u64, len);
        }
        let _ = f.read(i, len / 2..len, &mut cache);
        if t.end - t.start <= 1 << 16 {
            let _ = f.check_checksum(i);
        }
    }
});

//! Opening a `torch.save` file must never panic, whatever the zip archive and its
//! pickle hold: the restricted pickle reader (ckpt's data-only pickle machine plus an
//! allow-list of globals) returns an error, and whatever it accepts lies inside the file.
//! The same bytes read forward, as a DCP chunk in a bucket is (local headers and data
//! descriptors, never the central directory), give a tensor inside them or an error.
//! Seeds: tests/fixtures/torch/*.pth, *.pt, *.bin, and a rank file of DTensors
//! (tests/fixtures/dtensor/ws4/model_world_size_4_rank_1.pt).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((start, end)) = ckpt_core::torch_save_single_forward(data) {
        assert!(start <= end && end <= data.len() as u64, "{start}..{end}");
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.pth");
    std::fs::write(&p, data).unwrap();
    let Ok(f) = ckpt_core::formats::TensorFile::open(&p) else {
        return;
    };
    for (i, t) in f.tensors().iter().enumerate() {
        // A storage located when read (a zip local header, a DCP chunk's header) has
        // no bytes where locating it fails, and says why.
        match f.data(i) {
            Some(b) => assert_eq!(b.len() as u64, t.end - t.start),
            None => assert!(
                !f.locate_all().is_empty(),
                "{}: no bytes, no reason",
                t.name
            ),
        }
    }
});

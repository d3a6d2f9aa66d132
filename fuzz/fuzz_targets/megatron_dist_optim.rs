//! Opening a Megatron dist_ckpt whose distributed optimizer state is saved
//! `dp_reshardable` must never panic, whatever `__0_0.distcp` holds: it stores domain 0's
//! pickled `per_bucket_numel_unpadded` (read with Megatron's restricted pickle reader)
//! and chunks of the bucket tensors, which are mapped to parameters with the buffer
//! layout computed from common.pt's args; whatever is accepted lies inside the file.
//! The other files are megatron-core's own (tests/fixtures/megatron/tp2pp2dp2_distopt/
//! dist_ckpt_dp). Seed: the real file.
#![no_main]

macro_rules! file {
    ($f:literal) => {
        (
            $f,
            include_bytes!(concat!(
                "../../tests/fixtures/megatron/tp2pp2dp2_distopt/dist_ckpt_dp/",
                $f
            ))
            .as_slice(),
        )
    };
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let files: [(&str, &[u8]); 18] = [
        file!(".metadata"),
        file!("common.pt"),
        file!("metadata.json"),
        file!("__0_1.distcp"),
        file!("__1_0.distcp"),
        file!("__1_1.distcp"),
        file!("__2_0.distcp"),
        file!("__2_1.distcp"),
        file!("__3_0.distcp"),
        file!("__3_1.distcp"),
        file!("__4_0.distcp"),
        file!("__4_1.distcp"),
        file!("__5_0.distcp"),
        file!("__5_1.distcp"),
        file!("__6_0.distcp"),
        file!("__6_1.distcp"),
        file!("__7_0.distcp"),
        file!("__7_1.distcp"),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    std::fs::write(dir.path().join("__0_0.distcp"), data).unwrap();
    let Ok((ck, _)) = ckpt_core::Checkpoint::scan(&[dir.path().to_path_buf()]) else {
        return;
    };
    for f in &ck.files {
        for (i, t) in f.tensors().iter().enumerate() {
            // A storage located when read (a zip local header, a DCP chunk's header) has
            // no bytes where locating it fails, and says why.
            match f.data(i) {
                Some(b) => assert_eq!(b.len() as u64, t.end - t.start),
                None => assert!(!f.locate_all().is_empty(), "{}: no bytes, no reason", t.name),
            }
        }
    }
});

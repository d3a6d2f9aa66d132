//! Opening a PyTorch DCP directory must never panic, whatever its `.metadata` pickle
//! holds: the pickle machine, the allow-list of DCP's globals and the chunk table are
//! checked, and whatever is accepted lies inside the real `.distcp` files beside it
//! (torch 2.15's, from tests/fixtures/torch/dcp_mesh). Seeds: that `.metadata`,
//! tests/fixtures/torch/dcp/.metadata and megatron-core 0.15.3's `MCoreMetadata` with
//! flattened tensors (`mcore_data`), tests/fixtures/megatron/tp2pp2dp2_flat/dist_ckpt/.metadata.
#![no_main]

const FILES: [(&str, &[u8]); 4] = [
    (
        "__0_0.distcp",
        include_bytes!("../../tests/fixtures/torch/dcp_mesh/__0_0.distcp"),
    ),
    (
        "__1_0.distcp",
        include_bytes!("../../tests/fixtures/torch/dcp_mesh/__1_0.distcp"),
    ),
    (
        "__2_0.distcp",
        include_bytes!("../../tests/fixtures/torch/dcp_mesh/__2_0.distcp"),
    ),
    (
        "__3_0.distcp",
        include_bytes!("../../tests/fixtures/torch/dcp_mesh/__3_0.distcp"),
    ),
];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in FILES {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    std::fs::write(dir.path().join(".metadata"), data).unwrap();
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

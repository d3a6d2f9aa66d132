//! Opening a Megatron legacy checkpoint must never panic, whatever the rank file that
//! `args` are read from holds: the pickle machine, the globals allowed, the pickled
//! `argparse.Namespace` (sizes of any value), the layer rules and the layout built from
//! them are checked, and whatever is accepted lies inside the files. The other three
//! ranks are megatron-core's own (tests/fixtures/megatron/tp2pp2/legacy). Seed: the real
//! `mp_rank_00_000/model_optim_rng.pt`.
#![no_main]

const RANKS: [(&str, &[u8]); 3] = [
    (
        "mp_rank_00_001",
        include_bytes!(
            "../../tests/fixtures/megatron/tp2pp2/legacy/iter_0000001/mp_rank_00_001/model_optim_rng.pt"
        ),
    ),
    (
        "mp_rank_01_000",
        include_bytes!(
            "../../tests/fixtures/megatron/tp2pp2/legacy/iter_0000001/mp_rank_01_000/model_optim_rng.pt"
        ),
    ),
    (
        "mp_rank_01_001",
        include_bytes!(
            "../../tests/fixtures/megatron/tp2pp2/legacy/iter_0000001/mp_rank_01_001/model_optim_rng.pt"
        ),
    ),
];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let iter = dir.path().join("iter_0000001");
    for (name, bytes) in RANKS.iter().copied().chain([("mp_rank_00_000", data)]) {
        std::fs::create_dir_all(iter.join(name)).unwrap();
        std::fs::write(iter.join(name).join("model_optim_rng.pt"), bytes).unwrap();
    }
    let Ok((ck, _)) = ckpt_core::Checkpoint::scan(&[iter]) else {
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

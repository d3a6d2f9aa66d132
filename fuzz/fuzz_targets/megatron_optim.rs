//! Opening a Megatron legacy checkpoint with the distributed optimizer's state must never
//! panic, whatever `mp_rank_00_000/distrib_optim.pt` holds: the pickle machine, the
//! globals allowed, the dp_zero dict (buffers, dtype keys, `numel_unpadded`, the state
//! tensors' storages), the buffer layout computed from args and its padding check, and
//! whatever is accepted lies inside the file. The other files are megatron-core's own
//! (tests/fixtures/megatron/tp2pp2dp2_distopt/legacy). Seed: the real file.
#![no_main]

macro_rules! rank {
    ($d:literal) => {
        (
            $d,
            include_bytes!(concat!(
                "../../tests/fixtures/megatron/tp2pp2dp2_distopt/legacy/iter_0000001/",
                $d,
                "/model_optim_rng.pt"
            ))
            .as_slice(),
            include_bytes!(concat!(
                "../../tests/fixtures/megatron/tp2pp2dp2_distopt/legacy/iter_0000001/",
                $d,
                "/distrib_optim.pt"
            ))
            .as_slice(),
        )
    };
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let ranks: [(&str, &[u8], &[u8]); 4] = [
        rank!("mp_rank_00_000"),
        rank!("mp_rank_00_001"),
        rank!("mp_rank_01_000"),
        rank!("mp_rank_01_001"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let iter = dir.path().join("iter_0000001");
    for (i, (name, model, optim)) in ranks.iter().enumerate() {
        std::fs::create_dir_all(iter.join(name)).unwrap();
        std::fs::write(iter.join(name).join("model_optim_rng.pt"), model).unwrap();
        let optim = if i == 0 { data } else { optim };
        std::fs::write(iter.join(name).join("distrib_optim.pt"), optim).unwrap();
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

//! Opening a Megatron legacy checkpoint of a mixture of experts with the distributed
//! optimizer's state must never panic, whatever expert-parallel rank 1's
//! `distrib_optim.pt` holds: the chained optimizers' list (`[None, expert]` there), the
//! expert buffer's layout computed from args with the expert-data-parallel size, and
//! whatever is accepted lies inside the file. The other files are megatron-core's own
//! (tests/fixtures/moe/megatron/ep2dp4_distopt/legacy). Seed: the real file.
#![no_main]

const DIR: &str = "mp_rank_00_000";
const MODEL0: &[u8] = include_bytes!(
    "../../tests/fixtures/moe/megatron/ep2dp4_distopt/legacy/iter_0000001/mp_rank_00_000/model_optim_rng.pt"
);
const OPTIM0: &[u8] = include_bytes!(
    "../../tests/fixtures/moe/megatron/ep2dp4_distopt/legacy/iter_0000001/mp_rank_00_000/distrib_optim.pt"
);
const MODEL1: &[u8] = include_bytes!(
    "../../tests/fixtures/moe/megatron/ep2dp4_distopt/legacy/iter_0000001/mp_rank_00_001/model_optim_rng.pt"
);

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let iter = dir.path().join("iter_0000001");
    for (name, model, optim) in [(DIR, MODEL0, OPTIM0), ("mp_rank_00_001", MODEL1, data)] {
        std::fs::create_dir_all(iter.join(name)).unwrap();
        std::fs::write(iter.join(name).join("model_optim_rng.pt"), model).unwrap();
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

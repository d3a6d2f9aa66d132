//! Opening a tensor-parallel DeepSpeed checkpoint (TP 2 x DP 2, with
//! `universal_checkpoint_info`, from tests/fixtures/deepspeed_tp) must never panic,
//! whatever one of its files holds: the first input byte picks the file the rest of the
//! input replaces; the reader returns a named error, or pieces that all lie inside the
//! files. Seeds: fuzz/corpus/deepspeed_tp (each fixture file behind its selector byte).
#![no_main]

const FILES: [(&str, &[u8]); 6] = [
    (
        "mp_rank_00_model_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed_tp/zero2_uci/ckpt/global_step2/mp_rank_00_model_states.pt"),
    ),
    (
        "mp_rank_01_model_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed_tp/zero2_uci/ckpt/global_step2/mp_rank_01_model_states.pt"),
    ),
    (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed_tp/zero2_uci/ckpt/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ),
    (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed_tp/zero2_uci/ckpt/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ),
    (
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed_tp/zero2_uci/ckpt/global_step2/zero_pp_rank_0_mp_rank_01_optim_states.pt"),
    ),
    (
        "zero_pp_rank_1_mp_rank_01_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed_tp/zero2_uci/ckpt/global_step2/zero_pp_rank_1_mp_rank_01_optim_states.pt"),
    ),
];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let replaced = usize::from(sel) % FILES.len();
    let dir = tempfile::tempdir().unwrap();
    for (i, (name, bytes)) in FILES.iter().enumerate() {
        let b = if i == replaced { rest } else { bytes };
        std::fs::write(dir.path().join(name), b).unwrap();
    }
    let Ok(ck) = ckpt_core::Checkpoint::open(&[dir.path().to_path_buf()]) else {
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

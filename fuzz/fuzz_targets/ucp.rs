//! Opening a DeepSpeed universal checkpoint must never panic, whatever one of its files
//! holds: the first input byte picks a real tree (ZeRO-2's dicts or ZeRO-3's flat
//! tensors, from tests/fixtures/deepspeed/*/ucp, as ds_to_universal wrote them) and which
//! of its files the rest of the input replaces; the reader returns a named error, or
//! tensors that all lie inside their files.
//! Seeds: fuzz/corpus/ucp (each fixture file behind its selector byte).
#![no_main]

const ZERO2: [(&str, &[u8]); 4] = [
    (
        "mp_rank_00_model_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero2_fp32/ucp/mp_rank_00_model_states.pt"),
    ),
    (
        "zero/fc1.weight/fp32.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero2_fp32/ucp/zero/fc1.weight/fp32.pt"),
    ),
    (
        "zero/fc1.weight/exp_avg.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero2_fp32/ucp/zero/fc1.weight/exp_avg.pt"),
    ),
    (
        "zero/optimizer_state.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero2_fp32/ucp/zero/optimizer_state.pt"),
    ),
];

const ZERO3: [(&str, &[u8]); 3] = [
    (
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero3_fp32/ucp/zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ),
    (
        "zero/fc1.weight/fp32.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero3_fp32/ucp/zero/fc1.weight/fp32.pt"),
    ),
    (
        "zero/fc1.weight/exp_avg_sq.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero3_fp32/ucp/zero/fc1.weight/exp_avg_sq.pt"),
    ),
];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let files: &[(&str, &[u8])] = if sel & 0x80 == 0 { &ZERO2 } else { &ZERO3 };
    let replaced = usize::from(sel & 0x7f) % files.len();
    let dir = tempfile::tempdir().unwrap();
    for (i, (name, bytes)) in files.iter().enumerate() {
        let b = if i == replaced { rest } else { bytes };
        let p = dir.path().join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b).unwrap();
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

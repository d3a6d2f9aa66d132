//! Opening a DeepSpeed ZeRO tag directory must never panic, whatever one of its files
//! holds: the first input byte picks a real checkpoint (ZeRO-2 or ZeRO-3 from
//! tests/fixtures/deepspeed, or the mixture of experts without ZeRO from
//! tests/fixtures/moe/deepspeed) and which of its files the rest of the input replaces; the
//! reader returns a named error, or pieces that all lie inside the files and assemble.
//! Seeds: fuzz/corpus/deepspeed (each fixture file behind its selector byte).
#![no_main]

const ZERO2: [(&str, &[u8]); 3] = [
    (
        "mp_rank_00_model_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero2_fp32/ckpt/global_step2/mp_rank_00_model_states.pt"),
    ),
    (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero2_fp32/ckpt/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ),
    (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero2_fp32/ckpt/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ),
];

const ZERO3: [(&str, &[u8]); 4] = [
    (
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero3_fp32/ckpt/global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ),
    (
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero3_fp32/ckpt/global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ),
    (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero3_fp32/ckpt/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ),
    (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        include_bytes!("../../tests/fixtures/deepspeed/zero3_fp32/ckpt/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ),
];

macro_rules! zero0_moe {
    ($($name:literal),* $(,)?) => {
        [$(($name, include_bytes!(concat!("../../tests/fixtures/moe/deepspeed/ep2_zero0/ckpt/global_step2/", $name)) as &[u8])),*]
    };
}

/// A mixture of experts without ZeRO (stage 0): `module`, the expert files and the
/// expert-parallel optimizer files.
const ZERO0_MOE: [(&str, &[u8]); 11] = zero0_moe![
    "mp_rank_00_model_states.pt",
    "layer_0_expert_0_mp_rank_00_model_states.pt",
    "layer_0_expert_1_mp_rank_00_model_states.pt",
    "layer_0_expert_2_mp_rank_00_model_states.pt",
    "layer_0_expert_3_mp_rank_00_model_states.pt",
    "layer_1_expert_0_mp_rank_00_model_states.pt",
    "layer_1_expert_1_mp_rank_00_model_states.pt",
    "layer_1_expert_2_mp_rank_00_model_states.pt",
    "layer_1_expert_3_mp_rank_00_model_states.pt",
    "expp_rank_0_mp_rank_00_optim_states.pt",
    "expp_rank_1_mp_rank_00_optim_states.pt",
];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    // Selector: bit 7 ZeRO-3, else bit 6 ZeRO-0 with experts, else ZeRO-2; the low six
    // bits pick the file the input replaces.
    let files: &[(&str, &[u8])] = match (sel & 0x80, sel & 0x40) {
        (0, 0) => &ZERO2,
        (0, _) => &ZERO0_MOE,
        _ => &ZERO3,
    };
    let replaced = usize::from(sel & 0x3f) % files.len();
    let dir = tempfile::tempdir().unwrap();
    for (i, (name, bytes)) in files.iter().enumerate() {
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

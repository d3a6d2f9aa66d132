//! A trainer's run config (Megatron-Bridge's `run_config.yaml`, NeMo 2's
//! `context/model.yaml`) read as the model's record must never panic, whatever the
//! YAML holds; byte 0 picks the section the sizes are read from.
#![no_main]
use ckpt_core::run_config_sizes;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let section = if pick % 2 == 0 { "model" } else { "config" };
    let _ = run_config_sizes(text, section);
});

//! The safetensors header parser must never panic, whatever the bytes.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ckpt_core::formats::safetensors::parse_header(data);
});

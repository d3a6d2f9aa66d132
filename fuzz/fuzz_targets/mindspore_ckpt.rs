//! The MindSpore `.ckpt` reader must never panic, and every tensor it accepts must lie
//! inside the bytes with a length that matches its shape and dtype.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok((tensors, _)) = ckpt_core::formats::mindspore_ckpt::parse_mindspore_ckpt(data) else {
        return;
    };
    for t in tensors {
        assert!(t.start <= t.end && t.end <= data.len() as u64, "{t:?}");
    }
});

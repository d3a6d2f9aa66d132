//! The GGUF reader must never panic, and every tensor it accepts must lie inside the
//! bytes' range arithmetic (`TensorFile::from_parts` then checks them against the file)
//! with a length that matches its shape and dtype.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok((tensors, _)) = ckpt_core::formats::gguf::parse_gguf(data) else {
        return;
    };
    for t in tensors {
        assert!(t.start <= t.end, "{t:?}");
    }
});

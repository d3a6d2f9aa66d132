//! The MindSpore strategy reader (protobuf and JSON) must never panic, and every layout
//! it accepts must convert to ours or be refused with an error, never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(params) = ckpt_core::formats::mindspore_strategy::parse_mindspore_strategy(data) else {
        return;
    };
    for (name, p) in params {
        let dims = p.layout.tensor_map.len();
        if dims <= 4 && p.layout.dev_matrix.iter().product::<u64>() <= 1 << 12 {
            let _ = ckpt_core::layout::mindspore::from_mindspore(
                &name,
                &p.layout,
                vec![64; dims],
                ckpt_core::layout::Dtype::F32,
            );
        }
    }
});

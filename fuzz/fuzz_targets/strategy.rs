//! The strategy parser must never panic; what it accepts must survive a round trip and
//! give every rank a consistent set of pieces.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(s) = ckpt_core::layout::strategy::Strategy::from_json(text) else {
        return;
    };
    assert_eq!(
        ckpt_core::layout::strategy::Strategy::from_json(&s.to_json()).unwrap(),
        s
    );
    if s.mesh.world_size() <= 64 {
        for l in s.tensors.values() {
            if l.shape.iter().product::<u64>() <= 1 << 20 {
                for r in 0..s.mesh.world_size() {
                    let _ = l.pieces(&s.mesh, r);
                }
            }
        }
    }
});

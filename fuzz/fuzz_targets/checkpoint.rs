//! Opening a whole checkpoint directory must never panic, whatever the files hold, and
//! whatever it accepts must be copyable: every tensor is assembled through the same
//! plan and engine merge uses, and checksums are checked.
//!
//! Input layout: byte 0 picks the layout (even: sliced `ckpt_<r>/` directories sharing
//! a `strategy.json`; odd: a flat directory of safetensors files, DCP style); the rest
//! is split on `\n@@\n` into the strategy (sliced only) and up to 4 files.
#![no_main]
use ckpt_core::engine::copy::assemble;
use ckpt_core::layout::plan::{CopyPlan, TargetFile, TargetTensor};
use ckpt_core::layout::region::Region;
use ckpt_core::layout::Piece;
use ckpt_core::Checkpoint;

fn split<'a>(data: &'a [u8], sep: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(sep.len()).position(|w| w == sep) {
        out.push(&rest[..i]);
        rest = &rest[i + sep.len()..];
    }
    out.push(rest);
    out
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let parts = split(rest, b"\n@@\n");
    let dir = tempfile::tempdir().unwrap();
    if mode % 2 == 0 {
        let (strategy, files) = parts.split_first().unwrap();
        for (r, f) in files.iter().take(4).enumerate() {
            let d = dir.path().join(format!("ckpt_{r}"));
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("model.safetensors"), f).unwrap();
            std::fs::write(d.join("strategy.json"), strategy).unwrap();
        }
    } else {
        for (i, f) in parts.iter().take(4).enumerate() {
            std::fs::write(dir.path().join(format!("f{i}.safetensors")), f).unwrap();
        }
    }
    let Ok((ck, problems)) = Checkpoint::scan(&[dir.path().to_path_buf()]) else {
        return;
    };
    if !problems.is_empty() {
        return;
    }
    for f in &ck.files {
        for i in 0..f.tensors().len() {
            let _ = f.check_checksum(i);
        }
    }
    for (name, t) in &ck.tensors {
        if t.shape.iter().product::<u64>() > 1 << 16 {
            continue;
        }
        let full = Region::full(&t.shape);
        let target = TargetTensor {
            name: name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces: vec![Piece {
                global: full.clone(),
                local: full,
            }],
        };
        let file = TargetFile {
            path: "x".into(),
            tensors: vec![target],
            metadata: Default::default(),
        };
        // A checkpoint that opened cleanly must plan: every element has an owner.
        let plan = CopyPlan::build(&ck, vec![file]).expect("an accepted checkpoint plans");
        let bytes =
            assemble(&plan.files[0].tensors[0], &ck).expect("mapped inputs read without error");
        assert_eq!(
            bytes.len() as u64,
            ckpt_core::layout::plan::bytes_of(t.dtype, t.shape.iter().product())
        );
    }
});

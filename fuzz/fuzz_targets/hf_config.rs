//! A Hugging Face `config.json` (`merge --format hf --hf-config`, the config beside a
//! model an import reads) must never panic the reader, and whatever it accepts must
//! write a config that reads back as the same family and sizes.
#![no_main]
use ckpt_core::hf::{config_json as hf_config_json, read_config as read_hf_config};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok((family, shape)) = read_hf_config(text, "config.json") else {
        return;
    };
    let written = hf_config_json(family, &shape, "float32");
    let (again, back) = read_hf_config(&written, "written").expect("ckpt's own config reads back");
    assert_eq!(again, family);
    assert_eq!(
        (back.layers, back.hidden, back.heads, back.ffn, back.vocab),
        (
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.ffn,
            shape.vocab
        )
    );
});

//! A byte-level BPE `tokenizer.json` (`merge --format gguf` of Qwen2, Qwen3, their
//! mixtures of experts and Llama 3, `write/gguf/bpe.rs`) must never panic the reader,
//! and whatever it accepts is one token and one ggml type per id of the model, at least
//! one merge, and one of llama.cpp's pre-tokenizers ckpt names (`qwen2`, `llama-bpe`).
//! The first two bytes give the model's `vocab_size` (below 4096), the rest is the
//! file.
#![no_main]
use ckpt_core::write::gguf::{read_bpe_tokenizer, BpeVocab};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let [a, b, json @ ..] = data else {
        return;
    };
    let vocab_size = usize::from(u16::from_le_bytes([*a, *b]) % 4096);
    let Ok(BpeVocab {
        pre,
        tokens,
        types,
        merges,
    }) = read_bpe_tokenizer(json, vocab_size)
    else {
        return;
    };
    assert!(matches!(pre, "qwen2" | "llama-bpe"), "{pre}");
    assert_eq!(tokens.len(), vocab_size);
    assert_eq!(types.len(), vocab_size);
    assert!(
        types.iter().all(|t| matches!(t, 1 | 3 | 4 | 5)),
        "{types:?}"
    );
    assert!(!merges.is_empty());
    // Ids without a token are llama.cpp's unused `[PAD{i}]`.
    for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
        if *ty == 5 {
            assert_eq!(*t, format!("[PAD{i}]"));
        }
    }
});

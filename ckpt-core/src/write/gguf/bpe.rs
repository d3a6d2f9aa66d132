//! A byte-level BPE `tokenizer.json` (Qwen2's, Qwen3's and Llama 3's) as llama.cpp's
//! converter writes it (`TextModel._set_vocab_gpt2` and `get_vocab_base`, llama-cpp-python
//! 0.3.36's `vendor/llama.cpp/conversion/base.py`): `tokenizer.ggml.model = "gpt2"`, the
//! pre-tokenizer's name, one token per id below the config's `vocab_size` with its ggml
//! type, and the merges (gguf-py's `SpecialVocab(load_merges=True)`).
//!
//! The converter names the pre-tokenizer by a hash of the tokenizer's ids on a fixed
//! text (`get_vocab_base_pre`), which needs the real vocabulary it was registered for.
//! ckpt names it by what `tokenizer.json` configures instead, from one table
//! ([`KNOWN`]): the normalizer, the pre-tokenizer (`Split` of the row's regex, isolated,
//! then `ByteLevel` without a prefix space or its own regex) and the BPE model's
//! `ignore_merges` (llama.cpp's `llama_vocab::impl::load` sets it by the name: true for
//! `llama-bpe`, false for `qwen2`). Qwen2's (transformers' `Qwen2Tokenizer`: NFC, its
//! `PRETOKENIZE_REGEX`) is llama.cpp's `qwen2`; Llama 3's (Meta's `tokenizer.json`, as
//! transformers' `TikTokenConverter` builds it: no normalizer, its default pattern,
//! `ignore_merges`) is `llama-bpe`, the name the converter gives Meta-Llama-3-8B's hash.
//! Any other configuration is refused by name.

use super::refuse::{looks_special, unsupported};
use crate::error::Result;
use crate::formats::read_small;
use serde_json::{json, Map, Value as Json};
use std::path::Path;

/// A byte-level BPE `tokenizer.json` as `merge --format gguf` writes it for llama.cpp
/// ([`read_bpe_tokenizer`]).
#[derive(Clone, Debug)]
pub struct BpeVocab {
    /// `tokenizer.ggml.pre`.
    pub pre: &'static str,
    /// `tokenizer.ggml.tokens`: one per id below the model's `vocab_size`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 3 control, 4 user-defined, 5 unused.
    pub types: Vec<i32>,
    /// `tokenizer.ggml.merges`: `"left right"`, a space inside a part written as
    /// U+0120 (gguf-py's rule for the pair format).
    pub merges: Vec<String>,
}

/// A byte-level BPE `tokenizer.json` as `merge --format gguf` reads it for a model of
/// `vocab_size` ids, or the refusal naming the problem. The fuzz target's
/// entry.
///
/// # Errors
/// What the writer refuses: not JSON, not a byte-level BPE, a pre-tokenizer ckpt
/// cannot name, an id not below `vocab_size`, no merges.
pub fn read_bpe_tokenizer(json: &[u8], vocab_size: usize) -> Result<BpeVocab> {
    Ok(parse(json, Path::new("tokenizer.json"), vocab_size)?.vocab)
}

/// Qwen2's pre-tokenizer regex (transformers' `tokenization_qwen2.PRETOKENIZE_REGEX`,
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
pub(crate) const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's pre-tokenizer regex (transformers' `TikTokenConverter` default `pattern`,
/// the regex of Meta's `tokenizer.json`; transformers' GGUF loader's `_LLAMA3_SPLIT` for
/// `llama-bpe`; llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3`): digits in runs of up to 3.
pub(crate) const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A `tokenizer.json` configuration llama.cpp has a pre-tokenizer for.
pub(crate) struct KnownBpe {
    /// `tokenizer.ggml.pre`.
    pub(crate) pre: &'static str,
    /// What the configuration is, for messages.
    pub(crate) what: &'static str,
    /// The `normalizer` (`None`: JSON null or absent).
    pub(crate) normalizer: Option<&'static str>,
    /// The `Split` regex before the `ByteLevel` pre-tokenizer.
    pub(crate) regex: &'static str,
    /// `model.ignore_merges` (absent: false, the `tokenizers` default).
    pub(crate) ignore_merges: bool,
}

/// The configurations ckpt names, one row each.
pub(crate) const KNOWN: &[KnownBpe] = &[
    KnownBpe {
        pre: "qwen2",
        what: "Qwen2's: NFC, Split of Qwen2's regex, ByteLevel without prefix space, merges not ignored",
        normalizer: Some("NFC"),
        regex: QWEN2_REGEX,
        ignore_merges: false,
    },
    KnownBpe {
        pre: "llama-bpe",
        what: "Llama 3's: no normalizer, Split of Llama 3's regex, ByteLevel without prefix space, ignore_merges",
        normalizer: None,
        regex: LLAMA3_REGEX,
        ignore_merges: true,
    },
];

/// A `tokenizer.json` as the converter reads it: the vocabulary it writes, and the
/// parsed file (its added tokens, post-processor and normalizer are read again for the
/// special vocabulary).
pub(super) struct Bpe {
    pub(super) vocab: BpeVocab,
    pub(super) doc: Map<String, Json>,
}

/// The `tokenizer.ggml.pre` ckpt gives a `tokenizer.json`, by its normalizer,
/// pre-tokenizer and `ignore_merges` ([`KNOWN`]), or why none.
fn pre_name(doc: &Map<String, Json>) -> std::result::Result<&'static str, String> {
    let pre = doc.get("pre_tokenizer").unwrap_or(&Json::Null);
    // `trim_offsets` changes offsets only, not the pieces: not compared.
    let mut seen = pre.clone();
    if let Some(Json::Object(bl)) = seen.pointer_mut("/pretokenizers/1") {
        bl.remove("trim_offsets");
    }
    let normalizer = doc.get("normalizer").unwrap_or(&Json::Null);
    let ignore_merges = doc
        .get("model")
        .and_then(|m| m.get("ignore_merges"))
        .unwrap_or(&Json::Null);
    for known in KNOWN {
        let want_pre = json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": known.regex}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false},
            ],
        });
        let want_normalizer = known.normalizer.map_or(Json::Null, |t| json!({"type": t}));
        let merges_ok = match ignore_merges {
            Json::Null => !known.ignore_merges,
            v => v.as_bool() == Some(known.ignore_merges),
        };
        if seen == want_pre && *normalizer == want_normalizer && merges_ok {
            return Ok(known.pre);
        }
    }
    let kind = |v: &Json| -> String {
        match v {
            Json::Null => "none".into(),
            Json::Object(m) => {
                let ty = m.get("type").and_then(Json::as_str).unwrap_or("?");
                match m.get("pretokenizers").and_then(Json::as_array) {
                    Some(parts) => format!(
                        "{ty}[{}]",
                        parts
                            .iter()
                            .map(|p| p.get("type").and_then(Json::as_str).unwrap_or("?"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    None => ty.to_string(),
                }
            }
            other => other.to_string(),
        }
    };
    let regex = seen
        .pointer("/pretokenizers/0/pattern/Regex")
        .and_then(Json::as_str)
        .map(|r| match KNOWN.iter().find(|k| k.regex == r) {
            Some(k) => format!(", the regex {}'s", k.pre),
            None => ", a regex of no known tokenizer".into(),
        })
        .unwrap_or_default();
    Err(format!(
        "its pre-tokenizer ({}{regex}) with normalizer ({}) and ignore_merges {} is not one ckpt can name for llama.cpp (built: {})",
        kind(pre),
        kind(normalizer),
        if ignore_merges.is_null() { "absent".to_string() } else { ignore_merges.to_string() },
        KNOWN
            .iter()
            .map(|k| format!("`{}`, {}", k.pre, k.what))
            .collect::<Vec<_>>()
            .join("; ")
    ))
}

/// Reads `dir/tokenizer.json` for a model of `vocab_size` ids.
pub(super) fn read(dir: &Path, vocab_size: usize) -> Result<Bpe> {
    let path = dir.join("tokenizer.json");
    parse(&read_small(&path)?, &path, vocab_size)
}

/// The `tokenizer.json` `bytes` (read from `path`, for messages) for a model of
/// `vocab_size` ids.
pub(super) fn parse(bytes: &[u8], path: &Path, vocab_size: usize) -> Result<Bpe> {
    let bad = |problem: String| unsupported(format!("{}: {problem}", path.display()));
    let doc = match serde_json::from_slice(bytes) {
        Ok(Json::Object(m)) => m,
        Ok(_) => return Err(bad("not a JSON object".into())),
        Err(e) => return Err(bad(format!("not JSON: {e}"))),
    };
    let model = doc
        .get("model")
        .and_then(Json::as_object)
        .ok_or_else(|| bad("no `model`".into()))?;
    match model.get("type").and_then(Json::as_str) {
        Some("BPE") => {}
        other => {
            return Err(bad(format!(
                "model type {}: only a byte-level BPE is built",
                other.unwrap_or("missing")
            )))
        }
    }
    if model.get("byte_fallback").and_then(Json::as_bool) == Some(true) {
        return Err(bad(
            "a BPE with byte_fallback (SentencePiece-style) is not built".into(),
        ));
    }
    let pre = pre_name(&doc).map_err(bad)?;
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| bad("no `model.vocab`".into()))?;
    // `tokenizer.vocab`: the model's pieces, then the added tokens over them.
    let mut by_id: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let mut put = |id: u64, text: String, ty: i32| -> Result<()> {
        let slot = usize::try_from(id)
            .ok()
            .and_then(|i| by_id.get_mut(i))
            .ok_or_else(|| {
                bad(format!(
                    "token {text:?} has id {id}, not below the config's vocab_size {vocab_size} (the converter asserts it)"
                ))
            })?;
        *slot = Some((text, ty));
        Ok(())
    };
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("token {text:?} has id {id}")))?;
        put(id, text.clone(), 1)?;
    }
    for added in doc
        .get("added_tokens")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        let (Some(id), Some(text)) = (
            added.get("id").and_then(Json::as_u64),
            added.get("content").and_then(Json::as_str),
        ) else {
            return Err(bad(format!("added token {added} has no id or content")));
        };
        let special = added.get("special").and_then(Json::as_bool) == Some(true);
        if special || looks_special(text) {
            put(id, text.to_string(), 3)?;
        } else {
            // A non-normalized one is encoded and decoded first, which gives it back
            // for a byte-level BPE; `▁` pre-normalized to a space.
            put(id, text.replace('\u{2581}', " "), 4)?;
        }
    }
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    for (i, t) in by_id.into_iter().enumerate() {
        let (text, ty) = t.unwrap_or_else(|| (format!("[PAD{i}]"), 5));
        tokens.push(text);
        types.push(ty);
    }
    let merges = match model.get("merges").and_then(Json::as_array) {
        None => Vec::new(),
        Some(list) => list
            .iter()
            .map(|m| match m {
                Json::String(s) => Ok(s.clone()),
                Json::Array(pair) if pair.len() == 2 => {
                    let parts: Option<Vec<String>> = pair
                        .iter()
                        .map(|p| p.as_str().map(|s| s.replace(' ', "\u{120}")))
                        .collect();
                    parts
                        .map(|p| p.join(" "))
                        .ok_or_else(|| bad(format!("merge {m} is not two strings")))
                }
                other => Err(bad(format!("merge {other} is not a string or a pair"))),
            })
            .collect::<Result<_>>()?,
    };
    if merges.is_empty() {
        return Err(bad(
            "no merges (the converter writes a file llama.cpp cannot tokenize with)".into(),
        ));
    }
    Ok(Bpe {
        vocab: BpeVocab {
            pre,
            tokens,
            types,
            merges,
        },
        doc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(pre: Json, normalizer: Json) -> Map<String, Json> {
        match json!({"pre_tokenizer": pre, "normalizer": normalizer}) {
            Json::Object(m) => m,
            _ => unreachable!(),
        }
    }

    fn split_bytelevel(regex: &str) -> Json {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})
    }

    #[test]
    fn qwen2s_pre_tokenizer_is_named_and_others_are_refused_by_name() {
        let qwen = split_bytelevel(QWEN2_REGEX);
        assert_eq!(
            pre_name(&doc(qwen.clone(), json!({"type": "NFC"}))),
            Ok("qwen2")
        );
        // Another normalizer, another regex, a prefix space: refused, the parts named.
        let e = pre_name(&doc(qwen.clone(), Json::Null)).unwrap_err();
        assert!(
            e.contains("Sequence[Split, ByteLevel], the regex qwen2's")
                && e.contains("normalizer (none)")
                && e.contains("`llama-bpe`, Llama 3's"),
            "{e}"
        );
        let mut other = qwen.clone();
        other["pretokenizers"][0]["pattern"]["Regex"] = json!(r"\p{L}+|\p{N}{1,3}");
        let e = pre_name(&doc(other, json!({"type": "NFC"}))).unwrap_err();
        assert!(e.contains("a regex of no known tokenizer"), "{e}");
        let mut prefix = qwen;
        prefix["pretokenizers"][1]["add_prefix_space"] = json!(true);
        assert!(pre_name(&doc(prefix, json!({"type": "NFC"}))).is_err());
        let e = pre_name(&doc(
            json!({"type": "ByteLevel", "add_prefix_space": false}),
            Json::Null,
        ))
        .unwrap_err();
        assert!(e.contains("pre-tokenizer (ByteLevel)"), "{e}");
    }

    /// Llama 3's configuration is `llama-bpe` only with `ignore_merges` (llama.cpp
    /// ignores merges for it), and Qwen2's `qwen2` only without.
    #[test]
    fn llama3s_pre_tokenizer_is_llama_bpe_with_ignore_merges_only() {
        let with = |pre: Json, normalizer: Json, ignore: Option<bool>| {
            let mut d = doc(pre, normalizer);
            if let Some(b) = ignore {
                d.insert("model".into(), json!({"type": "BPE", "ignore_merges": b}));
            }
            pre_name(&d)
        };
        let llama = split_bytelevel(LLAMA3_REGEX);
        assert_eq!(with(llama.clone(), Json::Null, Some(true)), Ok("llama-bpe"));
        for ignore in [None, Some(false)] {
            let e = with(llama.clone(), Json::Null, ignore).unwrap_err();
            assert!(
                e.contains("the regex llama-bpe's") && e.contains("ignore_merges"),
                "{e}"
            );
        }
        // Llama 3's regex under Qwen2's NFC, and Qwen2's with ignore_merges: refused.
        assert!(with(llama, json!({"type": "NFC"}), Some(true)).is_err());
        let qwen = split_bytelevel(QWEN2_REGEX);
        assert_eq!(
            with(qwen.clone(), json!({"type": "NFC"}), Some(false)),
            Ok("qwen2")
        );
        let e = with(qwen, json!({"type": "NFC"}), Some(true)).unwrap_err();
        assert!(e.contains("ignore_merges true"), "{e}");
    }
}

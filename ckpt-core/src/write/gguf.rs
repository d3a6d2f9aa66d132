//! A GGUF file for llama.cpp (`merge --format gguf`), as llama.cpp's own
//! `convert_hf_to_gguf.py` writes it (tests/fixtures/serving/README.md, "GGUF
//! semantics"): the source seen as the Hugging Face model, its tensors renamed by
//! [`hf::LLAMA_CPP`] (the query and key rows permuted from Hugging Face's rotary halves to
//! llama.cpp's interleaved pairs, as a view of the stored rows), in the ggml type the
//! converter gives each (norms and 1-D tensors F32, the rest `--dtype`: F32, F16, BF16
//! cast by the engine, or Q8_0 computed), the model's keys from its `config.json` and
//! the tokenizer's from its SentencePiece `tokenizer.model` (Llama, Mistral) or its
//! byte-level BPE `tokenizer.json` (Qwen2, Qwen3: [`bpe`]) and `tokenizer_config.json`.
//! One file, written streaming at precomputed offsets by the GGUF codec
//! ([`crate::formats::gguf`]).

use super::Writer;
use crate::checkpoint::{Checkpoint, HfModel};
use crate::error::{Error, Result};
use crate::formats::gguf::{encode_metadata, GgmlType, Value};
use crate::formats::read_small;
use crate::hf::{self, Family, RopeRows};
use crate::layout::compute::Operation;
use crate::layout::plan::{CopyPlan, TargetFile, TargetTensor};
use crate::layout::region::Region;
use crate::layout::select::Selection;
use crate::layout::source::{
    Compute, ComputeInput, Computed, PieceSource, SourcePiece, SourceTensor,
};
use crate::layout::Piece;
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod bpe;
mod refuse;

pub use bpe::{read_bpe_tokenizer, BpeVocab};

use refuse::{looks_special, unsupported};

/// The file the plan writes (the tool moves it to the output's name).
pub(crate) const GGUF_FILE: &str = "model.gguf";

/// Names the converter drops.
const DROPPED_SUFFIXES: [&str; 3] = [
    ".rotary_emb.inv_freq",
    ".attention.masked_bias",
    ".attention.bias",
];

/// `merge --format gguf`, for a source already seen as the Hugging Face model.
#[derive(Clone, Debug)]
pub struct GgufExport {
    /// The model (family, sizes, its config).
    pub model: HfModel,
    /// The type of the tensors that are not norms or 1-D (`--dtype`); `None`: the
    /// converter's `auto`, BF16 or F16 as the first matrix is, else F16.
    pub out_type: Option<GgmlType>,
    /// The directory of the tokenizer (`--tokenizer`); else the source's own files.
    pub tokenizer: Option<PathBuf>,
}

/// The checkpoint's tensors under GGUF's names (a [`PieceSource`] over its files).
struct GgufTensors<'a> {
    base: &'a Checkpoint,
    tensors: BTreeMap<String, SourceTensor>,
}

impl PieceSource for GgufTensors<'_> {
    fn source_tensors(&self) -> &BTreeMap<String, SourceTensor> {
        &self.tensors
    }

    fn stored_shape(&self, file: usize, tensor: usize) -> &[u64] {
        self.base.stored_shape(file, tensor)
    }
}

/// llama.cpp's architecture for a family (`general.architecture`, the keys' prefix),
/// if ckpt writes it.
fn gguf_arch(family: Family) -> Option<&'static str> {
    match family {
        Family::Llama | Family::Mistral | Family::Mixtral => Some("llama"),
        Family::Qwen2 => Some("qwen2"),
        Family::Qwen3 => Some("qwen3"),
        Family::Qwen2Moe => Some("qwen2moe"),
        Family::Qwen3Moe => Some("qwen3moe"),
        _ => None,
    }
}

/// Whether the family is Qwen's, whose converters read only a byte-level BPE
/// `tokenizer.json` (Llama's read a SentencePiece `tokenizer.model` first:
/// [`GgufExport::tokenizer_dir`]).
fn bpe_family(family: Family) -> bool {
    matches!(
        family,
        Family::Qwen2 | Family::Qwen3 | Family::Qwen2Moe | Family::Qwen3Moe
    )
}

/// The GGUF name of `name` in `family`'s table and how its rows are permuted, if any.
/// Llama's (and Mixtral's) query and key rows are permuted (`LlamaModel.permute`);
/// Qwen's are not (`Qwen2Model` maps names only: llama.cpp rotates Qwen's halves,
/// NEOX-style), and Qwen adds the attention biases and Qwen3 the query/key norms,
/// Qwen's mixtures of experts the router and the shared expert, Mixtral its router
/// (the experts are [`expert_of`]'s).
fn table_row(name: &str, family: Family) -> Option<(String, RopeRows)> {
    let qwen = bpe_family(family);
    let extra: &[hf::NamesRow] = if qwen { hf::LLAMA_CPP_QWEN } else { &[] };
    let moe: &[hf::NamesRow] = match family {
        Family::Mixtral => hf::LLAMA_CPP_MIXTRAL,
        Family::Qwen2Moe | Family::Qwen3Moe => hf::LLAMA_CPP_QWEN_MOE,
        _ => &[],
    };
    for &hf::NamesRow {
        other: gguf_name,
        hf: hf_name,
        rope: rows,
    } in hf::LLAMA_CPP.rows.iter().chain(extra).chain(moe)
    {
        let rows = if qwen { RopeRows::AsTheyAre } else { rows };
        match hf_name.split_once("{l}") {
            None if hf_name == name => return Some((gguf_name.to_string(), rows)),
            Some((pre, post)) => {
                let Some(l) = name
                    .strip_prefix(pre)
                    .and_then(|rest| rest.strip_suffix(post))
                else {
                    continue;
                };
                if !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()) {
                    return Some((gguf_name.replace("{l}", l), rows));
                }
            }
            None => {}
        }
    }
    None
}

/// Digits only, as a number.
fn index(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// The experts of a mixture of experts as llama.cpp's converter stacks them: Mixtral's
/// `block_sparse_moe.experts.{e}.w{1,2,3}`, Qwen's `mlp.experts.{e}.{gate,up,down}_proj`.
fn experts_table(family: Family) -> &'static hf::LlamaCppExperts {
    if family == Family::Mixtral {
        &hf::LLAMA_CPP_MIXTRAL_EXPERTS
    } else {
        &hf::LLAMA_CPP_EXPERTS
    }
}

/// A per-expert tensor's layer, expert and place in `table.stacks`
/// (`model.layers.{l}.{module}.{e}.{proj}.weight`).
fn expert_of(name: &str, table: &hf::LlamaCppExperts) -> Option<(u64, u64, usize)> {
    let (l, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let (e, rest) = rest
        .strip_prefix(table.module)?
        .strip_prefix('.')?
        .split_once('.')?;
    let proj = rest.strip_suffix(".weight")?;
    let k = table.stacks.iter().position(|(_, p)| *p == proj)?;
    Some((index(l)?, index(e)?, k))
}

/// The config's keys that name the experts of a layer (the converter's
/// `find_hparam` lists).
const EXPERT_COUNT: [&str; 3] = ["num_local_experts", "num_experts", "n_routed_experts"];
const EXPERT_USED: [&str; 3] = [
    "num_experts_per_tok",
    "num_experts_per_token",
    "top_k_experts",
];

/// The config's value under the first of `keys` present (the converter's
/// `find_hparam`).
fn find<'a>(config: &'a Map<String, Json>, keys: &[&str]) -> Option<&'a Json> {
    keys.iter()
        .find_map(|k| config.get(*k).filter(|v| !v.is_null()))
}

fn u32_of(config: &Map<String, Json>, keys: &[&str]) -> Result<Option<u32>> {
    match find(config, keys) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| {
                unsupported(format!(
                    "config.json: `{}` is {v}, not an unsigned 32-bit integer",
                    keys[0]
                ))
            }),
    }
}

fn f32_of(config: &Map<String, Json>, keys: &[&str]) -> Result<Option<f32>> {
    match find(config, keys) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| unsupported(format!("config.json: `{}` is {v}, not a number", keys[0]))),
    }
}

/// gguf-py's `Metadata.id_to_title`: words split at `-` and spaces, each lower-case
/// word title-cased unless it is a version (`v1.2`) or starts with a digit.
fn id_to_title(id: &str) -> String {
    id.trim()
        .replace('-', " ")
        .split_whitespace()
        .map(|w| {
            let lower = w.chars().any(char::is_lowercase) && !w.chars().any(char::is_uppercase);
            let version = w.starts_with(|c: char| c.is_ascii_digit())
                || (w.starts_with('v')
                    && w.len() > 1
                    && w[1..]
                        .split('.')
                        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())));
            if lower && !version {
                title(w)
            } else {
                w.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Python's `str.title()`: a letter after a non-letter upper-cased, others lower.
fn title(w: &str) -> String {
    let mut out = String::with_capacity(w.len());
    let mut prev_letter = false;
    for c in w.chars() {
        if c.is_alphabetic() {
            if prev_letter {
                out.extend(c.to_lowercase());
            } else {
                out.extend(c.to_uppercase());
            }
            prev_letter = true;
        } else {
            out.push(c);
            prev_letter = false;
        }
    }
    out
}

/// gguf-py's `size_label` of a dense model of `n` parameters (`66K`, `1.2B`).
fn size_label(n: u64) -> String {
    let n = n as f64;
    let (scaled, suffix) = if n > 1e12 {
        (n * 1e-12, "T")
    } else if n > 1e9 {
        (n * 1e-9, "B")
    } else if n > 1e6 {
        (n * 1e-6, "M")
    } else {
        (n * 1e-3, "K")
    };
    // Python's round (half to even) of the scaled count, its digits without leading
    // zeros.
    let rounded = {
        let r = scaled.round();
        if (scaled - scaled.trunc() - 0.5).abs() < f64::EPSILON && r % 2.0 != 0.0 {
            r - 1.0
        } else {
            r
        }
    };
    let digits = format!("{rounded:.0}").trim_start_matches('0').len();
    let fix = 2usize.saturating_sub(digits);
    format!("{scaled:.fix$}{suffix}")
}

/// A tensor under its GGUF name, with its ggml type.
type Named = (String, SourceTensor, GgmlType);

/// A layer's expert tensors by (place in [`hf::LlamaCppExperts::stacks`], expert), with
/// their names.
type LayerExperts = BTreeMap<(usize, u64), (String, SourceTensor)>;

/// A SentencePiece piece: text, score, ggml token type.
type Token = (String, f32, i32);

/// The converter's `_create_vocab_sentencepiece` for `vocab_size` ids: the pieces of
/// `tokenizer.model`, `added_tokens.json` and `tokenizer_config.json`'s
/// `added_tokens_decoder` over them, ids beyond the pieces `[PAD{i}]`.
fn vocab(dir: &Path, vocab_size: usize) -> Result<Vec<Token>> {
    let path = dir.join("tokenizer.model");
    let pieces = crate::formats::gguf::read_sentencepiece(&read_small(&path)?)
        .map_err(|e| e.with_path(&path))?;
    let mut tokens: Vec<Token> = (0..vocab_size)
        .map(|i| (format!("[PAD{i}]"), -10000.0, 5))
        .collect();
    for (i, p) in pieces.into_iter().enumerate().take(vocab_size) {
        tokens[i] = p;
    }
    let added = dir.join("added_tokens.json");
    if added.is_file() {
        let doc: Json = serde_json::from_slice(&read_small(&added)?)
            .map_err(|e| unsupported(format!("{}: not JSON: {e}", added.display())))?;
        for (text, id) in doc.as_object().into_iter().flatten() {
            if let Some(id) = id.as_u64().map(|i| i as usize).filter(|&i| i < vocab_size) {
                tokens[id] = (text.clone(), -1000.0, 4);
            }
        }
    }
    if let Some(config) = tokenizer_config(dir)? {
        let decoder = config.get("added_tokens_decoder").and_then(Json::as_object);
        for (id, data) in decoder.into_iter().flatten() {
            let (Ok(id), Some(text)) = (
                id.parse::<usize>(),
                data.get("content").and_then(Json::as_str),
            ) else {
                continue;
            };
            if id >= vocab_size {
                continue;
            }
            let special =
                data.get("special").and_then(Json::as_bool) == Some(true) || looks_special(text);
            tokens[id] = if special {
                (text.to_string(), -1000.0, 3)
            } else {
                (text.replace('\u{2581}', " "), -1000.0, 4)
            };
        }
    }
    Ok(tokens)
}

/// `tokenizer_config.json` of `dir`, parsed, if there is one.
fn tokenizer_config(dir: &Path) -> Result<Option<Map<String, Json>>> {
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    match serde_json::from_slice(&read_small(&path)?) {
        Ok(Json::Object(m)) => Ok(Some(m)),
        _ => Err(unsupported(format!(
            "{}: not a JSON object",
            path.display()
        ))),
    }
}

/// `tokenizer.json` of `dir`, parsed, if there is one.
fn tokenizer_json(dir: &Path) -> Result<Option<Map<String, Json>>> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    match serde_json::from_slice(&read_small(&path)?) {
        Ok(Json::Object(m)) => Ok(Some(m)),
        _ => Err(unsupported(format!(
            "{}: not a JSON object",
            path.display()
        ))),
    }
}

/// gguf-py's `SpecialVocab` types, in its order.
const SPECIAL_TYPES: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];

/// The key `GGUFWriter.add_{typ}_token_id` writes (`cls` has none: skipped).
fn special_id_key(typ: &str) -> Option<&'static str> {
    Some(match typ {
        "bos" => "tokenizer.ggml.bos_token_id",
        "eos" => "tokenizer.ggml.eos_token_id",
        "unk" => "tokenizer.ggml.unknown_token_id",
        "sep" => "tokenizer.ggml.seperator_token_id",
        "pad" => "tokenizer.ggml.padding_token_id",
        "mask" => "tokenizer.ggml.mask_token_id",
        _ => return None,
    })
}

/// The key `GGUFWriter.add_add_{typ}_token` writes (only these three exist).
fn add_token_key(typ: &str) -> Option<&'static str> {
    Some(match typ {
        "bos" => "tokenizer.ggml.add_bos_token",
        "eos" => "tokenizer.ggml.add_eos_token",
        "sep" => "tokenizer.ggml.add_sep_token",
        _ => return None,
    })
}

/// Sets `typ`'s `add_{typ}_token` as a Python dict assignment does: in its place if
/// already there, else last.
fn set_add<'a>(adds: &mut Vec<(&'a str, bool)>, typ: &'a str, b: bool) {
    match adds.iter_mut().find(|(t, _)| *t == typ) {
        Some(slot) => slot.1 = b,
        None => adds.push((typ, b)),
    }
}

/// gguf-py's `SpecialVocab._try_load_from_tokenizer_json` on a `TemplateProcessing`
/// post-processor (its "crude parsing", followed step by step): a special token first
/// in the single template sets `add_bos_token` (true when it is the config's
/// `bos_token` or `cls_token`, else it becomes them where they are unset), a special
/// token last sets `add_eos_token`, and the pair template's middle sets
/// `add_sep_token`. Llama 3's (`<|begin_of_text|> $A`, pair `<bos> $A <bos>:1 $B:1`)
/// gives add_bos true, add_eos false, add_sep false. A last special token other than
/// the `eos_token` (which gguf-py makes the eos, the old one `eot` or `eom`) is not
/// built: refused, naming both.
fn template_adds(
    p: &Json,
    tok_config: &mut Map<String, Json>,
    adds: &mut Vec<(&str, bool)>,
) -> std::result::Result<(), String> {
    let special = |e: &Json| -> Option<String> {
        e.get("SpecialToken")
            .and_then(|t| t.get("id"))
            .and_then(Json::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    let sequence = |e: &Json| -> Option<String> {
        e.get("Sequence")
            .and_then(|t| t.get("id"))
            .and_then(Json::as_str)
            .map(str::to_string)
    };
    let list = |k: &str| -> Vec<Json> {
        p.get(k)
            .and_then(Json::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (single, pair) = (list("single"), list("pair"));
    // `tokenizer_config.get('<typ>_token')`: the value as written (a string compares
    // equal to a token's id; an AddedToken object never does, as in Python).
    let get = |c: &Map<String, Json>, k: &str| c.get(k).cloned().unwrap_or(Json::Null);
    let truthy = |v: &Json| match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
        Json::Number(n) => n.as_f64() != Some(0.0),
    };
    let has_config = !tok_config.is_empty();
    let mut bos = get(tok_config, "bos_token");
    let mut cls = get(tok_config, "cls_token");
    let mut eos = get(tok_config, "eos_token");
    let sep = get(tok_config, "sep_token");
    let is = |v: &Json, id: &str| v.as_str() == Some(id);
    let mut first = None;
    let mut last = None;
    if single.len() > 1 {
        first = special(&single[0]);
        if let Some(f) = &first {
            if !has_config {
                bos = Json::String(f.clone());
            } else if !is(&bos, f) && !is(&cls, f) {
                if !truthy(&bos) {
                    bos = Json::String(f.clone());
                    tok_config.insert("bos_token".into(), bos.clone());
                }
                if !truthy(&cls) {
                    cls = Json::String(f.clone());
                    tok_config.insert("cls_token".into(), cls.clone());
                }
            }
            set_add(adds, "bos", is(&bos, f) || is(&cls, f));
        }
        last = special(&single[single.len() - 1]);
        if let Some(l) = &last {
            if !has_config {
                eos = Json::String(l.clone());
            } else if !is(&eos, l) {
                return Err(format!(
                    "the TemplateProcessing post-processor ends with {l:?}, not the eos_token {eos} (gguf-py would make it the eos and the old one eot or eom: not built)"
                ));
            }
            set_add(adds, "eos", is(&eos, l));
        }
    }
    if !pair.is_empty() {
        let start = usize::from(first.is_some() && special(&pair[0]) == first);
        let stop = if last.is_some() && special(&pair[pair.len() - 1]) == last {
            pair.len() - 1
        } else {
            pair.len()
        };
        let middle = pair.get(start..stop.max(start)).unwrap_or(&[]);
        if let (Some(a), Some(b)) = (middle.first(), middle.last()) {
            if sequence(a).as_deref() == Some("A")
                && sequence(b).as_deref() == Some("B")
                && middle.len() > 2
            {
                let inner = &middle[1..middle.len() - 1];
                let sep_or_eos = |id: &str| is(&sep, id) || is(&eos, id);
                let mut add_sep = false;
                if let Some(entry) = special(&inner[0]) {
                    if sep_or_eos(&entry) && last.is_none() {
                        add_sep = true;
                    }
                }
                if inner.len() == 2 {
                    if let Some(entry) = special(&inner[1]) {
                        if sep_or_eos(&entry) {
                            add_sep = true;
                        }
                    }
                }
                set_add(adds, "sep", add_sep);
                if add_sep && !truthy(&sep) && has_config {
                    tok_config.insert("sep_token".into(), eos.clone());
                }
            }
        }
    }
    Ok(())
}

/// gguf-py's `SpecialVocab(dir, n_vocab=...)` and its `add_to_gguf` (merges aside): the
/// special ids from `tokenizer_config.json`'s `{typ}_token` (looked up among
/// `tokenizer.json`'s added tokens) then `config.json`'s `{typ}_token_id` (the first found
/// kept; with `n_vocab`, ids below it only), `add_{typ}_token` from `tokenizer.json`'s
/// post-processor then `tokenizer_config.json`, the chat template
/// (`tokenizer_config.json`'s, else `chat_template.jinja`, else `chat_template.json`'s)
/// and the normalizer's lowercase / strip-accents flags, in its order.
fn special_vocab(
    dir: &Path,
    config: &Map<String, Json>,
    tokenizer: Option<&Map<String, Json>>,
    n_vocab: Option<u64>,
) -> Result<Vec<(String, Value)>> {
    let mut ids: Vec<(&str, u64)> = Vec::new();
    let mut adds: Vec<(&str, bool)> = Vec::new();
    let mut lowercase = None;
    let mut strip_accents = None;
    let set_id = |ids: &mut Vec<(&str, u64)>, typ: &'static str, id: Option<&Json>| {
        let Some(id) = id.and_then(Json::as_u64) else {
            return;
        };
        if n_vocab.is_none_or(|n| id < n) && !ids.iter().any(|(t, _)| *t == typ) {
            ids.push((typ, id));
        }
    };
    let mut tok_config = tokenizer_config(dir)?.unwrap_or_default();
    let mut added: &[Json] = &[];
    if let Some(doc) = tokenizer {
        fn normalizer(n: &Json, lower: &mut Option<bool>, strip: &mut Option<bool>) {
            match n.get("type").and_then(Json::as_str) {
                Some("Lowercase") => *lower = Some(true),
                Some("StripAccents") => *strip = Some(true),
                Some("BertNormalizer") => {
                    if let Some(b) = n.get("lowercase").and_then(Json::as_bool) {
                        *lower = Some(b);
                    }
                    if let Some(b) = n.get("strip_accents").and_then(Json::as_bool) {
                        *strip = Some(b);
                    }
                }
                Some("Sequence") => {
                    for m in n
                        .get("normalizers")
                        .and_then(Json::as_array)
                        .into_iter()
                        .flatten()
                    {
                        normalizer(m, lower, strip);
                    }
                }
                _ => {}
            }
        }
        if let Some(n) = doc.get("normalizer") {
            normalizer(n, &mut lowercase, &mut strip_accents);
        }
        added = doc
            .get("added_tokens")
            .and_then(Json::as_array)
            .map_or(&[], Vec::as_slice);
        let present =
            |c: &Map<String, Json>, k: &str| c.get(k).is_some_and(|v| !v.is_null() && v != "");
        for (missing, from) in [("bos_token", "cls_token"), ("eos_token", "sep_token")] {
            if !present(&tok_config, missing) && present(&tok_config, from) {
                let v = tok_config[from].clone();
                tok_config.insert(missing.into(), v);
            }
        }
        if let Some(pp) = doc.get("post_processor").filter(|p| !p.is_null()) {
            let list = pp
                .get("processors")
                .and_then(Json::as_array)
                .map_or_else(|| vec![pp], |l| l.iter().collect());
            for p in list {
                match p.get("type").and_then(Json::as_str) {
                    Some("ByteLevel") => {
                        // `setdefault`
                        for typ in ["bos", "eos"] {
                            if !adds.iter().any(|(t, _)| *t == typ) {
                                adds.push((typ, false));
                            }
                        }
                    }
                    Some("TemplateProcessing") => {
                        template_adds(p, &mut tok_config, &mut adds).map_err(|e| {
                            unsupported(format!("{}: {e}", dir.join("tokenizer.json").display()))
                        })?;
                    }
                    Some(other @ "RobertaProcessing") => {
                        return Err(unsupported(format!(
                            "{}: the {other} post-processor is not built",
                            dir.join("tokenizer.json").display()
                        )));
                    }
                    _ => {}
                }
            }
        }
    }
    let mut chat_template = None;
    if !tok_config.is_empty() {
        chat_template = match tok_config.get("chat_template") {
            Some(Json::String(t)) => Some(t.clone()),
            Some(Json::Null) => None,
            Some(_) => {
                return Err(unsupported(format!(
                    "{}: a list of chat templates is not built",
                    dir.join("tokenizer_config.json").display()
                )))
            }
            None => chat_template_file(dir)?,
        };
        for typ in SPECIAL_TYPES {
            if let Some(b) = tok_config
                .get(&format!("add_{typ}_token"))
                .and_then(Json::as_bool)
            {
                if !adds.iter().any(|(t, _)| *t == typ) {
                    adds.push((typ, b));
                }
            }
            let content = match tok_config.get(&format!("{typ}_token")) {
                Some(Json::String(s)) => Some(s.as_str()),
                Some(Json::Object(m)) => m.get("content").and_then(Json::as_str),
                _ => None,
            };
            if let Some(content) = content {
                let id = added
                    .iter()
                    .find(|a| a.get("content").and_then(Json::as_str) == Some(content))
                    .and_then(|a| a.get("id"));
                set_id(&mut ids, typ, id);
            }
        }
    }
    let text_config = config.get("text_config");
    for typ in SPECIAL_TYPES {
        let key = format!("{typ}_token_id");
        let id = config
            .get(&key)
            .filter(|v| !v.is_null())
            .or_else(|| text_config.and_then(|c| c.get(&key)));
        set_id(&mut ids, typ, id);
    }
    let mut kv = Vec::new();
    for (typ, id) in ids {
        if let Some(key) = special_id_key(typ) {
            kv.push((
                key.to_string(),
                Value::U32(u32::try_from(id).unwrap_or(u32::MAX)),
            ));
        }
    }
    for (typ, b) in adds {
        if let Some(key) = add_token_key(typ) {
            kv.push((key.to_string(), Value::Bool(b)));
        }
    }
    if let Some(t) = chat_template {
        kv.push(("tokenizer.chat_template".into(), Value::Str(t)));
    }
    if let Some(b) = lowercase {
        kv.push(("tokenizer.ggml.normalizer.lowercase".into(), Value::Bool(b)));
    }
    if let Some(b) = strip_accents {
        kv.push((
            "tokenizer.ggml.normalizer.strip_accents".into(),
            Value::Bool(b),
        ));
    }
    Ok(kv)
}

/// `chat_template.jinja`, else `chat_template.json`'s `chat_template`, beside the
/// tokenizer (gguf-py's fallback when `tokenizer_config.json` has none).
fn chat_template_file(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        if dir.join("additional_chat_templates").is_dir() {
            return Err(unsupported(format!(
                "{}: additional chat templates are not built",
                dir.join("additional_chat_templates").display()
            )));
        }
        let bytes = read_small(&jinja)?;
        return String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| unsupported(format!("{}: not UTF-8", jinja.display())));
    }
    let json = dir.join("chat_template.json");
    if json.is_file() {
        return match serde_json::from_slice::<Json>(&read_small(&json)?) {
            Ok(doc) => match doc.get("chat_template") {
                Some(Json::String(t)) => Ok(Some(t.clone())),
                None | Some(Json::Null) => Ok(None),
                Some(_) => Err(unsupported(format!(
                    "{}: a list of chat templates is not built",
                    json.display()
                ))),
            },
            Err(e) => Err(unsupported(format!("{}: not JSON: {e}", json.display()))),
        };
    }
    Ok(None)
}

impl GgufExport {
    /// The model's config, parsed.
    fn config(&self, source: &Checkpoint) -> Result<(PathBuf, Map<String, Json>)> {
        let path = self
            .model
            .user_config
            .clone()
            .or_else(|| source.carried.get("config.json").cloned())
            .ok_or_else(|| {
                unsupported(
                    "the model's Hugging Face config.json is needed (beside the source, or --hf-config)"
                        .into(),
                )
            })?;
        match serde_json::from_slice(&read_small(&path)?) {
            Ok(Json::Object(m)) => Ok((path, m)),
            _ => Err(unsupported(format!(
                "{}: not a JSON object",
                path.display()
            ))),
        }
    }

    /// The directory holding the tokenizer (`--tokenizer`, else the source's own) and
    /// whether the converter reads its byte-level BPE `tokenizer.json` rather than a
    /// SentencePiece `tokenizer.model`. Qwen's converters read `tokenizer.json` only;
    /// `LlamaModel.set_vocab` (Llama, Mistral, Mixtral) reads `tokenizer.model` where
    /// there is one, else `tokenizer.json` (gguf-py's `LlamaHfVocab` refuses Llama 3's,
    /// and any BPE without byte fallback, so it is `_set_vocab_gpt2`'s).
    fn tokenizer_dir(&self, source: &Checkpoint) -> Result<(PathBuf, bool)> {
        let files: &[&str] = if bpe_family(self.model.family) {
            &["tokenizer.json"]
        } else {
            &["tokenizer.model", "tokenizer.json"]
        };
        let found = |dir: &Path| {
            files
                .iter()
                .find(|f| dir.join(f).is_file())
                .map(|f| (dir.to_path_buf(), *f == "tokenizer.json"))
        };
        if let Some(dir) = &self.tokenizer {
            return found(dir).ok_or_else(|| {
                unsupported(if bpe_family(self.model.family) {
                    format!(
                        "--tokenizer {}: no tokenizer.json (the byte-level BPE tokenizer {} ships)",
                        dir.display(),
                        self.model.family.architecture()
                    )
                } else {
                    format!(
                        "--tokenizer {}: no tokenizer.model (a SentencePiece model, as Llama 2 and Mistral ship it) and no tokenizer.json (a byte-level BPE, as Llama 3 ships it)",
                        dir.display()
                    )
                })
            });
        }
        // A trainer's kept tokenizer, else the files beside the model's config or
        // beside the weights (a Hugging Face model directory).
        let mut candidates: Vec<Option<PathBuf>> = files
            .iter()
            .map(|f| source.carried.get(*f).cloned())
            .collect();
        candidates.push(source.carried.get("config.json").cloned());
        candidates.push(source.files.first().map(|f| f.path().to_path_buf()));
        candidates
            .into_iter()
            .flatten()
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .find_map(|d| found(&d))
            .ok_or_else(|| {
                unsupported(format!(
                    "the source has no {} beside it: give the tokenizer's directory with --tokenizer DIR",
                    files.join(" or ")
                ))
            })
    }

    /// Refuses what llama.cpp's converter would not write as built here, by name.
    fn check(&self, config: &Map<String, Json>, path: &Path) -> Result<()> {
        for key in [
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
        ] {
            if find(config, &[key]).is_none() {
                return Err(unsupported(format!(
                    "{}: `{key}` missing (llama.cpp needs it)",
                    path.display()
                )));
            }
        }
        if find(config, &["rms_norm_eps", "norm_eps"]).is_none() {
            return Err(unsupported(format!(
                "{}: `rms_norm_eps` missing (llama.cpp needs it)",
                path.display()
            )));
        }
        if self.model.family.is_moe() {
            self.check_moe(config, path)?;
        }
        let rope = rope_params(config);
        match rope.get("rope_type").and_then(Json::as_str) {
            None | Some("default") | Some("linear") => Ok(()),
            Some(other) => Err(unsupported(format!(
                "{}: rope_type `{other}` is not built (the converter writes extra tensors or keys for it)",
                path.display()
            ))),
        }
    }

    /// Refuses a mixture of experts llama.cpp would not run as transformers does, by
    /// the config's key: experts and top-k are needed (llama.cpp's `qwen3moe` and
    /// `qwen2moe` refuse 0; its `llama` with no experts is a dense model); every layer
    /// has experts (`decoder_sparse_step` 1, no `mlp_only_layers`: llama.cpp loads a
    /// router in every layer); llama.cpp's `qwen3moe` always renormalises the top-k
    /// router weights and `qwen2moe` never does (`build_moe_ffn`'s `norm_w`, true and
    /// false), so `norm_topk_prob` must say the same (transformers' default is false
    /// for both; Mixtral has no such key: transformers' `MixtralTopKRouter` and
    /// llama.cpp's `llama` both renormalise); group routing and other score
    /// functions, which the converter writes keys for, are not built; a tied Qwen2-MoE
    /// head is refused (llama.cpp's qwen2moe needs `output.weight`; its `llama` takes
    /// the embedding when there is none).
    fn check_moe(&self, config: &Map<String, Json>, path: &Path) -> Result<()> {
        let family = self.model.family;
        let bad = |what: String| {
            Err(unsupported(format!(
                "{}: {what} ({} to GGUF is built for llama.cpp's {})",
                path.display(),
                family.architecture(),
                gguf_arch(family).unwrap_or("?")
            )))
        };
        for keys in [&EXPERT_COUNT[..], &EXPERT_USED[..]] {
            if u32_of(config, keys)?.unwrap_or(0) == 0 {
                return bad(format!(
                    "`{}` missing or 0 (llama.cpp needs it)",
                    keys[0..2].join("` / `")
                ));
            }
        }
        if let Some(step) = find(config, &["decoder_sparse_step"]) {
            if step.as_u64() != Some(1) {
                return bad(format!(
                    "`decoder_sparse_step` is {step}: layers without experts are not built (llama.cpp has experts in every layer)"
                ));
            }
        }
        if let Some(l) = find(config, &["mlp_only_layers"]) {
            if l.as_array().is_none_or(|a| !a.is_empty()) {
                return bad(format!(
                    "`mlp_only_layers` is {l}: layers without experts are not built (llama.cpp has experts in every layer)"
                ));
            }
        }
        let norm = find(config, &["norm_topk_prob"])
            .map_or(Some(false), Json::as_bool)
            .unwrap_or(false);
        let wants = family == Family::Qwen3Moe;
        if family != Family::Mixtral && norm != wants {
            return bad(format!(
                "`norm_topk_prob` is {norm}, but llama.cpp's {} {} the top-k router weights",
                gguf_arch(family).unwrap_or("?"),
                if wants {
                    "always renormalises"
                } else {
                    "never renormalises"
                }
            ));
        }
        for key in [
            "n_group",
            "topk_group",
            "score_function",
            "scoring_func",
            "score_func",
            "moe_router_activation",
            "moe_router_activation_func",
            "expert_selection_fn",
        ] {
            if let Some(v) = find(config, &[key]) {
                return bad(format!(
                    "`{key}` ({v}): group routing and router score functions are not built"
                ));
            }
        }
        if family == Family::Qwen2Moe
            && config.get("tie_word_embeddings").and_then(Json::as_bool) == Some(true)
        {
            // llama.cpp's `llama_model_qwen2moe::load_arch_tensors` needs
            // `output.weight`; the converter writes none for a tied head.
            return bad("`tie_word_embeddings` is true: llama.cpp's qwen2moe loads `output.weight`, which the converter does not write for a tied head (the file would not load)".into());
        }
        if family == Family::Qwen2Moe
            && find(config, &["shared_expert_intermediate_size"]).is_none()
        {
            return bad("`shared_expert_intermediate_size` missing (llama.cpp's qwen2moe has a shared expert)".into());
        }
        Ok(())
    }

    /// The key-value pairs, in the converter's order.
    fn kv(
        &self,
        source: &Checkpoint,
        config: &Map<String, Json>,
        label: String,
        out_type: GgmlType,
    ) -> Result<Vec<(String, Value)>> {
        let mut kv: Vec<(String, Value)> = Vec::new();
        let mut put = |k: &str, v: Value| kv.push((k.to_string(), v));
        let family = self.model.family;
        let a = gguf_arch(family).unwrap_or("llama");
        put("general.architecture", Value::Str(a.into()));
        put("general.type", Value::Str("model".into()));
        // The converter names the model after its directory: the config's (the
        // model's directory, or --hf-config's), else the weights'.
        let dir_name = self
            .model
            .user_config
            .as_deref()
            .or_else(|| source.files.first().map(|f| f.path()))
            .and_then(Path::parent)
            .and_then(|d| d.canonicalize().ok())
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into());
        put("general.name", Value::Str(id_to_title(&dir_name)));
        put("general.size_label", Value::Str(label));
        let u = |keys: &[&str]| u32_of(config, keys);
        if let Some(v) = u(&["num_hidden_layers", "n_layers"])? {
            put(&format!("{a}.block_count"), Value::U32(v));
        }
        if let Some(v) = u(&[
            "max_position_embeddings",
            "n_ctx",
            "n_positions",
            "max_length",
            "max_sequence_length",
            "model_max_length",
        ])? {
            put(&format!("{a}.context_length"), Value::U32(v));
        }
        if let Some(v) = u(&["hidden_size", "n_embd", "dim"])? {
            put(&format!("{a}.embedding_length"), Value::U32(v));
        }
        if let Some(v) = u(&[
            "prefix_dense_intermediate_size",
            "dense_intermediate_size",
            "intermediate_size",
            "n_inner",
            "hidden_dim",
        ])? {
            put(&format!("{a}.feed_forward_length"), Value::U32(v));
        }
        if let Some(v) = u(&["num_attention_heads", "n_head", "n_heads"])? {
            put(&format!("{a}.attention.head_count"), Value::U32(v));
        }
        if let Some(v) = u(&["num_key_value_heads", "n_kv_heads"])? {
            put(&format!("{a}.attention.head_count_kv"), Value::U32(v));
        }
        let rope = rope_params(config);
        if rope.get("rope_type").and_then(Json::as_str) == Some("linear") {
            if let Some(f) = rope.get("factor").and_then(Json::as_f64) {
                put(
                    &format!("{a}.rope.scaling.type"),
                    Value::Str("linear".into()),
                );
                put(&format!("{a}.rope.scaling.factor"), Value::F32(f as f32));
            }
        }
        if let Some(theta) = rope.get("rope_theta").and_then(Json::as_f64) {
            put(&format!("{a}.rope.freq_base"), Value::F32(theta as f32));
        }
        if let Some(eps) = f32_of(config, &["rms_norm_eps", "norm_eps"])? {
            put(
                &format!("{a}.attention.layer_norm_rms_epsilon"),
                Value::F32(eps),
            );
        }
        if let Some(v) = u(&EXPERT_COUNT)? {
            put(&format!("{a}.expert_count"), Value::U32(v));
        }
        if let Some(v) = u(&EXPERT_USED)? {
            put(&format!("{a}.expert_used_count"), Value::U32(v));
        }
        let head_dim = u(&["head_dim"])?;
        if let Some(hd) = head_dim {
            put(&format!("{a}.attention.key_length"), Value::U32(hd));
            put(&format!("{a}.attention.value_length"), Value::U32(hd));
        }
        put("general.file_type", Value::U32(out_type.file_type()));
        if matches!(family, Family::Qwen2Moe | Family::Qwen3Moe) {
            // `Qwen2MoeModel.set_gguf_parameters`, after `TextModel`'s.
            if let Some(v) = u(&["moe_intermediate_size"])? {
                put(&format!("{a}.expert_feed_forward_length"), Value::U32(v));
            }
            if let Some(v) = u(&["shared_expert_intermediate_size"])? {
                put(
                    &format!("{a}.expert_shared_feed_forward_length"),
                    Value::U32(v),
                );
            }
        }
        let vocab_size = u(&["vocab_size"])?.unwrap_or(0);
        let (dir, bpe) = self.tokenizer_dir(source)?;
        if bpe_family(family) {
            // `Qwen2Model` is `TextModel`'s keys alone, then `_set_vocab_gpt2`.
            put("general.quantization_version", Value::U32(2));
            return self.bpe_kv(&dir, config, vocab_size, kv);
        }
        put(&format!("{a}.vocab_size"), Value::U32(vocab_size));
        let rope_dim = match head_dim {
            Some(hd) => hd,
            None => {
                let hidden = u(&["hidden_size"])?.unwrap_or(0);
                let heads = u(&["num_attention_heads"])?.unwrap_or(1).max(1);
                hidden / heads
            }
        };
        put(&format!("{a}.rope.dimension_count"), Value::U32(rope_dim));
        put("general.quantization_version", Value::U32(2));
        let tok_config = tokenizer_config(&dir)?.unwrap_or_default();
        // `LlamaModel.set_vocab` adds it before the vocabulary, whichever it is.
        if let Some(b) = tok_config.get("add_prefix_space").and_then(Json::as_bool) {
            put("tokenizer.ggml.add_space_prefix", Value::Bool(b));
        }
        if bpe {
            // No tokenizer.model: `_set_vocab_gpt2` (Llama 3's byte-level BPE).
            return self.bpe_kv(&dir, config, vocab_size, kv);
        }
        // The tokenizer (`_set_vocab_sentencepiece`, `SpecialVocab.add_to_gguf`).
        let tokens = vocab(&dir, vocab_size as usize)?;
        put("tokenizer.ggml.model", Value::Str("llama".into()));
        put("tokenizer.ggml.pre", Value::Str("default".into()));
        let mut texts = Vec::with_capacity(tokens.len());
        let mut scores = Vec::with_capacity(tokens.len());
        let mut types = Vec::with_capacity(tokens.len());
        for (t, s, ty) in tokens {
            texts.push(t);
            scores.push(s);
            types.push(ty);
        }
        put("tokenizer.ggml.tokens", Value::Strings(texts));
        put("tokenizer.ggml.scores", Value::F32s(scores));
        put("tokenizer.ggml.token_type", Value::I32s(types));
        let tokenizer = tokenizer_json(&dir)?;
        kv.extend(special_vocab(
            &dir,
            config,
            tokenizer.as_ref(),
            Some(u64::from(vocab_size)),
        )?);
        Ok(kv)
    }

    /// `_set_vocab_gpt2`: the BPE vocabulary of `dir/tokenizer.json`, its merges and
    /// the special vocabulary, after `kv`.
    fn bpe_kv(
        &self,
        dir: &Path,
        config: &Map<String, Json>,
        vocab_size: u32,
        mut kv: Vec<(String, Value)>,
    ) -> Result<Vec<(String, Value)>> {
        if dir.join("tokenizer.model").is_file() && !self.model.family.is_moe() {
            // `Qwen2Model.set_vocab` tries SentencePiece first (`Qwen2MoeModel`'s,
            // `TextModel`'s, reads tokenizer.json only).
            return Err(unsupported(format!(
                "{}: a SentencePiece tokenizer.model beside a {} (the converter would read it instead of tokenizer.json) is not built",
                dir.display(),
                self.model.family.architecture()
            )));
        }
        let bpe::Bpe { vocab, doc } = bpe::read(dir, vocab_size as usize)?;
        let mut put = |k: &str, v: Value| kv.push((k.to_string(), v));
        put("tokenizer.ggml.model", Value::Str("gpt2".into()));
        put("tokenizer.ggml.pre", Value::Str(vocab.pre.into()));
        put("tokenizer.ggml.tokens", Value::Strings(vocab.tokens));
        put("tokenizer.ggml.token_type", Value::I32s(vocab.types));
        put("tokenizer.ggml.merges", Value::Strings(vocab.merges));
        kv.extend(special_vocab(dir, config, Some(&doc), None)?);
        Ok(kv)
    }

    /// The tensors under GGUF's names in the converter's order (the source's sorted
    /// names; a layer's experts, stacked, where its last expert tensor is), each with
    /// its ggml type (Q8_0 ones already as their blocks), and `general.size_label`.
    fn tensors(
        &self,
        source: &Checkpoint,
        config: &Map<String, Json>,
        out_type: GgmlType,
    ) -> Result<(Vec<Named>, String)> {
        let heads = u32_of(config, &["num_attention_heads"])?.unwrap_or(0);
        let kv_heads = u32_of(config, &["num_key_value_heads"])?.unwrap_or(heads);
        let family = self.model.family;
        let experts = if family.is_moe() {
            u64::from(u32_of(config, &EXPERT_COUNT)?.unwrap_or(0))
        } else {
            0
        };
        let table = experts_table(family);
        let mut out = Vec::new();
        let mut count = Count::default();
        // A layer's expert tensors until it has them all: (proj, expert) -> tensor.
        let mut pending: BTreeMap<u64, LayerExperts> = BTreeMap::new();
        for (name, t) in &source.tensors {
            if DROPPED_SUFFIXES.iter().any(|s| name.ends_with(s)) {
                continue;
            }
            let expert = if experts > 0 {
                expert_of(name, table)
            } else {
                None
            };
            if let Some((l, e, k)) = expert {
                check_dtype(name, t)?;
                if e >= experts {
                    return Err(Error::InvalidTensor {
                        tensor: name.clone(),
                        problem: format!(
                            "is expert {e}, but the config has {experts} (`{}`)",
                            EXPERT_COUNT
                                .iter()
                                .find(|k| find(config, &[**k]).is_some())
                                .unwrap_or(&EXPERT_COUNT[0])
                        ),
                    });
                }
                let layer = pending.entry(l).or_default();
                layer.insert((k, e), (name.clone(), t.clone()));
                if layer.len() as u64 == 3 * experts {
                    // `Qwen2MoeModel.modify_tensors` (`LlamaModel`'s for Mixtral): the
                    // layer's three stacks, now.
                    let mut layer = pending.remove(&l).unwrap_or_default();
                    for (k, (pattern, _)) in table.stacks.iter().enumerate() {
                        let parts: Vec<(String, SourceTensor)> =
                            (0..experts).filter_map(|e| layer.remove(&(k, e))).collect();
                        let gguf_name = pattern.replace("{l}", &l.to_string());
                        let (t, ty) = stack_experts(source, &gguf_name, parts, out_type)?;
                        count.add(&gguf_name, &t.shape);
                        out.push((gguf_name, t, ty));
                    }
                }
                continue;
            }
            let Some((gguf_name, rows)) = table_row(name, family) else {
                return Err(Error::InvalidTensor {
                    tensor: name.clone(),
                    problem: format!(
                        "has no GGUF name for llama.cpp's {} (nothing written)",
                        family.architecture()
                    ),
                });
            };
            check_dtype(name, t)?;
            let t = match rows {
                RopeRows::AsTheyAre => t.clone(),
                RopeRows::Query | RopeRows::Key => {
                    let h = u64::from(if rows == RopeRows::Query {
                        heads
                    } else {
                        kv_heads
                    });
                    let n = t.shape.first().copied().unwrap_or(0);
                    if h == 0 || t.shape.len() != 2 || n % h != 0 || (n / h) % 2 != 0 {
                        return Err(Error::InvalidTensor {
                            tensor: name.clone(),
                            problem: format!(
                                "has shape {:?}: not {h} heads of an even number of rows",
                                t.shape
                            ),
                        });
                    }
                    if t.pieces.iter().any(|p| p.compute.is_some()) {
                        // Computed (a LoRA merge, FP8 dequantized): the rows
                        // permuted by an operation on the computed rows.
                        // `reshape(H, 2, hd / 2, cols).swapaxes(1, 2)` of them.
                        let cols = t.shape[1];
                        let op = Operation::permute(
                            &t.shape,
                            vec![h, 2, n / h / 2, cols],
                            vec![0, 2, 1, 3],
                            t.shape.clone(),
                            None,
                        )?;
                        computed(name, t, op, t.shape.clone(), t.dtype)?
                    } else {
                        // `reshape(H, 2, hd/2, cols).swapaxes(1, 2)`: torchtitan's
                        // interleaved rows are llama.cpp's, a view of the stored rows.
                        t.regather(0, &hf::rope_blocks(h, n / h, false), n)
                    }
                }
            };
            count.add(&gguf_name, &t.shape);
            // The converter's F32 tensors: 1-D, norms, the routers (`FFN_GATE_INP`,
            // `FFN_GATE_INP_SHEXP`).
            let ty = if t.shape.len() <= 1
                || gguf_name.ends_with("_norm.weight")
                || gguf_name.ends_with(".ffn_gate_inp.weight")
                || gguf_name.ends_with(".ffn_gate_inp_shexp.weight")
            {
                GgmlType::F32
            } else {
                matrix_type(out_type, &t.shape)
            };
            let t = if ty == GgmlType::Q8_0 {
                q8_0(&gguf_name, &t)?
            } else {
                t
            };
            out.push((gguf_name, t, ty));
        }
        // `Qwen2MoeModel.prepare_tensors`'s (`LlamaModel`'s) "Unprocessed experts".
        if let Some((l, layer)) = pending.into_iter().next() {
            let (k, e) = (0..experts)
                .flat_map(|e| (0..3).map(move |k| (k, e)))
                .find(|ke| !layer.contains_key(ke))
                .unwrap_or((0, 0));
            return Err(Error::InvalidTensor {
                tensor: format!(
                    "model.layers.{l}.{}.{e}.{}.weight",
                    table.module, table.stacks[k].1
                ),
                problem: format!(
                    "missing: layer {l} has {} of the {} tensors of its {experts} experts (llama.cpp stacks them all)",
                    layer.len(),
                    3 * experts
                ),
            });
        }
        Ok((out, count.label()))
    }
}

/// The ggml type of a matrix of `shape` for `--dtype`: gguf-py's QuantError (rows not
/// of whole Q8_0 blocks) makes the converter fall back to F16.
fn matrix_type(out_type: GgmlType, shape: &[u64]) -> GgmlType {
    if out_type == GgmlType::Q8_0 && shape.last().is_none_or(|c| c % 32 != 0) {
        GgmlType::F16
    } else {
        out_type
    }
}

/// GGUF output reads F32, F16 or BF16 weights.
fn check_dtype(name: &str, t: &SourceTensor) -> Result<()> {
    if matches!(
        t.dtype,
        crate::layout::Dtype::F32 | crate::layout::Dtype::F16 | crate::layout::Dtype::BF16
    ) {
        return Ok(());
    }
    Err(Error::InvalidTensor {
        tensor: name.to_string(),
        problem: format!(
            "is {}: GGUF output reads F32, F16 or BF16 weights",
            crate::layout::strategy::dtype_name(t.dtype)
        ),
    })
}

/// gguf-py's `GGUFWriter.get_total_parameter_count`: every tensor's elements, those of
/// the `_exps.` tensors apart, per expert.
#[derive(Default)]
struct Count {
    total: u64,
    shared: u64,
    expert: u64,
    expert_sum: u64,
    expert_tensors: u64,
}

impl Count {
    fn add(&mut self, name: &str, shape: &[u64]) {
        let size: u64 = shape.iter().product();
        self.total += size;
        if name.contains("_exps.") && shape.len() >= 3 {
            let n = shape[if name.contains(".bias") {
                shape.len() - 2
            } else {
                shape.len() - 3
            }];
            self.expert += size / n.max(1);
            self.expert_sum += n;
            self.expert_tensors += 1;
        } else {
            self.shared += size;
        }
    }

    /// gguf-py's `size_label`: `{experts}x{shared + one expert's}` for a mixture.
    fn label(&self) -> String {
        match self.expert_sum.checked_div(self.expert_tensors) {
            Some(n) if n > 0 => format!("{n}x{}", size_label(self.shared + self.expert)),
            _ => size_label(self.total),
        }
    }
}

/// A layer's per-expert tensors of one projection (`parts`, experts in order) as
/// llama.cpp's `[experts, rows, cols]` tensor and its ggml type: each expert's tensor
/// given a leading axis (its stored bytes through a view, or a computed one computed
/// as `[1, rows, cols]`; as Q8_0 blocks first for `--dtype q8_0`), then stacked
/// ([`SourceTensor::stack`]): the copy reads each expert's bytes where they lie.
fn stack_experts(
    source: &Checkpoint,
    gguf_name: &str,
    parts: Vec<(String, SourceTensor)>,
    out_type: GgmlType,
) -> Result<(SourceTensor, GgmlType)> {
    let Some((first_name, first)) = parts.first() else {
        return Err(Error::InvalidTensor {
            tensor: gguf_name.to_string(),
            problem: "has no experts".into(),
        });
    };
    for (name, t) in &parts {
        if t.shape.len() != 2 || t.shape != first.shape || t.dtype != first.dtype {
            return Err(Error::InvalidTensor {
                tensor: name.clone(),
                problem: format!(
                    "is {} {:?}, {first_name} {} {:?}: llama.cpp stacks the experts' matrices, one shape and dtype",
                    crate::layout::strategy::dtype_name(t.dtype),
                    t.shape,
                    crate::layout::strategy::dtype_name(first.dtype),
                    first.shape
                ),
            });
        }
    }
    let ty = matrix_type(out_type, &first.shape);
    let stored = |f: usize, i: usize| source.stored_shape(f, i).to_vec();
    let mut lifted = Vec::with_capacity(parts.len());
    for (name, t) in parts {
        let t = if ty == GgmlType::Q8_0 {
            q8_0(&name, &t)?
        } else {
            t
        };
        let t = if t.pieces.iter().any(|p| p.compute.is_some()) {
            let mut shape = vec![1];
            shape.extend(&t.shape);
            let op =
                Operation::permute(&t.shape, t.shape.clone(), vec![0, 1], shape.clone(), None)?;
            computed(&name, &t, op, shape, t.dtype)?
        } else {
            t.with_leading_axis(stored)
                .map_err(|problem| Error::InvalidTensor {
                    tensor: name.clone(),
                    problem,
                })?
        };
        lifted.push(t);
    }
    let t = SourceTensor::stack(&lifted).map_err(|problem| Error::InvalidTensor {
        tensor: gguf_name.to_string(),
        problem,
    })?;
    Ok((t, ty))
}

/// The config's rope parameters (`rope_parameters`, transformers 5, or the older
/// `rope_scaling` with a top-level `rope_theta`), as the converter mirrors them.
fn rope_params(config: &Map<String, Json>) -> Map<String, Json> {
    let mut p = config
        .get("rope_parameters")
        .or_else(|| config.get("rope_scaling"))
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    if !p.contains_key("rope_theta") {
        if let Some(t) = config.get("rope_theta") {
            p.insert("rope_theta".into(), t.clone());
        }
    }
    if !p.contains_key("rope_type") {
        if let Some(t) = p.get("type").cloned() {
            p.insert("rope_type".into(), t);
        }
    }
    p
}

/// `t` as Q8_0 blocks: a `U8` `[rows, cols / 32 * 34]` tensor computed from it.
fn q8_0(name: &str, t: &SourceTensor) -> Result<SourceTensor> {
    let [rows, cols] = t.shape[..] else {
        return Err(Error::InvalidTensor {
            tensor: name.to_string(),
            problem: format!("Q8_0 is built for matrices, not shape {:?}", t.shape),
        });
    };
    computed(
        name,
        t,
        Operation::GgmlQ8_0,
        vec![rows, cols / 32 * 34],
        crate::layout::Dtype::U8,
    )
}

/// A tensor of `shape` and `dtype` computed by `op` from the whole of `t`, one piece.
fn computed(
    name: &str,
    t: &SourceTensor,
    op: Operation,
    shape: Vec<u64>,
    dtype: crate::layout::Dtype,
) -> Result<SourceTensor> {
    let Some(first) = t.pieces.first() else {
        return Err(Error::InvalidTensor {
            tensor: name.to_string(),
            problem: "holds no pieces".into(),
        });
    };
    let global = Region::full(&shape);
    let input = ComputeInput {
        name: name.to_string(),
        tensor: t.clone(),
        region: Region::full(&t.shape),
    };
    Ok(SourceTensor {
        dtype,
        shape,
        pieces: vec![SourcePiece {
            file: first.file,
            tensor: first.tensor,
            local: global.clone(),
            global,
            view: None,
            compute: Some(Compute(Arc::new(Computed {
                op,
                inputs: vec![input],
            }))),
        }],
        copies: Vec::new(),
    })
}

impl Writer for GgufExport {
    fn name(&self) -> &'static str {
        "gguf"
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn plan(&self, source: &Checkpoint, _: &Selection) -> Result<CopyPlan> {
        // The family first: its refusal needs no config.
        if gguf_arch(self.model.family).is_none() {
            return Err(unsupported(format!(
                "{} is not built (LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM are)",
                self.model.family.architecture()
            )));
        }
        // A GGUF given another type (a requantization): its own keys, tokenizer
        // included, carried with the new file type, unless a config or tokenizer is
        // given to write them from.
        let carried = match source
            .files
            .iter()
            .find(|f| f.format() == crate::formats::FileFormat::Gguf)
        {
            Some(f) if self.model.user_config.is_none() && self.tokenizer.is_none() => {
                Some(crate::formats::gguf::decode_metadata(f.metadata())?.0)
            }
            _ => None,
        };
        let (path, config) = match carried {
            Some(_) => match serde_json::from_str(&self.model.config_json("float32")?) {
                Ok(Json::Object(m)) => (PathBuf::from("config.json"), m),
                _ => return Err(unsupported("the GGUF's config did not serialise".into())),
            },
            None => self.config(source)?,
        };
        self.check(&config, &path)?;
        let out_type = self.out_type.unwrap_or_else(|| {
            // The converter's `auto`: the first matrix's dtype decides.
            match source
                .tensors
                .values()
                .find(|t| t.shape.len() >= 2)
                .map(|t| t.dtype)
            {
                Some(crate::layout::Dtype::BF16) => GgmlType::BF16,
                _ => GgmlType::F16,
            }
        });
        let (tensors, label) = self.tensors(source, &config, out_type)?;
        let kv = match carried {
            Some(mut kv) => {
                for (k, v) in &mut kv {
                    if k == "general.file_type" {
                        *v = Value::U32(out_type.file_type());
                    }
                }
                kv
            }
            None => self.kv(source, &config, label, out_type)?,
        };
        let mut types = BTreeMap::new();
        let mut sources = BTreeMap::new();
        let mut targets = Vec::with_capacity(tensors.len());
        for (name, t, ty) in tensors {
            if ty == GgmlType::Q8_0 {
                types.insert(name.clone(), ty);
            }
            let full = Region::full(&t.shape);
            targets.push(TargetTensor {
                name: name.clone(),
                dtype: ty.dtype(),
                shape: t.shape.clone(),
                pieces: vec![Piece {
                    global: full.clone(),
                    local: full,
                }],
            });
            sources.insert(name, t);
        }
        let file = TargetFile {
            path: GGUF_FILE.into(),
            tensors: targets,
            metadata: encode_metadata(&kv, &types),
        };
        let view = GgufTensors {
            base: source,
            tensors: sources,
        };
        CopyPlan::build(&view, vec![file])
    }

    fn output_file(&self) -> Option<&'static str> {
        Some(GGUF_FILE)
    }

    fn finish(&self, _: &Checkpoint, _: &Selection, _: &CopyPlan, _: &Path) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_table() {
        assert_eq!(
            table_row("model.layers.12.self_attn.k_proj.weight", Family::Llama),
            Some(("blk.12.attn_k.weight".into(), RopeRows::Key))
        );
        assert_eq!(
            table_row("lm_head.weight", Family::Llama),
            Some(("output.weight".into(), RopeRows::AsTheyAre))
        );
        assert_eq!(
            table_row("model.layers.x.mlp.up_proj.weight", Family::Llama),
            None
        );
        // Qwen: no permutation, its biases and norms named; Llama has none of them.
        assert_eq!(
            table_row("model.layers.3.self_attn.k_proj.weight", Family::Qwen2),
            Some(("blk.3.attn_k.weight".into(), RopeRows::AsTheyAre))
        );
        assert_eq!(
            table_row("model.layers.3.self_attn.q_proj.bias", Family::Qwen2),
            Some(("blk.3.attn_q.bias".into(), RopeRows::AsTheyAre))
        );
        assert_eq!(
            table_row("model.layers.0.self_attn.k_norm.weight", Family::Qwen3),
            Some(("blk.0.attn_k_norm.weight".into(), RopeRows::AsTheyAre))
        );
        assert_eq!(
            table_row("model.layers.3.self_attn.q_proj.bias", Family::Llama),
            None
        );
    }

    #[test]
    fn titles_and_size_labels_as_gguf_py() {
        assert_eq!(id_to_title("base"), "Base");
        assert_eq!(id_to_title("my-model"), "My Model");
        assert_eq!(id_to_title("tiny_llama"), "Tiny_Llama");
        assert_eq!(size_label(65_856), "66K");
        assert_eq!(size_label(1_235_814_400), "1.2B");
        assert_eq!(size_label(8_030_261_248), "8.0B");
        assert_eq!(size_label(124_000_000), "124M");
    }
}

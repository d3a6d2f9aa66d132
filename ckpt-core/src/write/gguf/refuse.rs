//! What the GGUF writer and its tokenizer readers share: the refusal they name, and the
//! converter's rule for tokens that look special (a leaf, so that the writer and
//! `bpe` import it rather than each other).

use crate::error::Error;

/// A `--format gguf` refusal.
pub(super) fn unsupported(problem: String) -> Error {
    Error::Unsupported {
        problem: format!("--format gguf: {problem}"),
    }
}

/// The converter's `does_token_look_special`.
pub(super) fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

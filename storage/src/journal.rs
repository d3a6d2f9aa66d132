//! The journals beside an output being published (`<output>.ckpt-partial/`): what a
//! killed run leaves for the next one to clean up. Written by the publish and by the
//! streamed uploads alike, so neither owns them (docs/storage.md, "Writing").

use crate::location::ObjectUrl;
use object_store::path::Path as Key;

const JOURNAL_WHAT: &str = "ckpt: an output being published; a later ckpt run to this output aborts these uploads and deletes these objects";

/// The journals beside an output (`<output>.ckpt-partial/<writer>.json`): one per
/// process writing it (a single `0.json` for the CLI, one per rank for Python's
/// `save_state_dict`), never under the output's prefix.
pub(crate) fn journal_prefix(url: &ObjectUrl) -> Key {
    Key::from(format!("{}.ckpt-partial", url.key()))
}

pub(crate) fn journal_key(url: &ObjectUrl, writer: u64) -> Key {
    Key::from(format!("{}.ckpt-partial/{writer}.json", url.key()))
}

/// The journal of the `n`th upload `writer` started while writing
/// ([`crate::stream`]).
pub(crate) fn stream_journal_key(url: &ObjectUrl, writer: u64, n: usize) -> Key {
    Key::from(format!(
        "{}.ckpt-partial/{writer}.stream-{n}.json",
        url.key()
    ))
}

/// A journal naming `objects` (key, multipart upload id). `abort_only`: the objects
/// are not being completed yet, so the clean-up aborts the uploads and leaves whatever
/// object has the key (an older output's, with `--force`) alone.
pub(crate) fn journal_text(objects: &[(&str, Option<&str>)], abort_only: bool) -> Vec<u8> {
    serde_json::json!({
        "what": JOURNAL_WHAT,
        "objects": objects.iter().map(|(k, id)| {
            let mut e = serde_json::json!({"key": k, "upload": id});
            if abort_only {
                e["abort_only"] = serde_json::Value::Bool(true);
            }
            e
        }).collect::<Vec<_>>(),
    })
    .to_string()
    .into_bytes()
}

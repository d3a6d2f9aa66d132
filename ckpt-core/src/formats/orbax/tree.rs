//! An Orbax item's `_METADATA`: the pytree's leaves, each one's parameter name (its
//! keys joined with `.`, the zarr array's key prefix) and value type, and the
//! `use_ocdbt` / `use_zarr3` flags that say where and how the arrays are stored
//! (docs/orbax.md, "`_METADATA` (tree metadata)"; orbax-checkpoint 0.12.8,
//! `_src/metadata/tree.py`, `value_metadata_entry.py`, `_src/tree/utils.py`).
//!
//! Restricted: the value types are an allow-list (arrays: `jax.Array`, `np.ndarray`,
//! `scalar`; strings and empty containers are leaves without an array), anything else
//! is a named problem. The `tree_metadata` keys (Python `str(tuple)`) are not parsed:
//! `key_metadata` is.

use serde_json::Value;

/// The tree metadata file of an item directory.
pub(crate) const METADATA_FILE: &str = "_METADATA";

/// Largest `_METADATA` read (a tree of a million leaves is about 250 MB of JSON).
pub(crate) const MAX_METADATA_BYTES: u64 = 512 << 20;

/// The leaves of an item's tree and how its arrays are stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tree {
    /// Every leaf, sorted by name.
    pub(crate) leaves: Vec<Leaf>,
    /// `use_ocdbt`, where recorded (else: whether `manifest.ocdbt` is there).
    pub(crate) use_ocdbt: Option<bool>,
    /// `use_zarr3`, where recorded (else: whichever metadata key the store holds).
    pub(crate) use_zarr3: Option<bool>,
}

/// One leaf of the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Leaf {
    /// Its parameter name: the keys joined with `.`.
    pub(crate) name: String,
    /// What it is.
    pub(crate) kind: LeafKind,
}

/// What a leaf holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeafKind {
    /// A zarr array (`jax.Array`, `np.ndarray`, or a Python `scalar` stored 0-d).
    Array,
    /// A string, kept in `_strings.json` (not a tensor).
    String,
    /// An empty container or `None`: nothing stored.
    Empty,
    /// An array marked `skip_deserialize`: orbax does not restore it.
    Skipped,
}

impl Tree {
    /// The leaves holding arrays.
    pub(crate) fn arrays(&self) -> impl Iterator<Item = &Leaf> {
        self.leaves.iter().filter(|l| l.kind == LeafKind::Array)
    }
}

/// Parses `_METADATA`'s bytes; the problem in words otherwise (the caller names the
/// file).
pub(crate) fn parse(bytes: &[u8]) -> Result<Tree, String> {
    let doc: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("_METADATA is not JSON: {e}"))?;
    let Value::Object(doc) = doc else {
        return Err("_METADATA is not a JSON object".into());
    };
    let Some(tree) = doc.get("tree_metadata") else {
        return Err(
            "_METADATA has no `tree_metadata` (written by an orbax older than ~0.5, whose \
             trees ckpt does not read?)"
                .into(),
        );
    };
    let Value::Object(tree) = tree else {
        return Err("`tree_metadata` is not a JSON object".into());
    };
    let flag = |key: &str| -> Result<Option<bool>, String> {
        match doc.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(format!("`{key}` is {v}, not true or false")),
        }
    };
    let use_ocdbt = flag("use_ocdbt")?;
    let use_zarr3 = flag("use_zarr3")?;
    let mut leaves = Vec::with_capacity(tree.len());
    for (label, entry) in tree {
        leaves.push(leaf(label, entry)?);
    }
    leaves.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = leaves.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(format!(
            "two leaves are both named `{}` (their keys joined with `.`): which array is \
             which cannot be told",
            w[0].name
        ));
    }
    Ok(Tree {
        leaves,
        use_ocdbt,
        use_zarr3,
    })
}

/// One `tree_metadata` entry (`label`: its key, for messages).
fn leaf(label: &str, entry: &Value) -> Result<Leaf, String> {
    let at = || format!("`tree_metadata` entry {label:?}");
    let Value::Object(entry) = entry else {
        return Err(format!("{} is not a JSON object", at()));
    };
    let Some(Value::Array(keys)) = entry.get("key_metadata") else {
        return Err(format!("{} has no `key_metadata` list", at()));
    };
    if keys.is_empty() {
        return Err(format!(
            "{}: the tree's root is a leaf (no keys): ckpt reads trees of named arrays",
            at()
        ));
    }
    let mut parts = Vec::with_capacity(keys.len());
    for k in keys {
        let key = match k.get("key") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) if n.is_u64() || n.is_i64() => n.to_string(),
            _ => {
                return Err(format!(
                    "{}: a key that is not a string or an integer: {k}",
                    at()
                ))
            }
        };
        parts.push(key);
    }
    let name = parts.join(".");
    check_name(&name).map_err(|why| format!("{}: parameter name `{name}` {why}", at()))?;
    let Some(Value::Object(value)) = entry.get("value_metadata") else {
        return Err(format!("leaf `{name}`: no `value_metadata` object"));
    };
    let Some(Value::String(value_type)) = value.get("value_type") else {
        return Err(format!("leaf `{name}`: no `value_type`"));
    };
    let skip = match value.get("skip_deserialize") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(format!("leaf `{name}`: `skip_deserialize` is {v}")),
    };
    let kind = match value_type.as_str() {
        "jax.Array" | "np.ndarray" | "scalar" if skip => LeafKind::Skipped,
        "jax.Array" | "np.ndarray" | "scalar" => LeafKind::Array,
        "string" => LeafKind::String,
        "Dict" | "List" | "Tuple" | "NamedTuple" | "None" => LeafKind::Empty,
        other => {
            return Err(format!(
                "leaf `{name}`: value type `{other}` is not one ckpt reads (arrays: \
                 jax.Array, np.ndarray, scalar; strings and empty containers are passed over)"
            ))
        }
    };
    Ok(Leaf { name, kind })
}

/// Whether a parameter name can be a key prefix and a directory name: not empty, no
/// `/` (orbax does not escape it: the keys of two arrays could then mix), no NUL, and
/// not `.` or `..`.
fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("is empty");
    }
    if name.contains('/') {
        return Err("holds a `/`, which orbax does not escape in its keys");
    }
    if name.contains('\0') {
        return Err("holds a NUL byte");
    }
    if name == "." || name == ".." {
        return Err("is not a directory name");
    }
    Ok(())
}

/// The tree ckpt's dotted `names` form, checked: each name split at `.` into dict keys,
/// none empty or holding what orbax cannot store (see `check_name`), and no name a
/// leaf where another needs a dict (`a` beside `a.b`). Returns the first offending name
/// and why; names need not be sorted.
pub(crate) fn check_tree<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> Result<(), (String, String)> {
    let mut sorted: Vec<&str> = Vec::new();
    for name in names {
        check_name(name).map_err(|why| (name.to_string(), why.to_string()))?;
        if name.split('.').any(str::is_empty) {
            return Err((
                name.to_string(),
                "has an empty key (a `.` at either end or two together): it is no path \
                 of dict keys"
                    .into(),
            ));
        }
        sorted.push(name);
    }
    sorted.sort_unstable();
    // A name that is a leaf and a dict at once: `a` and `a.b`. Every `a.`-prefixed name
    // sorts after `a` and before any name that does not start with `a.` but with `a`
    // followed by a byte above `.`; the first name at or after `a.` settles it.
    for &name in &sorted {
        let dict = format!("{name}.");
        let at = sorted.partition_point(|n| *n < dict.as_str());
        if let Some(inner) = sorted.get(at).filter(|n| n.starts_with(&dict)) {
            return Err((
                name.to_string(),
                format!(
                    "is a leaf of the tree and also holds `{inner}`: orbax's tree cannot \
                     have both (rename one, or leave one out with --exclude)"
                ),
            ));
        }
    }
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err((w[0].to_string(), "appears twice".into()));
    }
    Ok(())
}

/// `_METADATA` for arrays named `names` (valid as [`check_tree`] says), each a dict
/// path, OCDBT and zarr v3. An array without a write shape is stored as orbax stores
/// numpy arrays, `value_type` `np.ndarray` (orbax restores it without a target as a
/// numpy array, and as a `jax.Array` where the restore asks); one with a write shape
/// (each device's box, a sharded item's chunk shape) as orbax stores a `jax.Array`,
/// restored without a target with the sharding `_sharding` gives it. The
/// `tree_metadata` keys are Python's `str` of the key tuple, as orbax writes them
/// (orbax reads `key_metadata`).
pub(crate) fn metadata_json<'a>(
    leaves: impl IntoIterator<Item = (&'a str, Option<&'a [u64]>)>,
) -> String {
    let mut tree = serde_json::Map::new();
    for (name, write_shape) in leaves {
        let keys: Vec<&str> = name.split('.').collect();
        let key_metadata: Vec<Value> = keys
            .iter()
            .map(|k| serde_json::json!({"key": k, "key_type": DICT_KEY}))
            .collect();
        let value = match write_shape {
            None => serde_json::json!({"value_type": "np.ndarray", "skip_deserialize": false}),
            Some(shape) => serde_json::json!({
                "value_type": "jax.Array", "skip_deserialize": false, "write_shape": shape,
            }),
        };
        tree.insert(
            python_tuple(&keys),
            serde_json::json!({"key_metadata": key_metadata, "value_metadata": value}),
        );
    }
    let doc = serde_json::json!({
        "tree_metadata": tree,
        "use_ocdbt": true,
        "use_zarr3": true,
        "store_array_data_equal_to_fill_value": true,
        "custom_metadata": null,
    });
    doc.to_string()
}

/// `key_type` of a dict key (`1` is a sequence index).
const DICT_KEY: u8 = 2;

/// Python's `str()` of a tuple of strings: `('a', 'b')`, `('a',)`.
fn python_tuple(keys: &[&str]) -> String {
    let items: Vec<String> = keys.iter().map(|k| python_repr(k)).collect();
    if items.len() == 1 {
        format!("({},)", items[0])
    } else {
        format!("({})", items.join(", "))
    }
}

/// Python's `repr()` of a string: single quotes unless it holds a `'` and no `"`;
/// backslashes, the quote and control characters escaped.
fn python_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(keys: &str, value: &str) -> String {
        format!(r#""x": {{"key_metadata": {keys}, "value_metadata": {value}}}"#)
    }

    #[test]
    fn names_are_the_keys_joined_with_dots() {
        let doc = r#"{"tree_metadata": {
            "('params', 'w')": {"key_metadata": [{"key": "params", "key_type": 2}, {"key": "w", "key_type": 2}],
                "value_metadata": {"value_type": "jax.Array", "skip_deserialize": false, "write_shape": [4, 8]}},
            "('opt', 0, 'mu')": {"key_metadata": [{"key": "opt", "key_type": 2}, {"key": "0", "key_type": 1}, {"key": "mu", "key_type": 2}],
                "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": false}},
            "('n',)": {"key_metadata": [{"key": 3, "key_type": 1}],
                "value_metadata": {"value_type": "scalar"}},
            "('s',)": {"key_metadata": [{"key": "s", "key_type": 2}],
                "value_metadata": {"value_type": "string", "skip_deserialize": false}},
            "('e',)": {"key_metadata": [{"key": "e", "key_type": 2}],
                "value_metadata": {"value_type": "Dict", "skip_deserialize": true}}},
            "use_ocdbt": true, "use_zarr3": false}"#;
        let t = parse(doc.as_bytes()).unwrap();
        let got: Vec<(&str, LeafKind)> =
            t.leaves.iter().map(|l| (l.name.as_str(), l.kind)).collect();
        assert_eq!(
            got,
            [
                ("3", LeafKind::Array),
                ("e", LeafKind::Empty),
                ("opt.0.mu", LeafKind::Array),
                ("params.w", LeafKind::Array),
                ("s", LeafKind::String),
            ]
        );
        assert_eq!((t.use_ocdbt, t.use_zarr3), (Some(true), Some(false)));
        assert_eq!(t.arrays().count(), 3);
    }

    #[test]
    fn what_is_not_read_is_named() {
        let cases = [
            ("[]", "not a JSON object"),
            ("{}", "no `tree_metadata`"),
            (r#"{"tree_metadata": []}"#, "not a JSON object"),
            (
                &format!(
                    "{{\"tree_metadata\": {{{}}}}}",
                    entry(r#"[{"key": "a"}]"#, r#"{"value_type": "jax.random.key"}"#)
                ),
                "value type `jax.random.key`",
            ),
            (
                &format!(
                    "{{\"tree_metadata\": {{{}}}}}",
                    entry(r#"[{"key": "a/b"}]"#, r#"{"value_type": "jax.Array"}"#)
                ),
                "holds a `/`",
            ),
            (
                &format!(
                    "{{\"tree_metadata\": {{{}}}}}",
                    entry("[]", r#"{"value_type": "jax.Array"}"#)
                ),
                "root is a leaf",
            ),
            (
                &format!(
                    "{{\"tree_metadata\": {{{}}}, \"use_ocdbt\": 1}}",
                    entry(r#"[{"key": "a"}]"#, r#"{"value_type": "jax.Array"}"#)
                ),
                "`use_ocdbt` is 1",
            ),
            (
                r#"{"tree_metadata": {
                    "a": {"key_metadata": [{"key": "a.b"}], "value_metadata": {"value_type": "jax.Array"}},
                    "b": {"key_metadata": [{"key": "a"}, {"key": "b"}], "value_metadata": {"value_type": "jax.Array"}}}}"#,
                "both named `a.b`",
            ),
        ];
        for (doc, want) in cases {
            let e = parse(doc.as_bytes()).unwrap_err();
            assert!(e.contains(want), "{doc}: {e}");
        }
    }

    #[test]
    fn skipped_arrays_are_told_apart() {
        let doc = format!(
            "{{\"tree_metadata\": {{{}}}}}",
            entry(
                r#"[{"key": "a"}]"#,
                r#"{"value_type": "jax.Array", "skip_deserialize": true}"#
            )
        );
        let t = parse(doc.as_bytes()).unwrap();
        assert_eq!(t.leaves[0].kind, LeafKind::Skipped);
        assert_eq!((t.use_ocdbt, t.use_zarr3), (None, None));
    }
    #[test]
    fn names_that_form_a_tree() {
        assert_eq!(check_tree(["a.b", "a.c", "b", "a-x"]), Ok(()));
        let (name, why) = check_tree(["a.b.c", "a.b", "a.bc"]).unwrap_err();
        assert_eq!(name, "a.b");
        assert!(why.contains("a.b.c"), "{why}");
        assert_eq!(check_tree(["a", "a-b", "a.b"]).unwrap_err().0, "a");
        assert_eq!(check_tree(["x..y"]).unwrap_err().0, "x..y");
        assert_eq!(check_tree([".x"]).unwrap_err().0, ".x");
        assert_eq!(check_tree(["a/b"]).unwrap_err().0, "a/b");
        assert_eq!(check_tree(["a", "a"]).unwrap_err().0, "a");
    }

    #[test]
    fn metadata_written_reads_back() {
        let json = metadata_json([
            ("params.w", None),
            ("step", None),
            ("opt.0.mu", Some(&[2u64][..])),
        ]);
        assert!(
            json.contains(r#""value_type":"jax.Array","write_shape":[2]"#),
            "{json}"
        );
        assert!(json.contains(r#""('params', 'w')""#), "{json}");
        assert!(json.contains(r#""('step',)""#), "{json}");
        let t = parse(json.as_bytes()).unwrap();
        let names: Vec<&str> = t.arrays().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["opt.0.mu", "params.w", "step"]);
        assert_eq!((t.use_ocdbt, t.use_zarr3), (Some(true), Some(true)));
    }

    #[test]
    fn python_reprs() {
        assert_eq!(python_repr("a"), "'a'");
        assert_eq!(python_repr("it's"), "\"it's\"");
        assert_eq!(python_repr("a'\"b"), r#"'a\'"b'"#);
        assert_eq!(python_repr("a\\b\n"), r"'a\\b\n'");
        assert_eq!(python_tuple(&["a", "b"]), "('a', 'b')");
    }
}

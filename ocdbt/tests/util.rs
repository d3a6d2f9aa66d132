//! Helpers shared by the test modules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ckpt_ocdbt::Database;

/// `tests/fixtures/orbax/<rel>` of the workspace.
pub(crate) fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/orbax")
        .join(rel)
}

/// `scripts/<name>` of the workspace.
pub(crate) fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A JSON object `{key: hex}` as key bytes -> value bytes.
pub(crate) fn expected(v: &serde_json::Value) -> BTreeMap<Vec<u8>, Vec<u8>> {
    v.as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), unhex(v.as_str().unwrap())))
        .collect()
}

pub(crate) fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Every key and value of `db`, values read, checking the listing is strictly sorted.
pub(crate) fn contents(db: &Database) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let entries = db.list().unwrap();
    for w in entries.windows(2) {
        assert!(w[0].key < w[1].key, "listing not strictly sorted");
    }
    entries
        .into_iter()
        .map(|e| (e.key, e.value.read().unwrap()))
        .collect()
}

/// Copies a directory tree (fixtures are damaged only in copies).
pub(crate) fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

/// The tensors of a safetensors file: name -> (dtype, shape, bytes).
pub(crate) fn safetensors(path: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let data = &b[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let off: Vec<usize> = v["data_offsets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            (
                k.clone(),
                (
                    v["dtype"].as_str().unwrap().to_string(),
                    shape,
                    data[off[0]..off[1]].to_vec(),
                ),
            )
        })
        .collect()
}

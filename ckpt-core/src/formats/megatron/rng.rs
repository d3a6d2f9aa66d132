//! A rank's RNG state, carried from a source rank file into the written one.
//!
//! Megatron-LM saves, per (pipeline, tensor) rank, `rng_state`: a list (one entry, or
//! one per data-parallel rank with `--data-parallel-random-init`) of dicts of Python's,
//! numpy's, torch's CPU and CUDA generator states and the CUDA RNG tracker's states
//! (`get_rng_state`, megatron/training/checkpointing.py). torch's states are byte
//! tensors, so the value refers to storages of its archive by key. ckpt interprets none
//! of it: the value is written back as it was read, its storages renumbered to follow
//! the tensors of the file it goes into.
//!
//! The state belongs to one rank of one TP x PP grid: Megatron's own loader ignores it
//! when the grid changes (load_checkpoint: "(TP, PP) mismatch after resume ...: RNG
//! state will be ignored"), so a caller carries it only into the same grid.

use super::super::map_file;
use super::super::pickle::{Emitter, Value};
use super::super::torch_save::Archive;
use crate::error::{Error, Result};
use std::path::Path;

/// The key of the saved dict that holds the state.
pub(crate) const KEY: &str = "rng_state";

/// One rank's `rng_state` and the bytes of the storages it refers to.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RankRng {
    /// `rng_state` as read, its storage keys renumbered `0..storages.len()` in order of
    /// first reference.
    value: Value,
    /// Storage `j`'s bytes.
    storages: Vec<Vec<u8>>,
}

/// The storage key of a torch persistent id, `("storage", class, key, location,
/// numel)`.
fn storage_key(id: &mut Value) -> Option<&mut String> {
    match id {
        Value::Tuple(items) => match items.as_mut_slice() {
            [Value::Str(kind), _, Value::Str(key), ..] if kind == "storage" => Some(key),
            _ => None,
        },
        _ => None,
    }
}

impl RankRng {
    /// The `rng_state` of rank file `file`, when it has one (`--no-save-rng`: none).
    ///
    /// # Errors
    /// A file that is not a torch.save archive; a storage the state refers to that is
    /// missing; a persistent id that is not a storage.
    pub(crate) fn read(file: &Path) -> Result<Option<RankRng>> {
        let map = map_file(file)?;
        let all: &[u8] = map.as_deref().unwrap_or(&[]);
        let at = |e: Error| e.with_path(file);
        let archive = Archive::open(all).map_err(at)?;
        let Some(mut value) = archive.object().map_err(at)?.get(KEY).cloned() else {
            return Ok(None);
        };
        let mut keys: Vec<String> = Vec::new();
        let mut bad: Option<String> = None;
        value.visit_mut(&mut |v| {
            let Value::PersistentId(id) = v else { return };
            match storage_key(id) {
                Some(key) => {
                    let j = match keys.iter().position(|k| k == key) {
                        Some(j) => j,
                        None => {
                            keys.push(key.clone());
                            keys.len() - 1
                        }
                    };
                    *key = j.to_string();
                }
                None => bad = Some(format!("a persistent id that is not a storage: {id:?}")),
            }
        });
        if let Some(problem) = bad {
            return Err(at(Error::Unsupported {
                problem: format!("`{KEY}` holds {problem}"),
            }));
        }
        let storages = keys
            .iter()
            .map(|k| archive.storage_bytes(k).map(<[u8]>::to_vec))
            .collect::<Result<_>>()
            .map_err(at)?;
        Ok(Some(RankRng { value, storages }))
    }

    /// Pushes `'rng_state': <value>` (a pickle fragment for a dict being filled), its
    /// storages under keys `first_key`, `first_key + 1`, ...
    ///
    /// # Errors
    /// A value the emitter cannot write back.
    pub(crate) fn emit(&self, e: &mut Emitter, first_key: usize) -> Result<()> {
        let mut value = self.value.clone();
        value.visit_mut(&mut |v| {
            if let Value::PersistentId(id) = v {
                if let Some(key) = storage_key(id) {
                    let j: usize = key.parse().unwrap_or(0);
                    *key = (first_key + j).to_string();
                }
            }
        });
        e.str(KEY);
        e.value(&value).map_err(|p| Error::Unsupported {
            problem: format!("the source's `{KEY}` cannot be written back: {p}"),
        })?;
        Ok(())
    }

    /// The storages' bytes, in key order from `first_key`.
    pub(crate) fn storages(&self) -> &[Vec<u8>] {
        &self.storages
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::pickle::parse;

    fn fixture_rank() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/megatron/tp2pp2vp2/legacy/iter_0000001/mp_rank_01_001/model_optim_rng.pt")
    }

    /// The fixture's state (Python's, numpy's and torch's generator states, written by
    /// the fixture script as Megatron-LM's get_rng_state builds them) goes into another
    /// dict with its storages renumbered after that file's tensors, and nothing else
    /// changes.
    #[test]
    fn rng_state_is_written_back_with_storages_renumbered() {
        let rng = RankRng::read(&fixture_rank()).unwrap().unwrap();
        // torch.get_rng_state(): one byte tensor of the CPU generator's 5056 bytes.
        assert_eq!(
            rng.storages().iter().map(Vec::len).collect::<Vec<_>>(),
            vec![5056]
        );
        let mut e = Emitter::new();
        e.empty_dict().mark();
        rng.emit(&mut e, 7).unwrap();
        e.set_items();
        let back = parse(&e.finish()).unwrap();
        let mut value = back.get(KEY).unwrap().clone();
        let mut keys = Vec::new();
        value.visit_mut(&mut |v| {
            if let Value::PersistentId(id) = v {
                let key = storage_key(id).unwrap();
                keys.push(key.clone());
                *key = (key.parse::<usize>().unwrap() - 7).to_string();
            }
        });
        assert_eq!(keys, vec!["7".to_string()]);
        assert_eq!(value, rng.value);
        // The storage's bytes are the archive's own.
        let map = map_file(&fixture_rank()).unwrap();
        let archive = Archive::open(map.as_deref().unwrap()).unwrap();
        let original = archive.object().unwrap();
        let mut key = None;
        original.get(KEY).unwrap().clone().visit_mut(&mut |v| {
            if let Value::PersistentId(id) = v {
                key = storage_key(id).cloned();
            }
        });
        assert_eq!(
            archive.storage_bytes(&key.unwrap()).unwrap(),
            &rng.storages()[0][..]
        );
    }

    /// A rank file saved with `--no-save-rng` has nothing to carry; a file that is not
    /// a torch.save archive is an error naming it.
    #[test]
    fn a_file_without_rng_state_carries_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model_optim_rng.pt");
        let spec = crate::formats::writer::TensorSpec {
            name: "w".into(),
            dtype: crate::layout::Dtype::F32,
            shape: vec![2],
        };
        let w = crate::formats::torch_write::TorchWriter::create(&path, &[spec], false).unwrap();
        w.write_at(0, 0, &[0; 8]).unwrap();
        w.finish().unwrap();
        assert_eq!(RankRng::read(&path).unwrap(), None);
        let other = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/megatron/tp2pp2/full.safetensors");
        let e = RankRng::read(&other).unwrap_err().to_string();
        assert!(e.contains("full.safetensors"), "{e}");
    }
}

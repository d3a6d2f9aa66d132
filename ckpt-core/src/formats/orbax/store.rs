//! Where an Orbax item's zarr keys live: tensorstore's OCDBT database in the item
//! directory (`use_ocdbt=True`, the default: every key listed once, values inline in
//! the B+tree or `(data file, offset, length)`), or one file per key under the item
//! directory (`use_ocdbt=False`). Values are located, never read, except the small
//! ones asked for by [`Store::read_small`] (zarr metadata) and shard indices.

use crate::error::{Error, IoContext, Result};
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An item's key-value store.
#[derive(Debug)]
pub(crate) enum Store {
    /// The OCDBT database of the item directory, listed.
    Ocdbt {
        /// The item directory.
        dir: PathBuf,
        /// Every key and where its value is.
        keys: HashMap<Vec<u8>, ckpt_ocdbt::Value>,
    },
    /// One file per key under the item directory.
    Files {
        /// The item directory.
        dir: PathBuf,
    },
}

/// Where a value's bytes are.
#[derive(Clone, Debug)]
pub(crate) enum Loc {
    /// In memory (an OCDBT value inline in its B+tree leaf), `range` of `bytes`.
    Inline {
        /// The value, or the shard holding it.
        bytes: Arc<[u8]>,
        /// Its bytes there.
        start: u64,
        /// Its length.
        len: u64,
    },
    /// `len` bytes at `offset` of a file.
    File {
        /// The file (an OCDBT data file, or a chunk's own file).
        path: PathBuf,
        /// Where the value starts.
        offset: u64,
        /// Its length.
        len: u64,
    },
}

impl Loc {
    /// The value's length.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Loc::Inline { len, .. } | Loc::File { len, .. } => *len,
        }
    }

    /// Bytes `[at, at + n)` of the value (the caller keeps them inside it).
    pub(crate) fn sub(&self, at: u64, n: u64) -> Loc {
        match self {
            Loc::Inline { bytes, start, .. } => Loc::Inline {
                bytes: bytes.clone(),
                start: start + at,
                len: n,
            },
            Loc::File { path, offset, .. } => Loc::File {
                path: path.clone(),
                offset: offset + at,
                len: n,
            },
        }
    }

    /// Reads bytes `[at, at + out.len())` of the value.
    pub(crate) fn read_at(&self, at: u64, out: &mut [u8]) -> Result<()> {
        let n = out.len() as u64;
        let inside = at.checked_add(n).is_some_and(|end| end <= self.len());
        match self {
            Loc::Inline { bytes, start, .. } if inside => {
                let s = (start + at) as usize;
                out.copy_from_slice(&bytes[s..s + out.len()]);
                Ok(())
            }
            Loc::File { path, offset, .. } if inside => {
                let f = crate::formats::open_handle(path)?;
                f.read_exact_at(out, offset + at).at(path)
            }
            _ => Err(crate::error::overflow(format!(
                "{}: bytes {at}..+{n} of a value of {}",
                self.shown(),
                self.len()
            ))),
        }
    }

    /// A reader of the whole value, from its start.
    pub(crate) fn reader(&self) -> Result<Box<dyn std::io::Read + Send>> {
        Ok(match self {
            Loc::Inline { bytes, start, len } => Box::new(std::io::Cursor::new(Slice {
                bytes: bytes.clone(),
                start: *start as usize,
                end: (start + len) as usize,
            })),
            Loc::File { path, offset, len } => {
                use std::io::{Read, Seek, SeekFrom};
                let mut f = crate::formats::open_handle(path)?;
                f.seek(SeekFrom::Start(*offset)).at(path)?;
                Box::new(f.take(*len))
            }
        })
    }

    /// The file holding the value, for messages (`None` for an inline value).
    pub(crate) fn file(&self) -> Option<&Path> {
        match self {
            Loc::Inline { .. } => None,
            Loc::File { path, .. } => Some(path),
        }
    }

    /// Where the value is, in words.
    pub(crate) fn shown(&self) -> String {
        match self {
            Loc::Inline { .. } => "inline in the OCDBT B+tree".into(),
            Loc::File { path, offset, len } => {
                format!("{} bytes {offset}..+{len}", path.display())
            }
        }
    }
}

/// A value the item's B+tree points to that is not there, named by its array (the
/// key's part before its first `/`) and its data file: a per-process directory
/// missing (orbax's merged `manifest.ocdbt` holds the keys, the values stay in the
/// `ocdbt.process_<i>/` each process wrote), or a data file shorter than the tree
/// says (truncated). Other database errors as they are.
fn value_error(dir: &Path, e: ckpt_ocdbt::Error) -> Error {
    let ckpt_ocdbt::Error::Value { key, source } = &e else {
        return e.into();
    };
    let array = key.split('/').next().unwrap_or(key);
    let file = e.path().to_path_buf();
    let why = match &**source {
        ckpt_ocdbt::Error::Io { source: io, .. } if io.kind() == std::io::ErrorKind::NotFound => {
            // The first directory of the file's path under the item that is missing.
            let gone = file
                .strip_prefix(dir)
                .ok()
                .and_then(|rel| rel.components().next())
                .map(|c| dir.join(c))
                .filter(|top| top != &file && !top.exists());
            match gone {
                Some(top) => format!(
                    "its data file is missing: the directory {}/, which holds the part of \
                     the save that process wrote, is not there (the item's manifest.ocdbt \
                     only points into the per-process databases: copy the item directory \
                     whole)",
                    top.file_name().unwrap_or_default().to_string_lossy()
                ),
                None => "its data file is missing".to_string(),
            }
        }
        ckpt_ocdbt::Error::OutOfFile {
            offset,
            len,
            file_len,
            ..
        } => format!(
            "its value is bytes {offset}..+{len} of the data file, which has {file_len}: \
             the file is truncated"
        ),
        other => other.to_string(),
    };
    Error::InvalidOrbax {
        path: file,
        problem: format!("array `{array}` (zarr key `{key}`): {why}"),
    }
}

/// Part of a shared buffer, as a reader's source.
struct Slice {
    bytes: Arc<[u8]>,
    start: usize,
    end: usize,
}

impl AsRef<[u8]> for Slice {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[self.start..self.end]
    }
}

impl Store {
    /// The item directory's OCDBT database, listed.
    ///
    /// # Errors
    /// What `ckpt-ocdbt` finds wrong, naming the file and object.
    pub(crate) fn ocdbt(dir: &Path) -> Result<Store> {
        let db = ckpt_ocdbt::Database::open(dir)?;
        let keys = db
            .list()
            .map_err(|e| value_error(dir, e))?
            .into_iter()
            .map(|e| (e.key, e.value))
            .collect();
        Ok(Store::Ocdbt {
            dir: dir.to_path_buf(),
            keys,
        })
    }

    /// The keys as files under the item directory.
    pub(crate) fn files(dir: &Path) -> Store {
        Store::Files {
            dir: dir.to_path_buf(),
        }
    }

    /// Whether the store is the OCDBT database.
    pub(crate) fn is_ocdbt(&self) -> bool {
        matches!(self, Store::Ocdbt { .. })
    }

    /// Where `key`'s value is; `None` where the key is absent. (Keys are the
    /// parameter name, checked to hold no `/` and not be `.`/`..`, then `/` and the
    /// zarr key: as a path they stay under the item directory.)
    pub(crate) fn find(&self, key: &str) -> Result<Option<Loc>> {
        match self {
            Store::Ocdbt { keys, .. } => Ok(keys.get(key.as_bytes()).map(|v| match v {
                ckpt_ocdbt::Value::Inline(b) => Loc::Inline {
                    len: b.len() as u64,
                    bytes: Arc::from(b.as_slice()),
                    start: 0,
                },
                ckpt_ocdbt::Value::Stored { path, offset, len } => Loc::File {
                    path: path.clone(),
                    offset: *offset,
                    len: *len,
                },
            })),
            Store::Files { dir } => {
                let path = dir.join(key);
                match std::fs::metadata(&path) {
                    Ok(m) if m.is_file() => Ok(Some(Loc::File {
                        // (An object of a bucket not yet fetched: its size; it is
                        // downloaded when read.)
                        len: crate::formats::file_len(&path)?,
                        path,
                        offset: 0,
                    })),
                    Ok(_) => Ok(None),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::Io { path, source: e }),
                }
            }
        }
    }

    /// The whole value of `key` when it is at most `max` bytes; `None` where absent.
    ///
    /// # Errors
    /// A value over `max` bytes (named); I/O errors.
    pub(crate) fn read_small(&self, key: &str, max: u64) -> Result<Option<Vec<u8>>> {
        let Some(loc) = self.find(key)? else {
            return Ok(None);
        };
        if loc.len() > max {
            return Err(Error::InvalidOrbax {
                path: self.path_of(key, &loc),
                problem: format!(
                    "`{key}` is {} bytes, more than the {max} its kind of value may have",
                    loc.len()
                ),
            });
        }
        let mut out = vec![0; loc.len() as usize];
        loc.read_at(0, &mut out)?;
        Ok(Some(out))
    }

    /// The file messages about `key` name: its own file, or the data file holding it,
    /// or (inline) the database's manifest.
    pub(crate) fn path_of(&self, key: &str, loc: &Loc) -> PathBuf {
        match (self, loc.file()) {
            (_, Some(p)) => p.to_path_buf(),
            (Store::Ocdbt { dir, .. }, None) => dir.join("manifest.ocdbt"),
            (Store::Files { dir }, None) => dir.join(key),
        }
    }

    /// The item directory.
    pub(crate) fn dir(&self) -> &Path {
        match self {
            Store::Ocdbt { dir, .. } | Store::Files { dir } => dir,
        }
    }
}

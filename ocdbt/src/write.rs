//! Writing a new database (one generation) into an empty directory.
//!
//! The layout is the one tensorstore produces for a single commit, and the one
//! docs/orbax.md describes for writers: one data file `d/<32 hex>` holding the
//! out-of-line values first, then the B+tree nodes (leaves, then each interior level,
//! the root last); then `manifest.ocdbt`, written last (through a temporary name), so
//! a directory without a manifest is recognisably unfinished.

use std::collections::hash_map::RandomState;
use std::fs::{self, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::btree::{self, ValueOut, MAX_ARITY, MAX_INLINE, MAX_KEY};
use crate::codec::{seal_envelope, Compression};
use crate::data_file_table::{common_prefix, DataFile};
use crate::error::{io, show_key, Error, ObjectKind, Result};
use crate::manifest::{self, Config, ZSTD_LEVELS};
use crate::read::MANIFEST;
use crate::reference::{check_end, Ref, Stats};
use crate::version_tree::Version;

/// tensorstore's estimate of a leaf entry's decoded size beyond its key and value
/// (`kLeafNodeFixedSize`), and of an out-of-line value's reference (offset, length).
const LEAF_FIXED: u64 = 16;
const INDIRECT_FIXED: u64 = 16;
/// The same for an interior entry (`kInteriorNodeFixedSize`: key, offset, length,
/// statistics).
const INTERIOR_FIXED: u64 = 56;

/// How a [`Writer`] lays out the database. The defaults are orbax's: values up to
/// 1024 bytes inline, nodes aimed at 100000000 bytes, zstd level 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterOptions {
    max_inline_value_bytes: u32,
    max_decoded_node_bytes: u32,
    compression: Compression,
}

impl Default for WriterOptions {
    fn default() -> WriterOptions {
        WriterOptions {
            max_inline_value_bytes: 1024,
            max_decoded_node_bytes: 100_000_000,
            compression: Compression::Zstd { level: 0 },
        }
    }
}

impl WriterOptions {
    /// Orbax's options.
    pub fn new() -> WriterOptions {
        WriterOptions::default()
    }

    /// Values up to `n` bytes (at most 1 MiB) are stored inside the leaves, larger ones
    /// in the data file.
    #[must_use]
    pub fn max_inline_value_bytes(mut self, n: u32) -> WriterOptions {
        self.max_inline_value_bytes = n;
        self
    }

    /// Leaves and interior nodes are split to keep each under `n` bytes of
    /// tensorstore's estimate of its decoded size (a node of one entry, two in interior
    /// nodes, may exceed it); 0 for no bound.
    #[must_use]
    pub fn max_decoded_node_bytes(mut self, n: u32) -> WriterOptions {
        self.max_decoded_node_bytes = n;
        self
    }

    /// How nodes and the manifest are stored.
    #[must_use]
    pub fn compression(mut self, c: Compression) -> WriterOptions {
        self.compression = c;
        self
    }

    fn check(&self, dir: &Path) -> Result<()> {
        if u64::from(self.max_inline_value_bytes) > MAX_INLINE {
            return Err(Error::BadOption {
                path: dir.to_path_buf(),
                option: "max_inline_value_bytes",
                value: i64::from(self.max_inline_value_bytes),
                why: "at most 1048576 (1 MiB), the format's largest inline value",
            });
        }
        if let Compression::Zstd { level } = self.compression {
            if !ZSTD_LEVELS.contains(&level) {
                return Err(Error::BadOption {
                    path: dir.to_path_buf(),
                    option: "zstd level",
                    value: i64::from(level),
                    why: "zstd's levels are -131072..=22",
                });
            }
        }
        Ok(())
    }
}

/// Bytes of the data file set aside for one value by [`Writer::reserve`]: the caller
/// writes `len` bytes at `offset` of `path` (with its own handle, from any thread)
/// before calling [`Writer::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The data file.
    pub path: PathBuf,
    /// Where the value goes.
    pub offset: u64,
    /// Its length.
    pub len: u64,
}

/// What [`Writer::finish`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteSummary {
    /// Keys written.
    pub keys: u64,
    /// Height of the B+tree's root (0: a single leaf).
    pub height: u8,
    /// B+tree nodes written.
    pub nodes: u64,
    /// The data file, or `None` for a database without keys (which has none).
    pub data_file: Option<PathBuf>,
    /// Its size: values, then nodes.
    pub data_file_len: u64,
}

enum Pending {
    Inline(Vec<u8>),
    Stored { offset: u64, len: u64 },
}

/// Writes a new database from `(key, value)` pairs given in any order.
///
/// ```no_run
/// # fn main() -> ckpt_ocdbt::Result<()> {
/// use ckpt_ocdbt::{Writer, WriterOptions};
/// let mut w = Writer::create("out/items".as_ref(), WriterOptions::new())?;
/// w.put(b"step/.zarray", br#"{"zarr_format":2}"#)?;
/// let r = w.reserve(b"params.w/0.0", 4096)?;
/// // ... the caller writes 4096 bytes at r.offset of r.path ...
/// w.finish()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Writer {
    dir: PathBuf,
    options: WriterOptions,
    /// `d/<32 hex>`, relative to `dir`.
    data_relative: String,
    data_path: PathBuf,
    data: File,
    /// End of the values written or reserved so far.
    end: u64,
    entries: Vec<(Vec<u8>, Pending)>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pending::Inline(b) => write!(f, "Inline({} bytes)", b.len()),
            Pending::Stored { offset, len } => write!(f, "Stored({offset}, {len})"),
        }
    }
}

impl Writer {
    /// Starts a database in `dir`, which must be empty or not exist (it is created).
    ///
    /// # Errors
    ///
    /// [`Error::NotEmpty`], [`Error::BadOption`], [`Error::Io`].
    pub fn create(dir: &Path, options: WriterOptions) -> Result<Writer> {
        options.check(dir)?;
        match fs::read_dir(dir) {
            Ok(mut it) => {
                if it.next().is_some() {
                    return Err(Error::NotEmpty {
                        path: dir.to_path_buf(),
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::create_dir_all(dir).map_err(io(dir))?;
            }
            Err(e) => return Err(io(dir)(e)),
        }
        let d = dir.join("d");
        fs::create_dir(&d).map_err(io(&d))?;
        let data_relative = format!("d/{}", random_hex());
        let data_path = dir.join(&data_relative);
        let data = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&data_path)
            .map_err(io(&data_path))?;
        Ok(Writer {
            dir: dir.to_path_buf(),
            options,
            data_relative,
            data_path,
            data,
            end: 0,
            entries: Vec::new(),
        })
    }

    /// The data file values go to.
    pub fn data_file(&self) -> &Path {
        &self.data_path
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        if key.len() > MAX_KEY {
            return Err(Error::KeyTooLong {
                path: self.dir.clone(),
                key: show_key(key),
                len: key.len(),
            });
        }
        Ok(())
    }

    /// Sets `len` more bytes of the data file aside, returning where they start.
    fn allot(&mut self, len: u64) -> Result<u64> {
        let offset = self.end;
        let overflow = || Error::Overflow {
            path: self.data_path.clone(),
            what: "data file size",
        };
        let end = offset.checked_add(len).ok_or_else(overflow)?;
        check_end(offset, len).map_err(|_| overflow())?;
        self.end = end;
        Ok(offset)
    }

    /// Adds `key` with `value`: inline if it is at most `max_inline_value_bytes`, else
    /// appended to the data file now.
    ///
    /// # Errors
    ///
    /// [`Error::KeyTooLong`], [`Error::Overflow`], [`Error::Io`]. A duplicate key is
    /// reported by [`Writer::finish`].
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.check_key(key)?;
        let pending = if value.len() as u64 <= u64::from(self.options.max_inline_value_bytes) {
            Pending::Inline(value.to_vec())
        } else {
            let len = value.len() as u64;
            let offset = self.allot(len)?;
            let p = &self.data_path;
            self.data.seek(SeekFrom::Start(offset)).map_err(io(p))?;
            self.data.write_all(value).map_err(io(p))?;
            Pending::Stored { offset, len }
        };
        self.entries.push((key.to_vec(), pending));
        Ok(())
    }

    /// Adds `key` with a value of `len` bytes that the caller writes into the data file
    /// at the returned place (always out-of-line, whatever its size). Bytes the caller
    /// leaves unwritten read as zeros.
    ///
    /// # Errors
    ///
    /// [`Error::KeyTooLong`], [`Error::Overflow`].
    pub fn reserve(&mut self, key: &[u8], len: u64) -> Result<Reservation> {
        self.check_key(key)?;
        let offset = self.allot(len)?;
        self.entries
            .push((key.to_vec(), Pending::Stored { offset, len }));
        Ok(Reservation {
            path: self.data_path.clone(),
            offset,
            len,
        })
    }

    /// Writes the B+tree and the manifest, and syncs them.
    ///
    /// # Errors
    ///
    /// [`Error::DuplicateKey`], [`Error::Io`], [`Error::Overflow`].
    pub fn finish(mut self) -> Result<WriteSummary> {
        self.entries.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = self.entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::DuplicateKey {
                path: self.dir.clone(),
                key: show_key(&w[0].0),
            });
        }
        let p = self.data_path.clone();
        // Reserved bytes at the end that the caller did not write become zeros, and the
        // nodes follow all values.
        self.data.set_len(self.end).map_err(io(&p))?;
        self.data.seek(SeekFrom::Start(self.end)).map_err(io(&p))?;
        let file = DataFile {
            base: Vec::new(),
            relative: self.data_relative.clone().into_bytes(),
        };
        let (version, table_file, summary) = if self.entries.is_empty() {
            drop(self.data);
            fs::remove_file(&p).map_err(io(&p))?;
            let d = self.dir.join("d");
            fs::remove_dir(&d).map_err(io(&d))?;
            // The empty tree: a "missing" root, whose id indexes a table entry all the
            // same (tensorstore's is an empty path).
            let root = Version {
                generation: 1,
                root_height: 0,
                root: Ref {
                    file: 0,
                    offset: u64::MAX,
                    length: u64::MAX,
                },
                stats: Stats::default(),
                commit_time: now_ns(),
            };
            let summary = WriteSummary {
                keys: 0,
                height: 0,
                nodes: 0,
                data_file: None,
                data_file_len: 0,
            };
            let empty = DataFile {
                base: Vec::new(),
                relative: Vec::new(),
            };
            (root, empty, summary)
        } else {
            let mut tree = TreeWriter {
                options: &self.options,
                file: &file,
                out: &mut self.data,
                path: &p,
                pos: self.end,
                nodes: 0,
            };
            let (root, height) = tree.write(&self.entries)?;
            let nodes = tree.nodes;
            let len = tree.pos;
            self.data.sync_all().map_err(io(&p))?;
            let version = Version {
                generation: 1,
                root_height: height,
                root: root.location,
                stats: root.stats,
                commit_time: now_ns(),
            };
            let summary = WriteSummary {
                keys: self.entries.len() as u64,
                height,
                nodes,
                data_file: Some(p.clone()),
                data_file_len: len,
            };
            (version, file.clone(), summary)
        };
        let config = Config {
            uuid: random_bytes(),
            max_inline_value_bytes: self.options.max_inline_value_bytes,
            max_decoded_node_bytes: self.options.max_decoded_node_bytes,
            version_tree_arity_log2: 4,
            compression: self.options.compression,
        };
        let bytes = manifest::encode(&config, &[table_file], &[version]).map_err(io(&p))?;
        let tmp = self.dir.join(format!("{MANIFEST}.tmp"));
        let dest = self.dir.join(MANIFEST);
        {
            let mut f = File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(&bytes).map_err(io(&tmp))?;
            f.sync_all().map_err(io(&tmp))?;
        }
        fs::rename(&tmp, &dest).map_err(io(&dest))?;
        // The rename is durable once the directory is synced (where directories can be
        // opened: not on every platform).
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(summary)
    }
}

/// A node written: its location, its subtree's statistics, its first key (full), and
/// the length of the key prefix all its keys share (omitted from the node).
struct Written {
    location: Ref,
    stats: Stats,
    first_key: Vec<u8>,
    prefix: usize,
}

/// Writes the B+tree levels of one commit into the data file.
struct TreeWriter<'a> {
    options: &'a WriterOptions,
    file: &'a DataFile,
    out: &'a mut File,
    path: &'a Path,
    pos: u64,
    nodes: u64,
}

impl TreeWriter<'_> {
    /// Writes the leaves and the levels above them; returns the root and its height.
    fn write(&mut self, entries: &[(Vec<u8>, Pending)]) -> Result<(Written, u8)> {
        let file_len = self.file.path().len() as u64;
        let sizes: Vec<u64> = entries
            .iter()
            .map(|(k, v)| {
                k.len() as u64
                    + LEAF_FIXED
                    + match v {
                        Pending::Inline(b) => b.len() as u64,
                        Pending::Stored { .. } => INDIRECT_FIXED + file_len,
                    }
            })
            .collect();
        let groups = self.split(&sizes, 1);
        let root_level = groups.len() == 1;
        let mut level = Vec::with_capacity(groups.len());
        for g in groups {
            level.push(self.leaf(&entries[g], root_level)?);
        }
        let mut height = 0u8;
        while level.len() > 1 {
            height = height.checked_add(1).ok_or_else(|| Error::Overflow {
                path: self.path.to_path_buf(),
                what: "B+tree height",
            })?;
            let sizes: Vec<u64> = level
                .iter()
                .map(|w| w.first_key.len() as u64 + INTERIOR_FIXED + file_len)
                .collect();
            let groups = self.split(&sizes, 2);
            let root_level = groups.len() == 1;
            let mut next = Vec::with_capacity(groups.len());
            for g in groups {
                next.push(self.interior(height, &level[g], root_level)?);
            }
            level = next;
        }
        let root = level.pop().expect("one node");
        Ok((root, height))
    }

    /// Cuts entries of estimated `sizes` into consecutive nodes, each under
    /// `max_decoded_node_bytes` unless it has fewer than `min_arity` entries, and at most
    /// 2^20 entries. Every node but the last has at least `min_arity` entries, so each
    /// interior level is at most about half the one below and the tree ends.
    fn split(&self, sizes: &[u64], min_arity: usize) -> Vec<std::ops::Range<usize>> {
        let max = match self.options.max_decoded_node_bytes {
            0 => u64::MAX,
            n => u64::from(n),
        };
        let mut groups = Vec::new();
        let (mut start, mut total) = (0usize, 0u64);
        for (i, &s) in sizes.iter().enumerate() {
            let n = i - start;
            let full = n as u64 >= MAX_ARITY || (n >= min_arity && total.saturating_add(s) > max);
            if full {
                groups.push(start..i);
                start = i;
                total = 0;
            }
            total = total.saturating_add(s);
        }
        groups.push(start..sizes.len());
        groups
    }

    /// Appends one encoded node to the data file.
    fn append(&mut self, body: &[u8]) -> Result<Ref> {
        let sealed = seal_envelope(ObjectKind::BtreeNode, body, self.options.compression)
            .map_err(io(self.path))?;
        self.out.write_all(&sealed).map_err(io(self.path))?;
        let r = Ref {
            file: 0,
            offset: self.pos,
            length: sealed.len() as u64,
        };
        self.pos = self
            .pos
            .checked_add(r.length)
            .filter(|&end| check_end(0, end).is_ok())
            .ok_or_else(|| Error::Overflow {
                path: self.path.to_path_buf(),
                what: "data file size",
            })?;
        self.nodes += 1;
        Ok(r)
    }

    fn leaf(&mut self, entries: &[(Vec<u8>, Pending)], root: bool) -> Result<Written> {
        let first = &entries[0].0;
        let last = &entries[entries.len() - 1].0;
        // The root's keys are whole; another node's omit what all its keys share, which
        // its parent's entry records as the subtree common prefix.
        let prefix = if root { 0 } else { common_prefix(first, last) };
        let keys: Vec<&[u8]> = entries.iter().map(|(k, _)| &k[prefix..]).collect();
        let mut indirect = 0u64;
        let values: Vec<ValueOut<'_>> = entries
            .iter()
            .map(|(_, v)| match v {
                Pending::Inline(b) => ValueOut::Inline(b),
                Pending::Stored { offset, len } => {
                    indirect = indirect.saturating_add(*len);
                    ValueOut::Indirect {
                        offset: *offset,
                        length: *len,
                    }
                }
            })
            .collect();
        // A table only when something refers to the file, as tensorstore's builder.
        let files: &[DataFile] = if values
            .iter()
            .any(|v| matches!(v, ValueOut::Indirect { .. }))
        {
            std::slice::from_ref(self.file)
        } else {
            &[]
        };
        let body = btree::encode_leaf(files, &keys, &values);
        let location = self.append(&body)?;
        Ok(Written {
            stats: Stats {
                num_keys: entries.len() as u64,
                num_tree_bytes: location.length,
                num_indirect_value_bytes: indirect,
            },
            location,
            first_key: first.clone(),
            prefix,
        })
    }

    fn interior(&mut self, height: u8, children: &[Written], root: bool) -> Result<Written> {
        let first = &children[0].first_key;
        let last = &children[children.len() - 1].first_key;
        // A node's prefix must be a prefix of each child's, as a child's keys are read
        // relative to its parent's prefix extended by the entry's common prefix.
        let prefix = if root {
            0
        } else {
            children
                .iter()
                .map(|c| c.prefix)
                .min()
                .unwrap_or(0)
                .min(common_prefix(first, last))
        };
        let keys: Vec<&[u8]> = children.iter().map(|c| &c.first_key[prefix..]).collect();
        let scp: Vec<usize> = children.iter().map(|c| c.prefix - prefix).collect();
        let refs: Vec<Ref> = children.iter().map(|c| c.location).collect();
        let stats: Vec<Stats> = children.iter().map(|c| c.stats).collect();
        let body = btree::encode_interior(
            height,
            std::slice::from_ref(self.file),
            &keys,
            &scp,
            &refs,
            &stats,
        );
        let location = self.append(&body)?;
        let mut total = Stats {
            num_tree_bytes: location.length,
            ..Stats::default()
        };
        for s in &stats {
            total.num_keys = total.num_keys.saturating_add(s.num_keys);
            total.num_tree_bytes = total.num_tree_bytes.saturating_add(s.num_tree_bytes);
            total.num_indirect_value_bytes = total
                .num_indirect_value_bytes
                .saturating_add(s.num_indirect_value_bytes);
        }
        Ok(Written {
            location,
            stats: total,
            first_key: first.clone(),
            prefix,
        })
    }
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// 16 unpredictable bytes, for the database uuid and the data file name (tensorstore
/// uses `RAND_bytes`; a collision would only matter between databases sharing a
/// directory). From std's randomly keyed hasher, the time, the process and a counter:
/// no RNG crate needed.
fn random_bytes() -> [u8; 16] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(now_ns());
        h.write_u32(std::process::id());
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_usize(i);
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

/// 32 lowercase hex digits, as tensorstore names data files.
fn random_hex() -> String {
    random_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_respects_bound_and_min_arity() {
        let w = WriterOptions::new().max_decoded_node_bytes(100);
        let t = |sizes: &[u64], min| {
            let mut f = tempfile::tempfile().unwrap();
            let file = DataFile {
                base: vec![],
                relative: vec![],
            };
            let tw = TreeWriter {
                options: &w,
                file: &file,
                out: &mut f,
                path: Path::new("x"),
                pos: 0,
                nodes: 0,
            };
            tw.split(sizes, min)
        };
        assert_eq!(t(&[40, 40, 40, 40], 1), vec![0..2, 2..4]);
        // An entry larger than the bound gets a node of its own.
        assert_eq!(t(&[500, 40, 500], 1), vec![0..1, 1..2, 2..3]);
        // Interior nodes take two entries at least.
        assert_eq!(t(&[500, 500, 500], 2), vec![0..2, 2..3]);
    }

    #[test]
    fn random_names_are_hex_and_differ() {
        let a = random_hex();
        assert_eq!(a.len(), 32);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert_ne!(a, random_hex());
    }
}

//! Opening a database and walking one generation's B+tree.
//!
//! Nothing is trusted before it is checked: every object's envelope (magic, length,
//! CRC-32C, zstd bounded by the configuration), every reference against the size of
//! the file it points into, every data file path against the database directory,
//! every node's height against what its parent announced, and every key against the
//! range its parent gives it. Values are located, never read, by [`Database::list`].

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::btree::{self, LeafValue, NodeEntries};
use crate::codec::open_envelope;
use crate::data_file_table::DataFile;
use crate::error::{io, show_key, Error, ObjectKind, Problem, Result};
use crate::manifest::{self, Config, Manifest, MAX_MANIFEST_BYTES};
use crate::reference::Ref;
use crate::version_tree::{self, Version, VersionEntries, VersionNodeRef};

/// The manifest's file name in the database directory.
pub(crate) const MANIFEST: &str = "manifest.ocdbt";

/// Where a value is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Stored in the B+tree leaf itself (small values).
    Inline(Vec<u8>),
    /// `len` bytes at `offset` of the data file `path` (checked to lie inside it when
    /// listed): read, map or stream them there.
    Stored {
        /// The data file (the database directory joined with the stored path).
        path: PathBuf,
        /// Where the value starts.
        offset: u64,
        /// Its length.
        len: u64,
    },
}

impl Value {
    /// The value's length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Value::Inline(b) => b.len() as u64,
            Value::Stored { len, .. } => *len,
        }
    }

    /// Whether the value is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value's bytes (read from its data file if stored there).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] if the data file cannot be read, [`Error::OutOfFile`] if the
    /// range is no longer inside it.
    pub fn read(&self) -> Result<Vec<u8>> {
        match self {
            Value::Inline(b) => Ok(b.clone()),
            Value::Stored { path, offset, len } => {
                Files::default().read(path, *offset, *len, "value")
            }
        }
    }
}

/// One key and where its value is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key (OCDBT keys are bytes; orbax's are UTF-8).
    pub key: Vec<u8>,
    /// Its value.
    pub value: Value,
}

/// One generation of an OCDBT database, opened read-only.
#[derive(Debug)]
pub struct Database {
    dir: PathBuf,
    manifest: Manifest,
    version: Version,
    /// The table of the object holding `version` (the manifest or a version node):
    /// its root reference indexes it.
    version_files: Vec<DataFile>,
    /// That object.
    version_from: Referrer,
}

/// The object holding a reference: named when the reference is bad.
#[derive(Debug, Clone)]
struct Referrer {
    path: PathBuf,
    offset: u64,
    object: ObjectKind,
}

/// Bytes of a data file, and who pointed there.
#[derive(Debug)]
struct Loc {
    file: DataFile,
    offset: u64,
    length: u64,
    from: Referrer,
}

impl Database {
    /// Opens the newest generation of the database in `dir` (the directory holding
    /// `manifest.ocdbt`; for orbax, the item directory).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] for a missing or unreadable manifest, [`Error::Corrupt`] for a
    /// damaged one, [`Error::ManifestTooLarge`], [`Error::NumberedManifest`] for a
    /// configuration-only manifest.
    pub fn open(dir: &Path) -> Result<Database> {
        Database::open_inner(dir, None)
    }

    /// Opens generation `generation` of the database in `dir`, following the version
    /// tree for generations older than the manifest holds.
    ///
    /// # Errors
    ///
    /// As [`Database::open`], plus [`Error::NoSuchGeneration`], and errors of the
    /// version tree nodes read ([`Error::Corrupt`], [`Error::OutOfFile`],
    /// [`Error::VersionTree`], ...).
    pub fn open_generation(dir: &Path, generation: u64) -> Result<Database> {
        Database::open_inner(dir, Some(generation))
    }

    fn open_inner(dir: &Path, generation: Option<u64>) -> Result<Database> {
        let path = dir.join(MANIFEST);
        let mut f = File::open(&path).map_err(io(&path))?;
        let len = f.metadata().map_err(io(&path))?.len();
        if len > MAX_MANIFEST_BYTES {
            return Err(Error::ManifestTooLarge {
                path,
                len,
                max: MAX_MANIFEST_BYTES,
            });
        }
        let mut bytes = Vec::with_capacity(len as usize);
        // Bounded again while reading: the file may grow after its size was taken.
        (&mut f)
            .take(MAX_MANIFEST_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io(&path))?;
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(Error::ManifestTooLarge {
                path,
                len: bytes.len() as u64,
                max: MAX_MANIFEST_BYTES,
            });
        }
        let manifest = manifest::decode(&bytes).map_err(|problem| Error::Corrupt {
            path: path.clone(),
            offset: 0,
            object: ObjectKind::Manifest,
            problem,
        })?;
        if manifest.numbered {
            return Err(Error::NumberedManifest { path });
        }
        let mut db = Database {
            dir: dir.to_path_buf(),
            version: manifest.versions[manifest.versions.len() - 1].clone(),
            version_files: manifest.files.clone(),
            version_from: Referrer {
                path,
                offset: 0,
                object: ObjectKind::Manifest,
            },
            manifest,
        };
        if let Some(g) = generation {
            let (v, files, from) = db.find_version(g)?;
            db.version = v;
            db.version_files = files;
            db.version_from = from;
        }
        Ok(db)
    }

    /// The database's configuration.
    pub fn config(&self) -> &Config {
        &self.manifest.config
    }

    /// The generation opened.
    pub fn generation(&self) -> u64 {
        self.version.generation
    }

    /// The newest generation in the database.
    pub fn latest_generation(&self) -> u64 {
        self.manifest.versions[self.manifest.versions.len() - 1].generation
    }

    /// Height of the opened generation's B+tree root (0: the root is a leaf).
    pub fn root_height(&self) -> u8 {
        self.version.root_height
    }

    /// When the opened generation was committed, in nanoseconds since the Unix epoch.
    pub fn commit_time_ns(&self) -> u64 {
        self.version.commit_time
    }

    /// Every key of the opened generation, in order (bytewise), with where its value
    /// is. Out-of-line values are located, not read.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] for a damaged node, [`Error::OutOfFile`] for a node past the
    /// end of its data file (a truncated file), [`Error::NodeTooLarge`],
    /// [`Error::BadDataFilePath`], [`Error::NodeReferencedTwice`],
    /// [`Error::KeyOutOfRange`], [`Error::Io`]; [`Error::Value`] naming the key for a
    /// value whose data file is missing, too short or refused.
    pub fn list(&self) -> Result<Vec<Entry>> {
        let mut w = Walk::default();
        if let Some(root) = self.root()? {
            self.walk(&mut w, root, self.version.root_height, &[], &[], None)?;
        }
        Ok(w.out)
    }

    /// Where the value of `key` is, or `None` if the key is not in the opened
    /// generation.
    ///
    /// # Errors
    ///
    /// As [`Database::list`], for the nodes on the key's path.
    pub fn find(&self, key: &[u8]) -> Result<Option<Value>> {
        let mut files = Files::default();
        let Some(mut loc) = self.root()? else {
            return Ok(None);
        };
        let mut height = self.version.root_height;
        let mut prefix: Vec<u8> = Vec::new();
        loop {
            let (path, node) = self.read_btree_node(&mut files, &loc, height)?;
            let here = Referrer {
                path,
                offset: loc.offset,
                object: ObjectKind::BtreeNode,
            };
            let Some(rest) = key.strip_prefix(&prefix[..]) else {
                return Ok(None);
            };
            match node.entries {
                NodeEntries::Leaf(entries) => {
                    let Ok(i) = entries.binary_search_by(|e| e.key.as_slice().cmp(rest)) else {
                        return Ok(None);
                    };
                    let e = &entries[i];
                    return self
                        .value(&mut files, &here, &node.files, &e.value)
                        .map(Some)
                        .map_err(|source| Error::Value {
                            key: show_key(key),
                            source: Box::new(source),
                        });
                }
                NodeEntries::Interior(entries) => {
                    let i = entries.partition_point(|e| e.key.as_slice() <= rest);
                    if i == 0 {
                        return Ok(None);
                    }
                    let e = &entries[i - 1];
                    let common = &e.key[..e.subtree_common_prefix];
                    if !rest.starts_with(common) {
                        return Ok(None);
                    }
                    prefix.extend_from_slice(common);
                    height -= 1;
                    loc = Loc {
                        file: node.files[e.child.file].clone(),
                        offset: e.child.offset,
                        length: e.child.length,
                        from: here,
                    };
                }
            }
        }
    }

    /// The value of `key`, read, or `None` if the key is not there. Convenient for
    /// small values; large ones are better located with [`Database::find`] and read
    /// where they are.
    ///
    /// # Errors
    ///
    /// As [`Database::find`] and [`Value::read`].
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.find(key)?.map(|v| v.read()).transpose()
    }

    /// Every generation in the database, ascending (those in version tree nodes, then
    /// those in the manifest).
    ///
    /// # Errors
    ///
    /// Errors of the version tree nodes read, as for [`Database::open_generation`].
    pub fn generations(&self) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        let mut files = Files::default();
        for e in &self.manifest.version_nodes {
            let from = self.manifest_referrer();
            self.collect_generations(&mut files, e, &self.manifest.files, &from, &mut out)?;
        }
        out.extend(self.manifest.versions.iter().map(|v| v.generation));
        Ok(out)
    }

    fn collect_generations(
        &self,
        files: &mut Files,
        e: &VersionNodeRef,
        table: &[DataFile],
        from: &Referrer,
        out: &mut Vec<u64>,
    ) -> Result<()> {
        let (node, here) = self.read_version_node(files, e, table, from)?;
        match &node.entries {
            VersionEntries::Leaf(v) => out.extend(v.iter().map(|v| v.generation)),
            VersionEntries::Interior(children) => {
                for c in children {
                    self.collect_generations(files, c, &node.files, &here, out)?;
                }
            }
        }
        Ok(())
    }

    /// The version of generation `g` and the table its root reference indexes.
    fn find_version(&self, g: u64) -> Result<(Version, Vec<DataFile>, Referrer)> {
        let m = &self.manifest;
        if let Some(v) = m.versions.iter().find(|v| v.generation == g) {
            return Ok((v.clone(), m.files.clone(), self.manifest_referrer()));
        }
        let mut files = Files::default();
        let mut entries: Vec<VersionNodeRef> = m.version_nodes.clone();
        let mut table = m.files.clone();
        let mut from = self.manifest_referrer();
        loop {
            // Entry k holds (generation[k-1], generation[k]].
            let mut lo = 0;
            let Some(e) = entries
                .iter()
                .find(|e| {
                    let hit = lo < g && g <= e.generation;
                    lo = e.generation;
                    hit
                })
                .cloned()
            else {
                return Err(self.no_such_generation(g));
            };
            let (node, here) = self.read_version_node(&mut files, &e, &table, &from)?;
            match node.entries {
                VersionEntries::Leaf(v) => {
                    return match v.into_iter().find(|v| v.generation == g) {
                        Some(v) => Ok((v, node.files, here)),
                        None => Err(self.no_such_generation(g)),
                    }
                }
                VersionEntries::Interior(children) => {
                    entries = children;
                    table = node.files;
                    from = here;
                }
            }
        }
    }

    fn manifest_referrer(&self) -> Referrer {
        Referrer {
            path: self.dir.join(MANIFEST),
            offset: 0,
            object: ObjectKind::Manifest,
        }
    }

    fn no_such_generation(&self, generation: u64) -> Error {
        Error::NoSuchGeneration {
            path: self.dir.join(MANIFEST),
            generation,
            latest: self.latest_generation(),
        }
    }

    /// Reads the version tree node `e` (held by `from`, whose table is `table`) refers
    /// to and checks it is the node `e` says.
    fn read_version_node(
        &self,
        files: &mut Files,
        e: &VersionNodeRef,
        table: &[DataFile],
        from: &Referrer,
    ) -> Result<(version_tree::VersionNode, Referrer)> {
        let loc = Loc {
            file: table[e.location.file].clone(),
            offset: e.location.offset,
            length: e.location.length,
            from: from.clone(),
        };
        let kind = ObjectKind::VersionNode;
        let path = self.resolve(&loc.file, &loc.from)?;
        let bytes = files.read_object(&path, &loc, kind, MAX_MANIFEST_BYTES)?;
        let corrupt = |problem| Error::Corrupt {
            path: path.clone(),
            offset: loc.offset,
            object: kind,
            problem,
        };
        let body = open_envelope(&bytes, kind, MAX_MANIFEST_BYTES).map_err(corrupt)?;
        let node = version_tree::decode_node(&body, &loc.file.base).map_err(corrupt)?;
        let mismatch = |why: String| Error::VersionTree {
            path: path.clone(),
            offset: loc.offset,
            why,
        };
        if node.height != e.height {
            return Err(corrupt(Problem::Height {
                expected: e.height,
                found: node.height,
            }));
        }
        if node.arity_log2 != self.manifest.config.version_tree_arity_log2 {
            return Err(mismatch(format!(
                "version_tree_arity_log2 {}, but the manifest says {}",
                node.arity_log2, self.manifest.config.version_tree_arity_log2
            )));
        }
        if node.last_generation() != e.generation {
            return Err(mismatch(format!(
                "last generation {}, but its reference says {}",
                node.last_generation(),
                e.generation
            )));
        }
        let here = Referrer {
            path,
            offset: loc.offset,
            object: kind,
        };
        Ok((node, here))
    }

    /// The opened generation's root node, or `None` for an empty tree.
    fn root(&self) -> Result<Option<Loc>> {
        let r: Ref = self.version.root;
        if r.is_missing() {
            return Ok(None);
        }
        Ok(Some(Loc {
            file: self.version_files[r.file].clone(),
            offset: r.offset,
            length: r.length,
            from: self.version_from.clone(),
        }))
    }

    /// `file` as a path under the database directory; `from` holds the reference.
    fn resolve(&self, file: &DataFile, from: &Referrer) -> Result<PathBuf> {
        let raw = file.path();
        let bad = |why| Error::BadDataFilePath {
            path: from.path.clone(),
            offset: from.offset,
            object: from.object,
            data_file: String::from_utf8_lossy(&raw).into_owned(),
            why,
        };
        let s = std::str::from_utf8(&raw).map_err(|_| bad("is not UTF-8"))?;
        if s.contains('\0') {
            return Err(bad("contains a NUL byte"));
        }
        // Relative, plain components only: a path in the database must not name a file
        // outside its directory.
        for part in s.split('/') {
            match part {
                "" => return Err(bad("is empty, absolute, or has an empty component")),
                "." | ".." => return Err(bad("has a `.` or `..` component")),
                _ => {}
            }
        }
        Ok(self.dir.join(s))
    }

    /// The most bytes a B+tree node may decode to. tensorstore's writer aims nodes at
    /// `max_decoded_node_bytes` of its *estimate* of their decoded size, and lets a
    /// node of one entry (two in interior nodes) overshoot by that entry (a key of up
    /// to 64 KiB, an inline value of up to 1 MiB); the encoded body is within a small
    /// factor of the estimate. Four times the target plus 4 MiB accepts every node a
    /// writer produces and still bounds a damaged or hostile zstd frame. 0 (no target)
    /// is bounded as 2^32-1.
    fn btree_body_limit(&self) -> u64 {
        btree_body_limit(self.manifest.config.max_decoded_node_bytes)
    }

    fn read_btree_node(
        &self,
        files: &mut Files,
        loc: &Loc,
        height: u8,
    ) -> Result<(PathBuf, btree::BtreeNode)> {
        let kind = ObjectKind::BtreeNode;
        let path = self.resolve(&loc.file, &loc.from)?;
        let limit = self.btree_body_limit();
        // A compressed body is at most zstd's bound over the raw one.
        let max_stored = limit + limit / 128 + 1024;
        let bytes = files.read_object(&path, loc, kind, max_stored)?;
        let corrupt = |problem| Error::Corrupt {
            path: path.clone(),
            offset: loc.offset,
            object: kind,
            problem,
        };
        let body = open_envelope(&bytes, kind, limit).map_err(corrupt)?;
        let node = btree::decode_node(&body, &loc.file.base).map_err(corrupt)?;
        if node.height != height {
            return Err(corrupt(Problem::Height {
                expected: height,
                found: node.height,
            }));
        }
        Ok((path, node))
    }

    /// A leaf value as a [`Value`], a stored one checked to lie inside its file.
    fn value(
        &self,
        files: &mut Files,
        leaf: &Referrer,
        table: &[DataFile],
        v: &LeafValue,
    ) -> Result<Value> {
        match v {
            LeafValue::Inline(b) => Ok(Value::Inline(b.clone())),
            LeafValue::Indirect(r) => {
                let path = self.resolve(&table[r.file], leaf)?;
                files.check_range(&path, r.offset, r.length, "value")?;
                Ok(Value::Stored {
                    path,
                    offset: r.offset,
                    len: r.length,
                })
            }
        }
    }

    /// Lists the subtree at `loc` into `w`: `prefix` is the node's key prefix, and
    /// every key in it must be in `[lo, hi)` (full keys), the range its parent gives.
    fn walk(
        &self,
        w: &mut Walk,
        loc: Loc,
        height: u8,
        prefix: &[u8],
        lo: &[u8],
        hi: Option<&[u8]>,
    ) -> Result<()> {
        let (path, node) = self.read_btree_node(&mut w.files, &loc, height)?;
        if !w.seen.insert((path.clone(), loc.offset)) {
            return Err(Error::NodeReferencedTwice {
                path,
                offset: loc.offset,
            });
        }
        let here = Referrer {
            path: path.clone(),
            offset: loc.offset,
            object: ObjectKind::BtreeNode,
        };
        let check = |key: &[u8]| {
            if key < lo || hi.is_some_and(|h| key >= h) {
                Err(Error::KeyOutOfRange {
                    path: path.clone(),
                    offset: loc.offset,
                    key: show_key(key),
                })
            } else {
                Ok(())
            }
        };
        match &node.entries {
            NodeEntries::Leaf(entries) => {
                for e in entries {
                    let key = [prefix, &e.key[..]].concat();
                    check(&key)?;
                    let value = self
                        .value(&mut w.files, &here, &node.files, &e.value)
                        .map_err(|source| Error::Value {
                            key: show_key(&key),
                            source: Box::new(source),
                        })?;
                    w.out.push(Entry { key, value });
                }
            }
            NodeEntries::Interior(entries) => {
                let full: Vec<Vec<u8>> = entries
                    .iter()
                    .map(|e| [prefix, &e.key[..]].concat())
                    .collect();
                for (i, e) in entries.iter().enumerate() {
                    check(&full[i])?;
                    let child_prefix = [prefix, &e.key[..e.subtree_common_prefix]].concat();
                    let child_hi = full.get(i + 1).map(|k| k.as_slice()).or(hi);
                    let child = Loc {
                        file: node.files[e.child.file].clone(),
                        offset: e.child.offset,
                        length: e.child.length,
                        from: here.clone(),
                    };
                    self.walk(w, child, height - 1, &child_prefix, &full[i], child_hi)?;
                }
            }
        }
        Ok(())
    }
}

/// See [`Database::btree_body_limit`].
pub(crate) fn btree_body_limit(max_decoded_node_bytes: u32) -> u64 {
    let target = match max_decoded_node_bytes {
        0 => u64::from(u32::MAX),
        n => u64::from(n),
    };
    target * 4 + (4 << 20)
}

#[derive(Default)]
struct Walk {
    files: Files,
    seen: HashSet<(PathBuf, u64)>,
    out: Vec<Entry>,
}

/// Open data files and their sizes, for the duration of one walk.
#[derive(Default)]
struct Files {
    open: HashMap<PathBuf, (File, u64)>,
}

impl Files {
    fn get(&mut self, path: &Path) -> Result<&mut (File, u64)> {
        if !self.open.contains_key(path) {
            let f = File::open(path).map_err(io(path))?;
            let len = f.metadata().map_err(io(path))?.len();
            self.open.insert(path.to_path_buf(), (f, len));
        }
        Ok(self.open.get_mut(path).expect("inserted above"))
    }

    fn check_range(
        &mut self,
        path: &Path,
        offset: u64,
        len: u64,
        what: &'static str,
    ) -> Result<()> {
        let file_len = self.get(path)?.1;
        match offset.checked_add(len) {
            Some(end) if end <= file_len => Ok(()),
            _ => Err(Error::OutOfFile {
                path: path.to_path_buf(),
                what,
                offset,
                len,
                file_len,
            }),
        }
    }

    fn read(&mut self, path: &Path, offset: u64, len: u64, what: &'static str) -> Result<Vec<u8>> {
        self.check_range(path, offset, len, what)?;
        let size = usize::try_from(len).map_err(|_| Error::Overflow {
            path: path.to_path_buf(),
            what: "value length",
        })?;
        let f = &mut self.get(path)?.0;
        f.seek(SeekFrom::Start(offset)).map_err(io(path))?;
        let mut buf = vec![0u8; size];
        f.read_exact(&mut buf).map_err(io(path))?;
        Ok(buf)
    }

    /// An encoded object of at most `max` bytes.
    fn read_object(
        &mut self,
        path: &Path,
        loc: &Loc,
        object: ObjectKind,
        max: u64,
    ) -> Result<Vec<u8>> {
        if loc.length > max {
            return Err(Error::NodeTooLarge {
                path: path.to_path_buf(),
                object,
                offset: loc.offset,
                len: loc.length,
                max,
            });
        }
        self.read(
            path,
            loc.offset,
            loc.length,
            match object {
                ObjectKind::BtreeNode => "B+tree node",
                ObjectKind::VersionNode => "version tree node",
                ObjectKind::Manifest => "manifest",
            },
        )
    }
}

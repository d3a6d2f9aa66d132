//! Orbax (JAX) checkpoints, read: an item directory (`<root>/<step>/<item>/`, or a
//! `Checkpointer`'s directory, which is step and item at once) becomes one
//! [`TensorFile`] whose entries are the zarr chunks of its arrays, each a box of its
//! array at its offsets, decoded on read through a [`Decoder`](super::Decoder)
//! ([`chunks::Chunks`]). The on-disk format is docs/orbax.md; what ckpt reads and
//! refuses is docs/formats.md, "Orbax".
//!
//! - [`tree`]: `_METADATA`, the pytree's leaves (names = keys joined with `.`).
//! - [`zarr`]: each array's `.zarray` (v2) or `zarr.json` (v3).
//! - [`store`]: where the keys are (tensorstore's OCDBT database, through
//!   `ckpt-ocdbt`, or one file per key).
//! - [`chunks`]: the pieces and their decoding (zstd, shard indices, fill values).
//! - [`steps`]: a `CheckpointManager`'s step directories, which are committed, and
//!   which item of a step holds the arrays.
//! - [`encode`]: the other way, an item's arrays written (`--format orbax`'s file
//!   codec: zarr v3 in a new OCDBT database).
//! - [`sharding`]: an item's `_sharding` (each array's mesh and partition spec), written.
//!
//! Every problem is a named error naming the file or directory and the array; sizes
//! are checked; no tensor data is read to open an item (zarr metadata and v3 shard
//! indices are).

pub(crate) mod chunks;
pub(crate) mod encode;
pub(crate) mod sharding;
pub(crate) mod steps;
pub(crate) mod store;
pub(crate) mod tree;
pub(crate) mod zarr;

use self::chunks::{Array, Chunks, Piece, Source};
use self::store::{Loc, Store};
use self::tree::METADATA_FILE;
use self::zarr::{grid_counts, item_size, ArrayMeta, Codec};
use crate::error::{overflow, Error, Result};
use crate::formats::{FileFormat, TensorEntry, TensorFile};
use crate::layout::strategy::dtype_name;
use crate::layout::Dtype;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

pub(crate) use self::steps::{
    is_step_dir, item_step, step_dir_of, step_item, step_of, uncommitted,
};

/// Most pieces (zarr chunks, inner chunks of shards) one item may have: each is an
/// entry of a few hundred bytes in memory.
const MAX_PIECES: u64 = 1 << 22;

/// An Orbax item read: its file of pieces, every array's dtype and shape (zarr
/// metadata records them), and what was decided.
#[derive(Debug)]
pub(crate) struct Orbax {
    /// The item's pieces.
    pub(crate) file: TensorFile,
    /// Every array's dtype and global shape, by name.
    pub(crate) shapes: BTreeMap<String, (Dtype, Vec<u64>)>,
    /// What was passed over or filled in.
    pub(crate) notes: Vec<String>,
}

/// Whether `dir` is an Orbax item directory (it holds `_METADATA`).
pub(crate) fn is_item_dir(dir: &Path) -> bool {
    dir.join(METADATA_FILE).is_file()
}

/// Whether `dir` is an Orbax item directory or step directory (orbax's
/// `_CHECKPOINT_METADATA`), for discovery's table.
pub(crate) fn claims(dir: &Path) -> bool {
    is_item_dir(dir) || dir.join(steps::CHECKPOINT_METADATA).is_file()
}

fn invalid(path: &Path, problem: impl Into<String>) -> Error {
    Error::InvalidOrbax {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// Downloads the files under `dir` that are placeholders of objects in a bucket:
/// tensorstore's OCDBT files are read by `ckpt-ocdbt` with file reads, which a
/// placeholder cannot serve. (Nothing to do for a local directory.)
fn download_tree(dir: &Path, depth: u32) -> Result<()> {
    for p in crate::formats::list_dir(dir)? {
        if p.is_dir() && depth > 0 {
            download_tree(&p, depth - 1)?;
        } else if p.is_file() {
            crate::formats::download(&p)?;
        }
    }
    Ok(())
}

/// A whole small file, refused over `max` bytes.
fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>> {
    let len = crate::formats::file_len(path)?;
    if len > max {
        return Err(invalid(
            path,
            format!("{len} bytes, more than the {max} a {what} may have"),
        ));
    }
    crate::formats::read_small(path)
}

/// Reads the item directory `dir`: its tree, every array's zarr metadata, where each
/// chunk is (and, for zarr v3 shards, their indices). No tensor data is read.
///
/// # Errors
/// [`Error::InvalidOrbax`] naming the file and the array for everything ckpt does not
/// read or finds wrong; [`Error::Ocdbt`] for a damaged OCDBT database; I/O errors.
pub(crate) fn read(dir: &Path) -> Result<Orbax> {
    let meta_path = dir.join(METADATA_FILE);
    let bytes = read_bounded(&meta_path, tree::MAX_METADATA_BYTES, "tree metadata")?;
    let tree = tree::parse(&bytes).map_err(|p| invalid(&meta_path, p))?;
    let manifest = dir.join("manifest.ocdbt");
    let use_ocdbt = tree.use_ocdbt.unwrap_or_else(|| manifest.is_file());
    let store = if use_ocdbt {
        if !manifest.is_file() {
            return Err(invalid(
                dir,
                "_METADATA says use_ocdbt, but manifest.ocdbt is missing (the per-process \
                 databases, ocdbt.process_<i>/, are only merged into it when the save \
                 finishes: a save cut off?)",
            ));
        }
        // (The item directory, `d/`, `ocdbt.process_<i>/d/`.)
        download_tree(dir, 2)?;
        Store::ocdbt(dir)?
    } else {
        Store::files(dir)
    };
    let mut item = Item {
        store: &store,
        arrays: Vec::new(),
        pieces: Vec::new(),
        notes: Vec::new(),
    };
    let mut shapes = BTreeMap::new();
    let mut zarr_versions = std::collections::BTreeSet::new();
    for leaf in tree.arrays() {
        let meta = item.array_meta(&leaf.name, tree.use_zarr3)?;
        zarr_versions.insert(meta.zarr);
        shapes.insert(leaf.name.clone(), (meta.dtype, meta.shape.clone()));
        item.add_array(&leaf.name, &meta)?;
    }
    let mut notes = vec![format!(
        "Orbax item {}: {} arrays, {} chunks, zarr v{} {}",
        dir.display(),
        item.arrays.len(),
        item.pieces.len(),
        zarr_versions
            .iter()
            .map(u8::to_string)
            .collect::<Vec<_>>()
            .join("/v"),
        if store.is_ocdbt() {
            "in its OCDBT database"
        } else {
            "in one directory per array"
        }
    )];
    notes.extend(passed_over(&tree));
    notes.append(&mut item.notes);
    let Item { arrays, pieces, .. } = item;
    let mut entries = Vec::with_capacity(pieces.len());
    let mut at = 0u64;
    for p in &pieces {
        let end = at
            .checked_add(p.len)
            .ok_or_else(|| overflow(format!("{}: bytes of the item's arrays", dir.display())))?;
        let a = &arrays[p.array];
        entries.push(TensorEntry {
            name: a.name.clone(),
            dtype: a.dtype,
            shape: p.shape.clone(),
            start: at,
            end,
            offsets: Some(p.start.clone()),
        });
        at = end;
    }
    let decoder = Chunks::new(dir.to_path_buf(), arrays, pieces);
    let file = TensorFile::from_decoder(
        dir,
        FileFormat::Orbax,
        Box::new(decoder),
        entries,
        BTreeMap::new(),
    );
    Ok(Orbax {
        file,
        shapes,
        notes,
    })
}

/// The leaves that are not arrays, said (strings are not tensors; arrays orbax itself
/// skips are not read).
fn passed_over(tree: &tree::Tree) -> Vec<String> {
    let list = |kind: tree::LeafKind| -> Vec<&str> {
        tree.leaves
            .iter()
            .filter(|l| l.kind == kind)
            .map(|l| l.name.as_str())
            .collect()
    };
    let shown = |names: &[&str]| {
        let more = if names.len() > 8 { ", ..." } else { "" };
        format!("{}{more}", names[..names.len().min(8)].join(", "))
    };
    let mut out = Vec::new();
    let strings = list(tree::LeafKind::String);
    if !strings.is_empty() {
        out.push(format!(
            "{} string leaves (in _strings.json) are not tensors and are not carried: {}",
            strings.len(),
            shown(&strings)
        ));
    }
    let skipped = list(tree::LeafKind::Skipped);
    if !skipped.is_empty() {
        out.push(format!(
            "{} arrays marked skip_deserialize are not read: {}",
            skipped.len(),
            shown(&skipped)
        ));
    }
    out
}

/// The item being read: its arrays and their pieces so far.
struct Item<'a> {
    store: &'a Store,
    arrays: Vec<Array>,
    pieces: Vec<Piece>,
    notes: Vec<String>,
}

impl Item<'_> {
    /// Array `name`'s zarr metadata: the version `_METADATA` says, else whichever key
    /// the store holds.
    fn array_meta(&self, name: &str, zarr3: Option<bool>) -> Result<ArrayMeta> {
        let v2 = format!("{name}/{}", zarr::ZARRAY);
        let v3 = format!("{name}/{}", zarr::ZARR_JSON);
        let tries: &[(&str, u8)] = match zarr3 {
            Some(true) => &[(&v3, 3)],
            Some(false) => &[(&v2, 2)],
            None => &[(&v2, 2), (&v3, 3)],
        };
        for &(key, version) in tries {
            let Some(bytes) = self.store.read_small(key, zarr::MAX_ZARR_METADATA_BYTES)? else {
                continue;
            };
            let parsed = if version == 2 {
                zarr::parse_v2(&bytes)
            } else {
                zarr::parse_v3(&bytes)
            };
            let path = self.store.find(key)?.map_or_else(
                || self.store.dir().join(key),
                |l| self.store.path_of(key, &l),
            );
            return parsed.map_err(|p| invalid(&path, format!("array `{name}` (`{key}`): {p}")));
        }
        let keys: Vec<&str> = tries.iter().map(|t| t.0).collect();
        Err(invalid(
            self.store.dir(),
            format!(
                "array `{name}` (listed in _METADATA) has no zarr metadata: no {} {}",
                keys.join(" nor "),
                if self.store.is_ocdbt() {
                    "key in the OCDBT database"
                } else {
                    "file"
                }
            ),
        ))
    }

    /// Adds array `name`'s pieces: one per stored chunk (per inner chunk of a shard),
    /// cut to the array; a missing one as its fill value.
    fn add_array(&mut self, name: &str, meta: &ArrayMeta) -> Result<()> {
        let counts = grid_counts(&meta.shape, &meta.chunk);
        let total = counts
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .filter(|&n| n <= MAX_PIECES - (self.pieces.len() as u64).min(MAX_PIECES))
            .ok_or_else(|| {
                invalid(
                    self.store.dir(),
                    format!(
                        "array `{name}`: a grid of {counts:?} chunks of {:?}: with the item's \
                         other chunks, more than the {MAX_PIECES} ckpt reads",
                        meta.chunk
                    ),
                )
            })?;
        let array = self.arrays.len();
        self.arrays.push(Array {
            name: name.to_string(),
            dtype: meta.dtype,
        });
        let mut missing = 0u64;
        let mut idx = vec![0u64; counts.len()];
        for number in 0..total {
            if number > 0 {
                // The next grid index, in C order.
                for d in (0..idx.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < counts[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            let start: Vec<u64> = idx.iter().zip(&meta.chunk).map(|(i, c)| i * c).collect();
            let key = format!("{name}/{}", meta.keys.key(&idx));
            let found = self.store.find(&key)?;
            missing += u64::from(found.is_none());
            match &meta.codec {
                Codec::Plain(chain) => {
                    let source = match found {
                        Some(loc) => {
                            self.check_stored(name, &key, meta, &meta.chunk, &loc, *chain)?;
                            Source::Stored { loc, chain: *chain }
                        }
                        None => self.fill(name, &key, meta)?,
                    };
                    self.push(array, meta, key, number, start, meta.chunk.clone(), source)?;
                }
                Codec::Sharded {
                    inner,
                    chain,
                    index_crc,
                    index_at_end,
                } => {
                    let Some(shard) = found else {
                        let source = self.fill(name, &key, meta)?;
                        self.push(array, meta, key, number, start, meta.chunk.clone(), source)?;
                        continue;
                    };
                    let inner_counts: Vec<u64> =
                        meta.chunk.iter().zip(inner).map(|(s, i)| s / i).collect();
                    let n: u64 = inner_counts.iter().product();
                    if n > MAX_PIECES {
                        return Err(invalid(
                            &self.store.path_of(&key, &shard),
                            format!("array `{name}`: shard `{key}` of {n} inner chunks, more than ckpt reads"),
                        ));
                    }
                    let index =
                        self.shard_index(name, &key, &shard, n, *index_crc, *index_at_end)?;
                    let mut j = vec![0u64; inner_counts.len()];
                    for (k, entry) in index.into_iter().enumerate() {
                        if k > 0 {
                            for d in (0..j.len()).rev() {
                                j[d] += 1;
                                if j[d] < inner_counts[d] {
                                    break;
                                }
                                j[d] = 0;
                            }
                        }
                        let at: Vec<u64> = start
                            .iter()
                            .zip(&j)
                            .zip(inner)
                            .map(|((s, j), i)| s + j * i)
                            .collect();
                        // Inner chunks of an edge shard past the array: padding.
                        if at.iter().zip(&meta.shape).any(|(a, s)| a >= s) {
                            continue;
                        }
                        let inner_key = format!("{key}, inner chunk {j:?}");
                        let source = match entry {
                            Some((off, len)) => {
                                let loc = shard.sub(off, len);
                                self.check_stored(name, &inner_key, meta, inner, &loc, *chain)?;
                                Source::Stored { loc, chain: *chain }
                            }
                            None => {
                                missing += 1;
                                self.fill(name, &inner_key, meta)?
                            }
                        };
                        self.push(array, meta, inner_key, number, at, inner.clone(), source)?;
                    }
                }
            }
        }
        if missing > 0 {
            self.notes.push(format!(
                "array `{name}`: {missing} chunk(s) not stored, read as the fill value {} \
                 (orbax itself would refuse to restore them)",
                meta.fill_text
            ));
        }
        Ok(())
    }

    /// Adds one piece: the chunk of shape `stored` at `start`, cut to the array.
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        array: usize,
        meta: &ArrayMeta,
        key: String,
        number: u64,
        start: Vec<u64>,
        stored: Vec<u64>,
        source: Source,
    ) -> Result<()> {
        let shape: Vec<u64> = start
            .iter()
            .zip(&stored)
            .zip(&meta.shape)
            .map(|((a, c), s)| (*c).min(s - a))
            .collect();
        let size = item_size(meta.dtype);
        let bytes = |dims: &[u64]| {
            dims.iter()
                .try_fold(size, |a, &b| a.checked_mul(b))
                .ok_or_else(|| overflow(format!("bytes of chunk `{key}`")))
        };
        let len = bytes(&shape)?;
        let stored_len = bytes(&stored)?;
        if self.pieces.len() as u64 >= MAX_PIECES {
            return Err(invalid(
                self.store.dir(),
                format!(
                    "array `{}`: more than the {MAX_PIECES} chunks ckpt reads in one item",
                    meta_name(&self.arrays, array)
                ),
            ));
        }
        self.pieces.push(Piece {
            array,
            key,
            number,
            start,
            shape,
            stored,
            source,
            len,
            stored_len,
            crc: OnceLock::new(),
        });
        Ok(())
    }

    /// The fill value of a missing chunk, or the refusal where it cannot be
    /// represented.
    fn fill(&self, name: &str, key: &str, meta: &ArrayMeta) -> Result<Source> {
        meta.fill.clone().map(Source::Fill).ok_or_else(|| {
            invalid(
                self.store.dir(),
                format!(
                    "array `{name}`: chunk `{key}` is not stored, and its fill value {} cannot \
                     be represented as {}: refused rather than inventing its data",
                    meta.fill_text,
                    dtype_name(meta.dtype)
                ),
            )
        })
    }

    /// Checks a stored chunk's length where it is known without decoding it (no zstd:
    /// the raw bytes, and the CRC-32C).
    fn check_stored(
        &self,
        name: &str,
        key: &str,
        meta: &ArrayMeta,
        stored: &[u64],
        loc: &Loc,
        chain: zarr::Chain,
    ) -> Result<()> {
        let crc = if chain.crc32c { 4 } else { 0 };
        let raw = stored
            .iter()
            .try_fold(item_size(meta.dtype), |a, &b| a.checked_mul(b))
            .ok_or_else(|| overflow(format!("bytes of chunk `{key}`")))?;
        let bad = if chain.zstd {
            loc.len() < crc
        } else {
            raw.checked_add(crc) != Some(loc.len())
        };
        if bad {
            return Err(invalid(
                &self.store.path_of(key, loc),
                format!(
                    "array `{name}`: chunk `{key}` ({}) is {} bytes; {} x {stored:?}{} {}",
                    loc.shown(),
                    loc.len(),
                    dtype_name(meta.dtype),
                    if crc > 0 { " and its CRC-32C" } else { "" },
                    if chain.zstd {
                        "cannot be that short".to_string()
                    } else {
                        format!("take {}", raw + crc)
                    }
                ),
            ));
        }
        Ok(())
    }

    /// Reads and checks the index of the shard `key` at `loc` (`n` inner chunks).
    fn shard_index(
        &self,
        name: &str,
        key: &str,
        loc: &Loc,
        n: u64,
        crc: bool,
        at_end: bool,
    ) -> Result<Vec<Option<(u64, u64)>>> {
        let path = self.store.path_of(key, loc);
        let bad = |p: String| {
            invalid(
                &path,
                format!("array `{name}`: shard `{key}` ({}): {p}", loc.shown()),
            )
        };
        let len = zarr::index_len(n, crc)
            .filter(|&l| l <= loc.len())
            .ok_or_else(|| {
                bad(format!(
                    "{} bytes, too short for the index of its {n} inner chunks",
                    loc.len()
                ))
            })?;
        let mut index = vec![0u8; len as usize];
        loc.read_at(if at_end { loc.len() - len } else { 0 }, &mut index)?;
        zarr::parse_index(&index, n, crc, loc.len()).map_err(bad)
    }
}

fn meta_name(arrays: &[Array], i: usize) -> &str {
    arrays.get(i).map_or("", |a| a.name.as_str())
}

/// The zarr metadata and tree parsers, for the fuzz target: `kind` 0 parses `bytes` as
/// `_METADATA`, 1 as `.zarray`, 2 as `zarr.json`, 3 as a shard index of 1 to 4 inner
/// chunks (CRC-32C or not); the result says whether it was read.
pub(crate) fn parse_metadata(kind: u8, bytes: &[u8]) -> bool {
    match kind % 4 {
        0 => tree::parse(bytes).is_ok(),
        1 => zarr::parse_v2(bytes).is_ok(),
        2 => zarr::parse_v3(bytes).is_ok(),
        _ => {
            let n = u64::from(kind / 4 % 4) + 1;
            let crc = kind & 0x80 != 0;
            zarr::index_len(n, crc)
                .filter(|&l| l <= bytes.len() as u64)
                .is_some_and(|l| {
                    zarr::parse_index(
                        &bytes[bytes.len() - l as usize..],
                        n,
                        crc,
                        bytes.len() as u64,
                    )
                    .is_ok()
                })
        }
    }
}

/// A file or directory of the committed Orbax fixtures.
#[cfg(test)]
pub(crate) fn fixture(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/orbax")
        .join(rel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::ReadCache;

    /// Every array of an item, assembled from its pieces.
    fn arrays_of(o: &Orbax) -> BTreeMap<String, Vec<u8>> {
        let f = &o.file;
        let mut out: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        let mut cache = ReadCache::new();
        for (name, (dtype, shape)) in &o.shapes {
            let size = (dtype.bitsize() / 8) as u64;
            let n: u64 = shape.iter().product();
            let mut buf = vec![0u8; (n * size) as usize];
            for (i, t) in f
                .tensors()
                .iter()
                .enumerate()
                .filter(|(_, t)| &t.name == name)
            {
                let bytes = f.read(i, 0..t.end - t.start, &mut cache).unwrap().to_vec();
                let at = t.offsets.clone().unwrap();
                // Row by row of the piece's last dimension.
                let last = t.shape.last().copied().unwrap_or(1);
                for (r, row) in bytes.chunks((last * size) as usize).enumerate() {
                    let mut idx = vec![0u64; t.shape.len()];
                    let mut rem = r as u64;
                    for d in (0..t.shape.len().saturating_sub(1)).rev() {
                        idx[d] = rem % t.shape[d];
                        rem /= t.shape[d];
                    }
                    let g: Vec<u64> = idx.iter().zip(&at).map(|(i, a)| i + a).collect();
                    let off = g.iter().zip(shape).fold(0u64, |a, (i, s)| a * s + i) * size;
                    buf[off as usize..off as usize + row.len()].copy_from_slice(row);
                }
            }
            out.insert(name.clone(), buf);
        }
        out
    }

    fn reference(rel: &str) -> BTreeMap<String, (Dtype, Vec<u64>, Vec<u8>)> {
        let bytes = std::fs::read(fixture(rel)).unwrap();
        let st = ::safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors()
            .into_iter()
            .map(|(n, v)| {
                let shape = v.shape().iter().map(|&d| d as u64).collect();
                (n, (v.dtype(), shape, v.data().to_vec()))
            })
            .collect()
    }

    #[test]
    fn every_fixture_reads_as_its_reference() {
        for (item, want) in [
            (
                "ocdbt_zarr3/ckpt/2/items",
                "ocdbt_zarr3/reference.safetensors",
            ),
            (
                "ocdbt_zarr3/ckpt/1/items",
                "ocdbt_zarr3/reference_step1.safetensors",
            ),
            (
                "ocdbt_zarr2/ckpt/1/default",
                "ocdbt_zarr2/reference.safetensors",
            ),
            ("zarr_no_ocdbt/ckpt", "zarr_no_ocdbt/reference.safetensors"),
        ] {
            let o = read(&fixture(item)).unwrap();
            let want = reference(want);
            let got = arrays_of(&o);
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "{item}"
            );
            for (name, (dtype, shape, bytes)) in &want {
                assert_eq!(&o.shapes[name], &(*dtype, shape.clone()), "{item}: {name}");
                assert!(&got[name] == bytes, "{item}: {name} differs");
            }
            assert!(o.file.is_compressed());
            assert!(o.notes[0].contains("Orbax item"), "{:?}", o.notes);
        }
    }

    /// The fuzz target's seeds are read by the parsers they are meant for.
    #[test]
    fn fuzz_seeds_parse() {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/orbax_metadata");
        let mut n = 0;
        for e in std::fs::read_dir(&corpus).unwrap() {
            let p = e.unwrap().path();
            let b = std::fs::read(&p).unwrap();
            assert!(parse_metadata(b[0], &b[1..]), "{}", p.display());
            n += 1;
        }
        assert!(n >= 4, "{n} seeds");
    }

    #[test]
    fn the_fixtures_pieces_are_their_chunks() {
        let o = read(&fixture("ocdbt_zarr2/ckpt/1/default")).unwrap();
        let emb: Vec<_> = o
            .file
            .tensors()
            .iter()
            .filter(|t| t.name == "params.embed.embedding")
            .map(|t| (t.offsets.clone().unwrap(), t.shape.clone()))
            .collect();
        assert_eq!(
            emb,
            vec![
                (vec![0, 0], vec![8, 4]),
                (vec![0, 4], vec![8, 4]),
                (vec![8, 0], vec![8, 4]),
                (vec![8, 4], vec![8, 4]),
            ]
        );
        let step: Vec<_> = o
            .file
            .tensors()
            .iter()
            .filter(|t| t.name == "step")
            .collect();
        assert_eq!(
            (step.len(), step[0].shape.len(), step[0].end - step[0].start),
            (1, 0, 4)
        );
    }
}

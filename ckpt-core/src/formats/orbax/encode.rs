//! An Orbax item's arrays, written: the file codec of `--format orbax`. The "file" the
//! copy plan names is the item's `manifest.ocdbt`; what is written is the OCDBT
//! database around it (through `ckpt-ocdbt`), each tensor a zarr v3 array as orbax
//! 0.12.8 writes one with `use_zarr3=True` and `use_compression=False`
//! (docs/orbax.md, "What ckpt writes"): `<name>/zarr.json`, and per chunk a `sharding_indexed`
//! shard of one inner chunk, `<name>/c/<i>/0/...`: the chunk's C-order little-endian
//! bytes, then the shard index (offset 0, length, as two u64le) and its CRC-32C.
//!
//! Every chunk's bytes are reserved in the database's one data file when the writer is
//! created (its index written there at once), so the copy engine writes tensor bytes
//! straight to their places from any thread, in bounded memory; `finish` writes the
//! B+tree and the manifest (last). Chunks: one per array, or, for an array above
//! `max_chunk_bytes`, rows of dimension 0 evened out over as few chunks as keep each
//! under it (orbax splits a write slice above its 2 GiB data file target too).
//!
//! A sharded item (`reshard --format orbax`) is laid out by its plan instead: the
//! file's metadata [`GRID_KEY`] gives each array's shape and chunk shape (a regular
//! grid, every chunk whole), and each tensor of the plan is one chunk, named by its
//! key (`<name>/c/<i>/<j>/...`), its bytes the chunk's.

use super::tree::check_tree;
use super::zarr::{item_size, v3_name};
use crate::error::{overflow, Error, IoContext, Result};
use crate::formats::output::write_parts_to;
use crate::formats::writer::{TensorSpec, TensorWriter, WritePart};
use crate::layout::Dtype;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The manifest of an OCDBT database: the name a plan gives an Orbax item's arrays.
pub(crate) const MANIFEST_FILE: &str = "manifest.ocdbt";

/// Largest chunk written: orbax's OCDBT `target_data_file_size` on a local disk, above
/// which orbax 0.12.8 splits a write slice into several chunks
/// (`subchunking.choose_chunk_shape`), and the most tensorstore is asked to hold
/// decoded at once per chunk. `CKPT_TEST_ORBAX_CHUNK_BYTES` lowers it for tests.
pub(crate) const MAX_CHUNK_BYTES: u64 = 2 << 30;

/// The output file's metadata key whose value lays a sharded item out: JSON of
/// [`Grid`]s by array name.
pub(crate) const GRID_KEY: &str = "orbax.grid";

/// One array of a sharded item: its shape and its chunks' (which divides it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Grid {
    /// The array's shape.
    pub(crate) shape: Vec<u64>,
    /// Every chunk's shape.
    pub(crate) chunk: Vec<u64>,
}

impl Grid {
    /// The chunks along each dimension.
    pub(crate) fn counts(&self) -> Vec<u64> {
        self.shape
            .iter()
            .zip(&self.chunk)
            .map(|(&n, &c)| n / c.max(1))
            .collect()
    }

    /// Every chunk's grid index, in C order.
    pub(crate) fn indices(&self) -> Vec<Vec<u64>> {
        let counts = self.counts();
        let total: u64 = counts.iter().product();
        let mut out = Vec::with_capacity(total as usize);
        let mut idx = vec![0u64; counts.len()];
        for _ in 0..total {
            out.push(idx.clone());
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < counts[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        out
    }
}

/// The key of the chunk at grid index `idx` of array `name` (zarr v3's default chunk
/// key encoding: `c`, then the index's numbers, `/` between).
pub(crate) fn grid_chunk_key(name: &str, idx: &[u64]) -> String {
    let mut key = format!("{name}/c");
    for i in idx {
        key.push('/');
        key.push_str(&i.to_string());
    }
    key
}

/// A shard's index after its one inner chunk: offset and length (u64le each), then
/// the CRC-32C of those 16 bytes.
const INDEX_BYTES: u64 = 20;

/// [`MAX_CHUNK_BYTES`], or the test override.
pub(crate) fn max_chunk_bytes() -> u64 {
    std::env::var("CKPT_TEST_ORBAX_CHUNK_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(MAX_CHUNK_BYTES)
}

/// One array's place in the data file.
#[derive(Debug)]
struct Array {
    /// Bytes of the tensor.
    len: u64,
    /// Bytes of one (full) chunk.
    chunk_bytes: u64,
    /// Where each chunk's bytes start in the data file.
    offsets: Vec<u64>,
}

/// Writes an item's arrays into a new OCDBT database (see the module's doc).
#[derive(Debug)]
pub(crate) struct OrbaxArraysWriter {
    /// The database's directory (the item directory).
    dir: PathBuf,
    /// `None` once finished.
    db: Option<ckpt_ocdbt::Writer>,
    data: File,
    data_path: PathBuf,
    arrays: Vec<Array>,
}

/// Rows of dimension 0 in a chunk of an array of `shape` whose elements are `item`
/// bytes: all of them when the array fits in `max` bytes, else as many as fit (at
/// least one), evened out over the chunks that takes so the last pads least.
fn chunk_rows(shape: &[u64], item: u64, max: u64) -> Option<u64> {
    let Some((&rows, rest)) = shape.split_first() else {
        return Some(1);
    };
    let row = rest.iter().try_fold(item, |a, &b| a.checked_mul(b))?;
    if row.checked_mul(rows)? <= max {
        return Some(rows);
    }
    let per = (max / row).max(1);
    let chunks = rows.div_ceil(per);
    Some(rows.div_ceil(chunks))
}

/// The zarr v3 metadata tensorstore writes for orbax's uncompressed arrays (keys in
/// its order; a one-byte type's `bytes` codec has no endianness).
fn zarr_json(dtype_name: &str, fill: &str, item: u64, shape: &[u64], chunk: &[u64]) -> String {
    let list = |v: &[u64]| {
        let s: Vec<String> = v.iter().map(u64::to_string).collect();
        format!("[{}]", s.join(","))
    };
    let (shape, chunk) = (list(shape), list(chunk));
    let bytes = if item == 1 {
        r#"{"name":"bytes"}"#
    } else {
        r#"{"configuration":{"endian":"little"},"name":"bytes"}"#
    };
    format!(
        concat!(
            r#"{{"chunk_grid":{{"configuration":{{"chunk_shape":{chunk}}},"name":"regular"}},"#,
            r#""chunk_key_encoding":{{"name":"default"}},"#,
            r#""codecs":[{{"configuration":{{"chunk_shape":{chunk},"codecs":[{bytes}],"#,
            r#""index_codecs":[{{"configuration":{{"endian":"little"}},"name":"bytes"}},{{"name":"crc32c"}}]}},"#,
            r#""name":"sharding_indexed"}}],"#,
            r#""data_type":"{dtype}","fill_value":{fill},"node_type":"array","shape":{shape},"zarr_format":3}}"#
        ),
        chunk = chunk,
        bytes = bytes,
        dtype = dtype_name,
        fill = fill,
        shape = shape,
    )
}

/// The shard index of a shard holding one inner chunk of `len` bytes at its start.
fn shard_index(len: u64) -> [u8; INDEX_BYTES as usize] {
    let mut b = [0u8; INDEX_BYTES as usize];
    b[8..16].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(&b[..16]);
    b[16..].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The key of chunk `k` (along dimension 0) of array `name` of rank `rank`.
fn chunk_key(name: &str, rank: usize, k: u64) -> String {
    if rank == 0 {
        return format!("{name}/c");
    }
    let mut key = format!("{name}/c/{k}");
    for _ in 1..rank {
        key.push_str("/0");
    }
    key
}

/// Whether `tensors` can be an Orbax item's arrays: names that form orbax's tree
/// ([`check_tree`]), dtypes zarr v3 names, no array without elements.
///
/// # Errors
/// [`Error::InvalidTensor`] naming the first tensor that cannot.
pub(crate) fn check(tensors: &[TensorSpec]) -> Result<()> {
    check_tree(tensors.iter().map(|t| t.name.as_str()))
        .map_err(|(tensor, problem)| Error::InvalidTensor { tensor, problem })?;
    for t in tensors {
        let bad = |problem: String| Error::InvalidTensor {
            tensor: t.name.clone(),
            problem,
        };
        if v3_name(t.dtype).is_none() {
            return Err(bad(format!(
                "{:?} has no zarr v3 data type tensorstore reads: an Orbax checkpoint \
                 cannot hold it (cast it with --dtype)",
                t.dtype
            )));
        }
        if t.shape.contains(&0) {
            return Err(bad(format!(
                "shape {:?} has no elements: orbax saves no empty arrays (`Cannot save \
                 arrays with zero size`); leave it out with --exclude",
                t.shape
            )));
        }
    }
    Ok(())
}

impl OrbaxArraysWriter {
    /// Lays out the database whose manifest is `dest` for `tensors`, with chunks of at
    /// most `max_chunk_bytes` where dimension 0 allows.
    ///
    /// # Errors
    /// A name that cannot be a leaf of orbax's tree, a dtype zarr v3 has no name for,
    /// an array without elements (orbax saves none), I/O errors.
    pub(crate) fn create(
        dest: &Path,
        tensors: &[TensorSpec],
        metadata: &BTreeMap<String, String>,
        max_chunk_bytes: u64,
    ) -> Result<OrbaxArraysWriter> {
        if let Some(grid) = metadata.get(GRID_KEY) {
            return Self::create_sharded(dest, tensors, grid);
        }
        let dir = dest.parent().unwrap_or(Path::new(".")).to_path_buf();
        check(tensors)?;
        let mut db = ckpt_ocdbt::Writer::create(&dir, ckpt_ocdbt::WriterOptions::new())?;
        let mut arrays = Vec::with_capacity(tensors.len());
        let mut chunks = Vec::new();
        for t in tensors {
            // (`check` refused the dtypes without a name.)
            let Some((dtype_name, fill)) = v3_name(t.dtype) else {
                continue;
            };
            let item = item_size(t.dtype);
            let too_big = || overflow(format!("bytes of tensor `{}`", t.name));
            let len = t
                .shape
                .iter()
                .try_fold(item, |a, &b| a.checked_mul(b))
                .ok_or_else(too_big)?;
            let rows = chunk_rows(&t.shape, item, max_chunk_bytes).ok_or_else(too_big)?;
            let mut chunk = t.shape.clone();
            if let Some(first) = chunk.first_mut() {
                *first = rows;
            }
            let chunk_bytes = chunk
                .iter()
                .try_fold(item, |a, &b| a.checked_mul(b))
                .ok_or_else(too_big)?;
            let meta = zarr_json(dtype_name, fill, item, &t.shape, &chunk);
            db.put(format!("{}/zarr.json", t.name).as_bytes(), meta.as_bytes())?;
            let count = t.shape.first().map_or(1, |&d| d.div_ceil(rows));
            let mut offsets = Vec::with_capacity(count as usize);
            for k in 0..count {
                let key = chunk_key(&t.name, t.shape.len(), k);
                let r = db.reserve(key.as_bytes(), chunk_bytes + INDEX_BYTES)?;
                offsets.push(r.offset);
                chunks.push((r.offset + chunk_bytes, chunk_bytes));
            }
            arrays.push(Array {
                len,
                chunk_bytes,
                offsets,
            });
        }
        Self::with_indices(dir, db, arrays, &chunks)
    }

    /// The writer over `db`'s reserved chunks, each chunk's shard index (`(where, the
    /// chunk's bytes)`) already written after its place, so that the copy writes only
    /// the chunks' bytes.
    fn with_indices(
        dir: PathBuf,
        db: ckpt_ocdbt::Writer,
        arrays: Vec<Array>,
        indices: &[(u64, u64)],
    ) -> Result<OrbaxArraysWriter> {
        let data_path = db.data_file().to_path_buf();
        let data = File::options()
            .write(true)
            .open(&data_path)
            .at(&data_path)?;
        for &(at, len) in indices {
            data.write_all_at(&shard_index(len), at).at(&data_path)?;
        }
        Ok(OrbaxArraysWriter {
            dir,
            db: Some(db),
            data,
            data_path,
            arrays,
        })
    }
}

impl OrbaxArraysWriter {
    /// Lays out a sharded item (see the module's doc): `grid` the JSON of [`Grid`]s by
    /// array name, `tensors` one per chunk, named by its key.
    ///
    /// # Errors
    /// A grid that does not parse or does not divide its array, a tensor that is no
    /// chunk of it or of the wrong shape or dtype, a chunk missing or given twice, and
    /// what [`check`] refuses of the arrays; I/O errors.
    fn create_sharded(
        dest: &Path,
        tensors: &[TensorSpec],
        grid: &str,
    ) -> Result<OrbaxArraysWriter> {
        let dir = dest.parent().unwrap_or(Path::new(".")).to_path_buf();
        let bad = |tensor: &str, problem: String| Error::WithPath {
            path: dir.clone(),
            source: Box::new(Error::InvalidTensor {
                tensor: tensor.to_string(),
                problem,
            }),
        };
        let grids: BTreeMap<String, Grid> = serde_json::from_str(grid).map_err(|e| {
            bad(
                GRID_KEY,
                format!("the plan's chunk grid does not parse: {e}"),
            )
        })?;
        // Each chunk's key -> its array, and each array's dtype from its chunks.
        let mut chunk_of: HashMap<String, &str> = HashMap::new();
        for (name, g) in &grids {
            let divides = g.shape.len() == g.chunk.len()
                && g.shape
                    .iter()
                    .zip(&g.chunk)
                    .all(|(&n, &c)| c > 0 && n.is_multiple_of(c));
            if !divides {
                return Err(bad(
                    name,
                    format!(
                        "chunk shape {:?} does not divide shape {:?}",
                        g.chunk, g.shape
                    ),
                ));
            }
            for idx in g.indices() {
                chunk_of.insert(grid_chunk_key(name, &idx), name);
            }
        }
        let mut dtypes: BTreeMap<&str, Dtype> = BTreeMap::new();
        for t in tensors {
            let Some(&array) = chunk_of.get(&t.name) else {
                return Err(bad(
                    &t.name,
                    "is no chunk of the item's arrays (a key or a chunk given twice)".into(),
                ));
            };
            chunk_of.remove(&t.name);
            if t.shape != grids[array].chunk {
                return Err(bad(
                    &t.name,
                    format!(
                        "shape {:?}, but the chunks of `{array}` are {:?}",
                        t.shape, grids[array].chunk
                    ),
                ));
            }
            if *dtypes.entry(array).or_insert(t.dtype) != t.dtype {
                return Err(bad(
                    &t.name,
                    format!("dtype {:?} unlike the other chunks of `{array}`", t.dtype),
                ));
            }
        }
        if let Some(missing) = chunk_of.keys().min() {
            return Err(bad(missing, "chunk missing from the plan".into()));
        }
        let specs: Vec<TensorSpec> = grids
            .iter()
            .filter_map(|(name, g)| {
                let dtype = *dtypes.get(name.as_str())?;
                Some(TensorSpec {
                    name: name.clone(),
                    dtype,
                    shape: g.shape.clone(),
                })
            })
            .collect();
        check(&specs)?;
        let mut db = ckpt_ocdbt::Writer::create(&dir, ckpt_ocdbt::WriterOptions::new())?;
        for s in &specs {
            let Some((dtype_name, fill)) = v3_name(s.dtype) else {
                continue;
            };
            let g = &grids[&s.name];
            let meta = zarr_json(dtype_name, fill, item_size(s.dtype), &g.shape, &g.chunk);
            db.put(format!("{}/zarr.json", s.name).as_bytes(), meta.as_bytes())?;
        }
        let mut arrays = Vec::with_capacity(tensors.len());
        let mut indices = Vec::with_capacity(tensors.len());
        for t in tensors {
            let too_big = || overflow(format!("bytes of chunk `{}`", t.name));
            let chunk_bytes = t
                .shape
                .iter()
                .try_fold(item_size(t.dtype), |a, &b| a.checked_mul(b))
                .ok_or_else(too_big)?;
            let r = db.reserve(
                t.name.as_bytes(),
                chunk_bytes.checked_add(INDEX_BYTES).ok_or_else(too_big)?,
            )?;
            indices.push((r.offset + chunk_bytes, chunk_bytes));
            arrays.push(Array {
                len: chunk_bytes,
                chunk_bytes,
                offsets: vec![r.offset],
            });
        }
        Self::with_indices(dir, db, arrays, &indices)
    }

    /// Array `index`, checking that `len` bytes at `offset` lie inside it.
    fn array(&self, index: usize, offset: u64, len: u64) -> Result<&Array> {
        let a = self.arrays.get(index);
        let fits = |a: &&Array| offset.checked_add(len).is_some_and(|e| e <= a.len);
        a.filter(fits).ok_or_else(|| Error::WithPath {
            path: self.dir.clone(),
            source: Box::new(Error::Unsupported {
                problem: format!(
                    "a write of {len} bytes at {offset} runs past array {index} ({} bytes)",
                    a.map_or(0, |a| a.len)
                ),
            }),
        })
    }
}

impl TensorWriter for OrbaxArraysWriter {
    fn write_at(&self, index: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        self.write_parts_at(index, offset, &[bytes.into()])
            .map(drop)
    }

    /// A chunk holds whole rows of dimension 0, so the tensor's bytes run through its
    /// chunks in order, each chunk a contiguous part: `parts` are cut where a chunk
    /// ends, and each chunk's share written at its place (runs of mapped input files
    /// copied by the kernel).
    fn write_parts_at(&self, index: usize, offset: u64, parts: &[WritePart<'_>]) -> Result<bool> {
        let total: u64 = parts.iter().map(|p| p.bytes.len() as u64).sum();
        let a = self.array(index, offset, total)?;
        let cb = a.chunk_bytes;
        let flush = |batch: &mut Vec<WritePart<'_>>, start: u64| -> Result<()> {
            if batch.is_empty() {
                return Ok(());
            }
            let at = a.offsets[(start / cb) as usize] + start % cb;
            write_parts_to(&self.data, &self.data_path, batch, at)?;
            batch.clear();
            Ok(())
        };
        let mut batch: Vec<WritePart<'_>> = Vec::new();
        let (mut start, mut at) = (offset, offset);
        for p in parts {
            let (mut bytes, mut from) = (p.bytes, p.from);
            while !bytes.is_empty() {
                let chunk_end = (at / cb + 1) * cb;
                let n = bytes.len().min((chunk_end - at) as usize);
                batch.push(WritePart {
                    bytes: &bytes[..n],
                    from,
                });
                bytes = &bytes[n..];
                from = from.map(|(f, o)| (f, o + n as u64));
                at += n as u64;
                if at == chunk_end {
                    flush(&mut batch, start)?;
                    start = at;
                }
            }
        }
        flush(&mut batch, start)?;
        Ok(true)
    }

    fn finish(mut self: Box<Self>) -> Result<()> {
        if let Some(db) = self.db.take() {
            db.finish()?;
        }
        Ok(())
    }
}

impl Drop for OrbaxArraysWriter {
    /// Unfinished, the database is removed: its data file (the manifest is written
    /// only by `finish`).
    fn drop(&mut self) {
        if self.db.take().is_some() {
            let _ = std::fs::remove_file(&self.data_path);
            let _ = std::fs::remove_dir(self.dir.join("d"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cut_dimension_0_evenly() {
        // Fits: one chunk.
        assert_eq!(chunk_rows(&[10, 4], 4, 160), Some(10));
        // 10 rows of 16 bytes, at most 64 bytes: 4 rows would give 4+4+2; 3 chunks of
        // 4 rows are needed either way, evened out to 4 (ceil(10/3)).
        assert_eq!(chunk_rows(&[10, 4], 4, 64), Some(4));
        // 9 rows, at most 4 a chunk: 3 chunks of 3.
        assert_eq!(chunk_rows(&[9, 1], 1, 4), Some(3));
        // A row above the cap: one row a chunk.
        assert_eq!(chunk_rows(&[3, 100], 4, 64), Some(1));
        assert_eq!(chunk_rows(&[], 8, 1), Some(1));
        assert_eq!(chunk_rows(&[u64::MAX, 2], 8, 1), None);
    }

    #[test]
    fn metadata_as_tensorstore_writes_it() {
        // tensorstore 0.1.86's zarr.json for orbax's `use_compression=False`.
        assert_eq!(
            zarr_json("float32", "0.0", 4, &[3, 4], &[3, 4]),
            r#"{"chunk_grid":{"configuration":{"chunk_shape":[3,4]},"name":"regular"},"chunk_key_encoding":{"name":"default"},"codecs":[{"configuration":{"chunk_shape":[3,4],"codecs":[{"configuration":{"endian":"little"},"name":"bytes"}],"index_codecs":[{"configuration":{"endian":"little"},"name":"bytes"},{"name":"crc32c"}]},"name":"sharding_indexed"}],"data_type":"float32","fill_value":0.0,"node_type":"array","shape":[3,4],"zarr_format":3}"#
        );
        assert!(
            zarr_json("bool", "false", 1, &[2], &[2]).contains(r#""codecs":[{"name":"bytes"}]"#)
        );
        // orbax's `params.w` of 48 bytes: index 0, 48, CRC.
        assert_eq!(
            shard_index(48)[..].to_vec(),
            [0, 0, 0, 0, 0, 0, 0, 0, 0x30, 0, 0, 0, 0, 0, 0, 0, 0xc7, 0xf6, 0x06, 0xcb]
        );
        assert_eq!(chunk_key("w", 3, 2), "w/c/2/0/0");
        assert_eq!(chunk_key("step", 0, 0), "step/c");
    }

    /// A sharded item: each tensor one chunk by its key, at its place; a plan whose
    /// tensors are not exactly the grid's chunks is refused naming the chunk.
    #[test]
    fn a_sharded_item_takes_one_tensor_per_chunk_and_refuses_other_plans() {
        use crate::layout::Dtype;
        let tmp = tempfile::tempdir().unwrap();
        let spec = |name: &str, shape: Vec<u64>| TensorSpec {
            name: name.into(),
            dtype: Dtype::U8,
            shape,
        };
        let grid = r#"{"w":{"shape":[4,6],"chunk":[2,3]}}"#;
        let meta = BTreeMap::from([(GRID_KEY.to_string(), grid.to_string())]);
        let keys = ["w/c/0/0", "w/c/0/1", "w/c/1/0", "w/c/1/1"];
        let specs: Vec<TensorSpec> = keys.iter().map(|k| spec(k, vec![2, 3])).collect();
        let dest = tmp.path().join("ok").join(MANIFEST_FILE);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        let w = OrbaxArraysWriter::create(&dest, &specs, &meta, u64::MAX).unwrap();
        for i in 0..4u8 {
            w.write_at(usize::from(i), 0, &[i; 6]).unwrap();
        }
        assert!(w.write_at(0, 1, &[0; 6]).is_err());
        Box::new(w).finish().unwrap();
        let db = ckpt_ocdbt::Database::open(dest.parent().unwrap()).unwrap();
        for (i, k) in keys.iter().enumerate() {
            let v = db.get(k.as_bytes()).unwrap().unwrap();
            assert_eq!(v[..6], [i as u8; 6], "{k}");
            assert_eq!(v[6..], shard_index(6), "{k}");
        }
        let meta_json = String::from_utf8(db.get(b"w/zarr.json").unwrap().unwrap()).unwrap();
        assert!(
            meta_json.contains(r#""chunk_shape":[2,3]"#) && meta_json.contains(r#""shape":[4,6]"#)
        );
        let refused = |specs: &[TensorSpec], grid: &str, dir: &str| {
            let dest = tmp.path().join(dir).join(MANIFEST_FILE);
            std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
            let meta = BTreeMap::from([(GRID_KEY.to_string(), grid.to_string())]);
            let e = OrbaxArraysWriter::create(&dest, specs, &meta, u64::MAX).unwrap_err();
            assert_eq!(
                std::fs::read_dir(dest.parent().unwrap()).unwrap().count(),
                0
            );
            e.to_string()
        };
        let e = refused(&specs[..3], grid, "missing");
        assert!(e.contains("w/c/1/1") && e.contains("missing"), "{e}");
        let mut wrong = specs.clone();
        wrong[2].shape = vec![3, 2];
        let e = refused(&wrong, grid, "shape");
        assert!(e.contains("w/c/1/0") && e.contains("[2, 3]"), "{e}");
        let e = refused(&specs, r#"{"w":{"shape":[4,6],"chunk":[3,3]}}"#, "grid");
        assert!(e.contains("`w`") && e.contains("does not divide"), "{e}");
    }

    #[test]
    fn bytes_land_in_their_chunks_whatever_the_cuts() {
        use crate::layout::Dtype;
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("item").join(MANIFEST_FILE);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        let spec = |name: &str, shape: Vec<u64>| TensorSpec {
            name: name.into(),
            dtype: Dtype::U16,
            shape,
        };
        // 7 rows of 6 bytes in chunks of at most 16 bytes: 4 chunks of 2 rows, the
        // last padded by one row.
        let specs = [spec("p.w", vec![7, 3]), spec("s", vec![])];
        let w = OrbaxArraysWriter::create(&dest, &specs, &BTreeMap::new(), 16).unwrap();
        let data: Vec<u8> = (0..42).collect();
        // Parts of 5, 11 and 20 bytes from offset 3: they straddle every chunk edge.
        let (a, rest) = data[3..].split_at(5);
        let (b, c) = rest.split_at(11);
        w.write_parts_at(0, 3, &[a.into(), b.into(), c[..20].into()])
            .unwrap();
        w.write_at(0, 0, &data[..3]).unwrap();
        w.write_at(0, 39, &data[39..]).unwrap();
        assert!(w.write_at(0, 40, &[0; 3]).is_err());
        w.write_at(1, 0, &[9, 0]).unwrap();
        Box::new(w).finish().unwrap();
        let db = ckpt_ocdbt::Database::open(dest.parent().unwrap()).unwrap();
        let value = |key: &str| db.get(key.as_bytes()).unwrap().unwrap();
        for k in 0..4u64 {
            let v = value(&format!("p.w/c/{k}/0"));
            assert_eq!(v.len(), 12 + 20);
            let want: Vec<u8> = (k * 12..k * 12 + 12)
                .map(|i| if i < 42 { i as u8 } else { 0 })
                .collect();
            assert_eq!(v[..12], want[..], "chunk {k}");
            assert_eq!(v[12..], shard_index(12));
        }
        assert_eq!(value("s/c")[..2], [9, 0]);
        let meta = String::from_utf8(value("p.w/zarr.json")).unwrap();
        assert!(meta.contains(r#""chunk_shape":[2,3]"#), "{meta}");

        // Dropped unfinished: no data file left, and no manifest.
        let dest = tmp.path().join("other").join(MANIFEST_FILE);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        drop(OrbaxArraysWriter::create(&dest, &specs, &BTreeMap::new(), 16).unwrap());
        assert_eq!(
            std::fs::read_dir(dest.parent().unwrap()).unwrap().count(),
            0
        );
    }
}

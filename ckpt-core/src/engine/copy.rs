//! Carries out a [`CopyPlan`]: every output tensor is cut into slabs of at most
//! [`SLAB_BYTES`], each slab is gathered from the mapped sources by contiguous runs into
//! a buffer and written at its final place with one positional write. Slabs run in
//! parallel (rayon) across tensors and within large ones; memory stays at a few slabs
//! per thread whatever the checkpoint's size.

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::{create_writer, Compression, ReadCache, TensorSpec, TensorWriter};
use crate::layout::plan::{bytes_of, plan_region, CopyOp, CopyPlan, TensorPlan};
use crate::layout::region::{Dims, Region, Runs};
use crate::layout::source::Computed;
use crate::layout::Dtype;
use rayon::prelude::*;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

impl std::ops::AddAssign for CopyStats {
    fn add_assign(&mut self, o: CopyStats) {
        self.tensors += o.tensors;
        self.bytes_written += o.bytes_written;
        self.bytes_read += o.bytes_read;
        self.sync_micros += o.sync_micros;
        self.checksums_verified += o.checksums_verified;
        self.checksums_unchecked += o.checksums_unchecked;
    }
}

pub use crate::formats::SLAB_BYTES;

/// What a copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Output tensors written.
    pub tensors: u64,
    /// Bytes of tensor data written.
    pub bytes_written: u64,
    /// Bytes of tensor data read.
    pub bytes_read: u64,
    /// Time spent making the output durable (fsync before rename), in microseconds.
    pub sync_micros: u64,
    /// Source tensors read whole whose recorded checksums were checked.
    pub checksums_verified: u64,
    /// Source tensors with a recorded checksum that were read only in part, so that
    /// their checksums could not be checked (`--rank`, slices of a larger tensor).
    pub checksums_unchecked: u64,
}

/// Splits a tensor of `shape` into boxes that are contiguous in row-major order and
/// hold at most `max_bytes` (at least one innermost row each).
pub(super) fn slabs(shape: &[u64], dtype: Dtype, max_bytes: u64) -> Vec<Region> {
    let n = shape.len();
    if n == 0 || shape.contains(&0) {
        return if shape.contains(&0) {
            vec![]
        } else {
            vec![Region::full(shape)]
        };
    }
    if !dtype.bitsize().is_multiple_of(8) {
        // Sub-byte types: one slab, so no slab edge falls inside a byte.
        return vec![Region::full(shape)];
    }
    // Find the outermost dimension d whose trailing block fits, and cut along it.
    let mut inner = bytes_of(dtype, 1);
    let mut d = n - 1;
    while d > 0 && inner * shape[d] <= max_bytes {
        inner *= shape[d];
        d -= 1;
    }
    let step = (max_bytes / inner).clamp(1, shape[d]);
    let mut out = Vec::new();
    let outer: Vec<u64> = shape[..d].to_vec();
    let mut idx = vec![0u64; d];
    loop {
        let mut lo = 0;
        while lo < shape[d] {
            let hi = (lo + step).min(shape[d]);
            let mut start = idx.clone();
            start.push(lo);
            start.extend(std::iter::repeat_n(0, n - d - 1));
            let mut ext = vec![1; d];
            ext.push(hi - lo);
            ext.extend_from_slice(&shape[d + 1..]);
            out.push(Region::new(start, ext));
            lo = hi;
        }
        let mut k = d;
        loop {
            if k == 0 {
                return out;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < outer[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// Converts `n` elements from `src` (dtype `from`) into `dst` (dtype `to`).
fn convert(src: &[u8], from: Dtype, dst: &mut [u8], to: Dtype) {
    use half::{bf16, f16};
    let read = |i: usize| -> f64 {
        match from {
            Dtype::F16 => f16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f64(),
            Dtype::BF16 => bf16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f64(),
            Dtype::F32 => f64::from(f32::from_le_bytes(
                src[4 * i..4 * i + 4].try_into().unwrap_or_default(),
            )),
            _ => f64::from_le_bytes(src[8 * i..8 * i + 8].try_into().unwrap_or_default()),
        }
    };
    let n = src.len() / (from.bitsize() / 8);
    for i in 0..n {
        // Via f32 when the source fits in it, so f32->bf16 rounds once, as torch does.
        let v = read(i);
        match to {
            Dtype::F16 => {
                dst[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v as f32).to_le_bytes())
            }
            Dtype::BF16 => {
                dst[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v as f32).to_le_bytes())
            }
            Dtype::F32 => dst[4 * i..4 * i + 4].copy_from_slice(&(v as f32).to_le_bytes()),
            _ => dst[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes()),
        }
    }
}

/// Fills `buf` with the slab `slab` of the tensor `t` (local coordinates), reading the
/// sources' bytes (mapped, or decompressed through `cache`); returns the bytes read.
/// Mapped source pages are released as consumed.
fn fill_slab(
    source: &Checkpoint,
    t: &TensorPlan,
    slab: &Region,
    buf: &mut [u8],
    cache: &mut ReadCache,
) -> Result<u64> {
    let sbits = t.src_dtype.bitsize() as u64;
    let dbits = t.target.dtype.bitsize() as u64;
    let mut read = 0;
    for op in &t.ops {
        let dst_box = op.dst_box();
        let Some(part) = dst_box.overlap(slab) else {
            continue;
        };
        let src_start = op.src_start_of(&part);
        let dst_start: Vec<u64> = part
            .start
            .iter()
            .zip(&slab.start)
            .map(|(p, s)| p - s)
            .collect();
        if let Some(c) = &op.compute {
            read += fill_computed(
                source, t, c, &part, &src_start, slab, &dst_start, buf, cache,
            )?;
            continue;
        }
        let file = &source.files[op.file];
        if let Some(axes) = &op.axes {
            read += fill_permuted(
                source, t, op, axes, &part, &src_start, slab, &dst_start, buf, cache,
            )?;
            continue;
        }
        let (mut lo, mut hi) = (u64::MAX, 0u64);
        for run in Runs::new(
            &part.shape,
            &op.src_shape,
            &src_start,
            &slab.shape,
            &dst_start,
        ) {
            let s0 = run.src * sbits / 8;
            let s1 = (run.src + run.len) * sbits / 8;
            let d0 = (run.dst * dbits / 8) as usize;
            let d1 = ((run.dst + run.len) * dbits / 8) as usize;
            if t.src_dtype == t.target.dtype {
                file.read_into(op.tensor, s0..s1, &mut buf[d0..d1], cache)?;
            } else {
                let from = file.read(op.tensor, s0..s1, cache)?;
                convert(from, t.src_dtype, &mut buf[d0..d1], t.target.dtype);
            }
            lo = lo.min(s0);
            hi = hi.max(s1);
            read += s1 - s0;
        }
        if hi > lo {
            file.release(op.tensor, lo..hi);
        }
    }
    Ok(read)
}

/// [`fill_slab`]'s copy of `part` (a box of the slab, in the target's coordinates)
/// from a computed piece: each input's box that `part` needs assembled through its own
/// plan (any layout, the same reads as a copy), the operation run on them, and the
/// result placed like read bytes (converted when the target's dtype differs). Returns
/// the bytes read.
#[allow(clippy::too_many_arguments)]
fn fill_computed(
    source: &Checkpoint,
    t: &TensorPlan,
    c: &Computed,
    part: &Region,
    src_start: &[u64],
    slab: &Region,
    dst_start: &[u64],
    buf: &mut [u8],
    cache: &mut ReadCache,
) -> Result<u64> {
    // The part in the computed tensor's global coordinates.
    let out = Region::new(Dims::from_slice(src_start), part.shape.clone());
    let mut read = 0;
    let mut inputs: Vec<(Region, Vec<u8>)> = Vec::with_capacity(c.inputs.len());
    for (i, input) in c.inputs.iter().enumerate() {
        let region = c.op.input_region(i, &out, &input.region);
        let dtype = c.op.input_dtype(i, t.src_dtype);
        let plan = plan_region(source, &input.name, &input.tensor, &region, dtype)?;
        let mut bytes = scratch(bytes_of(dtype, region.numel()) as usize);
        read += fill_slab(
            source,
            &plan,
            &Region::full(&region.shape),
            &mut bytes,
            cache,
        )?;
        inputs.push((region, bytes));
    }
    let views: Vec<(Region, &[u8])> = inputs.iter().map(|(r, b)| (r.clone(), &b[..])).collect();
    // A part that is the whole slab, in the slab's dtype, is computed in place.
    let in_place = t.src_dtype == t.target.dtype && part.shape == slab.shape;
    let mut computed = if in_place {
        Vec::new()
    } else {
        scratch(bytes_of(t.src_dtype, out.numel()) as usize)
    };
    let into: &mut [u8] = if in_place { buf } else { &mut computed };
    let done =
        c.op.compute(&out, &views, t.src_dtype, into)
            .map_err(|e| Error::InvalidTensor {
                tensor: t.target.name.clone(),
                problem: e.to_string(),
            });
    drop(views);
    inputs.into_iter().for_each(|(_, b)| give_back(b));
    done?;
    if in_place {
        return Ok(read);
    }
    let (sbits, dbits) = (
        t.src_dtype.bitsize() as u64,
        t.target.dtype.bitsize() as u64,
    );
    let origin = vec![0; out.ndim()];
    for run in Runs::new(&part.shape, &part.shape, &origin, &slab.shape, dst_start) {
        let (s0, s1) = (
            (run.src * sbits / 8) as usize,
            ((run.src + run.len) * sbits / 8) as usize,
        );
        let (d0, d1) = (
            (run.dst * dbits / 8) as usize,
            ((run.dst + run.len) * dbits / 8) as usize,
        );
        if t.src_dtype == t.target.dtype {
            buf[d0..d1].copy_from_slice(&computed[s0..s1]);
        } else {
            convert(
                &computed[s0..s1],
                t.src_dtype,
                &mut buf[d0..d1],
                t.target.dtype,
            );
        }
    }
    give_back(computed);
    Ok(read)
}

thread_local! {
    /// Buffers of computed parts, reused on the thread: a part's inputs and result are
    /// slab-sized, and fresh ones each time were mapped, zeroed and unmapped by the
    /// kernel (a fifth of a LoRA merge's time).
    static SCRATCH: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer of `len` bytes from the thread's [`SCRATCH`].
fn scratch(len: usize) -> Vec<u8> {
    let mut b = SCRATCH
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default();
    // Only grown bytes are zeroed: every user overwrites the whole buffer (an input's
    // plan tiles its box; the operation writes every element of its part), so what a
    // reused buffer held never shows.
    if b.len() > len {
        b.truncate(len);
    } else {
        b.resize(len, 0);
    }
    b
}

/// Returns a [`scratch`] buffer (a few are kept).
fn give_back(b: Vec<u8>) {
    let _ = SCRATCH.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < 8 {
            s.push(b);
        }
    });
}

/// [`fill_slab`]'s copy of `part` (a box of the slab, in the target's coordinates)
/// from an op whose source box is permuted ([`CopyOp::axes`]): the source box is read
/// by its runs into a buffer, in the stored order, and each element put at its place
/// in the slab (converted when the dtypes differ). Returns the bytes read.
#[allow(clippy::too_many_arguments)]
fn fill_permuted(
    source: &Checkpoint,
    t: &TensorPlan,
    op: &CopyOp,
    axes: &[usize],
    part: &Region,
    src_start: &[u64],
    slab: &Region,
    dst_start: &[u64],
    buf: &mut [u8],
    cache: &mut ReadCache,
) -> Result<u64> {
    let file = &source.files[op.file];
    let stored = op.stored_box(&Region::new(src_start.to_vec(), part.shape.clone()));
    let (sbytes, dbytes) = (t.src_dtype.bitsize() / 8, t.target.dtype.bitsize() / 8);
    let row_major = |shape: &[u64]| -> Vec<usize> {
        crate::layout::region::strides(shape)
            .into_iter()
            .map(|s| s as usize)
            .collect()
    };
    // Where the box and the op's whole box lie in the stored tensor.
    let full = row_major(&op.src_shape);
    let whole = op.stored_box(&op.src);
    let (Some(begin), Some(span)) = (
        stored.element_span(&op.src_shape),
        whole.element_span(&op.src_shape),
    ) else {
        return Ok(0);
    };
    // The source elements: the mapped tensor itself, or (compressed) the box gathered
    // by its runs, in the stored order; where the box starts there and its strides.
    let gathered;
    let (elements, first, strides) = match file.data(op.tensor) {
        Some(bytes) => (bytes, begin.start as usize, full),
        None => {
            let mut buf = vec![0u8; stored.numel() as usize * sbytes];
            let zeros = vec![0; stored.ndim()];
            for run in Runs::new(
                &stored.shape,
                &op.src_shape,
                &stored.start,
                &stored.shape,
                &zeros,
            ) {
                let (s0, s1) = (run.src * sbytes as u64, (run.src + run.len) * sbytes as u64);
                let d0 = run.dst as usize * sbytes;
                file.read_into(
                    op.tensor,
                    s0..s1,
                    &mut buf[d0..d0 + (s1 - s0) as usize],
                    cache,
                )?;
            }
            gathered = buf;
            (&gathered[..], 0, row_major(&stored.shape))
        }
    };
    let from: Vec<usize> = axes.iter().map(|&a| strides[a]).collect();
    let to: Vec<usize> = row_major(&slab.shape);
    let shape: Vec<usize> = part.shape.iter().map(|&s| s as usize).collect();
    let at: Vec<usize> = dst_start.iter().map(|&s| s as usize).collect();
    let (from_dtype, to_dtype) = (t.src_dtype, t.target.dtype);
    // The last two dimensions of the part as tiles (a transpose reads one with a long
    // stride: tiles keep both sides in cache), the outer ones by an odometer.
    let n = shape.len();
    let mut index = vec![0usize; n - 2];
    loop {
        let mut f = first;
        let mut d = at[n - 1] + at[n - 2] * to[n - 2];
        for k in 0..n - 2 {
            f += index[k] * from[k];
            d += (at[k] + index[k]) * to[k];
        }
        let plane = Plane {
            rows: shape[n - 2],
            cols: shape[n - 1],
            from: (f, from[n - 2], from[n - 1]),
            to: (d, to[n - 2]),
        };
        match (from_dtype == to_dtype, sbytes) {
            (true, 2) => plane.copy::<2>(elements, buf),
            (true, 4) => plane.copy::<4>(elements, buf),
            (true, 8) => plane.copy::<8>(elements, buf),
            (true, 1) => plane.copy::<1>(elements, buf),
            _ => plane.each(|s, d| {
                convert(
                    &elements[s * sbytes..(s + 1) * sbytes],
                    from_dtype,
                    &mut buf[d * dbytes..(d + 1) * dbytes],
                    to_dtype,
                );
            }),
        }
        // The odometer over the outer dimensions, last fastest.
        let mut k = n - 2;
        loop {
            if k == 0 {
                // The op's stored span leaves the resident set once all of it is read.
                let (bytes, read) = (sbytes as u64, stored.numel() * sbytes as u64);
                file.release_when_read(
                    op.tensor,
                    span.start * bytes..span.end * bytes,
                    whole.numel() * bytes,
                    read,
                );
                return Ok(read);
            }
            k -= 1;
            index[k] += 1;
            if index[k] < shape[k] {
                break;
            }
            index[k] = 0;
        }
    }
}

/// A 2-D strided copy: element `(i, j)` of a `rows x cols` plane from element
/// `from.0 + i*from.1 + j*from.2` of a source to element `to.0 + i*to.1 + j` of a
/// destination, in tiles.
struct Plane {
    rows: usize,
    cols: usize,
    from: (usize, usize, usize),
    to: (usize, usize),
}

impl Plane {
    /// Elements a side of a tile. A transpose's rows lie a power of two apart (4 KiB,
    /// 32 KiB), in one cache set, so a tile's lines must fit the L1 cache's ways: 32 x 32
    /// tiles thrashed it (twice the user time of 8 x 8, docs/moe.md "Speed").
    const TILE: usize = 8;

    /// Calls `put(source element, destination element)` for every element, tile by
    /// tile.
    fn each(&self, mut put: impl FnMut(usize, usize)) {
        let (f0, fi, fj) = self.from;
        let (t0, ti) = self.to;
        for i0 in (0..self.rows).step_by(Self::TILE) {
            for j0 in (0..self.cols).step_by(Self::TILE) {
                for i in i0..(i0 + Self::TILE).min(self.rows) {
                    for j in j0..(j0 + Self::TILE).min(self.cols) {
                        put(f0 + i * fi + j * fj, t0 + i * ti + j);
                    }
                }
            }
        }
    }

    /// [`Plane::each`] copying elements of `N` bytes. A transpose's source is
    /// contiguous down the destination's columns (`from.1 == 1`): each tile then reads
    /// a run of the source per column.
    fn copy<const N: usize>(&self, src: &[u8], dst: &mut [u8]) {
        let (f0, fi, fj) = self.from;
        let (t0, ti) = self.to;
        if fi != 1 {
            return self.each(|s, d| {
                dst[d * N..d * N + N].copy_from_slice(&src[s * N..s * N + N]);
            });
        }
        for i0 in (0..self.rows).step_by(Self::TILE) {
            let i1 = (i0 + Self::TILE).min(self.rows);
            for j0 in (0..self.cols).step_by(Self::TILE) {
                for j in j0..(j0 + Self::TILE).min(self.cols) {
                    let s = f0 + j * fj;
                    let column = &src[(s + i0) * N..(s + i1) * N];
                    for (k, e) in column.chunks_exact(N).enumerate() {
                        let d = t0 + (i0 + k) * ti + j;
                        dst[d * N..d * N + N].copy_from_slice(e);
                    }
                }
            }
        }
    }
}

/// Writes the plan's files into `out_dir` (which must exist), calling `progress` with
/// the bytes of each finished slab. Files are written under temporary names and renamed
/// only once complete and synced.
///
/// # Errors
/// I/O errors, with the path.
pub fn execute(
    plan: &CopyPlan,
    source: &Checkpoint,
    out_dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<CopyStats> {
    execute_with(plan, source, out_dir, progress, None)
}

/// [`execute`], writing every file compressed (`.ckptz`) when `compression` is given.
///
/// # Errors
/// I/O errors, with the path.
pub fn execute_with(
    plan: &CopyPlan,
    source: &Checkpoint,
    out_dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
    compression: Option<Compression>,
) -> Result<CopyStats> {
    let mut writers = Vec::with_capacity(plan.files.len());
    for f in &plan.files {
        let specs: Vec<TensorSpec> = f
            .tensors
            .iter()
            .map(|t| TensorSpec {
                name: t.target.name.clone(),
                dtype: t.target.dtype,
                shape: t
                    .stored_shape
                    .clone()
                    .unwrap_or_else(|| t.target.shape.clone()),
            })
            .collect();
        let path = out_dir.join(&f.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|source| Error::Io {
                path: parent.into(),
                source,
            })?;
        }
        writers.push(create_writer(&path, &specs, &f.metadata, compression)?);
    }
    let mut jobs: Vec<(usize, usize, Region)> = Vec::new();
    for (fi, f) in plan.files.iter().enumerate() {
        for (ti, t) in f.tensors.iter().enumerate() {
            for s in slabs(&t.target.shape, t.target.dtype, SLAB_BYTES) {
                jobs.push((fi, ti, s));
            }
        }
    }
    // Compressed sources: slabs that read the same chunks run one after the other, so
    // that each chunk is decompressed once while a thread's cache still holds it (in
    // plan order, a chunk of a column-sharded source feeds one slab of every target
    // rank, far apart). Positional writes do not care about the order.
    let mut cached_chunks = crate::formats::CACHED_CHUNKS;
    if source.files.iter().any(|f| f.is_compressed()) {
        jobs.sort_by_cached_key(|(fi, ti, slab)| first_source(&plan.files[*fi].tensors[*ti], slab));
        // Jobs in that order read the chunks of the one before them: a cache of the
        // chunks one slab reads (two per source piece, for a piece that straddles two
        // chunks) decodes each chunk once, and more would only hold memory.
        let widest = jobs
            .iter()
            .map(|(fi, ti, slab)| pieces_read(&plan.files[*fi].tensors[*ti], slab))
            .max()
            .unwrap_or(0);
        cached_chunks = (2 * widest).clamp(2, crate::formats::CACHED_CHUNKS);
    } else if source.files.iter().any(|f| f.is_remote()) {
        // Objects in a bucket: in order of position in their files, all files abreast,
        // so that every object is read front to back by a stream of few requests (in
        // plan order a file is read where its tensors fall in the output's order, and
        // jumping about costs a request each time).
        jobs.sort_by_cached_key(|(fi, ti, slab)| {
            let t = &plan.files[*fi].tensors[*ti];
            let (f, tensor, offset) = first_source(t, slab);
            let at = source
                .files
                .get(f)
                .and_then(|file| file.tensors().get(tensor))
                .map_or(u64::MAX, |e| {
                    e.start.saturating_add(bytes_of(t.src_dtype, offset))
                });
            (at, f)
        });
    }
    // Source tensors read whole have their recorded checksums checked while they are
    // copied, over the same mapped pages; those read only in part cannot be.
    let tensors = || plan.files.iter().flat_map(|f| &f.tensors);
    let computed = computed_reads(source, tensors())?;
    let crate::layout::plan::TensorsRead {
        read: touched,
        whole,
    } = crate::layout::plan::tensors_read(
        tensors()
            .flat_map(|t| &t.ops)
            .filter(|op| op.compute.is_none())
            .chain(&computed),
    );
    // The bytes of an object in a bucket that no slab reads (tensors left out) are
    // consumed from the start: its blocks then leave the pager's budget once the rest
    // of them is read, instead of holding it until evicted.
    for (f, file) in source.files.iter().enumerate() {
        if file.is_remote() {
            for (t, e) in file.tensors().iter().enumerate() {
                if !touched.contains(&(f, t)) {
                    file.release(t, 0..e.end.saturating_sub(e.start));
                }
            }
        }
    }
    let checking = crate::formats::checksum::checksums_enabled();
    let has_sum = |&(f, t): &(usize, usize)| source.files[f].checksum(t).is_some();
    let to_check: Vec<(usize, usize)> = if checking {
        whole.iter().copied().filter(has_sum).collect()
    } else {
        Vec::new()
    };
    let unchecked = if checking {
        touched.difference(&whole).filter(|k| has_sum(k)).count() as u64
    } else {
        0
    };
    // For the bus-error test: another program truncating an input before it is read.
    if let Some(victim) = std::env::var_os("CKPT_TEST_TRUNCATE_BEFORE_COPY") {
        if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&victim) {
            let _ = f.set_len(f.metadata().map_or(0, |m| m.len() / 2));
        }
    }
    // Mapped local sources are hashed alongside the copy; objects in a bucket by the
    // copy itself, from the runs it reads (a pass of its own would fetch them twice:
    // `read_sums`); compressed ones after it, from the checksums of their chunks taken
    // as the copy decompressed them (hashing them alongside would decompress everything
    // twice).
    let (after, mapped): (Vec<_>, Vec<_>) = to_check
        .iter()
        .partition(|&&(f, _)| source.files[f].is_compressed());
    let (remote, alongside): (Vec<_>, Vec<_>) = mapped
        .into_iter()
        .partition(|&&(f, _)| source.files[f].is_remote());
    let sums = super::read_sums::ReadSums::of(remote.iter().map(|&&k| k));
    let read = AtomicU64::new(0);
    let (copied, checked) = rayon::join(
        || {
            copy_slabs(
                plan,
                source,
                &writers,
                &jobs,
                &read,
                progress,
                &sums,
                cached_chunks,
            )
        },
        || {
            alongside
                .par_iter()
                .try_for_each(|&&(f, t)| source.files[f].check_checksum(t).map(|_| ()))
        },
    );
    copied?;
    checked?;
    let summed = sums.whole(|f, t| {
        source.files[f]
            .tensors()
            .get(t)
            .map_or(0, |e| e.end.saturating_sub(e.start))
    });
    remote.par_iter().try_for_each(|&&(f, t)| {
        match summed.get(&(f, t)) {
            Some(&got) => source.files[f].check_read_checksum(t, got),
            // Read in part by the gathered path (a cast, a view): read again.
            None => source.files[f].check_checksum(t),
        }
        .map(|_| ())
    })?;
    after
        .par_iter()
        .try_for_each(|&&(f, t)| source.files[f].check_checksum_after_read(t).map(|_| ()))?;
    let t = std::time::Instant::now();
    // All files at once: each finish waits for its file's writeback (fsync), and the
    // disk takes the files' writeback together better than one after the other. The
    // first error in file order is reported, as when they finished in turn.
    writers
        .into_par_iter()
        .map(|w| w.finish())
        .collect::<Vec<Result<()>>>()
        .into_iter()
        .collect::<Result<()>>()?;
    Ok(CopyStats {
        tensors: plan.tensor_count() as u64,
        bytes_written: plan.bytes_written(),
        bytes_read: read.load(Ordering::Relaxed),
        sync_micros: t.elapsed().as_micros() as u64,
        checksums_verified: to_check.len() as u64,
        checksums_unchecked: unchecked,
    })
}

/// The copies of stored bytes that the computed boxes of `tensors` make: the ops that
/// read their inputs' boxes (what a computation reads of the files), so that a stored
/// tensor a computation reads whole has its checksum checked like one copied whole.
/// Plain copies are not repeated here: they stand in the plan already.
///
/// # Errors
/// An input box the source cannot give (as the copy itself would fail).
fn computed_reads<'a>(
    source: &Checkpoint,
    tensors: impl IntoIterator<Item = &'a TensorPlan>,
) -> Result<Vec<CopyOp>> {
    fn add(source: &Checkpoint, t: &TensorPlan, out: &mut Vec<CopyOp>) -> Result<()> {
        for op in &t.ops {
            let Some(c) = &op.compute else { continue };
            for (i, input) in c.inputs.iter().enumerate() {
                let region = c.op.input_region(i, &op.src, &input.region);
                let dtype = c.op.input_dtype(i, t.src_dtype);
                let plan = plan_region(source, &input.name, &input.tensor, &region, dtype)?;
                out.extend(plan.ops.iter().filter(|o| o.compute.is_none()).cloned());
                add(source, &plan, out)?;
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for t in tensors {
        add(source, t, &mut out)?;
    }
    Ok(out)
}

/// Where a slab's first source bytes are: `(file, tensor, element offset)`.
fn first_source(t: &TensorPlan, slab: &Region) -> (usize, usize, u64) {
    for op in &t.ops {
        let dst_box = op.dst_box();
        if let Some(part) = dst_box.overlap(slab) {
            let start = op
                .stored_box(&Region::new(op.src_start_of(&part), part.shape))
                .start;
            return (op.file, op.tensor, slab_offset(&op.src_shape, &start));
        }
    }
    (usize::MAX, usize::MAX, 0)
}

/// How many source pieces a slab of `t` reads: its plain ops', and every piece of a
/// computed op's inputs.
fn pieces_read(t: &TensorPlan, slab: &Region) -> usize {
    t.ops
        .iter()
        .filter(|op| op.dst_box().overlap(slab).is_some())
        .map(|op| match &op.compute {
            None => 1,
            Some(c) => c.inputs.iter().map(|i| i.tensor.pieces.len().max(1)).sum(),
        })
        .sum()
}

/// Copies every slab job into its writer, each thread keeping `cached_chunks` decoded
/// chunks of compressed sources.
#[allow(clippy::too_many_arguments)]
fn copy_slabs(
    plan: &CopyPlan,
    source: &Checkpoint,
    writers: &[Box<dyn TensorWriter>],
    jobs: &[(usize, usize, Region)],
    read: &AtomicU64,
    progress: &(dyn Fn(u64) + Sync),
    sums: &super::read_sums::ReadSums,
    cached_chunks: usize,
) -> Result<()> {
    // The slab buffer lives in the thread's cache, reused from job to job.
    jobs.par_iter().try_for_each_init(
        || {
            let mut cache = ReadCache::new();
            cache.keep(cached_chunks);
            cache
        },
        |cache: &mut ReadCache, (fi, ti, slab)| -> Result<()> {
            let t = &plan.files[*fi].tensors[*ti];
            let len = bytes_of(t.target.dtype, slab.numel()) as usize;
            let at = bytes_of(t.target.dtype, slab_offset(&t.target.shape, &slab.start));
            // Straight from the mapped inputs when the slab is plain runs of them. A
            // failed direct write is redone by the gathered path below: an input
            // truncated under us then faults in this process, and the SIGBUS handler
            // names it (the kernel would only have failed the write with EFAULT); any
            // other error comes back from that path's write.
            if let Some(runs) = super::direct::slab_runs(source, t, slab, len as u64) {
                if let Ok(Some(n)) =
                    super::direct::write_runs(source, &*writers[*fi], *ti, at, &runs, sums)
                {
                    read.fetch_add(n, Ordering::Relaxed);
                    progress(len as u64);
                    return Ok(());
                }
            }
            let mut buf = std::mem::take(&mut cache.slab);
            buf.clear();
            buf.resize(len, 0);
            let r = fill_slab(source, t, slab, &mut buf, cache).and_then(|n| {
                read.fetch_add(n, Ordering::Relaxed);
                writers[*fi].write_at(*ti, at, &buf)
            });
            cache.slab = buf;
            r?;
            progress(len as u64);
            Ok(())
        },
    )
}

/// Assembles one tensor in memory (for loading straight into a model).
///
/// # Errors
/// A damaged compressed source; I/O errors.
pub fn assemble(t: &TensorPlan, source: &Checkpoint) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; bytes_of(t.target.dtype, t.target.shape.iter().product()) as usize];
    assemble_into(t, source, &mut buf)?;
    Ok(buf)
}

/// [`assemble`] into memory the caller owns (a framework's tensor), which must be
/// exactly the tensor's size.
///
/// # Errors
/// A `dst` of another size; a damaged compressed source; I/O errors.
pub fn assemble_into(t: &TensorPlan, source: &Checkpoint, dst: &mut [u8]) -> Result<()> {
    // The whole tensor is its one part (its element count checked first: a part's is
    // then within it).
    t.target
        .shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| crate::error::overflow(format!("elements of `{}`", t.target.name)))?;
    assemble_part_into(t, source, &Region::full(&t.target.shape), dst)
}

/// One part of a tensor's load through a bounded buffer: a box of the tensor that is
/// contiguous in row-major order, and where its bytes lie in the tensor's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPart {
    /// The box, in the tensor's coordinates.
    pub region: Region,
    /// Byte offset of the part in the tensor's row-major bytes.
    pub offset: u64,
    /// Its bytes.
    pub bytes: u64,
}

/// The parts of `t`, in order, each at most `max_bytes` (but at least one innermost
/// row, and a sub-byte tensor whole, so that no part edge falls inside a byte): they
/// tile the tensor, so loading every part loads it.
#[must_use]
pub fn tensor_parts(t: &TensorPlan, max_bytes: u64) -> Vec<TensorPart> {
    let shape = &t.target.shape;
    let dtype = t.target.dtype;
    slabs(shape, dtype, max_bytes.max(1))
        .into_iter()
        .map(|region| TensorPart {
            offset: bytes_of(dtype, slab_offset(shape, &region.start)),
            bytes: bytes_of(dtype, region.numel()),
            region,
        })
        .collect()
}

/// Assembles one part of `t` ([`tensor_parts`]) into `dst`, which holds exactly its
/// bytes; mapped source pages are released as they are consumed, so a load part by
/// part holds a bounded window of the sources.
///
/// # Errors
/// `dst` of another size; read errors, with the file.
pub fn assemble_part_into(
    t: &TensorPlan,
    source: &Checkpoint,
    part: &Region,
    dst: &mut [u8],
) -> Result<()> {
    let want = bytes_of(t.target.dtype, part.numel());
    if want != dst.len() as u64 {
        return Err(Error::Mismatch {
            what: format!(
                "tensor `{}`: {want} bytes to load into a buffer of {}",
                t.target.name,
                dst.len()
            ),
        });
    }
    fill_slab(source, t, part, dst, &mut ReadCache::new())?;
    Ok(())
}

/// Row-major element offset of `start` in a tensor of `shape`.
fn slab_offset(shape: &[u64], start: &[u64]) -> u64 {
    shape.iter().zip(start).fold(0, |acc, (&s, &i)| acc * s + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slabs_tile_the_tensor_contiguously() {
        let shape = [3u64, 5, 7];
        for max in [1u64, 4, 28, 30, 140, 1000] {
            let s = slabs(&shape, Dtype::F32, max);
            let mut next = 0;
            for r in &s {
                assert_eq!(slab_offset(&shape, &r.start), next, "max {max}");
                next += r.numel();
                assert!(r.numel() * 4 <= max.max(28), "slab {r} over {max}");
            }
            assert_eq!(next, 105);
            assert_eq!(crate::layout::coverage::check_tiling(&shape, &s), Ok(()));
        }
    }

    #[test]
    fn parts_tile_the_tensor_at_their_byte_offsets() {
        let target = crate::layout::plan::TargetTensor {
            name: "w".into(),
            dtype: Dtype::BF16,
            shape: vec![6, 10, 3],
            pieces: vec![],
        };
        let t = TensorPlan {
            target,
            src_dtype: Dtype::BF16,
            ops: vec![],
            stored_shape: None,
        };
        for max in [1u64, 6, 60, 100, 360, 10_000] {
            let parts = tensor_parts(&t, max);
            let mut next = 0;
            for p in &parts {
                assert_eq!(p.offset, next, "max {max}");
                assert_eq!(p.bytes, p.region.numel() * 2);
                next += p.bytes;
            }
            assert_eq!(next, 360, "max {max}");
        }
    }

    #[test]
    fn casts_round_to_nearest() {
        let src: Vec<u8> = [1.0f32, -2.5, 3.140_625]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut dst = vec![0u8; 6];
        convert(&src, Dtype::F32, &mut dst, Dtype::BF16);
        let back: Vec<f32> = dst
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(back, vec![1.0, -2.5, 3.140_625]);
    }
}

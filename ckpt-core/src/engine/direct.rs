//! The copy engine's direct path: a slab whose bytes are all in mapped (uncompressed)
//! inputs, in the output's dtype, is written straight from the inputs as a list of
//! runs (long runs copied file to file by the kernel, the others from the mappings, one
//! `pwritev` per 1024 runs) instead of being gathered into a buffer first.
//! That saves the gather's copy and the buffer's zeroing: on a Megatron TP=4 -> TP=2
//! reshard they were a quarter of the process's CPU time. The bytes written, their
//! order and the checksums recorded are those of the gathered path.

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::formats::{TensorWriter, WritePart};
use crate::layout::plan::TensorPlan;
use crate::layout::region::{Region, Runs};

/// Most runs a slab is written from directly. A slab of tiny runs (narrow column
/// pieces) is better gathered: the gather's copy of a few bytes costs less than the
/// kernel's per-buffer work, and the run list stays small.
const MAX_RUNS: usize = 8192;

/// For the tests comparing both paths' outputs: `CKPT_TEST_NO_DIRECT` set sends every
/// slab through the gathered path.
fn gathered_only() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var_os("CKPT_TEST_NO_DIRECT").is_some())
}

/// One run of a slab: bytes `src` of tensor `tensor` of source file `file`, to go at
/// byte `dst` of the slab.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SlabRun {
    pub(crate) file: usize,
    pub(crate) tensor: usize,
    pub(crate) src: std::ops::Range<u64>,
    pub(crate) dst: u64,
}

/// The runs that make up `slab` (local coordinates of `t`'s target, `slab_len` bytes),
/// in slab order, when it can be written directly: same dtype on both sides, every
/// source mapped, and the runs tiling the slab exactly (each byte once, no gap). `None`
/// otherwise: the caller gathers the slab as usual.
pub(crate) fn slab_runs(
    source: &Checkpoint,
    t: &TensorPlan,
    slab: &Region,
    slab_len: u64,
) -> Option<Vec<SlabRun>> {
    if t.src_dtype != t.target.dtype || gathered_only() {
        return None;
    }
    let bits = t.src_dtype.bitsize() as u64;
    let mut runs: Vec<SlabRun> = Vec::new();
    for op in &t.ops {
        let dst_box = op.dst_box();
        let Some(part) = dst_box.overlap(slab) else {
            continue;
        };
        let file = &source.files[op.file];
        // A permuted box is no list of runs, a computed one no bytes of a file: gathered.
        if file.is_compressed()
            || file.data(op.tensor).is_none()
            || op.axes.is_some()
            || op.compute.is_some()
        {
            return None;
        }
        let src_start = op.src_start_of(&part);
        let dst_start: Vec<u64> = part
            .start
            .iter()
            .zip(&slab.start)
            .map(|(p, s)| p - s)
            .collect();
        for run in Runs::new(
            &part.shape,
            &op.src_shape,
            &src_start,
            &slab.shape,
            &dst_start,
        ) {
            let src = run.src * bits / 8..(run.src + run.len) * bits / 8;
            // Inside the stored tensor by the plan's construction; a run that is not
            // takes the gathered path, whose read names the tensor.
            if runs.len() == MAX_RUNS
                || src.end > file.data(op.tensor).map_or(0, |d| d.len() as u64)
            {
                return None;
            }
            runs.push(SlabRun {
                file: op.file,
                tensor: op.tensor,
                src,
                dst: run.dst * bits / 8,
            });
        }
    }
    runs.sort_unstable_by_key(|r| r.dst);
    // Exactly tiling: the gathered path writes every byte of the slab, so a gap (or a
    // byte covered twice) must take that path to come out the same.
    let mut pos = 0;
    for r in &runs {
        if r.dst != pos {
            return None;
        }
        pos += r.src.end - r.src.start;
    }
    (pos == slab_len).then_some(runs)
}

/// Writes `runs` (from [`slab_runs`]) at byte `at` of tensor `index` of `writer`, then
/// drops the input pages read from the process (as the gathered path does). `Ok(None)`
/// when the writer has no direct path (nothing written); else the bytes read.
///
/// # Errors
/// The writer's I/O errors.
pub(crate) fn write_runs(
    source: &Checkpoint,
    writer: &dyn TensorWriter,
    index: usize,
    at: u64,
    runs: &[SlabRun],
    sums: &super::read_sums::ReadSums,
) -> Result<Option<u64>> {
    let mut parts: Vec<WritePart<'_>> = Vec::with_capacity(runs.len());
    for r in runs {
        // Mapped and in range: checked by `slab_runs`.
        let Some(part) = source.files[r.file].mapped_part(r.tensor, r.src.clone()) else {
            return Ok(None);
        };
        parts.push(part);
    }
    if !writer.write_parts_at(index, at, &parts)? {
        return Ok(None);
    }
    // Hashed while resident, before they are released.
    for (r, part) in runs.iter().zip(&parts) {
        sums.add(r.file, r.tensor, r.src.start, part);
    }
    // Released per source tensor over the span read from it, as in the gathered path.
    let mut spans: Vec<(usize, usize, u64, u64)> = Vec::new();
    for r in runs {
        match spans.iter_mut().find(|s| s.0 == r.file && s.1 == r.tensor) {
            Some(s) => {
                s.2 = s.2.min(r.src.start);
                s.3 = s.3.max(r.src.end);
            }
            None => spans.push((r.file, r.tensor, r.src.start, r.src.end)),
        }
    }
    for (f, t, lo, hi) in spans {
        source.files[f].release(t, lo..hi);
    }
    Ok(Some(runs.iter().map(|r| r.src.end - r.src.start).sum()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::copy::{assemble, slabs};
    use crate::engine::example::{example_strategy, write_example, ExampleModel};
    use crate::layout::mesh::Mesh;
    use crate::layout::plan::{bytes_of, rank_tensors, CopyPlan, TargetFile};
    use crate::layout::Dtype;
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    /// The example model written on tp=4 and planned for rank `rank` of tp=2, each
    /// tensor cast to `dtype` when given.
    fn tp4_to_tp2(
        dir: &std::path::Path,
        rank: u64,
        dtype: Option<Dtype>,
    ) -> (Checkpoint, CopyPlan) {
        let model = ExampleModel::default();
        let src = dir.join("tp4");
        if !src.exists() {
            write_example(&src, &model, &Mesh::parse("tp=4").unwrap()).unwrap();
        }
        let source = Checkpoint::open(&[src]).unwrap();
        let target = example_strategy(&model, &Mesh::parse("tp=2").unwrap()).unwrap();
        let tensors = rank_tensors(&target, rank, true, &|_, l| {
            // The matrices and norms (BF16) cast; the integer step stays.
            Some(dtype.filter(|_| l.dtype == Dtype::BF16).unwrap_or(l.dtype))
        });
        let plan = CopyPlan::build(
            &source,
            vec![TargetFile {
                path: PathBuf::new(),
                tensors,
                metadata: BTreeMap::new(),
            }],
        )
        .unwrap();
        (source, plan)
    }

    #[test]
    fn runs_tile_every_slab_with_the_bytes_the_gathered_path_copies() {
        let dir = tempfile::tempdir().unwrap();
        let (mut multi_source, mut tensors) = (0, 0);
        for rank in 0..2 {
            let (source, plan) = tp4_to_tp2(dir.path(), rank, None);
            for t in &plan.files[0].tensors {
                tensors += 1;
                let whole = assemble(t, &source).unwrap();
                // Small slabs, so that slabs cut rows and columns of the sources.
                for slab in slabs(&t.target.shape, t.target.dtype, 96) {
                    let len = bytes_of(t.target.dtype, slab.numel());
                    let runs = slab_runs(&source, t, &slab, len).unwrap_or_else(|| {
                        panic!("`{}` slab {slab}: no direct runs", t.target.name)
                    });
                    let mut got = Vec::new();
                    for r in &runs {
                        let data = source.files[r.file].data(r.tensor).unwrap();
                        assert_eq!(r.dst, got.len() as u64);
                        got.extend_from_slice(&data[r.src.start as usize..r.src.end as usize]);
                    }
                    let at = bytes_of(
                        t.target.dtype,
                        t.target
                            .shape
                            .iter()
                            .zip(&slab.start)
                            .fold(0, |a, (s, i)| a * s + i),
                    ) as usize;
                    assert_eq!(
                        got,
                        whole[at..at + len as usize],
                        "`{}` slab {slab}",
                        t.target.name
                    );
                    let files: std::collections::BTreeSet<usize> =
                        runs.iter().map(|r| r.file).collect();
                    multi_source += usize::from(files.len() > 1);
                }
            }
        }
        // Row-sharded matrices gather every slab from two tp=4 ranks.
        assert!(
            tensors > 4 && multi_source > 0,
            "{tensors} tensors, {multi_source} two-source slabs"
        );
    }

    #[test]
    fn a_cast_or_a_slab_not_tiled_takes_the_gathered_path() {
        let dir = tempfile::tempdir().unwrap();
        let (source, plan) = tp4_to_tp2(dir.path(), 0, Some(Dtype::F32));
        let t = plan.files[0]
            .tensors
            .iter()
            .find(|t| t.src_dtype == Dtype::BF16)
            .unwrap();
        assert_eq!(t.target.dtype, Dtype::F32);
        let full = Region::full(&t.target.shape);
        assert_eq!(
            slab_runs(&source, t, &full, bytes_of(Dtype::F32, full.numel())),
            None
        );
        let (source, plan) = tp4_to_tp2(dir.path(), 0, None);
        let t = plan.files[0]
            .tensors
            .iter()
            .find(|t| t.ops.len() > 1)
            .expect("a tensor gathered from two tp=4 ranks");
        let full = Region::full(&t.target.shape);
        let len = bytes_of(t.target.dtype, full.numel());
        assert!(slab_runs(&source, t, &full, len).is_some());
        // One op short: the slab is no longer tiled.
        let mut short = t.clone();
        short.ops.pop();
        assert_eq!(slab_runs(&source, &short, &full, len), None);
        // A slab length the runs do not add up to.
        assert_eq!(slab_runs(&source, t, &full, len + 1), None);
    }
}

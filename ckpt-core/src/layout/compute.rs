//! Computed pieces: a piece of a tensor whose elements are computed, in the copy's own
//! streaming pass, from boxes of other stored tensors by a named [`Operation`] (FP8
//! block dequantization and quantization, a LoRA adapter's low-rank update), instead of
//! read from a file.
//!
//! A computed piece is planned like any other: the planner cuts its box to the target's
//! pieces, and the engine, where a copy op carries a [`Compute`](crate::layout::source::Compute), assembles each input's
//! box through that input's own copy plan (any layout: shards, slices, compressed),
//! computes the part of the box a slab needs, and places it like read bytes. Every part
//! is computed from its inputs alone, element by element in a fixed order, so the
//! output does not depend on how slabs or threads cut the work. What may become a
//! computed piece (a weight with its `_scale_inv`, an adapter's `lora_A`/`lora_B`) is the
//! checkpoint's business (`checkpoint/computed.rs`), and the pieces' record of it is
//! `source::Computed`; this module is the arithmetic and the geometry: which box of
//! each input a box of the output needs.

use crate::error::{Error, Result};
use crate::layout::region::{Dims, Region};
use crate::layout::Dtype;
use float8::F8E4M3;
use half::{bf16, f16};

/// The largest finite E4M3 value: FP8 block scales map each block's largest magnitude
/// to it.
pub(crate) const E4M3_MAX: f32 = 448.0;

/// How a computed piece's elements follow from its inputs' (all boxes in global
/// coordinates of their tensors; 2-D tensors, rows by columns).
#[derive(Clone, Debug, PartialEq)]
pub enum Operation {
    /// Inputs `[codes (F8_E4M3, M x N), scale_inv (F32, ceil(M/bh) x ceil(N/bw))]`:
    /// `y = round(f32(code) * scale_inv[i / bh, j / bw])`, the product one f32 rounding
    /// and the store one more (DeepSeek-V3's `weight_dequant`; partial edge blocks).
    BlockDequantize {
        /// Block rows and columns (`weight_block_size`).
        block: [u64; 2],
    },
    /// Input `[x (any float, read as F32), M x N]`: the E4M3 codes of `x` quantized by
    /// blocks, each block's `scale_inv = f32(max(amax, 1e-4) / 448)`, the code
    /// `e4m3(f32(x * f32(1 / scale_inv)))` round to nearest even, saturating (vLLM's and
    /// DeepGEMM's `per_block_cast_to_fp8`).
    BlockQuantize {
        /// Block rows and columns.
        block: [u64; 2],
    },
    /// Input `[x (any float, read as F32), M x N]`: the F32 `scale_inv` of each block of
    /// [`Operation::BlockQuantize`], a tensor of `ceil(M/bh) x ceil(N/bw)`.
    BlockScale {
        /// Block rows and columns.
        block: [u64; 2],
    },
    /// Inputs `[W, A_1, B_1, ..., A_k, B_k]` (`A` and `B` read as F32): `W` plus each
    /// adapter's `scale * (B @ A)` in turn, as PEFT's `merge_and_unload` on a CPU
    /// computes it: the product an FMA chain over the rank in ascending order, times
    /// the f32 scale, added to `f32(W)` in f32 and rounded to W's dtype.
    LowRank {
        /// One per adapter, in the order they are merged.
        updates: Vec<LowRankUpdate>,
    },
    /// Input `[x (any float, read as F32), M x N]`, `N` a multiple of 32: ggml's Q8_0
    /// blocks of each row, the output `U8`, `M x N / 32 * 34`. Per block of 32 values:
    /// `d = f32(amax / 127)`, `id = d ? f32(1 / d) : 0`, `q = roundf(f32(x * id))`
    /// (half away from zero) as `i8`, stored as `f16(d)` (round to nearest even) then
    /// the 32 `q` (ggml's `quantize_row_q8_0_ref`, gguf-py's `quants.Q8_0`).
    GgmlQ8_0,
    /// Input `[blocks (U8), M x N / 32 * 34]`, ggml's Q8_0 rows ([`Operation::GgmlQ8_0`]'s
    /// output): `y = round(f32(d) * f32(q))` for each block's `f16` scale `d` and its 32
    /// `i8` values `q`, the product exact in f32 and the store one rounding (ggml's
    /// `dequantize_row_q8_0`, gguf-py's `quants.dequantize`).
    GgmlQ8_0Dequantize,
    /// Input `[x]`, a box of any tensor (read in the output's dtype, or as F32 with a
    /// `scale`): the box's elements, row-major, read as a tensor of `shape`, its axes
    /// permuted (dimension `d` of the result is `shape`'s `axes[d]`), and the result's
    /// elements, row-major, are the output tensor's (`out_shape`: as many elements in
    /// any shape). A transpose with a reshape on either side: MaxText's stacked kernels
    /// (`[embed, layers, heads, head_dim]`) as Hugging Face's per-layer weights
    /// (`[heads * head_dim, embed]`) and back, their rotary rows reordered by splitting
    /// `head_dim` in `shape`. With `scale`, each element is multiplied by it in f32 and
    /// rounded once to the output dtype (MaxText's query kernel carries Hugging Face's
    /// times `1 / sqrt(head_dim)`). Built by [`Operation::permute`].
    Permute {
        /// The input box read as this row-major shape.
        shape: Vec<u64>,
        /// The permutation.
        axes: Vec<usize>,
        /// The output tensor's shape.
        out_shape: Vec<u64>,
        /// Where the permuted tensor's first dimension lies in the input box: the box's
        /// dimension and how many of its indices one index of it spans, when it is the
        /// outer part of one dimension of the box (a part of the output then needs only
        /// the input's indices under it); `None`: every part needs the whole box.
        lead: Option<(usize, u64)>,
        /// The factor each element is multiplied by (f32), if any.
        scale: Option<f32>,
    },
}

/// One adapter's update of [`Operation::LowRank`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LowRankUpdate {
    /// `lora_alpha / r` (or `/ sqrt(r)`, rsLoRA), rounded to f32.
    pub scale: f32,
    /// The rank `r` (A's rows, B's columns).
    pub rank: u64,
    /// `fan_in_fan_out`: the weight is stored `[in, out]` (GPT-2's `Conv1D`), so the
    /// update is `(B @ A)` transposed.
    pub transposed: bool,
}

/// The 2-D box of `rows x cols` at `(r0, c0)`.
fn rect(r0: u64, c0: u64, rows: u64, cols: u64) -> Region {
    Region::new(Dims::from_slice(&[r0, c0]), Dims::from_slice(&[rows, cols]))
}

/// `lo..hi` on a block grid: the blocks of size `b` that `lo..hi` touches.
fn blocks_of(lo: u64, hi: u64, b: u64) -> (u64, u64) {
    (lo / b, hi.div_ceil(b))
}

/// Row-major strides of `shape`, in elements.
fn strides_of(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

impl Operation {
    /// [`Operation::Permute`] of an input box of `box_shape` read as `shape`, permuted
    /// by `axes`, as a tensor of `out_shape`, scaled by `scale`.
    ///
    /// # Errors
    /// `axes` no permutation of `shape`'s dimensions; element counts that differ.
    pub fn permute(
        box_shape: &[u64],
        shape: Vec<u64>,
        axes: Vec<usize>,
        out_shape: Vec<u64>,
        scale: Option<f32>,
    ) -> Result<Operation> {
        let mut seen = vec![false; shape.len()];
        let is_permutation = axes.len() == shape.len()
            && axes
                .iter()
                .all(|&a| a < seen.len() && !std::mem::replace(&mut seen[a], true));
        let n: u64 = shape.iter().product();
        if !is_permutation
            || box_shape.iter().product::<u64>() != n
            || out_shape.iter().product::<u64>() != n
        {
            return Err(Error::Unsupported {
                problem: format!(
                    "a box of {box_shape:?} read as {shape:?}, axes {axes:?}, as {out_shape:?}: not a permutation of as many elements"
                ),
            });
        }
        // The box's dimensions, each a row-major split into consecutive dimensions of
        // `shape`: the one whose split begins with the permuted tensor's first.
        let lead_dim = axes.first().copied();
        let mut lead = None;
        let mut i = 0;
        for (j, &extent) in box_shape.iter().enumerate() {
            let first = i;
            let mut prod = 1u64;
            while prod < extent && i < shape.len() {
                prod *= shape[i];
                i += 1;
            }
            if prod != extent {
                lead = None;
                break;
            }
            if lead_dim == Some(first) && i > first && shape[first] > 0 {
                lead = Some((j, extent / shape[first]));
            }
        }
        Ok(Operation::Permute {
            shape,
            axes,
            out_shape,
            lead,
            scale,
        })
    }

    /// [`Operation::Permute`]'s indices of the permuted tensor's first dimension that
    /// the output box `out` lies in.
    fn permuted_rows(shape: &[u64], axes: &[usize], out_shape: &[u64], out: &Region) -> (u64, u64) {
        let first = axes.first().map_or(1, |&a| shape[a]);
        let n: u64 = shape.iter().product();
        if out.numel() == 0 || first == 0 {
            return (0, 0);
        }
        let per = n / first;
        let st = strides_of(out_shape);
        let lo: u64 = out.start.iter().zip(&st).map(|(a, s)| a * s).sum();
        let hi: u64 = (0..out.ndim())
            .map(|d| (out.end(d) - 1) * st[d])
            .sum::<u64>()
            + 1;
        (lo / per, hi.div_ceil(per))
    }

    /// The dtype the operation reads input `i` in (the plans assemble it so).
    #[must_use]
    pub fn input_dtype(&self, i: usize, stored: Dtype) -> Dtype {
        match (self, i) {
            (Operation::Permute { scale: None, .. }, 0) => stored,
            (Operation::BlockDequantize { .. }, 0) => Dtype::F8_E4M3,
            (Operation::GgmlQ8_0Dequantize, 0) => Dtype::U8,
            (Operation::LowRank { .. }, 0) => stored,
            _ => Dtype::F32,
        }
    }

    /// The box of input `i` that the output box `out` needs, within `whole` (the box of
    /// that input the whole piece needs, [`ComputeInput::region`](crate::layout::source::ComputeInput::region)).
    #[must_use]
    pub fn input_region(&self, i: usize, out: &Region, whole: &Region) -> Region {
        if let Operation::Permute {
            shape,
            axes,
            out_shape,
            lead,
            ..
        } = self
        {
            let Some((dim, per)) = *lead else {
                return whole.clone();
            };
            let (k0, k1) = Self::permuted_rows(shape, axes, out_shape, out);
            let mut r = whole.clone();
            r.start[dim] += k0 * per;
            r.shape[dim] = (k1 - k0) * per;
            return r;
        }
        let rows = (out.start[0], out.end(0));
        let cols = (out.start[1], out.end(1));
        let clip = |r: Region| {
            r.overlap(whole)
                .unwrap_or_else(|| Region::new(whole.start.clone(), Dims::from_slice(&[0, 0])))
        };
        match self {
            Operation::BlockDequantize { block } if i == 1 => {
                let (r0, r1) = blocks_of(rows.0, rows.1, block[0]);
                let (c0, c1) = blocks_of(cols.0, cols.1, block[1]);
                clip(rect(r0, c0, r1 - r0, c1 - c0))
            }
            Operation::BlockQuantize { block } => {
                let (r0, r1) = blocks_of(rows.0, rows.1, block[0]);
                let (c0, c1) = blocks_of(cols.0, cols.1, block[1]);
                clip(rect(
                    r0 * block[0],
                    c0 * block[1],
                    (r1 - r0) * block[0],
                    (c1 - c0) * block[1],
                ))
            }
            Operation::BlockScale { block, .. } => clip(rect(
                rows.0 * block[0],
                cols.0 * block[1],
                (rows.1 - rows.0) * block[0],
                (cols.1 - cols.0) * block[1],
            )),
            Operation::GgmlQ8_0 => {
                let (b0, b1) = blocks_of(cols.0, cols.1, Q8_0_BYTES);
                clip(rect(
                    rows.0,
                    b0 * Q8_0_BLOCK,
                    rows.1 - rows.0,
                    (b1 - b0) * Q8_0_BLOCK,
                ))
            }
            Operation::GgmlQ8_0Dequantize => {
                let (b0, b1) = blocks_of(cols.0, cols.1, Q8_0_BLOCK);
                clip(rect(
                    rows.0,
                    b0 * Q8_0_BYTES,
                    rows.1 - rows.0,
                    (b1 - b0) * Q8_0_BYTES,
                ))
            }
            Operation::LowRank { updates } if i > 0 => {
                let u = &updates[(i - 1) / 2];
                // The weight's rows are B's and its columns A's (transposed: the other
                // way round).
                let (b_rows, a_cols) = if u.transposed {
                    (cols, rows)
                } else {
                    (rows, cols)
                };
                if (i - 1).is_multiple_of(2) {
                    rect(0, a_cols.0, u.rank, a_cols.1 - a_cols.0)
                } else {
                    rect(b_rows.0, 0, b_rows.1 - b_rows.0, u.rank)
                }
            }
            _ => out.clone(),
        }
    }

    /// Computes the box `out` (global coordinates of the computed tensor) into `dst`,
    /// row-major in `dtype`, from the inputs' boxes ([`Operation::input_region`]), each
    /// `(its box, its bytes in [`Operation::input_dtype`])`.
    ///
    /// # Errors
    /// An output dtype the operation cannot produce, inputs of the wrong size.
    pub fn compute(
        &self,
        out: &Region,
        inputs: &[(Region, &[u8])],
        dtype: Dtype,
        dst: &mut [u8],
    ) -> Result<()> {
        if let Operation::Permute {
            shape,
            axes,
            out_shape,
            lead,
            scale,
        } = self
        {
            return permute(
                shape,
                axes,
                out_shape,
                lead.is_some(),
                *scale,
                out,
                inputs,
                dtype,
                dst,
            );
        }
        let (rows, cols) = (out.shape[0] as usize, out.shape[1] as usize);
        let size = dtype.bitsize() / 8;
        if dst.len() != rows * cols * size {
            return Err(mismatch("output", dst.len(), rows * cols * size));
        }
        for (i, (r, b)) in inputs.iter().enumerate() {
            let want = r.numel() as usize * self.input_dtype(i, dtype).bitsize() / 8;
            if b.len() != want {
                return Err(mismatch("input", b.len(), want));
            }
        }
        match self {
            Operation::BlockDequantize { block } => {
                let [(_, codes), (sr, scales)] = inputs else {
                    return Err(mismatch("inputs", inputs.len(), 2));
                };
                let scales = f32s(scales);
                let scale_cols = sr.shape[1] as usize;
                let table = e4m3_table();
                let mut row = vec![0f32; cols];
                for (i, (codes, dst)) in codes
                    .chunks_exact(cols.max(1))
                    .zip(dst.chunks_exact_mut((cols * size).max(1)))
                    .enumerate()
                {
                    let srow = ((out.start[0] + i as u64) / block[0] - sr.start[0]) as usize;
                    for (range, b) in segments(out.start[1], cols, block[1]) {
                        let s = scales[srow * scale_cols + (b - sr.start[1]) as usize];
                        for (v, &c) in row[range.clone()].iter_mut().zip(&codes[range]) {
                            *v = table[c as usize] * s;
                        }
                    }
                    encode(&row, dtype, dst)?;
                }
            }
            Operation::BlockQuantize { block } => {
                let [(xr, x)] = inputs else {
                    return Err(mismatch("inputs", inputs.len(), 1));
                };
                if dtype != Dtype::F8_E4M3 {
                    return Err(mismatch("bytes per code", size, 1));
                }
                let x = f32s(x);
                let (scales, gc) = block_scales(xr, &x, *block);
                // One f32 reciprocal per block, as the reference multiplies by it.
                let inverse: Vec<f32> = scales.iter().map(|s| 1.0 / s).collect();
                let (g0, c0) = (xr.start[0] / block[0], xr.start[1] / block[1]);
                let width = xr.shape[1] as usize;
                for (i, dst) in dst.chunks_exact_mut(cols.max(1)).enumerate() {
                    let gi = out.start[0] + i as u64;
                    let bi = (gi / block[0] - g0) * gc;
                    let at =
                        (gi - xr.start[0]) as usize * width + (out.start[1] - xr.start[1]) as usize;
                    let x = &x[at..at + cols];
                    for (range, b) in segments(out.start[1], cols, block[1]) {
                        let inv = inverse[(bi + b - c0) as usize];
                        for (d, &v) in dst[range.clone()].iter_mut().zip(&x[range]) {
                            *d = F8E4M3::from_f32(v * inv).to_bits();
                        }
                    }
                }
            }
            Operation::BlockScale { block, .. } => {
                let [(xr, x)] = inputs else {
                    return Err(mismatch("inputs", inputs.len(), 1));
                };
                let (scales, gc) = block_scales(xr, &f32s(x), *block);
                let (g0, c0) = (xr.start[0] / block[0], xr.start[1] / block[1]);
                for (i, dst) in dst.chunks_exact_mut((cols * size).max(1)).enumerate() {
                    let from = ((out.start[0] + i as u64 - g0) * gc + out.start[1] - c0) as usize;
                    encode(&scales[from..from + cols], dtype, dst)?;
                }
            }
            Operation::LowRank { updates } => low_rank(out, inputs, updates, dtype, dst)?,
            Operation::GgmlQ8_0Dequantize => {
                let [(xr, x)] = inputs else {
                    return Err(mismatch("inputs", inputs.len(), 1));
                };
                let width = xr.shape[1] as usize;
                let mut row = vec![0f32; cols];
                for (i, dst) in dst.chunks_exact_mut((cols * size).max(1)).enumerate() {
                    let at = (out.start[0] + i as u64 - xr.start[0]) as usize * width;
                    for (range, b) in segments(out.start[1], cols, Q8_0_BLOCK) {
                        let block = at + (b * Q8_0_BYTES - xr.start[1]) as usize;
                        let d = f16::from_le_bytes([x[block], x[block + 1]]).to_f32();
                        let first = (out.start[1] + range.start as u64 - b * Q8_0_BLOCK) as usize;
                        let q = &x[block + 2 + first..block + 2 + first + range.len()];
                        for (v, &q) in row[range].iter_mut().zip(q) {
                            *v = d * f32::from(q as i8);
                        }
                    }
                    encode(&row, dtype, dst)?;
                }
            }
            // Handled above, before the 2-D geometry.
            Operation::Permute { .. } => unreachable!("computed by permute()"),
            Operation::GgmlQ8_0 => {
                let [(xr, x)] = inputs else {
                    return Err(mismatch("inputs", inputs.len(), 1));
                };
                if dtype != Dtype::U8 {
                    return Err(mismatch("bytes per element", size, 1));
                }
                let x = f32s(x);
                let (b0, b1) = blocks_of(out.start[1], out.end(1), Q8_0_BYTES);
                let width = xr.shape[1] as usize;
                let mut block = [0u8; Q8_0_BYTES as usize];
                for i in 0..rows {
                    let row = (out.start[0] + i as u64 - xr.start[0]) as usize * width;
                    for b in b0..b1 {
                        let at = row + (b * Q8_0_BLOCK - xr.start[1]) as usize;
                        q8_0_block(&x[at..at + Q8_0_BLOCK as usize], &mut block);
                        // The block's bytes that fall in the output box.
                        let (lo, hi) = (
                            (b * Q8_0_BYTES).max(out.start[1]),
                            ((b + 1) * Q8_0_BYTES).min(out.end(1)),
                        );
                        let from = (lo - b * Q8_0_BYTES) as usize;
                        let to = i * cols + (lo - out.start[1]) as usize;
                        let n = (hi - lo) as usize;
                        dst[to..to + n].copy_from_slice(&block[from..from + n]);
                    }
                }
            }
        }
        Ok(())
    }
}

/// [`Operation::Permute`]'s box `out` of the output from the input's box (the whole
/// box, or with `led` the indices of the permuted tensor's first dimension that `out`
/// lies in).
#[allow(clippy::too_many_arguments)]
fn permute(
    shape: &[u64],
    axes: &[usize],
    out_shape: &[u64],
    led: bool,
    scale: Option<f32>,
    out: &Region,
    inputs: &[(Region, &[u8])],
    dtype: Dtype,
    dst: &mut [u8],
) -> Result<()> {
    let [(_, x)] = inputs else {
        return Err(mismatch("inputs", inputs.len(), 1));
    };
    let size = dtype.bitsize() / 8;
    let numel = out.numel() as usize;
    if dst.len() != numel * size {
        return Err(mismatch("output", dst.len(), numel * size));
    }
    let first = axes[0];
    let (k0, k1) = if led {
        Operation::permuted_rows(shape, axes, out_shape, out)
    } else {
        (0, shape[first])
    };
    // The input: `shape` with the first permuted dimension cut to k0..k1.
    let mut xs = shape.to_vec();
    xs[first] = k1 - k0;
    let in_size = if scale.is_some() { 4 } else { size };
    let want = xs.iter().product::<u64>() as usize * in_size;
    if x.len() != want {
        return Err(mismatch("input", x.len(), want));
    }
    let x_strides = strides_of(&xs);
    // The permuted part's shape and, for each of its dimensions, the input's stride.
    let ps: Vec<u64> = axes.iter().map(|&a| xs[a]).collect();
    let p_strides = strides_of(&ps);
    let from: Vec<u64> = axes.iter().map(|&a| x_strides[a]).collect();
    let per = shape.iter().product::<u64>() / shape[first].max(1);
    let base = k0 * per;
    let o_strides = strides_of(out_shape);
    // Trailing dimensions the permutation leaves in place are runs of consecutive
    // elements on both sides (a row permutation of a matrix moves whole rows): copied
    // a run at a time, not an index each.
    let mut run = 1u64;
    for k in (1..axes.len()).rev() {
        if axes[k] != k {
            break;
        }
        run *= ps[k];
    }
    let last = out.ndim().saturating_sub(1);
    let mut values = Vec::with_capacity(if scale.is_some() { numel } else { 0 });
    if run == 1 && out.ndim() > 0 {
        // Element by element (a transpose): each output row's first input index by
        // division, the rest by stepping the permuted index like an odometer.
        let walk = PermutedWalk {
            shape: &ps,
            strides: &p_strides,
            from: &from,
        };
        let rows = row_starts(out, &o_strides).map(|flat| flat - base);
        let row_len = out.shape[last] as usize;
        match (scale, size) {
            (Some(s), _) => walk.each(rows, row_len, |_, at| {
                let b = &x[4 * at..4 * at + 4];
                values.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * s);
            }),
            (None, 1) => walk.each(rows, row_len, |e, at| dst[e] = x[at]),
            (None, 2) => walk.each(rows, row_len, |e, at| copy_element::<2>(x, at, dst, e)),
            (None, 4) => walk.each(rows, row_len, |e, at| copy_element::<4>(x, at, dst, e)),
            (None, 8) => walk.each(rows, row_len, |e, at| copy_element::<8>(x, at, dst, e)),
            (None, _) => walk.each(rows, row_len, |e, at| {
                dst[e * size..(e + 1) * size].copy_from_slice(&x[at * size..(at + 1) * size]);
            }),
        }
        if scale.is_some() {
            encode(&values, dtype, dst)?;
        }
        return Ok(());
    }
    let mut idx = vec![0u64; out.ndim()];
    let mut e = 0usize;
    while e < numel {
        let flat: u64 = idx
            .iter()
            .zip(&out.start)
            .zip(&o_strides)
            .map(|((i, s), st)| (i + s) * st)
            .sum();
        let mut rest = flat - base;
        // Elements from here on in one run of the input and one row of the output box.
        let row_left = if out.ndim() == 0 {
            1
        } else {
            out.shape[last] - idx[last]
        };
        let n = ((run - rest % run).min(row_left) as usize).min(numel - e);
        let mut at = 0u64;
        for (ps, f) in p_strides.iter().zip(&from) {
            at += (rest / ps) * f;
            rest %= ps;
        }
        let at = at as usize;
        match scale {
            Some(s) => values.extend(
                x[4 * at..4 * (at + n)]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * s),
            ),
            None => dst[e * size..(e + n) * size].copy_from_slice(&x[at * size..(at + n) * size]),
        }
        e += n;
        if out.ndim() == 0 {
            continue;
        }
        idx[last] += n as u64;
        for d in (0..idx.len()).rev() {
            if idx[d] < out.shape[d] {
                break;
            }
            if d == 0 {
                break;
            }
            idx[d] = 0;
            idx[d - 1] += 1;
        }
    }
    if scale.is_some() {
        encode(&values, dtype, dst)?;
    }
    Ok(())
}

/// The flat index (in a tensor of row-major `strides`) of the first element of each
/// row of the box `b` (its last dimension), rows in order; none when it is empty.
fn row_starts<'a>(b: &'a Region, strides: &'a [u64]) -> impl Iterator<Item = u64> + 'a {
    let nd = b.ndim();
    let rows: u64 = b.shape[..nd - 1].iter().product();
    let rows = if b.shape[nd - 1] == 0 { 0 } else { rows };
    let mut idx = vec![0u64; nd];
    (0..rows).map(move |r| {
        if r > 0 {
            // The next row: the second-to-last index up by one, carried leftwards.
            let mut d = nd - 1;
            while d > 0 {
                d -= 1;
                idx[d] += 1;
                if idx[d] < b.shape[d] || d == 0 {
                    break;
                }
                idx[d] = 0;
            }
        }
        idx.iter()
            .zip(&b.start)
            .zip(strides)
            .map(|((i, s), st)| (i + s) * st)
            .sum()
    })
}

/// Element `at` of `x` into element `e` of `dst`, elements of `N` bytes (a copy the
/// compiler makes one load and one store, where a slice copy of a length known only at
/// run time calls `memcpy` for each element).
#[inline(always)]
fn copy_element<const N: usize>(x: &[u8], at: usize, dst: &mut [u8], e: usize) {
    let v: [u8; N] = x[at * N..at * N + N].try_into().expect("N bytes");
    dst[e * N..e * N + N].copy_from_slice(&v);
}

/// The input positions of a permuted tensor's elements, taken in the order of its
/// flat index: `shape` is the permuted tensor's, `strides` its row-major strides, and
/// `from` the input's stride for each of its dimensions.
struct PermutedWalk<'a> {
    shape: &'a [u64],
    strides: &'a [u64],
    from: &'a [u64],
}

impl PermutedWalk<'_> {
    /// Calls `f(output element, input element)` for `row_len` consecutive elements from
    /// each flat index `rows` yields, the output numbered on from 0.
    fn each(
        &self,
        rows: impl Iterator<Item = u64>,
        row_len: usize,
        mut f: impl FnMut(usize, usize),
    ) {
        let nd = self.shape.len();
        let mut digits = vec![0u64; nd];
        let mut e = 0usize;
        for flat in rows {
            let mut rest = flat;
            let mut at = 0u64;
            for ((digit, &stride), &from) in digits.iter_mut().zip(self.strides).zip(self.from) {
                *digit = rest / stride;
                rest %= stride;
                at += *digit * from;
            }
            for _ in 0..row_len {
                f(e, at as usize);
                e += 1;
                // The next index: the last digit up by one, carried leftwards.
                let mut k = nd;
                while k > 0 {
                    k -= 1;
                    digits[k] += 1;
                    at += self.from[k];
                    if digits[k] < self.shape[k] || k == 0 {
                        break;
                    }
                    at -= self.shape[k] * self.from[k];
                    digits[k] = 0;
                }
            }
        }
    }
}

/// The runs of `len` indices from `start` that fall in one block of `b` each: their
/// positions (from 0) and the block's index.
fn segments(start: u64, len: usize, b: u64) -> impl Iterator<Item = (std::ops::Range<usize>, u64)> {
    let end = start + len as u64;
    let mut at = start;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let block = at / b;
        let stop = ((block + 1) * b).min(end);
        let range = (at - start) as usize..(stop - start) as usize;
        at = stop;
        Some((range, block))
    })
}

/// Little-endian f32 bytes as values.
fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
        .collect()
}

/// `bytes` (a float `dtype`) as f32 values into `out` (exact from 16-bit floats).
fn decode(bytes: &[u8], dtype: Dtype, out: &mut [f32]) {
    match dtype {
        Dtype::BF16 => {
            for (v, x) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *v = bf16::from_le_bytes([x[0], x[1]]).to_f32();
            }
        }
        Dtype::F16 => {
            for (v, x) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *v = f16::from_le_bytes([x[0], x[1]]).to_f32();
            }
        }
        _ => {
            for (v, x) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *v = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
            }
        }
    }
}

/// `values` stored in `dtype` into `dst`, rounding to nearest even.
fn encode(values: &[f32], dtype: Dtype, dst: &mut [u8]) -> Result<()> {
    match dtype {
        Dtype::BF16 => {
            for (d, &v) in dst.chunks_exact_mut(2).zip(values) {
                d.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (d, &v) in dst.chunks_exact_mut(2).zip(values) {
                d.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        Dtype::F32 => {
            for (d, &v) in dst.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::F64 => {
            for (d, &v) in dst.chunks_exact_mut(8).zip(values) {
                d.copy_from_slice(&f64::from(v).to_le_bytes());
            }
        }
        other => {
            return Err(Error::Unsupported {
                problem: format!(
                    "a computed tensor cannot be {}",
                    crate::layout::strategy::dtype_name(other)
                ),
            })
        }
    }
    Ok(())
}

/// Values in a ggml Q8_0 block.
pub(crate) const Q8_0_BLOCK: u64 = 32;
/// Bytes of a ggml Q8_0 block: an f16 scale and 32 `i8`.
pub(crate) const Q8_0_BYTES: u64 = 34;

/// The Q8_0 block of 32 values ([`Operation::GgmlQ8_0`]).
fn q8_0_block(v: &[f32], block: &mut [u8; Q8_0_BYTES as usize]) {
    let amax = v.iter().fold(0f32, |m, e| m.max(e.abs()));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    block[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (j, e) in v.iter().enumerate() {
        // `roundf`: half away from zero, as `f32::round`.
        block[2 + j] = ((e * id).round() as i8) as u8;
    }
}

fn mismatch(what: &str, got: usize, want: usize) -> Error {
    Error::Mismatch {
        what: format!("computed piece: {what} of {got} where {want} were planned"),
    }
}

/// The value of every E4M3 code (exact in f32).
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|c| F8E4M3::from_bits(c as u8).to_f32()))
}

/// The `scale_inv` of every block `x` (whole blocks, the box `xr`) touches, row by
/// row, and the number of block columns.
fn block_scales(xr: &Region, x: &[f32], block: [u64; 2]) -> (Vec<f32>, u64) {
    let (g0, g1) = blocks_of(xr.start[0], xr.end(0), block[0]);
    let (c0, c1) = blocks_of(xr.start[1], xr.end(1), block[1]);
    let gc = c1 - c0;
    let mut amax = vec![0f32; ((g1 - g0) * gc) as usize];
    let width = xr.shape[1] as usize;
    for (i, row) in x.chunks_exact(width.max(1)).enumerate() {
        let bi = ((xr.start[0] + i as u64) / block[0] - g0) * gc;
        for (range, b) in segments(xr.start[1], width, block[1]) {
            let m = &mut amax[(bi + b - c0) as usize];
            *m = row[range].iter().fold(*m, |m, v| m.max(v.abs()));
        }
    }
    // An all-zero block gets the scale of 1e-4 (no division by zero), as DeepGEMM's.
    let scales = amax.into_iter().map(|a| a.max(1e-4) / E4M3_MAX).collect();
    (scales, gc)
}

/// [`Operation::LowRank`]: row by row, each adapter's update accumulated for the whole
/// row at once (the rank outermost, so the chain of FMAs per element runs in ascending
/// rank order while the columns vectorize).
fn low_rank(
    out: &Region,
    inputs: &[(Region, &[u8])],
    updates: &[LowRankUpdate],
    dtype: Dtype,
    dst: &mut [u8],
) -> Result<()> {
    let (rows, cols) = (out.shape[0] as usize, out.shape[1] as usize);
    let Some(((_, w), adapters)) = inputs.split_first() else {
        return Err(mismatch("inputs", 0, 1));
    };
    if adapters.len() != 2 * updates.len() {
        return Err(mismatch("inputs", inputs.len(), 1 + 2 * updates.len()));
    }
    let factors: Vec<(Vec<f32>, Vec<f32>)> = adapters
        .chunks_exact(2)
        .map(|p| (f32s(p[0].1), f32s(p[1].1)))
        .collect();
    let size = dtype.bitsize() / 8;
    let mut row = vec![0f32; cols];
    let mut acc = vec![0f32; cols];
    for i in 0..rows {
        let bytes = i * cols * size..(i + 1) * cols * size;
        decode(&w[bytes.clone()], dtype, &mut row);
        for (n, (u, (a, b))) in updates.iter().zip(&factors).enumerate() {
            let r = u.rank as usize;
            acc.iter_mut().for_each(|v| *v = 0.0);
            if u.transposed {
                // W[i, j] += (B @ A)[j, i]: A's column i against B's rows.
                for (j, v) in acc.iter_mut().enumerate() {
                    for k in 0..r {
                        *v = b[j * r + k].mul_add(a[k * rows + i], *v);
                    }
                }
            } else {
                low_rank_row(&mut acc, &b[i * r..(i + 1) * r], a);
            }
            // f32(W) + f32(delta * scale), rounded to W's dtype (then read back for the
            // next adapter, as PEFT's second merge reads the first's; the last rounding
            // is the store's).
            for (v, d) in row.iter_mut().zip(&acc) {
                *v += *d * u.scale;
            }
            if n + 1 < updates.len() {
                round_to(&mut row, dtype);
            }
        }
        encode(&row, dtype, &mut dst[bytes])?;
    }
    Ok(())
}

/// `values` rounded to `dtype` (and kept as f32).
fn round_to(values: &mut [f32], dtype: Dtype) {
    match dtype {
        Dtype::BF16 => values
            .iter_mut()
            .for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        Dtype::F16 => values
            .iter_mut()
            .for_each(|v| *v = f16::from_f32(*v).to_f32()),
        _ => {}
    }
}

/// `acc[j] = sum_k b[k] * a[k, j]` for a row of `acc` (`a` is `b.len()` rows of
/// `acc.len()`), each element an FMA chain over `k` ascending from 0 (the order PEFT's
/// CPU matmul sums in), with the processor's FMA instructions where it has them (the
/// same result as the software `mul_add`, many times faster).
fn low_rank_row(acc: &mut [f32], b: &[f32], a: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the processor has AVX-512F (its FMA included), checked just above.
            unsafe { low_rank_row_avx512(acc, b, a) };
            return;
        }
        if std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("avx2")
        {
            // SAFETY: the processor has FMA and AVX2 (checked just above).
            unsafe { low_rank_row_x86(acc, b, a) };
            return;
        }
    }
    low_rank_row_portable(acc, b, a);
}

/// Columns a block of [`low_rank_row`] keeps in registers while the rank runs.
const COLUMNS: usize = 32;

#[inline(always)]
fn low_rank_row_portable(acc: &mut [f32], b: &[f32], a: &[f32]) {
    let cols = acc.len();
    let mut j0 = 0;
    while j0 < cols {
        let n = COLUMNS.min(cols - j0);
        let mut sum = [0f32; COLUMNS];
        for (k, &bk) in b.iter().enumerate() {
            let row = &a[k * cols + j0..k * cols + j0 + n];
            for (s, &x) in sum.iter_mut().zip(row) {
                *s = bk.mul_add(x, *s);
            }
        }
        acc[j0..j0 + n].copy_from_slice(&sum[..n]);
        j0 += n;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,avx2")]
fn low_rank_row_x86(acc: &mut [f32], b: &[f32], a: &[f32]) {
    low_rank_row_portable(acc, b, a);
}

/// [`low_rank_row`] with 16 lanes a register: the same FMAs, twice as many at once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma,avx2")]
fn low_rank_row_avx512(acc: &mut [f32], b: &[f32], a: &[f32]) {
    low_rank_row_portable(acc, b, a);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn f32_at(bytes: &[u8], i: usize) -> f32 {
        super::f32s(&bytes[4 * i..4 * i + 4])[0]
    }

    #[test]
    fn dequantize_uses_each_elements_block_scale() {
        // 3 x 3 codes, blocks of 2: scales [[1, 2], [4, 8]].
        let codes: Vec<u8> = (0..9)
            .map(|i| F8E4M3::from_f32(i as f32).to_bits())
            .collect();
        let scales = f32s(&[1.0, 2.0, 4.0, 8.0]);
        let op = Operation::BlockDequantize { block: [2, 2] };
        let out = rect(0, 0, 3u64, 3);
        let mut dst = vec![0u8; 9 * 4];
        let inputs = [
            (out.clone(), &codes[..]),
            (rect(0, 0, 2u64, 2), &scales[..]),
        ];
        op.compute(&out, &inputs, Dtype::F32, &mut dst).unwrap();
        let got: Vec<f32> = (0..9).map(|i| f32_at(&dst, i)).collect();
        assert_eq!(got, [0.0, 1.0, 4.0, 3.0, 4.0, 10.0, 24.0, 28.0, 64.0]);
    }

    #[test]
    fn a_part_needs_the_blocks_it_touches_only() {
        let op = Operation::BlockDequantize { block: [128, 128] };
        let whole = rect(0, 0, 2u64, 3);
        let part = rect(130, 100, 10, 60);
        assert_eq!(op.input_region(1, &part, &whole), rect(1u64, 0, 1u64, 2));
        assert_eq!(op.input_region(0, &part, &whole), part);
        let q = Operation::BlockQuantize { block: [128, 128] };
        let x = rect(0, 0, 200, 300);
        assert_eq!(q.input_region(0, &part, &x), rect(128u64, 0, 72u64, 256));
    }

    #[test]
    fn quantize_then_dequantize_stays_within_fp8_rounding() {
        let (m, n) = (5u64, 7u64);
        let x: Vec<f32> = (0..m * n)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let xb = f32s(&x);
        let whole = rect(0, 0, m, n);
        let block = [2, 4];
        let mut codes = vec![0u8; (m * n) as usize];
        let q = Operation::BlockQuantize { block };
        q.compute(&whole, &[(whole.clone(), &xb)], Dtype::F8_E4M3, &mut codes)
            .unwrap();
        let grid = rect(0, 0, 3u64, 2);
        let mut scales = vec![0u8; 6 * 4];
        let s = Operation::BlockScale { block };
        s.compute(&grid, &[(whole.clone(), &xb)], Dtype::F32, &mut scales)
            .unwrap();
        let mut back = vec![0u8; xb.len()];
        let d = Operation::BlockDequantize { block };
        d.compute(
            &whole,
            &[(whole.clone(), &codes), (grid, &scales)],
            Dtype::F32,
            &mut back,
        )
        .unwrap();
        for (i, &v) in x.iter().enumerate() {
            let b = f32_at(&back, i);
            // E4M3 keeps 3 mantissa bits: a relative error of at most 2^-4.
            assert!((b - v).abs() <= v.abs() / 16.0 + 1e-6, "{v} came back {b}");
        }
        // Each part computed alone gives the same codes as the whole.
        for r0 in 0..m {
            let part = rect(r0, 3, 1, 4);
            let need = q.input_region(0, &part, &whole);
            let mut sub = Vec::new();
            for i in need.start[0]..need.end(0) {
                for j in need.start[1]..need.end(1) {
                    sub.extend_from_slice(&x[(i * n + j) as usize].to_le_bytes());
                }
            }
            let mut got = vec![0u8; 4];
            q.compute(&part, &[(need, &sub)], Dtype::F8_E4M3, &mut got)
                .unwrap();
            let want: Vec<u8> = (3..7).map(|j| codes[(r0 * n + j) as usize]).collect();
            assert_eq!(got, want, "row {r0}");
        }
    }

    #[test]
    fn low_rank_adds_the_scaled_product_in_rank_order() {
        // W 2 x 3 (f32), A 2 x 3, B 2 x 2, scale 0.5.
        let w = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let a = f32s(&[1.0, 0.0, 2.0, 0.0, 1.0, 1.0]);
        let b = f32s(&[1.0, 2.0, 3.0, 4.0]);
        let out = rect(0, 0, 2u64, 3);
        let op = Operation::LowRank {
            updates: vec![LowRankUpdate {
                scale: 0.5,
                rank: 2,
                transposed: false,
            }],
        };
        let inputs = [
            (out.clone(), &w[..]),
            (op.input_region(1, &out, &out), &a[..]),
            (op.input_region(2, &out, &out), &b[..]),
        ];
        let mut dst = vec![0u8; 24];
        op.compute(&out, &inputs, Dtype::F32, &mut dst).unwrap();
        // B @ A = [[1, 2, 4], [3, 4, 10]].
        let got: Vec<f32> = (0..6).map(|i| f32_at(&dst, i)).collect();
        assert_eq!(got, [1.5, 3.0, 5.0, 5.5, 7.0, 11.0]);
        // Transposed (fan_in_fan_out): W is [in, out] = 3 x 2, the update (B @ A)^T.
        let wt = f32s(&[0.0; 6]);
        let out_t = rect(0, 0, 3u64, 2);
        let op_t = Operation::LowRank {
            updates: vec![LowRankUpdate {
                scale: 1.0,
                rank: 2,
                transposed: true,
            }],
        };
        let inputs = [
            (out_t.clone(), &wt[..]),
            (op_t.input_region(1, &out_t, &out_t), &a[..]),
            (op_t.input_region(2, &out_t, &out_t), &b[..]),
        ];
        op_t.compute(&out_t, &inputs, Dtype::F32, &mut dst).unwrap();
        let got: Vec<f32> = (0..6).map(|i| f32_at(&dst, i)).collect();
        assert_eq!(got, [1.0, 3.0, 2.0, 4.0, 4.0, 10.0]);
    }

    #[test]
    fn q8_0_blocks_equal_gguf_py_and_any_part_is_the_wholes_bytes() {
        // Two blocks of one row; the bytes gguf-py's `quants.quantize(x, Q8_0)` gives.
        let x: Vec<f32> = (0..64)
            .map(|i| {
                let v = ((i * 37 % 23) as f32 - 11.0) * 0.37 + if i == 5 { 0.5 } else { 0.0 };
                if i == 40 {
                    0.0
                } else {
                    v
                }
            })
            .collect();
        let want: [u8; 68] = [
            26, 40, 129, 35, 187, 92, 244, 156, 46, 198, 104, 0, 152, 58, 210, 115, 12, 164, 69,
            221, 127, 23, 175, 81, 233, 129, 35, 187, 92, 244, 141, 46, 198, 104, 26, 40, 0, 152,
            58, 210, 115, 12, 164, 69, 0, 127, 23, 175, 81, 233, 129, 35, 187, 92, 244, 141, 46,
            198, 104, 0, 152, 58, 210, 115, 12, 164, 69, 221,
        ];
        let xb = f32s(&x);
        let whole_x = rect(0, 0, 1u64, 64);
        let op = Operation::GgmlQ8_0;
        let out = rect(0, 0, 1u64, 68);
        let mut dst = vec![0u8; 68];
        op.compute(&out, &[(whole_x.clone(), &xb)], Dtype::U8, &mut dst)
            .unwrap();
        assert_eq!(dst, want);
        // A part straddling the blocks' edge reads both blocks' values only.
        let part = rect(0, 30, 1u64, 10);
        let need = op.input_region(0, &part, &whole_x);
        assert_eq!(need, whole_x);
        let mut got = vec![0u8; 10];
        op.compute(&part, &[(need, &xb)], Dtype::U8, &mut got)
            .unwrap();
        assert_eq!(got, want[30..40]);
        let second = rect(0, 40, 1u64, 5);
        assert_eq!(op.input_region(0, &second, &whole_x), rect(0, 32, 1u64, 32));
    }

    #[test]
    fn q8_0_dequantized_equals_gguf_py_and_any_part_is_the_wholes_values() {
        // The blocks of the test above; the f32 bits gguf-py's
        // `quants.dequantize(blocks, Q8_0)` gives.
        let blocks: [u8; 68] = [
            26, 40, 129, 35, 187, 92, 244, 156, 46, 198, 104, 0, 152, 58, 210, 115, 12, 164, 69,
            221, 127, 23, 175, 81, 233, 129, 35, 187, 92, 244, 141, 46, 198, 104, 26, 40, 0, 152,
            58, 210, 115, 12, 164, 69, 0, 127, 23, 175, 81, 233, 129, 35, 187, 92, 244, 141, 46,
            198, 104, 0, 152, 58, 210, 115, 12, 164, 69, 221,
        ];
        let want: [u32; 64] = [
            3229759872, 1066372608, 3222110464, 1077718016, 3200573440, 3226276864, 1069329408,
            3220038656, 1079330816, 0, 3226814464, 1072555008, 3216813056, 1080809216, 1053089792,
            3225201664, 1074626816, 3213856256, 1082276224, 1060940800, 3223723264, 1076239616,
            3208424448, 3229759872, 1066372608, 3222110464, 1077718016, 3200573440, 3228292864,
            1069329408, 3220038656, 1079330816, 0, 3226814464, 1072555008, 3216813056, 1080809216,
            1053089792, 3225201664, 1074626816, 0, 1082276224, 1060940800, 3223723264, 1076239616,
            3208424448, 3229759872, 1066372608, 3222110464, 1077718016, 3200573440, 3228292864,
            1069329408, 3220038656, 1079330816, 0, 3226814464, 1072555008, 3216813056, 1080809216,
            1053089792, 3225201664, 1074626816, 3213856256,
        ];
        let op = Operation::GgmlQ8_0Dequantize;
        let whole_blocks = rect(0, 0, 1u64, 68);
        let out = rect(0, 0, 1u64, 64);
        let mut dst = vec![0u8; 256];
        op.compute(
            &out,
            &[(whole_blocks.clone(), &blocks)],
            Dtype::F32,
            &mut dst,
        )
        .unwrap();
        let got: Vec<u32> = (0..64).map(|i| f32_at(&dst, i).to_bits()).collect();
        assert_eq!(got, want);
        // Values 30..40 straddle the blocks' edge: both blocks' bytes, whole.
        let part = rect(0, 30, 1u64, 10);
        let need = op.input_region(0, &part, &whole_blocks);
        assert_eq!(need, whole_blocks);
        let mut got = vec![0u8; 40];
        op.compute(&part, &[(need, &blocks)], Dtype::F32, &mut got)
            .unwrap();
        assert!((0..10).all(|i| f32_at(&got, i).to_bits() == want[30 + i]));
        // Values 40..45: the second block only.
        let second = rect(0, 40, 1u64, 5);
        let need = op.input_region(0, &second, &whole_blocks);
        assert_eq!(need, rect(0, 34, 1u64, 34));
        let mut got = vec![0u8; 20];
        op.compute(&second, &[(need, &blocks[34..])], Dtype::F32, &mut got)
            .unwrap();
        assert!((0..5).all(|i| f32_at(&got, i).to_bits() == want[40 + i]));
    }

    /// llama.cpp's rotary permutation of computed rows (`LlamaModel.permute`:
    /// `reshape(H, 2, hd / 2, cols).swapaxes(1, 2)`) is a [`Operation::Permute`]: 2 heads
    /// of 4 rows, 1 column (f32), head rows (a0, a1, b0, b1) become (a0, b0, a1, b1), and
    /// a part of the output reads only its heads.
    #[test]
    fn rotary_halves_to_pairs_is_a_permute() {
        let x = f32s(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        let op = Operation::permute(
            &[8, 1],
            vec![2, 2, 2, 1],
            vec![0, 2, 1, 3],
            vec![8, 1],
            None,
        )
        .unwrap();
        let whole = rect(0, 0, 8u64, 1);
        let mut dst = vec![0u8; 32];
        op.compute(&whole, &[(whole.clone(), &x)], Dtype::F32, &mut dst)
            .unwrap();
        let got: Vec<f32> = (0..8).map(|i| f32_at(&dst, i)).collect();
        assert_eq!(got, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        // Rows 5..7 need head 1's rows only.
        let part = rect(5, 0, 2u64, 1);
        let need = op.input_region(0, &part, &whole);
        assert_eq!(need, rect(4, 0, 4u64, 1));
        let mut got = vec![0u8; 8];
        op.compute(&part, &[(need, &x[16..])], Dtype::F32, &mut got)
            .unwrap();
        assert_eq!((f32_at(&got, 0), f32_at(&got, 1)), (6.0, 5.0));
    }

    /// A `[4, 2, 3]` stacked kernel (`[embed, layers, out]`) read as layer 1's
    /// `[3, 4]` transpose: the whole, a part that needs only some of the input, and the
    /// scaled form.
    #[test]
    fn permute_takes_a_layer_of_a_stacked_kernel_transposed() {
        let layer1: Vec<f32> = (0..4)
            .flat_map(|e| (0..3).map(move |o| (e * 6 + 3 + o) as f32))
            .collect();
        let x = f32s(&layer1);
        let op = Operation::permute(&[4, 1, 3], vec![4, 3], vec![1, 0], vec![3, 4], None).unwrap();
        let whole = Region::from_ranges(&[0..4, 1..2, 0..3]);
        let out = rect(0, 0, 3u64, 4);
        assert_eq!(op.input_region(0, &out, &whole), whole);
        let mut dst = vec![0u8; 48];
        op.compute(&out, &[(whole.clone(), &x)], Dtype::F32, &mut dst)
            .unwrap();
        let got: Vec<f32> = (0..12).map(|i| f32_at(&dst, i)).collect();
        let want: Vec<f32> = (0..3)
            .flat_map(|o| (0..4).map(move |e| (e * 6 + 3 + o) as f32))
            .collect();
        assert_eq!(got, want);
        // The transpose back, [3, 4] -> [4, 1, 3], doubled: its rows 1..3 need the
        // input's columns 1..3 only.
        let back =
            Operation::permute(&[3, 4], vec![3, 4], vec![1, 0], vec![4, 1, 3], Some(2.0)).unwrap();
        let part = Region::from_ranges(&[1..3, 0..1, 0..3]);
        let hw = rect(0, 0, 3u64, 4);
        let need = back.input_region(0, &part, &hw);
        assert_eq!(need, rect(0, 1, 3u64, 2));
        let w = f32s(&want);
        let mut input = Vec::new();
        for r in 0..3 {
            input.extend_from_slice(&w[r * 16 + 4..r * 16 + 12]);
        }
        let mut got = vec![0u8; 24];
        back.compute(&part, &[(need, &input)], Dtype::F32, &mut got)
            .unwrap();
        let got: Vec<f32> = (0..6).map(|i| f32_at(&got, i)).collect();
        let want: Vec<f32> = (1..3)
            .flat_map(|e| (0..3).map(move |o| 2.0 * (e * 6 + 3 + o) as f32))
            .collect();
        assert_eq!(got, want);
    }

    proptest::proptest! {
        /// Every element of a permuted box, whatever the element size and the box, is
        /// the input element its index names (the odometer walk against the definition).
        #[test]
        fn permuted_boxes_take_the_elements_their_indices_name(
            dims in proptest::collection::vec(1u64..5, 2..5),
            seed in 0u64..1000,
            size in proptest::sample::select(vec![1usize, 2, 4, 8]),
        ) {
            let nd = dims.len();
            // A permutation of the axes from the seed, and an output box inside.
            let mut axes: Vec<usize> = (0..nd).collect();
            let mut r = seed;
            for i in (1..nd).rev() {
                axes.swap(i, (r % (i as u64 + 1)) as usize);
                r /= i as u64 + 1;
            }
            let ps: Vec<u64> = axes.iter().map(|&a| dims[a]).collect();
            let start: Vec<u64> = ps.iter().map(|&d| seed % d).collect();
            let shape: Vec<u64> = ps.iter().zip(&start).map(|(&d, &s)| d - s).collect();
            let out = Region::new(start, shape);
            let n: u64 = dims.iter().product();
            let dtype = match size { 1 => Dtype::U8, 2 => Dtype::BF16, 4 => Dtype::F32, _ => Dtype::F64 };
            let x: Vec<u8> = (0..n as usize * size).map(|i| (i * 7 + 3) as u8).collect();
            let op = Operation::permute(&[n], dims.clone(), axes.clone(), ps.clone(), None).unwrap();
            let whole = Region::full(&[n]);
            let need = op.input_region(0, &out, &whole);
            let input = &x[need.start[0] as usize * size..need.end(0) as usize * size];
            let mut got = vec![0u8; out.numel() as usize * size];
            op.compute(&out, &[(need.clone(), input)], dtype, &mut got).unwrap();
            let xs = strides_of(&dims);
            let mut e = 0;
            let mut idx = vec![0u64; nd];
            while e < out.numel() as usize {
                let at: u64 = (0..nd).map(|k| (out.start[k] + idx[k]) * xs[axes[k]]).sum();
                let at = at as usize * size;
                proptest::prop_assert_eq!(&got[e * size..(e + 1) * size], &x[at..at + size], "element {:?}", idx);
                e += 1;
                for k in (0..nd).rev() {
                    idx[k] += 1;
                    if idx[k] < out.shape[k] { break; }
                    idx[k] = 0;
                }
            }
        }
    }

    /// The leading dimension of the permuted tensor is the outer part of the input's
    /// first: rows of the output need only those heads.
    #[test]
    fn permute_reads_only_the_heads_a_part_needs() {
        // Input [E=2, H=3, D=2] (a layer's query kernel), output [H*D=6, E=2].
        let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let op =
            Operation::permute(&[2, 3, 2], vec![2, 3, 2], vec![1, 2, 0], vec![6, 2], None).unwrap();
        // The heads are the input's dimension 1, one index each.
        let whole = Region::from_ranges(&[0..2, 0..3, 0..2]);
        let part = rect(2, 0, 2u64, 2); // head 1's two rows
        let need = op.input_region(0, &part, &whole);
        assert_eq!(need, Region::from_ranges(&[0..2, 1..2, 0..2]));
        let input: Vec<f32> = (0..2)
            .flat_map(|e| (0..2).map(move |d| (e * 6 + 2 + d) as f32))
            .collect();
        let mut dst = vec![0u8; 16];
        op.compute(&part, &[(need, &f32s(&input))], Dtype::F32, &mut dst)
            .unwrap();
        let got: Vec<f32> = (0..4).map(|i| f32_at(&dst, i)).collect();
        // Row (h=1, d) column e is x[e, 1, d].
        assert_eq!(got, [x[2], x[8], x[3], x[9]]);
    }
}

//! 2-D convolution as one candle op, one image at a time: forward, each image's im2col
//! matrix (`[c·k·k, ho·wo]`, built in a buffer the task reuses) times the kernel gives
//! that image's `[o, ho·wo]` output, already in NCHW order; backward, the same matrix
//! gives the image's share of the kernel gradient and the kernel's transpose times the
//! output gradient gives the input gradient through col2im.
//!
//! Why not candle's: its backward goes through a transposed convolution several times
//! slower on the CPU. Why not one im2col matrix for the whole batch (the previous
//! version): for ResNet-20 that is a fresh 37 MB buffer per convolution, written once and
//! read once (page faults, memset, a cache miss per element), and the product comes out
//! `[b·ho·wo, o]`, needing a transpose to NCHW. Per image, the matrix stays in cache
//! between im2col and the product, and images run in parallel on the caller's rayon
//! pool with single-threaded products ([`gemm`], the kernels candle's matmul uses).
//!
//! Reproducible: every image's output and input gradient is one product of fixed shape;
//! the kernel gradient is summed over fixed groups of images (their number depends on
//! the batch, not on the threads), then over the groups in order, so the bits do not
//! depend on the thread count or on scheduling.

use crate::cpu_data::{f32_slice, with_f32};
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

struct Conv2dOp {
    stride: usize,
    padding: usize,
}

/// The batch's kernel gradient is summed in at most this many groups of consecutive
/// images, one task each: enough tasks for the cores, few enough partial gradients
/// (`o·c·k·k` floats each) to keep memory small. A constant, not the thread count, so
/// that the sums do not depend on the machine.
const GRAD_GROUPS: usize = 8;

/// Geometry of one convolution.
#[derive(Clone, Copy)]
struct Geom {
    b: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    k: usize,
    ho: usize,
    wo: usize,
    stride: usize,
    pad: usize,
}

/// `out[i] = inp[i·s + off - pad]` where that index is inside `inp`: the range of `i`
/// in `0..out_len` for which it is.
fn valid(off: usize, s: usize, pad: usize, inp: usize, out_len: usize) -> (usize, usize) {
    let lo = pad.saturating_sub(off).div_ceil(s).min(out_len);
    let hi = if inp + pad > off {
        ((inp + pad - off - 1) / s + 1).min(out_len)
    } else {
        0
    };
    (lo, hi.max(lo))
}

impl Geom {
    fn new(x: &Shape, w: &Shape, stride: usize, pad: usize) -> candle_core::Result<Geom> {
        let (b, c, h, wd) = x.dims4()?;
        let (o, c2, k, k2) = w.dims4()?;
        if c != c2 || k != k2 || h + 2 * pad < k || wd + 2 * pad < k || stride == 0 {
            candle_core::bail!(
                "conv2d: input {x:?} and kernel {w:?} (stride {stride}, padding {pad}) do not fit"
            )
        }
        Ok(Geom {
            b,
            c,
            h,
            w: wd,
            o,
            k,
            ho: (h + 2 * pad - k) / stride + 1,
            wo: (wd + 2 * pad - k) / stride + 1,
            stride,
            pad,
        })
    }

    /// Rows of an image's im2col matrix: one per (input channel, ky, kx).
    fn ckk(&self) -> usize {
        self.c * self.k * self.k
    }

    /// Output pixels per image: the im2col matrix's columns.
    fn pixels(&self) -> usize {
        self.ho * self.wo
    }

    fn image_in(&self) -> usize {
        self.c * self.h * self.w
    }

    fn image_out(&self) -> usize {
        self.o * self.pixels()
    }

    /// A 1x1 convolution with stride 1 and no padding: the image is its own im2col
    /// matrix.
    fn pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// Calls `f(row of the im2col matrix, output row oy, (first ox, end ox), start of
    /// the input row, kx)` for every stretch of an image's im2col matrix that reads the
    /// input; everything else is padding.
    fn for_each_run(&self, mut f: impl FnMut(usize, usize, (usize, usize), usize, usize)) {
        let (k, s, p) = (self.k, self.stride, self.pad);
        for ci in 0..self.c {
            for ky in 0..k {
                let (oy_lo, oy_hi) = valid(ky, s, p, self.h, self.ho);
                for kx in 0..k {
                    let row = (ci * k + ky) * k + kx;
                    let xs = valid(kx, s, p, self.w, self.wo);
                    if xs.0 == xs.1 {
                        continue;
                    }
                    for oy in oy_lo..oy_hi {
                        let iy = oy * s + ky - p;
                        // Input index of output column ox: (ci, iy, ox·s + kx - p).
                        f(row, oy, xs, (ci * self.h + iy) * self.w, kx);
                    }
                }
            }
        }
    }

    /// One image's im2col matrix `[c·k·k, ho·wo]` into `cols`.
    fn im2col(&self, x: &[f32], cols: &mut [f32]) {
        let (n, wo, s, p) = (self.pixels(), self.wo, self.stride, self.pad);
        cols.fill(0.0);
        self.for_each_run(|row, oy, (lo, hi), src, kx| {
            let out = &mut cols[row * n + oy * wo + lo..row * n + oy * wo + hi];
            let first = src + lo * s + kx - p;
            if s == 1 {
                out.copy_from_slice(&x[first..first + out.len()]);
            } else {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = x[first + j * s];
                }
            }
        });
    }

    /// Adds one image's im2col-shaped gradient `cols` into its input gradient `dx`.
    fn col2im(&self, cols: &[f32], dx: &mut [f32]) {
        let (n, wo, s, p) = (self.pixels(), self.wo, self.stride, self.pad);
        self.for_each_run(|row, oy, (lo, hi), src, kx| {
            let from = &cols[row * n + oy * wo + lo..row * n + oy * wo + hi];
            let first = src + lo * s + kx - p;
            if s == 1 {
                for (d, v) in dx[first..first + from.len()].iter_mut().zip(from) {
                    *d += v;
                }
            } else {
                for (j, v) in from.iter().enumerate() {
                    dx[first + j * s] += v;
                }
            }
        });
    }
}

/// Row-major matrix operand: its data and the strides of a row and of a column.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    fn rows(data: &'a [f32], cols: usize) -> Mat<'a> {
        Mat {
            data,
            rs: cols,
            cs: 1,
        }
    }

    fn t(self) -> Mat<'a> {
        Mat {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// `dst [m, n] (row-major) = a [m, k] · b [k, n]`, or `+=` when `add`; single-threaded.
fn matmul(dst: &mut [f32], add: bool, (m, n, k): (usize, usize, usize), a: Mat, b: Mat) {
    let last = |x: &Mat, r: usize, c: usize| (r - 1) * x.rs + (c - 1) * x.cs + 1;
    assert!(
        dst.len() >= m * n
            && (m * k == 0 || (a.data.len() >= last(&a, m, k) && b.data.len() >= last(&b, k, n))),
        "conv2d: matrix product out of bounds"
    );
    // SAFETY: the assertion above keeps every element the product reads (a: m x k, b: k x n
    // with their strides) and writes (dst: m x n, row-major) inside the slices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            add,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

impl Geom {
    fn forward(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let (o, n, ckk) = (self.o, self.pixels(), self.ckk());
        let mut y = vec![0f32; self.b * self.image_out()];
        let buf = if self.pointwise() { 0 } else { ckk * n };
        y.par_chunks_mut(self.image_out().max(1))
            .zip(x.par_chunks(self.image_in().max(1)))
            .for_each_init(
                || vec![0f32; buf],
                |cols, (yb, xb)| {
                    let cols: &[f32] = if self.pointwise() {
                        xb
                    } else {
                        self.im2col(xb, cols);
                        cols
                    };
                    matmul(
                        yb,
                        false,
                        (o, n, ckk),
                        Mat::rows(w, ckk),
                        Mat::rows(cols, n),
                    );
                },
            );
        y
    }

    /// Input and kernel gradients from the output gradient `dy`.
    fn backward(&self, x: &[f32], w: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (o, n, ckk) = (self.o, self.pixels(), self.ckk());
        let (per_in, per_out) = (self.image_in().max(1), self.image_out().max(1));
        let per_group = self.b.div_ceil(GRAD_GROUPS).max(1);
        let buf = if self.pointwise() { 0 } else { ckk * n };
        let mut dx = vec![0f32; self.b * self.image_in()];
        let partial: Vec<Vec<f32>> = dx
            .par_chunks_mut(per_group * per_in)
            .zip(x.par_chunks(per_group * per_in))
            .zip(dy.par_chunks(per_group * per_out))
            .map(|((dxg, xg), dyg)| {
                let mut dw = vec![0f32; o * ckk];
                let (mut cols, mut dcols) = (vec![0f32; buf], vec![0f32; buf]);
                let images = dxg
                    .chunks_mut(per_in)
                    .zip(xg.chunks(per_in))
                    .zip(dyg.chunks(per_out));
                for (j, ((dxb, xb), dyb)) in images.enumerate() {
                    let cols: &[f32] = if self.pointwise() {
                        xb
                    } else {
                        self.im2col(xb, &mut cols);
                        &cols
                    };
                    // dW += dy_b [o, n] · cols_bᵀ [n, ckk]
                    let dyb = Mat::rows(dyb, n);
                    matmul(&mut dw, j > 0, (o, ckk, n), dyb, Mat::rows(cols, n).t());
                    // dcols = Wᵀ [ckk, o] · dy_b [o, n], then back to the image.
                    let wt = Mat::rows(w, ckk).t();
                    if self.pointwise() {
                        matmul(dxb, false, (ckk, n, o), wt, dyb);
                    } else {
                        matmul(&mut dcols, false, (ckk, n, o), wt, dyb);
                        self.col2im(&dcols, dxb);
                    }
                }
                dw
            })
            .collect();
        let mut groups = partial.into_iter();
        let mut dw = groups.next().unwrap_or_else(|| vec![0f32; o * ckk]);
        for g in groups {
            for (a, b) in dw.iter_mut().zip(&g) {
                *a += b;
            }
        }
        (dx, dw)
    }
}

impl CustomOp2 for Conv2dOp {
    fn name(&self) -> &'static str {
        "conv2d-im2col"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = Geom::new(l1.shape(), l2.shape(), self.stride, self.padding)?;
        let y = g.forward(
            f32_slice(s1, l1, "conv2d: input")?,
            f32_slice(s2, l2, "conv2d: kernel")?,
        );
        Ok((CpuStorage::F32(y), (g.b, g.o, g.ho, g.wo).into()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = Geom::new(x.shape(), w.shape(), self.stride, self.padding)?;
        let (dx, dw) = with_f32(x, "conv2d: input", |xs| {
            with_f32(w, "conv2d: kernel", |ws| {
                with_f32(grad, "conv2d: gradient", |dy| g.backward(xs, ws, dy))
            })
        })???;
        let dev = x.device();
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), dev)?),
            Some(Tensor::from_vec(dw, w.shape(), dev)?),
        ))
    }
}

/// `conv2d(x [b, c, h, w], w [o, c, k, k])` with square stride and zero padding (CPU
/// tensors; candle's own `conv2d` is the same convolution on every device).
///
/// # Errors
/// Shapes that do not fit.
pub(crate) fn conv2d(
    x: &Tensor,
    w: &Tensor,
    stride: usize,
    padding: usize,
) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2(&w.contiguous()?, Conv2dOp { stride, padding })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn matches_candle_conv2d_and_its_gradients() {
        let dev = Device::Cpu;
        // Padding wider than the kernel's reach, pointwise, strided 1x1, and batches of
        // one, of fewer images than kernel-gradient groups, and of more.
        for (b, c, o, hw, k, stride, pad) in [
            (2, 3, 4, 7, 3, 1, 1),
            (1, 2, 5, 8, 3, 2, 1),
            (11, 4, 3, 6, 1, 2, 0),
            (3, 2, 2, 5, 3, 1, 0),
            (17, 3, 4, 5, 1, 1, 0),
            (5, 2, 3, 4, 3, 3, 2),
            (2, 1, 2, 3, 5, 1, 2),
        ] {
            let x =
                Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, c, hw, hw), &dev).unwrap()).unwrap();
            let w =
                Var::from_tensor(&Tensor::randn(0f32, 1.0, (o, c, k, k), &dev).unwrap()).unwrap();
            let a = conv2d(x.as_tensor(), w.as_tensor(), stride, pad).unwrap();
            let b = x
                .as_tensor()
                .conv2d(w.as_tensor(), pad, stride, 1, 1)
                .unwrap();
            assert_eq!(a.dims(), b.dims());
            let probe = Tensor::randn(0f32, 1.0, a.dims(), &dev).unwrap();
            let ga = (a.clone() * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gb = (b.clone() * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let close = |p: &Tensor, q: &Tensor| {
                let d = (p - q)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(
                    d < 1e-4,
                    "b{b} c{c} o{o} k{k} s{stride} p{pad}: differ by {d}"
                );
            };
            close(&a, &b);
            close(
                ga.get(x.as_tensor()).unwrap(),
                gb.get(x.as_tensor()).unwrap(),
            );
            close(
                ga.get(w.as_tensor()).unwrap(),
                gb.get(w.as_tensor()).unwrap(),
            );
        }
    }
}

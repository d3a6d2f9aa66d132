//! 2-D convolution as one candle op: im2col then one matrix product forward, and two
//! matrix products plus col2im backward (candle's own backward goes through a
//! transposed convolution that is several times slower on the CPU).

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

struct Conv2dOp {
    stride: usize,
    padding: usize,
}

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

    fn rows(&self) -> usize {
        self.b * self.ho * self.wo
    }

    fn cols(&self) -> usize {
        self.c * self.k * self.k
    }

    /// Visits every (column, input index) pair of image `bi`'s rows of the im2col
    /// matrix that falls inside the image; columns are relative to the image's rows.
    fn for_each_in(&self, bi: usize, mut f: impl FnMut(usize, usize)) {
        let (k, s, p) = (self.k, self.stride, self.pad);
        let ckk = self.cols();
        for oy in 0..self.ho {
            for ox in 0..self.wo {
                let row = (oy * self.wo + ox) * ckk;
                for ci in 0..self.c {
                    let base = (bi * self.c + ci) * self.h;
                    for ky in 0..k {
                        let iy = (oy * s + ky).wrapping_sub(p);
                        if iy >= self.h {
                            continue;
                        }
                        let col = row + (ci * k + ky) * k;
                        let src = (base + iy) * self.w;
                        for kx in 0..k {
                            let ix = (ox * s + kx).wrapping_sub(p);
                            if ix < self.w {
                                f(col + kx, src + ix);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The im2col matrix `[b * ho * wo, c * k * k]`, one image per task.
    fn im2col(&self, x: &[f32]) -> Vec<f32> {
        let per = self.ho * self.wo * self.cols();
        let mut cols = vec![0f32; self.b * per];
        cols.par_chunks_mut(per.max(1))
            .enumerate()
            .for_each(|(bi, out)| self.for_each_in(bi, |ci, xi| out[ci] = x[xi]));
        cols
    }

    /// Sums the im2col-shaped gradient back into an input-shaped one, one image per task.
    fn col2im(&self, cols: &[f32]) -> Vec<f32> {
        let per_in = self.c * self.h * self.w;
        let per = self.ho * self.wo * self.cols();
        let mut x = vec![0f32; self.b * per_in];
        x.par_chunks_mut(per_in.max(1))
            .enumerate()
            .for_each(|(bi, out)| {
                let src = &cols[bi * per..(bi + 1) * per];
                let base = bi * per_in;
                self.for_each_in(bi, |ci, xi| out[xi - base] += src[ci]);
            });
        x
    }
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("conv2d: only f32 is supported")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("conv2d: tensors must be contiguous"),
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
        let dev = candle_core::Device::Cpu;
        let cols = Tensor::from_vec(g.im2col(slice(s1, l1)?), (g.rows(), g.cols()), &dev)?;
        let w = Tensor::from_slice(slice(s2, l2)?, (g.o, g.cols()), &dev)?;
        let y = cols
            .matmul(&w.t()?)?
            .reshape((g.b, g.ho * g.wo, g.o))?
            .transpose(1, 2)?
            .contiguous()?;
        Ok((
            CpuStorage::F32(y.flatten_all()?.to_vec1()?),
            (g.b, g.o, g.ho, g.wo).into(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = Geom::new(x.shape(), w.shape(), self.stride, self.padding)?;
        let dev = x.device();
        let cols = Tensor::from_vec(
            g.im2col(&x.flatten_all()?.to_vec1()?),
            (g.rows(), g.cols()),
            dev,
        )?;
        let dy = grad
            .reshape((g.b, g.o, g.ho * g.wo))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((g.rows(), g.o))?;
        let dw = dy.t()?.matmul(&cols)?.reshape(w.shape())?;
        let dcols = dy.matmul(&w.reshape((g.o, g.cols()))?)?;
        let dx = Tensor::from_vec(g.col2im(&dcols.flatten_all()?.to_vec1()?), x.shape(), dev)?;
        Ok((Some(dx), Some(dw)))
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
        for (c, o, hw, k, stride, pad) in [
            (3, 4, 7, 3, 1, 1),
            (2, 5, 8, 3, 2, 1),
            (4, 3, 6, 1, 2, 0),
            (2, 2, 5, 3, 1, 0),
        ] {
            let x =
                Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, c, hw, hw), &dev).unwrap()).unwrap();
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
                assert!(d < 1e-4, "c{c} o{o} k{k} s{stride} p{pad}: differ by {d}");
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

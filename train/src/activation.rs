//! ReLU fused into the op before it, as single candle ops with parallel passes: candle's
//! own `relu` costs one pass forward and five backward (two zero tensors, a comparison,
//! a cast, a product) on the rank's thread alone, and ResNet's `relu(h + shortcut)` adds
//! a pass each way. Here: one pass forward, one backward. The gradient is PyTorch's:
//! the output's gradient where the output is positive, zero elsewhere.

use crate::cpu_data::{f32_slice, with_f32};
use crate::kernels::Kernels;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

/// Elements per parallel task of an element-wise pass.
const CHUNK: usize = 1 << 15;

/// `v = max(v, 0)` for every element.
pub(crate) fn relu_in_place(v: &mut [f32]) {
    for x in v {
        *x = x.max(0.0);
    }
}

/// The gradient through a ReLU whose output is `y`: `grad` where `y > 0`, else 0.
///
/// # Errors
/// Tensors that are not f32 on the CPU.
pub(crate) fn relu_grad(y: &Tensor, grad: &Tensor) -> candle_core::Result<Tensor> {
    let dx = with_f32(y, "relu: output", |y| {
        with_f32(grad, "relu: gradient", |g| {
            let mut dx = vec![0f32; g.len()];
            dx.par_chunks_mut(CHUNK)
                .zip(y.par_chunks(CHUNK).zip(g.par_chunks(CHUNK)))
                .for_each(|(d, (y, g))| {
                    for ((d, &y), &g) in d.iter_mut().zip(y).zip(g) {
                        *d = if y > 0.0 { g } else { 0.0 };
                    }
                });
            dx
        })
    })??;
    Tensor::from_vec(dx, grad.shape(), grad.device())
}

struct AddRelu;

impl CustomOp2 for AddRelu {
    fn name(&self) -> &'static str {
        "add-relu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            candle_core::bail!(
                "add-relu: shapes {:?} and {:?} differ",
                l1.shape(),
                l2.shape()
            )
        }
        let a = f32_slice(s1, l1, "add-relu: left")?;
        let b = f32_slice(s2, l2, "add-relu: right")?;
        let mut y = vec![0f32; a.len()];
        y.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
            .for_each(|(y, (a, b))| {
                for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
                    *y = (a + b).max(0.0);
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let d = relu_grad(res, grad)?;
        Ok((Some(d.clone()), Some(d)))
    }
}

/// `relu(a + b)`, one fused op on the CPU kernels.
///
/// # Errors
/// Shapes that differ.
pub(crate) fn add_relu(kernels: Kernels, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match kernels {
        Kernels::Cpu => a.contiguous()?.apply_op2(&b.contiguous()?, AddRelu),
        Kernels::Portable => (a + b)?.relu(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn add_relu_and_its_gradients_match_candle() {
        let dev = Device::Cpu;
        let a = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 5, 7), &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 5, 7), &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 5, 7), &dev).unwrap();
        let fused = add_relu(Kernels::Cpu, a.as_tensor(), b.as_tensor()).unwrap();
        let plain = (a.as_tensor() + b.as_tensor()).unwrap().relu().unwrap();
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(values(&fused), values(&plain));
        // Both sides of the ReLU are exercised.
        let out = values(&fused);
        assert!(out.contains(&0.0) && out.iter().any(|&v| v > 0.0));
        let gf = (fused * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gp = (plain * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for v in [&a, &b] {
            assert_eq!(
                values(gf.get(v.as_tensor()).unwrap()),
                values(gp.get(v.as_tensor()).unwrap())
            );
        }
        let e = add_relu(Kernels::Cpu, a.as_tensor(), &probe.narrow(0, 0, 2).unwrap());
        assert!(e.unwrap_err().to_string().contains("differ"));
    }
}

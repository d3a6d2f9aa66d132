//! Autograd-aware collectives for tensor and data parallelism (Megatron's `f`/`g`).
//!
//! Each is a candle custom op whose forward and backward talk through a [`Comm`]:
//!
//! | op | forward | backward |
//! | --- | --- | --- |
//! | [`copy_to_group`] (`f`) | identity | all-reduce sum |
//! | [`reduce_from_group`] (`g`) | all-reduce sum | identity |
//! | [`gather_from_group`] | all-gather along the last dim | keep own slice |
//! | [`all_reduce_sum_both`] | all-reduce sum | all-reduce sum |
//!
//! The last one is for synchronized BatchNorm over `dp`: the global loss is the sum of
//! the ranks' losses, so the gradient of a statistic summed over ranks is itself summed.
//! On a group of one every op is the identity and adds no node to the graph.
//!
//! Collectives work on host buffers whatever the backend, so on a GPU the ops stage
//! their tensor through host memory ([`on_host`]); the model maths around them stays on
//! the device.

use crate::comm::{Comm, ReduceOp};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape, Tensor};
use std::sync::Arc;

/// Runs a host kernel `f` on the storage of any device: copies it to host memory (the
/// layout still applies: the whole buffer comes over), runs `f`, and puts the result
/// back on the storage's device.
pub(crate) fn on_host<S>(
    storage: &S,
    layout: &Layout,
    f: impl FnOnce(&CpuStorage, &Layout) -> candle_core::Result<(CpuStorage, Shape)>,
) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let (out, shape) = f(&storage.to_cpu_storage()?, layout)?;
    Ok((storage.device().storage_from_cpu_storage_owned(out)?, shape))
}

/// Which of the ops above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Copy,
    Reduce,
    SumBoth,
}

struct CommOp {
    comm: Arc<dyn Comm>,
    kind: Kind,
}

fn reduce_tensor(comm: &dyn Comm, t: &Tensor) -> candle_core::Result<Tensor> {
    crate::comm::all_reduce_tensor(comm, &t.contiguous()?, ReduceOp::Sum)
        .map_err(candle_core::Error::wrap)
}

impl CustomOp1 for CommOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Copy => "copy-to-group",
            Kind::Reduce => "reduce-from-group",
            Kind::SumBoth => "all-reduce-sum",
        }
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let mut v = crate::cpu_data::f32_slice(storage, layout, self.name())?.to_vec();
        if self.kind != Kind::Copy {
            self.comm
                .all_reduce(&mut v, ReduceOp::Sum)
                .map_err(candle_core::Error::wrap)?;
        }
        Ok((CpuStorage::F32(v), layout.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        on_host(storage, layout, |s, l| self.cpu_fwd(s, l))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        match self.kind {
            Kind::Reduce => Ok(Some(grad_res.clone())),
            Kind::Copy | Kind::SumBoth => Ok(Some(reduce_tensor(self.comm.as_ref(), grad_res)?)),
        }
    }
}

fn apply(x: &Tensor, comm: &Arc<dyn Comm>, kind: Kind) -> candle_core::Result<Tensor> {
    if comm.size() == 1 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op1(CommOp {
        comm: comm.clone(),
        kind,
    })
}

/// Megatron's `f`: identity forward, gradient all-reduced over the group. Put before a
/// column-parallel layer whose input is replicated.
///
/// # Errors
/// Collective or tensor errors.
pub fn copy_to_group(x: &Tensor, comm: &Arc<dyn Comm>) -> candle_core::Result<Tensor> {
    apply(x, comm, Kind::Copy)
}

/// Megatron's `g`: partial sums all-reduced forward, gradient passed through. Put after
/// a row-parallel layer.
///
/// # Errors
/// Collective or tensor errors.
pub fn reduce_from_group(x: &Tensor, comm: &Arc<dyn Comm>) -> candle_core::Result<Tensor> {
    apply(x, comm, Kind::Reduce)
}

/// All-reduce sum whose gradient is also all-reduced (synchronized BatchNorm).
///
/// # Errors
/// Collective or tensor errors.
pub fn all_reduce_sum_both(x: &Tensor, comm: &Arc<dyn Comm>) -> candle_core::Result<Tensor> {
    apply(x, comm, Kind::SumBoth)
}

struct GatherOp {
    comm: Arc<dyn Comm>,
    /// Global size of the last dim, split as `torch.chunk` over the group.
    global: usize,
}

/// `torch.chunk` of `n` into `k`: the `i`-th piece as `(start, len)`.
#[must_use]
pub fn chunk(n: usize, k: usize, i: usize) -> (usize, usize) {
    let size = n.div_ceil(k);
    let start = (i * size).min(n);
    let end = ((i + 1) * size).min(n);
    (start, end - start)
}

impl CustomOp1 for GatherOp {
    fn name(&self) -> &'static str {
        "gather-from-group"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = crate::cpu_data::f32_slice(storage, layout, self.name())?;
        let dims = layout.shape().dims();
        let last = *dims.last().unwrap_or(&1);
        let rows = v.len().checked_div(last).unwrap_or(0);
        let parts = self.comm.all_gather(v).map_err(candle_core::Error::wrap)?;
        let k = parts.len();
        let mut out = vec![0f32; rows * self.global];
        for (i, p) in parts.iter().enumerate() {
            let (start, len) = chunk(self.global, k, i);
            if p.len() != rows * len {
                candle_core::bail!(
                    "gather-from-group: rank {i} sent {} values, expected {}",
                    p.len(),
                    rows * len
                );
            }
            for r in 0..rows {
                out[r * self.global + start..r * self.global + start + len]
                    .copy_from_slice(&p[r * len..(r + 1) * len]);
            }
        }
        let mut shape = dims.to_vec();
        if let Some(l) = shape.last_mut() {
            *l = self.global;
        }
        Ok((CpuStorage::F32(out), shape.into()))
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        on_host(storage, layout, |s, l| self.cpu_fwd(s, l))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (start, len) = chunk(self.global, self.comm.size(), self.comm.rank());
        let d = grad_res.rank() - 1;
        Ok(Some(grad_res.narrow(d, start, len)?.contiguous()?))
    }
}

/// Gathers a tensor split over the group along its last dim (`torch.chunk` pieces of a
/// global size `global`); the gradient keeps this rank's slice. For a classifier head
/// sharded by class.
///
/// # Errors
/// Collective or tensor errors.
pub fn gather_from_group(
    x: &Tensor,
    comm: &Arc<dyn Comm>,
    global: usize,
) -> candle_core::Result<Tensor> {
    if comm.size() == 1 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op1(GatherOp {
        comm: comm.clone(),
        global,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::run_threads;
    use candle_core::{Device, Var};
    use ckpt_core::layout::mesh::Mesh;

    /// y = g(x_r * w_r) summed: the gradient of each rank's w is its own x, and `f`
    /// makes the gradient of a replicated input the sum over ranks.
    #[test]
    fn f_and_g_give_megatron_gradients() {
        let mesh = Mesh::parse("tp=2").unwrap();
        let out = run_threads(&mesh, |d| {
            let r = d.rank as f32;
            let x = Var::new(&[1.0f32, 2.0], &Device::Cpu)?;
            let w = Var::new(&[r + 1.0, r + 1.0], &Device::Cpu)?;
            let xf = copy_to_group(x.as_tensor(), &d.tp)?;
            let y = reduce_from_group(&(xf * w.as_tensor())?, &d.tp)?;
            let loss = y.sum_all()?;
            let g = loss.backward()?;
            let gx = g.get(x.as_tensor()).unwrap().to_vec1::<f32>()?;
            let gw = g.get(w.as_tensor()).unwrap().to_vec1::<f32>()?;
            Ok((loss.to_scalar::<f32>()?, gx, gw))
        })
        .unwrap();
        // loss = sum(x * (w0 + w1)) = 3 * 1 + 3 * 2 = 9 on both ranks.
        assert_eq!(out[0].0, 9.0);
        assert_eq!(out[1].0, 9.0);
        assert_eq!(out[0].1, vec![3.0, 3.0]);
        assert_eq!(out[0].2, vec![1.0, 2.0]);
    }

    /// The staging the GPU path uses, run on host storage: the kernel gets the whole
    /// buffer with the view's layout (offset and all) and its result comes back.
    #[test]
    fn on_host_runs_the_kernel_on_a_view() {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap()
            .narrow(0, 1, 2)
            .unwrap();
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            unreachable!("a CPU tensor")
        };
        let (out, shape) = on_host(cpu, layout, |s, l| {
            let v = crate::cpu_data::f32_slice(s, l, "double")?;
            let doubled = v.iter().map(|x| 2.0 * x).collect();
            Ok((CpuStorage::F32(doubled), l.shape().clone()))
        })
        .unwrap();
        assert_eq!(shape.dims(), &[2, 4]);
        let CpuStorage::F32(v) = out else {
            unreachable!("f32 in, f32 out")
        };
        assert_eq!(v, (4..12).map(|x| 2.0 * x as f32).collect::<Vec<_>>());
    }

    #[test]
    fn gather_concatenates_uneven_chunks_and_splits_gradients() {
        let mesh = Mesh::parse("tp=4").unwrap();
        let out = run_threads(&mesh, |d| {
            let (_, len) = chunk(10, 4, d.rank);
            let x = Var::new(vec![d.rank as f32; 2 * len], &Device::Cpu)?;
            let xs = x.as_tensor().reshape((2, len))?;
            let y = gather_from_group(&xs, &d.tp, 10)?;
            let scale = Tensor::arange(0f32, 10.0, &Device::Cpu)?;
            let loss = y.broadcast_mul(&scale)?.sum_all()?;
            let g = loss.backward()?;
            Ok((
                y.to_vec2::<f32>()?,
                g.get(x.as_tensor()).unwrap().to_vec1::<f32>()?,
            ))
        })
        .unwrap();
        assert_eq!(
            out[0].0[1],
            vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0]
        );
        assert_eq!(out[3].1, vec![9.0, 9.0]);
        assert_eq!(out[1].1, vec![3.0, 4.0, 5.0, 3.0, 4.0, 5.0]);
    }
}

//! The kernel table: which implementation of convolution, BatchNorm and the fused
//! activations a model runs. Its own module, below the layers and the kernels that
//! consult it, so that none of them imports another for it.

use candle_core::Device;

/// Which implementation of convolution and training-mode BatchNorm a model uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kernels {
    /// This crate's ops (im2col convolution, fused BatchNorm): fastest, CPU only.
    #[default]
    Cpu,
    /// The same maths from candle's ops, which every device runs (the GPU path).
    Portable,
}

impl Kernels {
    /// The kernels for tensors on `device`.
    #[must_use]
    pub fn for_device(device: &Device) -> Kernels {
        if device.is_cpu() {
            Kernels::Cpu
        } else {
            Kernels::Portable
        }
    }
}

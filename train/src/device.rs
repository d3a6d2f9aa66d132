//! Where a rank's model maths runs: the CPU, or a CUDA device through candle's CUDA
//! kernels (feature `cuda-candle`).
//!
//! The choice is separate from the communication backend: collectives work on host
//! buffers (see `parallel::on_host`), so every backend runs with either device, and a
//! rank binds the GPU `local_rank % device_count` as the NCCL backend does.

use crate::error::{Error, Result};
use crate::launch::{Backend, LaunchEnv};
use candle_core::Device;

/// The kind of device the model maths runs on (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum DeviceKind {
    /// The CPU (the im2col convolution and fused BatchNorm kernels of this crate).
    #[default]
    Cpu,
    /// A CUDA GPU through candle's CUDA kernels (build feature `cuda-candle`).
    Cuda,
}

impl DeviceKind {
    /// The name used on the command line.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }

    /// Checks, before any rank starts, that this build and machine can use the device:
    /// for CUDA, that candle's CUDA kernels were built in and that the driver sees at
    /// least one device.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] saying what is missing and how to get it.
    pub fn check(self) -> Result<()> {
        match self {
            DeviceKind::Cpu => Ok(()),
            DeviceKind::Cuda => cuda_device_count().map(|_| ()),
        }
    }

    /// The device of rank `rank` of `backend`: the CPU, or the CUDA device
    /// `local_rank % visible devices` (CUDA numbers only the devices in
    /// `CUDA_VISIBLE_DEVICES`), the GPU the NCCL backend binds for that rank.
    ///
    /// # Errors
    /// As [`DeviceKind::check`]; an incomplete launcher environment; the driver
    /// refusing the device.
    pub fn for_rank(self, backend: Backend, rank: usize) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => {
                let ordinal = local_rank(backend, rank)? % cuda_device_count()?;
                Device::new_cuda(ordinal).map_err(|e| Error::DeviceUnavailable {
                    device: self.name(),
                    problem: format!("CUDA device {ordinal}: {e}"),
                })
            }
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The local rank of a rank of `backend` whose world rank is `rank`: thread ranks all
/// live on this machine; a process started by a launcher reads its local rank from it
/// (one process alone is local rank 0).
///
/// # Errors
/// An incomplete launcher environment.
fn local_rank(backend: Backend, rank: usize) -> Result<usize> {
    Ok(match backend {
        Backend::Threads => rank,
        Backend::Mpi | Backend::Nccl => LaunchEnv::from_env()?.map_or(0, |e| e.local_rank),
    })
}

/// Visible CUDA devices, or why CUDA cannot be used by candle here.
fn cuda_device_count() -> Result<usize> {
    let unavailable = |problem: String| Error::DeviceUnavailable {
        device: DeviceKind::Cuda.name(),
        problem,
    };
    if !candle_core::utils::cuda_is_available() {
        return Err(unavailable(
            "this binary was built without candle's CUDA kernels; on a machine with the CUDA \
             toolkit (nvcc) rebuild with `cargo build --release --features cuda-candle` \
             (docs/distributed.md), or run with --device cpu"
                .into(),
        ));
    }
    gpu_count().map_err(unavailable)
}

#[cfg(feature = "cuda")]
fn gpu_count() -> std::result::Result<usize, String> {
    crate::cuda::gpu_count()
}

// candle's CUDA kernels come with the `cuda-candle` feature, which implies `cuda`: a
// build that reaches here without `cuda` has returned above.
#[cfg(not(feature = "cuda"))]
fn gpu_count() -> std::result::Result<usize, String> {
    Err("built without the `cuda` feature".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_there() {
        DeviceKind::Cpu.check().unwrap();
        assert!(DeviceKind::Cpu
            .for_rank(Backend::Threads, 3)
            .unwrap()
            .is_cpu());
    }

    /// Without candle's CUDA kernels (every build on this GPU-less CI), asking for CUDA
    /// is an error that says how to get them, not a panic.
    #[cfg(not(feature = "cuda-candle"))]
    #[test]
    fn cuda_without_the_kernels_says_how_to_build_them() {
        for r in [
            DeviceKind::Cuda.check(),
            DeviceKind::Cuda.for_rank(Backend::Threads, 0).map(|_| ()),
        ] {
            let e = r.unwrap_err().to_string();
            assert!(
                e.starts_with("device `cuda` unavailable: this binary was built without candle's CUDA kernels"),
                "{e}"
            );
            assert!(e.contains("--features cuda-candle"), "{e}");
        }
    }

    #[test]
    fn thread_ranks_are_local() {
        assert_eq!(local_rank(Backend::Threads, 5).unwrap(), 5);
    }
}

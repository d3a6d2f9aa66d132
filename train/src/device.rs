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

/// The local rank of a rank of `backend` whose world rank is `rank`: a process started
/// by a launcher reads it from the launcher; otherwise every rank is a thread of this
/// process (always so for the thread backend, and for NCCL started by `ckpt` itself).
///
/// # Errors
/// An incomplete launcher environment.
fn local_rank(backend: Backend, rank: usize) -> Result<usize> {
    Ok(local_rank_in(backend, rank, LaunchEnv::from_env()?))
}

/// [`local_rank`] with the launcher's environment given.
fn local_rank_in(backend: Backend, rank: usize, env: Option<LaunchEnv>) -> usize {
    match backend {
        Backend::Threads => rank,
        Backend::Mpi | Backend::Nccl => env.map_or(rank, |e| e.local_rank),
    }
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
    crate::cuda::gpu_count().map_err(unavailable)
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
    fn local_ranks() {
        let torchrun = [("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")];
        let env =
            LaunchEnv::from_vars(|k| torchrun.iter().find(|v| v.0 == k).map(|v| v.1.to_string()))
                .unwrap();
        assert!(env.is_some());
        // Thread ranks are all local, launcher or not.
        assert_eq!(local_rank_in(Backend::Threads, 5, env), 5);
        // A process per rank: the launcher's local rank.
        assert_eq!(local_rank_in(Backend::Nccl, 5, env), 1);
        assert_eq!(local_rank_in(Backend::Mpi, 5, env), 1);
        // NCCL thread ranks started by `ckpt train` itself.
        assert_eq!(local_rank_in(Backend::Nccl, 3, None), 3);
    }
}

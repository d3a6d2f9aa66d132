//! Launching a training job: the backends (threads, MPI, NCCL) and the CPU thread
//! pools. Where a process learns its rank, the world size and its local rank
//! (`mpirun`, `torchrun`, `srun`) is [`LaunchEnv`], in ckpt-core, shared with merge and
//! reshard (`--rank auto`).

// The launchers' variables are read by ckpt-core (merge and reshard's `--rank auto`
// use them too); training adds the backends and thread pools.
use crate::comm::{run_threads, Dist};
use crate::error::{Error, Result};
pub use ckpt_core::launch::{LaunchEnv, Launcher};
use ckpt_core::layout::mesh::Mesh;
use std::fmt;

/// How the ranks of a training job talk to each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Backend {
    /// Every rank is a thread of this process, collectives in shared memory.
    #[default]
    Threads,
    /// One process per rank under `mpirun`, collectives over Open MPI (feature `mpi`).
    Mpi,
    /// One process per rank and GPU, collectives over NCCL (feature `cuda`).
    Nccl,
}

impl Backend {
    /// The name used on the command line.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Backend::Threads => "threads",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }

    /// Whether this build has the backend (features `mpi` and `cuda`).
    #[must_use]
    pub fn is_built(self) -> bool {
        match self {
            Backend::Threads => true,
            Backend::Mpi => cfg!(feature = "mpi"),
            Backend::Nccl => cfg!(feature = "cuda-driver"),
        }
    }

    /// Checks that the backend was built in.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] naming the cargo feature to build with.
    pub fn check_built(self) -> Result<()> {
        if self.is_built() {
            return Ok(());
        }
        let feature = if self == Backend::Mpi { "mpi" } else { "cuda" };
        Err(Error::BackendUnavailable {
            backend: self.name(),
            problem: format!("this binary was built without it; rebuild with `cargo build --release --features {feature}`"),
        })
    }
}

/// Sets up this process's CPU threads and memory for `ranks` ranks running in it
/// (thread ranks; 1 under a launcher). Call it once, before any tensor work: candle and
/// rayon read these settings when their pools first start.
///
/// candle's element-wise ops run on a spinning barrier pool that serializes its callers:
/// thread ranks sharing it take turns and spin, and even one rank's small ops (the mlp's)
/// cost more in spinning than they gain, so candle runs them on the calling thread
/// (`CANDLE_NUM_THREADS=1`). Convolutions, BatchNorm, the optimizer and matrix products
/// use rayon: each thread rank runs on a pool of its own with its share of the cores
/// (`RAYON_NUM_THREADS`, threads per rank; set here so that candle does not parse
/// `/proc/cpuinfo` before every matrix product to find it). Variables already set by
/// the user are kept.
///
/// Memory: every candle op returns a fresh buffer, and glibc's allocator gives freed
/// ones back to the kernel (trimming the heap top, unmapping large blocks), so each
/// step faulted in and zeroed the same pages again (a tenth of the mlp's time in the
/// profile). The step's working set is the same every step, so freed memory stays in the
/// process: no trimming, and blocks up to 32 MiB (glibc's largest mmap threshold) from
/// the heap. Measured with `train-bench` (see the README).
pub fn configure_cpu_threads(ranks: usize) {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let set = |k: &str, v: usize| {
        if std::env::var_os(k).is_none() {
            // Called at start-up, before any other thread of this process exists.
            std::env::set_var(k, v.to_string());
        }
    };
    set("CANDLE_NUM_THREADS", 1);
    set("RAYON_NUM_THREADS", (cores / ranks.max(1)).max(1));
    keep_freed_memory();
}

/// Threads per thread rank: `RAYON_NUM_THREADS` when set (see [`configure_cpu_threads`]),
/// else an equal share of the cores, at least one.
pub(crate) fn threads_per_rank(ranks: usize) -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
            (cores / ranks.max(1)).max(1)
        })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only sets allocator parameters; called before other threads run.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

/// Thread ranks run the whole job in one process: started as one of several processes
/// by a launcher, every process would run all of it and write the same outputs. Refused,
/// with what to do instead.
fn threads_alone(env: Option<LaunchEnv>) -> Result<()> {
    match env {
        Some(e) if e.world_size > 1 => Err(Error::BackendUnavailable {
            backend: "threads",
            problem: format!(
                "this process is rank {} of {} started by {}, but thread ranks run the whole job in every process (each writing the same output): add --backend mpi (a build with --features mpi; --backend nccl with --features cuda), or start a single process",
                e.rank, e.world_size, e.launcher
            ),
        }),
        _ => Ok(()),
    }
}

impl Backend {
    /// Runs `f` as the ranks of `mesh` that live in this process, returning their
    /// results in rank order: every rank on threads; this process's rank under MPI or
    /// NCCL (a failing rank aborts the job there, see [`crate::MpiWorld::run`]).
    ///
    /// # Errors
    /// A backend not built in or unavailable here, an invalid mesh, the first failing
    /// rank's error.
    pub fn run<T: Send>(self, mesh: &Mesh, f: impl Fn(Dist) -> Result<T> + Sync) -> Result<Vec<T>> {
        match self {
            Backend::Threads => {
                threads_alone(LaunchEnv::from_env()?)?;
                run_threads(mesh, f)
            }
            #[cfg(feature = "mpi")]
            Backend::Mpi => Ok(vec![crate::comm::run_mpi(mesh, f)?]),
            #[cfg(feature = "cuda-driver")]
            Backend::Nccl => crate::comm::run_nccl(mesh, f),
            #[allow(unreachable_patterns)]
            other => other.check_built().map(|()| Vec::new()),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Ranks of a job in this process, for sizing the CPU thread pools before any tensor
/// work: the mesh's (else `ranks`) with the thread backend, 1 under a launcher (one
/// process per rank).
#[must_use]
pub fn ranks_in_process(backend: Backend, mesh: Option<&str>, ranks: Option<u64>) -> usize {
    if backend != Backend::Threads {
        return 1;
    }
    mesh.and_then(|m| Mesh::parse(m).ok())
        .map(|m| m.world_size())
        .or(ranks)
        .unwrap_or(1) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        Ok(LaunchEnv::from_vars(|k| {
            vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string())
        })?)
    }

    #[test]
    fn thread_ranks_under_a_launcher_of_several_processes_are_refused() {
        let two = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ])
        .unwrap();
        let e = threads_alone(two).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 of 2") && e.contains("--backend mpi"),
            "{e}"
        );
        let one = env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ])
        .unwrap();
        assert!(threads_alone(one).is_ok());
        assert!(threads_alone(None).is_ok());
    }

    #[test]
    fn test_backend_values() {
        use clap::ValueEnum;
        assert_eq!(Backend::from_str("mpi", false), Ok(Backend::Mpi));
        assert_eq!(Backend::from_str("threads", false), Ok(Backend::Threads));
        assert_eq!(Backend::from_str("nccl", false), Ok(Backend::Nccl));
        assert!(Backend::from_str("gloo", false).is_err());
        assert_eq!(Backend::default(), Backend::Threads);
        assert!(Backend::Threads.check_built().is_ok());
        assert_eq!(Backend::Mpi.check_built().is_ok(), cfg!(feature = "mpi"));
        if !cfg!(feature = "cuda-driver") {
            let err = Backend::Nccl.check_built().unwrap_err().to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }

    #[test]
    fn training_on_nccl_without_a_gpu_is_a_clear_error() {
        if crate::cuda_available().is_ok() {
            return;
        }
        let cfg = crate::TrainConfig::try_parse_from([
            "t",
            "--backend",
            "nccl",
            "--ranks",
            "2",
            "--max-steps",
            "1",
            "--no-eval",
        ])
        .unwrap();
        let err = crate::train(&cfg, false).unwrap_err();
        assert!(
            matches!(
                err,
                Error::BackendUnavailable {
                    backend: "nccl",
                    ..
                }
            ),
            "{err}"
        );
        eprintln!("{err}");
    }
}

//! Launch conventions: where a process learns its rank, the world size and its local
//! rank, so the same binary runs under `mpirun`, `torchrun` and SLURM's `srun`.
//!
//! | launcher | rank | world size | local rank |
//! |---|---|---|---|
//! | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//! | `torchrun` | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` |
//! | SLURM `srun` | `SLURM_PROCID` | `SLURM_NTASKS` (or `SLURM_NPROCS`) | `SLURM_LOCALID` |
//!
//! The first launcher whose rank variable is set wins, in the order of the table:
//! `mpirun` inside a SLURM allocation inherits the batch step's `SLURM_PROCID=0`, and
//! `torchrun` under `srun` sees one SLURM task per node, so the SLURM variables are
//! the last resort. Pure std; nothing here talks to MPI or CUDA.

use crate::comm::{run_threads, Dist};
use crate::error::{Error, Result};
use ckpt_core::Mesh;
use std::fmt;

/// The program that started this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// Open MPI's `mpirun` / `mpiexec` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// PyTorch's `torchrun` (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`).
    Torchrun,
    /// SLURM's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
}

impl Launcher {
    /// Every launcher, in the order they are looked for.
    pub const ALL: [Launcher; 3] = [Launcher::OpenMpi, Launcher::Torchrun, Launcher::Slurm];

    /// The variables `[rank, world size, local rank]` this launcher sets.
    #[must_use]
    pub fn variables(self) -> [&'static str; 3] {
        match self {
            Launcher::OpenMpi => [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ],
            Launcher::Torchrun => ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
            Launcher::Slurm => ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
        }
    }

    /// Another name for the world-size variable, read when the first is unset.
    fn world_size_fallback(self) -> Option<&'static str> {
        match self {
            Launcher::Slurm => Some("SLURM_NPROCS"),
            Launcher::OpenMpi | Launcher::Torchrun => None,
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::OpenMpi => "mpirun",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "srun",
        })
    }
}

/// This process's place in a job started by a [`Launcher`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchEnv {
    /// Who set the variables.
    pub launcher: Launcher,
    /// This process's rank in the job, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// This process's rank among the processes of its machine (picks its GPU).
    pub local_rank: usize,
}

impl LaunchEnv {
    /// Reads the launcher's variables from the process environment; `None` when no
    /// launcher's rank variable is set (a plain run).
    ///
    /// # Errors
    /// [`Error::Launch`] when a launcher's variables are incomplete, not numbers, or
    /// inconsistent (rank not below the world size).
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`LaunchEnv::from_env`], reading variables through `get` (for tests and for
    /// environments captured elsewhere).
    ///
    /// ```
    /// # use ckpt_train::{LaunchEnv, Launcher};
    /// let vars = [("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")];
    /// let env = LaunchEnv::from_vars(|k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string())).unwrap().unwrap();
    /// assert_eq!((env.launcher, env.rank, env.world_size, env.local_rank), (Launcher::Torchrun, 3, 8, 1));
    /// ```
    ///
    /// # Errors
    /// As [`LaunchEnv::from_env`].
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        for launcher in Launcher::ALL {
            let [rank_var, size_var, local_var] = launcher.variables();
            let Some(rank) = get(rank_var) else { continue };
            let rank = parse(rank_var, &rank)?;
            let world_size = match (get(size_var), launcher.world_size_fallback()) {
                (Some(v), _) => parse(size_var, &v)?,
                (None, Some(alt)) => match get(alt) {
                    Some(v) => parse(alt, &v)?,
                    None => return Err(missing(launcher, size_var, rank_var)),
                },
                (None, None) => return Err(missing(launcher, size_var, rank_var)),
            };
            let local_rank = match get(local_var) {
                Some(v) => parse(local_var, &v)?,
                None => return Err(missing(launcher, local_var, rank_var)),
            };
            if world_size == 0 {
                return Err(Error::Launch {
                    variable: size_var.into(),
                    problem: "the world size is 0".into(),
                });
            }
            if rank >= world_size {
                return Err(Error::Launch {
                    variable: rank_var.into(),
                    problem: format!(
                        "rank {rank} is not below the world size {world_size} ({size_var})"
                    ),
                });
            }
            if local_rank >= world_size {
                return Err(Error::Launch {
                    variable: local_var.into(),
                    problem: format!("local rank {local_rank} is not below the world size {world_size} ({size_var})"),
                });
            }
            return Ok(Some(LaunchEnv {
                launcher,
                rank,
                world_size,
                local_rank,
            }));
        }
        Ok(None)
    }
}

impl fmt::Display for LaunchEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} (local rank {}, started by {})",
            self.rank, self.world_size, self.local_rank, self.launcher
        )
    }
}

fn parse(variable: &str, value: &str) -> Result<usize> {
    value.trim().parse::<usize>().map_err(|_| Error::Launch {
        variable: variable.into(),
        problem: format!("`{value}` is not a rank or count"),
    })
}

fn missing(launcher: Launcher, variable: &str, because: &str) -> Error {
    Error::Launch {
        variable: variable.into(),
        problem: format!("not set, but {because} is (an incomplete {launcher} environment)"),
    }
}

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
            Backend::Nccl => cfg!(feature = "cuda"),
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
            #[cfg(feature = "cuda")]
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

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_vars(|k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string()))
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
    fn no_launcher_is_a_plain_run() {
        assert_eq!(env(&[]).unwrap(), None);
        assert_eq!(
            env(&[("LOCAL_RANK", "0"), ("SLURM_NTASKS", "4")]).unwrap(),
            None
        );
    }

    #[test]
    fn mpirun() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                launcher: Launcher::OpenMpi,
                rank: 5,
                world_size: 8,
                local_rank: 1
            }
        );
        assert_eq!(
            e.to_string(),
            "rank 5 of 8 (local rank 1, started by mpirun)"
        );
    }

    #[test]
    fn torchrun() {
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                launcher: Launcher::Torchrun,
                rank: 0,
                world_size: 2,
                local_rank: 0
            }
        );
    }

    #[test]
    fn srun_with_the_old_world_size_name() {
        let e = env(&[
            ("SLURM_PROCID", "7"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "3"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                launcher: Launcher::Slurm,
                rank: 7,
                world_size: 8,
                local_rank: 3
            }
        );
        let e = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NPROCS", "2"),
            ("SLURM_LOCALID", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world_size), (1, 2));
    }

    #[test]
    fn mpirun_inside_a_slurm_allocation_uses_mpi_ranks() {
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.world_size),
            (Launcher::OpenMpi, 3, 4)
        );
    }

    #[test]
    fn torchrun_under_srun_uses_torchrun_ranks() {
        let e = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("RANK", "6"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.world_size, e.local_rank),
            (Launcher::Torchrun, 6, 8, 2)
        );
    }

    #[test]
    fn incomplete_environments_name_the_missing_variable() {
        let err = env(&[("RANK", "0"), ("LOCAL_RANK", "0")]).unwrap_err();
        assert_eq!(err.to_string(), "environment variable WORLD_SIZE: not set, but RANK is (an incomplete torchrun environment)");
        let err = env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("environment variable OMPI_COMM_WORLD_LOCAL_RANK: not set"),
            "{err}"
        );
        let err = env(&[("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("environment variable SLURM_NTASKS: not set"),
            "{err}"
        );
    }

    #[test]
    fn malformed_and_inconsistent_values_are_errors() {
        let err = env(&[("RANK", "one"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment variable RANK: `one` is not a rank or count"
        );
        let err = env(&[("RANK", "-1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err();
        assert!(
            matches!(err, Error::Launch { ref variable, .. } if variable == "RANK"),
            "{err}"
        );
        let err = env(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment variable RANK: rank 2 is not below the world size 2 (WORLD_SIZE)"
        );
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "0"), ("LOCAL_RANK", "0")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment variable WORLD_SIZE: the world size is 0"
        );
        let err = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "2"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("local rank 2 is not below the world size 2"),
            "{err}"
        );
    }

    #[test]
    fn whitespace_around_numbers_is_accepted() {
        let e = env(&[("RANK", " 1\n"), ("WORLD_SIZE", "2 "), ("LOCAL_RANK", "1")])
            .unwrap()
            .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (1, 2, 1));
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
        if !cfg!(feature = "cuda") {
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

//! Launch conventions: where a process learns its rank, the world size and its local
//! rank, so the same binary runs under `mpirun`, `torchrun` and SLURM's `srun`. Here
//! in ckpt-core, below every tool, so that merge and reshard (`--rank auto`) and
//! training read them the same way.
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
//! the last resort. Pure std.

use crate::error::{Error, Result};
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
    /// # use ckpt_core::launch::{LaunchEnv, Launcher};
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

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_vars(|k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string()))
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
}

//! The one error type of ckpt-train: every variant names what failed.

use std::path::PathBuf;

/// Result with ckpt-train's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while training.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O error, with the file it happened on.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A data file is malformed.
    #[error("{path}: {problem}")]
    BadData {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// An option or combination of options is invalid.
    #[error("invalid option `{option}`: {problem}")]
    InvalidOption {
        /// The option.
        option: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A model configuration is invalid for the mesh or data.
    #[error("model `{model}`: {problem}")]
    InvalidModel {
        /// The model name.
        model: String,
        /// What is wrong.
        problem: String,
    },
    /// A collective failed: a peer rank stopped or the ranks disagreed.
    #[error("collective `{op}` in group {group}: {problem}")]
    Collective {
        /// The collective.
        op: &'static str,
        /// The group (its ranks).
        group: String,
        /// What went wrong.
        problem: String,
    },
    /// A rank thread panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A launcher's environment variables are incomplete or inconsistent.
    #[error("environment variable {variable}: {problem}")]
    Launch {
        /// The variable.
        variable: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A communication backend cannot run here: not built in, or no library, driver or
    /// device.
    #[error("backend `{backend}` unavailable: {problem}")]
    BackendUnavailable {
        /// The backend (`mpi`, `nccl`).
        backend: &'static str,
        /// What is missing.
        problem: String,
    },
    /// The device asked for cannot be used here: not built in, or no driver or GPU.
    #[error("device `{device}` unavailable: {problem}")]
    DeviceUnavailable {
        /// The device kind (`cuda`).
        device: &'static str,
        /// What is missing.
        problem: String,
    },
    /// A checkpoint to resume from is unusable.
    #[error("checkpoint {path}: {problem}")]
    BadCheckpoint {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// An error of the tensor library.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An error of ckpt-core (layouts, strategy, checkpoint I/O).
    #[error(transparent)]
    Core(#[from] ckpt_core::Error),
    /// A JSON file could not be read or written.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
}

/// Attaches a path to I/O errors.
pub(crate) trait IoContext<T> {
    /// The error, naming `path`.
    fn at(self, path: &std::path::Path) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

impl Error {
    /// An [`Error::InvalidOption`].
    pub(crate) fn option(option: &str, problem: impl Into<String>) -> Error {
        Error::InvalidOption {
            option: option.into(),
            problem: problem.into(),
        }
    }

    /// An [`Error::InvalidModel`].
    pub(crate) fn model(model: &str, problem: impl Into<String>) -> Error {
        Error::InvalidModel {
            model: model.into(),
            problem: problem.into(),
        }
    }
}

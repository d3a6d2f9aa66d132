//! The one error type of ckpt-core: every variant names what failed.

use std::path::PathBuf;

/// Result with ckpt-core's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ckpt-core.
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
    /// An object store or a URL (the storage layer names the object).
    #[error(transparent)]
    Storage(#[from] ckpt_storage::Error),
    /// Another error, with the file it concerns.
    #[error("{path}: {source}")]
    WithPath {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: Box<Error>,
    },
    /// Arithmetic on sizes or offsets overflowed.
    #[error("size overflow: {what}")]
    Overflow {
        /// What was being computed.
        what: String,
    },
    /// A mesh description is invalid.
    #[error("invalid mesh `{mesh}`: {problem}")]
    InvalidMesh {
        /// The mesh as given.
        mesh: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A tensor's layout is invalid (placements, shape, stage, blocks...).
    #[error("tensor `{tensor}`: {problem}")]
    InvalidLayout {
        /// The tensor.
        tensor: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A strategy file is malformed.
    #[error("invalid strategy: {problem}")]
    InvalidStrategy {
        /// What is wrong with it.
        problem: String,
    },
    /// A split-rules file (the `rules` section of a strategy file) is malformed; the
    /// rule at fault is named by its index and pattern.
    #[error("{path}: split rules: {problem}")]
    InvalidSplitRules {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A DeepSpeed checkpoint directory is incomplete or inconsistent (the file, and the
    /// tensor when one is at fault, are named).
    #[error("{path}: DeepSpeed checkpoint: {problem}")]
    InvalidDeepSpeed {
        /// The file or directory at fault.
        path: PathBuf,
        /// What is wrong, naming the tensor when one is at fault.
        problem: String,
    },
    /// A DeepSpeed universal checkpoint (`ds_to_universal.py`'s tree) is incomplete or
    /// inconsistent (the file, and the tensor when one is at fault, are named).
    #[error("{path}: DeepSpeed universal checkpoint: {problem}")]
    InvalidUcp {
        /// The file or directory at fault.
        path: PathBuf,
        /// What is wrong, naming the tensor when one is at fault.
        problem: String,
    },
    /// A Megatron legacy checkpoint's distributed optimizer state (`distrib_optim.pt`) is
    /// incomplete or does not fit the model's parameters (the file, and the tensor when
    /// one is at fault, are named).
    #[error("{path}: Megatron distributed optimizer state: {problem}")]
    InvalidMegatronOptim {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong, naming the tensor when one is at fault.
        problem: String,
    },
    /// An Orbax (JAX) checkpoint is incomplete, inconsistent or holds what ckpt does not
    /// read (the file or directory, and the array when one is at fault, are named).
    #[error("{path}: Orbax checkpoint: {problem}")]
    InvalidOrbax {
        /// The file or directory at fault.
        path: PathBuf,
        /// What is wrong, naming the array (and its zarr key) when one is at fault.
        problem: String,
    },
    /// tensorstore's OCDBT key-value database of an Orbax item is damaged or not read
    /// (`ckpt-ocdbt` names the file, the object and its offset).
    #[error(transparent)]
    Ocdbt(#[from] ckpt_ocdbt::Error),
    /// A safetensors header is malformed.
    #[error("invalid safetensors header: {problem}")]
    InvalidHeader {
        /// What is wrong with it.
        problem: String,
    },
    /// A compressed (`.ckptz`) file's preamble or header is malformed.
    #[error("invalid .ckptz header: {problem}")]
    InvalidCompressed {
        /// What is wrong with it.
        problem: String,
    },
    /// A `.ckptz` file of a format version this build does not read (written by a
    /// later ckpt).
    #[error("`.ckptz` format version {version} is not one this ckpt reads (versions {supported:?}): written by a newer ckpt?")]
    CkptzVersion {
        /// The file's version byte.
        version: u8,
        /// The versions read.
        supported: Vec<u8>,
    },
    /// A compressed chunk does not decompress to the bytes its header promises.
    #[error("{path}: tensor `{tensor}`: compressed chunk {chunk} is damaged: {problem}")]
    CorruptChunk {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The chunk's number within the tensor.
        chunk: u64,
        /// What decompressing it gave.
        problem: String,
    },
    /// A `torch.save` archive or its pickle is malformed or not allowed.
    #[error("torch.save file: {problem}")]
    InvalidTorch {
        /// What is wrong with it.
        problem: String,
    },
    /// A tensor in a safetensors header is malformed.
    #[error("tensor `{tensor}`: {problem}")]
    InvalidTensor {
        /// The tensor.
        tensor: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A header larger than the limit.
    #[error("safetensors header of {len} bytes exceeds the limit of {max} bytes")]
    HeaderTooLarge {
        /// Declared header length.
        len: u64,
        /// Allowed maximum.
        max: u64,
    },
    /// Part of a tensor is held by no source.
    #[error("tensor `{tensor}`: elements {region} are missing (no rank holds them)")]
    CoverageGap {
        /// The tensor.
        tensor: String,
        /// A region nobody holds.
        region: String,
    },
    /// Two sources hold overlapping but different parts of a tensor.
    #[error("tensor `{tensor}`: pieces from {a} and {b} overlap at {region}")]
    Overlap {
        /// The tensor.
        tensor: String,
        /// The first source.
        a: String,
        /// The second source.
        b: String,
        /// Where they overlap.
        region: String,
    },
    /// Several files hold a tensor and nothing says how their parts fit together.
    #[error("tensor `{tensor}` is ambiguous: {problem} (files: {files})")]
    Ambiguous {
        /// The tensor.
        tensor: String,
        /// The files holding it.
        files: String,
        /// Why the copies cannot be taken as one tensor, and what is needed.
        problem: String,
    },
    /// A tensor's bytes do not match the checksum recorded for them.
    #[error("{path}: tensor `{tensor}`: checksum mismatch: recorded {recorded}, the bytes give {actual} (the file is damaged)")]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The recorded checksum.
        recorded: String,
        /// The checksum of the bytes as read.
        actual: String,
    },
    /// Sources disagree (shape, dtype, strategy hash, world size...).
    #[error("{what}")]
    Mismatch {
        /// What disagrees, with both values.
        what: String,
    },
    /// The input is not a checkpoint this tool understands.
    #[error("{problem}")]
    UnknownInput {
        /// What was found.
        problem: String,
    },
    /// A requested conversion is not possible.
    #[error("{problem}")]
    Unsupported {
        /// What was asked.
        problem: String,
    },
    /// A launcher's environment variables are incomplete or inconsistent.
    #[error("environment variable {variable}: {problem}")]
    Launch {
        /// The variable.
        variable: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Several problems, one per line.
    #[error("{0}")]
    Many(Problems),
    /// The output already exists.
    #[error("{path} already exists (use --force to replace it)")]
    OutputExists {
        /// The output path.
        path: PathBuf,
    },
    /// The inputs were read and hold no tensor at all (a save of other state only, or
    /// the wrong files of a directory): an empty output is never written, and `verify`
    /// does not call such an input fine.
    #[error(
        "no tensors: {files} hold(s) none; an empty checkpoint is not written, nor called fine"
    )]
    NoTensors {
        /// The files read, with their formats.
        files: String,
    },
    /// No tensor has this name or matches this glob.
    #[error("no tensor matches `{pattern}` (the checkpoint has {tensors} tensors; `ckpt inspect` lists them)")]
    TensorNotFound {
        /// The name or glob asked for.
        pattern: String,
        /// How many tensors there are.
        tensors: usize,
    },
}

impl Error {
    /// Wraps this error with the path it concerns (unless it already names one).
    #[must_use]
    pub fn with_path(self, path: impl Into<PathBuf>) -> Error {
        match self {
            e @ (Error::Io { .. }
            | Error::WithPath { .. }
            | Error::CorruptChunk { .. }
            | Error::InvalidOrbax { .. }
            | Error::Ocdbt(_)) => e,
            e => Error::WithPath {
                path: path.into(),
                source: Box::new(e),
            },
        }
    }
}

/// Adds a path to `std::io::Error`s.
pub(crate) trait IoContext<T> {
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

pub(crate) fn overflow(what: impl Into<String>) -> Error {
    Error::Overflow { what: what.into() }
}

/// Several problems found in one pass, one per line.
#[derive(Debug)]
pub struct Problems(pub Vec<Error>);

impl std::fmt::Display for Problems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

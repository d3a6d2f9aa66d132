//! The crate's errors. A database error ([`Error`]) names the file, and for a damaged
//! object where it sits in the file and which kind of object it is; what is wrong
//! inside an object is a [`Problem`], the error of the byte-level decoders (which see
//! bytes, not files).

use std::fmt;
use std::path::PathBuf;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The three encoded objects of the format; they share one envelope (magic, length,
/// version, compression, body, CRC-32C).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ObjectKind {
    /// `manifest.ocdbt`: the configuration and the newest versions.
    Manifest,
    /// A version tree node: older versions.
    VersionNode,
    /// A B+tree node: keys and values (leaf) or children (interior).
    BtreeNode,
}

impl ObjectKind {
    /// The magic number (big-endian on disk) that starts an object of this kind.
    pub(crate) fn magic(self) -> u32 {
        match self {
            ObjectKind::Manifest => 0x0cdb_3a2a,
            ObjectKind::VersionNode => 0x0cdb_1234,
            ObjectKind::BtreeNode => 0x0cdb_20de,
        }
    }
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ObjectKind::Manifest => "manifest",
            ObjectKind::VersionNode => "version tree node",
            ObjectKind::BtreeNode => "B+tree node",
        })
    }
}

/// What is wrong inside one encoded object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// Fewer bytes than the envelope alone takes.
    #[error("{len} bytes, shorter than the 16-byte envelope (magic, length, CRC-32C)")]
    TooShort {
        /// The object's size.
        len: u64,
    },
    /// The first four bytes are not the magic number of the expected kind.
    #[error("magic number {found:#010x}, expected {expected:#010x}")]
    BadMagic {
        /// What the bytes say.
        found: u32,
        /// The magic of the kind expected here.
        expected: u32,
    },
    /// The length field disagrees with the object's size.
    #[error("length field says {stored} bytes, but the object is {actual} bytes")]
    LengthMismatch {
        /// The length field.
        stored: u64,
        /// The size of the object as read (file size, or reference length).
        actual: u64,
    },
    /// The CRC-32C over everything before it does not match.
    #[error("CRC-32C mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Crc {
        /// The last four bytes, little-endian.
        stored: u32,
        /// CRC-32C of the bytes before them.
        computed: u32,
    },
    /// A format version other than 0.
    #[error("format version {0}; only version 0 exists")]
    UnsupportedVersion(u32),
    /// A compression format other than 0 (none) and 1 (zstd).
    #[error("compression format {0}; only 0 (none) and 1 (zstd) exist")]
    UnknownCompression(u32),
    /// The zstd frame does not decode.
    #[error("zstd: {0}")]
    Zstd(String),
    /// The zstd frame decodes to more bytes than such an object may have.
    #[error("compressed body decodes to more than {limit} bytes")]
    DecodedTooLarge {
        /// The bound (for B+tree nodes, derived from the manifest's `max_decoded_node_bytes`).
        limit: u64,
    },
    /// Bytes follow the zstd frame inside the envelope.
    #[error("{count} bytes after the zstd frame")]
    AfterFrame {
        /// How many.
        count: u64,
    },
    /// A field runs past the end of the (decompressed) body.
    #[error("{field} runs past the end of the body ({at} bytes in)")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Where in the body it started.
        at: u64,
    },
    /// A varint longer than its field's width allows.
    #[error("{field}: varint does not fit in {bits} bits ({at} bytes into the body)")]
    BadVarint {
        /// The field being read.
        field: &'static str,
        /// The field's width.
        bits: u32,
        /// Where in the body it started.
        at: u64,
    },
    /// A count, length or size larger than the format allows.
    #[error("{field} = {value}, more than the maximum {max}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The largest value allowed.
        max: u64,
    },
    /// A field whose value the format forbids here.
    #[error("{field} = {value}: {why}")]
    Invalid {
        /// The field (with its entry index where the format has columns).
        field: String,
        /// Its value.
        value: u64,
        /// The rule it breaks.
        why: &'static str,
    },
    /// Keys of a node not strictly increasing.
    #[error("entry {index}: key is not greater than the key before it")]
    KeyOrder {
        /// The entry whose key is out of order.
        index: u64,
    },
    /// A reference's data file index outside the object's data file table.
    #[error("data file id {id} is outside the table of {files} data files")]
    DataFileId {
        /// The index stored.
        id: u64,
        /// The table's size.
        files: u64,
    },
    /// A reference whose end is past 2^63-1 (the format's bound for offset + length).
    #[error("reference offset {offset} + length {length} is past 2^63-1")]
    BadReference {
        /// The offset.
        offset: u64,
        /// The length.
        length: u64,
    },
    /// A node of another height than its parent (or version) announced.
    #[error("height {found}, but its reference announced height {expected}")]
    Height {
        /// What the reference said.
        expected: u8,
        /// What the node says.
        found: u8,
    },
    /// Decoding stopped before the end of the body.
    #[error("{count} bytes left after the last field")]
    TrailingBytes {
        /// How many.
        count: u64,
    },
}

/// Everything that can go wrong reading or writing a database.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}", path = path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An encoded object is damaged or not what the format allows.
    #[error("{path}: {object} at offset {offset}: {problem}", path = path.display())]
    Corrupt {
        /// The file holding it.
        path: PathBuf,
        /// Where it starts in the file.
        offset: u64,
        /// What it should be.
        object: ObjectKind,
        /// What is wrong.
        problem: Problem,
    },
    /// `manifest.ocdbt` larger than any manifest.
    #[error("{path}: {len} bytes, more than the {max} bytes a manifest may have", path = path.display())]
    ManifestTooLarge {
        /// The manifest.
        path: PathBuf,
        /// Its size.
        len: u64,
        /// The bound.
        max: u64,
    },
    /// A configuration-only manifest (kind `numbered`): the versions are in
    /// `manifest.<16 hex>` files, which this crate does not read.
    #[error("{path}: manifest kind 1 (numbered: versions in `manifest.<16 hex>` files) is not supported; only kind 0 (single, what orbax writes) is", path = path.display())]
    NumberedManifest {
        /// The manifest.
        path: PathBuf,
    },
    /// The generation asked for is not in the database.
    #[error("{path}: no generation {generation} in this database (the latest is {latest})", path = path.display())]
    NoSuchGeneration {
        /// The manifest.
        path: PathBuf,
        /// The generation asked for.
        generation: u64,
        /// The newest generation.
        latest: u64,
    },
    /// A data file path (in a data file table) that does not name a file inside the
    /// database directory.
    #[error("{path}: {object} at offset {offset} refers to data file {data_file:?}, which {why}", path = path.display())]
    BadDataFilePath {
        /// The file holding the reference.
        path: PathBuf,
        /// Where the referring object starts.
        offset: u64,
        /// What refers to it.
        object: ObjectKind,
        /// The path as stored (lossily decoded).
        data_file: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// A reference to bytes past the end of a data file (a truncated file, or a
    /// damaged reference).
    #[error("{path}: {what} at offset {offset}, {len} bytes, runs past the end of the file ({file_len} bytes)", path = path.display())]
    OutOfFile {
        /// The data file.
        path: PathBuf,
        /// What was referenced.
        what: &'static str,
        /// The offset referenced.
        offset: u64,
        /// The length referenced.
        len: u64,
        /// The file's size.
        file_len: u64,
    },
    /// A reference to a node larger than the database's configuration allows.
    #[error("{path}: {object} at offset {offset} is {len} bytes, more than the {max} bytes allowed", path = path.display())]
    NodeTooLarge {
        /// The data file.
        path: PathBuf,
        /// The node's kind.
        object: ObjectKind,
        /// Its offset.
        offset: u64,
        /// Its length as referenced.
        len: u64,
        /// The bound.
        max: u64,
    },
    /// One B+tree node reached twice in one tree: a loop or shared subtree, which no
    /// writer produces (a tree walk must not multiply).
    #[error("{path}: B+tree node at offset {offset} is referenced twice in one tree", path = path.display())]
    NodeReferencedTwice {
        /// The data file.
        path: PathBuf,
        /// The node's offset.
        offset: u64,
    },
    /// A child node's keys outside the range its parent gives it.
    #[error("{path}: B+tree node at offset {offset}: key {key:?} is outside the range its parent gives the node (keys must increase across the whole tree)", path = path.display())]
    KeyOutOfRange {
        /// The data file.
        path: PathBuf,
        /// The node's offset.
        offset: u64,
        /// The key (escaped).
        key: String,
    },
    /// A version tree node that does not hold the generation its parent says it does.
    #[error("{path}: version tree node at offset {offset}: {why}", path = path.display())]
    VersionTree {
        /// The data file.
        path: PathBuf,
        /// The node's offset.
        offset: u64,
        /// What disagrees.
        why: String,
    },
    /// The writer's directory exists and is not empty.
    #[error("{path}: not an empty directory (a database is only written into an empty one)", path = path.display())]
    NotEmpty {
        /// The directory.
        path: PathBuf,
    },
    /// A key longer than the format's 65535 bytes.
    #[error("{path}: key {key:?} is {len} bytes; OCDBT keys are at most 65535 bytes", path = path.display())]
    KeyTooLong {
        /// The database being written.
        path: PathBuf,
        /// The key (escaped, shortened).
        key: String,
        /// Its length.
        len: usize,
    },
    /// The same key given twice to a writer.
    #[error("{path}: key {key:?} given twice", path = path.display())]
    DuplicateKey {
        /// The database being written.
        path: PathBuf,
        /// The key (escaped).
        key: String,
    },
    /// A writer option out of the range the format allows.
    #[error("{path}: {option} = {value}: {why}", path = path.display())]
    BadOption {
        /// The database to be written.
        path: PathBuf,
        /// The option.
        option: &'static str,
        /// The value given.
        value: i64,
        /// The allowed range.
        why: &'static str,
    },
    /// Size arithmetic that would overflow.
    #[error("{path}: {what} overflows 64 bits", path = path.display())]
    Overflow {
        /// The file concerned.
        path: PathBuf,
        /// The quantity.
        what: &'static str,
    },
    /// The value of a key cannot be where its B+tree leaf says: its data file is
    /// missing or unreadable, too short (truncated), or its path is refused.
    #[error("the value of key `{key}`: {source}")]
    Value {
        /// The key (escaped as [`show_key`] does).
        key: String,
        /// What is wrong with its data file ([`Error::Io`], [`Error::OutOfFile`],
        /// [`Error::BadDataFilePath`]).
        source: Box<Error>,
    },
}

impl Error {
    /// The file or directory the error is about (for a [`Error::Value`], its data
    /// file).
    pub fn path(&self) -> &std::path::Path {
        match self {
            Error::Io { path, .. }
            | Error::Corrupt { path, .. }
            | Error::ManifestTooLarge { path, .. }
            | Error::NumberedManifest { path }
            | Error::NoSuchGeneration { path, .. }
            | Error::BadDataFilePath { path, .. }
            | Error::OutOfFile { path, .. }
            | Error::NodeTooLarge { path, .. }
            | Error::NodeReferencedTwice { path, .. }
            | Error::KeyOutOfRange { path, .. }
            | Error::VersionTree { path, .. }
            | Error::NotEmpty { path }
            | Error::KeyTooLong { path, .. }
            | Error::DuplicateKey { path, .. }
            | Error::BadOption { path, .. }
            | Error::Overflow { path, .. } => path,
            Error::Value { source, .. } => source.path(),
        }
    }
}

/// A key for messages: printable ASCII as is, other bytes escaped, at most ~200
/// characters (keys may be 64 KiB of anything).
pub(crate) fn show_key(key: &[u8]) -> String {
    const MAX: usize = 200;
    let mut s = key[..key.len().min(MAX)].escape_ascii().to_string();
    if key.len() > MAX {
        s.push_str("...");
    }
    s
}

/// `io::Error` -> [`Error::Io`] naming the path.
pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

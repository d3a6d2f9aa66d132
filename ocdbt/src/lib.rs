//! Reads and writes tensorstore's OCDBT key-value databases, as orbax-checkpoint
//! writes them (`manifest.ocdbt` + `d/<32 hex>` data files), without tensorstore.
//! A pure key-value store: it knows nothing of zarr or tensors. The format, and how
//! it was established, is in `docs/orbax.md`.
//!
//! - **Reading** ([`Database`]): opens the newest generation or any older one
//!   (following the version tree), lists every key in order with where its value is
//!   ([`Value::Inline`] bytes, or a [`Value::Stored`] range of a data file for the
//!   caller to map or stream), and looks single keys up. B+trees of any height, nodes
//!   compressed or not, data files of other directories (orbax's merged root points
//!   into `ocdbt.process_N/d/`). Everything is checked: magic, format version,
//!   lengths, CRC-32C, decompressed sizes bounded by the configuration, references
//!   against file sizes, paths against the directory, key order across the tree.
//! - **Writing** ([`Writer`]): one generation into an empty directory, from keys in
//!   any order; small values inline, others in one data file (given as bytes, or
//!   written by the caller into a [`Reservation`]); leaves split under a node-size
//!   bound with interior levels above; the manifest last.
//!
//! Not supported: numbered manifests (`manifest_kind` 1, which orbax never writes),
//! writing more than one generation or into an existing database.

mod btree;
mod codec;
mod data_file_table;
mod error;
mod manifest;
mod read;
mod reference;
mod version_tree;
mod write;

pub use crate::codec::Compression;
pub use crate::error::{Error, ObjectKind, Problem, Result};
pub use crate::manifest::Config;
pub use crate::read::{Database, Entry, Value};
pub use crate::write::{Reservation, WriteSummary, Writer, WriterOptions};

/// Entry points for the fuzz target (`fuzz/fuzz_targets/ocdbt_manifest.rs`): the
/// byte-level decoders, which must never panic whatever the bytes.
#[doc(hidden)]
pub mod fuzzing {
    use crate::error::{ObjectKind, Problem};

    /// Decodes `bytes` as a whole `manifest.ocdbt`.
    ///
    /// # Errors
    ///
    /// What is wrong with them.
    pub fn manifest(bytes: &[u8]) -> Result<(), Problem> {
        crate::manifest::decode(bytes).map(drop)
    }

    /// Decodes `bytes` as an encoded B+tree node of a database whose
    /// `max_decoded_node_bytes` is `max_decoded_node_bytes`, reached through the base
    /// path `transitive`.
    ///
    /// # Errors
    ///
    /// What is wrong with them.
    pub fn btree_node(
        bytes: &[u8],
        max_decoded_node_bytes: u32,
        transitive: &[u8],
    ) -> Result<(), Problem> {
        let limit = crate::read::btree_body_limit(max_decoded_node_bytes);
        let body = crate::codec::open_envelope(bytes, ObjectKind::BtreeNode, limit)?;
        crate::btree::decode_node(&body, transitive).map(drop)
    }

    /// Decodes `bytes` as an encoded version tree node.
    ///
    /// # Errors
    ///
    /// What is wrong with them.
    pub fn version_node(bytes: &[u8]) -> Result<(), Problem> {
        let max = crate::manifest::MAX_MANIFEST_BYTES;
        let body = crate::codec::open_envelope(bytes, ObjectKind::VersionNode, max)?;
        crate::version_tree::decode_node(&body, b"").map(drop)
    }

    /// Sets the length field and the CRC-32C of an encoded object (of at least 16
    /// bytes; shorter ones are left alone) to match its bytes, so that mutated input
    /// reaches the body parsers instead of stopping at the checksum.
    pub fn reseal(bytes: &mut [u8]) {
        crate::codec::reseal(bytes);
    }
}

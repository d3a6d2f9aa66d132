//! `manifest.ocdbt` (`format/manifest.cc`, `config_codec.cc`): the database's
//! configuration, then (manifest kind 0, "single") a data file table, the newest
//! versions inline, and references to version tree nodes for the older ones.

use crate::codec::{open_envelope, put_varint, seal_envelope, Compression, Cursor};
use crate::data_file_table::{self, DataFile};
use crate::error::{ObjectKind, Problem};
use crate::version_tree::{
    max_height, read_arity_log2, read_interior_entries, read_leaf_entries, validate_manifest_nodes,
    write_leaf_entries, Version, VersionNodeRef,
};

/// The most bytes a manifest may take, stored or decompressed. Far above any real one
/// (a config, at most 2^16 inline versions of ~60 bytes, at most 62 node references and
/// their paths), and low enough that a damaged or hostile one cannot exhaust memory.
pub(crate) const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// zstd's level range (riegeli's `kMinCompressionLevel` = `ZSTD_minCLevel()`,
/// `kMaxCompressionLevel`), which tensorstore's reader checks.
pub(crate) const ZSTD_LEVELS: std::ops::RangeInclusive<i32> = -(1 << 17)..=22;

/// A database's configuration, as its manifest states it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Identifies the database (random when created).
    pub uuid: [u8; 16],
    /// Values up to this size are stored inside B+tree leaves (orbax: 1024).
    pub max_inline_value_bytes: u32,
    /// The size writers aim B+tree nodes at, in tensorstore's estimate of their decoded
    /// size (orbax: 100000000; tensorstore's default 8 MiB; 0: no bound).
    pub max_decoded_node_bytes: u32,
    /// log2 of the version tree's arity (1..=16; default 4).
    pub version_tree_arity_log2: u8,
    /// How nodes and manifests are (to be) written.
    pub compression: Compression,
}

/// A decoded manifest.
#[derive(Debug)]
pub(crate) struct Manifest {
    pub(crate) config: Config,
    /// Kind 1: configuration only, versions in `manifest.<16 hex>` files.
    pub(crate) numbered: bool,
    pub(crate) files: Vec<DataFile>,
    /// The newest versions, ascending, never empty for kind 0.
    pub(crate) versions: Vec<Version>,
    /// Older versions, by version tree node, ascending generation, descending height.
    pub(crate) version_nodes: Vec<VersionNodeRef>,
}

fn read_config(c: &mut Cursor<'_>) -> Result<(Config, bool), Problem> {
    let uuid: [u8; 16] = c.bytes(16, "uuid")?.try_into().expect("16 bytes");
    let kind = c.u8("manifest_kind")?;
    if kind > 1 {
        return Err(Problem::Invalid {
            field: "manifest_kind".into(),
            value: u64::from(kind),
            why: "only 0 (single) and 1 (numbered) exist",
        });
    }
    let max_inline_value_bytes = c.varint32("max_inline_value_bytes")?;
    let max_decoded_node_bytes = c.varint32("max_decoded_node_bytes")?;
    let version_tree_arity_log2 = read_arity_log2(c)?;
    let compression = match c.varint32("compression_method")? {
        0 => Compression::None,
        1 => {
            let level = c.i32le("zstd_level")?;
            if !ZSTD_LEVELS.contains(&level) {
                return Err(Problem::Invalid {
                    field: "zstd_level".into(),
                    value: level as u64,
                    why: "outside zstd's levels -131072..=22",
                });
            }
            Compression::Zstd { level }
        }
        n => {
            return Err(Problem::Invalid {
                field: "compression_method".into(),
                value: u64::from(n),
                why: "only 0 (none) and 1 (zstd) exist",
            })
        }
    };
    let config = Config {
        uuid,
        max_inline_value_bytes,
        max_decoded_node_bytes,
        version_tree_arity_log2,
        compression,
    };
    Ok((config, kind == 1))
}

/// Decodes a whole manifest file.
pub(crate) fn decode(bytes: &[u8]) -> Result<Manifest, Problem> {
    let body = open_envelope(bytes, ObjectKind::Manifest, MAX_MANIFEST_BYTES)?;
    let mut c = Cursor::new(&body);
    let (config, numbered) = read_config(&mut c)?;
    let mut m = Manifest {
        config,
        numbered,
        files: Vec::new(),
        versions: Vec::new(),
        version_nodes: Vec::new(),
    };
    if !numbered {
        let a = m.config.version_tree_arity_log2;
        m.files = data_file_table::read(&mut c, b"")?;
        m.versions = read_leaf_entries(&mut c, a, m.files.len())?;
        m.version_nodes =
            read_interior_entries(&mut c, u64::from(max_height(a)), m.files.len(), None)?;
        let last = m.versions[m.versions.len() - 1].generation;
        validate_manifest_nodes(a, last, &m.version_nodes)?;
    }
    c.finish()?;
    Ok(m)
}

/// Encodes a single-kind manifest holding `versions` inline and no version tree nodes
/// (what a database of at most `2^arity_log2` generations has).
pub(crate) fn encode(
    config: &Config,
    files: &[DataFile],
    versions: &[Version],
) -> std::io::Result<Vec<u8>> {
    let mut b = Vec::new();
    b.extend_from_slice(&config.uuid);
    b.push(0);
    put_varint(&mut b, u64::from(config.max_inline_value_bytes));
    put_varint(&mut b, u64::from(config.max_decoded_node_bytes));
    b.push(config.version_tree_arity_log2);
    match config.compression {
        Compression::None => put_varint(&mut b, 0),
        Compression::Zstd { level } => {
            put_varint(&mut b, 1);
            b.extend_from_slice(&level.to_le_bytes());
        }
    }
    data_file_table::write(&mut b, files);
    write_leaf_entries(&mut b, versions);
    put_varint(&mut b, 0);
    seal_envelope(ObjectKind::Manifest, &b, config.compression)
}

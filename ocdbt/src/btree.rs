//! B+tree nodes (`format/btree.cc`, `btree_codec.h`, `btree_node_encoder.cc`).
//!
//! ```text
//! height u8 (0 = leaf) | data file table | num_entries varint (1 ..= 2^20)
//! key_prefix_length[1..n] | key_suffix_length[0..n]
//! [interior: subtree_common_prefix_length[0..n]] | key_suffix bytes
//! leaf:     value_length[n] | value_kind[n] u8 (0 inline, 1 out-of-line)
//!           | data_file_id, offset per out-of-line value | inline values, concatenated
//! interior: child refs (ids, offsets, lengths) | child statistics
//! ```
//!
//! Keys are relative: a node's keys follow the prefix its path from the root implies,
//! and interior entry `i` extends that prefix for its child by the first
//! `subtree_common_prefix_length[i]` bytes of its key.

use crate::codec::{put_varint, Cursor};
use crate::data_file_table::{self, DataFile};
use crate::error::Problem;
use crate::reference::{check_end, read_file_id, read_refs, read_stats, write_refs, write_stats};
use crate::reference::{Ref, Stats};

/// Most entries in one node (`kMaxNodeArity`).
pub(crate) const MAX_ARITY: u64 = 1 << 20;
/// Longest inline value (`kMaxInlineValueLength`).
pub(crate) const MAX_INLINE: u64 = 1 << 20;
/// Longest key (`kMaxKeyLength`).
pub(crate) const MAX_KEY: usize = 65535;

#[derive(Debug)]
pub(crate) struct BtreeNode {
    pub(crate) height: u8,
    pub(crate) files: Vec<DataFile>,
    pub(crate) entries: NodeEntries,
}

#[derive(Debug)]
pub(crate) enum NodeEntries {
    Leaf(Vec<LeafEntry>),
    Interior(Vec<InteriorEntry>),
}

#[derive(Debug)]
pub(crate) struct LeafEntry {
    /// Relative to the node's prefix.
    pub(crate) key: Vec<u8>,
    pub(crate) value: LeafValue,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum LeafValue {
    Inline(Vec<u8>),
    /// In a data file; the length is the value's length.
    Indirect(Ref),
}

#[derive(Debug)]
pub(crate) struct InteriorEntry {
    /// Relative to the node's prefix: the inclusive lower bound of the child's keys.
    pub(crate) key: Vec<u8>,
    /// How many bytes of `key` every key of the child shares (and omits).
    pub(crate) subtree_common_prefix: usize,
    pub(crate) child: Ref,
    #[allow(dead_code)] // Read to reach the end of the body; not validated (see Stats).
    pub(crate) stats: Stats,
}

/// The key columns, shared by leaves and interior nodes (`ReadKeys`).
fn read_keys(
    c: &mut Cursor<'_>,
    n: usize,
    interior: bool,
) -> Result<(Vec<Vec<u8>>, Vec<usize>), Problem> {
    let mut prefix = vec![0u16; n];
    for p in prefix.iter_mut().skip(1) {
        *p = c.varint16("key_prefix_length")?;
    }
    let mut suffix = vec![0u16; n];
    for s in suffix.iter_mut() {
        *s = c.varint16("key_suffix_length")?;
    }
    let mut scp = vec![0usize; if interior { n } else { 0 }];
    for s in scp.iter_mut() {
        *s = usize::from(c.varint16("subtree_common_prefix_length")?);
    }
    let mut prev_len = 0usize;
    for i in 0..n {
        let p = usize::from(prefix[i]);
        if p > prev_len {
            return Err(Problem::Invalid {
                field: format!("key_prefix_length[{i}]"),
                value: p as u64,
                why: "longer than the previous key",
            });
        }
        let len = p + usize::from(suffix[i]);
        if len > MAX_KEY {
            return Err(Problem::Invalid {
                field: format!("key_length[{i}]"),
                value: len as u64,
                why: "keys are at most 65535 bytes",
            });
        }
        if interior && scp[i] > len {
            return Err(Problem::Invalid {
                field: format!("subtree_common_prefix_length[{i}]"),
                value: scp[i] as u64,
                why: "longer than the key",
            });
        }
        prev_len = len;
    }
    let mut keys: Vec<Vec<u8>> = Vec::with_capacity(n);
    for i in 0..n {
        let suffix = c.bytes(u64::from(suffix[i]), "key_suffix")?;
        let mut key = match keys.last() {
            Some(prev) => prev[..usize::from(prefix[i])].to_vec(),
            None => Vec::new(),
        };
        key.extend_from_slice(suffix);
        if let Some(prev) = keys.last() {
            if key <= *prev {
                return Err(Problem::KeyOrder { index: i as u64 });
            }
        }
        keys.push(key);
    }
    Ok((keys, scp))
}

/// Decodes a node's body; `transitive` is the base path it was reached through.
pub(crate) fn decode_node(body: &[u8], transitive: &[u8]) -> Result<BtreeNode, Problem> {
    let mut c = Cursor::new(body);
    let height = c.u8("height")?;
    let files = data_file_table::read(&mut c, transitive)?;
    // Every entry takes at least a key suffix length, a value length and a value kind.
    let n = c.count("num_entries", MAX_ARITY, 3)?;
    if n == 0 {
        return Err(Problem::Invalid {
            field: "num_entries".into(),
            value: 0,
            why: "a B+tree node is never empty",
        });
    }
    let (keys, scp) = read_keys(&mut c, n, height > 0)?;
    let entries = if height == 0 {
        let mut lengths = Vec::with_capacity(n);
        for _ in 0..n {
            lengths.push(c.varint64("value_length")?);
        }
        let mut kinds = Vec::with_capacity(n);
        for (i, &len) in lengths.iter().enumerate() {
            let kind = c.u8("value_kind")?;
            match kind {
                0 if len > MAX_INLINE => {
                    return Err(Problem::Invalid {
                        field: format!("value_length[{i}]"),
                        value: len,
                        why: "an inline value is at most 1 MiB",
                    })
                }
                0 | 1 => kinds.push(kind),
                _ => {
                    return Err(Problem::Invalid {
                        field: format!("value_kind[{i}]"),
                        value: u64::from(kind),
                        why: "only 0 (inline) and 1 (out-of-line) exist",
                    })
                }
            }
        }
        let indirect = kinds.iter().filter(|&&k| k == 1).count();
        let mut ids = Vec::with_capacity(indirect);
        for _ in 0..indirect {
            ids.push(read_file_id(&mut c, files.len())?);
        }
        let mut ids = ids.into_iter();
        let mut values = Vec::with_capacity(n);
        for (&kind, &length) in kinds.iter().zip(&lengths) {
            if kind == 1 {
                let file = ids.next().expect("one id per out-of-line value");
                let offset = c.varint64("data_file_offset")?;
                check_end(offset, length)?;
                values.push(Some(Ref {
                    file,
                    offset,
                    length,
                }));
            } else {
                values.push(None);
            }
        }
        let mut entries = Vec::with_capacity(n);
        for ((key, value), length) in keys.into_iter().zip(values).zip(lengths) {
            let value = match value {
                Some(r) => LeafValue::Indirect(r),
                None => LeafValue::Inline(c.bytes(length, "inline value")?.to_vec()),
            };
            entries.push(LeafEntry { key, value });
        }
        NodeEntries::Leaf(entries)
    } else {
        let refs = read_refs(&mut c, n, files.len(), false)?;
        let stats = read_stats(&mut c, n)?;
        NodeEntries::Interior(
            keys.into_iter()
                .zip(scp)
                .zip(refs.into_iter().zip(stats))
                .map(|((key, scp), (child, stats))| InteriorEntry {
                    key,
                    subtree_common_prefix: scp,
                    child,
                    stats,
                })
                .collect(),
        )
    };
    c.finish()?;
    Ok(BtreeNode {
        height,
        files,
        entries,
    })
}

/// A value as the writer encodes it: inline bytes, or `(offset, length)` in data file 0.
pub(crate) enum ValueOut<'a> {
    Inline(&'a [u8]),
    Indirect { offset: u64, length: u64 },
}

/// The key columns; `keys` are already relative to the node's prefix.
fn write_keys(out: &mut Vec<u8>, keys: &[&[u8]], scp: Option<&[usize]>) {
    let mut prefix = vec![0usize; keys.len()];
    for i in 1..keys.len() {
        prefix[i] = data_file_table::common_prefix(keys[i - 1], keys[i]);
        put_varint(out, prefix[i] as u64);
    }
    for (k, p) in keys.iter().zip(&prefix) {
        put_varint(out, (k.len() - p) as u64);
    }
    for s in scp.unwrap_or(&[]) {
        put_varint(out, *s as u64);
    }
    for (k, &p) in keys.iter().zip(&prefix) {
        out.extend_from_slice(&k[p..]);
    }
}

/// The body of a leaf; `files` is empty or the one data file all out-of-line values
/// are in.
pub(crate) fn encode_leaf(files: &[DataFile], keys: &[&[u8]], values: &[ValueOut<'_>]) -> Vec<u8> {
    let mut b = vec![0u8];
    data_file_table::write(&mut b, files);
    put_varint(&mut b, keys.len() as u64);
    write_keys(&mut b, keys, None);
    for v in values {
        put_varint(
            &mut b,
            match v {
                ValueOut::Inline(x) => x.len() as u64,
                ValueOut::Indirect { length, .. } => *length,
            },
        );
    }
    for v in values {
        b.push(u8::from(matches!(v, ValueOut::Indirect { .. })));
    }
    for v in values {
        if let ValueOut::Indirect { .. } = v {
            put_varint(&mut b, 0);
        }
    }
    for v in values {
        if let ValueOut::Indirect { offset, .. } = v {
            put_varint(&mut b, *offset);
        }
    }
    for v in values {
        if let ValueOut::Inline(x) = v {
            b.extend_from_slice(x);
        }
    }
    b
}

/// The body of an interior node of `height` whose children are all in `files[0]`.
pub(crate) fn encode_interior(
    height: u8,
    files: &[DataFile],
    keys: &[&[u8]],
    scp: &[usize],
    children: &[Ref],
    stats: &[Stats],
) -> Vec<u8> {
    let mut b = vec![height];
    data_file_table::write(&mut b, files);
    put_varint(&mut b, keys.len() as u64);
    write_keys(&mut b, keys, Some(scp));
    write_refs(&mut b, children);
    write_stats(&mut b, stats);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Vec<DataFile> {
        vec![DataFile {
            base: Vec::new(),
            relative: b"d/00".to_vec(),
        }]
    }

    #[test]
    fn leaf_round_trip() {
        let keys: [&[u8]; 3] = [b"w/.zarray", b"w/0.0", b"w/0.1"];
        let values = [
            ValueOut::Inline(b"{\"a\":1}"),
            ValueOut::Indirect {
                offset: 0,
                length: 20,
            },
            ValueOut::Inline(b"xyz"),
        ];
        let body = encode_leaf(&file(), &keys, &values);
        let node = decode_node(&body, b"").unwrap();
        let NodeEntries::Leaf(e) = node.entries else {
            panic!("a leaf")
        };
        assert_eq!(e[1].key, b"w/0.0");
        assert_eq!(
            e[1].value,
            LeafValue::Indirect(Ref {
                file: 0,
                offset: 0,
                length: 20
            })
        );
        assert_eq!(e[2].value, LeafValue::Inline(b"xyz".to_vec()));
    }

    #[test]
    fn refusals() {
        // Keys out of order.
        let body = encode_leaf(
            &[],
            &[b"b", b"a"],
            &[ValueOut::Inline(b""), ValueOut::Inline(b"")],
        );
        assert_eq!(
            decode_node(&body, b"").unwrap_err(),
            Problem::KeyOrder { index: 1 }
        );
        // Duplicate keys.
        let body = encode_leaf(
            &[],
            &[b"a", b"a"],
            &[ValueOut::Inline(b""), ValueOut::Inline(b"")],
        );
        assert!(matches!(
            decode_node(&body, b""),
            Err(Problem::KeyOrder { .. })
        ));
        // An out-of-line value with no data file table.
        let body = encode_leaf(
            &[],
            &[b"a"],
            &[ValueOut::Indirect {
                offset: 0,
                length: 1,
            }],
        );
        assert!(matches!(
            decode_node(&body, b""),
            Err(Problem::DataFileId { id: 0, files: 0 })
        ));
        // A reference past 2^63-1.
        let body = encode_leaf(
            &file(),
            &[b"a"],
            &[ValueOut::Indirect {
                offset: u64::MAX - 1,
                length: 5,
            }],
        );
        assert!(matches!(
            decode_node(&body, b""),
            Err(Problem::BadReference { .. })
        ));
        // Empty node.
        assert!(matches!(
            decode_node(&[0, 0, 0], b""),
            Err(Problem::Invalid { .. })
        ));
        // Trailing bytes.
        let mut body = encode_leaf(&[], &[b"a"], &[ValueOut::Inline(b"x")]);
        body.push(0);
        assert_eq!(
            decode_node(&body, b"").unwrap_err(),
            Problem::TrailingBytes { count: 1 }
        );
        // A huge entry count with no bytes behind it.
        let mut body = vec![0u8, 0];
        put_varint(&mut body, 1 << 19);
        assert!(matches!(
            decode_node(&body, b""),
            Err(Problem::Truncated { .. })
        ));
        // Subtree common prefix longer than the key.
        let body = encode_interior(
            1,
            &file(),
            &[b"ab"],
            &[3],
            &[Ref {
                file: 0,
                offset: 0,
                length: 1,
            }],
            &[Stats::default()],
        );
        assert!(matches!(
            decode_node(&body, b""),
            Err(Problem::Invalid { .. })
        ));
    }
}

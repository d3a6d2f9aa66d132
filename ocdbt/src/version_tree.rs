//! Versions (generations) and the version tree (`format/version_tree.cc`,
//! `version_tree_codec.h`, `manifest.cc`): the manifest holds the newest versions
//! inline and refers to version tree nodes for older ones.
//!
//! A version leaf entry points to one generation's B+tree root; an interior entry to a
//! version tree node holding the generations `(previous entry's generation, its
//! generation]`. With arity `A = 2^arity_log2`, a node of height `h` spans an aligned
//! range of `A^(h+1)` generations; every check below follows from that layout, as
//! tensorstore's reader checks it.

use crate::codec::{put_varint, Cursor};
use crate::data_file_table::{self, DataFile};
use crate::error::Problem;
use crate::reference::{read_refs, read_stats, write_refs, write_stats, Ref, Stats};

/// Largest `version_tree_arity_log2` (`kMaxVersionTreeArityLog2`).
pub(crate) const MAX_ARITY_LOG2: u8 = 16;

/// One generation: its B+tree root and commit time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Version {
    pub(crate) generation: u64,
    pub(crate) root_height: u8,
    pub(crate) root: Ref,
    pub(crate) stats: Stats,
    /// Nanoseconds since the Unix epoch.
    pub(crate) commit_time: u64,
}

/// A reference to a version tree node of `height` whose last generation is
/// `generation`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VersionNodeRef {
    pub(crate) generation: u64,
    pub(crate) location: Ref,
    pub(crate) num_generations: u64,
    pub(crate) commit_time: u64,
    pub(crate) height: u8,
}

/// A decoded version tree node.
#[derive(Debug)]
pub(crate) struct VersionNode {
    pub(crate) arity_log2: u8,
    pub(crate) height: u8,
    pub(crate) files: Vec<DataFile>,
    pub(crate) entries: VersionEntries,
}

#[derive(Debug)]
pub(crate) enum VersionEntries {
    Leaf(Vec<Version>),
    Interior(Vec<VersionNodeRef>),
}

impl VersionNode {
    /// The last generation the node holds.
    pub(crate) fn last_generation(&self) -> u64 {
        match &self.entries {
            VersionEntries::Leaf(v) => v.last().map_or(0, |e| e.generation),
            VersionEntries::Interior(v) => v.last().map_or(0, |e| e.generation),
        }
    }
}

/// `GetMaxVersionTreeHeight`.
pub(crate) fn max_height(arity_log2: u8) -> u8 {
    63 / arity_log2.max(1) - 1
}

fn invalid(field: String, value: u64, why: &'static str) -> Problem {
    Problem::Invalid { field, value, why }
}

pub(crate) fn read_arity_log2(c: &mut Cursor<'_>) -> Result<u8, Problem> {
    let a = c.u8("version_tree_arity_log2")?;
    if a == 0 || a > MAX_ARITY_LOG2 {
        return Err(invalid(
            "version_tree_arity_log2".into(),
            u64::from(a),
            "outside 1..=16",
        ));
    }
    Ok(a)
}

/// Leaf entries (also the manifest's inline versions), checked.
pub(crate) fn read_leaf_entries(
    c: &mut Cursor<'_>,
    arity_log2: u8,
    files: usize,
) -> Result<Vec<Version>, Problem> {
    // Each entry takes at least 1 + 1 + 3 + 3 + 8 bytes over its columns.
    let n = c.count("num_versions", 1 << arity_log2, 16)?;
    let mut gens = Vec::with_capacity(n);
    for _ in 0..n {
        gens.push(c.varint64("generation_number")?);
    }
    let mut heights = Vec::with_capacity(n);
    for _ in 0..n {
        heights.push(c.u8("root_height")?);
    }
    let roots = read_refs(c, n, files, true)?;
    let stats = read_stats(c, n)?;
    let mut versions = Vec::with_capacity(n);
    for i in 0..n {
        versions.push(Version {
            generation: gens[i],
            root_height: heights[i],
            root: roots[i],
            stats: stats[i],
            commit_time: c.u64le("commit_time")?,
        });
    }
    validate_leaf_entries(arity_log2, &versions)?;
    Ok(versions)
}

/// `ValidateVersionTreeLeafNodeEntries`.
fn validate_leaf_entries(arity_log2: u8, versions: &[Version]) -> Result<(), Problem> {
    if versions.is_empty() {
        return Err(invalid(
            "num_versions".into(),
            0,
            "a version list is never empty",
        ));
    }
    for (i, v) in versions.iter().enumerate() {
        if v.root.is_missing() {
            if v.root_height != 0 {
                return Err(invalid(
                    format!("root_height[{i}]"),
                    u64::from(v.root_height),
                    "not 0 for an empty generation",
                ));
            }
            if v.stats != Stats::default() {
                return Err(invalid(
                    format!("num_keys[{i}]"),
                    v.stats.num_keys,
                    "statistics not zero for an empty generation",
                ));
            }
        }
        if v.generation == 0 {
            return Err(invalid(
                format!("generation_number[{i}]"),
                0,
                "generation numbers start at 1",
            ));
        }
        if i > 0 && v.generation <= versions[i - 1].generation {
            return Err(invalid(
                format!("generation_number[{i}]"),
                v.generation,
                "not greater than the previous generation",
            ));
        }
    }
    let last = versions[versions.len() - 1].generation;
    let min = last - (last - 1) % (1u64 << arity_log2);
    if versions[0].generation < min {
        return Err(invalid(
            "generation_number[0]".into(),
            versions[0].generation,
            "outside the aligned range of one version tree leaf",
        ));
    }
    Ok(())
}

/// Interior entries; `with_height` for the manifest's column of heights, else all are
/// `node_height - 1`.
pub(crate) fn read_interior_entries(
    c: &mut Cursor<'_>,
    max_entries: u64,
    files: usize,
    node_height: Option<u8>,
) -> Result<Vec<VersionNodeRef>, Problem> {
    let n = c.count("num_children", max_entries, 13)?;
    let mut gens = Vec::with_capacity(n);
    for _ in 0..n {
        gens.push(c.varint64("generation_number")?);
    }
    let locations = read_refs(c, n, files, false)?;
    let mut num_generations = Vec::with_capacity(n);
    for _ in 0..n {
        num_generations.push(c.varint64("num_generations")?);
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        times.push(c.u64le("commit_time")?);
    }
    let mut entries = Vec::with_capacity(n);
    for i in 0..n {
        let height = match node_height {
            Some(h) => h - 1,
            None => c.u8("entry_height")?,
        };
        entries.push(VersionNodeRef {
            generation: gens[i],
            location: locations[i],
            num_generations: num_generations[i],
            commit_time: times[i],
            height,
        });
    }
    Ok(entries)
}

/// `ValidateVersionTreeInteriorNodeEntries`.
fn validate_interior_entries(
    arity_log2: u8,
    height: u8,
    entries: &[VersionNodeRef],
) -> Result<(), Problem> {
    if entries.is_empty() {
        return Err(invalid(
            "num_children".into(),
            0,
            "a version tree node is never empty",
        ));
    }
    // height <= max_height keeps the shift below 63.
    let stride = 1u64 << (u32::from(arity_log2) * u32::from(height));
    for (i, e) in entries.iter().enumerate() {
        let g = e.generation;
        if g == 0 {
            return Err(invalid(
                format!("generation_number[{i}]"),
                0,
                "generation numbers start at 1",
            ));
        }
        if i > 0 {
            let p = entries[i - 1].generation;
            if g <= p {
                return Err(invalid(
                    format!("generation_number[{i}]"),
                    g,
                    "not greater than the previous generation",
                ));
            }
            if (g - 1) / stride == (p - 1) / stride {
                return Err(invalid(
                    format!("generation_number[{i}]"),
                    g,
                    "in the same child node as the previous entry",
                ));
            }
        }
        if g % stride != 0 {
            return Err(invalid(
                format!("generation_number[{i}]"),
                g,
                "not a multiple of the child nodes' span",
            ));
        }
        let max_generations = match g % stride {
            0 => stride,
            m => m,
        };
        if e.num_generations > max_generations {
            return Err(invalid(
                format!("num_generations[{i}]"),
                e.num_generations,
                "more generations than the child node spans",
            ));
        }
    }
    Ok(())
}

/// The manifest's references to version tree nodes: `ValidateManifestVersionTreeNodes`.
pub(crate) fn validate_manifest_nodes(
    arity_log2: u8,
    last_generation: u64,
    entries: &[VersionNodeRef],
) -> Result<(), Problem> {
    let max_h = max_height(arity_log2);
    for (i, e) in entries.iter().enumerate() {
        if e.height == 0 || e.height > max_h {
            return Err(invalid(
                format!("entry_height[{i}]"),
                u64::from(e.height),
                "outside 1..=the maximum version tree height",
            ));
        }
        if e.generation == 0 {
            return Err(invalid(
                format!("generation_number[{i}]"),
                0,
                "generation numbers start at 1",
            ));
        }
        if i > 0 {
            if e.generation <= entries[i - 1].generation {
                return Err(invalid(
                    format!("generation_number[{i}]"),
                    e.generation,
                    "not greater than the previous generation",
                ));
            }
            if e.height >= entries[i - 1].height {
                return Err(invalid(
                    format!("entry_height[{i}]"),
                    u64::from(e.height),
                    "not lower than the previous entry's height",
                ));
            }
        }
    }
    // Walk the heights the layout allows (`ForEachManifestVersionTreeNodeRef`), from
    // the lowest up, matching entries from the last one back.
    let a = u32::from(arity_log2);
    let mut i = entries.len();
    let mut g = ((last_generation - 1) >> a) << a;
    let mut h: u32 = 1;
    while g != 0 {
        let s = (h + 1) * a;
        let next = (g - 1)
            .checked_shr(s)
            .unwrap_or(0)
            .checked_shl(s)
            .unwrap_or(0);
        if i > 0 && u32::from(entries[i - 1].height) == h {
            i -= 1;
            let e = &entries[i];
            if e.generation < next + 1 || e.generation > g {
                return Err(invalid(
                    format!("generation_number[{i}]"),
                    e.generation,
                    "outside the range the layout gives its height",
                ));
            }
        }
        h += 1;
        g = next;
    }
    if i != 0 {
        return Err(invalid(
            format!("entry_height[{}]", i - 1),
            u64::from(entries[i - 1].height),
            "no such version tree node can exist below the last generation",
        ));
    }
    Ok(())
}

/// Decodes the body of a version tree node; `transitive` is the base path it was
/// reached through.
pub(crate) fn decode_node(body: &[u8], transitive: &[u8]) -> Result<VersionNode, Problem> {
    let mut c = Cursor::new(body);
    let arity_log2 = read_arity_log2(&mut c)?;
    let height = c.u8("height")?;
    let files = data_file_table::read(&mut c, transitive)?;
    let entries = if height == 0 {
        VersionEntries::Leaf(read_leaf_entries(&mut c, arity_log2, files.len())?)
    } else {
        if height > max_height(arity_log2) {
            return Err(invalid(
                "height".into(),
                u64::from(height),
                "above the maximum version tree height for its arity",
            ));
        }
        let e = read_interior_entries(&mut c, 1 << arity_log2, files.len(), Some(height))?;
        validate_interior_entries(arity_log2, height, &e)?;
        VersionEntries::Interior(e)
    };
    c.finish()?;
    Ok(VersionNode {
        arity_log2,
        height,
        files,
        entries,
    })
}

/// Writes leaf entries (the manifest's inline versions).
pub(crate) fn write_leaf_entries(out: &mut Vec<u8>, versions: &[Version]) {
    put_varint(out, versions.len() as u64);
    for v in versions {
        put_varint(out, v.generation);
    }
    for v in versions {
        out.push(v.root_height);
    }
    let refs: Vec<Ref> = versions.iter().map(|v| v.root).collect();
    write_refs(out, &refs);
    let stats: Vec<Stats> = versions.iter().map(|v| v.stats).collect();
    write_stats(out, &stats);
    for v in versions {
        out.extend_from_slice(&v.commit_time.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node_ref(generation: u64, height: u8) -> VersionNodeRef {
        VersionNodeRef {
            generation,
            location: Ref {
                file: 0,
                offset: 0,
                length: 1,
            },
            num_generations: 1,
            commit_time: 0,
            height,
        }
    }

    #[test]
    fn manifest_node_layout() {
        // The ocdbt_multilevel fixture: last = 21, arity 16: one height-1 node, gen 16.
        validate_manifest_nodes(4, 21, &[node_ref(16, 1)]).unwrap();
        // 16 is the last generation: everything inline, no node may exist.
        assert!(validate_manifest_nodes(4, 16, &[node_ref(16, 1)]).is_err());
        // Height 3 cannot exist below 300 generations at arity 16.
        assert!(validate_manifest_nodes(4, 300, &[node_ref(256, 3)]).is_err());
        validate_manifest_nodes(4, 300, &[node_ref(256, 2)]).unwrap();
        validate_manifest_nodes(4, 300, &[node_ref(288, 1)]).unwrap();
        validate_manifest_nodes(4, 600, &[node_ref(512, 2), node_ref(592, 1)]).unwrap();
        // Arity 2 (log2 1), the deepest trees: no shift overflows.
        validate_manifest_nodes(1, u64::MAX, &[]).unwrap();
    }
}

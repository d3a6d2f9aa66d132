//! The table of data files at the start of every object that refers to data files
//! (`format/data_file_id_codec.cc`): references store an index into it.
//!
//! ```text
//! num_files varint | path_prefix_length[1..n] | path_suffix_length[0..n]
//! | base_path_length[0..n] | path_suffix[0..n] (bytes)
//! path[i] = path[i-1][..prefix[i]] + suffix[i]; base = path[i][..base_len[i]]
//! ```
//!
//! Paths are relative to the database directory, after the *transitive* base path of
//! the object that holds the table: an object reached through table entry `j` of its
//! parent is in `transitive + base[j]`'s frame, so its own entries get that prefix.
//! Orbax's merged root refers to `ocdbt.process_0/` + `d/...` this way.

use crate::codec::{put_varint, Cursor};
use crate::error::Problem;

/// Longest full path (transitive included), `kMaxPathLength`.
pub(crate) const MAX_PATH: usize = 65535;

/// One data file: its full path relative to the database directory is
/// `base + relative`; `base` already includes the transitive prefix.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct DataFile {
    pub(crate) base: Vec<u8>,
    pub(crate) relative: Vec<u8>,
}

impl DataFile {
    pub(crate) fn path(&self) -> Vec<u8> {
        [&self.base[..], &self.relative[..]].concat()
    }
}

/// Reads a table; `transitive` is the base path of the object holding it.
pub(crate) fn read(c: &mut Cursor<'_>, transitive: &[u8]) -> Result<Vec<DataFile>, Problem> {
    // Each file takes at least one byte in the suffix- and base-length columns.
    let n = c.count("num_files", u64::MAX, 2)?;
    let max_path = MAX_PATH.saturating_sub(transitive.len());
    let mut prefix = vec![0u16; n];
    for p in prefix.iter_mut().skip(1) {
        *p = c.varint16("path_prefix_length")?;
    }
    let mut suffix = vec![0u16; n];
    for s in suffix.iter_mut() {
        *s = c.varint16("path_suffix_length")?;
    }
    let mut base = vec![0u16; n];
    for i in 0..n {
        base[i] = c.varint16("base_path_length")?;
        let path_len = usize::from(prefix[i]) + usize::from(suffix[i]);
        if path_len > max_path {
            return Err(Problem::Invalid {
                field: format!("path_length[{i}]"),
                value: path_len as u64,
                why: "longer than 65535 bytes with the transitive base path",
            });
        }
        if usize::from(base[i]) > path_len {
            return Err(Problem::Invalid {
                field: format!("base_path_length[{i}]"),
                value: u64::from(base[i]),
                why: "longer than the path",
            });
        }
        // tensorstore's rule: a shared prefix may run into the relative part only when
        // the base paths are the same length (hence equal).
        let prev_base = if i == 0 { 0 } else { base[i - 1] };
        if prefix[i] > prev_base.min(base[i]) && base[i] != prev_base {
            return Err(Problem::Invalid {
                field: format!("path_prefix_length[{i}]"),
                value: u64::from(prefix[i]),
                why: "runs past a base path of another length than the previous one",
            });
        }
    }
    let mut files = Vec::with_capacity(n);
    let mut prev: Vec<u8> = Vec::new();
    for i in 0..n {
        let p = usize::from(prefix[i]);
        if p > prev.len() {
            return Err(Problem::Invalid {
                field: format!("path_prefix_length[{i}]"),
                value: p as u64,
                why: "longer than the previous path",
            });
        }
        let mut path = prev[..p].to_vec();
        path.extend_from_slice(c.bytes(u64::from(suffix[i]), "path_suffix")?);
        let (b, r) = path.split_at(usize::from(base[i]));
        files.push(DataFile {
            base: [transitive, b].concat(),
            relative: r.to_vec(),
        });
        prev = path;
    }
    Ok(files)
}

/// Writes a table of `files` (in this order, which the references' indices follow),
/// with prefix compression as tensorstore's `DataFileTableBuilder::Finalize` does it.
pub(crate) fn write(out: &mut Vec<u8>, files: &[DataFile]) {
    put_varint(out, files.len() as u64);
    let mut prefix = vec![0usize; files.len()];
    for i in 1..files.len() {
        let (a, b) = (&files[i - 1], &files[i]);
        let mut p = common_prefix(&a.base, &b.base);
        if a.base.len() == b.base.len() && p == b.base.len() {
            p += common_prefix(&a.relative, &b.relative);
        }
        prefix[i] = p;
        put_varint(out, p as u64);
    }
    for (f, p) in files.iter().zip(&prefix) {
        put_varint(out, (f.base.len() + f.relative.len() - p) as u64);
    }
    for f in files {
        put_varint(out, f.base.len() as u64);
    }
    for (f, &p) in files.iter().zip(&prefix) {
        out.extend_from_slice(&f.path()[p..]);
    }
}

pub(crate) fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn df(b: &str, r: &str) -> DataFile {
        DataFile {
            base: b.as_bytes().to_vec(),
            relative: r.as_bytes().to_vec(),
        }
    }

    #[test]
    fn round_trip_with_shared_prefixes() {
        let files = vec![
            df("", "d/0123"),
            df("", "d/0199"),
            df("ocdbt.process_0/", "d/aa"),
            df("ocdbt.process_0/", "d/ab"),
            df("ocdbt.process_1/", "d/ab"),
        ];
        let mut b = Vec::new();
        write(&mut b, &files);
        let mut c = Cursor::new(&b);
        assert_eq!(read(&mut c, b"").unwrap(), files);
        c.finish().unwrap();
        // Read under a transitive base path: every base gets it in front.
        let mut c = Cursor::new(&b);
        let t = read(&mut c, b"x/").unwrap();
        assert_eq!(t[2].path(), b"x/ocdbt.process_0/d/aa");
        assert_eq!(t[0].base, b"x/");
    }

    #[test]
    fn prefix_longer_than_previous_path_is_refused() {
        // Two files: prefix[1] = 5, but path[0] is 2 bytes.
        let b = [2u8, 5, 2, 0, 0, 0, b'a', b'b'];
        let e = read(&mut Cursor::new(&b), b"").unwrap_err();
        assert!(
            matches!(e, Problem::Invalid { ref field, .. } if field == "path_prefix_length[1]")
        );
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        let mut b = Vec::new();
        put_varint(&mut b, 1 << 60);
        assert!(matches!(
            read(&mut Cursor::new(&b), b""),
            Err(Problem::Truncated { .. })
        ));
    }
}

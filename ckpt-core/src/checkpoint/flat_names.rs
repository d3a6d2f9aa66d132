//! Names of pieces in coverage messages: a piece its reader reported as a flat element
//! range (ZeRO) is named by that range, as `inspect` draws it, not by the boxes
//! `layout/flat.rs` cut it into for planning.

use crate::formats::{PieceKind, TensorFile};
use crate::layout::flat::{check_flat_cover, FlatDefect, FlatRange};
use crate::layout::source::SourcePiece;

/// A piece in messages: its file, and the flat range it is part of when it is one.
pub(crate) fn piece_name(files: &[TensorFile], p: &SourcePiece) -> String {
    let f = &files[p.file];
    match f.piece(p.tensor) {
        PieceKind::Flat { start, len } => format!(
            "{} (flat [{start}..{}])",
            f.path().display(),
            start.saturating_add(len)
        ),
        _ => f.path().display().to_string(),
    }
}

/// Where a tensor of `numel` elements whose pieces are all flat ranges has no data,
/// as a flat range of its elements; `None` when a piece is a box or the ranges leave
/// no gap (the box check's message stands then).
pub(crate) fn flat_gap(files: &[TensorFile], pieces: &[SourcePiece], numel: u64) -> Option<String> {
    let mut ranges = std::collections::BTreeSet::new();
    for p in pieces {
        match files[p.file].piece(p.tensor) {
            PieceKind::Flat { start, len } => ranges.insert((start, len)),
            _ => return None,
        };
    }
    let ranges: Vec<FlatRange> = ranges
        .into_iter()
        .map(|(s, l)| FlatRange::new(s, l))
        .collect();
    match check_flat_cover(numel, &ranges) {
        Err(FlatDefect::Gap { range }) => Some(format!("{range} (row-major elements)")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{map_file, FileFormat, TensorEntry};
    use crate::layout::region::Region;
    use crate::layout::Dtype;

    /// A file holding the boxes `layout/flat.rs` cuts `range` of a [3, 4] f32 tensor
    /// into (marked with the range when `mark`), and the pieces of those boxes.
    fn flat_file(
        path: &std::path::Path,
        range: FlatRange,
        mark: bool,
    ) -> (TensorFile, Vec<SourcePiece>) {
        std::fs::write(path, vec![0u8; range.len as usize * 4]).unwrap();
        let boxes = range.boxes(&[3, 4]).unwrap();
        let entries = boxes
            .iter()
            .map(|b| TensorEntry {
                name: "w".into(),
                dtype: Dtype::F32,
                shape: b.region.shape.to_vec(),
                start: b.offset * 4,
                end: (b.offset + b.region.numel()) * 4,
                offsets: Some(b.region.start.to_vec()),
            })
            .collect();
        let mut f = TensorFile::from_parts(
            path,
            map_file(path).unwrap(),
            FileFormat::DeepSpeed,
            entries,
            Default::default(),
        )
        .unwrap();
        let mut pieces = Vec::new();
        for (i, b) in boxes.into_iter().enumerate() {
            if mark {
                f.set_flat(i, range.start, range.len);
            }
            pieces.push(SourcePiece {
                file: 0,
                tensor: i,
                local: Region::full(&b.region.shape),
                global: b.region,
                view: None,
                compute: None,
            });
        }
        (f, pieces)
    }

    #[test]
    fn flat_pieces_are_named_by_their_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r1.pt");
        // Elements 5..9 of a 3×4 matrix: the end of row 1, the start of row 2.
        let (f, pieces) = flat_file(&path, FlatRange::new(5, 4), true);
        assert_eq!(pieces.len(), 2, "cut into two boxes");
        let files = [f];
        for p in &pieces {
            assert_eq!(
                piece_name(&files, p),
                format!("{} (flat [5..9])", path.display())
            );
        }
        // Nothing before them is held: the gap as a flat range.
        assert_eq!(
            flat_gap(&files, &pieces, 12).as_deref(),
            Some("flat 0..5 (row-major elements)")
        );
        assert_eq!(
            flat_gap(&files, &pieces, 9).as_deref(),
            Some("flat 0..5 (row-major elements)")
        );
    }

    #[test]
    fn boxes_keep_their_box_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r0.pt");
        let (f, pieces) = flat_file(&path, FlatRange::new(5, 4), false);
        let files = [f];
        assert_eq!(piece_name(&files, &pieces[0]), path.display().to_string());
        assert_eq!(flat_gap(&files, &pieces, 12), None);
    }
}

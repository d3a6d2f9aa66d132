//! The terminal drawing of a [`TensorPicture`]: the folded tensor as a grid of
//! characters, each standing for the element at its centre and showing the symbol of
//! the holder that owns it, then a legend with every holding's exact extent and bytes.

use super::{fold, Extent, TensorPicture};
use crate::layout::plan::bytes_of;
use std::fmt::Write;

/// Symbols of holders, in the order they first appear; `#` once these run out.
const SYMBOLS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
/// A cell no holding covers (a gap: the checkpoint is missing data).
const GAP: char = '.';
/// A cell that two owners claim (an overlap: the checkpoint is inconsistent).
const CLASH: char = '!';
/// 256-colour backgrounds, one per symbol in turn, chosen to differ under white text.
const PALETTE: &[u8] = &[25, 130, 28, 90, 136, 30, 124, 58, 61, 94, 127, 23];
/// Red, for gaps and overlaps.
const ALARM: u8 = 196;

/// Size and style of a drawing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Canvas {
    /// Most characters per line of the grid.
    pub width: usize,
    /// Most lines of the grid.
    pub height: usize,
    /// ANSI colours (a terminal without `NO_COLOR`); plain characters otherwise.
    pub color: bool,
}

impl Default for Canvas {
    fn default() -> Self {
        Canvas {
            width: 64,
            height: 32,
            color: false,
        }
    }
}

/// What a cell shows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cell {
    Holder(usize),
    Gap,
    Clash,
}

/// Row-major index of element `flat` of `shape`.
fn unravel(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut index = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        if shape[d] > 0 {
            index[d] = flat % shape[d];
            flat /= shape[d];
        }
    }
    index
}

/// Element of `n` sampled by cell `i` of `cells`: the one under the cell's centre.
fn sample(i: usize, cells: usize, n: u64) -> u64 {
    ((2 * i as u128 + 1) * u128::from(n) / (2 * cells as u128)) as u64
}

/// Draws `p` on `canvas`.
///
/// Worked example: a 4 × 2 matrix split in rows over two ranks, the second rank also
/// keeping a copy of the first's rows. Each element is two characters wide while the
/// tensor is narrow enough, so that squares look square:
/// ```
/// use ckpt_core::draw::{render_text, Canvas, Extent, Holding, TensorPicture};
/// use ckpt_core::layout::region::Region;
/// let p = TensorPicture {
///     name: "w".into(), dtype: ckpt_core::layout::Dtype::F32, shape: vec![4, 2],
///     holders: vec!["rank 0".into(), "rank 1".into()],
///     ranks: vec![Some(0), Some(1)],
///     holdings: vec![
///         Holding { holder: 0, extent: Extent::Box(Region::from_ranges(&[0..2, 0..2])), copy: false },
///         Holding { holder: 1, extent: Extent::Box(Region::from_ranges(&[2..4, 0..2])), copy: false },
///         Holding { holder: 1, extent: Extent::Box(Region::from_ranges(&[0..2, 0..2])), copy: true },
///     ],
///     empty: vec![],
/// };
/// let text = render_text(&p, &Canvas::default());
/// assert!(text.contains("0 |0000|\n  1 |0000|\n  2 |1111|\n  3 |1111|\n"));
/// ```
#[must_use]
pub fn render_text(p: &TensorPicture, canvas: &Canvas) -> String {
    let f = fold(&p.shape);
    let mut out = String::new();
    let owners = p
        .holdings
        .iter()
        .filter(|h| !h.copy && h.extent.numel() > 0);
    let files: std::collections::BTreeSet<usize> = owners.clone().map(|h| h.holder).collect();
    let _ = writeln!(
        out,
        "tensor `{}`  {} {:?}  {} piece(s) in {} file(s), {} replica(s)",
        p.name,
        crate::layout::strategy::dtype_name(p.dtype),
        p.shape,
        owners.count(),
        files.len(),
        p.holdings.iter().filter(|h| h.copy).count()
    );
    if let Some(rule) = &f.rule {
        let _ = writeln!(out, "{rule}");
    }
    // A symbol per holder, in order of holder index.
    let mut order: Vec<usize> = p.holdings.iter().map(|h| h.holder).collect();
    order.sort_unstable();
    order.dedup();
    // Symbols are rank numbers when every holder drawn has one (so that rank 3 is
    // `3` even when rank 2 is missing), else the holders' order.
    let by_rank = order
        .iter()
        .all(|&h| p.ranks.get(h).copied().flatten().is_some());
    let key = |holder: usize| -> usize {
        if by_rank {
            p.ranks[holder].map_or(usize::MAX, |r| usize::try_from(r).unwrap_or(usize::MAX))
        } else {
            order.binary_search(&holder).unwrap_or(usize::MAX)
        }
    };
    let symbol_of =
        |holder: usize| -> char { SYMBOLS.get(key(holder)).map_or('#', |&b| b as char) };
    let color_of = |holder: usize| -> u8 { PALETTE[key(holder) % PALETTE.len()] };
    let mut drawn = vec![0u64; p.holdings.len()];
    if f.rows == 0 || f.cols == 0 {
        let _ = writeln!(out, "(no elements)");
    } else {
        let width = canvas.width.max(1);
        // Two characters per column while they fit: terminal cells are about twice
        // as tall as wide.
        let w = if f.cols.saturating_mul(2) <= width as u64 {
            (f.cols * 2) as usize
        } else {
            width
        };
        let h = if f.rows <= canvas.height.max(1) as u64 {
            f.rows as usize
        } else {
            canvas.height.max(1)
        };
        if f.rows > h as u64 || f.cols > w as u64 {
            let _ = writeln!(
                out,
                "scaled: {h} lines for {} rows, {w} characters for {} columns; each shows the owner of the element at its centre",
                f.rows, f.cols
            );
        }
        let label_w = (f.rows - 1).to_string().len().max(3);
        let _ = writeln!(
            out,
            "{:>label_w$}  0{:>pad$}",
            "",
            f.cols,
            pad = w.saturating_sub(1)
        );
        let _ = writeln!(out, "{:>label_w$} +{}+", "", "-".repeat(w));
        let mut gaps = false;
        let mut clashes = false;
        for i in 0..h {
            let row = sample(i, h, f.rows);
            let mut cells = Vec::with_capacity(w);
            for j in 0..w {
                let col = sample(j, w, f.cols);
                let flat = row * f.cols + col;
                let index = unravel(flat, &p.shape);
                // Owners decide the cell; a replica alone still means the data is there.
                let mut owner: Option<usize> = None;
                let mut replica: Option<usize> = None;
                let mut clash = false;
                for (k, hd) in p.holdings.iter().enumerate() {
                    if hd.extent.numel() == 0 || !hd.extent.holds(flat, &index) {
                        continue;
                    }
                    drawn[k] += 1;
                    if hd.copy {
                        replica.get_or_insert(hd.holder);
                    } else if owner.is_some_and(|o| o != hd.holder) {
                        clash = true;
                    } else {
                        owner = Some(hd.holder);
                    }
                }
                let cell = match (clash, owner.or(replica)) {
                    (true, _) => Cell::Clash,
                    (false, Some(x)) => Cell::Holder(x),
                    (false, None) => Cell::Gap,
                };
                gaps |= cell == Cell::Gap;
                clashes |= cell == Cell::Clash;
                cells.push(cell);
            }
            // The row whose owners the line shows, not the first of the rows it
            // stands for: a gap drawn at a row is a gap at that row.
            let _ = write!(out, "{row:>label_w$} |");
            let mut current: Option<u8> = None;
            for c in cells {
                let (ch, colour) = match c {
                    Cell::Holder(x) => (symbol_of(x), color_of(x)),
                    Cell::Gap => (GAP, ALARM),
                    Cell::Clash => (CLASH, ALARM),
                };
                if canvas.color && current != Some(colour) {
                    let _ = write!(out, "\x1b[97;48;5;{colour}m");
                    current = Some(colour);
                }
                out.push(ch);
            }
            if canvas.color {
                out.push_str("\x1b[0m");
            }
            out.push_str("|\n");
        }
        let _ = writeln!(out, "{:>label_w$} +{}+", "", "-".repeat(w));
        if gaps {
            let _ = writeln!(out, "{GAP} = held by no file: data missing");
        }
        if clashes {
            let _ = writeln!(out, "{CLASH} = claimed by two files: overlapping pieces");
        }
    }
    let lw = p
        .holdings
        .iter()
        .map(|h| p.holders[h.holder].chars().count())
        .max()
        .unwrap_or(0);
    for (k, hd) in p.holdings.iter().enumerate() {
        let sym = symbol_of(hd.holder);
        let mark = if canvas.color {
            format!("\x1b[97;48;5;{}m{sym}\x1b[0m", color_of(hd.holder))
        } else {
            sym.to_string()
        };
        let numel = hd.extent.numel();
        let what = if numel == 0 {
            "holds nothing of it (empty piece)".to_string()
        } else {
            let mut s = format!("{}  {} B", hd.extent, bytes_of(p.dtype, numel));
            if hd.copy {
                s.push_str("  replica");
            }
            if drawn[k] == 0 && f.rows > 0 && f.cols > 0 {
                s.push_str("  (smaller than one character: not drawn)");
            }
            if let Extent::Flat { .. } = hd.extent {
                s.push_str("  flat range, row-major");
            }
            s
        };
        let _ = writeln!(out, "  {mark}  {:<lw$}  {what}", p.holders[hd.holder]);
    }
    if !p.empty.is_empty() {
        // One line, however many ranks: on a big mesh most hold nothing of a tensor.
        const LISTED: usize = 16;
        let names: Vec<&str> = p
            .empty
            .iter()
            .take(LISTED)
            .map(|&h| p.holders[h].as_str())
            .collect();
        let more = p.empty.len().saturating_sub(LISTED);
        let rest = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        let _ = writeln!(out, "  -  holds nothing of it: {}{rest}", names.join(", "));
    }
    out
}

#[cfg(test)]
// One-dimensional regions are written as one range: `&[0..3]`.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use crate::draw::Holding;
    use crate::layout::region::Region;
    use crate::layout::Dtype;

    fn owner(holder: usize, r: &[std::ops::Range<u64>]) -> Holding {
        Holding {
            holder,
            extent: Extent::Box(Region::from_ranges(r)),
            copy: false,
        }
    }

    fn pic(shape: &[u64], n: usize, holdings: Vec<Holding>) -> TensorPicture {
        TensorPicture {
            name: "t".into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            holders: (0..n).map(|r| format!("rank {r}")).collect(),
            ranks: (0..n as u64).map(Some).collect(),
            holdings,
            empty: vec![],
        }
    }

    #[test]
    fn columns_split_unevenly_with_an_empty_rank() {
        // 5 columns over 3 ranks as torch.chunk cuts them: 2, 2, 1... and a 4th rank
        // with nothing.
        let mut p = pic(
            &[2, 5],
            5,
            vec![
                owner(0, &[0..2, 0..2]),
                owner(1, &[0..2, 2..4]),
                owner(2, &[0..2, 4..5]),
                owner(3, &[0..0, 0..0]),
            ],
        );
        p.empty = vec![4];
        let text = render_text(&p, &Canvas::default());
        assert_eq!(
            text,
            "tensor `t`  F32 [2, 5]  3 piece(s) in 3 file(s), 0 replica(s)\n\
             \x20    0        5\n\
             \x20   +----------+\n\
             \x20 0 |0000111122|\n\
             \x20 1 |0000111122|\n\
             \x20   +----------+\n\
             \x20 0  rank 0  [0..2, 0..2]  16 B\n\
             \x20 1  rank 1  [0..2, 2..4]  16 B\n\
             \x20 2  rank 2  [0..2, 4..5]  8 B\n\
             \x20 3  rank 3  holds nothing of it (empty piece)\n\
             \x20 -  holds nothing of it: rank 4\n"
        );
    }

    #[test]
    fn vector_is_one_run_per_holder_and_replicas_are_listed() {
        let copy = Holding {
            holder: 2,
            extent: Extent::Box(Region::from_ranges(&[0..3])),
            copy: true,
        };
        let p = pic(&[6], 3, vec![owner(0, &[0..3]), owner(1, &[3..6]), copy]);
        let text = render_text(&p, &Canvas::default());
        assert_eq!(
            text,
            "tensor `t`  F32 [6]  2 piece(s) in 2 file(s), 1 replica(s)\n\
             \x20    0          6\n\
             \x20   +------------+\n\
             \x20 0 |000000111111|\n\
             \x20   +------------+\n\
             \x20 0  rank 0  [0..3]  12 B\n\
             \x20 1  rank 1  [3..6]  12 B\n\
             \x20 2  rank 2  [0..3]  12 B  replica\n"
        );
    }

    #[test]
    fn flat_ranges_draw_as_runs_over_the_folded_rows() {
        // ZeRO-style: a 2x4 tensor flattened, 3 elements then 5.
        let flat = |holder, start, len| Holding {
            holder,
            extent: Extent::Flat { start, len },
            copy: false,
        };
        let p = pic(&[2, 4], 2, vec![flat(0, 0, 3), flat(1, 3, 5)]);
        let text = render_text(&p, &Canvas::default());
        assert!(text.contains("  0 |00000011|\n  1 |11111111|\n"), "{text}");
        assert!(text.contains("  0  rank 0  flat [0..3]  12 B  flat range, row-major\n"));
    }

    #[test]
    fn higher_ranks_fold_with_the_rule_and_scale_down() {
        // 2x3x40, split in the middle dimension over 3 ranks: the folded rows cycle.
        let p = pic(
            &[2, 3, 40],
            3,
            (0..3)
                .map(|r| owner(r, &[0..2, r as u64..r as u64 + 1, 0..40]))
                .collect(),
        );
        let text = render_text(
            &p,
            &Canvas {
                width: 20,
                height: 16,
                color: false,
            },
        );
        assert!(
            text.contains("3-D folded to 2-D: rows = dims 0..1 (2×3 = 6), columns = dim 2 (40)\n")
        );
        assert!(text.contains("scaled: 6 lines for 6 rows, 20 characters for 40 columns;"));
        let grid: Vec<&str> = text.lines().filter(|l| l.contains(" |")).collect();
        assert_eq!(
            grid,
            [
                "  0 |00000000000000000000|",
                "  1 |11111111111111111111|",
                "  2 |22222222222222222222|",
                "  3 |00000000000000000000|",
                "  4 |11111111111111111111|",
                "  5 |22222222222222222222|",
            ]
        );
    }

    #[test]
    fn gaps_overlaps_and_tiny_pieces_are_marked() {
        // 100 rows: rank 0 rows 0..60, rank 1 rows 50..99 (overlap 50..60, gap 99),
        // rank 2 row 99 alone is too thin for a 4-line grid... but sits at a gap.
        let p = pic(
            &[100, 1],
            2,
            vec![owner(0, &[0..60, 0..1]), owner(1, &[50..98, 0..1])],
        );
        let text = render_text(
            &p,
            &Canvas {
                width: 64,
                height: 10,
                color: false,
            },
        );
        let grid: Vec<&str> = text.lines().filter(|l| l.contains(" |")).collect();
        assert_eq!(grid[5], " 55 |!!|", "{text}");
        assert_eq!(grid[9], " 95 |11|", "{text}");
        assert!(text.contains("! = claimed by two files"));
        let p = pic(
            &[100, 1],
            2,
            vec![owner(0, &[0..99, 0..1]), owner(1, &[99..100, 0..1])],
        );
        let text = render_text(
            &p,
            &Canvas {
                width: 64,
                height: 4,
                color: false,
            },
        );
        assert!(
            text.contains("rank 1  [99..100, 0..1]  4 B  (smaller than one character: not drawn)"),
            "{text}"
        );
        let p = pic(&[4], 1, vec![owner(0, &[0..2])]);
        let text = render_text(&p, &Canvas::default());
        assert!(text.contains("|0000....|"), "{text}");
        assert!(text.contains(". = held by no file"));
    }

    #[test]
    fn colours_only_when_asked() {
        let p = pic(
            &[1, 2],
            2,
            vec![owner(0, &[0..1, 0..1]), owner(1, &[0..1, 1..2])],
        );
        let plain = render_text(&p, &Canvas::default());
        assert!(!plain.contains('\x1b'));
        let color = render_text(
            &p,
            &Canvas {
                color: true,
                ..Canvas::default()
            },
        );
        assert!(
            color.contains("|\x1b[97;48;5;25m00\x1b[97;48;5;130m11\x1b[0m|"),
            "{color}"
        );
    }
}

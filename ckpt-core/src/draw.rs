//! Pictures of layouts: which file (rank) holds which part of each tensor.
//!
//! Every picture is drawn from one plain list, a [`TensorPicture`]: the tensor's global
//! shape and a list of [`Holding`]s, each a holder (a file, labelled by its rank when
//! known) and the [`Extent`] it holds, a box of the global tensor or a flat row-major
//! range (ZeRO-style). The terminal drawing ([`render_text`]), the JSON of `inspect
//! --json` ([`pieces_json`]) and the HTML report ([`write_html_report`]) all read that
//! list, so a new kind of piece only needs a new [`Extent`] case.

mod experts;
mod html;
mod plan_report;
mod terminal;

use crate::checkpoint::{Checkpoint, Kind};
use crate::error::{Error, Result};
use crate::formats::PieceKind;
use crate::layout::plan::bytes_of;
use crate::layout::region::Region;
use crate::layout::Dtype;
pub(crate) use html::placements;
pub use html::{html_report, plan_html_report, write_html_report, write_plan_html};
pub use plan_report::{PlanReport, SourceRead, TargetReads};
use serde_json::{json, Value};
pub use terminal::{render_text, Canvas};

/// What one holding covers of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Extent {
    /// A box of the global tensor.
    Box(Region),
    /// `len` elements from row-major element `start` of the global tensor (a flat
    /// optimizer-state shard, ZeRO-style).
    Flat {
        /// First element.
        start: u64,
        /// Number of elements.
        len: u64,
    },
}

impl Extent {
    /// Number of elements held.
    #[must_use]
    pub fn numel(&self) -> u64 {
        match self {
            Extent::Box(r) => r.numel(),
            Extent::Flat { len, .. } => *len,
        }
    }

    /// Whether the element at row-major offset `flat`, index `index`, is held.
    fn holds(&self, flat: u64, index: &[u64]) -> bool {
        match self {
            Extent::Box(r) => index
                .iter()
                .enumerate()
                .all(|(d, &i)| i >= r.start[d] && i < r.end(d)),
            Extent::Flat { start, len } => flat >= *start && flat - start < *len,
        }
    }
}

impl std::fmt::Display for Extent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Extent::Box(r) => write!(f, "{r}"),
            Extent::Flat { start, len } => write!(f, "flat [{start}..{}]", start + len),
        }
    }
}

/// One holder's part of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// Index into [`TensorPicture::holders`].
    pub holder: usize,
    /// What it holds.
    pub extent: Extent,
    /// A replica of a part another holder owns (read only by deep checks).
    pub copy: bool,
}

/// A tensor's global shape and who holds what of it.
#[derive(Clone, Debug)]
pub struct TensorPicture {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Labels of every holder that may appear (`rank 0`, or a file name).
    pub holders: Vec<String>,
    /// Rank of each holder, when known (the drawing's symbols are rank numbers then).
    pub ranks: Vec<Option<u64>>,
    /// The holdings (an empty extent: a piece recorded with no elements).
    pub holdings: Vec<Holding>,
    /// Holders that hold none of the tensor although they hold others (rank files of
    /// a sliced checkpoint: uneven splits, replicated data written once, pipeline
    /// stages).
    pub empty: Vec<usize>,
}

/// A tensor folded to a matrix of `rows` × `cols` elements in row-major order, so that
/// a row-major offset is `row * cols + col` in any rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fold {
    /// Rows of the matrix.
    pub rows: u64,
    /// Columns of the matrix.
    pub cols: u64,
    /// How the dimensions were folded, when they were (more than 2).
    pub rule: Option<String>,
}

/// Folds `shape` to 2-D: a scalar is 1 × 1, a vector one row, a matrix itself, and
/// higher ranks keep the last dimension as columns and fold all others into rows.
///
/// ```
/// let f = ckpt_core::draw::fold(&[2, 3, 4]);
/// assert_eq!((f.rows, f.cols), (6, 4));
/// assert_eq!(f.rule.unwrap(), "3-D folded to 2-D: rows = dims 0..1 (2×3 = 6), columns = dim 2 (4)");
/// ```
#[must_use]
pub fn fold(shape: &[u64]) -> Fold {
    match shape {
        [] => Fold {
            rows: 1,
            cols: 1,
            rule: None,
        },
        [n] => Fold {
            rows: 1,
            cols: *n,
            rule: None,
        },
        [r, c] => Fold {
            rows: *r,
            cols: *c,
            rule: None,
        },
        _ => {
            let n = shape.len();
            // Shapes of opened checkpoints have element counts that fit in u64 (their
            // bytes are in files); saturating keeps a hand-made picture from panicking.
            let rows = shape[..n - 1]
                .iter()
                .fold(1u64, |a, &b| a.saturating_mul(b));
            let dims: Vec<String> = shape[..n - 1].iter().map(u64::to_string).collect();
            Fold {
                rows,
                cols: shape[n - 1],
                rule: Some(format!(
                    "{n}-D folded to 2-D: rows = dims 0..{} ({} = {rows}), columns = dim {} ({})",
                    n - 2,
                    dims.join("×"),
                    n - 1,
                    shape[n - 1]
                )),
            }
        }
    }
}

/// Label of file `file` of `ck` in pictures: `rank R` when known, else its path.
#[must_use]
pub fn holder_label(ck: &Checkpoint, file: usize) -> String {
    match ck.ranks.get(file).copied().flatten() {
        Some(r) => format!("rank {r}"),
        None => ck.files[file].path().display().to_string(),
    }
}

/// The holdings of tensor `t` of `ck` (owners, then replicas) and the files that hold
/// none of it (sliced checkpoints only: every rank file is expected to hold its part).
/// A piece its reader reported as a flat range (ZeRO) is one holding of that range,
/// however many boxes the range was cut into for planning.
fn holdings_of(
    ck: &Checkpoint,
    t: &crate::layout::source::SourceTensor,
) -> (Vec<Holding>, Vec<usize>) {
    let mut flat_seen = std::collections::HashSet::new();
    let mut holdings: Vec<Holding> = Vec::with_capacity(t.pieces.len() + t.copies.len());
    let owners = t.pieces.iter().map(|p| (p, false));
    for (p, copy) in owners.chain(t.copies.iter().map(|(_, p)| (p, true))) {
        let extent = match ck.files[p.file].piece(p.tensor) {
            PieceKind::Flat { start, len } => {
                if !flat_seen.insert((p.file, start, len, copy)) {
                    continue;
                }
                Extent::Flat { start, len }
            }
            _ => Extent::Box(p.global.clone()),
        };
        holdings.push(Holding {
            holder: p.file,
            extent,
            copy,
        });
    }
    let mut empty = Vec::new();
    if ck.kind == Kind::Sliced {
        let mut seen = vec![false; ck.files.len()];
        for h in &holdings {
            seen[h.holder] = true;
        }
        empty = (0..ck.files.len()).filter(|&f| !seen[f]).collect();
    }
    (holdings, empty)
}

/// The picture of tensor `name` of `ck`.
///
/// # Errors
/// [`Error::TensorNotFound`] when `ck` has no such tensor.
pub fn picture(ck: &Checkpoint, name: &str) -> Result<TensorPicture> {
    let t = ck.tensors.get(name).ok_or_else(|| Error::TensorNotFound {
        pattern: name.to_string(),
        tensors: ck.tensors.len(),
    })?;
    let (holdings, empty) = holdings_of(ck, t);
    Ok(TensorPicture {
        name: name.to_string(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        holders: (0..ck.files.len()).map(|i| holder_label(ck, i)).collect(),
        ranks: ck.ranks.clone(),
        holdings,
        empty,
    })
}

/// Names of `ck`'s tensors matching `pattern` (an exact name or a glob), in order.
///
/// # Errors
/// A malformed glob, or [`Error::TensorNotFound`] when nothing matches.
pub fn matching(ck: &Checkpoint, pattern: &str) -> Result<Vec<String>> {
    if ck.tensors.contains_key(pattern) {
        return Ok(vec![pattern.to_string()]);
    }
    let glob = globset::Glob::new(pattern)
        .map_err(|e| Error::Unsupported {
            problem: format!("bad pattern `{pattern}`: {}", e.kind()),
        })?
        .compile_matcher();
    let names: Vec<String> = ck
        .tensors
        .keys()
        .filter(|n| glob.is_match(n.as_str()))
        .cloned()
        .collect();
    if names.is_empty() {
        return Err(Error::TensorNotFound {
            pattern: pattern.to_string(),
            tensors: ck.tensors.len(),
        });
    }
    Ok(names)
}

/// The pieces of tensor `name` for `inspect --json`: one object per holding with the
/// file index, rank, box (`start`, `shape`) or flat range, bytes and whether it is a
/// replica. Files holding none of it are left out (a mesh of 1000 ranks would repeat
/// them for every tensor).
///
/// # Errors
/// [`Error::TensorNotFound`] when `ck` has no such tensor.
pub fn pieces_json(ck: &Checkpoint, name: &str) -> Result<Value> {
    let t = ck.tensors.get(name).ok_or_else(|| Error::TensorNotFound {
        pattern: name.to_string(),
        tensors: ck.tensors.len(),
    })?;
    let (holdings, _) = holdings_of(ck, t);
    Ok(Value::Array(
        holdings
            .iter()
            .map(|h| {
                let mut v = json!({
                    "file": h.holder,
                    "rank": ck.ranks[h.holder],
                    "bytes": bytes_of(t.dtype, h.extent.numel()),
                    "copy": h.copy,
                });
                match &h.extent {
                    Extent::Box(r) => {
                        v["start"] = json!(r.start);
                        v["shape"] = json!(r.shape);
                    }
                    Extent::Flat { start, len } => v["flat"] = json!([start, len]),
                }
                v
            })
            .collect(),
    ))
}

/// How many pieces of tensor `name` `ck` reads (replicas not counted), as the pictures
/// count them: a flat range is one piece however many boxes it was cut into.
///
/// # Errors
/// [`Error::TensorNotFound`] when `ck` has no such tensor.
pub fn piece_count(ck: &Checkpoint, name: &str) -> Result<usize> {
    let t = ck.tensors.get(name).ok_or_else(|| Error::TensorNotFound {
        pattern: name.to_string(),
        tensors: ck.tensors.len(),
    })?;
    Ok(holdings_of(ck, t).0.iter().filter(|h| !h.copy).count())
}

/// The terminal drawings of every tensor of `ck` matching `pattern` (a name or a
/// glob), one after the other, after a map of which file holds which expert where
/// the tensors are a mixture of experts' (one per expert).
///
/// # Errors
/// A malformed glob, or [`Error::TensorNotFound`] when nothing matches.
pub fn show(ck: &Checkpoint, pattern: &str, canvas: &Canvas) -> Result<String> {
    let names = matching(ck, pattern)?;
    // Experts first: which file holds which expert, across the tensors.
    let labels: Vec<String> = (0..ck.files.len()).map(|f| holder_label(ck, f)).collect();
    let held: Vec<experts::Held> = names
        .iter()
        .filter(|n| experts::expert_of(n).is_some())
        .map(|n| {
            let t = &ck.tensors[n];
            experts::Held {
                name: n.clone(),
                numel: t.shape.iter().product(),
                by_file: holdings_of(ck, t)
                    .0
                    .iter()
                    .map(|h| (h.holder, h.extent.numel()))
                    .collect(),
            }
        })
        .collect();
    let mut out = experts::expert_maps(&labels, &held);
    for (i, name) in names.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&render_text(&picture(ck, name)?, canvas));
    }
    Ok(out)
}

//! The HTML report of a checkpoint: one self-contained file (inline CSS, JS and SVG, no
//! fetches) with a summary, a sortable and filterable table of tensors, and per tensor
//! a drawing of its pieces over the ranks, built in the browser when the row is opened
//! from the JSON embedded in the page (`report.html` is the page, `__DATA__` the place
//! of the JSON).

use super::{holder_label, holdings_of, Extent, PlanReport};
use crate::checkpoint::{Checkpoint, Kind};
use crate::error::{Error, Result};
use crate::layout::plan::{bytes_of, CopyPlan};
use crate::layout::strategy::dtype_name;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

const PAGE: &str = include_str!("report.html");

/// Placements of tensor `name` as `inspect` prints them: `tp:Shard(0) dp:Replicate`,
/// `whole`, or the number of pieces.
pub(crate) fn placements(ck: &Checkpoint, name: &str) -> String {
    match (&ck.strategy, ck.kind) {
        (Some(s), _) => match s.tensors.get(name) {
            Some(l) => s
                .mesh
                .axes()
                .iter()
                .zip(&l.placements)
                .map(|(a, p)| format!("{}:{}", a.name, p))
                .chain(l.stage.map(|st| format!("stage {st}")))
                .collect::<Vec<_>>()
                .join(" "),
            None => String::new(),
        },
        (None, Kind::Integrated) => "whole".into(),
        // Counted as drawn: a ZeRO rank's flat range is one piece.
        (None, _) => format!("{} pieces", super::piece_count(ck, name).unwrap_or(0)),
    }
}

/// The data the page draws from. Tensors are arrays, not objects, to keep a report of
/// 10^5 tensors small: `[name, dtype, shape, bytes, placements, holdings]`, each
/// holding `[holder, start, shape, copy]` for a box or `[holder, null, len, copy,
/// start]` for a flat range.
fn data(ck: &Checkpoint, problems: &[Error], title: &str) -> Value {
    let mut dtypes: BTreeMap<String, u64> = BTreeMap::new();
    let mut bits: BTreeMap<String, usize> = BTreeMap::new();
    let mut tensors = Vec::with_capacity(ck.tensors.len());
    for (name, t) in &ck.tensors {
        let d = dtype_name(t.dtype);
        *dtypes.entry(d.clone()).or_default() += 1;
        bits.insert(d.clone(), t.dtype.bitsize());
        let (holdings, _) = holdings_of(ck, t);
        let holdings: Vec<Value> = holdings
            .iter()
            .map(|h| {
                let copy = u8::from(h.copy);
                match &h.extent {
                    Extent::Box(r) => json!([h.holder, r.start, r.shape, copy]),
                    Extent::Flat { start, len } => json!([h.holder, null, len, copy, start]),
                }
            })
            .collect();
        tensors.push(json!([
            name,
            d,
            t.shape,
            bytes_of(t.dtype, t.shape.iter().product()),
            placements(ck, name),
            holdings
        ]));
    }
    let formats: std::collections::BTreeSet<&str> =
        ck.files.iter().map(|f| f.format().name()).collect();
    let kind = match ck.kind {
        Kind::Sliced => "sliced (ckpt rank files + strategy)",
        Kind::Integrated => "integrated (whole tensors)",
        Kind::Dcp
            if ck
                .files
                .iter()
                .all(|f| f.format() == crate::formats::FileFormat::Orbax) =>
        {
            "Orbax"
        }
        Kind::Dcp => "PyTorch DCP",
    };
    let ranks = ck.ranks.iter().flatten().max().map(|r| r + 1);
    let strategy = ck.strategy.as_ref().map(|s| {
        let mut placements: BTreeMap<String, u64> = BTreeMap::new();
        for name in ck.tensors.keys() {
            *placements.entry(self::placements(ck, name)).or_default() += 1;
        }
        let common: Vec<String> = placements
            .iter()
            .map(|(p, n)| format!("{p} ({n})"))
            .collect();
        format!("mesh {}: {}", s.mesh, common.join(", "))
    });
    json!({
        "summary": {
            "path": title,
            "format": formats.into_iter().collect::<Vec<_>>().join(", "),
            "kind": kind,
            "dtypes": dtypes,
            "bytes": ck.stored_bytes(),
            "ranks": ranks,
            "strategy": strategy,
            "problems": problems.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "notes": ck.notes,
        },
        "bits": bits,
        // Rank files of a sliced checkpoint each hold part of every tensor, so the
        // page lists those holding none of one; the data leaves them out.
        "sliced": ck.kind == Kind::Sliced,
        "files": ck.files.iter().map(|f| f.path().display().to_string()).collect::<Vec<_>>(),
        "holders": (0..ck.files.len()).map(|i| ck.label(i)).collect::<Vec<_>>(),
        "short": (0..ck.files.len()).map(|i| match ck.ranks[i] {
            Some(r) => format!("r{r}"),
            None => holder_label(ck, i).rsplit('/').next().unwrap_or_default().to_string(),
        }).collect::<Vec<_>>(),
        "tensors": tensors,
    })
}

/// The report page of `ck` (with the `problems` its verification found), titled
/// `title` (the path inspected).
///
/// # Errors
/// JSON encoding errors, as [`Error::Unsupported`] (not expected: all keys are
/// strings).
pub fn html_report(ck: &Checkpoint, problems: &[Error], title: &str) -> Result<String> {
    page(&data(ck, problems, title), title)
}

/// The page around `data`.
fn page(data: &Value, title: &str) -> Result<String> {
    let json = serde_json::to_string(data).map_err(|e| Error::Unsupported {
        problem: format!("report data: {e}"),
    })?;
    // `</` would end the script element early (a tensor named `</script>`); `<\/` is
    // the same string to JSON.
    let json = json.replace("</", "<\\/");
    let title = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    // Split first, so that neither the title nor the data can be taken for the
    // other's place.
    let (head, tail) = PAGE.split_once("__DATA__").unwrap_or((PAGE, ""));
    Ok(format!(
        "{}{json}{tail}",
        head.replacen("__TITLE__", &title, 1)
    ))
}

/// A target tensor's dtype and pieces: (output file, box in the global tensor).
type TargetPieces<'a> = (
    crate::layout::Dtype,
    Vec<(usize, &'a crate::layout::region::Region)>,
);

/// The page of a reshard plan: per tensor, the target pieces over the target files
/// (filled) with the source pieces they are cut from (dashed outlines, holders after
/// the targets), and the reads of each output file with the totals.
///
/// # Errors
/// JSON encoding errors, as [`Error::Unsupported`].
pub fn plan_html_report(
    source: &Checkpoint,
    plan: &CopyPlan,
    mesh: &str,
    title: &str,
) -> Result<String> {
    let report = PlanReport::new(source, plan);
    let nt = plan.files.len();
    // Target pieces by tensor name: (target file, box).
    let mut targets: BTreeMap<&str, TargetPieces> = BTreeMap::new();
    for (k, f) in plan.files.iter().enumerate() {
        for t in &f.tensors {
            let e = targets
                .entry(t.target.name.as_str())
                .or_insert((t.target.dtype, Vec::new()));
            e.1.extend(t.target.pieces.iter().map(|p| (k, &p.global)));
        }
    }
    let mut dtypes: BTreeMap<String, u64> = BTreeMap::new();
    let mut bits: BTreeMap<String, usize> = BTreeMap::new();
    let mut tensors = Vec::with_capacity(targets.len());
    for (name, (dtype, pieces)) in &targets {
        let d = dtype_name(*dtype);
        *dtypes.entry(d.clone()).or_default() += 1;
        bits.insert(d.clone(), dtype.bitsize());
        let src = source.tensors.get(*name);
        // The global shape: the source's, or (a renamed tensor) the target pieces' extent.
        let shape: Vec<u64> = match src {
            Some(t) => t.shape.clone(),
            None => (0..pieces.first().map_or(0, |p| p.1.ndim()))
                .map(|dim| pieces.iter().map(|p| p.1.end(dim)).max().unwrap_or(0))
                .collect(),
        };
        let mut holdings: Vec<Value> = pieces
            .iter()
            .map(|(k, r)| json!([k, r.start, r.shape, 0]))
            .collect();
        if let Some(t) = src {
            holdings.extend(
                t.pieces
                    .iter()
                    .map(|p| json!([nt + p.file, p.global.start, p.global.shape, 2])),
            );
        }
        tensors.push(json!([
            name,
            d,
            shape,
            bytes_of(*dtype, shape.iter().product()),
            "",
            holdings
        ]));
    }
    let short = |p: &Path| {
        p.parent().and_then(|d| d.file_name()).map_or_else(
            || p.display().to_string(),
            |d| d.to_string_lossy().into_owned(),
        )
    };
    let data = json!({
        "summary": {
            "path": title,
            "format": "reshard plan (nothing written)",
            "kind": format!("{} source file(s) -> {nt} output file(s) on mesh {mesh}", source.files.len()),
            "dtypes": dtypes,
            "bytes": report.bytes_written,
            "ranks": null,
            "strategy": format!("target mesh {mesh}"),
            "problems": [],
            "notes": source.notes,
        },
        "bits": bits,
        "sliced": false,
        "files": plan.files.iter().map(|f| f.path.display().to_string()).collect::<Vec<_>>(),
        "holders": plan.files.iter().map(|f| format!("output {}", f.path.display()))
            .chain((0..source.files.len()).map(|i| format!("source {}", source.label(i)))).collect::<Vec<_>>(),
        "short": plan.files.iter().map(|f| short(&f.path))
            .chain((0..source.files.len()).map(|i| match source.ranks[i] {
                Some(r) => format!("src r{r}"),
                None => short(source.files[i].path()),
            })).collect::<Vec<_>>(),
        "plan": report.to_json(source),
        "tensors": tensors,
    });
    page(&data, title)
}

/// Writes the report of `ck` to `dest` (temporary name, sync, rename: a reader never
/// sees half a report).
///
/// # Errors
/// I/O errors, with the path.
pub fn write_html_report(
    ck: &Checkpoint,
    problems: &[Error],
    title: &str,
    dest: &Path,
) -> Result<u64> {
    let page = html_report(ck, problems, title)?;
    crate::formats::output::write_file_atomic(dest, page.as_bytes())?;
    Ok(page.len() as u64)
}

/// Writes the page of a reshard plan (see [`plan_html_report`]) to `dest`, through a
/// temporary name; returns its size.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_plan_html(
    source: &Checkpoint,
    plan: &CopyPlan,
    mesh: &str,
    title: &str,
    dest: &Path,
) -> Result<u64> {
    let page = plan_html_report(source, plan, mesh, title)?;
    crate::formats::output::write_file_atomic(dest, page.as_bytes())?;
    Ok(page.len() as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn page_has_one_place_for_data_and_title() {
        assert_eq!(super::PAGE.matches("__DATA__").count(), 1);
        assert_eq!(super::PAGE.matches("__TITLE__").count(), 1);
        // Self-contained: nothing is fetched.
        for fetch in ["src=", "href=", "@import", "url(", "fetch("] {
            assert!(!super::PAGE.contains(fetch), "{fetch}");
        }
    }
}

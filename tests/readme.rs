//! The README's format table against what the binary accepts, so the table cannot go
//! stale: every output format `ckpt merge --format` and `ckpt reshard --format` accept
//! is in the table's "write with" column as `merge --format X` / `reshard --format X`,
//! every such cell names a format the command accepts, and every `--format X` anywhere
//! in the README is accepted by one of the two. (The README's shell commands themselves
//! are run by scripts/readme_examples.sh; its Python blocks by
//! python/tests/test_readme.py.)

use crate::util::Dir;
use std::collections::BTreeSet;

const README: &str = include_str!("../README.md");

/// The columns of the format table, in order.
const COLUMNS: [&str; 7] = [
    "format",
    "what ckpt reads",
    "write with",
    "merge",
    "reshard",
    "optimizer state",
    "refused",
];

/// The cells of a Markdown table row (`| a | b |`), trimmed. Pipes inside backticks
/// do not occur in the table.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

/// The header and rows of the first table under `## Formats`.
fn format_table() -> (Vec<String>, Vec<Vec<String>>) {
    let mut lines = README
        .lines()
        .skip_while(|l| l.trim() != "## Formats")
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .skip_while(|l| !l.starts_with('|'));
    let header = cells(lines.next().expect("README: no table under `## Formats`"));
    let rule = lines.next().expect("README: the format table has no rows");
    assert!(rule.starts_with("|---"), "README: not a table rule: {rule}");
    let rows = lines
        .take_while(|l| l.starts_with('|'))
        .map(cells)
        .collect();
    (header, rows)
}

/// The `X` of every `PREFIX X` in `text`, X a format name (letters, digits, `-`, `_`).
fn values_after(text: &str, prefix: &str) -> BTreeSet<String> {
    text.match_indices(prefix)
        .map(|(i, _)| {
            text[i + prefix.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect::<String>()
        })
        .filter(|v| !v.is_empty())
        .collect()
}

/// The values `ckpt COMMAND --format` accepts, from clap's refusal of one it does not
/// (`[possible values: a, b, c]`; hidden aliases are not listed, names are).
fn accepted(d: &Dir, command: &str) -> BTreeSet<String> {
    let mut args = vec![command, "--format", "not-a-format", "in", "-o", "out"];
    if command == "reshard" {
        args.extend(["--to", "2"]);
    }
    let o = d.ckpt(&args);
    assert_ne!(o.code, 0, "ckpt {command} accepted --format not-a-format");
    let start = o
        .stderr
        .find("[possible values: ")
        .unwrap_or_else(|| panic!("ckpt {command}: no possible values in:\n{}", o.stderr))
        + "[possible values: ".len();
    let end = start + o.stderr[start..].find(']').expect("closing ]");
    o.stderr[start..end]
        .split(',')
        .map(|v| v.trim().to_string())
        .collect()
}

#[test]
fn the_readme_format_table_matches_the_formats_the_binary_writes() {
    let d = Dir::new();
    let (header, rows) = format_table();
    assert_eq!(header, COLUMNS, "README: the format table's columns");
    assert!(rows.len() >= 10, "README: only {} format rows", rows.len());
    for row in &rows {
        assert_eq!(
            row.len(),
            COLUMNS.len(),
            "README: format table row with {} cells: {row:?}",
            row.len()
        );
        for (c, name) in [(3, "merge"), (4, "reshard")] {
            assert!(
                !row[c].is_empty(),
                "README: format `{}` says nothing under {name}",
                row[0]
            );
        }
    }
    let write: String = rows
        .iter()
        .map(|r| r[2].as_str())
        .collect::<Vec<_>>()
        .join("\n");
    for command in ["merge", "reshard"] {
        let binary = accepted(&d, command);
        let table = values_after(&write, &format!("{command} --format "));
        assert_eq!(
            table, binary,
            "README: the format table's `{command} --format` values (left) are not the ones `ckpt {command}` accepts (right)"
        );
    }
    // Every `--format X` in the README (recipes, prose) is a value of merge or reshard.
    let any: BTreeSet<String> = accepted(&d, "merge")
        .union(&accepted(&d, "reshard"))
        .cloned()
        .collect();
    for v in values_after(README, "--format ") {
        assert!(
            any.contains(&v),
            "README: `--format {v}` is accepted by neither merge nor reshard ({any:?})"
        );
    }
}

#[test]
fn the_readme_names_each_format_row_once() {
    let (_, rows) = format_table();
    let mut seen = BTreeSet::new();
    for r in &rows {
        assert!(
            seen.insert(r[0].clone()),
            "README: format `{}` listed twice",
            r[0]
        );
    }
}

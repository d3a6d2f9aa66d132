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

/// The values of `--format` in clap's words: `[possible values: a, b, c]` (an error,
/// or short help) or, where the values have help texts, the `Possible values:` list of
/// `--help` (`  - a: ...`). Hidden aliases are not listed; names are.
fn possible_values(text: &str) -> Option<BTreeSet<String>> {
    if let Some(i) = text.find("[possible values: ") {
        let start = i + "[possible values: ".len();
        let end = start + text[start..].find(']')?;
        return Some(
            text[start..end]
                .split(',')
                .map(|v| v.trim().to_string())
                .collect(),
        );
    }
    let i = text.find("Possible values:")?;
    let values: BTreeSet<String> = text[i..]
        .lines()
        .skip(1)
        .map(str::trim)
        .take_while(|l| l.starts_with("- "))
        .map(|l| {
            l[2..]
                .split(|c: char| c == ':' || c.is_whitespace())
                .next()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    (!values.is_empty()).then_some(values)
}

/// The values `ckpt COMMAND --format` accepts: from clap's refusal of one it does not,
/// else from `ckpt COMMAND --help`'s `--format` entry.
fn accepted(d: &Dir, command: &str) -> BTreeSet<String> {
    let mut args = vec![command, "--format", "not-a-format", "in", "-o", "out"];
    if command == "reshard" {
        args.extend(["--to", "2"]);
    }
    let o = d.ckpt(&args);
    assert_ne!(o.code, 0, "ckpt {command} accepted --format not-a-format");
    if let Some(v) = possible_values(&o.stderr) {
        return v;
    }
    let help = d.ckpt(&[command, "--help"]).stdout;
    let entry = help
        .find("--format")
        .map(|i| &help[i..])
        .unwrap_or_else(|| panic!("ckpt {command} --help has no --format:\n{help}"));
    let next = entry[1..].find("\n  -").map_or(entry.len(), |j| j + 1);
    possible_values(&entry[..next]).unwrap_or_else(|| {
        panic!(
            "ckpt {command}: no possible values of --format in its error:\n{}\nnor in its help:\n{entry}",
            o.stderr
        )
    })
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

#[test]
fn possible_values_are_read_in_both_of_clap_s_forms() {
    let short =
        "error: invalid value 'x' for '--format <FORMAT>'\n  [possible values: a, b-c, d_e]\n";
    let long = "      --format <FORMAT>\n          Output.\n\n          Possible values:\n          - a:   one\n          - b-c: two\n          - d_e\n\n      --one-file\n";
    let want: BTreeSet<String> = ["a", "b-c", "d_e"].map(String::from).into();
    assert_eq!(possible_values(short), Some(want.clone()));
    assert_eq!(possible_values(long), Some(want));
    assert_eq!(possible_values("no values here"), None);
}

//! List options, one rule for all (`--include`, `--exclude`, `--shard`): one value per
//! occurrence, repeated for more (`--include A --include B`), never the words that follow
//! it (they are the inputs); a value may also be a comma-separated list (`--include
//! A,B`), split at the commas that are not inside a glob's `{a,b}` or `[...]`. Paths
//! (`--source-strategy`) are never split. The old spellings with several values after
//! one flag are kept where that is not ambiguous ([`old_spellings`]).

use std::ffi::OsString;
use std::path::Path;

/// The values of one occurrence of a list option (several where it was a
/// comma-separated list).
#[derive(Clone, Debug)]
pub(crate) struct List<T>(pub(crate) Vec<T>);

/// Every value of a list option, in the order given.
pub(crate) fn flat<T: Clone>(lists: &[List<T>]) -> Vec<T> {
    lists.iter().flat_map(|l| l.0.iter().cloned()).collect()
}

/// Splits a list option's value at its commas outside `{...}` and `[...]`.
pub(crate) fn split_list(s: &str) -> std::result::Result<Vec<String>, String> {
    let (mut parts, mut cur, mut depth, mut class) = (Vec::new(), String::new(), 0u32, false);
    for c in s.chars() {
        match c {
            '[' if !class => class = true,
            ']' if class => class = false,
            '{' if !class => depth += 1,
            '}' if !class => depth = depth.saturating_sub(1),
            ',' if !class && depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    parts.push(cur);
    if parts.iter().any(String::is_empty) {
        return Err(format!("`{s}`: an empty value in the list"));
    }
    Ok(parts)
}

/// Checks glob patterns at parse time (a bad one is a usage error).
pub(crate) fn parse_globs(s: &str) -> std::result::Result<List<String>, String> {
    let globs = split_list(s)?;
    for g in &globs {
        ckpt_core::layout::select::Selection::new(std::slice::from_ref(g), &[], None)
            .map_err(|e| e.to_string())?;
    }
    Ok(List(globs))
}

/// Checks `--shard NAME_GLOB=DIM[,NAME_GLOB=DIM...]` at parse time.
pub(crate) fn parse_shards(s: &str) -> std::result::Result<List<(String, usize)>, String> {
    let mut rules = Vec::new();
    for rule in split_list(s)? {
        let (glob, dim) = rule
            .rsplit_once('=')
            .ok_or_else(|| format!("`{rule}`: expected NAME_GLOB=DIM"))?;
        let dim = dim
            .parse()
            .map_err(|_| format!("`{rule}`: DIM `{dim}` is not a dimension number"))?;
        ckpt_core::layout::select::Selection::new(&[glob.to_string()], &[], None)
            .map_err(|e| e.to_string())?;
        rules.push((glob.to_string(), dim));
    }
    Ok(List(rules))
}

/// The old spellings of list options that took several values after one flag, kept
/// where they are not ambiguous: `--shard A=0 B=1` (rules look like `NAME_GLOB=DIM`)
/// and `--predict 3 5` (image numbers and ranges) read as `--shard A=0 --shard B=1`
/// and `--predict 3 --predict 5`. A word that is an existing path stays an input.
pub(crate) fn old_spellings(args: Vec<OsString>) -> Vec<OsString> {
    fn is_shard_rule(w: &str) -> bool {
        w.rsplit_once('=').is_some_and(|(g, d)| {
            !g.is_empty() && !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())
        })
    }
    fn is_image_list(w: &str) -> bool {
        w.split(',').all(|p| {
            let ends: Vec<&str> = p.split("..").collect();
            ends.len() <= 2
                && ends
                    .iter()
                    .all(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()))
        })
    }
    type Flag = (&'static str, fn(&str) -> bool);
    const FLAGS: [Flag; 2] = [("--shard", is_shard_rule), ("--predict", is_image_list)];
    let mut out = Vec::with_capacity(args.len());
    // A list flag whose value is the next word; one whose value was given, and whose
    // further words are taken as more values while they look like its values.
    let (mut pending, mut open): (Option<Flag>, Option<Flag>) = (None, None);
    let mut rest = false;
    for a in args {
        let word = a.to_str().unwrap_or("").to_string();
        if rest || word == "--" {
            rest = true;
            out.push(a);
            continue;
        }
        if let Some(f) = pending.take() {
            out.push(a);
            open = Some(f);
            continue;
        }
        if let Some((flag, looks)) = open {
            if !word.starts_with('-') && looks(&word) && !Path::new(&word).exists() {
                out.push(OsString::from(flag));
                out.push(a);
                continue;
            }
        }
        open = None;
        for f in FLAGS {
            if word == f.0 {
                pending = Some(f);
            } else if word.starts_with(&format!("{}=", f.0)) {
                open = Some(f);
            }
        }
        out.push(a);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn lists_split_at_commas_outside_globs() {
        assert_eq!(split_list("[,]x,{a,b},c").unwrap(), ["[,]x", "{a,b}", "c"]);
        assert_eq!(split_list("a.*").unwrap(), ["a.*"]);
        assert!(split_list("a,,b").is_err());
        assert!(split_list("a,").is_err());
        assert_eq!(
            parse_shards("a=0,{b,c}=1").unwrap().0,
            [("a".to_string(), 0), ("{b,c}".to_string(), 1)]
        );
        assert!(parse_shards("a").is_err());
        assert!(parse_globs("[a").is_err());
        assert_eq!(flat(&[List(vec![1, 2]), List(vec![3])]), [1, 2, 3]);
    }

    #[test]
    fn old_spellings_are_kept_where_unambiguous() {
        let got = old_spellings(words(&[
            "ckpt", "reshard", "--shard", "a=0", "b.*=1", "in", "-o", "o", "--to", "2",
        ]));
        assert_eq!(
            got,
            words(&[
                "ckpt", "reshard", "--shard", "a=0", "--shard", "b.*=1", "in", "-o", "o", "--to",
                "2"
            ])
        );
        let got = old_spellings(words(&["ckpt", "reshard", "--shard=a=0", "b=1", "in"]));
        assert_eq!(
            got,
            words(&["ckpt", "reshard", "--shard=a=0", "--shard", "b=1", "in"])
        );
        let got = old_spellings(words(&["ckpt", "infer", "--predict", "3", "0..5", "ck"]));
        assert_eq!(
            got,
            words(&["ckpt", "infer", "--predict", "3", "--predict", "0..5", "ck"])
        );
        // Options, paths and words after `--` are left alone; so are other options'.
        let same = words(&["ckpt", "infer", "ck", "--predict", "3", "--json", "--", "4"]);
        assert_eq!(old_spellings(same.clone()), same);
        let same = words(&["ckpt", "merge", "--include", "a=0", "b=1"]);
        assert_eq!(old_spellings(same.clone()), same);
        let here = std::env::current_dir().unwrap();
        let dir = here.display().to_string();
        let same = words(&["ckpt", "infer", "--predict", "3", &dir]);
        assert_eq!(old_spellings(same.clone()), same);
    }
}

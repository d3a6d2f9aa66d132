//! Split rules: how a parameter lies over the tensor-parallel ranks, for checkpoints
//! whose files do not say (Megatron legacy, DeepSpeed with `mp_rank` > 0).
//!
//! A rule matches a tensor's global name and gives its split: along one dimension
//! (optionally per sub-parameter block, a fused `[gate; up]`), or replicated. Rules are
//! tried in order and the first match wins. They come from two places:
//!
//! - the user: the `rules` section of a strategy file given with `--source-strategy`
//!   (docs/strategy.md, "Split rules"), patterns in glob syntax (as `--include`),
//!   matched against the whole name;
//! - DeepSpeed's `universal_checkpoint_info` (Megatron-DeepSpeed writes it into the
//!   model states), patterns as Python's `re.match` uses them: anchored at the start
//!   only, as deepspeed/checkpoint/ds_to_universal.py matches them.
//!
//! ```json
//! {"rules": [
//!   {"match": "decoder.layers.*.mlp.linear_fc1.weight", "split": 0, "blocks": 2},
//!   {"match": "decoder.layers.*.mlp.down.weight", "split": 1},
//!   {"match": "*.norm.weight", "replicated": true}
//! ]}
//! ```

use crate::error::{Error, Result};
use globset::{Glob, GlobMatcher};
use regex::Regex;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// How one parameter lies over the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// Every TP rank holds the whole tensor (norms, row-parallel biases).
    Replicated,
    /// Split along `dim` into TP pieces; with `blocks` > 1 each of that many equal
    /// blocks is split (fc1 of a gated MLP: `[gate; up]` per rank).
    Dim { dim: usize, blocks: u64 },
}

/// The largest dimension index a rule may name (no tensor has more dimensions).
const MAX_DIM: u64 = 64;

/// What tells a user how to place a tensor no rule places (for refusals).
pub(crate) const HOW_TO_ADD: &str = "give a rule in a strategy file, e.g. {\"rules\": [{\"match\": \"<name glob>\", \"split\": <dim>}]} or {\"match\": ..., \"replicated\": true}, with --source-strategy FILE (docs/strategy.md, \"Split rules\")";

#[derive(Clone, Debug)]
enum Matcher {
    Glob(GlobMatcher),
    /// A Python `re.match` pattern: anchored at the start only.
    Regex(Regex),
}

#[derive(Clone, Debug)]
struct Rule {
    pattern: String,
    matcher: Matcher,
    split: Split,
}

/// An ordered list of split rules (the first that matches a name wins), and where
/// they came from (for messages).
#[derive(Clone, Debug, Default)]
pub struct SplitRules {
    rules: Vec<Rule>,
    source: Option<PathBuf>,
}

/// Whether `bytes` are a strategy file with a `rules` section (a JSON object holding
/// `rules`): how `--source-strategy` tells it from a MindSpore strategy file.
#[must_use]
pub fn is_split_rules(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Value>(bytes)
        .ok()
        .and_then(|v| v.as_object().map(|o| o.contains_key("rules")))
        .unwrap_or(false)
}

impl SplitRules {
    /// Reads the `rules` section of a strategy file (other sections are ignored).
    ///
    /// # Errors
    /// [`Error::InvalidSplitRules`] naming the file and the rule at fault: not JSON,
    /// no `rules` list, a rule without `match`, a bad glob, neither or both of `split`
    /// and `replicated`, a dimension or block count that is not a small non-negative
    /// integer, an unknown key.
    pub fn read(path: &Path) -> Result<SplitRules> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::InvalidSplitRules {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
        SplitRules::parse(&text, path)
    }

    /// [`SplitRules::read`] of text already read; `path` is for messages.
    ///
    /// # Errors
    /// As [`SplitRules::read`].
    pub fn parse(text: &str, path: &Path) -> Result<SplitRules> {
        let bad = |problem: String| Error::InvalidSplitRules {
            path: path.to_path_buf(),
            problem,
        };
        let doc: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let list = doc
            .get("rules")
            .ok_or_else(|| bad("no `rules` section".into()))?
            .as_array()
            .ok_or_else(|| bad("`rules` is not a list of rules".into()))?;
        let mut rules = Vec::with_capacity(list.len());
        for (i, r) in list.iter().enumerate() {
            let obj = r
                .as_object()
                .ok_or_else(|| bad(format!("rule {i} is not an object")))?;
            let pattern = obj
                .get("match")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .ok_or_else(|| bad(format!("rule {i} has no `match` pattern (a name glob)")))?;
            let at = |problem: &str| bad(format!("rule {i} (`{pattern}`): {problem}"));
            if let Some(k) = obj
                .keys()
                .find(|k| !matches!(k.as_str(), "match" | "split" | "blocks" | "replicated"))
            {
                return Err(at(&format!(
                    "unknown key `{k}` (a rule has `match` and `split` [+ `blocks`] or `replicated`)"
                )));
            }
            let glob = Glob::new(pattern).map_err(|e| at(&format!("bad glob: {}", e.kind())))?;
            let small = |key: &str, min: u64| -> Result<Option<u64>> {
                match obj.get(key) {
                    None => Ok(None),
                    Some(v) => v
                        .as_u64()
                        .filter(|n| (min..MAX_DIM).contains(n))
                        .map(Some)
                        .ok_or_else(|| {
                            at(&format!(
                                "`{key}` is {v}, not an integer in {min}..{MAX_DIM}"
                            ))
                        }),
                }
            };
            let split = match (small("split", 0)?, obj.get("replicated")) {
                (Some(dim), None) => Split::Dim {
                    dim: dim as usize,
                    blocks: small("blocks", 1)?.unwrap_or(1),
                },
                (None, Some(Value::Bool(true))) => {
                    if obj.contains_key("blocks") {
                        return Err(at("`blocks` goes with `split`, not `replicated`"));
                    }
                    Split::Replicated
                }
                (None, Some(v)) => return Err(at(&format!("`replicated` is {v}, not true"))),
                (None, None) => return Err(at("neither `split` nor `replicated`")),
                (Some(_), Some(_)) => return Err(at("both `split` and `replicated`")),
            };
            rules.push(Rule {
                pattern: pattern.to_string(),
                matcher: Matcher::Glob(glob.compile_matcher()),
                split,
            });
        }
        Ok(SplitRules {
            rules,
            source: Some(path.to_path_buf()),
        })
    }

    /// Adds a rule whose pattern is a Python `re.match` regular expression (DeepSpeed's
    /// `universal_checkpoint_info`), after the others.
    ///
    /// # Errors
    /// A pattern the `regex` crate cannot compile (the message names it).
    pub(crate) fn push_regex(
        &mut self,
        pattern: &str,
        split: Split,
    ) -> std::result::Result<(), String> {
        // re.match anchors at the start only: `(?:p)` after `^`, no `$`.
        let re = Regex::new(&format!("^(?:{pattern})")).map_err(|e| {
            format!("pattern `{pattern}` is not a regular expression ckpt reads: {e}")
        })?;
        self.rules.push(Rule {
            pattern: pattern.to_string(),
            matcher: Matcher::Regex(re),
            split,
        });
        Ok(())
    }

    /// The first rule matching `name`: its split and its pattern.
    pub(crate) fn find(&self, name: &str) -> Option<(Split, &str)> {
        self.rules.iter().find_map(|r| {
            let hit = match &r.matcher {
                Matcher::Glob(g) => g.is_match(name),
                Matcher::Regex(re) => re.is_match(name),
            };
            hit.then_some((r.split, r.pattern.as_str()))
        })
    }

    /// Whether there are no rules.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The file the rules were read from, if any.
    #[must_use]
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// How a message names a rule: its pattern and file.
    pub(crate) fn describe(&self, pattern: &str) -> String {
        match &self.source {
            Some(p) => format!("rule `{pattern}` of {}", p.display()),
            None => format!("rule `{pattern}`"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SplitRules> {
        SplitRules::parse(text, Path::new("rules.json"))
    }

    #[test]
    fn first_matching_rule_wins() {
        let r = parse(
            r#"{"mesh": {}, "rules": [
                {"match": "layers.*.fc1.weight", "split": 0, "blocks": 2},
                {"match": "layers.*.weight", "split": 1},
                {"match": "*.norm", "replicated": true}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.find("layers.3.fc1.weight"),
            Some((Split::Dim { dim: 0, blocks: 2 }, "layers.*.fc1.weight"))
        );
        assert_eq!(
            r.find("layers.3.fc2.weight").map(|x| x.0),
            Some(Split::Dim { dim: 1, blocks: 1 })
        );
        assert_eq!(r.find("a.norm").map(|x| x.0), Some(Split::Replicated));
        assert_eq!(r.find("a.norm.bias"), None);
    }

    #[test]
    fn malformed_rules_are_refused_by_index_and_pattern() {
        let cases = [
            (r#"{"tensors": {}}"#, "no `rules` section"),
            (r#"{"rules": {"a": 1}}"#, "not a list"),
            (r#"{"rules": [{"split": 0}]}"#, "rule 0 has no `match`"),
            (r#"{"rules": [{"match": "a"}]}"#, "rule 0 (`a`): neither"),
            (
                r#"{"rules": [{"match": "a", "split": 0, "replicated": true}]}"#,
                "both",
            ),
            (
                r#"{"rules": [{"match": "a", "split": -1}]}"#,
                "`split` is -1",
            ),
            (
                r#"{"rules": [{"match": "a", "split": 0, "blocks": 0}]}"#,
                "`blocks` is 0",
            ),
            (
                r#"{"rules": [{"match": "a", "replicated": false}]}"#,
                "not true",
            ),
            (
                r#"{"rules": [{"match": "a", "split": 0}, {"match": "b", "dim": 0}]}"#,
                "rule 1 (`b`): unknown key `dim`",
            ),
            (r#"{"rules": [{"match": "a[", "split": 0}]}"#, "bad glob"),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
            assert!(e.starts_with("rules.json: split rules:"), "{e}");
        }
    }

    #[test]
    fn regex_rules_match_like_python_re_match() {
        let mut r = SplitRules::default();
        r.push_regex(r"row\.weight", Split::Dim { dim: 1, blocks: 1 })
            .unwrap();
        r.push_regex(r".*norm", Split::Replicated).unwrap();
        // Anchored at the start, not at the end.
        assert!(r.find("row.weight.extra").is_some());
        assert!(r.find("xrow.weight").is_none());
        assert_eq!(
            r.find("a.norm.weight").map(|x| x.0),
            Some(Split::Replicated)
        );
        assert!(r.push_regex("(", Split::Replicated).is_err());
    }

    #[test]
    fn rules_files_are_told_from_other_strategy_files() {
        assert!(is_split_rules(br#"{"rules": []}"#));
        assert!(!is_split_rules(br#"{"format": "ckpt-strategy"}"#));
        assert!(!is_split_rules(b"\x0a\x03abc"));
    }
}

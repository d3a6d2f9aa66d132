//! `Selection`: which tensors a tool keeps (`--include`/`--exclude` glob patterns) and
//! the dtype it writes them in (`--dtype`).

use crate::error::{Error, Result};
use crate::layout::plan::check_cast;
use crate::layout::split_rules::SplitRules;
use crate::layout::Dtype;
use globset::{Glob, GlobSet, GlobSetBuilder};

/// Tensor selection and casting, shared by merge and reshard.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    include: Option<GlobSet>,
    exclude: Option<GlobSet>,
    /// The patterns as given (`--include`, then `--exclude`), for messages.
    patterns: Vec<(&'static str, String, Glob)>,
    cast: Option<Dtype>,
    /// Tensors `cast` leaves as they are: computed in a dtype of their own (FP8
    /// weights quantized on the way and their F32 scales).
    uncast: std::collections::BTreeSet<String>,
    strip_prefix: Option<String>,
    add_prefix: Option<String>,
    step: Option<u64>,
    views: Views,
    /// The user's split rules (`--source-strategy` with a `rules` section).
    rules: SplitRules,
}

/// How a reader gives tensors it stores fused or padded. Megatron's is the reader
/// with such tensors today: fused QKV projections, and a vocabulary padded for the
/// tensor-parallel size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Views {
    /// Split fused QKV projections into their query, key and value parts.
    pub split_qkv: bool,
    /// Drop the rows that pad the vocabulary, where the checkpoint records its size.
    pub unpad_vocab: bool,
    /// A Megatron dist_ckpt's stacked layer tensors (`decoder.layers.<param>`,
    /// `[layers, ...]`) as one tensor a layer (`decoder.layers.<l>.<param>`), as the
    /// legacy format names them.
    pub per_layer: bool,
    /// The model's tensors are all the output takes (`--format hf`): state a reader
    /// cannot place without a record the checkpoint lacks (a distributed optimizer's
    /// buckets without Megatron-LM's args) is left out, said, instead of refused.
    pub model_only: bool,
}

fn glob(p: &str) -> Result<Glob> {
    Glob::new(p).map_err(|e| Error::Unsupported {
        problem: format!("bad pattern `{p}`: {}", e.kind()),
    })
}

fn globs(patterns: &[String]) -> Result<Option<GlobSet>> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        b.add(glob(p)?);
    }
    b.build().map(Some).map_err(|e| Error::Unsupported {
        problem: e.to_string(),
    })
}

impl Selection {
    /// Keeps names matching any `include` (all when empty) and no `exclude`; casts
    /// floating-point tensors to `cast` when given.
    ///
    /// # Errors
    /// A malformed pattern.
    pub fn new(include: &[String], exclude: &[String], cast: Option<Dtype>) -> Result<Selection> {
        let patterns = [("--include", include), ("--exclude", exclude)]
            .into_iter()
            .flat_map(|(flag, ps)| ps.iter().map(move |p| (flag, p)))
            .map(|(flag, p)| Ok((flag, p.clone(), glob(p)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Selection {
            include: globs(include)?,
            exclude: globs(exclude)?,
            patterns,
            cast,
            uncast: Default::default(),
            strip_prefix: None,
            add_prefix: None,
            step: None,
            views: Views::default(),
            rules: SplitRules::default(),
        })
    }

    /// Renames tensors on the way in: removes `strip` from the start of each name that
    /// has it (`module.`, DDP's wrapper), then puts `add` in front of every name. The
    /// `--include`/`--exclude` patterns match the new names.
    #[must_use]
    pub fn with_prefixes(mut self, strip: Option<String>, add: Option<String>) -> Selection {
        self.strip_prefix = strip.filter(|s| !s.is_empty());
        self.add_prefix = add.filter(|s| !s.is_empty());
        self
    }

    /// Places the tensors of checkpoints whose files do not say how they are split
    /// (Megatron legacy, tensor-parallel DeepSpeed) by `rules` first (before
    /// megatron-core's table, before DeepSpeed's `universal_checkpoint_info`).
    #[must_use]
    pub fn with_rules(mut self, rules: SplitRules) -> Selection {
        self.rules = rules;
        self
    }

    /// The user's split rules (empty unless given).
    #[must_use]
    pub fn rules(&self) -> &SplitRules {
        &self.rules
    }

    /// Takes the checkpoint of training step `step` where the inputs hold several: a
    /// training output's `step_<step>/` (DeepSpeed's `global_step<step>/`) instead of
    /// `latest`, Megatron's `iter_<step>/` instead of its tracker's, MindSpore's
    /// `<prefix>-<epoch>_<step>.ckpt` in each rank directory instead of the newest.
    #[must_use]
    pub fn with_step(mut self, step: Option<u64>) -> Selection {
        self.step = step;
        self
    }

    /// Gives fused or padded tensors as `views` says (where the reader has them).
    #[must_use]
    pub fn with_views(mut self, views: Views) -> Selection {
        self.views = views;
        self
    }

    /// The views [`Selection::with_views`] asked for.
    #[must_use]
    pub fn views(&self) -> Views {
        self.views
    }

    /// The step [`Selection::with_step`] asked for.
    #[must_use]
    pub fn step(&self) -> Option<u64> {
        self.step
    }

    /// Whether this keeps every tensor as it is (no pattern, cast, rename or step).
    #[must_use]
    pub fn is_everything(&self) -> bool {
        self.include.is_none()
            && self.exclude.is_none()
            && self.cast.is_none()
            && !self.renames()
            && self.step.is_none()
            && self.views == Views::default()
    }

    /// Whether [`Selection::rename`] changes names at all.
    #[must_use]
    pub fn renames(&self) -> bool {
        self.strip_prefix.is_some() || self.add_prefix.is_some()
    }

    /// A tensor's name after `--strip-prefix` and `--add-prefix`.
    #[must_use]
    pub fn rename(&self, name: &str) -> String {
        let base = match &self.strip_prefix {
            Some(p) => name.strip_prefix(p.as_str()).unwrap_or(name),
            None => name,
        };
        match &self.add_prefix {
            Some(p) => format!("{p}{base}"),
            None => base.to_string(),
        }
    }

    /// Checks the selection against the tensors of an input: a selection that keeps none
    /// of them is an error (an empty output is never what was meant); a pattern that
    /// matches no tensor gives a warning, returned.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the input has tensors and none is kept.
    pub fn review<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str> + Clone,
    ) -> Result<Vec<String>> {
        let total = names.clone().into_iter().count();
        let kept = names.clone().into_iter().filter(|n| self.keeps(n)).count();
        if total > 0 && kept == 0 {
            let given: Vec<String> = self
                .patterns
                .iter()
                .map(|(flag, p, _)| format!("{flag} '{p}'"))
                .collect();
            let some: Vec<&str> = names.clone().into_iter().take(3).collect();
            return Err(Error::Unsupported {
                problem: format!(
                    "{} leave none of the input's {total} tensors (they are named like `{}`): nothing to write",
                    given.join(" "),
                    some.join("`, `")
                ),
            });
        }
        let mut warnings = Vec::new();
        for (flag, p, g) in &self.patterns {
            let m = g.compile_matcher();
            if !names.clone().into_iter().any(|n| m.is_match(n)) {
                warnings.push(format!("{flag} '{p}' matches no tensor of the input"));
            }
        }
        Ok(warnings)
    }

    /// This selection with the tensors `names` left out of the cast (they are written
    /// in the dtype the checkpoint gives them).
    #[must_use]
    pub fn without_cast_of(mut self, names: impl IntoIterator<Item = String>) -> Selection {
        self.uncast.extend(names);
        self
    }

    /// This selection casting to `to` when it names no cast of its own (a source that
    /// says what dtype its model takes: a GGUF read as Hugging Face's model).
    #[must_use]
    pub fn or_cast(mut self, to: Dtype) -> Selection {
        self.cast.get_or_insert(to);
        self
    }

    /// The floating-point type `--dtype` casts to, if any.
    #[must_use]
    pub fn cast(&self) -> Option<Dtype> {
        self.cast
    }

    /// Whether the tensor `name` is kept.
    #[must_use]
    pub fn keeps(&self, name: &str) -> bool {
        self.include.as_ref().is_none_or(|g| g.is_match(name))
            && !self.exclude.as_ref().is_some_and(|g| g.is_match(name))
    }

    /// The output dtype of a kept tensor. A cast to a floating-point type converts the
    /// floating-point tensors and keeps integer and boolean ones as they are (`--dtype
    /// bf16` of fp32 master weights beside an integer `step` is the usual export).
    ///
    /// # Errors
    /// A cast that cannot convert (to an integer type, or of 8-bit floats).
    pub fn dtype(&self, name: &str, dtype: Dtype) -> Result<Dtype> {
        match self.cast {
            None => Ok(dtype),
            Some(_) if self.uncast.contains(name) => Ok(dtype),
            Some(to) if keeps_integers(dtype, to) => Ok(dtype),
            Some(to) => check_cast(name, dtype, to).map(|()| to),
        }
    }
}

/// Whether a cast to `to` leaves a `from` tensor as it is: integers and booleans under a
/// cast to a floating-point type.
fn keeps_integers(from: Dtype, to: Dtype) -> bool {
    use Dtype::*;
    let int = matches!(from, BOOL | U8 | I8 | I16 | U16 | I32 | U32 | I64 | U64);
    int && matches!(to, F16 | BF16 | F32 | F64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn include_exclude_and_cast() {
        let s = Selection::new(&[], &["optim.*".into()], Some(Dtype::BF16)).unwrap();
        assert!(s.keeps("layer.w"));
        assert!(!s.keeps("optim.layer.w.exp_avg"));
        assert_eq!(s.dtype("w", Dtype::F32).unwrap(), Dtype::BF16);
        assert_eq!(
            s.review(["layer.w", "optim.layer.w.exp_avg"]).unwrap(),
            Vec::<String>::new()
        );
        let w = s.review(["layer.w"]).unwrap();
        assert_eq!(w, ["--exclude 'optim.*' matches no tensor of the input"]);
        let e = s.review(["optim.a", "optim.b"]).unwrap_err().to_string();
        assert_eq!(
            e,
            "--exclude 'optim.*' leave none of the input's 2 tensors (they are named like `optim.a`, `optim.b`): nothing to write"
        );
        // Integers and booleans stay as they are under a cast to a float type...
        assert_eq!(s.dtype("step", Dtype::I64).unwrap(), Dtype::I64);
        assert_eq!(s.dtype("mask", Dtype::BOOL).unwrap(), Dtype::BOOL);
        // ... while a cast to an integer type, or of 8-bit floats, is refused.
        let to_int = Selection::new(&[], &[], Some(Dtype::I32)).unwrap();
        assert!(to_int
            .dtype("w", Dtype::F32)
            .unwrap_err()
            .to_string()
            .contains("cannot cast F32 to I32"));
        assert!(s
            .dtype("w8", Dtype::F8_E4M3)
            .unwrap_err()
            .to_string()
            .contains("cannot cast F8_E4M3 to BF16"));
    }
}

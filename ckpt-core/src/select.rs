//! `Selection`: which tensors a tool keeps (`--include`/`--exclude` glob patterns) and
//! the dtype it writes them in (`--dtype`).

use crate::error::{Error, Result};
use crate::plan::check_cast;
use crate::Dtype;
use globset::{Glob, GlobSet, GlobSetBuilder};

/// Tensor selection and casting, shared by merge and reshard.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    include: Option<GlobSet>,
    exclude: Option<GlobSet>,
    cast: Option<Dtype>,
}

fn globs(patterns: &[String]) -> Result<Option<GlobSet>> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        b.add(Glob::new(p).map_err(|e| Error::Unsupported {
            problem: format!("bad pattern `{p}`: {e}"),
        })?);
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
        Ok(Selection {
            include: globs(include)?,
            exclude: globs(exclude)?,
            cast,
        })
    }

    /// Whether the tensor `name` is kept.
    #[must_use]
    pub fn keeps(&self, name: &str) -> bool {
        self.include.as_ref().is_none_or(|g| g.is_match(name))
            && !self.exclude.as_ref().is_some_and(|g| g.is_match(name))
    }

    /// The output dtype of a kept tensor.
    ///
    /// # Errors
    /// A cast of a non-float tensor.
    pub fn dtype(&self, name: &str, dtype: Dtype) -> Result<Dtype> {
        match self.cast {
            None => Ok(dtype),
            Some(to) => check_cast(name, dtype, to).map(|()| to),
        }
    }
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
        assert!(s
            .dtype("step", Dtype::I64)
            .unwrap_err()
            .to_string()
            .contains("cannot cast I64 to BF16"));
    }
}

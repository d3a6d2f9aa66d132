//! `Mesh`: named device axes; rank `r` maps to its coordinate in row-major order.

use crate::error::{Error, Result};
use std::fmt;

/// One named axis of a device mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Axis {
    /// Axis name, e.g. `dp` or `tp`.
    pub name: String,
    /// Number of devices along the axis (at least 1).
    pub size: u64,
}

/// A device mesh: named axes with sizes, ranks in row-major order (last axis fastest),
/// the rule of MindSpore's dev_matrix and PyTorch's DeviceMesh.
///
/// ```
/// use ckpt_core::layout::mesh::Mesh;
/// let mesh = Mesh::parse("dp=2,tp=4").unwrap();
/// assert_eq!(mesh.world_size(), 8);
/// assert_eq!(mesh.coords(6), vec![1, 2]);
/// assert_eq!(mesh.rank_of(&[1, 2]), 6);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    axes: Vec<Axis>,
    /// Index of the pipeline axis, if any: tensors of stage `s` live only where it is `s`.
    pipeline: Option<usize>,
}

impl Mesh {
    /// A mesh from `(name, size)` pairs, outermost first.
    ///
    /// # Errors
    /// Duplicate or empty names, sizes of zero, or a world size that overflows.
    pub fn new(axes: Vec<(String, u64)>) -> Result<Mesh> {
        let text = axes
            .iter()
            .map(|(n, s)| format!("{n}={s}"))
            .collect::<Vec<_>>()
            .join(",");
        let bad = |problem: String| Error::InvalidMesh {
            mesh: text.clone(),
            problem,
        };
        let mut world: u64 = 1;
        for (i, (name, size)) in axes.iter().enumerate() {
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(bad(format!(
                    "axis name `{name}` must be non-empty letters, digits or _"
                )));
            }
            if axes[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(format!("axis `{name}` appears twice")));
            }
            if *size == 0 {
                return Err(bad(format!("axis `{name}` has size 0")));
            }
            world = world
                .checked_mul(*size)
                .ok_or_else(|| bad("world size overflows".into()))?;
        }
        Ok(Mesh {
            axes: axes
                .into_iter()
                .map(|(name, size)| Axis { name, size })
                .collect(),
            pipeline: None,
        })
    }

    /// Parses `dp=2,tp=4` (a bare number `N` means one axis `dp=N`).
    ///
    /// # Errors
    /// Malformed text or an invalid mesh.
    pub fn parse(text: &str) -> Result<Mesh> {
        let bad = |problem: &str| Error::InvalidMesh {
            mesh: text.to_string(),
            problem: problem.to_string(),
        };
        if let Ok(n) = text.trim().parse::<u64>() {
            return Mesh::new(vec![("dp".into(), n)]);
        }
        let mut axes = Vec::new();
        for part in text.split(',') {
            let (name, size) = part
                .split_once('=')
                .ok_or_else(|| bad("expected name=size,name=size"))?;
            let size = size
                .trim()
                .parse::<u64>()
                .map_err(|_| bad("axis sizes must be whole numbers"))?;
            axes.push((name.trim().to_string(), size));
        }
        Mesh::new(axes)
    }

    /// The same mesh with `name` declared the pipeline axis.
    ///
    /// # Errors
    /// No axis of that name.
    pub fn with_pipeline(mut self, name: &str) -> Result<Mesh> {
        let i = self.axis_index(name).ok_or_else(|| Error::InvalidMesh {
            mesh: self.to_string(),
            problem: format!("pipeline axis `{name}` is not a mesh axis"),
        })?;
        self.pipeline = Some(i);
        Ok(self)
    }

    /// The axes, outermost first.
    #[must_use]
    pub fn axes(&self) -> &[Axis] {
        &self.axes
    }

    /// Index of the pipeline axis.
    #[must_use]
    pub fn pipeline(&self) -> Option<usize> {
        self.pipeline
    }

    /// Position of the axis called `name`.
    #[must_use]
    pub fn axis_index(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|a| a.name == name)
    }

    /// Number of ranks.
    #[must_use]
    pub fn world_size(&self) -> u64 {
        self.axes.iter().map(|a| a.size).product()
    }

    /// Coordinate of `rank` on every axis (last axis fastest).
    #[must_use]
    pub fn coords(&self, rank: u64) -> Vec<u64> {
        self.coords_iter(rank).collect()
    }

    /// [`Mesh::coords`] without a vector: what the per-tensor layout arithmetic uses.
    pub(crate) fn coords_iter(&self, rank: u64) -> impl Iterator<Item = u64> + '_ {
        // The stride of axis d is the product of the sizes after it.
        let n = self.axes.len();
        (0..n).map(move |d| {
            let stride: u64 = self.axes[d + 1..].iter().map(|a| a.size).product();
            (rank / stride) % self.axes[d].size
        })
    }

    /// The ranks that differ from `rank` only on axis `axis`, in axis order: the group
    /// a collective over that axis runs in.
    ///
    /// ```
    /// use ckpt_core::layout::mesh::Mesh;
    /// let mesh = Mesh::parse("dp=2,tp=3").unwrap();
    /// assert_eq!(mesh.axis_group(4, 1), vec![3, 4, 5]);
    /// assert_eq!(mesh.axis_group(4, 0), vec![1, 4]);
    /// ```
    #[must_use]
    pub fn axis_group(&self, rank: u64, axis: usize) -> Vec<u64> {
        let mut c = self.coords(rank);
        (0..self.axes[axis].size)
            .map(|k| {
                c[axis] = k;
                self.rank_of(&c)
            })
            .collect()
    }

    /// The rank at a coordinate.
    #[must_use]
    pub fn rank_of(&self, coords: &[u64]) -> u64 {
        self.axes
            .iter()
            .zip(coords)
            .fold(0, |r, (a, &c)| r * a.size + c)
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}={}", a.name, a.size)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_errors_name_the_problem() {
        assert!(Mesh::parse("dp=2,dp=2")
            .unwrap_err()
            .to_string()
            .contains("appears twice"));
        assert!(Mesh::parse("dp=0")
            .unwrap_err()
            .to_string()
            .contains("size 0"));
        assert!(Mesh::parse("dp").is_err());
        assert_eq!(Mesh::parse("4").unwrap().to_string(), "dp=4");
    }

    #[test]
    fn coords_round_trip() {
        let m = Mesh::parse("pp=2,dp=3,tp=2").unwrap();
        for r in 0..m.world_size() {
            assert_eq!(m.rank_of(&m.coords(r)), r);
        }
        assert_eq!(m.coords(7), vec![1, 0, 1]);
    }
}

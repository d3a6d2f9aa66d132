//! The coverage check: every element of every tensor held by exactly one owner piece
//! (identical pieces kept as copies).

use super::{flat_names, Checkpoint};
use crate::error::Error;
use crate::layout::coverage::{check_tiling, Defect};
use crate::layout::region::Region;
use crate::layout::source::SourcePiece;
use std::collections::BTreeMap;

impl Checkpoint {
    /// Dedupes identical pieces (keeping the first as owner), then checks that the
    /// owners tile every tensor.
    pub(super) fn assemble(
        &mut self,
        raw: BTreeMap<String, Vec<SourcePiece>>,
        problems: &mut Vec<Error>,
    ) {
        for (name, mut pieces) in raw {
            let Some(t) = self.tensors.get_mut(&name) else {
                continue;
            };
            pieces.sort_by(|a, b| (&a.global, a.file).cmp(&(&b.global, b.file)));
            let mut owners: Vec<SourcePiece> = Vec::with_capacity(pieces.len());
            for p in pieces {
                match owners.last() {
                    Some(o) if o.global == p.global => {
                        let k = owners.len() - 1;
                        t.copies.push((k, p));
                    }
                    _ => owners.push(p),
                }
            }
            let full = Region::full(&t.shape);
            let mut ok = true;
            for p in &owners {
                if !full.contains(&p.global) {
                    problems.push(Error::InvalidTensor {
                        tensor: name.clone(),
                        problem: format!(
                            "{} holds {} outside the shape {:?}",
                            self.files[p.file].path().display(),
                            p.global,
                            t.shape
                        ),
                    });
                    ok = false;
                }
            }
            if ok {
                let boxes: Vec<Region> = owners.iter().map(|p| p.global.clone()).collect();
                match check_tiling(&t.shape, &boxes) {
                    Ok(()) => {}
                    // Pieces reported as flat ranges (ZeRO) are named by those ranges.
                    Err(Defect::Gap { region }) => {
                        let numel = full.numel();
                        problems.push(Error::CoverageGap {
                            tensor: name.clone(),
                            region: flat_names::flat_gap(&self.files, &owners, numel)
                                .unwrap_or_else(|| region.to_string()),
                        });
                    }
                    Err(Defect::Overlap { a, b, region }) => problems.push(Error::Overlap {
                        tensor: name.clone(),
                        a: flat_names::piece_name(&self.files, &owners[a]),
                        b: flat_names::piece_name(&self.files, &owners[b]),
                        region: region.to_string(),
                    }),
                }
            }
            t.pieces = owners;
        }
    }
}

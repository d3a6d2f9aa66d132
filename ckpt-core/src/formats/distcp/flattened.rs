//! Megatron's N-D flattened tensors in DCP: what megatron-core 0.8 to 0.15 store for a
//! `ShardedTensor` with a `flattened_range` (the distributed optimizer's
//! `fully_sharded_model_space` states, `optimizer.state.<state>.<model key>`: each data
//! parallel rank's slice of its tensor-parallel chunk of the parameter, flattened).
//!
//! megatron/core/dist_checkpointing/strategies/torch.py (`sharded_tensor_to_torch_sharded_tensor`,
//! core_v0.15.3) stores such a tensor of global shape `[X, Y, Z]` cut into local chunks
//! `[x, y, z]` (`axis_fragmentations` `[X/x, Y/y, Z/z]`; prepended axes such as stacked
//! layers have chunk extent 1) as a DCP tensor of the *reformulated* global shape
//! `[X/x, Y/y, Z/z, x*y*z]` (resharding.py `nd_flattened_tensor_reformulated_global_shape`),
//! each piece a chunk `[1, 1, 1, len]` at `[i, j, k, start]`: elements `start..start+len`
//! of chunk `(i, j, k)` flattened. The original global shape is kept in the metadata:
//! `Metadata.mcore_data[key]['nd_reformulated_orig_global_shape']` (an attribute set on
//! torch's `Metadata` up to 0.14, a field of `MCoreMetadata` in 0.15).
//!
//! [`resolve`] (given the shapes `mcore_data` records, which the DCP reader parses) turns
//! such tensors back into what they are: the real global shape, each
//! stored chunk a flat range inside a box of it (read as the boxes [`FlatRange::boxes`]
//! cuts it into), the ranges of each chunk checked to tile it exactly. A metadata without
//! `mcore_data` says nothing: then an `optimizer.state.<state>.<key>` tensor is taken as
//! flattened when its shape is the reformulation of the model tensor `<key>`'s, and
//! refused when it could be one and no model tensor says which.

use crate::error::{overflow, Error, Result};
use crate::formats::TensorEntry;
use crate::layout::flat::{check_flat_cover, flat_of_box, numel, FlatRange};
use crate::layout::region::Region;
use std::collections::BTreeMap;

/// The distributed optimizer's prefix of its state tensors.
const OPTIMIZER_STATE: &str = "optimizer.state.";

/// Where a stored chunk of a flattened tensor lies in the real tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FlatPiece {
    /// The local chunk, a box of the real global tensor.
    pub(crate) chunk: Region,
    /// The elements of the chunk (flattened) the stored piece holds.
    pub(crate) range: FlatRange,
}

impl FlatPiece {
    /// The entries of the stored piece `stored` (its archive's data: the range's
    /// elements in order), one per box [`FlatRange::boxes`] cuts the range into inside
    /// the chunk, each placed in the real tensor of `shape`; with the flat range of the
    /// tensor the piece is, when its chunk is one contiguous run of the tensor (a chunk
    /// of whole trailing axes), for pictures and messages.
    pub(crate) fn entries(
        &self,
        stored: TensorEntry,
        shape: &[u64],
    ) -> Result<Vec<(TensorEntry, Option<FlatRange>)>> {
        let elem = (stored.dtype.bitsize() / 8) as u64;
        let of_tensor = flat_of_box(&self.chunk, shape)
            .map(|c| FlatRange::new(c.start + self.range.start, self.range.len));
        let mut out = Vec::new();
        for b in self.range.boxes(&self.chunk.shape)? {
            let first = b
                .offset
                .checked_mul(elem)
                .and_then(|x| x.checked_add(stored.start))
                .ok_or_else(|| overflow(format!("tensor `{}`: piece offset", stored.name)))?;
            let len = b
                .region
                .numel()
                .checked_mul(elem)
                .ok_or_else(|| overflow(format!("tensor `{}`: piece length", stored.name)))?;
            let region = b.region.offset(&self.chunk.start);
            out.push((
                TensorEntry {
                    name: stored.name.clone(),
                    dtype: stored.dtype,
                    shape: region.shape.into_vec(),
                    start: first,
                    end: first + len,
                    offsets: Some(region.start.into_vec()),
                },
                of_tensor,
            ));
        }
        Ok(out)
    }
}

fn bad(tensor: &str, problem: String) -> Error {
    Error::InvalidTensor {
        tensor: tensor.to_string(),
        problem,
    }
}

/// The model tensor an optimizer state belongs to: `optimizer.state.<state>.<key>` gives
/// `<key>`.
fn model_key(name: &str) -> Option<&str> {
    name.strip_prefix(OPTIMIZER_STATE)?
        .split_once('.')
        .map(|(_, key)| key)
}

/// The chunk shape when `stored` is the reformulation of `orig`: `stored` is `orig`'s
/// axis fragmentations followed by the chunk's element count, each fragmentation
/// dividing its axis. `Err` says why not.
fn chunk_shape(stored: &[u64], orig: &[u64]) -> std::result::Result<Vec<u64>, String> {
    let Some((&chunk_numel, fragments)) = stored.split_last() else {
        return Err("it is a scalar".into());
    };
    if fragments.len() != orig.len() {
        return Err(format!(
            "{} axes are not the {} of {orig:?} and one for the chunk's elements",
            stored.len(),
            orig.len() + 1
        ));
    }
    let mut chunk = Vec::with_capacity(orig.len());
    for (d, (&g, &f)) in orig.iter().zip(fragments).enumerate() {
        if f == 0 || g % f != 0 {
            return Err(format!("axis {d} of {g} is not cut into {f} equal chunks"));
        }
        chunk.push(g / f);
    }
    let n = numel(&chunk).map_err(|e| e.to_string())?;
    if n != chunk_numel {
        return Err(format!(
            "chunks of {chunk:?} hold {n} elements, not {chunk_numel}"
        ));
    }
    Ok(chunk)
}

/// A chunk as DCP stores it: the tensor's name, offsets and sizes in the stored shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stored<'a> {
    pub(crate) name: &'a str,
    pub(crate) offsets: &'a [u64],
    pub(crate) sizes: &'a [u64],
}

/// The flattened tensors of a DCP checkpoint, resolved.
#[derive(Debug, Default)]
pub(crate) struct Resolved {
    /// The real global shape of each flattened tensor.
    pub(crate) shapes: BTreeMap<String, Vec<u64>>,
    /// Per stored chunk (in the order given), its place when its tensor is flattened.
    pub(crate) pieces: Vec<Option<FlatPiece>>,
}

/// Finds the flattened tensors among `shapes` (every tensor's stored shape) and places
/// their `chunks`. Flattened: what `recorded` (`mcore_data`'s original shapes) names,
/// or, when the metadata has no `mcore_data` (`None`), an optimizer state whose shape is
/// the reformulation of its model tensor's.
///
/// # Errors
/// A recorded shape the stored one is not a reformulation of, a model tensor of another
/// shape, a stored chunk that is not `[1, .., 1, len]` inside its chunk, ranges that do
/// not tile a chunk exactly once; without `mcore_data`, an optimizer state that could be
/// flattened but has no model tensor to say so.
pub(crate) fn resolve(
    recorded: Option<&BTreeMap<String, Vec<u64>>>,
    shapes: &BTreeMap<String, Vec<u64>>,
    chunks: &[Stored<'_>],
) -> Result<Resolved> {
    // Tensor -> (real shape, chunk shape).
    let mut flat: BTreeMap<String, (Vec<u64>, Vec<u64>)> = BTreeMap::new();
    match recorded {
        Some(recorded) => {
            for (name, orig) in recorded {
                let stored = shapes.get(name).ok_or_else(|| {
                    bad(
                        name,
                        "mcore_data records its original shape but the metadata holds no such tensor"
                            .into(),
                    )
                })?;
                let chunk = chunk_shape(stored, orig).map_err(|why| {
                    bad(
                        name,
                        format!(
                            "mcore_data records it flattened from {orig:?}, but its stored shape {stored:?} is not that shape's reformulation (axis fragmentations, then the chunk's elements): {why}"
                        ),
                    )
                })?;
                if let Some(key) = model_key(name) {
                    if let Some(m) = shapes.get(key).filter(|m| *m != orig) {
                        return Err(bad(
                            name,
                            format!(
                                "mcore_data records it flattened from {orig:?}, but its model tensor `{key}` is {m:?}"
                            ),
                        ));
                    }
                }
                flat.insert(name.clone(), (orig.clone(), chunk));
            }
        }
        None => {
            for (name, stored) in shapes {
                let Some(key) = model_key(name) else {
                    continue;
                };
                match shapes.get(key) {
                    Some(m) if m == stored => {}
                    Some(m) => {
                        if let Ok(chunk) = chunk_shape(stored, m) {
                            flat.insert(name.clone(), (m.clone(), chunk));
                        }
                    }
                    None if could_be_flattened(name, stored, chunks) => {
                        return Err(bad(
                            name,
                            format!(
                                "its {stored:?} pieces are [1, .., 1, n]: Megatron's flattened optimizer state (megatron-core 0.8 to 0.15, fully_sharded_model_space) or a tensor of that shape; the metadata has no mcore_data and the checkpoint no model tensor `{key}`, so which is not ckpt's to guess: pass the checkpoint with its model tensors or its original .metadata"
                            ),
                        ));
                    }
                    None => {}
                }
            }
        }
    }
    let pieces = place_chunks(&flat, chunks)?;
    Ok(Resolved {
        shapes: flat.into_iter().map(|(n, (orig, _))| (n, orig)).collect(),
        pieces,
    })
}

/// Whether every stored chunk of tensor `name` (of stored shape `shape`) is `[1, .., 1,
/// n]` with at least two axes: what a reformulated flattened tensor stores.
fn could_be_flattened(name: &str, shape: &[u64], chunks: &[Stored<'_>]) -> bool {
    shape.len() >= 2
        && chunks
            .iter()
            .filter(|c| c.name == name)
            .all(|c| c.sizes[..c.sizes.len() - 1].iter().all(|&s| s == 1))
}

/// The place of each chunk of a flattened tensor; checks that each chunk's ranges tile
/// it.
fn place_chunks(
    flat: &BTreeMap<String, (Vec<u64>, Vec<u64>)>,
    chunks: &[Stored<'_>],
) -> Result<Vec<Option<FlatPiece>>> {
    let mut pieces = Vec::with_capacity(chunks.len());
    for c in chunks {
        let Some((orig, chunk)) = flat.get(c.name) else {
            pieces.push(None);
            continue;
        };
        let n = chunk.len();
        if c.offsets.len() != n + 1
            || c.sizes.len() != n + 1
            || c.sizes[..n].iter().any(|&s| s != 1)
        {
            return Err(bad(
                c.name,
                format!(
                    "a flattened tensor's stored chunk at {:?} is {:?}, not [1, .., 1, n]",
                    c.offsets, c.sizes
                ),
            ));
        }
        let start = c.offsets[..n]
            .iter()
            .zip(chunk)
            .map(|(&i, &x)| i.checked_mul(x))
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| overflow(format!("tensor `{}`: chunk offset", c.name)))?;
        if start
            .iter()
            .zip(chunk)
            .zip(orig)
            .any(|((&s, &x), &g)| s.checked_add(x).is_none_or(|e| e > g))
        {
            return Err(bad(
                c.name,
                format!(
                    "a flattened tensor's stored chunk at {:?} lies past its chunks (of {chunk:?}) of {orig:?}",
                    c.offsets
                ),
            ));
        }
        pieces.push(Some(FlatPiece {
            chunk: Region::new(start, chunk.clone()),
            range: FlatRange::new(c.offsets[n], c.sizes[n]),
        }));
    }
    // (tensor, chunk start) -> the ranges stored of that chunk.
    let mut ranges: BTreeMap<(&str, &[u64]), Vec<FlatRange>> = BTreeMap::new();
    for (c, p) in chunks.iter().zip(&pieces) {
        if let Some(p) = p {
            ranges
                .entry((c.name, p.chunk.start.as_slice()))
                .or_default()
                .push(p.range);
        }
    }
    for ((name, start), rs) in &ranges {
        let chunk = &flat[*name].1;
        let n = numel(chunk)?;
        check_flat_cover(n, rs).map_err(|defect| {
            bad(
                name,
                format!(
                    "the flattened ranges stored of its chunk {} do not tile its {n} elements: {defect}",
                    Region::new(start.to_vec(), chunk.clone())
                ),
            )
        })?;
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATE: &str = "optimizer.state.exp_avg.w";

    /// A test checkpoint: shapes by name, and the stored chunks (offsets, sizes).
    type Fixture = (BTreeMap<String, Vec<u64>>, Vec<(Vec<u64>, Vec<u64>)>);

    /// `w` is [2, 4, 6] (2 stacked layers), cut in 2 along axis 1: chunks [1, 2, 6] of
    /// 12 elements, stored as [2, 2, 1, 12]; layer 1's chunk 0 in the ranges given.
    fn checkpoint(ranges_of_1_0: &[(u64, u64)]) -> Fixture {
        let shapes = BTreeMap::from([
            ("w".to_string(), vec![2, 4, 6]),
            (STATE.to_string(), vec![2, 2, 1, 12]),
        ]);
        let mut chunks = vec![
            (vec![0, 0, 0, 0], vec![1, 1, 1, 12]),
            (vec![0, 1, 0, 0], vec![1, 1, 1, 12]),
            (vec![1, 1, 0, 0], vec![1, 1, 1, 12]),
        ];
        for &(s, l) in ranges_of_1_0 {
            chunks.push((vec![1, 0, 0, s], vec![1, 1, 1, l]));
        }
        (shapes, chunks)
    }

    fn run(
        recorded: Option<&[u64]>,
        shapes: &BTreeMap<String, Vec<u64>>,
        chunks: &[(Vec<u64>, Vec<u64>)],
    ) -> Result<Resolved> {
        let recorded = recorded.map(|s| BTreeMap::from([(STATE.to_string(), s.to_vec())]));
        let stored: Vec<Stored<'_>> = chunks
            .iter()
            .map(|(o, s)| Stored {
                name: STATE,
                offsets: o,
                sizes: s,
            })
            .collect();
        resolve(recorded.as_ref(), shapes, &stored)
    }

    #[test]
    fn recorded_flattened_tensors_get_their_real_shape_and_places() {
        let (shapes, chunks) = checkpoint(&[(0, 5), (5, 7)]);
        let r = run(Some(&[2, 4, 6]), &shapes, &chunks).unwrap();
        assert_eq!(
            r.shapes,
            BTreeMap::from([(STATE.to_string(), vec![2, 4, 6])])
        );
        assert_eq!(
            r.pieces[4],
            Some(FlatPiece {
                chunk: Region::from_ranges(&[1..2, 0..2, 0..6]),
                range: FlatRange::new(5, 7),
            })
        );
        assert_eq!(
            r.pieces[1].as_ref().unwrap().chunk,
            Region::from_ranges(&[0..1, 2..4, 0..6])
        );
    }

    #[test]
    fn pieces_are_the_boxes_of_their_range_in_the_real_tensor() {
        let p = FlatPiece {
            chunk: Region::from_ranges(&[1..2, 0..2, 0..6]),
            range: FlatRange::new(5, 7),
        };
        let stored = TensorEntry {
            name: STATE.into(),
            dtype: crate::layout::Dtype::F32,
            shape: vec![1, 1, 1, 7],
            start: 1000,
            end: 1028,
            offsets: Some(vec![1, 0, 0, 5]),
        };
        let e = p.entries(stored, &[2, 4, 6]).unwrap();
        let got: Vec<_> = e
            .iter()
            .map(|(t, f)| {
                (
                    t.offsets.clone().unwrap(),
                    t.shape.clone(),
                    t.start,
                    t.end,
                    *f,
                )
            })
            .collect();
        // Elements 5..12 of the chunk: the last of row 0, all of row 1; the chunk (layer
        // 1, rows 0..2) is elements 24..36 of the tensor.
        let whole = Some(FlatRange::new(29, 7));
        assert_eq!(
            got,
            vec![
                (vec![1, 0, 5], vec![1, 1, 1], 1000, 1004, whole),
                (vec![1, 1, 0], vec![1, 1, 6], 1004, 1028, whole),
            ]
        );
    }

    #[test]
    fn without_mcore_data_the_model_tensor_says_it() {
        let (shapes, chunks) = checkpoint(&[(0, 5), (5, 7)]);
        let r = run(None, &shapes, &chunks).unwrap();
        assert_eq!(r.shapes[STATE], vec![2, 4, 6]);
        assert!(r.pieces.iter().all(Option::is_some));
    }

    #[test]
    fn without_mcore_data_or_model_tensor_it_is_refused_by_name() {
        let (mut shapes, chunks) = checkpoint(&[(0, 5), (5, 7)]);
        shapes.remove("w");
        let e = run(None, &shapes, &chunks).unwrap_err().to_string();
        assert!(
            e.contains(STATE) && e.contains("no model tensor `w`"),
            "{e}"
        );
    }

    #[test]
    fn ranges_that_do_not_tile_a_chunk_are_named() {
        let (shapes, chunks) = checkpoint(&[(0, 5), (6, 6)]);
        let e = run(Some(&[2, 4, 6]), &shapes, &chunks)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(STATE) && e.contains("[1..2, 0..2, 0..6]") && e.contains("flat 5..6"),
            "{e}"
        );
        let (shapes, chunks) = checkpoint(&[(0, 6), (5, 7)]);
        let e = run(Some(&[2, 4, 6]), &shapes, &chunks)
            .unwrap_err()
            .to_string();
        assert!(e.contains("both hold elements flat 5..6"), "{e}");
    }

    #[test]
    fn a_recorded_shape_that_does_not_fit_is_named() {
        let (shapes, chunks) = checkpoint(&[(0, 12)]);
        let e = run(Some(&[2, 4, 5]), &shapes, &chunks)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not that shape's reformulation"), "{e}");
        // A model tensor of another shape than the recorded one.
        let (mut shapes, chunks) = checkpoint(&[(0, 12)]);
        shapes.insert("w".into(), vec![2, 6, 4]);
        let e = run(Some(&[2, 4, 6]), &shapes, &chunks)
            .unwrap_err()
            .to_string();
        assert!(e.contains("its model tensor `w` is [2, 6, 4]"), "{e}");
    }
}

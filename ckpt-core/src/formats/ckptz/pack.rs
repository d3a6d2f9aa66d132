//! Packing (`.ckptz` version 2): the tensors of one dtype, taken in file order, form
//! one stream, and a stream is cut into chunks of a fixed raw size. A thousand tiny
//! BatchNorm vectors thus share one chunk (and its planes, and one zstd frame per
//! plane) instead of paying a frame each; a large tensor spans many chunks; a read of
//! any byte range decodes only the chunks of its stream that cover it.
//!
//! ```text
//! file order   a: F32 [0, 40)   b: I64 [40, 56)   c: F32 [56, 96)      (chunks of 32 B)
//! streams      F32: a (offset 0), c (offset 40), 80 bytes: chunks [0,32) [32,64) [64,80)
//!              I64: b (offset 0), 16 bytes: chunk [0,16)
//! tensor c     stream F32 bytes [40, 80): its parts are chunk 1 [8,32) and chunk 2 [0,16)
//! ```
//!
//! Version 1 files are described with the same type: one stream per tensor.

use crate::error::{overflow, Result};
use crate::layout::Dtype;
use std::ops::Range;

/// One stream: tensors of one dtype, back to back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stream {
    /// The dtype of its tensors.
    pub(crate) dtype: Dtype,
    /// Raw bytes per chunk (the last one may be shorter).
    pub(crate) chunk_size: u64,
    /// Raw bytes of the stream.
    pub(crate) len: u64,
    /// Its tensors (indices into the file's tensor list), by offset in the stream.
    pub(crate) members: Vec<usize>,
}

impl Stream {
    /// Number of chunks.
    pub(crate) fn chunk_count(&self) -> usize {
        self.len.div_ceil(self.chunk_size) as usize
    }

    /// Raw byte range of chunk `k` in the stream.
    pub(crate) fn chunk_range(&self, k: usize) -> Range<u64> {
        let lo = k as u64 * self.chunk_size;
        lo..(lo + self.chunk_size).min(self.len)
    }
}

/// Where every tensor's bytes are among the streams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Streams {
    /// The streams.
    pub(crate) streams: Vec<Stream>,
    /// Per tensor: its stream and its first byte's offset in it.
    pub(crate) place: Vec<(usize, u64)>,
    /// Per tensor: its raw length.
    pub(crate) lens: Vec<u64>,
}

/// A part of a tensor that lies in one chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Part {
    /// The chunk's number in the stream.
    pub(crate) chunk: usize,
    /// The part's bytes within the chunk.
    pub(crate) in_chunk: Range<u64>,
    /// The part's bytes within the tensor.
    pub(crate) in_tensor: Range<u64>,
}

impl Streams {
    /// Version 2's packing of tensors given in file order as `(dtype, raw length)`: one
    /// stream per dtype, in the order of each dtype's first tensor, chunks of
    /// `chunk_size(dtype)` bytes.
    ///
    /// # Errors
    /// A stream longer than `u64::MAX`.
    pub(crate) fn packed(
        tensors: &[(Dtype, u64)],
        chunk_size: impl Fn(Dtype) -> u64,
    ) -> Result<Streams> {
        let mut streams: Vec<Stream> = Vec::new();
        let mut place = Vec::with_capacity(tensors.len());
        for (i, &(dtype, len)) in tensors.iter().enumerate() {
            let s = match streams.iter().position(|s| s.dtype == dtype) {
                Some(s) => s,
                None => {
                    streams.push(Stream {
                        dtype,
                        chunk_size: chunk_size(dtype),
                        len: 0,
                        members: Vec::new(),
                    });
                    streams.len() - 1
                }
            };
            let st = &mut streams[s];
            place.push((s, st.len));
            st.len = st
                .len
                .checked_add(len)
                .ok_or_else(|| overflow("length of a packed stream"))?;
            st.members.push(i);
        }
        Ok(Streams {
            streams,
            place,
            lens: tensors.iter().map(|t| t.1).collect(),
        })
    }

    /// Puts the streams in the order `dtypes` lists them (a header's order), when that is
    /// a permutation of theirs; `false` (and nothing changed) otherwise. Tensors that
    /// hold no bytes share their offset with the next tensor, so "each dtype's first
    /// tensor in file order" does not decide the order when such a tensor comes first:
    /// the writer's order, recorded in the header, does.
    pub(crate) fn follow(&mut self, dtypes: &[Dtype]) -> bool {
        if dtypes.len() != self.streams.len() {
            return false;
        }
        let mut new_of_old = vec![usize::MAX; self.streams.len()];
        for (new, d) in dtypes.iter().enumerate() {
            match self.streams.iter().position(|s| s.dtype == *d) {
                Some(old) if new_of_old[old] == usize::MAX => new_of_old[old] = new,
                _ => return false,
            }
        }
        let mut streams: Vec<(usize, Stream)> = std::mem::take(&mut self.streams)
            .into_iter()
            .enumerate()
            .map(|(old, st)| (new_of_old[old], st))
            .collect();
        streams.sort_by_key(|(new, _)| *new);
        self.streams = streams.into_iter().map(|(_, st)| st).collect();
        for p in &mut self.place {
            p.0 = new_of_old[p.0];
        }
        true
    }

    /// Version 1's layout: every tensor its own stream, with its own chunk size.
    pub(crate) fn one_per_tensor(tensors: &[(Dtype, u64, u64)]) -> Streams {
        Streams {
            streams: tensors
                .iter()
                .enumerate()
                .map(|(i, &(dtype, len, chunk_size))| Stream {
                    dtype,
                    chunk_size,
                    len,
                    members: vec![i],
                })
                .collect(),
            place: (0..tensors.len()).map(|i| (i, 0)).collect(),
            lens: tensors.iter().map(|t| t.1).collect(),
        }
    }

    /// The stream of tensor `t` and the stream range of its bytes `range`.
    pub(crate) fn locate(&self, t: usize, range: Range<u64>) -> (usize, Range<u64>) {
        let (s, o) = self.place[t];
        (s, o + range.start..o + range.end)
    }

    /// The parts of tensor `t`, chunk by chunk (none for an empty tensor).
    pub(crate) fn parts(&self, t: usize) -> impl Iterator<Item = Part> + '_ {
        let (s, o) = self.place[t];
        let st = &self.streams[s];
        let end = o + self.lens[t];
        let cs = st.chunk_size;
        let ks = if end > o {
            (o / cs) as usize..(((end - 1) / cs) as usize + 1)
        } else {
            0..0
        };
        ks.map(move |k| {
            let c = st.chunk_range(k);
            let (lo, hi) = (o.max(c.start), end.min(c.end));
            Part {
                chunk: k,
                in_chunk: lo - c.start..hi - c.start,
                in_tensor: lo - o..hi - o,
            }
        })
    }

    /// The first chunk of tensor `t` (its parts are numbered from it).
    pub(crate) fn first_chunk(&self, t: usize) -> usize {
        let (s, o) = self.place[t];
        (o / self.streams[s].chunk_size) as usize
    }

    /// The tensors with bytes in chunk `k` of stream `s`: `(tensor, part number within
    /// the tensor, part bytes within the chunk)`.
    pub(crate) fn in_chunk(
        &self,
        s: usize,
        k: usize,
    ) -> impl Iterator<Item = (usize, usize, Range<u64>)> + '_ {
        let st = &self.streams[s];
        let c = st.chunk_range(k);
        // Members are sorted by offset: skip those that end before the chunk.
        let from = st
            .members
            .partition_point(|&t| self.place[t].1 + self.lens[t] <= c.start);
        st.members[from..]
            .iter()
            .take_while(move |&&t| self.place[t].1 < c.end)
            .filter(|&&t| self.lens[t] > 0)
            .map(move |&t| {
                let o = self.place[t].1;
                let (lo, hi) = (o.max(c.start), (o + self.lens[t]).min(c.end));
                (t, k - self.first_chunk(t), lo - c.start..hi - c.start)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worked_example() {
        let s = Streams::packed(
            &[(Dtype::F32, 40), (Dtype::I64, 16), (Dtype::F32, 40)],
            |_| 32,
        )
        .unwrap();
        assert_eq!(s.streams.len(), 2);
        assert_eq!((s.streams[0].len, s.streams[0].chunk_count()), (80, 3));
        assert_eq!(s.streams[0].members, [0, 2]);
        assert_eq!(s.place, [(0, 0), (1, 0), (0, 40)]);
        let parts: Vec<Part> = s.parts(2).collect();
        assert_eq!(
            parts,
            [
                Part {
                    chunk: 1,
                    in_chunk: 8..32,
                    in_tensor: 0..24
                },
                Part {
                    chunk: 2,
                    in_chunk: 0..16,
                    in_tensor: 24..40
                }
            ]
        );
        let in1: Vec<_> = s.in_chunk(0, 1).collect();
        assert_eq!(in1, [(0, 1, 0..8), (2, 0, 8..32)]);
        assert_eq!(s.in_chunk(0, 2).collect::<Vec<_>>(), [(2, 1, 0..16)]);
        assert_eq!(s.locate(2, 5..10), (0, 45..50));
    }

    #[test]
    fn parts_tile_every_tensor_and_every_chunk() {
        // Sizes from 0 to 47 bytes, three dtypes interleaved, chunks of 20 bytes.
        let dts = [Dtype::F32, Dtype::BF16, Dtype::U8];
        let tensors: Vec<(Dtype, u64)> =
            (0..60).map(|i| (dts[i % 3], (i as u64 * 7) % 48)).collect();
        let s = Streams::packed(&tensors, |_| 20).unwrap();
        for (t, &(_, len)) in tensors.iter().enumerate() {
            let mut at = 0;
            for p in s.parts(t) {
                assert_eq!(p.in_tensor.start, at);
                assert_eq!(
                    p.in_tensor.end - p.in_tensor.start,
                    p.in_chunk.end - p.in_chunk.start
                );
                at = p.in_tensor.end;
            }
            assert_eq!(at, len);
        }
        for (si, st) in s.streams.iter().enumerate() {
            for k in 0..st.chunk_count() {
                let mut at = 0;
                for (t, j, r) in s.in_chunk(si, k) {
                    assert_eq!(r.start, at);
                    assert_eq!(s.parts(t).nth(j).unwrap().in_chunk, r);
                    at = r.end;
                }
                let c = st.chunk_range(k);
                assert_eq!(at, c.end - c.start);
            }
        }
    }
}

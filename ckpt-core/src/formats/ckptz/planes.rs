//! Byte planes (`.ckptz` version 2): a chunk of floats is cut into one plane per byte
//! of the element after moving the sign bit to the bottom, so that the top plane is
//! the exponent alone.
//!
//! An F32 is `s eeeeeeee mmm…` (sign, 8 exponent bits, 23 mantissa bits). Grouping its
//! bytes as they are (version 1) puts the sign beside 7 exponent bits and the eighth
//! exponent bit beside 7 mantissa bits: the sign is noise that the exponent byte's
//! entropy coder pays for, and the exponent's last bit is lost in a mantissa byte that
//! no coder can shrink. Rotating each element left by one bit first gives
//! `eeeeeeee mmm… s`: the top byte is the exponent (a few distinct values in a trained
//! layer), the others mantissa and sign (noise). ZipNN separates the exponent the same
//! way. The same rotation serves BF16 (`s e8 m7`: the top byte becomes the exponent),
//! F16 (`s e5 m10`: the exponent and 3 mantissa bits) and F64 (`s e11 m52`).
//!
//! ```text
//! F32 0x3F80_0001 (1.0000001) rotl 1 = 0x7F00_0002: planes [02, 00, 00, 7F]
//! F32 0xBF80_0000 (-1.0)      rotl 1 = 0x7F00_0001: planes [01, 00, 00, 7F]
//! ```

use crate::layout::Dtype;

/// How the raw bytes of a chunk of one dtype become planes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlaneSplit {
    /// Planes per chunk: the element size in bytes for the floats wider than a byte,
    /// 1 (the raw bytes, untransformed) for everything else.
    pub(crate) width: usize,
}

impl PlaneSplit {
    /// The split ckpt uses for `dtype`: rotated planes for F16, BF16, F32 and F64;
    /// integers, bools and 8-bit or smaller floats stay one plane (their bytes are not
    /// of different kinds).
    pub(crate) fn of(dtype: Dtype) -> PlaneSplit {
        let width = match dtype {
            Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64 => dtype.bitsize() / 8,
            _ => 1,
        };
        PlaneSplit { width }
    }

    /// Splits `raw` (whole elements) into `dst` (same length): plane `j` is
    /// `dst[j * n..(j + 1) * n]` for `n` elements, byte `j` (little-endian) of each
    /// element rotated left by one bit.
    pub(crate) fn split(self, raw: &[u8], dst: &mut [u8]) {
        match self.width {
            2 => split_2(raw, dst),
            4 => split_4(raw, dst),
            8 => split_8(raw, dst),
            _ => dst.copy_from_slice(raw),
        }
    }

    /// The inverse of [`PlaneSplit::split`].
    #[cfg(test)]
    pub(crate) fn join(self, planes: &[u8], dst: &mut [u8]) {
        if self.width <= 1 {
            dst.copy_from_slice(planes);
            return;
        }
        let n = planes.len() / self.width;
        let parts: Vec<&[u8]> = (0..self.width)
            .map(|j| &planes[j * n..(j + 1) * n])
            .collect();
        self.join_parts(&parts, dst);
    }

    /// [`PlaneSplit::join`] from planes held apart (plane `j` is `planes[j]`, each
    /// `dst.len() / width` bytes): the reader joins stored planes straight from the
    /// bytes read from the file and coded ones from where they were decoded, with no
    /// copy into one buffer first.
    pub(crate) fn join_parts(self, planes: &[&[u8]], dst: &mut [u8]) {
        match self.width {
            2 => join_2(planes[0], planes[1], dst),
            4 => join_4([planes[0], planes[1], planes[2], planes[3]], dst),
            8 => join_8(planes, dst),
            _ => dst.copy_from_slice(planes[0]),
        }
    }

    /// [`PlaneSplit::join_parts`] and the CRC-32C of the joined bytes in one pass, block
    /// by block, so that each block is hashed while it is still in the L1 cache rather
    /// than read back from memory by a second pass over the chunk.
    pub(crate) fn join_crc(self, planes: &[&[u8]], dst: &mut [u8]) -> u32 {
        // Elements per block: 32 KiB of output, inside every L1 data cache.
        let per = (JOIN_BLOCK / self.width.max(1)).max(1);
        let mut crc = 0;
        let mut block: Vec<&[u8]> = Vec::with_capacity(planes.len());
        for (i, out) in dst.chunks_mut(per * self.width.max(1)).enumerate() {
            let (lo, hi) = (i * per, i * per + out.len() / self.width.max(1));
            block.clear();
            block.extend(planes.iter().map(|p| &p[lo..hi]));
            self.join_parts(&block, out);
            crc = crc32c::crc32c_append(crc, out);
        }
        crc
    }
}

/// Output bytes joined and hashed at a time by [`PlaneSplit::join_crc`].
const JOIN_BLOCK: usize = 32 << 10;

// One pass over zipped iterators per width, as for version 1's grouping: the compiler
// turns the rotation and the byte scatter into shuffles.

fn split_2(src: &[u8], dst: &mut [u8]) {
    let (a, b) = dst.split_at_mut(src.len() / 2);
    for ((e, a), b) in src.as_chunks::<2>().0.iter().zip(a).zip(b) {
        let v = u16::from_le_bytes(*e).rotate_left(1);
        (*a, *b) = (v as u8, (v >> 8) as u8);
    }
}

fn join_2(a: &[u8], b: &[u8], dst: &mut [u8]) {
    for ((e, a), b) in dst.as_chunks_mut::<2>().0.iter_mut().zip(a).zip(b) {
        *e = u16::from_le_bytes([*a, *b]).rotate_right(1).to_le_bytes();
    }
}

fn split_4(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 4;
    let (a, rest) = dst.split_at_mut(n);
    let (b, rest) = rest.split_at_mut(n);
    let (c, d) = rest.split_at_mut(n);
    for ((((e, a), b), c), d) in src.as_chunks::<4>().0.iter().zip(a).zip(b).zip(c).zip(d) {
        let v = u32::from_le_bytes(*e).rotate_left(1);
        (*a, *b, *c, *d) = (v as u8, (v >> 8) as u8, (v >> 16) as u8, (v >> 24) as u8);
    }
}

fn join_4([a, b, c, d]: [&[u8]; 4], dst: &mut [u8]) {
    for ((((e, a), b), c), d) in dst
        .as_chunks_mut::<4>()
        .0
        .iter_mut()
        .zip(a)
        .zip(b)
        .zip(c)
        .zip(d)
    {
        *e = u32::from_le_bytes([*a, *b, *c, *d])
            .rotate_right(1)
            .to_le_bytes();
    }
}

fn split_8(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 8;
    for (i, e) in src.as_chunks::<8>().0.iter().enumerate() {
        let v = u64::from_le_bytes(*e).rotate_left(1).to_le_bytes();
        for (j, b) in v.into_iter().enumerate() {
            dst[j * n + i] = b;
        }
    }
}

fn join_8(planes: &[&[u8]], dst: &mut [u8]) {
    for (i, e) in dst.as_chunks_mut::<8>().0.iter_mut().enumerate() {
        let mut v = [0u8; 8];
        for (b, p) in v.iter_mut().zip(planes) {
            *b = p[i];
        }
        *e = u64::from_le_bytes(v).rotate_right(1).to_le_bytes();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_top_plane_is_the_exponent() {
        let s = PlaneSplit::of(Dtype::F32);
        let raw: Vec<u8> = [1.000_000_1f32, -1.0]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let mut p = vec![0; 8];
        s.split(&raw, &mut p);
        // Planes of 2 elements: low byte (mantissa and sign), .., exponent.
        assert_eq!(p, [0x02, 0x01, 0, 0, 0, 0, 0x7F, 0x7F]);
        let mut back = vec![0; 8];
        s.join(&p, &mut back);
        assert_eq!(back, raw);
        // BF16 -2.0 = 0xC000: rotl 1 = 0x8001, exponent 0x80 on top, sign at the bottom.
        let mut p = vec![0; 2];
        PlaneSplit::of(Dtype::BF16).split(&[0x00, 0xC0], &mut p);
        assert_eq!(p, [0x01, 0x80]);
    }

    #[test]
    fn every_width_round_trips() {
        let raw: Vec<u8> = (0..8 * 1001).map(|i| (i * 37 % 253) as u8).collect();
        for d in [
            Dtype::U8,
            Dtype::F16,
            Dtype::BF16,
            Dtype::F32,
            Dtype::F64,
            Dtype::I64,
        ] {
            let s = PlaneSplit::of(d);
            let mut p = vec![0; raw.len()];
            s.split(&raw, &mut p);
            if s.width > 1 {
                assert_ne!(p, raw, "{d:?}");
            }
            let mut back = vec![0; raw.len()];
            s.join(&p, &mut back);
            assert_eq!(back, raw, "{d:?}");
        }
        assert_eq!(PlaneSplit::of(Dtype::I64).width, 1);
        assert_eq!(PlaneSplit::of(Dtype::F8_E4M3).width, 1);
    }
}

//! The primitives every object is made of: varints, fixed-width integers, and the
//! envelope shared by manifests, version tree nodes and B+tree nodes
//! (`format/codec_util.cc` in tensorstore).
//!
//! ```text
//! magic u32be | length u64le (whole object) | version varint | compression varint
//! | body (raw, or one zstd frame) | CRC-32C u32le over everything before it
//! ```

use std::io::Read;

use crate::error::{ObjectKind, Problem};

/// The envelope without body: magic, length and CRC.
const ENVELOPE: usize = 4 + 8 + 4;

/// How the body of an object is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Raw.
    None,
    /// One zstd frame, at this level (0 = zstd's default; tensorstore's default and
    /// orbax's choice).
    Zstd {
        /// The zstd level, -131072 ..= 22 (zstd's range, checked by tensorstore's reader).
        level: i32,
    },
}

/// A read position in a body, with every read checked against its end.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Cursor<'a> {
        Cursor { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn truncated(&self, field: &'static str) -> Problem {
        Problem::Truncated {
            field,
            at: self.pos as u64,
        }
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, Problem> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.truncated(field))?;
        self.pos += 1;
        Ok(b)
    }

    pub(crate) fn bytes(&mut self, n: u64, field: &'static str) -> Result<&'a [u8], Problem> {
        if n > self.remaining() as u64 {
            return Err(self.truncated(field));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    pub(crate) fn u64le(&mut self, field: &'static str) -> Result<u64, Problem> {
        let b = self.bytes(8, field)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    pub(crate) fn i32le(&mut self, field: &'static str) -> Result<i32, Problem> {
        let b = self.bytes(4, field)?;
        Ok(i32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    /// An unsigned LEB128 varint of at most `bits` bits (riegeli's `ReadVarint64` /
    /// `ReadVarint32`: 10 or 5 bytes at most, and the last byte may not carry bits past
    /// the width).
    fn varint(&mut self, bits: u32, field: &'static str) -> Result<u64, Problem> {
        let start = self.pos;
        let mut value: u64 = 0;
        let mut shift = 0u32;
        loop {
            let b = match self.buf.get(self.pos) {
                Some(&b) => b,
                None => {
                    return Err(Problem::Truncated {
                        field,
                        at: start as u64,
                    })
                }
            };
            self.pos += 1;
            let low = u64::from(b & 0x7f);
            // Bits this byte would put at or past `bits`.
            if shift >= bits || (shift > 0 && bits - shift < 7 && low >> (bits - shift) != 0) {
                return Err(Problem::BadVarint {
                    field,
                    bits,
                    at: start as u64,
                });
            }
            value |= low << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
            shift += 7;
        }
    }

    pub(crate) fn varint64(&mut self, field: &'static str) -> Result<u64, Problem> {
        self.varint(64, field)
    }

    pub(crate) fn varint32(&mut self, field: &'static str) -> Result<u32, Problem> {
        // Fits: `varint` refuses any bit at or past 32.
        self.varint(32, field).map(|v| v as u32)
    }

    /// Key and path lengths: read as 32-bit varints, then bounded to 16 bits (as
    /// tensorstore's `VarintCodec<uint16_t>`).
    pub(crate) fn varint16(&mut self, field: &'static str) -> Result<u16, Problem> {
        let v = self.varint32(field)?;
        u16::try_from(v).map_err(|_| Problem::TooLarge {
            field,
            value: u64::from(v),
            max: u64::from(u16::MAX),
        })
    }

    /// A column count: a varint bounded by `max` and by the bytes left, each entry
    /// taking at least `min_bytes_each` bytes, so that no allocation is sized by a
    /// number the input merely claims.
    pub(crate) fn count(
        &mut self,
        field: &'static str,
        max: u64,
        min_bytes_each: u64,
    ) -> Result<usize, Problem> {
        let n = self.varint64(field)?;
        if n > max {
            return Err(Problem::TooLarge {
                field,
                value: n,
                max,
            });
        }
        if n.saturating_mul(min_bytes_each) > self.remaining() as u64 {
            return Err(self.truncated(field));
        }
        Ok(n as usize)
    }

    /// Everything must have been read.
    pub(crate) fn finish(&self) -> Result<(), Problem> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(Problem::TrailingBytes { count: n as u64 }),
        }
    }
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Checks the envelope of an object of `kind` and returns its body, decompressed if it
/// was compressed to at most `max_body` bytes.
///
/// The CRC is checked before the version and compression fields are read, so a flipped
/// byte anywhere is reported as what it is rather than as whatever the flip made it
/// look like.
pub(crate) fn open_envelope(
    bytes: &[u8],
    kind: ObjectKind,
    max_body: u64,
) -> Result<std::borrow::Cow<'_, [u8]>, Problem> {
    if bytes.len() < ENVELOPE {
        return Err(Problem::TooShort {
            len: bytes.len() as u64,
        });
    }
    let magic = u32::from_be_bytes(bytes[0..4].try_into().expect("4 bytes"));
    if magic != kind.magic() {
        return Err(Problem::BadMagic {
            found: magic,
            expected: kind.magic(),
        });
    }
    let stored = u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes"));
    if stored != bytes.len() as u64 {
        return Err(Problem::LengthMismatch {
            stored,
            actual: bytes.len() as u64,
        });
    }
    let (covered, crc) = bytes.split_at(bytes.len() - 4);
    let stored_crc = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
    let computed = crc32c::crc32c(covered);
    if stored_crc != computed {
        return Err(Problem::Crc {
            stored: stored_crc,
            computed,
        });
    }
    let mut c = Cursor::new(&covered[12..]);
    let version = c.varint32("format version")?;
    if version != 0 {
        return Err(Problem::UnsupportedVersion(version));
    }
    let compression = c.varint32("compression")?;
    let body = &covered[12 + (covered.len() - 12 - c.remaining())..];
    match compression {
        0 => Ok(std::borrow::Cow::Borrowed(body)),
        1 => zstd_body(body, max_body).map(std::borrow::Cow::Owned),
        n => Err(Problem::UnknownCompression(n)),
    }
}

/// One zstd frame, decoded as a stream (tensorstore's frames carry their content size
/// but need not: the size is never trusted) to at most `max` bytes, and nothing after
/// it.
fn zstd_body(frame: &[u8], max: u64) -> Result<Vec<u8>, Problem> {
    let zerr = |e: std::io::Error| Problem::Zstd(e.to_string());
    let mut dec = zstd::stream::read::Decoder::with_buffer(frame)
        .map_err(zerr)?
        .single_frame();
    let mut out = Vec::new();
    (&mut dec)
        .take(max.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(zerr)?;
    if out.len() as u64 > max {
        return Err(Problem::DecodedTooLarge { limit: max });
    }
    let rest = dec.finish();
    if !rest.is_empty() {
        return Err(Problem::AfterFrame {
            count: rest.len() as u64,
        });
    }
    Ok(out)
}

/// Wraps `body` in the envelope of `kind`, compressing it as asked.
pub(crate) fn seal_envelope(
    kind: ObjectKind,
    body: &[u8],
    compression: Compression,
) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len() + ENVELOPE + 2);
    out.extend_from_slice(&kind.magic().to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    put_varint(&mut out, 0);
    match compression {
        Compression::None => {
            put_varint(&mut out, 0);
            out.extend_from_slice(body);
        }
        Compression::Zstd { level } => {
            put_varint(&mut out, 1);
            // `bulk` writes the content size into the frame, as riegeli's writer does.
            out.extend_from_slice(&zstd::bulk::compress(body, level)?);
        }
    }
    let len = out.len() as u64 + 4;
    out[4..12].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Rewrites the length field and the CRC of `bytes` (at least 16 bytes) so that the
/// envelope checks pass: the fuzz target uses it to reach the body parsers.
pub(crate) fn reseal(bytes: &mut [u8]) {
    if bytes.len() < ENVELOPE {
        return;
    }
    let len = bytes.len() as u64;
    bytes[4..12].copy_from_slice(&len.to_le_bytes());
    let n = bytes.len() - 4;
    let crc = crc32c::crc32c(&bytes[..n]);
    bytes[n..].copy_from_slice(&crc.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_refuse_overlong() {
        for v in [0u64, 1, 127, 128, 300, 1 << 32, u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            let mut c = Cursor::new(&b);
            assert_eq!(c.varint64("v").unwrap(), v);
            c.finish().unwrap();
        }
        // 2^32 does not fit 32 bits; 11 bytes do not fit 64.
        let mut b = Vec::new();
        put_varint(&mut b, 1 << 32);
        assert!(matches!(
            Cursor::new(&b).varint32("x"),
            Err(Problem::BadVarint { bits: 32, .. })
        ));
        let long = [0xffu8; 10];
        assert!(matches!(
            Cursor::new(&[&long[..], &[0x01]].concat()).varint64("x"),
            Err(Problem::BadVarint { bits: 64, .. })
        ));
        // u64::MAX is 9 bytes of 0xff then 0x01; 0x02 in the tenth byte overflows.
        let mut over = vec![0xffu8; 9];
        over.push(0x02);
        assert!(matches!(
            Cursor::new(&over).varint64("x"),
            Err(Problem::BadVarint { .. })
        ));
        assert!(matches!(
            Cursor::new(&[0x80]).varint64("x"),
            Err(Problem::Truncated { .. })
        ));
        let mut b = Vec::new();
        put_varint(&mut b, 70000);
        assert!(matches!(
            Cursor::new(&b).varint16("key length"),
            Err(Problem::TooLarge { max: 65535, .. })
        ));
    }

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn envelope_round_trip_and_damage() {
        for c in [Compression::None, Compression::Zstd { level: 0 }] {
            let sealed = seal_envelope(ObjectKind::BtreeNode, b"hello body", c).unwrap();
            let body = open_envelope(&sealed, ObjectKind::BtreeNode, 100).unwrap();
            assert_eq!(&body[..], b"hello body");
            assert!(matches!(
                open_envelope(&sealed, ObjectKind::Manifest, 100),
                Err(Problem::BadMagic { .. })
            ));
            let mut bad = sealed.clone();
            let n = bad.len();
            bad[n - 6] ^= 1;
            assert!(matches!(
                open_envelope(&bad, ObjectKind::BtreeNode, 100),
                Err(Problem::Crc { .. })
            ));
            assert!(matches!(
                open_envelope(&sealed[..n - 1], ObjectKind::BtreeNode, 100),
                Err(Problem::LengthMismatch { .. })
            ));
        }
        let big = vec![0u8; 1 << 20];
        let sealed =
            seal_envelope(ObjectKind::BtreeNode, &big, Compression::Zstd { level: 0 }).unwrap();
        assert_eq!(
            open_envelope(&sealed, ObjectKind::BtreeNode, 1000).unwrap_err(),
            Problem::DecodedTooLarge { limit: 1000 }
        );
        let mut two = sealed.clone();
        let n = two.len();
        // A second frame after the first: trailing compressed bytes.
        let frame = zstd::bulk::compress(b"x", 0).unwrap();
        two.splice(n - 4..n - 4, frame.iter().copied());
        reseal(&mut two);
        assert!(matches!(
            open_envelope(&two, ObjectKind::BtreeNode, 2 << 20),
            Err(Problem::AfterFrame { .. })
        ));
    }
}

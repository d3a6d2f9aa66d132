//! The `.ckptz` reader must never panic, whatever the bytes: the header parser (version
//! 1, version 2 and later versions' refusal), and for a file it accepts, reading
//! (decompressing) its tensors and their checksums. Then a capped round trip through
//! the version 2 writer: tensors whose dtypes, sizes and bytes come from the input,
//! written in pieces in reverse order, read back to the same bytes.
#![no_main]
use ckpt_core::formats::ckptz::{CkptzWriter, Compression};
use ckpt_core::formats::writer::TensorSpec;
use ckpt_core::layout::Dtype;

const DTYPES: [Dtype; 6] = [
    Dtype::F32,
    Dtype::BF16,
    Dtype::F16,
    Dtype::F64,
    Dtype::U8,
    Dtype::I64,
];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ckpt_core::formats::ckptz::parse_header(data, data.len() as u64);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.ckptz");
    std::fs::write(&p, data).unwrap();
    if let Ok(f) = ckpt_core::formats::TensorFile::open(&p) {
        let mut cache = ckpt_core::formats::ChunkCache::new();
        for (i, t) in f.tensors().iter().enumerate() {
            // A header may claim a huge tensor in few huge chunks: read a capped prefix
            // and a range across the first chunk edge, not the whole claim.
            let len = (t.end - t.start).min(1 << 16);
            if let Ok(b) = f.read(i, 0..len, &mut cache) {
                assert_eq!(b.len() as u64, len);
            }
            let _ = f.read(i, len / 2..len, &mut cache);
            if t.end - t.start <= 1 << 16 {
                let _ = f.check_checksum(i);
            }
        }
    }
    round_trip(data, dir.path());
});

/// Bytes 0..2: chunk size; then per tensor 2 bytes (dtype, element count) while input
/// lasts (at most 16 tensors); the rest is the tensors' bytes, repeated.
fn round_trip(data: &[u8], dir: &std::path::Path) {
    if data.len() < 4 {
        return;
    }
    let chunk = u64::from(u16::from_le_bytes([data[0], data[1]])) % 512 + 1;
    let specs: Vec<TensorSpec> = data[2..]
        .chunks_exact(2)
        .take(16)
        .enumerate()
        .map(|(i, c)| TensorSpec {
            name: format!("t{i}"),
            dtype: DTYPES[c[0] as usize % DTYPES.len()],
            shape: vec![u64::from(c[1] % 64)],
        })
        .collect();
    let fill = &data[2..];
    let p = dir.join("rt.ckptz");
    let c = Compression {
        level: 1,
        chunk_bytes: chunk,
    };
    let w = CkptzWriter::create(&p, &specs, &Default::default(), c).unwrap();
    let mut want = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let n = s.shape[0] as usize * s.dtype.bitsize() / 8;
        let bytes: Vec<u8> = fill.iter().cycle().skip(i).take(n).copied().collect();
        for lo in (0..n).step_by(7).rev() {
            w.write_at(i, lo as u64, &bytes[lo..(lo + 7).min(n)])
                .unwrap();
        }
        want.push(bytes);
    }
    w.finish().unwrap();
    let f = ckpt_core::formats::TensorFile::open(&p).unwrap();
    let mut cache = ckpt_core::formats::ChunkCache::new();
    for (s, bytes) in specs.iter().zip(&want) {
        let k = f.find(&s.name).unwrap();
        let got = f.read(k, 0..bytes.len() as u64, &mut cache).unwrap();
        assert_eq!(got, &bytes[..]);
        f.check_checksum(k).unwrap();
    }
}

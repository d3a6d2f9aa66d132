//! The IDX format of (Fashion-)MNIST: big-endian header, then unsigned bytes.

use super::{read_maybe_gz, Dataset, Split};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// An IDX array of unsigned bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Idx {
    /// Dimensions.
    pub dims: Vec<usize>,
    /// Row-major data.
    pub data: Vec<u8>,
}

/// Parses an IDX file's bytes (already un-gzipped). Only the unsigned-byte type (0x08)
/// is accepted, as (Fashion-)MNIST uses.
///
/// # Errors
/// [`Error::BadData`]: short header, wrong magic or type, or a length that disagrees
/// with the dimensions.
pub fn read_idx(bytes: &[u8], path: &Path) -> Result<Idx> {
    let bad = |problem: String| Error::BadData {
        path: path.to_path_buf(),
        problem,
    };
    if bytes.len() < 4 {
        return Err(bad(format!(
            "{} bytes, too short for an IDX header",
            bytes.len()
        )));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad(
            "not an IDX file (magic must start with two zero bytes)".into(),
        ));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "IDX element type 0x{:02x} is not unsigned byte (0x08)",
            bytes[2]
        )));
    }
    let nd = bytes[3] as usize;
    let header = 4 + 4 * nd;
    if bytes.len() < header {
        return Err(bad(format!(
            "{} bytes, too short for {nd} dimensions",
            bytes.len()
        )));
    }
    let dims: Vec<usize> = (0..nd)
        .map(|i| {
            u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes")) as usize
        })
        .collect();
    let n = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("dimensions overflow".into()))?;
    if bytes.len() - header != n {
        return Err(bad(format!(
            "{} data bytes, dimensions {dims:?} need {n}",
            bytes.len() - header
        )));
    }
    Ok(Idx {
        dims,
        data: bytes[header..].to_vec(),
    })
}

fn find(dir: &Path, stem: &str) -> Result<PathBuf> {
    for name in [stem.to_string(), format!("{stem}.gz")] {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(Error::BadData {
        path: dir.join(stem),
        problem: "missing (also tried .gz)".into(),
    })
}

fn images_labels(dir: &Path, images: &str, labels: &str) -> Result<Dataset> {
    let ip = find(dir, images)?;
    let lp = find(dir, labels)?;
    let im = read_idx(&read_maybe_gz(&ip)?, &ip)?;
    let lb = read_idx(&read_maybe_gz(&lp)?, &lp)?;
    if im.dims.len() != 3 {
        return Err(Error::BadData {
            path: ip,
            problem: format!("images must have 3 dimensions, got {:?}", im.dims),
        });
    }
    if lb.dims != [im.dims[0]] {
        return Err(Error::BadData {
            path: lp,
            problem: format!("labels {:?} do not match {} images", lb.dims, im.dims[0]),
        });
    }
    if let Some(l) = lb.data.iter().find(|&&l| l > 9) {
        return Err(Error::BadData {
            path: lp,
            problem: format!("label {l} outside 0..9"),
        });
    }
    let (mean, std) = (0.2860f32, 0.3530f32);
    Ok(Dataset {
        images: im
            .data
            .iter()
            .map(|&p| (f32::from(p) / 255.0 - mean) / std)
            .collect(),
        labels: lb.data.iter().map(|&l| u32::from(l)).collect(),
        channels: 1,
        height: im.dims[1],
        width: im.dims[2],
        classes: 10,
    })
}

/// Reads Fashion-MNIST from `dir` (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
/// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each optionally `.gz`).
///
/// # Errors
/// Missing or malformed files.
pub fn read_fashion_mnist(dir: &Path) -> Result<Split> {
    Ok(Split {
        train: images_labels(dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte")?,
        test: images_labels(dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut b = vec![0, 0, 8, dims.len() as u8];
        for d in dims {
            b.extend_from_slice(&d.to_be_bytes());
        }
        b.extend_from_slice(data);
        b
    }

    #[test]
    fn reads_a_small_fashion_mnist_directory() {
        let dir = tempfile::tempdir().unwrap();
        let img: Vec<u8> = (0..2 * 4 * 4).map(|i| i as u8).collect();
        std::fs::write(
            dir.path().join("train-images-idx3-ubyte"),
            idx(&[2, 4, 4], &img),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("train-labels-idx1-ubyte"),
            idx(&[2], &[3, 9]),
        )
        .unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &idx(&[1, 4, 4], &img[..16])).unwrap();
        std::fs::write(
            dir.path().join("t10k-images-idx3-ubyte.gz"),
            gz.finish().unwrap(),
        )
        .unwrap();
        std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), idx(&[1], &[0])).unwrap();
        let s = read_fashion_mnist(dir.path()).unwrap();
        assert_eq!(
            (s.train.len(), s.test.len(), s.train.height, s.train.width),
            (2, 1, 4, 4)
        );
        assert_eq!(s.train.labels, vec![3, 9]);
        assert!((s.train.images[17] - (17.0 / 255.0 - 0.2860) / 0.3530).abs() < 1e-6);
    }

    #[test]
    fn truncated_idx_is_an_error() {
        let mut b = idx(&[2, 2], &[1, 2, 3, 4]);
        b.pop();
        let e = read_idx(&b, Path::new("f")).unwrap_err();
        assert_eq!(e.to_string(), "f: 3 data bytes, dimensions [2, 2] need 4");
        let e = read_idx(&[0, 0, 0x0d, 1], Path::new("f")).unwrap_err();
        assert!(e.to_string().contains("0x0d"));
    }
}

//! CIFAR-10 binary batches: records of one label byte and 3,072 pixel bytes (R, G, B
//! planes of 32x32).

use super::{Dataset, Split};
use crate::error::{Error, IoContext, Result};
use std::path::Path;

/// Bytes of one CIFAR-10 record.
pub const CIFAR_RECORD: usize = 1 + 3 * 32 * 32;

const MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
const STD: [f32; 3] = [0.2470, 0.2435, 0.2616];

fn read_batches(files: &[std::path::PathBuf]) -> Result<Dataset> {
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    for f in files {
        let bytes = std::fs::read(f).at(f)?;
        if bytes.is_empty() || bytes.len() % CIFAR_RECORD != 0 {
            return Err(Error::BadData {
                path: f.clone(),
                problem: format!(
                    "{} bytes is not a whole number of {CIFAR_RECORD}-byte records",
                    bytes.len()
                ),
            });
        }
        for rec in bytes.chunks_exact(CIFAR_RECORD) {
            if rec[0] > 9 {
                return Err(Error::BadData {
                    path: f.clone(),
                    problem: format!("label {} outside 0..9", rec[0]),
                });
            }
            labels.push(u32::from(rec[0]));
            for (i, &p) in rec[1..].iter().enumerate() {
                let c = i / 1024;
                images.push((f32::from(p) / 255.0 - MEAN[c]) / STD[c]);
            }
        }
    }
    Ok(Dataset {
        images,
        labels,
        channels: 3,
        height: 32,
        width: 32,
        classes: 10,
    })
}

/// Reads CIFAR-10 from `dir` (`data_batch_*.bin` for training, `test_batch.bin`), the
/// layout of `cifar-10-batches-bin`. Pixels are normalised per channel.
///
/// # Errors
/// Missing files, lengths that are not whole records, labels above 9.
pub fn read_cifar10(dir: &Path) -> Result<Split> {
    let mut train: Vec<_> = std::fs::read_dir(dir)
        .at(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("data_batch_") && n.ends_with(".bin"))
        })
        .collect();
    train.sort();
    if train.is_empty() {
        return Err(Error::BadData {
            path: dir.to_path_buf(),
            problem: "no data_batch_*.bin files".into(),
        });
    }
    let test = dir.join("test_batch.bin");
    if !test.is_file() {
        return Err(Error::BadData {
            path: test,
            problem: "missing".into(),
        });
    }
    Ok(Split {
        train: read_batches(&train)?,
        test: read_batches(&[test])?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_small_batches() {
        let dir = tempfile::tempdir().unwrap();
        let mut rec = vec![7u8];
        rec.extend((0..3072).map(|i| (i % 256) as u8));
        std::fs::write(
            dir.path().join("data_batch_1.bin"),
            [rec.clone(), rec.clone()].concat(),
        )
        .unwrap();
        std::fs::write(dir.path().join("test_batch.bin"), &rec).unwrap();
        let s = read_cifar10(dir.path()).unwrap();
        assert_eq!((s.train.len(), s.test.len(), s.train.channels), (2, 1, 3));
        assert_eq!(s.train.labels, vec![7, 7]);
        assert!((s.train.images[1024 + 1] - (1.0 / 255.0 - MEAN[1]) / STD[1]).abs() < 1e-6);
        std::fs::write(dir.path().join("test_batch.bin"), &rec[..100]).unwrap();
        assert!(read_cifar10(dir.path())
            .unwrap_err()
            .to_string()
            .contains("whole number"));
    }
}

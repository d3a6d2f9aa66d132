//! Data sets (the shipped digits, Fashion-MNIST IDX, CIFAR-10 binary) and the
//! distributed sampler.

mod cifar;
mod digits;
mod idx;
mod sampler;

pub use self::cifar::{read_cifar10, CIFAR_RECORD};
pub use self::digits::{digits, parse_digits_csv, DIGITS_CSV_GZ, DIGITS_SPLIT_SEED, DIGITS_TEST};
pub use self::idx::{read_fashion_mnist, read_idx, Idx};
pub use self::sampler::DistributedSampler;

use crate::error::{Error, IoContext, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;
use std::path::{Path, PathBuf};

/// Images and labels held in memory, images as `f32` `[n, channels, height, width]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Pixel values, normalised, row-major `[n, c, h, w]`.
    pub images: Vec<f32>,
    /// Class of every image.
    pub labels: Vec<u32>,
    /// Channels per image.
    pub channels: usize,
    /// Image height.
    pub height: usize,
    /// Image width.
    pub width: usize,
    /// Number of classes.
    pub classes: usize,
}

/// A training and a test set.
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    /// Training images.
    pub train: Dataset,
    /// Test images.
    pub test: Dataset,
}

impl Dataset {
    /// Number of images.
    #[must_use]
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Elements per image.
    #[must_use]
    pub fn image_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    /// The first `n` images (all when `n` is larger).
    #[must_use]
    pub fn truncate(mut self, n: usize) -> Dataset {
        let n = n.min(self.len());
        self.images.truncate(n * self.image_len());
        self.labels.truncate(n);
        self
    }

    /// Images `[b, c, h, w]` and labels `[b]` (u32) of the given indices.
    ///
    /// # Errors
    /// Tensor library errors.
    pub fn batch(&self, idx: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
        let il = self.image_len();
        let mut x = Vec::with_capacity(idx.len() * il);
        let mut y = Vec::with_capacity(idx.len());
        for &i in idx {
            x.extend_from_slice(&self.images[i * il..(i + 1) * il]);
            y.push(self.labels[i]);
        }
        let x = Tensor::from_vec(x, (idx.len(), self.channels, self.height, self.width), dev)?;
        let y = Tensor::from_vec(y, idx.len(), dev)?;
        Ok((x, y))
    }

    /// Like [`Dataset::batch`] with CIFAR augmentation: random crop from the image padded
    /// by 4 (zeros) and random horizontal flip. Each image's draw comes from `seed` and
    /// the image's index only, so it does not depend on how the batch is split over
    /// ranks, and a resumed run draws the same.
    ///
    /// # Errors
    /// Tensor library errors.
    pub fn augmented_batch(
        &self,
        idx: &[usize],
        seed: u64,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (c, h, w) = (self.channels, self.height, self.width);
        let il = self.image_len();
        let mut x = vec![0f32; idx.len() * il];
        let mut y = Vec::with_capacity(idx.len());
        for (b, &i) in idx.iter().enumerate() {
            let mut rng =
                ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let (dy, dx): (i64, i64) = (rng.random_range(-4..=4), rng.random_range(-4..=4));
            let flip = rng.random_bool(0.5);
            let src = &self.images[i * il..(i + 1) * il];
            let dst = &mut x[b * il..(b + 1) * il];
            for ch in 0..c {
                for yy in 0..h {
                    let sy = yy as i64 + dy;
                    if sy < 0 || sy >= h as i64 {
                        continue;
                    }
                    for xx in 0..w {
                        let ox = if flip { w - 1 - xx } else { xx };
                        let sx = ox as i64 + dx;
                        if sx < 0 || sx >= w as i64 {
                            continue;
                        }
                        dst[(ch * h + yy) * w + xx] = src[(ch * h + sy as usize) * w + sx as usize];
                    }
                }
            }
            y.push(self.labels[i]);
        }
        Ok((
            Tensor::from_vec(x, (idx.len(), c, h, w), dev)?,
            Tensor::from_vec(y, idx.len(), dev)?,
        ))
    }
}

/// Which data set to train on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataSource {
    /// scikit-learn's 8x8 digits: the copy embedded in the binary, or a `.csv(.gz)` file.
    Digits(Option<PathBuf>),
    /// Fashion-MNIST IDX files in a directory.
    FashionMnist(PathBuf),
    /// CIFAR-10 binary batches in a directory.
    Cifar10(PathBuf),
}

/// Where Debian's `dataset-fashion-mnist` installs Fashion-MNIST.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

impl DataSource {
    /// Parses `digits`, `digits:FILE`, `fashion-mnist[:DIR]`, `cifar10:DIR`.
    ///
    /// # Errors
    /// Unknown names, or `cifar10` without a directory.
    pub fn parse(text: &str) -> Result<DataSource> {
        let (name, path) = match text.split_once(':') {
            Some((n, p)) => (n, Some(PathBuf::from(p))),
            None => (text, None),
        };
        match name {
            "digits" => Ok(DataSource::Digits(path)),
            "fashion-mnist" | "fashion_mnist" => Ok(DataSource::FashionMnist(
                path.unwrap_or_else(|| PathBuf::from(FASHION_MNIST_DIR)),
            )),
            "cifar10" | "cifar-10" => path.map(DataSource::Cifar10).ok_or_else(|| {
                Error::option(
                    "--data",
                    "cifar10 needs a directory: cifar10:DIR (holding cifar-10-batches-bin files)",
                )
            }),
            _ => Err(Error::option(
                "--data",
                format!("unknown data set `{name}` (digits, fashion-mnist, cifar10)"),
            )),
        }
    }

    /// Reads the training and test sets.
    ///
    /// # Errors
    /// Missing or malformed files.
    pub fn load(&self) -> Result<Split> {
        match self {
            DataSource::Digits(None) => {
                digits(DIGITS_CSV_GZ, Path::new("<embedded digits.csv.gz>"))
            }
            DataSource::Digits(Some(p)) => {
                let bytes = std::fs::read(p).at(p)?;
                digits(&bytes, p)
            }
            DataSource::FashionMnist(dir) => read_fashion_mnist(dir),
            DataSource::Cifar10(dir) => read_cifar10(dir),
        }
    }

    /// Whether training batches are augmented (CIFAR-10 only).
    #[must_use]
    pub fn augments(&self) -> bool {
        matches!(self, DataSource::Cifar10(_))
    }
}

impl fmt::Display for DataSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSource::Digits(None) => f.write_str("digits"),
            DataSource::Digits(Some(p)) => write!(f, "digits:{}", p.display()),
            DataSource::FashionMnist(p) => write!(f, "fashion-mnist:{}", p.display()),
            DataSource::Cifar10(p) => write!(f, "cifar10:{}", p.display()),
        }
    }
}

/// Reads a file, un-gzipping it when it starts with the gzip magic.
pub(crate) fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).at(path)?;
    gunzip_if_needed(bytes, path)
}

/// Un-gzips `bytes` when they start with the gzip magic.
pub(crate) fn gunzip_if_needed(bytes: Vec<u8>, path: &Path) -> Result<Vec<u8>> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut out)
            .at(path)?;
        Ok(out)
    } else {
        Ok(bytes)
    }
}

//! scikit-learn's 8x8 handwritten digits (1,797 images), shipped in `data/digits/`.

use super::{gunzip_if_needed, Dataset, Split};
use crate::error::{Error, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;

/// The shipped `data/digits/digits.csv.gz`, embedded so the default run needs no files.
pub const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../../data/digits/digits.csv.gz");

/// Number of images held out for testing (20% of 1,797).
pub const DIGITS_TEST: usize = 360;

/// Seed of the fixed permutation that splits the digits into training and test sets.
pub const DIGITS_SPLIT_SEED: u64 = 1797;

/// Parses the digits CSV: one image a line, 64 pixel values 0..16 then the label.
/// Pixels are scaled to 0..1. `path` only names the source in errors.
///
/// # Errors
/// [`Error::BadData`] naming the line.
pub fn parse_digits_csv(text: &str, path: &Path) -> Result<Dataset> {
    let bad = |line: usize, problem: String| Error::BadData {
        path: path.to_path_buf(),
        problem: format!("line {line}: {problem}"),
    };
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let vals: Vec<&str> = line.split(',').collect();
        if vals.len() != 65 {
            return Err(bad(i + 1, format!("{} values, expected 65", vals.len())));
        }
        for v in &vals[..64] {
            let p: f32 = v
                .trim()
                .parse()
                .map_err(|_| bad(i + 1, format!("pixel `{v}` is not a number")))?;
            if !(0.0..=16.0).contains(&p) {
                return Err(bad(i + 1, format!("pixel {p} outside 0..16")));
            }
            images.push(p / 16.0);
        }
        let label: u32 = vals[64]
            .trim()
            .parse()
            .map_err(|_| bad(i + 1, format!("label `{}` is not a whole number", vals[64])))?;
        if label > 9 {
            return Err(bad(i + 1, format!("label {label} outside 0..9")));
        }
        labels.push(label);
    }
    Ok(Dataset {
        images,
        labels,
        channels: 1,
        height: 8,
        width: 8,
        classes: 10,
    })
}

/// The digits split into training and test sets by a fixed permutation (ChaCha8 seeded
/// with [`DIGITS_SPLIT_SEED`]): the last [`DIGITS_TEST`] images of the permutation (20%
/// of a smaller file) are the test set. The rows of the file are grouped by writer, so
/// a split by position would test on writers never seen.
///
/// # Errors
/// A malformed file.
pub fn digits(bytes: &[u8], path: &Path) -> Result<Split> {
    let raw = gunzip_if_needed(bytes.to_vec(), path)?;
    let text = String::from_utf8(raw).map_err(|_| Error::BadData {
        path: path.to_path_buf(),
        problem: "not UTF-8 text".into(),
    })?;
    let all = parse_digits_csv(&text, path)?;
    let n = all.len();
    let n_test = if n >= 1797 { DIGITS_TEST } else { n / 5 };
    let cut = n - n_test;
    let il = all.image_len();
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(DIGITS_SPLIT_SEED));
    let pick = |idx: &[usize]| Dataset {
        images: idx
            .iter()
            .flat_map(|&i| all.images[i * il..(i + 1) * il].iter().copied())
            .collect(),
        labels: idx.iter().map(|&i| all.labels[i]).collect(),
        ..all.clone()
    };
    Ok(Split {
        train: pick(&order[..cut]),
        test: pick(&order[cut..]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_digits_parse() {
        let s = digits(DIGITS_CSV_GZ, Path::new("x")).unwrap();
        assert_eq!(s.train.len(), 1437);
        assert_eq!(s.test.len(), 360);
        let mut all = s.train.labels.clone();
        all.extend(&s.test.labels);
        all.sort_unstable();
        let full = parse_digits_csv(
            &String::from_utf8(gunzip_if_needed(DIGITS_CSV_GZ.to_vec(), Path::new("x")).unwrap())
                .unwrap(),
            Path::new("x"),
        )
        .unwrap();
        let mut want = full.labels.clone();
        want.sort_unstable();
        assert_eq!(all, want, "the split is a permutation");
        assert_eq!(
            digits(DIGITS_CSV_GZ, Path::new("x")).unwrap(),
            s,
            "and fixed"
        );
    }

    #[test]
    fn bad_rows_name_their_line() {
        let e = parse_digits_csv("1,2,3\n", Path::new("d.csv")).unwrap_err();
        assert_eq!(e.to_string(), "d.csv: line 1: 3 values, expected 65");
    }
}

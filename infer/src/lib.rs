//! ckpt-infer: evaluate a checkpoint on one device or tensor-parallel on several.
//!
//! The model, its configuration and (unless given) the data set come from the
//! checkpoint itself (`config.json`, `trainer_state.json`). A sliced checkpoint runs
//! tensor parallel on as many ranks as its strategy's `tp` axis has (an integrated one
//! on one), each rank loading only its own slice through ckpt-core's copy plan;
//! `--ranks` may be any multiple of that: the extra copies are data parallel, each
//! evaluating its share of the test set, and the shares are gathered in order, so the
//! predictions are those of one copy.

use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::{Checkpoint, Kind};
use ckpt_train::{find_meta_file, resolve_checkpoint, DataSource, Dataset, TRAINER_STATE_FILE};
use std::path::{Path, PathBuf};
use std::time::Instant;

mod present;

/// Everything that can go wrong in inference.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// From the checkpoint layer (names file and tensor).
    #[error(transparent)]
    Core(#[from] ckpt_core::Error),
    /// From the model layer.
    #[error(transparent)]
    Train(#[from] ckpt_train::Error),
    /// From candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The checkpoint lacks what inference needs, or does not fit the request.
    #[error("{path}: {problem}")]
    Checkpoint {
        /// The checkpoint.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A bad option.
    #[error("{option}: {problem}")]
    Option {
        /// The option.
        option: String,
        /// What is wrong.
        problem: String,
    },
}

/// Result with inference's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which images to predict, besides the accuracy over the whole test set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Predict {
    /// Test-set indices.
    Indices(Vec<usize>),
    /// Files in the data set's own format (digits: CSV rows).
    Files(Vec<PathBuf>),
}

/// What to evaluate.
#[derive(Clone, Debug, Default)]
pub struct InferRequest {
    /// Checkpoint directory (integrated, sliced root, or a training output with `latest`).
    pub checkpoint: PathBuf,
    /// Data set (default: the one the checkpoint was trained on).
    pub data: Option<String>,
    /// Number of ranks: a multiple of a sliced checkpoint's tensor-parallel size (the
    /// extra copies data parallel).
    pub ranks: Option<u64>,
    /// Images per forward pass.
    pub batch_size: usize,
    /// Images to predict one by one.
    pub predict: Option<Predict>,
    /// Evaluate only the first N test images.
    pub limit: Option<usize>,
    /// How the tensor-parallel ranks run: threads here, or one process per rank under
    /// mpirun.
    pub backend: ckpt_train::Backend,
    /// Where the model maths runs (CUDA needs a build with `--features cuda-candle`).
    pub device: ckpt_train::DeviceKind,
}

/// One prediction.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// Test index, or row within the given files.
    pub index: usize,
    /// The true class, when known.
    pub label: Option<u32>,
    /// The predicted class.
    pub class: usize,
    /// Softmax probabilities.
    pub probabilities: Vec<f32>,
}

/// What an evaluation found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct InferReport {
    /// Model family and configuration.
    pub model: serde_json::Value,
    /// Ranks used (data parallel x tensor parallel).
    pub ranks: u64,
    /// The checkpoint's kind.
    pub kind: String,
    /// The data set.
    pub data: String,
    /// Test images evaluated.
    pub images: usize,
    /// Test accuracy.
    pub accuracy: f32,
    /// Accuracy per class.
    pub per_class_accuracy: Vec<f32>,
    /// `confusion[true][predicted]`.
    pub confusion: Vec<Vec<u64>>,
    /// Predicted class of every test image.
    pub predicted: Vec<usize>,
    /// Logits of every test image (row-major `[images, classes]`).
    #[serde(skip)]
    pub logits: Vec<f32>,
    /// Requested predictions.
    pub predictions: Vec<Prediction>,
    /// Images per second of the forward passes.
    pub images_per_sec: f64,
    /// Wall time, loading included.
    pub seconds: f64,
}

fn bad(path: &Path, problem: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// The data set a checkpoint was trained on (from `trainer_state.json`).
fn trained_on(dir: &Path) -> Option<String> {
    let p = find_meta_file(dir, TRAINER_STATE_FILE)?;
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    v.get("data")?.as_str().map(str::to_string)
}

/// Tensor-parallel size of a sliced checkpoint's strategy (1 when it has no `tp` axis).
fn tp_size(strategy: &Strategy) -> u64 {
    strategy
        .mesh
        .axis_index("tp")
        .map_or(1, |i| strategy.mesh.axes()[i].size)
}

/// Evaluates a checkpoint.
///
/// # Errors
/// A checkpoint that does not fit its model (the tensor and both shapes are named),
/// ranks that do not match a sliced checkpoint, unreadable data.
pub fn infer(req: &InferRequest) -> Result<InferReport> {
    let t0 = Instant::now();
    req.device.check()?;
    let dir = resolve_checkpoint(&req.checkpoint)?;
    let cfg = ckpt_train::read_model_config(&dir)?;
    let source = Checkpoint::open(std::slice::from_ref(&dir))?;
    // Tensor parallel as the checkpoint is sliced (an integrated one: one rank), and
    // data parallel over the rest: `--ranks` must be a multiple of the slicing.
    let tp = match (&source.strategy, source.kind) {
        (Some(s), Kind::Sliced) => tp_size(s),
        _ => 1,
    };
    // One process per rank: by default, as many ranks as the launcher started.
    let launched = match req.backend {
        ckpt_train::Backend::Threads => None,
        _ => ckpt_train::LaunchEnv::from_env()?.map(|e| e.world_size as u64),
    };
    let ranks = req.ranks.or(launched).unwrap_or(tp);
    if ranks == 0 || !ranks.is_multiple_of(tp) {
        let mesh = source
            .strategy
            .as_ref()
            .map(|s| s.mesh.to_string())
            .unwrap_or_default();
        return Err(Error::Option {
            option: "--ranks".into(),
            problem: format!(
                "{ranks} ranks, but {} is sliced for {tp} tensor-parallel ranks (mesh {mesh}): use --ranks {tp} or a multiple of it (the test set split over the copies), or `ckpt reshard {} -o OUT --to {ranks}` first",
                dir.display(),
                dir.display()
            ),
        });
    }
    let dp = ranks / tp;
    let data_name = req
        .data
        .clone()
        .or_else(|| trained_on(&dir))
        .unwrap_or_else(|| "digits".into());
    let split = DataSource::parse(&data_name)?.load()?;
    let mut test = split.test;
    if let Some(n) = req.limit {
        truncate(&mut test, n);
    }
    let extra = match &req.predict {
        Some(Predict::Files(files)) => Some(read_files(files, &data_name)?),
        _ => None,
    };
    if test.classes != cfg.classes() {
        return Err(bad(
            &dir,
            format!(
                "the model has {} classes but {data_name} has {}",
                cfg.classes(),
                test.classes
            ),
        ));
    }

    // The model's tensors, laid out for `tp` tensor-parallel ranks in each of `dp`
    // data-parallel copies.
    let mesh = Mesh::parse(&format!("dp={dp},tp={tp}"))?;
    let target = ckpt_train::model_strategy(&cfg, &mesh)?;
    for (name, l) in &target.tensors {
        match source.tensors.get(name) {
            None => {
                return Err(bad(
                    &dir,
                    format!("tensor `{name}` of the {} model is missing", cfg.kind()),
                ))
            }
            Some(t) if t.shape != l.shape => {
                return Err(bad(
                    &dir,
                    format!(
                    "tensor `{name}` has shape {:?} in the checkpoint but the {} model needs {:?}",
                    t.shape,
                    cfg.kind(),
                    l.shape
                ),
                ))
            }
            Some(_) => {}
        }
    }
    let kind = format!("{:?}", source.kind).to_lowercase();
    drop(source);
    let batch = req.batch_size.max(1);
    let outputs = req.backend.run(&mesh, |dist| {
        let device = req.device.for_rank(req.backend, dist.rank)?;
        let (_, model) = ckpt_train::load_model(&dir, &dist, &device)?;
        let forward =
            |set: &Dataset, from: usize, n: usize| -> ckpt_train::Result<(Vec<f32>, f64)> {
                let mut logits = Vec::with_capacity(n * set.classes);
                let t = Instant::now();
                let idx: Vec<usize> = (from..from + n).collect();
                for b in idx.chunks(batch) {
                    let (x, _) = set.batch(b, &device)?;
                    logits.extend(model.forward(&x, false)?.flatten_all()?.to_vec1::<f32>()?);
                }
                Ok((logits, t.elapsed().as_secs_f64()))
            };
        // Each data-parallel copy evaluates its share of the test set (`torch.chunk`
        // pieces, in order); the shares are gathered back in order on every rank.
        let (from, n) = ckpt_train::chunk(test.len(), dist.dp_size(), dist.dp_rank());
        let (mine, secs) = forward(&test, from, n)?;
        let logits: Vec<f32> = dist.dp.all_gather(&mine)?.concat();
        let more = extra
            .as_ref()
            .map(|set| forward(set, 0, set.len()))
            .transpose()?;
        Ok(((logits, secs), more))
    })?;
    let ((logits, fwd_secs), more) = outputs
        .into_iter()
        .next()
        .ok_or_else(|| bad(&dir, "no rank ran"))?;
    let classes = test.classes;
    let predicted: Vec<usize> = logits.chunks(classes).map(argmax).collect();
    let mut confusion = vec![vec![0u64; classes]; classes];
    for (p, &y) in predicted.iter().zip(&test.labels) {
        confusion[y as usize][*p] += 1;
    }
    let correct: u64 = (0..classes).map(|c| confusion[c][c]).sum();
    let per_class_accuracy = confusion
        .iter()
        .enumerate()
        .map(|(c, row)| {
            let n: u64 = row.iter().sum();
            if n == 0 {
                0.0
            } else {
                row[c] as f32 / n as f32
            }
        })
        .collect();
    let predictions = match (&req.predict, more) {
        (Some(Predict::Indices(idx)), _) => idx
            .iter()
            .map(|&i| {
                if i >= test.len() {
                    return Err(Error::Option {
                        option: "--predict".into(),
                        problem: format!("index {i} is past the {} test images", test.len()),
                    });
                }
                Ok(prediction(
                    i,
                    Some(test.labels[i]),
                    &logits[i * classes..(i + 1) * classes],
                ))
            })
            .collect::<Result<Vec<_>>>()?,
        (Some(Predict::Files(_)), Some((l, _))) => {
            let set = extra.as_ref().expect("files were read");
            l.chunks(classes)
                .enumerate()
                .map(|(i, row)| prediction(i, set.labels.get(i).copied(), row))
                .collect()
        }
        _ => vec![],
    };
    Ok(InferReport {
        model: serde_json::to_value(&cfg).unwrap_or_default(),
        ranks,
        kind,
        data: data_name,
        images: test.len(),
        accuracy: if test.is_empty() {
            0.0
        } else {
            correct as f32 / test.len() as f32
        },
        per_class_accuracy,
        confusion,
        predicted,
        logits,
        predictions,
        images_per_sec: test.len() as f64 / fwd_secs.max(1e-9),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

fn prediction(index: usize, label: Option<u32>, logits: &[f32]) -> Prediction {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|&v| (v - m).exp()).collect();
    let s: f32 = e.iter().sum();
    Prediction {
        index,
        label,
        class: argmax(logits),
        probabilities: e.iter().map(|v| v / s).collect(),
    }
}

fn truncate(d: &mut Dataset, n: usize) {
    let n = n.min(d.len());
    d.labels.truncate(n);
    d.images.truncate(n * d.channels * d.height * d.width);
}

/// Images from files in the data set's format (digits CSV rows).
fn read_files(files: &[PathBuf], data: &str) -> Result<Dataset> {
    if !data.starts_with("digits") {
        return Err(Error::Option {
            option: "--predict".into(),
            problem: format!(
                "files are read for the digits data set only (this is {data}); give test indices"
            ),
        });
    }
    let mut all: Option<Dataset> = None;
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| bad(f, e.to_string()))?;
        let d = ckpt_train::parse_digits_csv(&text, f)?;
        match &mut all {
            None => all = Some(d),
            Some(a) => {
                a.images.extend(d.images);
                a.labels.extend(d.labels);
            }
        }
    }
    all.ok_or_else(|| Error::Option {
        option: "--predict".into(),
        problem: "no files".into(),
    })
}

/// Parses `--predict`: test indices (`7`, `3,5,7`), ranges with the end excluded
/// (`0..10`), or files in the data set's format (digits: CSV rows of 64 pixel values
/// 0..16 and the label, as in the data set's own file).
///
/// # Errors
/// A range written another way (`0-5`), an empty range (`5..2`), or an argument that
/// is neither an index, a range nor an existing file; the message says what to write.
pub fn parse_predict(items: &[String]) -> std::result::Result<Predict, String> {
    if items.iter().any(|it| Path::new(it).is_file()) {
        return match items.iter().find(|it| !Path::new(it).is_file()) {
            Some(it) => Err(format!(
                "`{it}`: not a file, and the other arguments are files"
            )),
            None => Ok(Predict::Files(items.iter().map(PathBuf::from).collect())),
        };
    }
    let mut idx = Vec::new();
    for it in items {
        for part in it.split(',').map(str::trim) {
            if let Some((a, b)) = part.split_once("..") {
                let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) else {
                    return Err(format!("`{part}`: a range is START..END, two test indices"));
                };
                if a >= b {
                    return Err(format!(
                        "`{part}` is empty: a range is START..END with START < END, the end excluded"
                    ));
                }
                idx.extend(a..b);
                continue;
            }
            if let Some((a, b)) = part.split_once('-') {
                if a.parse::<usize>().is_ok() && b.parse::<usize>().is_ok() {
                    return Err(format!(
                        "`{part}`: write the range as {a}..{b} (the end excluded), or {a}..{} to include {b}",
                        b.parse::<usize>().unwrap_or(0) + 1
                    ));
                }
            }
            match part.parse::<usize>() {
                Ok(i) => idx.push(i),
                Err(_) => {
                    return Err(format!(
                        "`{part}`: neither a test index (7), a range (0..10) nor an existing file"
                    ))
                }
            }
        }
    }
    Ok(Predict::Indices(idx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predict_argument() {
        assert_eq!(
            parse_predict(&["0..3".into(), "7,9".into()]),
            Ok(Predict::Indices(vec![0, 1, 2, 7, 9]))
        );
        let f = tempfile::NamedTempFile::new().unwrap();
        let name = f.path().display().to_string();
        assert_eq!(
            parse_predict(std::slice::from_ref(&name)),
            Ok(Predict::Files(vec![f.path().to_path_buf()]))
        );
        let err = |a: &str| parse_predict(&[a.to_string()]).unwrap_err();
        assert!(err("0-5").contains("0..5"), "{}", err("0-5"));
        assert!(err("5..2").contains("is empty"), "{}", err("5..2"));
        assert!(
            err("a.csv").contains("nor an existing file"),
            "{}",
            err("a.csv")
        );
        assert!(parse_predict(&[name, "x".into()])
            .unwrap_err()
            .contains("`x`: not a file"));
        let p = prediction(0, None, &[0.0, 2.0_f32.ln()]);
        assert_eq!(p.class, 1);
        assert!((p.probabilities[1] - 2.0 / 3.0).abs() < 1e-6);
    }
}

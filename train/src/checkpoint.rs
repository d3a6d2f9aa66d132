//! Checkpoints of a training run: sliced (one directory per rank with the strategy) or
//! integrated (whole tensors), written atomically, plus the trainer state.
//!
//! Layout of `--out OUT`:
//!
//! ```text
//! OUT/latest                      "step_N", replaced atomically after each save
//! OUT/step_N/config.json          model name and config
//! OUT/step_N/trainer_state.json   step, epoch, sampler position, RNG, schedule, optimizer
//! OUT/step_N/ckpt_<r>/{model.safetensors, strategy.json, config.json, trainer_state.json}  (sliced)
//! OUT/step_N/model.safetensors                                                          (integrated)
//! ```
//!
//! A save is written to `OUT/step_N.tmp/`, all ranks meet at a barrier, then rank 0
//! renames it to `OUT/step_N/` and updates `latest`: a crash leaves the previous
//! checkpoint intact and the partial one under a `.tmp` name.

use crate::comm::Dist;
use crate::error::{Error, IoContext, Result};
use crate::optim::{OptimConfig, Schedule};
use crate::params::place_local;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::layout::{Dtype, TensorLayout};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Name of the model config file.
pub const CONFIG_FILE: &str = "config.json";
/// Name of the trainer state file.
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// Name of the pointer to the newest checkpoint in an output directory.
pub const LATEST_FILE: &str = "latest";
/// `format` of a trainer state file.
pub const TRAINER_STATE_FORMAT: &str = "ckpt-trainer-state";

/// How checkpoints are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SaveMode {
    /// One directory per rank with `strategy.json` (ckpt's sliced format).
    Sliced,
    /// Whole tensors in the Hugging Face layout.
    Integrated,
}

/// The random state: every draw is derived from `(seed, epoch, step)` (sampler
/// shuffles, augmentation), so these three numbers are the whole state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// How draws are derived.
    pub kind: String,
    /// Seed of the run.
    pub seed: u64,
    /// Epoch whose shuffle is in use.
    pub epoch: u64,
    /// Updates done.
    pub step: u64,
}

/// Where the learning-rate schedule is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleState {
    /// Shape of the schedule.
    pub kind: Schedule,
    /// Peak learning rate.
    pub base_lr: f64,
    /// Warmup updates.
    pub warmup: u64,
    /// Updates the schedule spans.
    pub total_steps: u64,
    /// Updates done (the next update uses `lr_at(position)`).
    pub position: u64,
}

/// The trainer state saved beside the weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Always [`TRAINER_STATE_FORMAT`].
    pub format: String,
    /// Version of this format (1).
    pub version: u64,
    /// Updates done.
    pub step: u64,
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Sampler position: batches of `epoch` already consumed.
    pub batch_in_epoch: u64,
    /// Updates per epoch.
    pub steps_per_epoch: u64,
    /// Global batch size.
    pub global_batch: usize,
    /// Random state.
    pub rng: RngState,
    /// Learning-rate schedule.
    pub schedule: ScheduleState,
    /// Optimizer hyper-parameters.
    pub optimizer: OptimConfig,
    /// Whether optimizer state was split over `dp` when saved.
    pub shard_optimizer: bool,
    /// Whether BatchNorm was synchronized.
    pub sync_bn: bool,
    /// The mesh it was saved from.
    pub mesh: String,
    /// The data set.
    pub data: String,
    /// Training images used (`--train-limit`), when limited.
    #[serde(default)]
    pub train_limit: Option<usize>,
    /// Test images used (`--test-limit`), when limited.
    #[serde(default)]
    pub test_limit: Option<usize>,
    /// Mean training loss of the last update.
    pub loss: Option<f32>,
}

/// Reads and checks a trainer state file.
///
/// # Errors
/// Unreadable, malformed, or of another format or version.
pub fn read_trainer_state(path: &Path) -> Result<TrainerState> {
    let text = std::fs::read_to_string(path).at(path)?;
    let s: TrainerState = serde_json::from_str(&text).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })?;
    if s.format != TRAINER_STATE_FORMAT || s.version != 1 {
        return Err(Error::BadCheckpoint {
            path: path.to_path_buf(),
            problem: format!(
                "trainer state format `{}` version {} is not {TRAINER_STATE_FORMAT} 1",
                s.format, s.version
            ),
        });
    }
    Ok(s)
}

/// The checkpoint directory that `dir` designates: `dir` itself, or the one its
/// `latest` file names.
///
/// # Errors
/// A path that does not exist; an unreadable `latest` file.
pub fn resolve_checkpoint(dir: &Path) -> Result<PathBuf> {
    if let Err(e) = std::fs::metadata(dir) {
        return Err(Error::BadCheckpoint {
            path: dir.to_path_buf(),
            problem: match e.kind() {
                std::io::ErrorKind::NotFound => "no such file or directory".into(),
                _ => e.to_string(),
            },
        });
    }
    let latest = dir.join(LATEST_FILE);
    if latest.is_file() {
        let name = std::fs::read_to_string(&latest).at(&latest)?;
        return Ok(dir.join(name.trim()));
    }
    Ok(dir.to_path_buf())
}

/// Finds `name` (config or trainer state) in a checkpoint: in its root, or in its
/// first rank directory.
#[must_use]
pub fn find_meta_file(dir: &Path, name: &str) -> Option<PathBuf> {
    let p = dir.join(name);
    if p.is_file() {
        return Some(p);
    }
    let mut ranks: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("ckpt_"))
        })
        .collect();
    ranks.sort();
    ranks
        .into_iter()
        .map(|r| r.join(name))
        .find(|p| p.is_file())
}

/// A full (global) tensor, gathered on rank 0.
#[derive(Clone, Debug, PartialEq)]
pub struct FullTensor {
    /// Global shape.
    pub shape: Vec<u64>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// Gathers every rank's local tensors into whole tensors on world rank 0 (`None`
/// elsewhere). `locals` are this rank's tensors, in the same order on every rank, with
/// their layouts. Replicated tensors take rank 0's copy.
///
/// # Errors
/// Collective errors.
pub fn gather_full(
    dist: &Dist,
    locals: &[(String, TensorLayout, Vec<f32>)],
) -> Result<Option<BTreeMap<String, FullTensor>>> {
    let flat: Vec<f32> = locals
        .iter()
        .flat_map(|(_, _, v)| v.iter().copied())
        .collect();
    let Some(parts) = dist.world.gather(&flat, 0)? else {
        return Ok(None);
    };
    let mut out = BTreeMap::new();
    let mut fulls: Vec<Vec<f32>> = locals
        .iter()
        .map(|(_, l, _)| vec![0f32; l.shape.iter().product::<u64>() as usize])
        .collect();
    // Place in descending rank order so rank 0's copy of replicated data wins.
    for r in (0..parts.len()).rev() {
        let mut at = 0;
        for (i, (_, l, _)) in locals.iter().enumerate() {
            let n = l
                .local_shape(&dist.mesh, r as u64)
                .map_or(0, |s| s.iter().product::<u64>() as usize);
            place_local(
                &parts[r][at..at + n],
                l,
                &dist.mesh,
                r as u64,
                &mut fulls[i],
            );
            at += n;
        }
    }
    for ((name, l, _), data) in locals.iter().zip(fulls) {
        out.insert(
            name.clone(),
            FullTensor {
                shape: l.shape.clone(),
                data,
            },
        );
    }
    Ok(Some(out))
}

/// Little-endian bytes of `f32` values.
#[must_use]
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `f32` values of little-endian bytes.
#[must_use]
pub fn f32_from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// What one save writes.
pub(crate) struct SaveRequest<'a> {
    pub(crate) out: &'a Path,
    pub(crate) step: u64,
    pub(crate) mode: SaveMode,
    pub(crate) compression: Option<ckpt_core::formats::ckptz::Compression>,
    pub(crate) keep: usize,
    pub(crate) strategy: &'a Strategy,
    pub(crate) config_json: &'a str,
    pub(crate) state: &'a TrainerState,
}

fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step_")?.parse().ok()
}

/// One save, prepared: the temporary directory exists, and this rank holds what it
/// writes (its own slices, or for the lead of an integrated save, the gathered
/// tensors). Writing it needs no collective, so it can run beside training.
struct SaveJob {
    out: PathBuf,
    name: String,
    keep: usize,
    rank: usize,
    world: usize,
    lead: bool,
    compression: Option<ckpt_core::formats::ckptz::Compression>,
    strategy: Strategy,
    config_json: String,
    state_json: String,
    data: SaveData,
}

enum SaveData {
    /// This rank's slices (sliced checkpoints). Kept as floats: turning them into
    /// bytes is the writer's work, not the stall's.
    Slices(Vec<(String, Vec<f32>)>),
    /// The whole tensors (the lead of an integrated save).
    Whole(Vec<(String, Vec<u64>, Vec<f32>)>),
    /// Nothing to write (the other ranks of an integrated save).
    Nothing,
}

impl SaveJob {
    fn tmp(&self) -> PathBuf {
        self.out.join(format!("{}.tmp", self.name))
    }

    /// Collective: the lead clears leftovers and makes the temporary directory, every
    /// rank snapshots what it writes (and an integrated save gathers the tensors).
    fn prepare(
        dist: &Dist,
        req: &SaveRequest<'_>,
        locals: Vec<(String, TensorLayout, Vec<f32>)>,
    ) -> Result<SaveJob> {
        let name = format!("step_{}", req.step);
        let lead = dist.rank == 0;
        let tmp = req.out.join(format!("{name}.tmp"));
        if lead {
            // Leftovers of killed saves (`step_K.tmp`) and prunes (`.step_K.pruned-*`)
            // are never checkpoints: `latest` only ever names a complete `step_N`.
            remove_leftovers(req.out)?;
            ckpt_core::formats::output::remove_stale_temps(&req.out.join(&name));
            std::fs::create_dir_all(&tmp).at(&tmp)?;
        }
        dist.world.barrier()?;
        let data = match req.mode {
            // Moved, not copied: the snapshot is the caller's one copy.
            SaveMode::Sliced => {
                SaveData::Slices(locals.into_iter().map(|(n, _, v)| (n, v)).collect())
            }
            SaveMode::Integrated => match gather_full(dist, &locals)? {
                Some(full) => SaveData::Whole(
                    full.into_iter()
                        .map(|(n, t)| (n, t.shape, t.data))
                        .collect(),
                ),
                None => SaveData::Nothing,
            },
        };
        Ok(SaveJob {
            out: req.out.to_path_buf(),
            name,
            keep: req.keep,
            rank: dist.rank,
            world: dist.world.size(),
            lead,
            compression: req.compression,
            strategy: req.strategy.clone(),
            config_json: req.config_json.to_string(),
            state_json: serde_json::to_string_pretty(req.state).expect("trainer state serializes"),
            data,
        })
    }

    /// This rank's files, in the temporary directory. No collective.
    fn write(&self) -> Result<()> {
        let tmp = self.tmp();
        // For tests: `CKPT_TEST_SAVE_FAIL=<rank>:<step>` makes that rank's part of that
        // step's save fail, as a full disk would.
        if std::env::var("CKPT_TEST_SAVE_FAIL")
            .is_ok_and(|v| v == format!("{}:{}", self.rank, self.name.trim_start_matches("step_")))
        {
            return Err(Error::BadCheckpoint {
                path: tmp,
                problem: "writing failed (CKPT_TEST_SAVE_FAIL)".into(),
            });
        }
        match &self.data {
            SaveData::Slices(floats) => {
                let bytes: Vec<(&str, Vec<u8>)> = floats
                    .iter()
                    .map(|(n, v)| (n.as_str(), f32_bytes(v)))
                    .collect();
                let refs: Vec<(&str, &[u8])> =
                    bytes.iter().map(|(n, b)| (*n, b.as_slice())).collect();
                let rank_dir = ckpt_core::engine::save::write_rank_with(
                    &tmp,
                    &self.strategy,
                    self.rank as u64,
                    &refs,
                    false,
                    self.compression,
                )?;
                ckpt_core::formats::output::write_file_atomic(
                    &rank_dir.join(CONFIG_FILE),
                    self.config_json.as_bytes(),
                )?;
                ckpt_core::formats::output::write_file_atomic(
                    &rank_dir.join(TRAINER_STATE_FILE),
                    self.state_json.as_bytes(),
                )?;
            }
            SaveData::Whole(floats) => {
                let bytes: Vec<Vec<u8>> = floats.iter().map(|(_, _, v)| f32_bytes(v)).collect();
                let refs: Vec<(&str, Dtype, &[u64], &[u8])> = floats
                    .iter()
                    .zip(&bytes)
                    .map(|((n, s, _), b)| (n.as_str(), Dtype::F32, s.as_slice(), b.as_slice()))
                    .collect();
                ckpt_core::engine::save::write_integrated_with(&tmp, &refs, self.compression)?;
            }
            SaveData::Nothing => {}
        }
        if self.lead {
            ckpt_core::formats::output::write_file_atomic(
                &tmp.join(CONFIG_FILE),
                self.config_json.as_bytes(),
            )?;
            ckpt_core::formats::output::write_file_atomic(
                &tmp.join(TRAINER_STATE_FILE),
                self.state_json.as_bytes(),
            )?;
        }
        Ok(())
    }

    /// The lead's last part, once every rank has written: swap the directory in and
    /// point `latest` at it. No collective.
    fn commit(&self) -> Result<PathBuf> {
        let tmp = self.tmp();
        let fin = self.out.join(&self.name);
        // `step_N` may exist (resuming from an older step into the same --out) and
        // `latest` may name it: swap the new one in atomically, so that it names a
        // complete checkpoint, old or new, at every instant.
        ckpt_core::formats::output::replace_atomically(&tmp, &fin)?;
        if let Ok(d) = std::fs::File::open(&self.out) {
            let _ = d.sync_all();
        }
        ckpt_core::formats::output::write_file_atomic(
            &self.out.join(LATEST_FILE),
            format!("{}\n", self.name).as_bytes(),
        )?;
        if self.keep > 0 {
            prune(&self.out, self.keep, &self.name)?;
        }
        Ok(fin)
    }

    /// Where ranks of a background save say they are done (or failed), beside the
    /// temporary directory (not in it: it is renamed whole).
    fn marks(&self) -> PathBuf {
        self.out.join(format!(".{}.ranks", self.name))
    }
}

/// Saves a checkpoint collectively: every rank calls this with its local tensors, and
/// returns when the checkpoint is complete and `latest` names it. Returns the final
/// directory.
pub(crate) fn save(
    dist: &Dist,
    req: &SaveRequest<'_>,
    locals: Vec<(String, TensorLayout, Vec<f32>)>,
) -> Result<PathBuf> {
    let job = SaveJob::prepare(dist, req, locals)?;
    job.write()?;
    dist.world.barrier()?;
    if job.lead {
        job.commit()?;
    }
    dist.world.barrier()?;
    Ok(job.out.join(&job.name))
}

/// Saves that do not stall training: [`AsyncSaver::start`] snapshots this rank's
/// tensors into host memory (the stall) and writes them on a thread of its own while
/// training goes on. Ranks do not meet again for it: each marks its part done in a
/// directory beside the checkpoint (`.step_N.ranks/<rank>`, or `<rank>.failed` with the
/// error), and the lead's thread commits (`step_N`, then `latest`) once every rank's
/// mark is there; a failure anywhere leaves `latest` on the previous checkpoint. At most
/// one save is in flight per rank: the next [`AsyncSaver::start`] and
/// [`AsyncSaver::finish`] wait for it and report its error.
#[derive(Default)]
pub(crate) struct AsyncSaver {
    running: Option<std::thread::JoinHandle<Result<PathBuf>>>,
}

impl AsyncSaver {
    /// Waits for the save in flight; its directory, or its error.
    pub(crate) fn finish(&mut self) -> Result<Option<PathBuf>> {
        match self.running.take() {
            None => Ok(None),
            Some(h) => match h.join() {
                Ok(r) => r.map(Some),
                Err(_) => Err(Error::BadCheckpoint {
                    path: PathBuf::from("(background save)"),
                    problem: "the saving thread panicked".into(),
                }),
            },
        }
    }

    /// Waits for the previous save, then starts this one; returns the directory it will
    /// be (complete once `latest` names it).
    pub(crate) fn start(
        &mut self,
        dist: &Dist,
        req: &SaveRequest<'_>,
        locals: Vec<(String, TensorLayout, Vec<f32>)>,
    ) -> Result<PathBuf> {
        self.finish()?;
        let job = SaveJob::prepare(dist, req, locals)?;
        let marks = job.marks();
        if job.lead {
            let _ = std::fs::remove_dir_all(&marks);
            std::fs::create_dir_all(&marks).at(&marks)?;
        }
        // Every rank sees the marks directory before any writes a mark.
        dist.world.barrier()?;
        let fin = job.out.join(&job.name);
        let timeout = save_timeout();
        self.running = Some(std::thread::spawn(move || -> Result<PathBuf> {
            let written = job.write();
            let mark = marks.join(match &written {
                Ok(()) => job.rank.to_string(),
                Err(_) => format!("{}.failed", job.rank),
            });
            let text = written
                .as_ref()
                .err()
                .map(ToString::to_string)
                .unwrap_or_default();
            std::fs::write(&mark, text).at(&mark)?;
            written?;
            if job.lead {
                wait_for_marks(&marks, job.world, timeout)?;
                let fin = job.commit()?;
                let _ = std::fs::remove_dir_all(&marks);
                return Ok(fin);
            }
            Ok(job.out.join(&job.name))
        }));
        Ok(fin)
    }
}

/// How long the lead waits for the other ranks' parts: `CKPT_COMM_TIMEOUT` seconds, as
/// for collectives, or ten minutes.
fn save_timeout() -> std::time::Duration {
    std::env::var("CKPT_COMM_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0 && s.is_finite())
        .map_or(
            std::time::Duration::from_secs(600),
            std::time::Duration::from_secs_f64,
        )
}

/// Waits until every rank's mark is in `marks`; a failed rank's error, or a timeout,
/// stops the commit.
fn wait_for_marks(marks: &Path, world: usize, timeout: std::time::Duration) -> Result<()> {
    let start = std::time::Instant::now();
    loop {
        let mut done = 0;
        for e in std::fs::read_dir(marks).at(marks)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(r) = name.strip_suffix(".failed") {
                let why = std::fs::read_to_string(e.path()).unwrap_or_default();
                return Err(Error::BadCheckpoint {
                    path: marks.to_path_buf(),
                    problem: format!("rank {r} could not write its part of the checkpoint: {why}"),
                });
            }
            done += usize::from(name.parse::<usize>().is_ok());
        }
        if done >= world {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(Error::BadCheckpoint {
                path: marks.to_path_buf(),
                problem: format!(
                    "{done} of {world} ranks wrote their part within {timeout:?}: the checkpoint is not committed"
                ),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Removes all but the newest `keep` `step_N` directories of `out`, never `current`
/// (the one `latest` now names, which need not be the newest after a resume from an
/// older step). Each is first renamed to `.step_N.pruned-<pid>`, so that a prune killed
/// half-way leaves no half-deleted `step_N`, only a hidden leftover.
fn prune(out: &Path, keep: usize, current: &str) -> Result<()> {
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(out)
        .at(out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .filter_map(|p| Some((step_of(p.file_name()?.to_str()?)?, p)))
        .filter(|(_, p)| p.file_name().is_some_and(|n| n != current))
        .collect();
    steps.sort();
    let n = steps.len();
    for (step, p) in steps
        .into_iter()
        .take(n.saturating_sub(keep.saturating_sub(1)))
    {
        let gone = out.join(format!(".step_{step}.pruned-{}", std::process::id()));
        std::fs::rename(&p, &gone).at(&p)?;
        std::fs::remove_dir_all(&gone).at(&gone)?;
    }
    Ok(())
}

/// Removes what killed saves and prunes left in `out`.
fn remove_leftovers(out: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let leftover = (name.starts_with("step_") && name.ends_with(".tmp"))
            || (name.starts_with(".step_")
                && (name.contains(".pruned-") || name.ends_with(".ranks")));
        if leftover && e.path().is_dir() {
            std::fs::remove_dir_all(e.path()).at(&e.path())?;
        }
    }
    Ok(())
}

/// The names of the tensors a checkpoint holds.
///
/// # Errors
/// An unreadable checkpoint.
pub fn checkpoint_tensor_names(dir: &Path) -> Result<Vec<String>> {
    Ok(checkpoint_tensor_dtypes(dir)?.into_keys().collect())
}

/// The tensors a checkpoint holds, with their dtypes.
///
/// # Errors
/// An unreadable checkpoint.
pub(crate) fn checkpoint_tensor_dtypes(
    dir: &Path,
) -> Result<std::collections::BTreeMap<String, Dtype>> {
    let c = ckpt_core::Checkpoint::open(&[dir.to_path_buf()])?;
    Ok(c.tensors.into_iter().map(|(n, t)| (n, t.dtype)).collect())
}

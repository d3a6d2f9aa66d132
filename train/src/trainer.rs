//! The training loop: plan the run from a [`TrainConfig`], run one thread per rank,
//! report from rank 0.

use crate::checkpoint::{
    checkpoint_tensor_dtypes, f32_from_bytes, find_meta_file, gather_full, read_trainer_state,
    resolve_checkpoint, save, AsyncSaver, FullTensor, RngState, SaveMode, SaveRequest,
    ScheduleState, TrainerState, CONFIG_FILE, TRAINER_STATE_FILE, TRAINER_STATE_FORMAT,
};
use crate::comm::{check_mesh, Dist, ReduceOp};
use crate::config::TrainConfig;
use crate::data::{DataSource, Dataset, DistributedSampler, Split};
use crate::device::DeviceKind;
use crate::error::{Error, IoContext, Result};
use crate::events::EventWriter;
use crate::kernels::Kernels;
use crate::launch::Backend;
use crate::layers::ModelCtx;
use crate::models::{build_model, Model, ModelConfig, ModelKind};
use crate::optim::{
    lr_at, state_layout, state_tensor_name, OptimConfig, Optimizer, OptimizerKind, Schedule,
};
use crate::params::{init_global, slice_local, ParamSpec, ShardedVars};
use candle_core::{Device, Var};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::layout::{Dtype, TensorLayout};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What a run did, as seen from rank 0.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// The mesh trained on.
    pub mesh: String,
    /// The model and its configuration.
    pub model: ModelConfig,
    /// Updates done before this run (0 unless resumed).
    pub start_step: u64,
    /// Updates done at the end, in total.
    pub steps: u64,
    /// Epochs completed, in total.
    pub epochs: u64,
    /// Training loss (mean over the global batch) of each update of this run.
    pub losses: Vec<f32>,
    /// Test accuracy after each epoch completed in this run: `(epoch, accuracy)`.
    pub test_accuracy: Vec<(u64, f32)>,
    /// Training throughput (images per second, all ranks together, evaluation and
    /// saving excluded).
    pub images_per_sec: f64,
    /// Wall time of the run in seconds.
    pub seconds: f64,
    /// Checkpoint directories written, oldest first.
    pub checkpoints: Vec<PathBuf>,
    /// The final full weights (parameters, buffers, optimizer state), when
    /// [`TrainConfig::gather_weights`] was set.
    pub weights: Option<BTreeMap<String, FullTensor>>,
    /// How long the training loop stood still for each save (rank 0), in seconds:
    /// the copy into memory, or with [`TrainConfig::sync_save`] the whole save.
    pub save_stalls: Vec<f64>,
    /// Wall time of each training step of this run (rank 0), in seconds, saves and
    /// evaluation excluded: benchmarks leave out the first (warm-up) steps.
    pub step_seconds: Vec<f64>,
    /// The TensorBoard event file written during the run (with `--out`, by rank 0).
    pub events: Option<PathBuf>,
}

impl TrainReport {
    /// The last test accuracy measured.
    #[must_use]
    pub fn final_accuracy(&self) -> Option<f32> {
        self.test_accuracy.last().map(|a| a.1)
    }
}

/// Where a resumed run starts.
#[derive(Clone, Debug)]
struct Resume {
    dir: PathBuf,
    state: TrainerState,
    names: BTreeSet<String>,
    /// Tensors stored in another float type, cast to F32 on load.
    cast: BTreeMap<String, Dtype>,
}

/// Everything a rank needs, resolved and checked once.
struct Plan {
    mesh: Mesh,
    source: DataSource,
    data: Split,
    train_limit: Option<usize>,
    test_limit: Option<usize>,
    model: ModelConfig,
    specs: Vec<ParamSpec>,
    optim: OptimConfig,
    base_lr: f64,
    schedule: Schedule,
    warmup: u64,
    total_steps: u64,
    steps_per_epoch: u64,
    global_batch: usize,
    local_batch: usize,
    seed: u64,
    sync_bn: bool,
    zero: bool,
    epochs: u64,
    max_steps: Option<u64>,
    save: SaveMode,
    compress: Option<ckpt_core::formats::ckptz::Compression>,
    save_every: u64,
    keep: usize,
    out: Option<PathBuf>,
    resume: Option<Resume>,
    eval: bool,
    gather_weights: bool,
    async_save: bool,
    backend: Backend,
    device: DeviceKind,
    portable_kernels: bool,
}

fn default_mesh(kind: ModelKind) -> &'static str {
    match kind {
        ModelKind::Resnet => "dp=4",
        _ => "dp=2,tp=2",
    }
}

fn check_model_fits(model: &ModelConfig, d: &Dataset) -> Result<()> {
    let name = model.kind().to_string();
    if model.classes() < d.classes {
        return Err(Error::model(
            &name,
            format!("{} classes but the data has {}", model.classes(), d.classes),
        ));
    }
    match model {
        ModelConfig::Mlp(c) if c.in_features != d.image_len() => Err(Error::model(
            &name,
            format!(
                "in_features {} but images have {} values",
                c.in_features,
                d.image_len()
            ),
        )),
        ModelConfig::Vit(c)
            if c.image_size != d.height || c.image_size != d.width || c.channels != d.channels =>
        {
            Err(Error::model(
                &name,
                format!(
                    "image_size {} x {} channels but images are {}x{}x{}",
                    c.image_size, c.channels, d.channels, d.height, d.width
                ),
            ))
        }
        ModelConfig::Resnet(c) if c.channels != d.channels => Err(Error::model(
            &name,
            format!("{} channels but images have {}", c.channels, d.channels),
        )),
        _ => Ok(()),
    }
}

fn read_model_config(path: &Path) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(path).at(path)?;
    serde_json::from_str(&text).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })
}

impl Plan {
    fn new(cfg: &TrainConfig) -> Result<Plan> {
        let resume = match &cfg.resume {
            Some(r) => {
                let dir = resolve_checkpoint(r)?;
                let sp = find_meta_file(&dir, TRAINER_STATE_FILE).ok_or_else(|| {
                    Error::BadCheckpoint {
                        path: dir.clone(),
                        problem: format!("no {TRAINER_STATE_FILE}"),
                    }
                })?;
                let state = read_trainer_state(&sp)?;
                let dtypes = checkpoint_tensor_dtypes(&dir)?;
                let mut cast = BTreeMap::new();
                for (name, &dt) in &dtypes {
                    match dt {
                        Dtype::F32 => {}
                        Dtype::BF16 | Dtype::F16 | Dtype::F64 => {
                            cast.insert(name.clone(), dt);
                        }
                        other => {
                            return Err(Error::BadCheckpoint {
                                path: dir.clone(),
                                problem: format!(
                                    "tensor `{name}` is {other:?}: only float tensors are trained"
                                ),
                            })
                        }
                    }
                }
                let names = dtypes.into_keys().collect();
                Some(Resume {
                    dir,
                    state,
                    names,
                    cast,
                })
            }
            None => None,
        };
        let resumed_model = match &resume {
            Some(r) => {
                let p =
                    find_meta_file(&r.dir, CONFIG_FILE).ok_or_else(|| Error::BadCheckpoint {
                        path: r.dir.clone(),
                        problem: format!("no {CONFIG_FILE}"),
                    })?;
                Some(read_model_config(&p)?)
            }
            None => None,
        };
        let kind = resumed_model.as_ref().map_or(cfg.model, ModelConfig::kind);
        let mesh_text = match (&cfg.mesh, cfg.ranks) {
            (Some(m), _) => m.clone(),
            (None, Some(n)) => format!("dp={n}"),
            (None, None) => default_mesh(kind).to_string(),
        };
        let mesh = Mesh::parse(&mesh_text)?;
        check_mesh(&mesh)?;
        cfg.device.check()?;
        let dp = mesh
            .axis_index("dp")
            .map_or(1, |a| mesh.axes()[a].size as usize);
        let tp = mesh
            .axis_index("tp")
            .map_or(1, |a| mesh.axes()[a].size as usize);

        let data_text = match &resume {
            Some(r) if cfg.data == "digits" => r.state.data.clone(),
            _ => cfg.data.clone(),
        };
        let source = DataSource::parse(&data_text)?;
        let mut data = source.load()?;
        let saved =
            |f: fn(&TrainerState) -> Option<usize>| resume.as_ref().and_then(|r| f(&r.state));
        let train_limit = cfg.train_limit.or_else(|| saved(|s| s.train_limit));
        let test_limit = cfg.test_limit.or_else(|| saved(|s| s.test_limit));
        if let Some(n) = train_limit {
            data.train = data.train.truncate(n);
        }
        if let Some(n) = test_limit {
            data.test = data.test.truncate(n);
        }
        let t = &data.train;
        let model = match (resumed_model, &cfg.model_config) {
            (Some(m), _) => m,
            (None, Some(json)) => {
                let inner: serde_json::Value = serde_json::from_str(json)
                    .map_err(|e| Error::option("--model-config", e.to_string()))?;
                serde_json::from_value(serde_json::json!({ "model": kind, "config": inner }))
                    .map_err(|e| Error::option("--model-config", e.to_string()))?
            }
            (None, None) => {
                ModelConfig::for_data(kind, t.channels, t.height, t.width, t.classes, cfg.depth)
            }
        };
        check_model_fits(&model, t)?;
        let specs = model.specs(tp)?;

        let (optim, base_lr, schedule, warmup, global_batch, seed) = match &resume {
            Some(r) => {
                let s = &r.state;
                (
                    s.optimizer.clone(),
                    s.schedule.base_lr,
                    s.schedule.kind,
                    s.schedule.warmup,
                    s.global_batch,
                    s.rng.seed,
                )
            }
            None => {
                let adam = cfg.optimizer == OptimizerKind::Adamw;
                let optim = OptimConfig {
                    kind: cfg.optimizer,
                    momentum: cfg.momentum,
                    weight_decay: cfg.weight_decay.unwrap_or(if adam { 0.01 } else { 5e-4 }),
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                };
                (
                    optim,
                    cfg.lr.unwrap_or(if adam { 5e-3 } else { 0.1 }),
                    cfg.schedule,
                    cfg.warmup,
                    cfg.batch_size,
                    cfg.seed,
                )
            }
        };
        if global_batch == 0 || global_batch % dp != 0 {
            return Err(Error::option(
                "--batch-size",
                format!("global batch {global_batch} must be a positive multiple of dp={dp}"),
            ));
        }
        let local_batch = global_batch / dp;
        let per_rank = t.len().div_ceil(dp);
        let steps_per_epoch = (per_rank / local_batch) as u64;
        if steps_per_epoch == 0 {
            return Err(Error::option(
                "--batch-size",
                format!(
                    "{} training images give no full batch of {global_batch} over dp={dp}",
                    t.len()
                ),
            ));
        }
        let total_steps = match &resume {
            Some(r) => r.state.schedule.total_steps,
            None => cfg.epochs * steps_per_epoch,
        };
        if cfg.save_every > 0 && cfg.out.is_none() {
            return Err(Error::option("--save-every", "needs --out DIR"));
        }
        let sync_bn = cfg.sync_bn || resume.as_ref().is_some_and(|r| r.state.sync_bn);
        if let Some(r) = &resume {
            // A resume with nothing left to do is a mistake to say, not a run that ends
            // at once with exit 0.
            let end = cfg
                .max_steps
                .unwrap_or(u64::MAX)
                .min(cfg.epochs.saturating_mul(steps_per_epoch));
            if r.state.step >= end {
                let done_epochs = r.state.step.div_ceil(steps_per_epoch.max(1));
                return Err(Error::option(
                    "--epochs",
                    format!(
                        "{} is at step {} (epoch {}), and --epochs {}{} ends at step {end}: nothing left to do; continue with --epochs {} or more",
                        r.dir.display(),
                        r.state.step,
                        r.state.epoch,
                        cfg.epochs,
                        cfg.max_steps.map(|m| format!(" --max-steps {m}")).unwrap_or_default(),
                        done_epochs + 1
                    ),
                ));
            }
        }
        Ok(Plan {
            mesh,
            source,
            data,
            train_limit,
            test_limit,
            model,
            specs,
            optim,
            base_lr,
            schedule,
            warmup,
            total_steps,
            steps_per_epoch,
            global_batch,
            local_batch,
            seed,
            sync_bn,
            zero: cfg.shard_optimizer,
            epochs: cfg.epochs,
            max_steps: cfg.max_steps,
            save: cfg.save,
            compress: cfg.compress,
            save_every: cfg.save_every,
            keep: cfg.keep,
            out: cfg.out.clone(),
            resume,
            eval: !cfg.no_eval,
            gather_weights: cfg.gather_weights,
            async_save: !cfg.sync_save,
            backend: cfg.backend,
            device: cfg.device,
            portable_kernels: cfg.portable_kernels,
        })
    }

    /// What a resume does not take from the checkpoint as it is: optimizer state that
    /// is missing (started from zero), tensors stored in another float type (cast to
    /// F32).
    fn resume_warnings(&self) -> Vec<String> {
        let Some(r) = &self.resume else {
            return vec![];
        };
        let mut out = Vec::new();
        let specs: BTreeSet<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
        let missing: Vec<String> = self
            .layouts()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !specs.contains(n.as_str()) && !r.names.contains(n))
            .collect();
        if !missing.is_empty() {
            out.push(format!(
                "{} has no optimizer state for {} tensor(s) (e.g. `{}`): the {} state ({}) starts from zero, as in a new run",
                r.dir.display(),
                missing.len(),
                missing[0],
                match self.optim.kind {
                    OptimizerKind::Sgd => "SGD",
                    OptimizerKind::Adamw => "AdamW",
                },
                self.optim.kind.state_names().join(", ")
            ));
        }
        if !r.cast.is_empty() {
            let mut by: BTreeMap<String, usize> = BTreeMap::new();
            for d in r.cast.values() {
                *by.entry(format!("{d:?}")).or_default() += 1;
            }
            let first = r.cast.keys().next().cloned().unwrap_or_default();
            out.push(format!(
                "{}: {} tensor(s) stored as {} (e.g. `{first}`) are cast to F32 to train: they keep the checkpoint's precision, not the original run's",
                r.dir.display(),
                r.cast.len(),
                by.iter().map(|(d, n)| format!("{n} {d}")).collect::<Vec<_>>().join(", ")
            ));
        }
        out
    }

    /// Layouts of every tensor a checkpoint of this run holds, in a fixed order.
    fn layouts(&self) -> Vec<(String, TensorLayout)> {
        let mut out: Vec<(String, TensorLayout)> = self
            .specs
            .iter()
            .map(|s| (s.name.clone(), s.layout(&self.mesh)))
            .collect();
        for s in self.specs.iter().filter(|s| s.hint.trainable) {
            for st in self.optim.kind.state_names() {
                out.push((
                    state_tensor_name(&s.name, st),
                    state_layout(s, &self.mesh, self.zero),
                ));
            }
        }
        out
    }

    fn strategy(&self, only: Option<&BTreeSet<String>>) -> Result<Strategy> {
        let mut s = Strategy::new(self.mesh.clone());
        for (name, l) in self.layouts() {
            if only.is_none_or(|o| o.contains(&name)) {
                s.insert(name, l)?;
            }
        }
        Ok(s)
    }
}

/// Mixes numbers into one seed (splitmix64 steps).
fn mix(parts: &[u64]) -> u64 {
    parts.iter().fold(0x853c_49e6_748f_ea9bu64, |h, &p| {
        let mut z = h ^ p.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// Replaces `buffers` by dp rank 0's values.
fn broadcast_buffers(buffers: &[Var], dist: &Dist) -> Result<()> {
    if buffers.is_empty() {
        return Ok(());
    }
    let mut flat = Vec::new();
    for b in buffers {
        flat.extend(crate::comm::tensor_to_vec(b.as_tensor())?);
    }
    dist.dp.broadcast(&mut flat, 0)?;
    let mut at = 0;
    for b in buffers {
        let t = b.as_tensor();
        let n = t.elem_count();
        b.set(&candle_core::Tensor::from_vec(
            flat[at..at + n].to_vec(),
            t.shape(),
            t.device(),
        )?)?;
        at += n;
    }
    Ok(())
}

struct RankResult {
    save_stalls: Vec<f64>,
    step_seconds: Vec<f64>,
    losses: Vec<f32>,
    accuracy: Vec<(u64, f32)>,
    checkpoints: Vec<PathBuf>,
    weights: Option<BTreeMap<String, FullTensor>>,
    train_seconds: f64,
    start_step: u64,
    steps: u64,
    epochs: u64,
    events: Option<PathBuf>,
}

/// Test accuracy: each dp rank evaluates its chunk of the test set; counts are summed.
fn evaluate(model: &Model, test: &Dataset, dist: &Dist, dev: &Device) -> Result<f32> {
    let (start, len) = crate::parallel::chunk(test.len(), dist.dp_size(), dist.dp_rank());
    let mut counts = [0f32, len as f32];
    let idx: Vec<usize> = (start..start + len).collect();
    for b in idx.chunks(256) {
        let (x, y) = test.batch(b, dev)?;
        let pred = model.forward(&x, false)?.argmax(1)?;
        counts[0] += pred
            .eq(&y)?
            .to_dtype(candle_core::DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
    }
    dist.dp.all_reduce(&mut counts, ReduceOp::Sum)?;
    Ok(if counts[1] > 0.0 {
        counts[0] / counts[1]
    } else {
        0.0
    })
}

fn rank_main(plan: &Plan, dist: Dist, progress: bool) -> Result<RankResult> {
    let rank = dist.rank as u64;
    let mesh = &plan.mesh;
    let dev = plan.device.for_rank(plan.backend, dist.rank)?;
    let lead = dist.rank == 0;

    // Local tensors: from the checkpoint (resharded on load) or initialised globally.
    let mut loaded: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    if let Some(r) = &plan.resume {
        for s in &plan.specs {
            if !r.names.contains(&s.name) {
                return Err(Error::BadCheckpoint {
                    path: r.dir.clone(),
                    problem: format!("tensor `{}` of the model is missing", s.name),
                });
            }
        }
        let target = plan.strategy(Some(&r.names))?;
        for (name, t) in ckpt_core::engine::save::load_rank(&r.dir, &target, rank)? {
            let values = match t.dtype {
                Dtype::F32 => f32_from_bytes(&t.data),
                // Said before training (`resume_warnings`).
                Dtype::BF16 => t
                    .data
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                Dtype::F16 => t
                    .data
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                Dtype::F64 => t
                    .data
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                    .collect(),
                other => {
                    return Err(Error::BadCheckpoint {
                        path: r.dir.clone(),
                        problem: format!(
                            "tensor `{name}` is {other:?}; only float tensors are trained"
                        ),
                    })
                }
            };
            loaded.insert(name, values);
        }
    }
    let mut vars: BTreeMap<String, Var> = BTreeMap::new();
    for s in &plan.specs {
        let l = s.layout(mesh);
        let shape: Vec<usize> = l
            .local_shape(mesh, rank)
            .unwrap_or_default()
            .iter()
            .map(|&d| d as usize)
            .collect();
        let data = match loaded.remove(&s.name) {
            Some(d) => d,
            None => slice_local(&init_global(s, plan.seed), &l, mesh, rank),
        };
        vars.insert(s.name.clone(), Var::from_vec(data, shape, &dev)?);
    }
    let ctx = ModelCtx {
        tp: dist.tp.clone(),
        dp: dist.dp.clone(),
        sync_bn: plan.sync_bn,
        kernels: if plan.portable_kernels {
            Kernels::Portable
        } else {
            Kernels::for_device(&dev)
        },
    };
    let vb = ShardedVars::serve_vars(&vars, dist.tp_size(), dist.tp_rank()).into_var_builder();
    let model = build_model(&plan.model, &vb, &ctx)?;
    let trainable: Vec<(String, Var, ParamSpec)> = plan
        .specs
        .iter()
        .filter(|s| s.hint.trainable)
        .map(|s| (s.name.clone(), vars[&s.name].clone(), s.clone()))
        .collect();
    let mut opt = Optimizer::new(plan.optim.clone(), trainable, &dist, plan.zero)?;
    opt.load_state(&loaded)?;
    // Buffers (BatchNorm running statistics) that dp ranks compute apart are replaced
    // by dp rank 0's after every update, as DDP's broadcast_buffers does, so every rank
    // holds what the checkpoint (which stores them once) holds.
    let buffers: Vec<Var> = if plan.sync_bn || dist.dp_size() == 1 {
        Vec::new()
    } else {
        plan.specs
            .iter()
            .filter(|s| !s.hint.trainable)
            .map(|s| vars[&s.name].clone())
            .collect()
    };

    let train = &plan.data.train;
    let sampler = DistributedSampler {
        len: train.len(),
        replicas: dist.dp_size(),
        rank: dist.dp_rank(),
        seed: plan.seed,
        shuffle: true,
    };
    let spe = plan.steps_per_epoch;
    let (mut step, mut epoch, mut skip) = match &plan.resume {
        Some(r) => (r.state.step, r.state.epoch, r.state.batch_in_epoch),
        None => (0, 0, 0),
    };
    let start_step = step;
    let end_step = plan
        .max_steps
        .unwrap_or(u64::MAX)
        .min(plan.epochs.saturating_mul(spe))
        .max(step);

    let bar = if lead && progress {
        ProgressBar::with_draw_target(Some(end_step - step), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    let say = |line: String| {
        if lead && progress {
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
    };

    let layouts = plan.layouts();
    let strategy = plan.strategy(None)?;
    let config_json = plan.model.to_json();
    let mut result = RankResult {
        save_stalls: Vec::new(),
        step_seconds: Vec::new(),
        losses: Vec::new(),
        accuracy: Vec::new(),
        checkpoints: Vec::new(),
        weights: None,
        train_seconds: 0.0,
        start_step,
        steps: step,
        epochs: epoch,
        events: None,
    };
    // The curves, live: `train/loss` and `train/images_per_sec` at each update's global
    // step (so that a resumed run continues them), `test/accuracy` at each epoch number.
    let mut events = match &plan.out {
        Some(out) if lead => Some(EventWriter::create(out)?),
        _ => None,
    };
    let mut last_loss = None;
    let mut last_saved = plan.resume.as_ref().map(|r| r.state.step);

    let locals = |opt: &Optimizer| -> Result<Vec<(String, TensorLayout, Vec<f32>)>> {
        let states: BTreeMap<String, &[f32]> = opt.state().into_iter().collect();
        layouts
            .iter()
            .map(|(name, l)| {
                let v = match vars.get(name) {
                    Some(var) => crate::comm::tensor_to_vec(var.as_tensor())?,
                    None => states.get(name).map(|s| s.to_vec()).unwrap_or_default(),
                };
                Ok((name.clone(), l.clone(), v))
            })
            .collect()
    };
    let state_at = |step: u64, epoch: u64, batch: u64, loss: Option<f32>| -> TrainerState {
        let (epoch, batch) = if batch >= spe {
            (epoch + 1, 0)
        } else {
            (epoch, batch)
        };
        TrainerState {
            format: TRAINER_STATE_FORMAT.into(),
            version: 1,
            step,
            epoch,
            batch_in_epoch: batch,
            steps_per_epoch: spe,
            global_batch: plan.global_batch,
            rng: RngState {
                kind: "counter: shuffles and augmentation drawn from (seed, epoch, sample index)"
                    .into(),
                seed: plan.seed,
                epoch,
                step,
            },
            schedule: ScheduleState {
                kind: plan.schedule,
                base_lr: plan.base_lr,
                warmup: plan.warmup,
                total_steps: plan.total_steps,
                position: step,
            },
            optimizer: plan.optim.clone(),
            shard_optimizer: plan.zero,
            sync_bn: plan.sync_bn,
            mesh: mesh.to_string(),
            data: plan.source.to_string(),
            train_limit: plan.train_limit,
            test_limit: plan.test_limit,
            loss,
        }
    };
    let saver = std::cell::RefCell::new(AsyncSaver::default());
    let stalls = std::cell::RefCell::new(Vec::new());
    let do_save = |step: u64,
                   epoch: u64,
                   batch: u64,
                   loss: Option<f32>,
                   opt: &Optimizer|
     -> Result<PathBuf> {
        let out = plan.out.as_ref().expect("saving needs --out");
        if lead {
            std::fs::create_dir_all(out).at(out)?;
        }
        let st = state_at(step, epoch, batch, loss);
        let req = SaveRequest {
            out,
            step,
            mode: plan.save,
            compression: plan.compress,
            keep: plan.keep,
            strategy: &strategy,
            config_json: &config_json,
            state: &st,
        };
        let t = Instant::now();
        let dir = if plan.async_save {
            saver.borrow_mut().start(&dist, &req, locals(opt)?)?
        } else {
            save(&dist, &req, locals(opt)?)?
        };
        stalls.borrow_mut().push(t.elapsed().as_secs_f64());
        Ok(dir)
    };

    let mut pos_batch = skip;
    'epochs: while epoch < plan.epochs && step < end_step {
        let indices = sampler.indices(epoch);
        for b in skip..spe {
            if step >= end_step {
                break 'epochs;
            }
            let t0 = Instant::now();
            let idx = &indices[b as usize * plan.local_batch..(b as usize + 1) * plan.local_batch];
            let (x, y) = if plan.source.augments() {
                train.augmented_batch(idx, mix(&[plan.seed, epoch]), &dev)?
            } else {
                train.batch(idx, &dev)?
            };
            let logits = model.forward(&x, true)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            let grads = loss.backward()?;
            let lr = lr_at(
                plan.schedule,
                plan.base_lr,
                step,
                plan.warmup,
                plan.total_steps,
            );
            opt.step(&grads, lr, step + 1)?;
            broadcast_buffers(&buffers, &dist)?;
            let mut l = [loss.to_scalar::<f32>()?];
            dist.dp.all_reduce(&mut l, ReduceOp::Mean)?;
            step += 1;
            pos_batch = b + 1;
            let took = t0.elapsed().as_secs_f64();
            result.train_seconds += took;
            result.step_seconds.push(took);
            result.losses.push(l[0]);
            last_loss = Some(l[0]);
            if let Some(ev) = events.as_mut() {
                ev.scalar("train/loss", step as i64, l[0])?;
                // Every update has the global batch; its throughput is that over its time.
                if took > 0.0 {
                    let ips = plan.global_batch as f64 / took;
                    ev.scalar("train/images_per_sec", step as i64, ips as f32)?;
                }
            }
            let ips =
                (result.losses.len() * plan.global_batch) as f64 / result.train_seconds.max(1e-9);
            bar.set_message(format!(
                "epoch {epoch} step {step} loss {:.4} {ips:.0} img/s",
                l[0]
            ));
            bar.inc(1);
            if plan.save_every > 0 && step % plan.save_every == 0 {
                result
                    .checkpoints
                    .push(do_save(step, epoch, b + 1, last_loss, &opt)?);
                last_saved = Some(step);
            }
        }
        skip = 0;
        pos_batch = 0;
        epoch += 1;
        if plan.eval {
            let acc = evaluate(&model, &plan.data.test, &dist, &dev)?;
            result.accuracy.push((epoch - 1, acc));
            if let Some(ev) = events.as_mut() {
                ev.scalar("test/accuracy", (epoch - 1) as i64, acc)?;
            }
            say(format!(
                "epoch {} step {step} loss {:.4} test accuracy {acc:.4}",
                epoch - 1,
                last_loss.unwrap_or(f32::NAN)
            ));
        }
    }
    bar.finish_and_clear();
    let (final_epoch, final_batch) = if pos_batch >= spe {
        (epoch + 1, 0)
    } else {
        (epoch, pos_batch)
    };
    if plan.out.is_some() && last_saved != Some(step) {
        result
            .checkpoints
            .push(do_save(step, final_epoch, final_batch, last_loss, &opt)?);
    }
    // The run is over when its last checkpoint is.
    saver.borrow_mut().finish()?;
    result.save_stalls = stalls.take();
    if plan.gather_weights {
        result.weights = gather_full(&dist, &locals(&opt)?)?;
    }
    result.steps = step;
    result.epochs = final_epoch;
    result.events = events.map(EventWriter::finish).transpose()?;
    Ok(result)
}

/// Trains as `cfg` says: one thread per rank of the mesh, checkpoints under `--out`.
/// `progress` shows an indicatif bar on a terminal (per-epoch lines otherwise).
///
/// Resuming takes the model, optimizer, schedule, seed, global batch, data set and its
/// limits from the checkpoint (so no flags need repeating; `--data` and the limits
/// override); the mesh may differ from the one saved.
///
/// # Errors
/// Invalid options, unreadable data or checkpoints, a failed rank.
pub fn train(cfg: &TrainConfig, progress: bool) -> Result<TrainReport> {
    let start = Instant::now();
    let plan = Plan::new(cfg)?;
    // Said once (by the first process under a launcher), before any work.
    if crate::launch::LaunchEnv::from_env()
        .ok()
        .flatten()
        .is_none_or(|l| l.rank == 0)
    {
        for w in plan.resume_warnings() {
            eprintln!("ckpt: warning: {w}");
        }
    }
    let mut results = cfg
        .backend
        .run(&plan.mesh, |dist| rank_main(&plan, dist, progress))?;
    let r0 = results.swap_remove(0);
    let images = r0.losses.len() * plan.global_batch;
    Ok(TrainReport {
        mesh: plan.mesh.to_string(),
        model: plan.model.clone(),
        start_step: r0.start_step,
        steps: r0.steps,
        epochs: r0.epochs,
        losses: r0.losses,
        test_accuracy: r0.accuracy,
        images_per_sec: images as f64 / r0.train_seconds.max(1e-9),
        seconds: start.elapsed().as_secs_f64(),
        checkpoints: r0.checkpoints,
        weights: r0.weights,
        save_stalls: r0.save_stalls,
        step_seconds: r0.step_seconds,
        events: r0.events,
    })
}

//! Optimizers (SGD with momentum, AdamW) over `dp`, optionally with their state split
//! across the `dp` ranks (ZeRO-1), and the learning-rate schedule.
//!
//! Gradients are averaged over `dp` in one all-reduce of all parameters, or with ZeRO-1
//! one reduce-scatter that hands each rank the average of its shard. Updates are
//! element-wise in plain `f32` and the collectives add in rank order, so a ZeRO-1 update
//! (each rank updates its shard, then the shards are all-gathered) gives bit-for-bit the
//! parameters of an unsplit one.

use crate::comm::{Comm, Dist, ReduceOp};
use crate::error::{Error, Result};
use crate::params::{local_positions, ParamSpec};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::{Placement, TensorLayout};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The optimizer family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// SGD with momentum and L2 weight decay (PyTorch's `SGD`).
    Sgd,
    /// Adam with decoupled weight decay (PyTorch's `AdamW`).
    Adamw,
}

impl OptimizerKind {
    /// Names of the per-parameter state tensors, saved as `optim.<param>.<state>`.
    #[must_use]
    pub fn state_names(self) -> &'static [&'static str] {
        match self {
            OptimizerKind::Sgd => &["momentum_buffer"],
            OptimizerKind::Adamw => &["exp_avg", "exp_avg_sq"],
        }
    }
}

/// Optimizer hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    /// Family.
    pub kind: OptimizerKind,
    /// SGD momentum.
    pub momentum: f64,
    /// Weight decay (L2 for SGD, decoupled for AdamW).
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
}

/// Name of an optimizer state tensor.
#[must_use]
pub fn state_tensor_name(param: &str, state: &str) -> String {
    format!("optim.{param}.{state}")
}

/// The layout of a parameter's optimizer state: the parameter's own, and with `zero`
/// also split over `dp` along dim 0 — after `tp` when `tp` splits dim 0 too (`order=1`,
/// same blocks), so each rank's shard lies inside its `tp` piece.
#[must_use]
pub fn state_layout(spec: &ParamSpec, mesh: &Mesh, zero: bool) -> TensorLayout {
    let mut l = spec.layout(mesh);
    if zero && !spec.shape.is_empty() {
        let blocks = match spec.hint.tp {
            Placement::Shard { dim: 0, blocks, .. } => blocks,
            _ => 1,
        };
        for (a, axis) in mesh.axes().iter().enumerate() {
            if axis.name == "dp" && axis.size > 1 {
                l.placements[a] = Placement::Shard {
                    dim: 0,
                    blocks,
                    order: 1,
                };
            }
        }
    }
    l
}

struct Slot {
    name: String,
    var: Var,
    /// Positions in the local parameter of this rank's state shard (`None`: all).
    mine: Option<Vec<u32>>,
    /// The same for every `dp` peer, in group order (ZeRO only).
    peers: Vec<Vec<u32>>,
    /// One buffer per state name, as long as the shard.
    state: Vec<Vec<f32>>,
}

/// Appends the values of `t` to `out` as f32: straight from the storage of an f32 CPU
/// tensor (one copy), through `to_vec1` otherwise.
fn append_values(t: &Tensor, out: &mut Vec<f32>) -> Result<()> {
    if t.device().is_cpu() && t.dtype() == candle_core::DType::F32 {
        crate::cpu_data::with_f32(t, "gradient", |v| out.extend_from_slice(v))?;
    } else {
        out.extend(crate::comm::tensor_to_vec(t)?);
    }
    Ok(())
}

/// One optimizer step's constants: SGD with momentum and weight decay, or AdamW with
/// its bias corrections for this step.
#[derive(Clone, Copy)]
struct UpdateRule {
    kind: OptimizerKind,
    lr: f32,
    mom: f32,
    wd: f32,
    b1: f32,
    b2: f32,
    eps: f32,
    bc1: f32,
    bc2: f32,
}

/// Elements per parallel task of an update: large enough that a task outweighs its
/// hand-off, small enough to spread a layer over the cores.
const UPDATE_CHUNK: usize = 1 << 14;

impl UpdateRule {
    fn new(c: &OptimConfig, lr: f64, step: u64) -> UpdateRule {
        UpdateRule {
            kind: c.kind,
            lr: lr as f32,
            mom: c.momentum as f32,
            wd: c.weight_decay as f32,
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            eps: c.eps as f32,
            bc1: 1.0 - (c.beta1 as f32).powi(step as i32),
            bc2: 1.0 - (c.beta2 as f32).powi(step as i32),
        }
    }

    /// Updates `p` from its averaged gradient `g` and its state (one vector per state
    /// name, each as long as `p`), element by element: in parallel chunks, the same
    /// bits whatever the thread count.
    fn apply(self, p: &mut [f32], g: &[f32], state: &mut [Vec<f32>]) {
        match (self.kind, state) {
            (OptimizerKind::Sgd, [buf]) => p
                .par_chunks_mut(UPDATE_CHUNK)
                .zip(g.par_chunks(UPDATE_CHUNK))
                .zip(buf.par_chunks_mut(UPDATE_CHUNK))
                .for_each(|((p, g), b)| self.sgd(p, g, b)),
            (OptimizerKind::Adamw, [m, v]) => p
                .par_chunks_mut(UPDATE_CHUNK)
                .zip(g.par_chunks(UPDATE_CHUNK))
                .zip(
                    m.par_chunks_mut(UPDATE_CHUNK)
                        .zip(v.par_chunks_mut(UPDATE_CHUNK)),
                )
                .for_each(|((p, g), (m, v))| self.adamw(p, g, m, v)),
            (kind, state) => unreachable!("{kind:?} with {} state vectors", state.len()),
        }
    }

    // Straight loops over equal-length slices, so that they vectorize (wider with
    // `wide`).
    fn sgd(self, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
        wide(|| self.sgd_loop(p, g, buf));
    }

    fn adamw(self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        wide(|| self.adamw_loop(p, g, m, v));
    }

    #[inline(always)]
    fn sgd_loop(self, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
        let (lr, mom, wd) = (self.lr, self.mom, self.wd);
        for ((p, &g), b) in p.iter_mut().zip(g).zip(buf) {
            let g = g + wd * *p;
            *b = mom * *b + g;
            *p -= lr * *b;
        }
    }

    #[inline(always)]
    fn adamw_loop(self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let (lr, b1, b2, eps) = (self.lr, self.b1, self.b2, self.eps);
        let decay = 1.0 - lr * self.wd;
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
            let pv = *p * decay;
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
            *p = pv - lr * (*m / self.bc1) / ((*v / self.bc2).sqrt() + eps);
        }
    }
}

/// Runs `update` compiled for AVX2 when the CPU has it (on x86-64), else as built: 8
/// lanes instead of SSE2's 4, and AdamW is bound by the throughput of its two divisions
/// and square root. Division and square root are correctly rounded at every width and
/// Rust never fuses a multiply and an add on its own, so both builds give the same bits.
#[inline(always)]
fn wide(update: impl FnOnce()) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // `update` (an inline(always) loop) is inlined here and built with AVX2.
        #[target_feature(enable = "avx2")]
        fn avx2(update: impl FnOnce()) {
            update();
        }
        // SAFETY: the CPU was just found to support AVX2.
        return unsafe { avx2(update) };
    }
    update();
}

/// An optimizer over one rank's local parameters.
pub struct Optimizer {
    cfg: OptimConfig,
    slots: Vec<Slot>,
    dp: Arc<dyn Comm>,
    zero: bool,
}

impl Optimizer {
    /// An optimizer of `params` (name, variable, spec) on `dist`'s rank, with zero
    /// state; `zero` splits the state over `dp`.
    ///
    /// # Errors
    /// Layout errors.
    pub fn new(
        cfg: OptimConfig,
        params: Vec<(String, Var, ParamSpec)>,
        dist: &Dist,
        zero: bool,
    ) -> Result<Optimizer> {
        let zero = zero && dist.dp_size() > 1;
        let mut slots = Vec::with_capacity(params.len());
        for (name, var, spec) in params {
            let local = var.as_tensor().elem_count();
            let (mine, peers) = if zero {
                let pl = spec.layout(&dist.mesh);
                let sl = state_layout(&spec, &dist.mesh, true);
                let peers = dist
                    .dp
                    .members()
                    .iter()
                    .map(|&r| local_positions(&pl, &sl, &dist.mesh, r as u64))
                    .collect::<Result<Vec<_>>>()?;
                (Some(peers[dist.dp_rank()].clone()), peers)
            } else {
                (None, Vec::new())
            };
            let n = mine.as_ref().map_or(local, Vec::len);
            let state = cfg
                .kind
                .state_names()
                .iter()
                .map(|_| vec![0f32; n])
                .collect();
            slots.push(Slot {
                name,
                var,
                mine,
                peers,
                state,
            });
        }
        Ok(Optimizer {
            cfg,
            slots,
            dp: dist.dp.clone(),
            zero,
        })
    }

    /// Averages the gradients over `dp` and applies one update with learning rate `lr`;
    /// `step` is the 1-based update count (AdamW's bias correction).
    ///
    /// # Errors
    /// Collective or tensor errors.
    pub fn step(&mut self, grads: &GradStore, lr: f64, step: u64) -> Result<()> {
        let total = self
            .slots
            .iter()
            .map(|s| s.var.as_tensor().elem_count())
            .sum();
        let mut flat = Vec::with_capacity(total);
        let mut offsets = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            offsets.push(flat.len());
            match grads.get(s.var.as_tensor()) {
                Some(g) => append_values(g, &mut flat)?,
                None => flat.extend(std::iter::repeat_n(0f32, s.var.as_tensor().elem_count())),
            }
        }
        // The averaged gradient of every element this rank updates, slot after slot: all
        // of them, or with ZeRO only this rank's shard, reduce-scattered so that each
        // rank sums only its own share.
        let (grad, grad_at) = if self.zero {
            let mut perm = Vec::with_capacity(flat.len());
            let mut counts = vec![0usize; self.dp.size()];
            for (k, count) in counts.iter_mut().enumerate() {
                for (i, s) in self.slots.iter().enumerate() {
                    perm.extend(s.peers[k].iter().map(|&pi| flat[offsets[i] + pi as usize]));
                    *count += s.peers[k].len();
                }
            }
            let mine = self.dp.reduce_scatter(&perm, &counts, ReduceOp::Mean)?;
            let mut at = Vec::with_capacity(self.slots.len());
            let mut n = 0;
            for s in &self.slots {
                at.push(n);
                n += s.state[0].len();
            }
            (mine, at)
        } else {
            self.dp.all_reduce(&mut flat, ReduceOp::Mean)?;
            (flat, offsets)
        };
        let mut params: Vec<Vec<f32>> = self
            .slots
            .iter()
            .map(|s| crate::comm::tensor_to_vec(s.var.as_tensor()))
            .collect::<Result<_>>()?;
        let rule = UpdateRule::new(&self.cfg, lr, step);
        for (i, s) in self.slots.iter_mut().enumerate() {
            let n = s.state[0].len();
            let g = &grad[grad_at[i]..grad_at[i] + n];
            match &s.mine {
                None => rule.apply(&mut params[i], g, &mut s.state),
                Some(mine) => {
                    // ZeRO: this rank's elements, gathered, updated, scattered back.
                    let p = &mut params[i];
                    let mut sub: Vec<f32> = mine.iter().map(|&pi| p[pi as usize]).collect();
                    rule.apply(&mut sub, g, &mut s.state);
                    for (&pi, v) in mine.iter().zip(sub) {
                        p[pi as usize] = v;
                    }
                }
            }
        }
        if self.zero {
            let mut mine = Vec::new();
            for (i, s) in self.slots.iter().enumerate() {
                let m = s.mine.as_ref().expect("zero slots have shards");
                mine.extend(m.iter().map(|&pi| params[i][pi as usize]));
            }
            let all = self.dp.all_gather(&mine)?;
            for (k, part) in all.iter().enumerate() {
                let mut at = 0;
                for (i, s) in self.slots.iter().enumerate() {
                    for &pi in &s.peers[k] {
                        params[i][pi as usize] = part[at];
                        at += 1;
                    }
                }
                if at != part.len() {
                    return Err(Error::Collective {
                        op: "all_gather",
                        group: format!("{:?}", self.dp.members()),
                        problem: "ZeRO shard sizes disagree".into(),
                    });
                }
            }
        }
        for (s, p) in self.slots.iter().zip(params) {
            let t = s.var.as_tensor();
            s.var.set(&Tensor::from_vec(p, t.shape(), t.device())?)?;
        }
        Ok(())
    }

    /// This rank's state tensors, `optim.<param>.<state>` to the local shard (flat).
    #[must_use]
    pub fn state(&self) -> Vec<(String, &[f32])> {
        let names = self.cfg.kind.state_names();
        let mut out = Vec::new();
        for s in &self.slots {
            for (k, st) in names.iter().zip(&s.state) {
                out.push((state_tensor_name(&s.name, k), st.as_slice()));
            }
        }
        out
    }

    /// Replaces state tensors from `tensors` (name to local shard); names absent from
    /// the map keep their current (zero) state.
    ///
    /// # Errors
    /// A shard of the wrong length.
    pub fn load_state(&mut self, tensors: &BTreeMap<String, Vec<f32>>) -> Result<()> {
        let names = self.cfg.kind.state_names();
        for s in &mut self.slots {
            for (k, st) in names.iter().zip(s.state.iter_mut()) {
                let n = state_tensor_name(&s.name, k);
                if let Some(v) = tensors.get(&n) {
                    if v.len() != st.len() {
                        return Err(Error::BadCheckpoint {
                            path: n.into(),
                            problem: format!("{} values for a shard of {}", v.len(), st.len()),
                        });
                    }
                    st.copy_from_slice(v);
                }
            }
        }
        Ok(())
    }
}

/// The learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Constant after warmup.
    Constant,
    /// Cosine decay to zero at the last step, after warmup.
    Cosine,
}

/// The learning rate of update `step` (0-based) of `total`, with linear warmup over
/// `warmup` updates.
///
/// ```
/// use ckpt_train::{lr_at, Schedule};
/// assert_eq!(lr_at(Schedule::Cosine, 0.1, 0, 0, 10), 0.1);
/// assert!((lr_at(Schedule::Cosine, 0.1, 5, 0, 10) - 0.05).abs() < 1e-12);
/// assert_eq!(lr_at(Schedule::Constant, 0.1, 1, 4, 10), 0.05);
/// ```
#[must_use]
pub fn lr_at(schedule: Schedule, base: f64, step: u64, warmup: u64, total: u64) -> f64 {
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    match schedule {
        Schedule::Constant => base,
        Schedule::Cosine => {
            let span = total.saturating_sub(warmup).max(1) as f64;
            let t = ((step - warmup) as f64 / span).min(1.0);
            base * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's SGD (momentum, L2 decay) and AdamW (decoupled decay, bias-corrected
    /// moments) in f64, element by element, against the chunked parallel update over
    /// more elements than one chunk, for three steps.
    #[test]
    fn update_rules_follow_pytorch_over_every_chunk() {
        let n = 2 * UPDATE_CHUNK + 7;
        for kind in [OptimizerKind::Sgd, OptimizerKind::Adamw] {
            let cfg = OptimConfig {
                kind,
                momentum: 0.9,
                weight_decay: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            };
            let mut p: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
            let mut state = vec![vec![0f32; n]; kind.state_names().len()];
            let mut want: Vec<f64> = p.iter().map(|&v| f64::from(v)).collect();
            let (mut a, mut b) = (vec![0f64; n], vec![0f64; n]);
            for step in 1..=3u64 {
                let g: Vec<f32> = (0..n)
                    .map(|i| ((i * 7 + step as usize) % 31) as f32 * 0.003 - 0.04)
                    .collect();
                let lr = 0.05;
                UpdateRule::new(&cfg, lr, step).apply(&mut p, &g, &mut state);
                for i in 0..n {
                    let gi = f64::from(g[i]);
                    match kind {
                        OptimizerKind::Sgd => {
                            let gi = gi + 0.01 * want[i];
                            a[i] = 0.9 * a[i] + gi;
                            want[i] -= lr * a[i];
                        }
                        OptimizerKind::Adamw => {
                            want[i] *= 1.0 - lr * 0.01;
                            a[i] = 0.9 * a[i] + 0.1 * gi;
                            b[i] = 0.999 * b[i] + 0.001 * gi * gi;
                            let mhat = a[i] / (1.0 - 0.9f64.powi(step as i32));
                            let vhat = b[i] / (1.0 - 0.999f64.powi(step as i32));
                            want[i] -= lr * mhat / (vhat.sqrt() + 1e-8);
                        }
                    }
                }
            }
            for (i, (&got, &w)) in p.iter().zip(&want).enumerate() {
                assert!(
                    (f64::from(got) - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{kind:?} element {i}: {got} vs {w}"
                );
            }
        }
    }

    /// The build the CPU picks (AVX2 here when it has it) gives the same bits as the
    /// loops built for the baseline target, tails shorter than a vector included.
    #[test]
    fn wide_updates_give_the_same_bits() {
        let n = 1000 + 5;
        let rule = |kind| {
            let cfg = OptimConfig {
                kind,
                momentum: 0.9,
                weight_decay: 0.05,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-6,
            };
            UpdateRule::new(&cfg, 0.01, 3)
        };
        let start = |seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 37 + seed) % 101) as f32 - 50.0) * 0.013)
                .collect()
        };
        let (g, p0) = (start(1), start(2));
        let (mut p1, mut p2) = (p0.clone(), p0.clone());
        let (mut b1, mut b2) = (start(3), start(3));
        rule(OptimizerKind::Sgd).sgd(&mut p1, &g, &mut b1);
        rule(OptimizerKind::Sgd).sgd_loop(&mut p2, &g, &mut b2);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&p1), bits(&b1)), (bits(&p2), bits(&b2)), "sgd");
        let (mut p1, mut p2) = (p0.clone(), p0);
        let (mut m1, mut m2) = (start(4), start(4));
        let v0: Vec<f32> = start(5).iter().map(|x| x * x).collect();
        let (mut v1, mut v2) = (v0.clone(), v0);
        rule(OptimizerKind::Adamw).adamw(&mut p1, &g, &mut m1, &mut v1);
        rule(OptimizerKind::Adamw).adamw_loop(&mut p2, &g, &mut m2, &mut v2);
        assert_eq!(
            (bits(&p1), bits(&m1), bits(&v1)),
            (bits(&p2), bits(&m2), bits(&v2)),
            "adamw"
        );
        assert_ne!(
            bits(&p1),
            bits(&start(2)),
            "the update changed the parameters"
        );
    }
}

//! The thread backend: every rank is a thread; collectives meet in shared memory.

use super::{check_mesh, Comm, Dist, ReduceOp};
use crate::error::{Error, Result};
use ckpt_core::layout::mesh::Mesh;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One rank's deposit for a collective: the op name (checked to agree) and its data.
type Slot = Option<(&'static str, Arc<Vec<f32>>)>;

/// Shared state of one group.
struct Group {
    members: Vec<usize>,
    slots: Mutex<Vec<Slot>>,
    /// The barrier: members arrived, and waiters asleep on `cv`.
    gate: Mutex<Gate>,
    /// Barriers completed, written under `gate`'s lock; read without it by spinners.
    generation: AtomicU64,
    cv: Condvar,
    /// Whether a waiter spins a little before it sleeps: when every rank has a core of its
    /// own, the last rank usually arrives within microseconds, sooner than a sleeping
    /// thread is woken (tens of microseconds on a virtual machine, several times a step).
    /// Never with more ranks than cores, where a spinner would keep a peer off its core.
    spin: bool,
    abort: Arc<AtomicBool>,
}

#[derive(Default)]
struct Gate {
    arrived: usize,
    sleepers: usize,
}

/// How long a waiter spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

impl Group {
    fn label(&self) -> String {
        format!("{:?}", self.members)
    }

    /// Waits until every member arrived, or fails when the job was aborted.
    fn wait(&self, op: &'static str) -> Result<()> {
        let lock = || {
            self.gate
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let mut g = lock();
        let gen = self.generation.load(Ordering::Acquire);
        g.arrived += 1;
        if g.arrived == self.members.len() {
            g.arrived = 0;
            self.generation.store(gen + 1, Ordering::Release);
            if g.sleepers > 0 {
                self.cv.notify_all();
            }
            return Ok(());
        }
        drop(g);
        if self.spin {
            let start = Instant::now();
            while start.elapsed() < SPIN {
                if self.generation.load(Ordering::Acquire) != gen {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        let mut g = lock();
        while self.generation.load(Ordering::Acquire) == gen {
            if self.abort.load(Ordering::SeqCst) {
                return Err(Error::Collective {
                    op,
                    group: self.label(),
                    problem: "a peer rank stopped".into(),
                });
            }
            g.sleepers += 1;
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
            g.sleepers -= 1;
        }
        Ok(())
    }

    /// Deposits `data`, waits for everyone, returns every member's data in group order.
    fn exchange(&self, me: usize, op: &'static str, data: Vec<f32>) -> Result<Vec<Arc<Vec<f32>>>> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)[me] = Some((op, Arc::new(data)));
        self.wait(op)?;
        let snapshot: Vec<Slot> = self
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        self.wait(op)?;
        let mut out = Vec::with_capacity(snapshot.len());
        for (i, s) in snapshot.into_iter().enumerate() {
            match s {
                Some((o, d)) if o == op => out.push(d),
                Some((o, _)) => {
                    return Err(Error::Collective {
                        op,
                        group: self.label(),
                        problem: format!("rank {} called `{o}` at the same time", self.members[i]),
                    })
                }
                None => {
                    return Err(Error::Collective {
                        op,
                        group: self.label(),
                        problem: "missing deposit".into(),
                    })
                }
            }
        }
        Ok(out)
    }
}

/// Buffers at least this long are all-reduced as a reduce-scatter then an all-gather.
const SPLIT_REDUCE_LEN: usize = 1 << 14;

/// A rank's handle on one group.
struct ThreadComm {
    group: Arc<Group>,
    me: usize,
}

fn reduce(
    parts: &[Arc<Vec<f32>>],
    op: ReduceOp,
    group: &Group,
    name: &'static str,
) -> Result<Vec<f32>> {
    let n = parts[0].len();
    if let Some(p) = parts.iter().find(|p| p.len() != n) {
        return Err(Error::Collective {
            op: name,
            group: group.label(),
            problem: format!("buffer lengths differ ({n} and {})", p.len()),
        });
    }
    Ok(super::reduce_ordered(
        parts.iter().map(|p| p.as_slice()),
        parts.len(),
        op,
    ))
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.me
    }
    fn size(&self) -> usize {
        self.group.members.len()
    }
    fn members(&self) -> &[usize] {
        &self.group.members
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let parts = self.group.exchange(self.me, "all_reduce", buf.to_vec())?;
        let n = self.size();
        if buf.len() < SPLIT_REDUCE_LEN || n == 1 {
            let r = reduce(&parts, op, &self.group, "all_reduce")?;
            buf.copy_from_slice(&r);
            return Ok(());
        }
        // Large buffers: each rank reduces its share, then the shares are exchanged (the
        // traffic of a ring all-reduce; the same additions in the same order).
        let (start, len) = crate::parallel::chunk(buf.len(), n, self.me);
        if let Some(p) = parts.iter().find(|p| p.len() != buf.len()) {
            return Err(Error::Collective {
                op: "all_reduce",
                group: self.group.label(),
                problem: format!("buffer lengths differ ({} and {})", buf.len(), p.len()),
            });
        }
        // This rank's share of every deposit, summed in rank order where it lies.
        let seg = super::reduce_ordered(parts.iter().map(|p| &p[start..start + len]), n, op);
        drop(parts);
        let shares = self.group.exchange(self.me, "all_reduce", seg)?;
        let mut at = 0;
        for s in &shares {
            buf[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        }
        Ok(())
    }
    fn all_gather(&self, buf: &[f32]) -> Result<Vec<Vec<f32>>> {
        let parts = self.group.exchange(self.me, "all_gather", buf.to_vec())?;
        Ok(parts.iter().map(|p| p.as_ref().clone()).collect())
    }
    fn reduce_scatter(&self, buf: &[f32], counts: &[usize], op: ReduceOp) -> Result<Vec<f32>> {
        if counts.len() != self.size() || counts.iter().sum::<usize>() != buf.len() {
            return Err(Error::Collective {
                op: "reduce_scatter",
                group: self.group.label(),
                problem: "counts do not match the buffer".into(),
            });
        }
        let parts = self
            .group
            .exchange(self.me, "reduce_scatter", buf.to_vec())?;
        let start: usize = counts[..self.me].iter().sum();
        let mine: Vec<Arc<Vec<f32>>> = parts
            .iter()
            .map(|p| Arc::new(p[start..start + counts[self.me]].to_vec()))
            .collect();
        reduce(&mine, op, &self.group, "reduce_scatter")
    }
    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        let data = if self.me == root {
            std::mem::take(buf)
        } else {
            Vec::new()
        };
        let parts = self.group.exchange(self.me, "broadcast", data)?;
        *buf = parts[root].as_ref().clone();
        Ok(())
    }
    fn gather(&self, buf: &[f32], root: usize) -> Result<Option<Vec<Vec<f32>>>> {
        let parts = self.group.exchange(self.me, "gather", buf.to_vec())?;
        Ok((self.me == root).then(|| parts.iter().map(|p| p.as_ref().clone()).collect()))
    }
    fn barrier(&self) -> Result<()> {
        self.group.wait("barrier")
    }
}

fn new_group(members: Vec<usize>, abort: &Arc<AtomicBool>, spin: bool) -> Arc<Group> {
    let n = members.len();
    Arc::new(Group {
        members,
        slots: Mutex::new(vec![None; n]),
        gate: Mutex::new(Gate::default()),
        generation: AtomicU64::new(0),
        cv: Condvar::new(),
        spin,
        abort: abort.clone(),
    })
}

/// Builds the communicators of every rank of `mesh`; `spin`: see [`Group::spin`].
fn build(mesh: &Mesh, abort: &Arc<AtomicBool>, spin: bool) -> Vec<Dist> {
    let world = mesh.world_size() as usize;
    let new_group = |members, abort| new_group(members, abort, spin);
    let world_group = new_group((0..world).collect(), abort);
    let axis_groups = |name: &str| -> Vec<(Arc<Group>, usize)> {
        let mut per_rank: Vec<Option<(Arc<Group>, usize)>> = vec![None; world];
        let Some(a) = mesh.axis_index(name) else {
            return (0..world).map(|r| (new_group(vec![r], abort), 0)).collect();
        };
        for r in 0..world {
            if per_rank[r].is_some() {
                continue;
            }
            let members: Vec<usize> = mesh
                .axis_group(r as u64, a)
                .into_iter()
                .map(|m| m as usize)
                .collect();
            let g = new_group(members.clone(), abort);
            for (i, m) in members.into_iter().enumerate() {
                per_rank[m] = Some((g.clone(), i));
            }
        }
        per_rank
            .into_iter()
            .map(|x| x.expect("every rank is in a group"))
            .collect()
    };
    let dp = axis_groups("dp");
    let tp = axis_groups("tp");
    (0..world)
        .map(|r| Dist {
            mesh: mesh.clone(),
            rank: r,
            world: Arc::new(ThreadComm {
                group: world_group.clone(),
                me: r,
            }),
            dp: Arc::new(ThreadComm {
                group: dp[r].0.clone(),
                me: dp[r].1,
            }),
            tp: Arc::new(ThreadComm {
                group: tp[r].0.clone(),
                me: tp[r].1,
            }),
        })
        .collect()
}

/// Runs `f` on a rayon pool of `threads` threads of its own, so that the parallel loops
/// of one rank (convolutions, BatchNorm, matrix products) stay on that rank's share of
/// the cores: on rayon's one global pool, sized to that share, the ranks' loops would
/// queue behind each other. With one thread, `f` runs on that thread and its parallel
/// loops run inline, with no hand-off at all. Without a pool (it could not be started),
/// `f` runs here on the global pool.
fn in_own_pool<T: Send>(rank: usize, threads: usize, f: impl FnOnce() -> T + Send) -> T {
    match rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("rank-{rank}-{i}"))
        .build()
    {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

/// Runs `f` once per rank of `mesh`, each on its own thread, and returns the ranks'
/// results in rank order.
///
/// When a rank fails or panics the others are released from their collectives, and the
/// first genuine error is returned (not the "peer stopped" errors it caused).
///
/// # Errors
/// An invalid mesh, or the error of the first rank that failed.
pub fn run_threads<T: Send>(mesh: &Mesh, f: impl Fn(Dist) -> Result<T> + Sync) -> Result<Vec<T>> {
    check_mesh(mesh)?;
    let abort = Arc::new(AtomicBool::new(false));
    let world = mesh.world_size() as usize;
    let share = crate::launch::threads_per_rank(world);
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let dists = build(mesh, &abort, world.saturating_mul(share) <= cores);
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = dists
            .into_iter()
            .map(|d| {
                let (f, abort) = (&f, abort.clone());
                let rank = d.rank;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            in_own_pool(rank, share, || f(d))
                        }));
                        let r = match r {
                            Ok(r) => r,
                            Err(p) => {
                                let message = p
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                                    .unwrap_or_else(|| "unknown panic".into());
                                Err(Error::RankPanicked { rank, message })
                            }
                        };
                        if r.is_err() {
                            abort.store(true, Ordering::SeqCst);
                        }
                        r
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread joins"))
            .collect()
    });
    let mut first_peer_error = None;
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e @ Error::Collective { .. }) if e.to_string().contains("a peer rank stopped") => {
                first_peer_error.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    match first_peer_error {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_is_ordered_and_identical_on_every_rank() {
        let mesh = Mesh::parse("dp=4").unwrap();
        let out = run_threads(&mesh, |d| {
            let mut v = vec![0.1f32 * (d.rank as f32 + 1.0), 1e8, -1e8];
            d.world.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        })
        .unwrap();
        assert!(out.iter().all(|v| v == &out[0]));
        let want = ((0.1f32 + 0.2) + 0.3) + 0.4;
        assert_eq!(out[0][0], want);
    }

    #[test]
    fn split_all_reduce_equals_the_direct_one() {
        let mesh = Mesh::parse("dp=3").unwrap();
        let n = SPLIT_REDUCE_LEN + 5;
        let out = run_threads(&mesh, |d| {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * (d.rank + 1)) % 97) as f32 * 0.37)
                .collect();
            let mut big = v.clone();
            d.world.all_reduce(&mut big, ReduceOp::Mean)?;
            let mut direct = Vec::new();
            for c in v.chunks(1000) {
                let mut c = c.to_vec();
                d.world.all_reduce(&mut c, ReduceOp::Mean)?;
                direct.extend(c);
            }
            Ok((big, direct))
        })
        .unwrap();
        for (big, direct) in &out {
            assert!(big
                .iter()
                .zip(direct)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert_eq!(big, &out[0].0);
        }
    }

    #[test]
    fn axis_groups_follow_row_major_ranks() {
        let mesh = Mesh::parse("dp=2,tp=2").unwrap();
        let out = run_threads(&mesh, |d| {
            Ok((
                d.dp.members().to_vec(),
                d.tp.members().to_vec(),
                d.dp_rank(),
                d.tp_rank(),
            ))
        })
        .unwrap();
        assert_eq!(out[1], (vec![1, 3], vec![0, 1], 0, 1));
        assert_eq!(out[2], (vec![0, 2], vec![2, 3], 1, 0));
    }

    #[test]
    fn gather_scatter_broadcast() {
        let mesh = Mesh::parse("tp=3").unwrap();
        let out = run_threads(&mesh, |d| {
            let r = d.rank as f32;
            let g = d.tp.all_gather(&vec![r; d.rank + 1])?;
            let rs =
                d.tp.reduce_scatter(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[1, 2, 3], ReduceOp::Sum)?;
            let mut b = vec![r; 2];
            d.tp.broadcast(&mut b, 2)?;
            let root = d.tp.gather(&[r], 1)?;
            d.tp.barrier()?;
            Ok((g, rs, b, root))
        })
        .unwrap();
        assert_eq!(
            out[0].0,
            vec![vec![0.0], vec![1.0, 1.0], vec![2.0, 2.0, 2.0]]
        );
        assert_eq!(out[1].1, vec![6.0, 9.0]);
        assert_eq!(out[0].2, vec![2.0, 2.0]);
        assert_eq!(out[1].3, Some(vec![vec![0.0], vec![1.0], vec![2.0]]));
        assert_eq!(out[0].3, None);
    }

    #[test]
    fn a_failing_rank_releases_the_others() {
        let mesh = Mesh::parse("dp=3").unwrap();
        let err = run_threads(&mesh, |d| {
            if d.rank == 1 {
                return Err(Error::option("--test", "rank 1 fails"));
            }
            d.world.barrier()?;
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("rank 1 fails"), "{err}");
    }

    #[test]
    fn a_panicking_rank_is_reported() {
        let mesh = Mesh::parse("dp=2").unwrap();
        let err = run_threads(&mesh, |d| {
            assert!(d.rank != 0, "boom");
            d.world.barrier()
        })
        .unwrap_err();
        assert!(matches!(err, Error::RankPanicked { rank: 0, .. }), "{err}");
    }

    #[test]
    fn mismatched_collectives_are_errors() {
        let mesh = Mesh::parse("dp=2").unwrap();
        let err = run_threads(&mesh, |d| {
            if d.rank == 0 {
                d.world.all_gather(&[1.0])?;
            } else {
                d.world.all_reduce(&mut [1.0], ReduceOp::Sum)?;
            }
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("at the same time"), "{err}");
    }
}

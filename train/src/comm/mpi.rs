//! The MPI backend (feature `mpi`): one process per rank under `mpirun`, collectives
//! over Open MPI through rsmpi.
//!
//! Results are bit-identical to the thread backend. MPI's own reductions combine the
//! ranks in an unspecified order, so they are not used: every reduction moves each
//! rank's share of the buffer to its owner (`MPI_Alltoallv`), which sums the pieces in
//! group order exactly as the thread backend does, then the reduced shares are
//! gathered back (`MPI_Allgatherv`). That is the traffic of a ring all-reduce.
//!
//! Every collective starts with a small header exchange (the operation, the buffer
//! length, the root, a sequence number) so that ranks that disagree get an
//! [`Error::Collective`] on every rank instead of corrupt data or a hang.
//!
//! A rank that dies makes `mpirun` stop the job. A rank that stops calling collectives
//! while alive (stuck, or failed and not exiting) is caught by a watchdog: a collective
//! that has not completed after `CKPT_COMM_TIMEOUT` seconds (default 600) prints which
//! one and aborts the job with `MPI_Abort`. A rank whose work fails aborts the job the
//! same way ([`MpiWorld::run`]), so no peer waits forever.

use super::process::{reduce_ordered, timeout_from_env, TIMEOUT_VAR};
use super::{check_mesh, Comm, Dist, ReduceOp, SoloComm};
use crate::error::{Error, Result};
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::environment::Universe;
use ::mpi::topology::{Color, SimpleCommunicator};
use ::mpi::traits::{Communicator, CommunicatorCollectives, Root};
use ::mpi::Threading;
use ckpt_core::layout::mesh::Mesh;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Serialises MPI calls of this process (the communicators are shared by threads).
static MPI_CALLS: Mutex<()> = Mutex::new(());

/// The universe (finalised at exit) and the world.
static WORLD: OnceLock<std::result::Result<MpiWorld, String>> = OnceLock::new();
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);

fn lock_calls() -> MutexGuard<'static, ()> {
    MPI_CALLS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An MPI communicator shared between threads; every use holds [`MPI_CALLS`].
struct Handle(ManuallyDrop<SimpleCommunicator>);

// SAFETY: the handle is an opaque MPI object; every call on it (including the final
// `MPI_Comm_free`) is made while holding the process-wide `MPI_CALLS` lock, and MPI
// was initialised with `MPI_THREAD_MULTIPLE` (or the lock alone serialises the calls).
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        if ::mpi::environment::is_finalized() {
            return;
        }
        let _calls = lock_calls();
        // SAFETY: dropped once, here, before `MPI_Finalize`.
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}

/// What the watchdog watches: the collective in progress, if any.
struct Watch {
    current: Mutex<Option<(&'static str, String, Instant)>>,
    timeout_ms: AtomicU64,
    stopped: AtomicBool,
}

/// Clears the watched collective when it ends.
struct Watching<'a>(&'a Watch);

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        *self
            .0
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }
}

impl Watch {
    fn enter(&self, op: &'static str, group: &str) -> Watching<'_> {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((op, group.to_string(), Instant::now()));
        Watching(self)
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Polls the collective in progress and aborts the job when it overran.
    fn run(&self, rank: usize) {
        loop {
            let timeout = self.timeout();
            std::thread::sleep(
                (timeout / 20).clamp(Duration::from_millis(20), Duration::from_secs(1)),
            );
            if self.stopped.load(Ordering::SeqCst) {
                return;
            }
            let overran = self
                .current
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .and_then(|(op, group, since)| {
                    (since.elapsed() > timeout).then(|| (*op, group.clone()))
                });
            if let Some((op, group)) = overran {
                eprintln!(
                    "ckpt: rank {rank}: collective `{op}` in group {group} did not complete within {:.1} s \
                     (a peer rank is stuck or gone; {TIMEOUT_VAR} sets the limit); aborting the MPI job",
                    timeout.as_secs_f64()
                );
                // MPI_Abort may be called from any thread under MPI_THREAD_MULTIPLE (the only
                // level the watchdog runs at) and does not return; it takes no lock, as the
                // stuck collective holds it.
                SimpleCommunicator::world().abort(ABORT_CODE);
            }
        }
    }
}

/// Exit code of a job aborted by ckpt.
const ABORT_CODE: i32 = 1;

/// This process's place in the MPI job: initialises MPI once per process and finalises
/// it when the process exits. Get it with [`mpi_world`].
pub struct MpiWorld {
    rank: usize,
    size: usize,
    threading: Threading,
    watch: Arc<Watch>,
}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiWorld(rank {} of {}, {:?})",
            self.rank, self.size, self.threading
        )
    }
}

extern "C" fn finalize_at_exit() {
    finalize_mpi();
}

extern "C" {
    fn atexit(f: extern "C" fn()) -> std::os::raw::c_int;
}

/// Finalises MPI if this crate initialised it and it is still running (also done
/// automatically when the process exits). MPI cannot be used again afterwards.
pub fn finalize_mpi() {
    if let Some(Ok(w)) = WORLD.get() {
        w.watch.stopped.store(true, Ordering::SeqCst);
    }
    let universe = UNIVERSE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(u) = universe {
        let _calls = lock_calls();
        drop(u);
    }
}

/// The MPI job this process belongs to, initialising MPI on first use (a process
/// started without `mpirun` is a job of one).
///
/// # Errors
/// [`Error::BackendUnavailable`] when MPI was initialised by someone else, or already
/// finalised.
pub fn mpi_world() -> Result<&'static MpiWorld> {
    WORLD
        .get_or_init(|| {
            if ::mpi::environment::is_finalized() {
                return Err("MPI was already finalised in this process".into());
            }
            let (universe, threading) = ::mpi::initialize_with_threading(Threading::Multiple)
                .ok_or("MPI was initialised outside ckpt in this process")?;
            let world = universe.world();
            let (rank, size) = (world.rank() as usize, world.size() as usize);
            *UNIVERSE.lock().unwrap_or_else(PoisonError::into_inner) = Some(universe);
            // SAFETY: registers a plain `extern "C" fn` with the C library.
            unsafe { atexit(finalize_at_exit) };
            let timeout = timeout_from_env().map_err(|e| e.to_string())?;
            let watch = Arc::new(Watch {
                current: Mutex::new(None),
                timeout_ms: AtomicU64::new(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
                stopped: AtomicBool::new(false),
            });
            if size > 1 && threading == Threading::Multiple {
                let w = watch.clone();
                std::thread::Builder::new()
                    .name("mpi-watchdog".into())
                    .spawn(move || w.run(rank))
                    .map_err(|e| e.to_string())?;
            }
            Ok(MpiWorld {
                rank,
                size,
                threading,
                watch,
            })
        })
        .as_ref()
        .map_err(|problem| Error::BackendUnavailable {
            backend: "mpi",
            problem: problem.clone(),
        })
}

impl MpiWorld {
    /// This process's rank in the job.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in the job.
    #[must_use]
    pub fn size(&self) -> usize {
        self.size
    }

    /// How long a collective may wait for its peers before the job is aborted.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.watch.timeout()
    }

    /// Sets how long a collective may wait for its peers (overrides
    /// `CKPT_COMM_TIMEOUT`). Without `MPI_THREAD_MULTIPLE` there is no watchdog.
    pub fn set_timeout(&self, timeout: Duration) {
        self.watch.timeout_ms.store(
            u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            Ordering::Relaxed,
        );
    }

    /// Builds this rank's communicators for `mesh` (world, `dp` and `tp` groups, with the
    /// same group order as the thread backend). Every process must call it.
    ///
    /// # Errors
    /// A mesh with other axes, or whose size is not the number of processes.
    pub fn dist(&self, mesh: &Mesh) -> Result<Dist> {
        check_mesh(mesh)?;
        if mesh.world_size() != self.size as u64 {
            return Err(Error::option(
                "--mesh",
                format!(
                    "mesh {mesh} has {} ranks but the MPI job has {} processes \
                     (start mpirun -n {}, or give a --mesh or --ranks of {} ranks)",
                    mesh.world_size(),
                    self.size,
                    mesh.world_size(),
                    self.size
                ),
            ));
        }
        let rank = self.rank;
        let world: Arc<dyn Comm> = self.comm(SimpleCommunicator::world(), 0..self.size)?;
        let axis = |name: &str| -> Result<Arc<dyn Comm>> {
            let Some(a) = mesh.axis_index(name) else {
                return Ok(Arc::new(SoloComm { members: [rank] }));
            };
            let members: Vec<usize> = mesh
                .axis_group(rank as u64, a)
                .into_iter()
                .map(|m| m as usize)
                .collect();
            // Every process takes part in the split, even those in groups of one.
            let split = {
                let _calls = lock_calls();
                SimpleCommunicator::world().split_by_color_with_key(
                    Color::with_value(to_count(members[0])?),
                    to_count(mesh.coords(rank as u64)[a] as usize)?,
                )
            };
            let split = split.ok_or_else(|| Error::Collective {
                op: "split",
                group: format!("{members:?}"),
                problem: "MPI_Comm_split gave no communicator".into(),
            })?;
            if members.len() == 1 {
                drop(Handle(ManuallyDrop::new(split)));
                return Ok(Arc::new(SoloComm { members: [rank] }));
            }
            let comm = self.comm(split, members)?;
            Ok(comm)
        };
        let dp = axis("dp")?;
        let tp = axis("tp")?;
        Ok(Dist {
            mesh: mesh.clone(),
            rank,
            world,
            dp,
            tp,
        })
    }

    fn comm(
        &self,
        comm: SimpleCommunicator,
        members: impl IntoIterator<Item = usize>,
    ) -> Result<Arc<dyn Comm>> {
        let members: Vec<usize> = members.into_iter().collect();
        let handle = Handle(ManuallyDrop::new(comm));
        let me = members
            .iter()
            .position(|&m| m == self.rank)
            .expect("this rank is a member of its groups");
        let (got_rank, got_size) = {
            let _calls = lock_calls();
            (handle.0.rank() as usize, handle.0.size() as usize)
        };
        let label = format!("{members:?}");
        if (got_rank, got_size) != (me, members.len()) {
            return Err(Error::Collective {
                op: "split",
                group: label,
                problem: format!(
                    "MPI placed this rank at {got_rank} of {got_size}, expected {me} of {}",
                    members.len()
                ),
            });
        }
        Ok(Arc::new(MpiComm {
            handle,
            me,
            members,
            label,
            seq: AtomicU64::new(0),
            watch: self.watch.clone(),
        }))
    }

    /// Runs `f` as this process's rank of `mesh`.
    ///
    /// A failure (error or panic) of `f` in a job of several processes is printed with
    /// the rank and aborts the whole job (`MPI_Abort`), since the other ranks may be
    /// waiting in a collective for this one; in a job of one it is returned.
    ///
    /// # Errors
    /// As [`MpiWorld::dist`]; the error of `f` in a job of one process.
    pub fn run<T>(&self, mesh: &Mesh, f: impl FnOnce(Dist) -> Result<T>) -> Result<T> {
        let dist = self.dist(mesh)?;
        let rank = self.rank;
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(dist)))
            .unwrap_or_else(|p| {
                let message = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err(Error::RankPanicked { rank, message })
            });
        match out {
            Err(e) if self.size > 1 => self.abort(&e),
            out => out,
        }
    }

    /// Prints `err` (with its sources) for this rank and aborts the whole job.
    pub fn abort(&self, err: &dyn std::error::Error) -> ! {
        let mut text = err.to_string();
        let mut source = err.source();
        while let Some(s) = source {
            text.push_str(&format!(": {s}"));
            source = s.source();
        }
        eprintln!(
            "ckpt: rank {} of {}: {text}; aborting the MPI job",
            self.rank, self.size
        );
        SimpleCommunicator::world().abort(ABORT_CODE)
    }
}

/// Runs `f` as this process's rank of `mesh` in the MPI job (see [`MpiWorld::run`]).
///
/// # Errors
/// As [`mpi_world`] and [`MpiWorld::run`].
pub fn run_mpi<T>(mesh: &Mesh, f: impl FnOnce(Dist) -> Result<T>) -> Result<T> {
    mpi_world()?.run(mesh, f)
}

fn to_count(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Collective {
        op: "count",
        group: String::new(),
        problem: format!("{n} elements exceed MPI's int counts"),
    })
}

/// The collectives, as numbered in headers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    Gather = 5,
    Barrier = 6,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::Gather => "gather",
            Op::Barrier => "barrier",
        }
    }

    fn from_code(code: u64) -> &'static str {
        [
            Op::AllReduce,
            Op::AllGather,
            Op::ReduceScatter,
            Op::Broadcast,
            Op::Gather,
            Op::Barrier,
        ]
        .into_iter()
        .find(|o| *o as u64 == code)
        .map_or("an unknown collective", Op::name)
    }
}

/// One rank's header: what it is calling, with which sizes, and whether its own
/// arguments are valid.
#[derive(Clone, Copy, Debug, Default)]
struct Header {
    op: u64,
    seq: u64,
    len: u64,
    /// Root, reduce op or a hash of the counts: must agree over the group.
    agree: u64,
    /// Non-zero when this rank's arguments are invalid (checked locally).
    bad: u64,
}

const HEADER_WORDS: usize = 5;

/// A rank's handle on one MPI group.
struct MpiComm {
    handle: Handle,
    me: usize,
    members: Vec<usize>,
    label: String,
    seq: AtomicU64,
    watch: Arc<Watch>,
}

fn reduce_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Mean => 2,
        ReduceOp::Max => 3,
    }
}

/// FNV-1a over words: a fingerprint of arguments that must agree over the group.
fn fingerprint(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Splits `n` elements into `p` near-equal segments (the first `n % p` one longer).
fn segments(n: usize, p: usize) -> Vec<usize> {
    (0..p).map(|i| n / p + usize::from(i < n % p)).collect()
}

fn displacements(counts: &[i32]) -> Vec<i32> {
    counts
        .iter()
        .scan(0i32, |at, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect()
}

fn counts_i32(counts: &[usize]) -> Option<Vec<i32>> {
    let c: Option<Vec<i32>> = counts.iter().map(|&c| i32::try_from(c).ok()).collect();
    c.filter(|c| c.iter().try_fold(0i32, |a, &b| a.checked_add(b)).is_some())
}

impl MpiComm {
    fn err(&self, op: Op, problem: impl Into<String>) -> Error {
        Error::Collective {
            op: op.name(),
            group: self.label.clone(),
            problem: problem.into(),
        }
    }

    fn comm(&self) -> &SimpleCommunicator {
        &self.handle.0
    }

    /// Exchanges headers and checks that every rank called the same collective with
    /// agreeing arguments; the outcome is the same on every rank.
    fn headers(&self, op: Op, len: usize, agree: u64, bad: Option<String>) -> Result<Vec<Header>> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let mine = [op as u64, seq, len as u64, agree, u64::from(bad.is_some())];
        let mut all = vec![0u64; HEADER_WORDS * self.members.len()];
        self.comm().all_gather_into(&mine[..], &mut all[..]);
        let hs: Vec<Header> = all
            .chunks_exact(HEADER_WORDS)
            .map(|w| Header {
                op: w[0],
                seq: w[1],
                len: w[2],
                agree: w[3],
                bad: w[4],
            })
            .collect();
        for (i, h) in hs.iter().enumerate() {
            if h.op != op as u64 {
                return Err(self.err(
                    op,
                    format!(
                        "rank {} called `{}` at the same time",
                        self.members[i],
                        Op::from_code(h.op)
                    ),
                ));
            }
        }
        for (i, h) in hs.iter().enumerate() {
            if h.seq != seq {
                return Err(self.err(
                    op,
                    format!(
                        "rank {} is at collective #{} of this group, this rank at #{seq}",
                        self.members[i], h.seq
                    ),
                ));
            }
        }
        if let Some(problem) = bad {
            return Err(self.err(op, problem));
        }
        if let Some(i) = hs.iter().position(|h| h.bad != 0) {
            return Err(self.err(
                op,
                format!("rank {} passed invalid arguments", self.members[i]),
            ));
        }
        if let Some(i) = hs.iter().position(|h| h.agree != agree) {
            let what = match op {
                Op::Broadcast | Op::Gather => "the root",
                Op::AllReduce => "the reduction",
                _ => "the segment counts or reduction",
            };
            return Err(self.err(op, format!("rank {} disagrees on {what}", self.members[i])));
        }
        Ok(hs)
    }

    /// Every rank's `buf`, concatenated in group order; `lens` are the ranks' lengths.
    fn all_gather_flat(&self, op: Op, buf: &[f32], lens: &[usize]) -> Result<Vec<f32>> {
        let counts = counts_i32(lens)
            .ok_or_else(|| self.err(op, "the gathered buffers exceed MPI's int counts"))?;
        let displs = displacements(&counts);
        let mut out = vec![0f32; lens.iter().sum()];
        {
            let mut part = PartitionMut::new(&mut out[..], &counts[..], &displs[..]);
            self.comm().all_gather_varcount_into(buf, &mut part);
        }
        Ok(out)
    }

    /// Sends segment `j` of `buf` (sizes `send`) to rank `j`; returns what every rank
    /// sent here, in group order, `recv_each` elements from each.
    fn all_to_all(
        &self,
        op: Op,
        buf: &[f32],
        send: &[usize],
        recv_each: usize,
    ) -> Result<Vec<f32>> {
        let p = self.members.len();
        let send =
            counts_i32(send).ok_or_else(|| self.err(op, "the buffer exceeds MPI's int counts"))?;
        let recv = counts_i32(&vec![recv_each; p])
            .ok_or_else(|| self.err(op, "the buffer exceeds MPI's int counts"))?;
        let (sd, rd) = (displacements(&send), displacements(&recv));
        let mut out = vec![0f32; recv_each * p];
        {
            let part = Partition::new(buf, &send[..], &sd[..]);
            let mut into = PartitionMut::new(&mut out[..], &recv[..], &rd[..]);
            self.comm().all_to_all_varcount_into(&part, &mut into);
        }
        Ok(out)
    }
}

fn cut(flat: &[f32], lens: &[usize]) -> Vec<Vec<f32>> {
    let mut at = 0;
    lens.iter()
        .map(|&n| {
            let v = flat[at..at + n].to_vec();
            at += n;
            v
        })
        .collect()
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.me
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn members(&self) -> &[usize] {
        &self.members
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let _w = self.watch.enter("all_reduce", &self.label);
        let _calls = lock_calls();
        let n = buf.len();
        let hs = self.headers(Op::AllReduce, n, reduce_code(op), None)?;
        if let Some(h) = hs.iter().find(|h| h.len != n as u64) {
            return Err(self.err(
                Op::AllReduce,
                format!("buffer lengths differ ({n} and {})", h.len),
            ));
        }
        let p = self.members.len();
        let seg = segments(n, p);
        let mine = seg[self.me];
        let pieces = self.all_to_all(Op::AllReduce, buf, &seg, mine)?;
        let reduced = if mine == 0 {
            Vec::new()
        } else {
            reduce_ordered(pieces.chunks(mine), p, op)
        };
        let full = self.all_gather_flat(Op::AllReduce, &reduced, &seg)?;
        buf.copy_from_slice(&full);
        Ok(())
    }

    fn all_gather(&self, buf: &[f32]) -> Result<Vec<Vec<f32>>> {
        let _w = self.watch.enter("all_gather", &self.label);
        let _calls = lock_calls();
        let hs = self.headers(Op::AllGather, buf.len(), 0, None)?;
        let lens: Vec<usize> = hs.iter().map(|h| h.len as usize).collect();
        let flat = self.all_gather_flat(Op::AllGather, buf, &lens)?;
        Ok(cut(&flat, &lens))
    }

    fn reduce_scatter(&self, buf: &[f32], counts: &[usize], op: ReduceOp) -> Result<Vec<f32>> {
        let _w = self.watch.enter("reduce_scatter", &self.label);
        let _calls = lock_calls();
        let p = self.members.len();
        let bad = (counts.len() != p || counts.iter().sum::<usize>() != buf.len())
            .then(|| "counts do not match the buffer".to_string());
        let agree = fingerprint(counts.iter().map(|&c| c as u64).chain([reduce_code(op)]));
        let hs = self.headers(Op::ReduceScatter, buf.len(), agree, bad)?;
        if let Some(h) = hs.iter().find(|h| h.len != buf.len() as u64) {
            return Err(self.err(
                Op::ReduceScatter,
                format!("buffer lengths differ ({} and {})", buf.len(), h.len),
            ));
        }
        let mine = counts[self.me];
        let pieces = self.all_to_all(Op::ReduceScatter, buf, counts, mine)?;
        if mine == 0 {
            return Ok(Vec::new());
        }
        Ok(reduce_ordered(pieces.chunks(mine), p, op))
    }

    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        let _w = self.watch.enter("broadcast", &self.label);
        let _calls = lock_calls();
        let bad = (root >= self.members.len())
            .then(|| format!("root {root} is not in a group of {}", self.members.len()));
        let hs = self.headers(Op::Broadcast, buf.len(), root as u64, bad)?;
        let n = hs[root].len as usize;
        if self.me != root {
            buf.clear();
            buf.resize(n, 0.0);
        }
        if n > 0 {
            to_count(n)
                .map_err(|_| self.err(Op::Broadcast, "the buffer exceeds MPI's int counts"))?;
            self.comm()
                .process_at_rank(root as i32)
                .broadcast_into(&mut buf[..]);
        }
        Ok(())
    }

    fn gather(&self, buf: &[f32], root: usize) -> Result<Option<Vec<Vec<f32>>>> {
        let _w = self.watch.enter("gather", &self.label);
        let _calls = lock_calls();
        let bad = (root >= self.members.len())
            .then(|| format!("root {root} is not in a group of {}", self.members.len()));
        let hs = self.headers(Op::Gather, buf.len(), root as u64, bad)?;
        let lens: Vec<usize> = hs.iter().map(|h| h.len as usize).collect();
        let counts = counts_i32(&lens)
            .ok_or_else(|| self.err(Op::Gather, "the gathered buffers exceed MPI's int counts"))?;
        let proc = self.comm().process_at_rank(root as i32);
        if self.me != root {
            proc.gather_varcount_into(buf);
            return Ok(None);
        }
        let displs = displacements(&counts);
        let mut flat = vec![0f32; lens.iter().sum()];
        {
            let mut part = PartitionMut::new(&mut flat[..], &counts[..], &displs[..]);
            proc.gather_varcount_into_root(buf, &mut part);
        }
        Ok(Some(cut(&flat, &lens)))
    }

    fn barrier(&self) -> Result<()> {
        let _w = self.watch.enter("barrier", &self.label);
        let _calls = lock_calls();
        // The header exchange is an all-gather: nobody leaves before everyone arrived.
        self.headers(Op::Barrier, 0, 0, None).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_buffer() {
        assert_eq!(segments(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(segments(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(segments(0, 3), vec![0, 0, 0]);
        assert_eq!(displacements(&[3, 3, 2, 2]), vec![0, 3, 6, 8]);
    }

    #[test]
    fn counts_beyond_int_are_refused() {
        assert_eq!(counts_i32(&[1, 2]), Some(vec![1, 2]));
        assert_eq!(counts_i32(&[i32::MAX as usize, 1]), None);
        assert_eq!(counts_i32(&[usize::MAX]), None);
    }

    #[test]
    fn fingerprints_tell_counts_apart() {
        assert_ne!(fingerprint([1, 2]), fingerprint([2, 1]));
        assert_eq!(fingerprint([3, 4]), fingerprint([3, 4]));
    }
}

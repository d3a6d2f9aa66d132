//! The NCCL backend (feature `cuda`): collectives between GPUs, one rank per GPU.
//!
//! Ranks are thread ranks of one process (one GPU each), processes under `mpirun`
//! (with the `mpi` feature), or processes under `torchrun` / `srun`. Each rank binds
//! the GPU `local_rank % device_count`; CUDA numbers only the devices listed in
//! `CUDA_VISIBLE_DEVICES`, so restricting that variable restricts the choice.
//!
//! Group rank 0 creates each group's NCCL unique id and shares it through the host
//! engine: the thread or MPI communicator of the same group, or, under `torchrun` and
//! `srun`, a file in `CKPT_RENDEZVOUS_DIR` (a directory every rank sees; default the
//! system temporary directory, which only works on one machine).
//!
//! NCCL moves the bytes; the reductions are done on the host in group order, as the
//! thread backend does them, so results are bit-identical to the other backends (NCCL's
//! own all-reduce picks its order from the topology). A collective that does not
//! complete within `CKPT_COMM_TIMEOUT` seconds (default 600) aborts its communicator
//! and fails with [`Error::Collective`].

use super::process::{reduce_ordered, timeout_from_env};
use super::{Comm, Dist, ReduceOp, SoloComm};
use crate::cuda::{nccl, NcclLib};
use crate::error::{Error, Result};
use crate::launch::{LaunchEnv, Launcher};
use ckpt_core::layout::mesh::Mesh;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::os::raw::c_void;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

/// Directory for unique-id files of ranks without a host engine (`torchrun`, `srun`).
pub const RENDEZVOUS_DIR_VAR: &str = "CKPT_RENDEZVOUS_DIR";

/// Names a job's unique-id files; defaults to the launcher's job id.
pub const JOB_ID_VAR: &str = "CKPT_JOB_ID";

fn unavailable(problem: impl Into<String>) -> Error {
    Error::BackendUnavailable {
        backend: "nccl",
        problem: problem.into(),
    }
}

/// Runs `f` as the ranks of `mesh` in this process on NCCL: every rank as a thread
/// (one GPU each) when no launcher started this process, otherwise this process's rank.
///
/// # Errors
/// No driver, device or NCCL ([`Error::BackendUnavailable`]); an invalid mesh; a
/// failing rank.
pub fn run_nccl<T: Send>(mesh: &Mesh, f: impl Fn(Dist) -> Result<T> + Sync) -> Result<Vec<T>> {
    let devices = crate::cuda::device_count().map_err(unavailable)?;
    let timeout = timeout_from_env()?;
    match LaunchEnv::from_env()? {
        None if mesh.world_size() > devices as u64 => Err(unavailable(format!(
            "mesh {mesh} has {} thread ranks but {devices} CUDA device(s) are visible; \
             NCCL needs a GPU per rank",
            mesh.world_size()
        ))),
        None => super::run_threads(mesh, |host| {
            let d = nccl_dist(&host, host.rank, devices, &Ids::Host, timeout)?;
            f(d)
        }),
        #[cfg(feature = "mpi")]
        Some(env) if env.launcher == Launcher::OpenMpi => Ok(vec![super::run_mpi(mesh, |host| {
            f(nccl_dist(
                &host,
                env.local_rank,
                devices,
                &Ids::Host,
                timeout,
            )?)
        })?]),
        Some(env) => {
            super::check_mesh(mesh)?;
            if mesh.world_size() != env.world_size as u64 {
                return Err(Error::option(
                    "--mesh",
                    format!(
                        "mesh {mesh} has {} ranks but {} started {} processes",
                        mesh.world_size(),
                        env.launcher,
                        env.world_size
                    ),
                ));
            }
            let host = layout_dist(mesh, env.rank);
            let ids = Ids::Files {
                dir: rendezvous_dir(),
                job: job_id(env.launcher),
            };
            Ok(vec![f(nccl_dist(
                &host,
                env.local_rank,
                devices,
                &ids,
                timeout,
            )?)?])
        }
    }
}

fn rendezvous_dir() -> PathBuf {
    std::env::var_os(RENDEZVOUS_DIR_VAR).map_or_else(std::env::temp_dir, PathBuf::from)
}

/// The job's id, from [`JOB_ID_VAR`] or the launcher (torchrun's `--rdzv-id`, SLURM's
/// job and step).
fn job_id(launcher: Launcher) -> String {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let Some(j) = var(JOB_ID_VAR) {
        return j;
    }
    match launcher {
        Launcher::Slurm => format!(
            "slurm-{}-{}",
            var("SLURM_JOB_ID").unwrap_or_default(),
            var("SLURM_STEP_ID").unwrap_or_default()
        ),
        Launcher::Torchrun => format!(
            "torchrun-{}",
            var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into())
        ),
        Launcher::OpenMpi => format!(
            "ompi-{}",
            var("OMPI_MCA_orte_ess_jobid")
                .or_else(|| var("PMIX_NAMESPACE"))
                .unwrap_or_default()
        ),
    }
}

/// A rank's groups of `mesh`, as shapes only (the NCCL communicators replace them).
fn layout_dist(mesh: &Mesh, rank: usize) -> Dist {
    let members = |axis: &str| -> Vec<usize> {
        let Some(a) = mesh.axis_index(axis) else {
            return vec![rank];
        };
        mesh.axis_group(rank as u64, a)
            .into_iter()
            .map(|m| m as usize)
            .collect()
    };
    let group = |members: Vec<usize>| -> Arc<dyn Comm> {
        let me = members
            .iter()
            .position(|&m| m == rank)
            .expect("a rank is in its groups");
        Arc::new(super::ShapeOnlyComm { rank: me, members })
    };
    Dist {
        mesh: mesh.clone(),
        rank,
        world: group((0..mesh.world_size() as usize).collect()),
        dp: group(members("dp")),
        tp: group(members("tp")),
    }
}

/// How group rank 0 shares a unique id.
enum Ids {
    /// Through the host communicator of the same group.
    Host,
    /// Through a file `DIR/ckpt-nccl-JOB-GROUP.id`.
    Files { dir: PathBuf, job: String },
}

/// A unique id as 32 `f32` bit patterns, for a host broadcast (moved, never computed).
fn id_to_words(id: &crate::cuda::UniqueId) -> Vec<f32> {
    id.internal
        .chunks_exact(4)
        .map(|c| {
            f32::from_bits(u32::from_le_bytes([
                c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8,
            ]))
        })
        .collect()
}

fn id_from_words(w: &[f32]) -> Option<crate::cuda::UniqueId> {
    if w.len() != 32 {
        return None;
    }
    let mut id = crate::cuda::UniqueId { internal: [0; 128] };
    for (i, x) in w.iter().enumerate() {
        for (j, b) in x.to_bits().to_le_bytes().into_iter().enumerate() {
            id.internal[i * 4 + j] = b as std::os::raw::c_char;
        }
    }
    Some(id)
}

/// Writes `bytes` to `path` atomically (temporary file, then rename).
fn publish(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Reads `path` once it exists and was written after `since` (older files are left
/// over from an earlier job with the same id), waiting up to `timeout`.
fn await_file(path: &Path, since: SystemTime, timeout: Duration) -> std::io::Result<Vec<u8>> {
    let start = Instant::now();
    loop {
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.modified().is_ok_and(|m| m >= since) {
                return std::fs::read(path);
            }
        }
        if start.elapsed() > timeout {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{} did not appear within {:.0} s (is {RENDEZVOUS_DIR_VAR} shared by all ranks?)", path.display(), timeout.as_secs_f64()),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// When this process started, less a margin for launchers that start ranks seconds
/// apart: files older than that are stale.
fn process_epoch() -> SystemTime {
    static START: std::sync::OnceLock<SystemTime> = std::sync::OnceLock::new();
    *START.get_or_init(|| SystemTime::now() - Duration::from_secs(30))
}

/// Shares group rank 0's 128-byte id with the group through a file.
fn file_rendezvous(
    dir: &Path,
    job: &str,
    group: &[usize],
    me: usize,
    make: impl FnOnce() -> Result<Vec<u8>>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let name = format!(
        "ckpt-nccl-{}-{}.id",
        job.replace(['/', ' '], "_"),
        group
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("_")
    );
    let path = dir.join(name);
    let since = process_epoch();
    let io = |e: std::io::Error| Error::Io {
        path: path.clone(),
        source: e,
    };
    if me == 0 {
        let bytes = make()?;
        publish(&path, &bytes).map_err(io)?;
        Ok(bytes)
    } else {
        await_file(&path, since, timeout).map_err(io)
    }
}

/// NCCL communicators for `host`'s groups on the GPU `local_rank % devices`.
fn nccl_dist(
    host: &Dist,
    local_rank: usize,
    devices: usize,
    ids: &Ids,
    timeout: Duration,
) -> Result<Dist> {
    // A rank alone in every group still gets real communicators of one (NCCL runs each
    // collective, so a one-GPU machine exercises init, the collectives and abort); the
    // stand-in only where NCCL itself is absent.
    let lib = match nccl() {
        Ok(lib) => Some(lib),
        Err(problem) if host.world.size() == 1 => {
            eprintln!("ckpt: {problem}; one rank runs without NCCL (no collective to issue)");
            None
        }
        Err(problem) => return Err(unavailable(problem)),
    };
    let device = local_rank % devices;
    let cuda = |e: cudarc::driver::DriverError| unavailable(format!("CUDA device {device}: {e}"));
    let ctx = CudaContext::new(device).map_err(cuda)?;
    let stream = ctx.new_stream().map_err(cuda)?;
    let group = |h: &Arc<dyn Comm>| -> Result<Arc<dyn Comm>> {
        let members = h.members().to_vec();
        let Some(lib) = lib else {
            return Ok(Arc::new(SoloComm {
                members: [host.rank],
            }));
        };
        let me = h.rank();
        let make = || -> Result<crate::cuda::UniqueId> {
            let mut id = crate::cuda::UniqueId { internal: [0; 128] };
            // SAFETY: writes the 128-byte id.
            check(
                lib,
                unsafe { (lib.get_unique_id)(&mut id) },
                "ncclGetUniqueId",
                &members,
            )?;
            Ok(id)
        };
        let id = match ids {
            // No peer to share the id with.
            _ if members.len() == 1 => make()?,
            Ids::Host => {
                let mut words = if me == 0 {
                    id_to_words(&make()?)
                } else {
                    Vec::new()
                };
                h.broadcast(&mut words, 0)?;
                id_from_words(&words).ok_or_else(|| Error::Collective {
                    op: "nccl_init",
                    group: format!("{members:?}"),
                    problem: "malformed unique id".into(),
                })?
            }
            Ids::Files { dir, job } => {
                let bytes = file_rendezvous(
                    dir,
                    job,
                    &members,
                    me,
                    || make().map(|id| id.internal.iter().map(|&c| c as u8).collect()),
                    timeout,
                )?;
                let mut id = crate::cuda::UniqueId { internal: [0; 128] };
                if bytes.len() != 128 {
                    return Err(Error::Collective {
                        op: "nccl_init",
                        group: format!("{members:?}"),
                        problem: "malformed unique-id file".into(),
                    });
                }
                for (d, s) in id.internal.iter_mut().zip(bytes) {
                    *d = s as std::os::raw::c_char;
                }
                id
            }
        };
        ctx.bind_to_thread().map_err(cuda)?;
        let mut raw: crate::cuda::RawComm = std::ptr::null_mut();
        // SAFETY: every member calls this with the same id and group size.
        check(
            lib,
            unsafe { (lib.comm_init_rank)(&mut raw, members.len() as i32, id, me as i32) },
            "ncclCommInitRank",
            &members,
        )?;
        Ok(Arc::new(NcclComm {
            lib,
            raw,
            ctx: ctx.clone(),
            stream: stream.clone(),
            me,
            label: format!("{members:?}"),
            members,
            seq: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
            calls: Mutex::new(()),
            timeout,
        }))
    };
    Ok(Dist {
        mesh: host.mesh.clone(),
        rank: host.rank,
        world: group(&host.world)?,
        dp: group(&host.dp)?,
        tp: group(&host.tp)?,
    })
}

fn check(lib: &NcclLib, r: i32, call: &str, members: &[usize]) -> Result<()> {
    if r == 0 {
        return Ok(());
    }
    Err(Error::Collective {
        op: "nccl",
        group: format!("{members:?}"),
        problem: format!("{call}: {}", lib.error_string(r)),
    })
}

/// A rank's NCCL communicator for one group, with its GPU stream.
struct NcclComm {
    lib: &'static NcclLib,
    raw: crate::cuda::RawComm,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    me: usize,
    members: Vec<usize>,
    label: String,
    seq: AtomicU64,
    aborted: AtomicBool,
    calls: Mutex<()>,
    timeout: Duration,
}

// SAFETY: the NCCL communicator is only used under `calls`; NCCL allows a communicator
// to be used from any thread as long as calls are not concurrent.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // SAFETY: the communicator is not used after this.
            unsafe { (self.lib.comm_destroy)(self.raw) };
        }
    }
}

/// One rank's header, as in the MPI backend: `[op, seq, len, agree, bad]`.
const HEADER_WORDS: usize = 5;

impl NcclComm {
    fn err(&self, op: &'static str, problem: impl Into<String>) -> Error {
        Error::Collective {
            op,
            group: self.label.clone(),
            problem: problem.into(),
        }
    }

    fn cuda(&self, op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
        move |e| self.err(op, format!("CUDA: {e}"))
    }

    /// Waits for the stream, failing (and aborting the communicator) when NCCL reports
    /// an error or the collective overruns the timeout.
    fn wait(&self, op: &'static str) -> Result<()> {
        let start = Instant::now();
        loop {
            // SAFETY: queries a live stream.
            let q = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match q {
                cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                other => return Err(self.err(op, format!("CUDA: {other:?}"))),
            }
            let mut async_err = 0;
            // SAFETY: reads the communicator's error state.
            unsafe { (self.lib.comm_get_async_error)(self.raw, &mut async_err) };
            if async_err != 0 && async_err != 7 {
                self.abort();
                return Err(self.err(op, format!("NCCL: {}", self.lib.error_string(async_err))));
            }
            if start.elapsed() > self.timeout {
                self.abort();
                return Err(self.err(
                    op,
                    format!("did not complete within {:.1} s (a peer rank is stuck or gone); communicator aborted", self.timeout.as_secs_f64()),
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: aborting frees the communicator; `aborted` keeps it from reuse.
            unsafe { (self.lib.comm_abort)(self.raw) };
        }
    }

    /// NCCL all-gather of `count` elements of type `dtype` per rank.
    fn raw_all_gather<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        op: &'static str,
        mine: &[T],
        dtype: i32,
    ) -> Result<Vec<T>> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(self.err(op, "the communicator was aborted by an earlier failure"));
        }
        let p = self.members.len();
        let n = mine.len();
        let send: CudaSlice<T> = self.stream.clone_htod(mine).map_err(self.cuda(op))?;
        let mut recv: CudaSlice<T> = self.stream.alloc_zeros(n * p).map_err(self.cuda(op))?;
        {
            let (s, _sync_s) = send.device_ptr(&self.stream);
            let (r, _sync_r) = recv.device_ptr_mut(&self.stream);
            self.ctx.bind_to_thread().map_err(self.cuda(op))?;
            // SAFETY: device buffers of `n` and `n * p` elements on this stream.
            let res = unsafe {
                (self.lib.all_gather)(
                    s as *const c_void,
                    r as *mut c_void,
                    n,
                    dtype,
                    self.raw,
                    self.stream.cu_stream().cast(),
                )
            };
            check(self.lib, res, "ncclAllGather", &self.members)?;
        }
        self.wait(op)?;
        self.stream.clone_dtoh(&recv).map_err(self.cuda(op))
    }

    /// Headers of every rank; the same checks as the MPI backend.
    fn headers(
        &self,
        op: &'static str,
        code: u64,
        len: usize,
        agree: u64,
        bad: Option<String>,
    ) -> Result<Vec<[u64; HEADER_WORDS]>> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let mine = [code, seq, len as u64, agree, u64::from(bad.is_some())];
        let all = self.raw_all_gather(op, &mine, crate::cuda::NCCL_UINT64)?;
        let hs: Vec<[u64; HEADER_WORDS]> = all
            .chunks_exact(HEADER_WORDS)
            .map(|w| [w[0], w[1], w[2], w[3], w[4]])
            .collect();
        if let Some(i) = hs.iter().position(|h| h[0] != code || h[1] != seq) {
            return Err(self.err(
                op,
                format!(
                    "rank {} called another collective at the same time",
                    self.members[i]
                ),
            ));
        }
        if let Some(problem) = bad {
            return Err(self.err(op, problem));
        }
        if let Some(i) = hs.iter().position(|h| h[4] != 0) {
            return Err(self.err(
                op,
                format!("rank {} passed invalid arguments", self.members[i]),
            ));
        }
        if let Some(i) = hs.iter().position(|h| h[3] != agree) {
            return Err(self.err(
                op,
                format!(
                    "rank {} disagrees on the root, counts or reduction",
                    self.members[i]
                ),
            ));
        }
        Ok(hs)
    }

    /// Every rank's buffer (lengths from the headers), padded to the longest for NCCL.
    fn gather_all(&self, op: &'static str, buf: &[f32], lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        let max = lens.iter().copied().max().unwrap_or(0);
        if max == 0 {
            return Ok(vec![Vec::new(); lens.len()]);
        }
        let mut padded = buf.to_vec();
        padded.resize(max, 0.0);
        let flat = self.raw_all_gather(op, &padded, crate::cuda::NCCL_FLOAT32)?;
        Ok(flat
            .chunks_exact(max)
            .zip(lens)
            .map(|(c, &n)| c[..n].to_vec())
            .collect())
    }
}

fn reduce_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Mean => 2,
        ReduceOp::Max => 3,
    }
}

impl Comm for NcclComm {
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
        let _calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let hs = self.headers("all_reduce", 1, buf.len(), reduce_code(op), None)?;
        if let Some(h) = hs.iter().find(|h| h[2] != buf.len() as u64) {
            return Err(self.err(
                "all_reduce",
                format!("buffer lengths differ ({} and {})", buf.len(), h[2]),
            ));
        }
        let parts = self.gather_all("all_reduce", buf, &vec![buf.len(); hs.len()])?;
        let r = reduce_ordered(parts.iter().map(Vec::as_slice), parts.len(), op);
        buf.copy_from_slice(&r);
        Ok(())
    }

    fn all_gather(&self, buf: &[f32]) -> Result<Vec<Vec<f32>>> {
        let _calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let hs = self.headers("all_gather", 2, buf.len(), 0, None)?;
        let lens: Vec<usize> = hs.iter().map(|h| h[2] as usize).collect();
        self.gather_all("all_gather", buf, &lens)
    }

    fn reduce_scatter(&self, buf: &[f32], counts: &[usize], op: ReduceOp) -> Result<Vec<f32>> {
        let _calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let p = self.members.len();
        let bad = (counts.len() != p || counts.iter().sum::<usize>() != buf.len())
            .then(|| "counts do not match the buffer".to_string());
        let agree = counts.iter().fold(reduce_code(op), |h, &c| {
            h.wrapping_mul(0x0100_0000_01b3) ^ c as u64
        });
        let hs = self.headers("reduce_scatter", 3, buf.len(), agree, bad)?;
        if let Some(h) = hs.iter().find(|h| h[2] != buf.len() as u64) {
            return Err(self.err(
                "reduce_scatter",
                format!("buffer lengths differ ({} and {})", buf.len(), h[2]),
            ));
        }
        let parts = self.gather_all("reduce_scatter", buf, &vec![buf.len(); p])?;
        let start: usize = counts[..self.me].iter().sum();
        let end = start + counts[self.me];
        Ok(reduce_ordered(parts.iter().map(|v| &v[start..end]), p, op))
    }

    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        let _calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let bad = (root >= self.members.len())
            .then(|| format!("root {root} is not in a group of {}", self.members.len()));
        let hs = self.headers("broadcast", 4, buf.len(), root as u64, bad)?;
        let n = hs[root][2] as usize;
        if self.me != root {
            buf.clear();
            buf.resize(n, 0.0);
        }
        if n == 0 {
            return Ok(());
        }
        let mut dev: CudaSlice<f32> = self
            .stream
            .clone_htod(&buf[..])
            .map_err(self.cuda("broadcast"))?;
        {
            let (d, _sync) = dev.device_ptr_mut(&self.stream);
            self.ctx.bind_to_thread().map_err(self.cuda("broadcast"))?;
            // SAFETY: an in-place broadcast of `n` floats on this stream.
            let res = unsafe {
                (self.lib.broadcast)(
                    d as *const c_void,
                    d as *mut c_void,
                    n,
                    crate::cuda::NCCL_FLOAT32,
                    root as i32,
                    self.raw,
                    self.stream.cu_stream().cast(),
                )
            };
            check(self.lib, res, "ncclBroadcast", &self.members)?;
        }
        self.wait("broadcast")?;
        *buf = self
            .stream
            .clone_dtoh(&dev)
            .map_err(self.cuda("broadcast"))?;
        Ok(())
    }

    fn gather(&self, buf: &[f32], root: usize) -> Result<Option<Vec<Vec<f32>>>> {
        let _calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let bad = (root >= self.members.len())
            .then(|| format!("root {root} is not in a group of {}", self.members.len()));
        let hs = self.headers("gather", 5, buf.len(), root as u64, bad)?;
        let lens: Vec<usize> = hs.iter().map(|h| h[2] as usize).collect();
        let all = self.gather_all("gather", buf, &lens)?;
        Ok((self.me == root).then_some(all))
    }

    fn barrier(&self) -> Result<()> {
        let _calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        self.headers("barrier", 6, 0, 0, None).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_survive_the_host_broadcast_encoding() {
        let mut id = crate::cuda::UniqueId { internal: [0; 128] };
        for (i, c) in id.internal.iter_mut().enumerate() {
            // Every byte value, including those that make NaN patterns.
            *c = (i as u8).wrapping_mul(37).wrapping_add(255) as std::os::raw::c_char;
        }
        id.internal[0..4].copy_from_slice(&[-1, -1, -1, -1]);
        let back = id_from_words(&id_to_words(&id)).unwrap();
        assert_eq!(back.internal, id.internal);
        assert!(id_from_words(&[0.0; 31]).is_none());
    }

    #[test]
    fn file_rendezvous_shares_rank_zeros_id() {
        let dir = tempfile::tempdir().unwrap();
        let group = [0usize, 2, 4];
        let out: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|me| {
                    let dir = dir.path();
                    s.spawn(move || {
                        if me == 0 {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        file_rendezvous(
                            dir,
                            "job 1/x",
                            &group,
                            me,
                            || Ok(vec![7u8; 128]),
                            Duration::from_secs(10),
                        )
                        .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(out.iter().all(|b| b == &vec![7u8; 128]));
        assert!(dir.path().join("ckpt-nccl-job_1_x-0_2_4.id").exists());
    }

    #[test]
    fn file_rendezvous_times_out_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = file_rendezvous(
            dir.path(),
            "j",
            &[0, 1],
            1,
            || unreachable!(),
            Duration::from_millis(100),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("ckpt-nccl-j-0_1.id")
                && err.to_string().contains(RENDEZVOUS_DIR_VAR),
            "{err}"
        );
    }

    #[test]
    fn stale_id_files_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.id");
        std::fs::write(&path, [1u8; 128]).unwrap();
        let future = SystemTime::now() + Duration::from_secs(3600);
        assert!(await_file(&path, future, Duration::from_millis(50)).is_err());
        assert_eq!(
            await_file(&path, SystemTime::UNIX_EPOCH, Duration::from_millis(50)).unwrap(),
            vec![1u8; 128]
        );
    }

    #[test]
    fn layout_groups_match_the_thread_backend() {
        let mesh = Mesh::parse("dp=2,tp=2").unwrap();
        let d = layout_dist(&mesh, 2);
        assert_eq!(
            (d.dp.members(), d.tp.members(), d.dp.rank(), d.tp.rank()),
            (&[0, 2][..], &[2, 3][..], 1, 0)
        );
        assert_eq!(d.world.members(), &[0, 1, 2, 3]);
    }

    #[test]
    fn without_a_gpu_the_backend_fails_clearly() {
        if crate::cuda::cuda_available().is_ok() {
            return;
        }
        let mesh = Mesh::parse("dp=2").unwrap();
        let err = run_nccl(&mesh, |_| Ok(())).unwrap_err();
        assert!(
            matches!(
                err,
                Error::BackendUnavailable {
                    backend: "nccl",
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string()
                .starts_with("backend `nccl` unavailable: no "),
            "{err}"
        );
    }
}

//! Tests of the MPI backend (feature `mpi`) against the thread backend, under `mpirun`.
//!
//! Run without arguments (`cargo test -p ckpt-train --features mpi --test mpi`, or
//! `train/tests/mpi.sh`), this binary is the supervisor: it starts itself under
//! `mpirun -n 2` and `-n 4` for each scenario and checks the outcome. Started by
//! `mpirun` with a scenario name, it is one rank of that scenario.
//!
//! - `collectives`: every collective on the world, dp and tp groups of several meshes
//!   gives, bit for bit, what the thread backend gives for the same rank; mismatched
//!   calls fail on every rank and leave the group usable.
//! - `train`: training under MPI writes checkpoints byte-identical to a thread-rank run
//!   of the same mesh, seed and data; a checkpoint saved under MPI resumes under threads
//!   and one saved under threads resumes under MPI, both ending byte-identical to an
//!   uninterrupted run (mlp with dp, tp, ZeRO-1 and SGD; ResNet-8 with --sync-bn; vit).
//! - a rank killed during training (`train` with `CKPT_TEST_PID_DIR`) ends the job and
//!   leaves `latest` naming a complete checkpoint that resumes.
//! - `dies`, `fails`, `stuck`: a rank killed by a signal, a rank whose work fails, and a
//!   rank that stops calling collectives all end the job with an error within a bound.

use ckpt_core::layout::mesh::Mesh;
use ckpt_train::{
    all_gather_tensor, all_reduce_tensor, mpi_world, run_threads, Backend, Comm, Dist, LaunchEnv,
    ReduceOp, Result, TrainConfig,
};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let under_mpirun =
        matches!(LaunchEnv::from_env(), Ok(Some(e)) if e.launcher == ckpt_train::Launcher::OpenMpi);
    let outcome = match (args.get(1).map(String::as_str), under_mpirun) {
        (Some(scenario), true) => worker(scenario, &args[2..]),
        (None | Some("--nocapture" | "--quiet" | "-q"), false) => supervise(),
        (Some(other), false) => Err(format!(
            "`{other}`: scenarios run under mpirun; run without arguments to run them all"
        )),
        (None, true) => Err("under mpirun, name a scenario".into()),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpi test: {e}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------
// Supervisor
// ---------------------------------------------------------------------------------

/// What one `mpirun` did.
struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
    seconds: f64,
}

/// An `mpirun` in progress, its output read by threads.
struct Job {
    n: usize,
    scenario: String,
    child: std::process::Child,
    start: Instant,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

fn read_all(mut r: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        r.read_to_string(&mut s).ok();
        s
    })
}

/// Starts this binary as `n` ranks of `scenario`.
fn spawn_mpirun(
    n: usize,
    scenario: &str,
    extra: &[String],
    envs: &[(&str, &str)],
) -> std::result::Result<Job, String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"])
        .arg(&me)
        .arg(scenario)
        .args(extra)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // Ranks share two cores with each other: yield instead of spinning in MPI waits.
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start mpirun (install openmpi-bin): {e}"))?;
    let out = read_all(child.stdout.take().expect("piped"));
    let err = read_all(child.stderr.take().expect("piped"));
    Ok(Job {
        n,
        scenario: scenario.into(),
        child,
        start,
        out,
        err,
    })
}

impl Job {
    /// Waits for the job, killing it after `limit`.
    fn finish(mut self, limit: Duration) -> std::result::Result<Run, String> {
        let status = loop {
            if let Some(s) = self.child.try_wait().map_err(|e| e.to_string())? {
                break s;
            }
            if self.start.elapsed() > limit {
                self.child.kill().ok();
                self.child.wait().ok();
                let (o, e) = (
                    self.out.join().unwrap_or_default(),
                    self.err.join().unwrap_or_default(),
                );
                return Err(format!(
                    "mpirun -n {} {} still running after {limit:?}: killed\nstdout:\n{o}\nstderr:\n{e}",
                    self.n, self.scenario
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Ok(Run {
            ok: status.success(),
            stdout: self.out.join().unwrap_or_default(),
            stderr: self.err.join().unwrap_or_default(),
            seconds: self.start.elapsed().as_secs_f64(),
        })
    }
}

/// Runs this binary as `n` ranks of `scenario`, killing it after `limit`.
fn mpirun(
    n: usize,
    scenario: &str,
    extra: &[String],
    envs: &[(&str, &str)],
    limit: Duration,
) -> std::result::Result<Run, String> {
    spawn_mpirun(n, scenario, extra, envs)?.finish(limit)
}

fn expect_ok(run: &Run, what: &str) -> std::result::Result<(), String> {
    if run.ok {
        println!("ok: {what} ({:.1} s)", run.seconds);
        Ok(())
    } else {
        Err(format!(
            "{what} failed\nstdout:\n{}\nstderr:\n{}",
            run.stdout, run.stderr
        ))
    }
}

fn supervise() -> std::result::Result<(), String> {
    let long = Duration::from_secs(600);
    for n in [2, 4] {
        expect_ok(
            &mpirun(n, "collectives", &[], &[], long)?,
            &format!("collectives bit-identical to threads, mpirun -n {n}"),
        )?;
    }
    train_scenarios(long)?;
    failure_scenarios()?;
    println!("all MPI scenarios passed");
    Ok(())
}

/// A failure scenario must end the job, non-zero, well before `limit`.
fn expect_failure(
    run: &Run,
    what: &str,
    needle: &str,
    limit: f64,
) -> std::result::Result<(), String> {
    if run.ok {
        return Err(format!(
            "{what}: the job succeeded\nstderr:\n{}",
            run.stderr
        ));
    }
    if !run.stderr.contains(needle) {
        return Err(format!(
            "{what}: stderr lacks `{needle}`\nstdout:\n{}\nstderr:\n{}",
            run.stdout, run.stderr
        ));
    }
    if run.seconds > limit {
        return Err(format!(
            "{what}: took {:.1} s, more than {limit} s",
            run.seconds
        ));
    }
    println!("ok: {what} ({:.1} s)", run.seconds);
    Ok(())
}

/// Kills rank 1 with SIGKILL after ten checkpoints of a long run: the job ends, and
/// `latest` names a complete checkpoint that resumes.
fn killed_during_training(limit: Duration) -> std::result::Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = tmp.path().join("run");
    let pids = tmp.path().join("pids");
    std::fs::create_dir_all(&pids).map_err(|e| e.to_string())?;
    // 512 images at batch 64 for 500 epochs: 4000 updates, far more than the test waits.
    let long = |extra: &[&str]| -> Vec<String> {
        let mut a = train_args("dp=2", extra);
        let at = a
            .iter()
            .position(|x| x == "--epochs")
            .expect("train_args sets --epochs");
        a[at + 1] = "500".into();
        a
    };
    let mut args = long(&["--save-every", "4"]);
    args.extend(["--out".into(), path_arg(&out)]);
    let pid_env = path_arg(&pids);
    let job = spawn_mpirun(
        2,
        "train",
        &args,
        &[
            ("CKPT_TEST_PID_DIR", &pid_env),
            ("CKPT_COMM_TIMEOUT", "300"),
        ],
    )?;
    let latest = out.join(ckpt_train::LATEST_FILE);
    let waited = Instant::now();
    let mut job = job;
    // Wait for ten saves, so that the kill lands while saves come and go.
    let saved = |l: &Path| {
        std::fs::read_to_string(l)
            .ok()
            .and_then(|n| n.trim().trim_start_matches("step_").parse::<u64>().ok())
    };
    while !matches!(saved(&latest), Some(s) if s >= 40) || !pids.join("pid-1").exists() {
        if job.child.try_wait().map_err(|e| e.to_string())?.is_some() {
            let run = job.finish(limit)?;
            return Err(format!(
                "the run ended before its first checkpoint\nstderr:\n{}",
                run.stderr
            ));
        }
        if waited.elapsed() > limit {
            return Err(format!(
                "no checkpoint after {limit:?}\n{}",
                job.finish(Duration::ZERO).err().unwrap_or_default()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = std::fs::read_to_string(pids.join("pid-1")).map_err(|e| e.to_string())?;
    let killed = Command::new("kill")
        .args(["-9", pid.trim()])
        .status()
        .map_err(|e| e.to_string())?;
    if !killed.success() {
        return Err(format!("kill -9 {pid} failed (did the run end already?)"));
    }
    let run = job.finish(limit)?;
    expect_failure(
        &run,
        "a rank killed during training ends the job",
        "signal 9",
        60.0,
    )?;
    let name = std::fs::read_to_string(&latest).map_err(|e| e.to_string())?;
    let step: u64 = name
        .trim()
        .trim_start_matches("step_")
        .parse()
        .map_err(|_| format!("latest is `{name}`"))?;
    let files = checkpoint_files(&out, step)?;
    if files.len() != 4 {
        return Err(format!(
            "checkpoint step_{step} after the kill has {} files, not 4",
            files.len()
        ));
    }
    let mut a = long(&[]);
    a.extend([
        "--resume".into(),
        path_arg(&out),
        "--max-steps".into(),
        (step + 1).to_string(),
        "--out".into(),
        path_arg(&tmp.path().join("resumed")),
    ]);
    train_threads(&a)?;
    println!("ok: after the kill, latest (step {step}) is complete and resumes under threads");
    Ok(())
}

fn failure_scenarios() -> std::result::Result<(), String> {
    let limit = Duration::from_secs(120);
    // The watchdog's limit is far away: mpirun itself must notice the dead rank.
    killed_during_training(limit)?;
    let run = mpirun(2, "dies", &[], &[("CKPT_COMM_TIMEOUT", "300")], limit)?;
    expect_failure(
        &run,
        "a rank killed by a signal ends the job",
        "signal",
        60.0,
    )?;
    let run = mpirun(2, "fails", &[], &[("CKPT_COMM_TIMEOUT", "300")], limit)?;
    expect_failure(
        &run,
        "a rank whose work fails aborts the job",
        "rank 1 of 2: invalid option `--test`: rank 1 fails; aborting the MPI job",
        60.0,
    )?;
    let run = mpirun(2, "stuck", &[], &[("CKPT_COMM_TIMEOUT", "2")], limit)?;
    expect_failure(
        &run,
        "a stuck rank trips the watchdog of the waiting rank",
        "rank 0: collective `barrier` in group [0, 1] did not complete within 2.0 s",
        60.0,
    )
}

// ---------------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------------

fn worker(scenario: &str, args: &[String]) -> std::result::Result<(), String> {
    let world = mpi_world().map_err(|e| e.to_string())?;
    match scenario {
        "collectives" => {
            collectives(world.size()).map_err(|e| format!("rank {}: {e}", world.rank()))
        }
        "train" => {
            if let Some(dir) = std::env::var_os("CKPT_TEST_PID_DIR") {
                let path = Path::new(&dir).join(format!("pid-{}", world.rank()));
                std::fs::write(&path, std::process::id().to_string()).map_err(|e| e.to_string())?;
            }
            let cfg = TrainConfig::try_parse_from(
                std::iter::once("train").chain(args.iter().map(String::as_str)),
            )
            .map_err(|e| e.to_string())?;
            ckpt_train::train(
                &TrainConfig {
                    backend: Backend::Mpi,
                    ..cfg
                },
                false,
            )
            .map_err(|e| e.to_string())?;
            Ok(())
        }
        "dies" => {
            let mesh = Mesh::parse("dp=2").map_err(|e| e.to_string())?;
            let d = world.dist(&mesh).map_err(|e| e.to_string())?;
            d.world.barrier().map_err(|e| e.to_string())?;
            if d.rank == 1 {
                std::process::abort();
            }
            let mut v = vec![1.0f32; 8];
            d.world
                .all_reduce(&mut v, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            Err("rank 0's all_reduce completed without its peer".into())
        }
        "fails" => {
            let mesh = Mesh::parse("dp=2").map_err(|e| e.to_string())?;
            world
                .run(&mesh, |d| {
                    if d.rank == 1 {
                        return Err(ckpt_train::Error::InvalidOption {
                            option: "--test".into(),
                            problem: "rank 1 fails".into(),
                        });
                    }
                    d.world.barrier()
                })
                .map_err(|e| e.to_string())?;
            Err("rank 0 passed a barrier without its peer".into())
        }
        "stuck" => {
            let mesh = Mesh::parse("dp=2").map_err(|e| e.to_string())?;
            let d = world.dist(&mesh).map_err(|e| e.to_string())?;
            if d.rank == 1 {
                std::thread::sleep(Duration::from_secs(300));
            }
            d.world.barrier().map_err(|e| e.to_string())?;
            Err("rank 0 passed a barrier without its peer".into())
        }
        other => Err(format!("unknown scenario `{other}`")),
    }
}

/// Deterministic values of mixed magnitudes, so that the order of a sum shows in its
/// bits.
fn values(seed: usize, len: usize) -> Vec<f32> {
    let mut x = (seed as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mant = ((x % 2001) as f32 - 1000.0) / 7.0;
            let exp = ((x >> 20) % 13) as i32 - 6;
            mant * 10f32.powi(exp)
        })
        .collect()
}

/// Every collective on every group of `d`, with outputs recorded in order.
fn script(d: &Dist) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::new();
    let groups: [(&str, &dyn Comm); 3] = [
        ("world", d.world.as_ref()),
        ("dp", d.dp.as_ref()),
        ("tp", d.tp.as_ref()),
    ];
    for (gi, (_, c)) in groups.iter().enumerate() {
        let (p, r) = (c.size(), c.rank());
        let seed = d.rank * 101 + gi * 7;
        for (k, len) in [37usize, 1, 0, 1000, p - 1].into_iter().enumerate() {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                let mut v = values(seed + k, len);
                c.all_reduce(&mut v, op)?;
                out.push(v);
            }
        }
        out.extend(c.all_gather(&values(seed + 10, r * 3 + usize::from(r == 1) * 5))?);
        let counts: Vec<usize> = (0..p).map(|i| (i * 2 + 1) % 4).collect();
        let total: usize = counts.iter().sum();
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            out.push(c.reduce_scatter(&values(seed + 20, total), &counts, op)?);
        }
        let mut b = values(seed + 30, 5 + r);
        c.broadcast(&mut b, p - 1)?;
        out.push(b);
        let mut b = values(seed + 31, r);
        c.broadcast(&mut b, 0)?;
        out.push(b);
        for root in [0, p - 1] {
            if let Some(g) = c.gather(&values(seed + 40 + root, 2 * r + 1), root)? {
                out.push(vec![g.len() as f32]);
                out.extend(g);
            }
        }
        c.barrier()?;
        let t = candle_core::Tensor::from_vec(
            values(seed + 50, 6 * (r + 1)),
            (r + 1, 6),
            &candle_core::Device::Cpu,
        )?;
        out.push(ckpt_train::tensor_to_vec(&all_gather_tensor(*c, &t, 0)?)?);
        let t = candle_core::Tensor::from_vec(
            values(seed + 51, 12),
            (3, 4),
            &candle_core::Device::Cpu,
        )?;
        out.push(ckpt_train::tensor_to_vec(&all_reduce_tensor(
            *c,
            &t,
            ReduceOp::Sum,
        )?)?);
    }
    Ok(out)
}

/// Disagreements fail on every rank (where threads might hang or differ), and the group
/// stays usable afterwards.
fn disagreements(d: &Dist) -> Result<()> {
    let w = d.world.as_ref();
    let mismatch = if d.rank == 0 {
        w.all_gather(&[1.0]).map(|_| ())
    } else {
        w.all_reduce(&mut [1.0], ReduceOp::Sum)
    };
    expect_err(mismatch, "at the same time")?;
    expect_err(
        w.all_reduce(&mut vec![0.5; 3 + usize::from(d.rank == 1)], ReduceOp::Sum),
        "buffer lengths differ",
    )?;
    let n = w.size();
    let counts = if d.rank == 1 {
        vec![1; n + 1]
    } else {
        vec![1; n]
    };
    expect_err(
        w.reduce_scatter(&vec![1.0; n], &counts, ReduceOp::Sum)
            .map(|_| ()),
        if d.rank == 1 {
            "counts do not match"
        } else {
            "rank 1 passed invalid arguments"
        },
    )?;
    expect_err(
        w.broadcast(&mut vec![1.0], d.rank % 2),
        "disagrees on the root",
    )?;
    expect_err(w.gather(&[1.0], n).map(|_| ()), "is not in a group")?;
    w.barrier()?;
    let mut v = vec![d.rank as f32];
    w.all_reduce(&mut v, ReduceOp::Max)?;
    if v != [(n - 1) as f32] {
        return Err(ckpt_train::Error::InvalidOption {
            option: "test".into(),
            problem: format!("max after errors: {v:?}"),
        });
    }
    Ok(())
}

fn expect_err(r: Result<()>, needle: &str) -> Result<()> {
    match r {
        Err(e) if e.to_string().contains(needle) => Ok(()),
        Err(e) => Err(ckpt_train::Error::InvalidOption {
            option: "test".into(),
            problem: format!("wrong error: {e} (wanted `{needle}`)"),
        }),
        Ok(()) => Err(ckpt_train::Error::InvalidOption {
            option: "test".into(),
            problem: format!("no error (wanted `{needle}`)"),
        }),
    }
}

fn collectives(size: usize) -> Result<()> {
    let world = mpi_world()?;
    let meshes: &[&str] = if size == 4 {
        &["dp=4", "dp=2,tp=2", "tp=4", "tp=2,dp=2"]
    } else {
        &["dp=2", "tp=2"]
    };
    if size > 2 {
        // The data is order-sensitive: summing the ranks' values backwards changes bits,
        // so an MPI reduction in another order would be caught.
        let parts: Vec<Vec<f32>> = (0..size).map(|r| values(r * 101, 1000)).collect();
        let fwd = (0..1000).map(|i| parts.iter().fold(0f32, |a, p| a + p[i]).to_bits());
        let back = (0..1000).map(|i| parts.iter().rev().fold(0f32, |a, p| a + p[i]).to_bits());
        if fwd.zip(back).all(|(a, b)| a == b) {
            return Err(ckpt_train::Error::InvalidOption {
                option: "test".into(),
                problem: "test data is not order-sensitive".into(),
            });
        }
    }
    for m in meshes {
        let mesh = Mesh::parse(m)?;
        let d = world.dist(&mesh)?;
        let mpi = script(&d)?;
        let threads = run_threads(&mesh, |d| script(&d))?.swap_remove(world.rank());
        let bits = |v: &[Vec<f32>]| {
            v.iter()
                .map(|x| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>())
                .collect::<Vec<_>>()
        };
        if bits(&mpi) != bits(&threads) {
            let at = mpi
                .iter()
                .zip(&threads)
                .position(|(a, b)| bits(std::slice::from_ref(a)) != bits(std::slice::from_ref(b)));
            return Err(ckpt_train::Error::InvalidOption {
                option: "test".into(),
                problem: format!(
                    "mesh {m}: MPI and threads differ at output {at:?} of {} / {}",
                    mpi.len(),
                    threads.len()
                ),
            });
        }
        println!(
            "rank {}: mesh {m}: {} outputs bit-identical to threads",
            world.rank(),
            mpi.len()
        );
        disagreements(&d)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------

/// Options of a short run of the mlp on the shipped digits.
fn train_args(mesh: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--mesh",
        mesh,
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--train-limit",
        "512",
        "--no-eval",
        "--seed",
        "7",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    a.extend(extra.iter().map(ToString::to_string));
    a
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Trains on threads in this process.
fn train_threads(args: &[String]) -> std::result::Result<(), String> {
    let cfg = TrainConfig::try_parse_from(
        std::iter::once("train".to_string()).chain(args.iter().cloned()),
    )
    .map_err(|e| e.to_string())?;
    ckpt_train::train(&cfg, false)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Every file of the checkpoint `dir/step_N` except the trainer state (which records
/// timings), relative path to bytes.
fn checkpoint_files(dir: &Path, step: u64) -> std::result::Result<Vec<(PathBuf, Vec<u8>)>, String> {
    let root = dir.join(format!("step_{step}"));
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "safetensors")
                || p.file_name().is_some_and(|n| n == "strategy.json")
            {
                let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                out.push((
                    p.strip_prefix(&root).expect("under root").to_path_buf(),
                    bytes,
                ));
            }
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(format!("{}: no checkpoint files", root.display()));
    }
    Ok(out)
}

fn same_checkpoint(a: &Path, b: &Path, step: u64, what: &str) -> std::result::Result<(), String> {
    let (fa, fb) = (checkpoint_files(a, step)?, checkpoint_files(b, step)?);
    let names = |f: &[(PathBuf, Vec<u8>)]| f.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    if names(&fa) != names(&fb) {
        return Err(format!(
            "{what}: different files {:?} and {:?}",
            names(&fa),
            names(&fb)
        ));
    }
    for ((name, x), (_, y)) in fa.iter().zip(&fb) {
        if x != y {
            return Err(format!(
                "{what}: {} differs between {} and {}",
                name.display(),
                a.display(),
                b.display()
            ));
        }
    }
    println!(
        "ok: {what}: {} files byte-identical at step {step}",
        fa.len()
    );
    Ok(())
}

fn train_scenarios(limit: Duration) -> std::result::Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    // 512 images / batch 64 = 8 updates per epoch, 16 in all; a checkpoint every 8.
    let (half, full) = (8u64, 16u64);
    for (i, (n, mesh, extra)) in [
        (2usize, "dp=2", &[][..]),
        (4, "dp=2,tp=2", &["--shard-optimizer"][..]),
        (4, "tp=4", &["--optimizer", "sgd"][..]),
        (
            2,
            "dp=2",
            &["--model", "resnet", "--depth", "8", "--sync-bn"][..],
        ),
        (4, "dp=2,tp=2", &["--model", "vit"][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let base = tmp.path().join(format!("{i}"));
        let mesh_label = format!("{mesh} {}", extra.join(" "));
        let mesh_label = mesh_label.trim();
        let dir = |name: &str| base.join(name);
        let mut args = train_args(mesh, extra);
        args.extend(["--save-every".into(), half.to_string()]);
        // Reference: threads, uninterrupted, saving at 8 and 16.
        let mut a = args.clone();
        a.extend(["--out".into(), path_arg(&dir("threads"))]);
        train_threads(&a)?;
        // MPI from scratch, all 16 updates: identical at 8 and 16.
        let mut a = args.clone();
        a.extend(["--out".into(), path_arg(&dir("mpi"))]);
        expect_ok(
            &mpirun(n, "train", &a, &[], limit)?,
            &format!("training {mesh_label} under mpirun -n {n}"),
        )?;
        same_checkpoint(
            &dir("threads"),
            &dir("mpi"),
            half,
            &format!("{mesh_label}: MPI and threads, step {half}"),
        )?;
        same_checkpoint(
            &dir("threads"),
            &dir("mpi"),
            full,
            &format!("{mesh_label}: MPI and threads, step {full}"),
        )?;
        // Saved under threads, resumed under MPI.
        let mut a = args.clone();
        a.extend([
            "--resume".into(),
            path_arg(&dir("threads").join(format!("step_{half}"))),
            "--out".into(),
            path_arg(&dir("t2m")),
        ]);
        expect_ok(
            &mpirun(n, "train", &a, &[], limit)?,
            &format!("{mesh_label}: resuming a thread checkpoint under mpirun -n {n}"),
        )?;
        same_checkpoint(
            &dir("threads"),
            &dir("t2m"),
            full,
            &format!("{mesh_label}: saved under threads, resumed under MPI"),
        )?;
        // Saved under MPI, resumed under threads.
        let mut a = args.clone();
        a.extend([
            "--resume".into(),
            path_arg(&dir("mpi").join(format!("step_{half}"))),
            "--out".into(),
            path_arg(&dir("m2t")),
        ]);
        train_threads(&a)?;
        same_checkpoint(
            &dir("threads"),
            &dir("m2t"),
            full,
            &format!("{mesh_label}: saved under MPI, resumed under threads"),
        )?;
    }
    Ok(())
}

//! Runs each collective of the chosen backend once per group and checks the results
//! against what the group's ranks hold: the GPU check's proof that NCCL really runs
//! (`scripts/gpu_check.sh`, with `NCCL_DEBUG=INFO` showing each call), and the same
//! check on the thread backend anywhere.
//!
//! ```text
//! comm-check [--backend threads|nccl] [--mesh dp=1]
//! ```
//!
//! Prints one JSON object: the backend, mesh, each collective and whether it gave the
//! expected result; exit 1 when one did not, or when a collective failed (with
//! `CKPT_COMM_TIMEOUT` set below a collective's time, the communicator is aborted and
//! the error says so: the check of abort).

use ckpt_core::layout::mesh::Mesh;
use ckpt_train::{Comm, Dist, ReduceOp};
use std::process::ExitCode;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// Each collective on `comm`, checked: `(name, ok)`.
fn check(comm: &dyn Comm) -> ckpt_train::Result<RankChecks> {
    let (me, p) = (comm.rank(), comm.size());
    let mine: Vec<f32> = (0..4).map(|i| (me * 10 + i) as f32).collect();
    let sum: Vec<f32> = (0..4)
        .map(|i| (0..p).map(|r| (r * 10 + i) as f32).sum())
        .collect();
    let mut out = vec![];
    let mut buf = mine.clone();
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    out.push(("all_reduce", buf == sum));
    let mut b = if me == 0 { vec![7.0, 8.0] } else { vec![] };
    comm.broadcast(&mut b, 0)?;
    out.push(("broadcast", b == vec![7.0, 8.0]));
    let all = comm.all_gather(&mine)?;
    let want: Vec<Vec<f32>> = (0..p)
        .map(|r| (0..4).map(|i| (r * 10 + i) as f32).collect())
        .collect();
    out.push(("all_gather", all == want));
    let full: Vec<f32> = (0..2 * p).map(|i| (me + i) as f32).collect();
    let got = comm.reduce_scatter(&full, &vec![2; p], ReduceOp::Sum)?;
    let want: Vec<f32> = (2 * me..2 * me + 2)
        .map(|i| (0..p).map(|r| (r + i) as f32).sum())
        .collect();
    out.push(("reduce_scatter", got == want));
    Ok(out)
}

/// One rank's checks: each collective's name and whether its result was right.
type RankChecks = Vec<(&'static str, bool)>;

/// The checks of every rank, or `None` for a backend this build does not have.
fn run(backend: &str, mesh: &Mesh) -> Option<ckpt_train::Result<Vec<RankChecks>>> {
    let body = |d: Dist| check(d.world.as_ref());
    match backend {
        "threads" => Some(ckpt_train::run_threads(mesh, body)),
        #[cfg(feature = "cuda-driver")]
        "nccl" => Some(ckpt_train::run_nccl(mesh, body)),
        _ => None,
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let backend = arg(&args, "--backend").unwrap_or_else(|| "threads".into());
    let mesh_text = arg(&args, "--mesh").unwrap_or_else(|| "dp=1".into());
    let mesh = match Mesh::parse(&mesh_text) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("comm-check: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(result) = run(&backend, &mesh) else {
        eprintln!(
            "comm-check: --backend `{backend}`: threads, or nccl (built with the `cuda` feature)"
        );
        return ExitCode::from(2);
    };
    match result {
        Ok(ranks) => {
            let ok = ranks.iter().flatten().all(|(_, ok)| *ok);
            let checks: Vec<String> = ranks[0]
                .iter()
                .map(|(name, _)| {
                    let all = ranks
                        .iter()
                        .all(|r| r.iter().any(|(n, ok)| n == name && *ok));
                    format!("\"{name}\": {all}")
                })
                .collect();
            println!(
                "{{\"backend\": \"{backend}\", \"mesh\": \"{mesh_text}\", \"ranks\": {}, {}, \"ok\": {ok}}}",
                ranks.len(),
                checks.join(", ")
            );
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            println!("{{\"backend\": \"{backend}\", \"mesh\": \"{mesh_text}\", \"ok\": false, \"error\": {:?}}}", e.to_string());
            eprintln!("comm-check: {e}");
            ExitCode::from(1)
        }
    }
}

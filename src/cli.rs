//! Command-line definition and dispatch: one function per subcommand.

use crate::report::{bytes_bar, human_bytes};
use anyhow::{bail, Context, Result};
use ckpt_core::{Checkpoint, CopyPlan, Dtype, Kind, Mesh, Selection, Strategy};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// A usage error found after parsing (exit code 2, like clap's own).
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// The error and its causes, each said once: a cause whose text its wrapper already
/// includes (`path: No such file or directory` over `No such file or directory`) is
/// not repeated.
pub(crate) fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// Whether an error is the user's way of asking (exit 2) rather than a problem found.
pub(crate) fn is_usage(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<Usage>()
            || matches!(
                c.downcast_ref::<ckpt_train::Error>(),
                Some(ckpt_train::Error::InvalidOption { .. })
            )
    })
}

/// Checks a glob pattern at parse time (a bad one is a usage error).
fn parse_glob(s: &str) -> std::result::Result<String, String> {
    ckpt_core::Selection::new(&[s.to_string()], &[], None)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

/// Checks a mesh at parse time, keeping the text.
fn parse_shard(s: &str) -> std::result::Result<(String, usize), String> {
    let (glob, dim) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}`: expected NAME_GLOB=DIM"))?;
    let dim = dim
        .parse()
        .map_err(|_| format!("`{s}`: DIM `{dim}` is not a dimension number"))?;
    ckpt_core::Selection::new(&[glob.to_string()], &[], None).map_err(|e| e.to_string())?;
    Ok((glob.to_string(), dim))
}

fn parse_mesh(s: &str) -> std::result::Result<String, String> {
    Mesh::parse(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

/// Checks `--data` at parse time, keeping the text.
fn parse_data(s: &str) -> std::result::Result<String, String> {
    ckpt_train::DataSource::parse(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

/// `auto` or a rank number.
fn parse_rank(s: &str) -> std::result::Result<String, String> {
    if s == "auto" || s.parse::<u64>().is_ok() {
        Ok(s.to_string())
    } else {
        Err(format!("`{s}` is not a rank number or `auto`"))
    }
}

/// Merge, reshard, check and load checkpoints of models trained on many devices.
#[derive(Parser, Debug)]
#[command(name = "ckpt", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List tensors: global shape, dtype, placements, bytes per rank and in total.
    Inspect {
        #[command(flatten)]
        inputs: Inputs,
        #[command(flatten)]
        names: Names,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Draw which rank (file) holds which part of TENSOR (a name or a glob).
        #[arg(long, value_name = "TENSOR")]
        show: Option<String>,
        /// Write a self-contained HTML report (summary, tensor table, drawings) to FILE.
        #[arg(long, value_name = "FILE")]
        html: Option<PathBuf>,
    },
    /// Check a checkpoint: headers, rank files, strategy agreement, exact coverage.
    Verify {
        #[command(flatten)]
        inputs: Inputs,
        #[command(flatten)]
        names: Names,
        /// Also compare replicated copies byte for byte.
        #[arg(long, conflicts_with = "fast")]
        deep: bool,
        /// Check metadata only: do not read the data to compare it with the recorded
        /// checksums.
        #[arg(long)]
        fast: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Join per-rank slices into one integrated (Hugging Face) checkpoint.
    Merge(MergeArgs),
    /// Re-slice a checkpoint for another mesh or strategy.
    Reshard(ReshardArgs),
    /// Compress a checkpoint file or directory into .ckptz files (byte-grouped zstd
    /// chunks); other files are copied.
    Compress(ConvertArgs),
    /// Turn .ckptz files back into safetensors, byte for byte as they were.
    Decompress(ConvertArgs),
    /// Write a synthetic tensor-parallel checkpoint (examples, tests, benchmarks).
    Example(ExampleArgs),
    /// Train a model on thread ranks and save integrated or sliced checkpoints.
    Train(TrainArgs),
    /// Evaluate a checkpoint on one device or tensor-parallel on several.
    Infer(InferArgs),
    /// The whole story on the shipped digits: train on 4 ranks, save sliced, verify,
    /// merge, infer on 1, reshard to 2, infer on 2, resume training on 2.
    Demo {
        /// Where to work (default: a new temporary directory, kept afterwards).
        dir: Option<PathBuf>,
        /// Reuse a non-empty directory.
        #[arg(long)]
        force: bool,
        /// No progress output.
        #[arg(long, short)]
        quiet: bool,
    },
}

#[derive(Args, Debug)]
struct TrainArgs {
    #[command(flatten)]
    config: ckpt_train::TrainConfig,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// No progress output.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args, Debug)]
struct InferArgs {
    /// Checkpoint: integrated, sliced (root with ckpt_*/), or a training --out directory.
    checkpoint: PathBuf,
    /// Data set (default: the one it was trained on): digits, digits:FILE, fashion-mnist[:DIR], cifar10:DIR.
    #[arg(long, value_parser = parse_data)]
    data: Option<String>,
    /// Ranks: a sliced checkpoint's tensor-parallel size (the default) or a multiple of
    /// it, the extra copies data parallel (the test set split over them).
    #[arg(long)]
    ranks: Option<u64>,
    /// Images per forward pass.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Predict these test images (7; 3,5,7; 0..10, the end excluded) or the images in
    /// these files (digits: CSV rows of 64 pixel values 0..16 and the label, as in the
    /// data set's own file).
    #[arg(long, num_args = 1..)]
    predict: Vec<String>,
    /// Evaluate only the first N test images.
    #[arg(long)]
    limit: Option<usize>,
    /// How ranks run: threads of this process, or one process per rank under mpirun.
    #[arg(long, value_enum, default_value_t = ckpt_train::Backend::Threads)]
    backend: ckpt_train::Backend,
    /// Where the model maths runs: the CPU, or CUDA GPUs (needs a build with
    /// `--features cuda-candle`).
    #[arg(long, value_enum, default_value_t = ckpt_train::DeviceKind::Cpu)]
    device: ckpt_train::DeviceKind,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// The checkpoint to read, shared by the commands that read one.
#[derive(Args, Debug, Clone)]
struct Inputs {
    /// Rank directories (ckpt_<r>/, MindSpore's rank_<r>/), a sliced checkpoint root or
    /// training --out, rank files, an integrated or DCP checkpoint, MindSpore .ckpt files.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// The source's MindSpore strategy file (protobuf or JSON; one per pipeline stage),
    /// when it is not the only one beside the rank directories.
    #[arg(long, value_name = "FILE")]
    source_strategy: Vec<PathBuf>,
    /// Read the checkpoint of this training step where the inputs hold several: a
    /// training output's step_<N>/ instead of `latest`, MindSpore's
    /// <prefix>-<epoch>_<N>.ckpt in each rank directory instead of the newest.
    #[arg(long, value_name = "N")]
    step: Option<u64>,
}

impl Inputs {
    /// Every input path: the strategy files are inputs too (recognised by content).
    fn all(&self) -> Result<Vec<PathBuf>> {
        for s in &self.source_strategy {
            let bytes =
                std::fs::read(s).with_context(|| format!("--source-strategy {}", s.display()))?;
            if !ckpt_core::is_mindspore_strategy(&bytes) {
                return Err(Usage(format!(
                    "--source-strategy {}: not a MindSpore strategy file (protobuf ParallelStrategyMap or its JSON form)",
                    s.display()
                ))
                .into());
            }
        }
        Ok(self
            .paths
            .iter()
            .chain(&self.source_strategy)
            .cloned()
            .collect())
    }
}

/// Renaming, on every command that reads a checkpoint.
#[derive(Args, Debug, Clone, Default)]
struct Names {
    /// Remove this prefix from every tensor name that has it (DDP's `module.`).
    #[arg(long, value_name = "PREFIX")]
    strip_prefix: Option<String>,
    /// Put this prefix in front of every tensor name (after --strip-prefix).
    #[arg(long, value_name = "PREFIX")]
    add_prefix: Option<String>,
}

impl Names {
    fn selection(&self) -> Selection {
        Selection::default().with_prefixes(self.strip_prefix.clone(), self.add_prefix.clone())
    }
}

/// Options shared by the commands that copy tensors.
#[derive(Args, Debug, Clone)]
struct CopyArgs {
    /// Cast floating-point tensors while copying (integers are refused): bf16, f16,
    /// f32, f64, or any safetensors dtype name (F8_E4M3, F8_E5M2, ...).
    #[arg(long, value_parser = parse_cast)]
    dtype: Option<Dtype>,
    /// Keep only tensors matching these glob patterns.
    #[arg(long, value_parser = parse_glob)]
    include: Vec<String>,
    /// Drop tensors matching these glob patterns (e.g. 'optim.*').
    #[arg(long, value_parser = parse_glob)]
    exclude: Vec<String>,
    #[command(flatten)]
    names: Names,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Write compressed .ckptz files (byte-grouped zstd chunks, level 1 to 22, default
    /// 1) that every ckpt command reads: zstd or zstd:LEVEL.
    #[arg(long, value_name = "zstd[:LEVEL]", value_parser = ckpt_core::Compression::parse)]
    compress: Option<ckpt_core::Compression>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    /// Neither check the sources' checksums nor record the output's (to measure what
    /// they cost; benchmarks only).
    #[arg(long, hide = true)]
    no_checksums: bool,
}

#[derive(Args, Debug)]
struct MergeArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Output directory.
    #[arg(short, long)]
    output: PathBuf,
    /// Split the output into files of at most this size, with an index (e.g. 5GB).
    #[arg(long, value_parser = ckpt_merge::parse_size)]
    max_shard_size: Option<u64>,
    /// `auto`: under mpirun, srun or torchrun, write only this process's share of the
    /// output files (with --max-shard-size); no data crosses processes.
    #[arg(long, value_parser = ["auto"])]
    rank: Option<String>,
    /// Output format: `safetensors` (Hugging Face layout), `mindspore` (one model.ckpt
    /// that mindspore.load_checkpoint reads), `torch` (one model.pth, a dict of
    /// tensors that torch.load(weights_only=True) reads) or `ucp` (DeepSpeed's universal
    /// checkpoint, from a DeepSpeed ZeRO checkpoint: latest_universal and
    /// <tag>_universal/zero/<param>/*.pt, loaded with "load_universal": true).
    #[arg(long, default_value = "safetensors", value_parser = ["safetensors", "mindspore", "torch", "ucp"])]
    format: String,
    /// Keep optimizer state (tensors named `optim.*`) in model.safetensors; by default
    /// it goes to optimizer.safetensors beside it, and model.safetensors holds the
    /// weights only (`ckpt infer` and `ckpt train --resume` read both).
    #[arg(long)]
    one_file: bool,
    #[command(flatten)]
    copy: CopyArgs,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to", "mesh", "strategy"])))]
struct ReshardArgs {
    #[command(flatten)]
    inputs: Inputs,
    /// Output directory.
    #[arg(short, long)]
    output: PathBuf,
    /// Keep placements; innermost mesh axis becomes N, others 1.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    to: Option<u64>,
    /// New sizes for named axes, e.g. dp=2,tp=2.
    #[arg(long, value_parser = parse_mesh)]
    mesh: Option<String>,
    /// With --to N on a whole copy (no strategy): split tensors matching NAME_GLOB along
    /// DIM over the N ranks, first matching rule wins, others replicated; e.g.
    /// --shard '*.q_proj.weight=0' '*.o_proj.weight=1'.
    #[arg(long, value_name = "NAME_GLOB=DIM", num_args = 1.., value_parser = parse_shard, requires = "to")]
    shard: Vec<(String, usize)>,
    /// A target strategy file: ckpt's strategy.json, or a MindSpore (predict) strategy
    /// file, protobuf or JSON.
    #[arg(long)]
    strategy: Option<PathBuf>,
    /// Build only this target rank (`auto`: from mpirun, Slurm or torchrun variables).
    #[arg(long, value_parser = parse_rank)]
    rank: Option<String>,
    /// Print which files each target rank reads and the bytes, and write nothing.
    #[arg(long)]
    plan: bool,
    /// With --plan: also write the plan as a self-contained HTML page (per tensor the
    /// target pieces over the source pieces; per output file its reads).
    #[arg(long, value_name = "FILE", requires = "plan")]
    html: Option<PathBuf>,
    /// Write replicated tensors on every rank, not only the lowest (always with
    /// `--format mindspore`).
    #[arg(long)]
    keep_all: bool,
    /// Output layout: `ckpt` (ckpt_<r>/ directories), `dcp` (PyTorch DCP sharded
    /// safetensors, loadable by torch's HuggingFaceStorageReader), `distcp` (DCP's
    /// default format: __<r>_0.distcp + .metadata, loadable by
    /// torch.distributed.checkpoint.load; each chunk stored once), `mindspore`
    /// (rank_<r>/checkpoint_<r>.ckpt, loadable by mindspore.load_checkpoint) or
    /// `megatron` (a Megatron legacy checkpoint from a Megatron legacy source:
    /// iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt).
    #[arg(long, default_value = "ckpt", value_parser = ["ckpt", "dcp", "distcp", "mindspore", "megatron"])]
    format: String,
    #[command(flatten)]
    copy: CopyArgs,
}

#[derive(Args, Debug)]
struct ConvertArgs {
    /// A tensor file, or a checkpoint directory (converted with everything under it).
    source: PathBuf,
    /// The output file or directory.
    #[arg(short, long)]
    output: PathBuf,
    /// zstd level (compress only).
    #[arg(long, default_value_t = ckpt_core::DEFAULT_LEVEL, value_parser = clap::value_parser!(i32).range(1..=22))]
    level: i32,
    /// Raw bytes per compressed chunk (tests: small chunks make small tensors span
    /// several).
    #[arg(long, hide = true, value_parser = ckpt_merge::parse_size)]
    chunk_bytes: Option<u64>,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ExampleArgs {
    /// Output directory (a sliced checkpoint root).
    output: PathBuf,
    /// Mesh, e.g. tp=4 or dp=2,tp=4 (innermost axis is tensor parallel).
    #[arg(long, default_value = "tp=4", value_parser = parse_mesh)]
    mesh: String,
    /// Hidden size.
    #[arg(long, default_value_t = 64)]
    hidden: u64,
    /// Layers.
    #[arg(long, default_value_t = 2)]
    layers: u64,
    /// Vocabulary rows (odd sizes shard unevenly).
    #[arg(long, default_value_t = 1000)]
    vocab: u64,
    /// Element type.
    #[arg(long, default_value = "BF16", value_parser = parse_cast)]
    dtype: Dtype,
    /// Add ZeRO-sharded F32 optimizer moments (`optim.*.exp_avg`).
    #[arg(long)]
    optimizer: bool,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
}

fn parse_cast(s: &str) -> std::result::Result<Dtype, String> {
    match s.to_ascii_lowercase().as_str() {
        "bf16" => Ok(Dtype::BF16),
        "f16" | "fp16" => Ok(Dtype::F16),
        "f32" | "fp32" => Ok(Dtype::F32),
        "f64" => Ok(Dtype::F64),
        _ => ckpt_core::parse_dtype(&s.to_ascii_uppercase()),
    }
}

pub(crate) fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Inspect {
            inputs,
            names,
            json,
            show,
            html,
        } => {
            let sel = names.selection().with_step(inputs.step);
            match (show, html) {
                (None, None) => inspect(&inputs.all()?, &sel, json),
                (show, html) => crate::pictures::run(&inputs.all()?, &sel, show, html, json),
            }
        }
        Command::Verify {
            inputs,
            names,
            deep,
            fast,
            json,
        } => verify(
            &inputs.all()?,
            &names.selection().with_step(inputs.step),
            ckpt_core::VerifyDepth {
                checksums: !fast,
                deep,
            },
            json,
        ),
        Command::Merge(a) => merge(a),
        Command::Reshard(a) => reshard(a),
        Command::Compress(a) => {
            let how = ckpt_core::Conversion::Compress(ckpt_core::Compression {
                level: a.level,
                chunk_bytes: a.chunk_bytes.unwrap_or(ckpt_core::DEFAULT_CHUNK_BYTES),
            });
            convert(a, how)
        }
        Command::Decompress(a) => convert(a, ckpt_core::Conversion::Decompress),
        Command::Example(a) => example(a),
        Command::Train(a) => train(a),
        Command::Infer(a) => infer(a),
        Command::Demo { dir, force, quiet } => {
            let dir = match dir {
                Some(d) => d,
                None => std::env::temp_dir().join(format!("ckpt-demo-{}", std::process::id())),
            };
            // The demo's largest job: 4 thread ranks.
            ckpt_train::configure_cpu_threads(4);
            crate::demo::run(&dir, force, !quiet)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn placements_text(ck: &Checkpoint, name: &str) -> String {
    match (&ck.strategy, ck.kind) {
        (Some(s), _) => {
            let l = &s.tensors[name];
            s.mesh
                .axes()
                .iter()
                .zip(&l.placements)
                .map(|(a, p)| format!("{}:{}", a.name, p))
                .chain(l.stage.map(|st| format!("stage {st}")))
                .collect::<Vec<_>>()
                .join(" ")
        }
        (None, Kind::Integrated) => "whole".into(),
        (None, _) => format!("{} pieces", ck.tensors[name].pieces.len()),
    }
}

fn inspect(paths: &[PathBuf], sel: &Selection, as_json: bool) -> Result<ExitCode> {
    let (ck, problems) = ckpt_core::verify_selected(paths, sel, ckpt_core::VerifyDepth::default())?;
    let mut per_file = vec![0u64; ck.files.len()];
    for (i, f) in ck.files.iter().enumerate() {
        per_file[i] = f.tensors().iter().map(|t| t.end - t.start).sum();
    }
    let total: u64 = per_file.iter().sum();
    if as_json {
        let tensors: Vec<_> = ck
            .tensors
            .iter()
            .map(|(name, t)| {
                json!({
                    "name": name, "shape": t.shape, "dtype": ckpt_core::dtype_name(t.dtype),
                    "placements": placements_text(&ck, name),
                    "pieces": ckpt_core::pieces_json(&ck, name).unwrap_or_default(),
                    "bytes": ckpt_core::bytes_of(t.dtype, t.shape.iter().product()),
                })
            })
            .collect();
        let files: Vec<_> = ck
            .files
            .iter()
            .enumerate()
            .map(|(i, f)| json!({"path": f.path(), "rank": ck.ranks[i], "bytes": per_file[i], "tensors": f.tensors().len()}))
            .collect();
        let doc = json!({
            "kind": format!("{:?}", ck.kind).to_lowercase(),
            "mesh": ck.strategy.as_ref().map(|s| s.mesh.to_string()),
            "tensors": tensors, "files": files, "total_bytes": total,
            "problems": problems.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "notes": ck.notes,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        let mesh = ck
            .strategy
            .as_ref()
            .map(|s| format!(" on mesh {}", s.mesh))
            .unwrap_or_default();
        let kind = match ck.kind {
            Kind::Sliced => "sliced",
            Kind::Integrated => "integrated",
            Kind::Dcp => "PyTorch DCP",
        };
        println!(
            "{kind} checkpoint, {} file(s){mesh}, {} tensors",
            ck.files.len(),
            ck.tensors.len()
        );
        let w = ck.tensors.keys().map(String::len).max().unwrap_or(4).max(6);
        println!(
            "{:<w$}  {:<6}  {:<18}  {:>12}  placements",
            "tensor", "dtype", "shape", "bytes"
        );
        for (name, t) in &ck.tensors {
            println!(
                "{name:<w$}  {:<6}  {:<18}  {:>12}  {}",
                ckpt_core::dtype_name(t.dtype),
                format!("{:?}", t.shape),
                ckpt_core::bytes_of(t.dtype, t.shape.iter().product()),
                placements_text(&ck, name)
            );
        }
        println!("bytes per file:");
        for (i, f) in ck.files.iter().enumerate() {
            let r = ck.ranks[i]
                .map(|r| format!("rank {r}: "))
                .unwrap_or_default();
            // Compressed files: what they take on disk too.
            let stored = match f.format() {
                ckpt_core::FileFormat::Ckptz => std::fs::metadata(f.path())
                    .map(|m| format!(" ({} compressed)", human_bytes(m.len())))
                    .unwrap_or_default(),
                _ => String::new(),
            };
            println!(
                "  {r}{}  {}{stored}",
                f.path().display(),
                human_bytes(per_file[i])
            );
        }
        println!("total: {} ({total} bytes)", human_bytes(total));
        for note in &ck.notes {
            println!("note: {note}");
        }
        for p in &problems {
            println!("problem: {p}");
        }
    }
    // Problems printed are problems found: the exit code says so too.
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn verify(
    paths: &[PathBuf],
    sel: &Selection,
    depth: ckpt_core::VerifyDepth,
    as_json: bool,
) -> Result<ExitCode> {
    let deep = depth.deep;
    let (ck, problems) = match ckpt_core::verify_selected(paths, sel, depth) {
        Ok(x) => x,
        Err(e) => {
            if as_json {
                println!("{}", json!({"ok": false, "problems": [e.to_string()]}));
            } else {
                println!("{e}");
            }
            return Ok(ExitCode::from(1));
        }
    };
    if as_json {
        let doc = json!({"ok": problems.is_empty(), "files": ck.files.len(), "tensors": ck.tensors.len(),
            "problems": problems.iter().map(ToString::to_string).collect::<Vec<_>>(), "notes": ck.notes});
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for note in &ck.notes {
            println!("note: {note}");
        }
        for p in &problems {
            // One line per problem (multi-line errors are already split per problem).
            println!("{}", p.to_string().replace('\n', " "));
        }
        if problems.is_empty() {
            let recorded: usize = ck
                .files
                .iter()
                .map(|f| {
                    (0..f.tensors().len())
                        .filter(|&i| f.checksum(i).is_some())
                        .count()
                })
                .sum();
            // Whole-file checksums (MindSpore's crc_num).
            let file_sums = ck
                .files
                .iter()
                .filter(|f| f.metadata().contains_key("crc_num"))
                .count();
            let sums = match (recorded, file_sums, depth.checksums) {
                (0, 0, _) => ", no checksums recorded".to_string(),
                (n, 0, true) => format!(", {n} checksums match"),
                (0, k, true) => format!(", {k} file checksums (crc_num) match"),
                (n, k, true) => format!(", {n} checksums and {k} file checksums (crc_num) match"),
                (_, _, false) => ", checksums not read (--fast)".to_string(),
            };
            println!(
                "ok: {} file(s), {} tensors, every element owned exactly once{sums}{}",
                ck.files.len(),
                ck.tensors.len(),
                if deep {
                    ", replicated copies identical"
                } else {
                    ""
                }
            );
        }
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn summary(
    verb: &str,
    stats: &ckpt_core::CopyStats,
    (names, files): (u64, u64),
    secs: f64,
    out: &std::path::Path,
    as_json: bool,
) {
    let gbs = stats.bytes_written as f64 / secs.max(1e-9) / 1e9;
    if as_json {
        println!(
            "{}",
            json!({"tensors": names, "pieces": stats.tensors, "files": files, "bytes_written": stats.bytes_written, "bytes_read": stats.bytes_read,
                   "sync_seconds": stats.sync_micros as f64 / 1e6,
                   "checksums_verified": stats.checksums_verified,
                   "checksums_unchecked": stats.checksums_unchecked,
                   "seconds": secs, "gb_per_s": gbs, "output": out})
        );
    } else {
        // Pieces are said only where they differ from tensors (a reshard's slices).
        let pieces = if stats.tensors == names {
            String::new()
        } else {
            format!(" as {} pieces", stats.tensors)
        };
        println!(
            "{verb} {names} tensors{pieces} in {files} file(s), {} in {secs:.2} s ({gbs:.2} GB/s) into {}",
            human_bytes(stats.bytes_written),
            out.display()
        );
        if stats.checksums_unchecked > 0 {
            println!(
                "checksums: {} source tensors checked; {} read only in part could not be",
                stats.checksums_verified, stats.checksums_unchecked
            );
        }
    }
}

/// Runs a copying command with a byte progress bar (sized once the plan is known) and
/// prints its summary.
fn with_progress(
    verb: &str,
    out: &std::path::Path,
    copy: &CopyArgs,
    run: impl FnOnce(
        &(dyn Fn(u64) + Sync),
        &dyn Fn(&Checkpoint, &CopyPlan),
    ) -> ckpt_core::Result<ckpt_core::CopyStats>,
) -> Result<ExitCode> {
    if copy.no_checksums {
        ckpt_core::set_checksums_enabled(false);
    }
    let t = Instant::now();
    let bar = std::sync::OnceLock::new();
    // Distinct tensors and files of the plan: a reshard writes several pieces of a tensor.
    let shape = std::sync::OnceLock::new();
    let stats = run(
        &|n| {
            if let Some(b) = bar.get() {
                indicatif::ProgressBar::inc(b, n);
            }
        },
        &|source: &Checkpoint, p: &CopyPlan| {
            for note in &source.notes {
                eprintln!("ckpt: note: {note}");
            }
            let _ = bar.set(bytes_bar(p.bytes_written(), copy.quiet || copy.json));
            let names: std::collections::BTreeSet<&str> = p
                .files
                .iter()
                .flat_map(|f| f.tensors.iter().map(|t| t.target.name.as_str()))
                .collect();
            let _ = shape.set((names.len() as u64, p.files.len() as u64));
        },
    );
    if let Some(b) = bar.get() {
        b.finish_and_clear();
    }
    let (names, files) = shape.get().copied().unwrap_or((0, 0));
    summary(
        verb,
        &stats?,
        (names, files),
        t.elapsed().as_secs_f64(),
        out,
        copy.json,
    );
    Ok(ExitCode::SUCCESS)
}

fn merge(a: MergeArgs) -> Result<ExitCode> {
    let req = ckpt_merge::MergeRequest {
        inputs: a.inputs.all()?,
        output: a.output,
        max_shard_size: a.max_shard_size,
        selection: Selection::new(&a.copy.include, &a.copy.exclude, a.copy.dtype)?
            .with_prefixes(
                a.copy.names.strip_prefix.clone(),
                a.copy.names.add_prefix.clone(),
            )
            .with_step(a.inputs.step),
        force: a.copy.force,
        one_file: a.one_file,
        format: match a.format.as_str() {
            "mindspore" => ckpt_merge::MergeFormat::MindSpore,
            "torch" => ckpt_merge::MergeFormat::Torch,
            "ucp" => ckpt_merge::MergeFormat::Ucp,
            _ => ckpt_merge::MergeFormat::Safetensors,
        },
        compression: a.copy.compress,
        share: match a.rank {
            Some(_) => Some(launch_share()?),
            None => None,
        },
    };
    with_progress("merged", &req.output, &a.copy, |progress, on_plan| {
        ckpt_merge::merge(&req, progress, on_plan)
    })
}

/// This process's share of partitioned work: `(rank, world size)` from the launcher.
fn launch_share() -> Result<(u64, u64)> {
    let env = ckpt_core::LaunchEnv::from_env()?.context(
        "--rank auto: no launcher variables (OMPI_COMM_WORLD_RANK, PMI_RANK, RANK or SLURM_PROCID) are set",
    )?;
    Ok((env.rank as u64, env.world_size as u64))
}

fn reshard(a: ReshardArgs) -> Result<ExitCode> {
    let target = if let Some(n) = a.to {
        ckpt_reshard::Target::To(n)
    } else if let Some(m) = &a.mesh {
        let mesh = Mesh::parse(m)?;
        ckpt_reshard::Target::Mesh(
            mesh.axes()
                .iter()
                .map(|x| (x.name.clone(), x.size))
                .collect(),
        )
    } else if let Some(s) = &a.strategy {
        let bytes = std::fs::read(s).with_context(|| format!("--strategy {}", s.display()))?;
        if ckpt_core::is_mindspore_strategy(&bytes) {
            ckpt_reshard::Target::MindSpore(ckpt_core::read_mindspore_strategies(&[s.as_path()])?)
        } else {
            ckpt_reshard::Target::Strategy(Strategy::read(s)?)
        }
    } else {
        bail!("give --to, --mesh or --strategy");
    };
    let ranks = match a.rank.as_deref() {
        None => ckpt_reshard::Ranks::All,
        // One share per process of the job that started this one.
        Some("auto") => {
            let (index, count) = launch_share()?;
            ckpt_reshard::Ranks::Share { index, count }
        }
        // Checked by parse_rank.
        Some(r) => ckpt_reshard::Ranks::One(r.parse().map_err(|_| Usage(format!("--rank `{r}`")))?),
    };
    let req = ckpt_reshard::ReshardRequest {
        inputs: a.inputs.all()?,
        output: a.output,
        target,
        ranks,
        selection: Selection::new(&a.copy.include, &a.copy.exclude, a.copy.dtype)?
            .with_prefixes(
                a.copy.names.strip_prefix.clone(),
                a.copy.names.add_prefix.clone(),
            )
            .with_step(a.inputs.step),
        // MindSpore loads each rank's parameters from that rank's file alone.
        keep_all: a.keep_all || a.format == "mindspore",
        force: a.copy.force,
        shard: a.shard,
        compression: a.copy.compress,
        format: match a.format.as_str() {
            "dcp" => ckpt_reshard::OutputFormat::Dcp,
            "mindspore" => ckpt_reshard::OutputFormat::MindSpore,
            "distcp" => ckpt_reshard::OutputFormat::Distcp,
            "megatron" => ckpt_reshard::OutputFormat::Megatron,
            _ => ckpt_reshard::OutputFormat::Ranks,
        },
    };
    if a.plan {
        let (source, strategy, plan) = ckpt_reshard::prepare(&req)?;
        print_plan(&source, &strategy, &plan, a.copy.json)?;
        if let Some(dest) = &a.html {
            let title = req
                .inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" ");
            ckpt_core::write_plan_html(&source, &plan, &strategy.mesh.to_string(), &title, dest)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    with_progress("resharded", &req.output, &a.copy, |progress, on_plan| {
        ckpt_reshard::reshard(&req, progress, on_plan)
    })
}

fn print_plan(
    source: &Checkpoint,
    strategy: &Strategy,
    plan: &CopyPlan,
    as_json: bool,
) -> Result<()> {
    let report = ckpt_core::PlanReport::new(source, plan);
    if as_json {
        let mut doc = report.to_json(source);
        doc["mesh"] = json!(strategy.mesh.to_string());
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "target mesh {} ({} ranks)",
            strategy.mesh,
            strategy.mesh.world_size()
        );
        print!("{}", report.to_text(source, 8));
    }
    Ok(())
}

fn convert(a: ConvertArgs, how: ckpt_core::Conversion) -> Result<ExitCode> {
    let t = Instant::now();
    let s = ckpt_core::convert(&a.source, &a.output, how, a.force)?;
    let secs = t.elapsed().as_secs_f64();
    let verb = match how {
        ckpt_core::Conversion::Compress(_) => "compressed",
        ckpt_core::Conversion::Decompress => "decompressed",
    };
    let ratio = s.bytes_out as f64 / s.bytes_in.max(1) as f64;
    if a.json {
        println!(
            "{}",
            json!({"files": s.files, "copied": s.copied, "raw_bytes": s.raw_bytes,
                   "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "ratio": ratio,
                   "seconds": secs, "output": a.output})
        );
    } else {
        println!(
            "{verb} {} file(s), {} -> {} ({ratio:.3} x) in {secs:.2} s into {}",
            s.files,
            human_bytes(s.bytes_in),
            human_bytes(s.bytes_out),
            a.output.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn example(a: ExampleArgs) -> Result<ExitCode> {
    let mesh = Mesh::parse(&a.mesh)?;
    let model = ckpt_core::ExampleModel {
        hidden: a.hidden,
        layers: a.layers,
        vocab: a.vocab,
        dtype: a.dtype,
        optimizer: a.optimizer,
    };
    let staged = ckpt_core::StagedDir::new(&a.output, a.force)?;
    let s = ckpt_core::write_example(staged.path(), &model, &mesh)?;
    staged.commit()?;
    println!(
        "wrote a {}-rank example checkpoint ({} tensors, mesh {}) to {}",
        mesh.world_size(),
        s.tensors.len(),
        mesh,
        a.output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Whether this process prints the results: always, unless a launcher (mpirun, srun,
/// torchrun) started it as a rank other than 0.
fn is_lead() -> Result<bool> {
    Ok(ckpt_core::LaunchEnv::from_env()?.is_none_or(|e| e.rank == 0))
}

/// Ranks of a thread job in this process (1 under a launcher), for sizing the CPU
/// thread pools before any tensor work.
fn ranks_here(backend: ckpt_train::Backend, mesh: Option<&str>, ranks: Option<u64>) -> usize {
    if backend != ckpt_train::Backend::Threads {
        return 1;
    }
    mesh.and_then(|m| ckpt_core::Mesh::parse(m).ok())
        .map(|m| m.world_size())
        .or(ranks)
        .unwrap_or(1) as usize
}

fn train(a: TrainArgs) -> Result<ExitCode> {
    ckpt_train::configure_cpu_threads(ranks_here(
        a.config.backend,
        a.config.mesh.as_deref(),
        a.config.ranks,
    ));
    let report = ckpt_train::train(&a.config, !(a.quiet || a.json))?;
    if !is_lead()? {
        return Ok(ExitCode::SUCCESS);
    }
    // TensorBoard's curves beside the checkpoints: `tensorboard --logdir OUT`.
    let events = match &a.config.out {
        Some(out) => Some(ckpt_train::run_scalars(&report).write(out)?),
        None => None,
    };
    if a.json {
        println!(
            "{}",
            json!({
                "mesh": report.mesh, "model": report.model, "start_step": report.start_step, "steps": report.steps,
                "epochs": report.epochs, "final_loss": report.losses.last(), "test_accuracy": report.test_accuracy,
                "images_per_sec": report.images_per_sec, "seconds": report.seconds, "checkpoints": report.checkpoints,
                "save_stall_seconds": report.save_stalls, "events": events,
            })
        );
    } else {
        println!(
            "trained {} on {}: steps {}..{}, epochs {}, final loss {}, test accuracy {}, {:.0} images/s, {:.1} s",
            report.model.kind(),
            report.mesh,
            report.start_step,
            report.steps,
            report.epochs,
            report.losses.last().map_or("-".into(), |l| format!("{l:.4}")),
            report.final_accuracy().map_or("-".into(), |a| format!("{a:.4}")),
            report.images_per_sec,
            report.seconds
        );
        if let Some(last) = report.checkpoints.last() {
            println!("checkpoint: {}", last.display());
        }
        if let Some(e) = &events {
            println!("tensorboard: {}", e.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn infer(a: InferArgs) -> Result<ExitCode> {
    ckpt_train::configure_cpu_threads(ranks_here(a.backend, None, a.ranks));
    let req = ckpt_infer::InferRequest {
        checkpoint: a.checkpoint,
        data: a.data,
        ranks: a.ranks,
        batch_size: a.batch_size,
        predict: if a.predict.is_empty() {
            None
        } else {
            Some(
                ckpt_infer::parse_predict(&a.predict)
                    .map_err(|e| Usage(format!("--predict {e}")))?,
            )
        },
        limit: a.limit,
        backend: a.backend,
        device: a.device,
    };
    let r = ckpt_infer::infer(&req)?;
    if !is_lead()? {
        return Ok(ExitCode::SUCCESS);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} checkpoint, model {}, {} rank(s): test accuracy {:.4} on {} images of {}",
        r.kind,
        r.model["model"].as_str().unwrap_or("?"),
        r.ranks,
        r.accuracy,
        r.images,
        r.data
    );
    println!(
        "per class: {}",
        r.per_class_accuracy
            .iter()
            .enumerate()
            .map(|(c, a)| format!("{c}:{a:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!("confusion (rows: true class, columns: predicted):");
    for row in &r.confusion {
        println!(
            "  {}",
            row.iter().map(|n| format!("{n:>4}")).collect::<String>()
        );
    }
    for p in &r.predictions {
        let probs = p
            .probabilities
            .iter()
            .map(|v| format!("{v:.3}"))
            .collect::<Vec<_>>()
            .join(" ");
        let label = p.label.map_or(String::new(), |l| format!(" (true {l})"));
        println!("image {}: class {}{label}  p = [{probs}]", p.index, p.class);
    }
    println!(
        "{:.0} images/s, {:.2} s in all",
        r.images_per_sec, r.seconds
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reshard_needs_exactly_one_target() {
        assert!(Cli::try_parse_from(["ckpt", "reshard", "a", "-o", "b"]).is_err());
        assert!(Cli::try_parse_from([
            "ckpt", "reshard", "a", "-o", "b", "--to", "2", "--mesh", "tp=2"
        ])
        .is_err());
        assert!(Cli::try_parse_from(["ckpt", "reshard", "a", "-o", "b", "--to", "2"]).is_ok());
    }

    #[test]
    fn compress_flags() {
        let c =
            Cli::try_parse_from(["ckpt", "merge", "a", "-o", "b", "--compress", "zstd:7"]).unwrap();
        match c.command {
            Command::Merge(m) => assert_eq!(m.copy.compress.map(|c| c.level), Some(7)),
            other => panic!("parsed as {other:?}"),
        }
        for bad in ["zstd:0", "zstd:23", "lz4", "zstd:x"] {
            assert!(
                Cli::try_parse_from([
                    "ckpt",
                    "reshard",
                    "a",
                    "-o",
                    "b",
                    "--to",
                    "2",
                    "--compress",
                    bad
                ])
                .is_err(),
                "{bad}"
            );
        }
        let c = Cli::try_parse_from(["ckpt", "compress", "a", "-o", "b"]).unwrap();
        match c.command {
            Command::Compress(a) => assert_eq!(a.level, ckpt_core::DEFAULT_LEVEL),
            other => panic!("parsed as {other:?}"),
        }
        assert!(
            Cli::try_parse_from(["ckpt", "compress", "a", "-o", "b", "--level", "30"]).is_err()
        );
        assert!(Cli::try_parse_from(["ckpt", "decompress", "a"]).is_err());
    }

    #[test]
    fn dtype_flag() {
        assert_eq!(parse_cast("bf16"), Ok(Dtype::BF16));
        assert!(parse_cast("int3").is_err());
        let c = Cli::try_parse_from([
            "ckpt",
            "merge",
            "a",
            "-o",
            "b",
            "--dtype",
            "f16",
            "--max-shard-size",
            "5GB",
        ])
        .unwrap();
        match c.command {
            Command::Merge(m) => {
                assert_eq!(m.copy.dtype, Some(Dtype::F16));
                assert_eq!(m.max_shard_size, Some(5_000_000_000));
            }
            other => panic!("parsed as {other:?}"),
        }
    }
}

//! Command-line definition and dispatch: the commands (their arguments in
//! [`args`](crate::args)), each handed to one function of [`commands`](crate::commands),
//! which calls its library and prints what the library says.
//!
//! Exit codes: 0 done (or nothing wrong found), 1 a problem (a failure, or problems
//! found by `inspect`/`verify`), 2 a usage error (clap's own, or [`Usage`]).

use crate::args::{
    ConvertArgs, ExampleArgs, InferArgs, Inputs, MergeArgs, Names, ReshardArgs, TrainArgs, Usage,
};
use crate::commands;
use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

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

pub(crate) fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Inspect {
            inputs,
            names,
            json,
            show,
            html,
        } => {
            let sel = names
                .selection()
                .with_step(inputs.step)
                .with_rules(inputs.rules()?);
            match (show, html) {
                (None, None) => commands::inspect(&inputs.all()?, &sel, json),
                (show, html) => crate::pictures::run(&inputs.all()?, &sel, show, html, json),
            }
        }
        Command::Verify {
            inputs,
            names,
            deep,
            fast,
            json,
        } => commands::verify(
            &inputs.all()?,
            &names
                .selection()
                .with_step(inputs.step)
                .with_rules(inputs.rules()?),
            ckpt_core::VerifyDepth {
                checksums: !fast,
                deep,
            },
            json,
        ),
        Command::Merge(a) => commands::merge(a),
        Command::Reshard(a) => commands::reshard(a),
        Command::Compress(a) => {
            let how = ckpt_core::Conversion::Compress(ckpt_core::Compression {
                level: a.level,
                chunk_bytes: a.chunk_bytes.unwrap_or(ckpt_core::DEFAULT_CHUNK_BYTES),
            });
            commands::convert(a, how)
        }
        Command::Decompress(a) => commands::convert(a, ckpt_core::Conversion::Decompress),
        Command::Example(a) => commands::example(a),
        Command::Train(a) => commands::train(a),
        Command::Infer(a) => commands::infer(a),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_cast;
    use ckpt_core::Dtype;

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

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
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::ffi::OsString;
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
    // Objects of a bucket are read and written through local trees: name the objects.
    ckpt_core::storage::unmirror_text(&out)
}

/// Whether an error is the user's way of asking (exit 2) rather than a problem found:
/// a [`Usage`], a trainer option, or a mesh the user gave that does not fit (`--mesh
/// pp=2` on a source without a `pp` axis; a mesh read from a file is wrapped with the
/// file's path, a problem of the file, exit 1).
pub(crate) fn is_usage(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<ckpt_core::Error>(),
        Some(ckpt_core::Error::InvalidMesh { .. })
    ) || e.chain().any(|c| {
        c.is::<Usage>()
            || matches!(
                c.downcast_ref::<ckpt_train::Error>(),
                Some(ckpt_train::Error::InvalidOption { .. })
            )
    })
}

/// An error as the JSON object `--json` prints instead of the text line.
pub(crate) fn error_json(message: &str, exit_code: u8) -> String {
    serde_json::json!({"error": message, "exit_code": exit_code}).to_string()
}

/// The commands of the digits model and the synthetic examples: listed in `--help`
/// apart from the checkpoint tools, after them.
const DEMO_COMMANDS: [&str; 4] = ["train", "infer", "demo", "example"];

/// The command line's definition: [`Cli`], with `--help` listing the checkpoint tools
/// under their own heading and the demo commands apart (clap has one heading for all
/// subcommands: these are hidden from it and listed after it, with their own `about`).
pub(crate) fn command() -> clap::Command {
    let mut cmd = Cli::command().subcommand_help_heading("Checkpoint tools");
    let width = cmd
        .get_subcommands()
        .map(|s| s.get_name().len())
        .max()
        .unwrap_or(0);
    let header = *cmd.get_styles().get_header();
    let literal = *cmd.get_styles().get_literal();
    let mut text =
        format!("{header}Demo and examples (the digits model, synthetic checkpoints):{header:#}\n");
    for name in DEMO_COMMANDS {
        let about = cmd
            .find_subcommand(name)
            .and_then(|s| s.get_about())
            .map(|a| a.to_string())
            .unwrap_or_default();
        let pad = " ".repeat(width.saturating_sub(name.len()));
        text.push_str(&format!("  {literal}{name}{literal:#}{pad}  {about}\n"));
        cmd = cmd.mut_subcommand(name, |s| s.hide(true));
    }
    cmd.after_help(text.trim_end().to_string())
}

/// Runs `ckpt` with `args` (program name first): parsed, run, and an error printed once
/// (on stderr, or as JSON on stdout under `--json`) with its exit code (0, 1 or 2).
pub(crate) fn main(args: Vec<OsString>) -> ExitCode {
    let cli = match parse(args) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let json = cli.json();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let code = if is_usage(&e) { 2 } else { 1 };
            if json {
                println!("{}", error_json(&message(&e), code));
            } else {
                eprintln!("ckpt: error: {}", message(&e));
            }
            ExitCode::from(code)
        }
    }
}

/// Parses the command line (with the old spellings of list options kept, see
/// [`old_spellings`](crate::args::lists::old_spellings)). A usage error is printed, as
/// JSON when `--json` was given, and its exit code returned; so are `--help` and
/// `--version` (exit 0).
fn parse(args: Vec<OsString>) -> std::result::Result<Cli, ExitCode> {
    let args = crate::args::lists::old_spellings(args);
    let json = args
        .iter()
        .take_while(|a| *a != "--")
        .any(|a| a == "--json");
    let parsed = command()
        .try_get_matches_from(&args)
        .and_then(|m| Cli::from_arg_matches(&m));
    match parsed {
        Ok(cli) => Ok(cli),
        Err(e) if json && e.use_stderr() => {
            // The error's own lines, without clap's usage and `--help` hints.
            let text = e.render().to_string();
            let first = text.split("\n\n").next().unwrap_or("");
            let message = first
                .strip_prefix("error: ")
                .unwrap_or(first)
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            println!("{}", error_json(&message, 2));
            Err(ExitCode::from(2))
        }
        Err(e) => {
            let _ = e.print();
            Err(ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2)))
        }
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
    /// Join per-rank slices into one integrated checkpoint: safetensors files in
    /// Hugging Face's layout (--format: a Hugging Face model, torch, MindSpore, ...).
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

impl Cli {
    /// Whether the command prints JSON (`--json`): its errors are JSON too.
    pub(crate) fn json(&self) -> bool {
        match &self.command {
            Command::Inspect { json, .. } | Command::Verify { json, .. } => *json,
            Command::Merge(a) => a.copy.json,
            Command::Reshard(a) => a.copy.json,
            Command::Compress(a) | Command::Decompress(a) => a.json,
            Command::Train(a) => a.json,
            Command::Infer(a) => a.json,
            Command::Example(_) | Command::Demo { .. } => false,
        }
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
            ckpt_core::engine::verify::VerifyDepth {
                checksums: !fast,
                deep,
            },
            json,
        ),
        Command::Merge(a) => commands::merge(a),
        Command::Reshard(a) => commands::reshard(a),
        Command::Compress(a) => {
            let how = ckpt_core::engine::convert::Conversion::Compress(
                ckpt_core::formats::ckptz::Compression {
                    level: a.level,
                    chunk_bytes: a
                        .chunk_bytes
                        .unwrap_or(ckpt_core::formats::ckptz::DEFAULT_CHUNK_BYTES),
                },
            );
            commands::convert(a, how)
        }
        Command::Decompress(a) => {
            commands::convert(a, ckpt_core::engine::convert::Conversion::Decompress)
        }
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
    use crate::args::lists::flat;
    use crate::args::parse_cast;
    use ckpt_core::layout::Dtype;

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
            Command::Compress(a) => assert_eq!(a.level, ckpt_core::formats::ckptz::DEFAULT_LEVEL),
            other => panic!("parsed as {other:?}"),
        }
        assert!(
            Cli::try_parse_from(["ckpt", "compress", "a", "-o", "b", "--level", "30"]).is_err()
        );
        assert!(Cli::try_parse_from(["ckpt", "decompress", "a"]).is_err());
    }

    #[test]
    fn list_options_take_one_value_per_occurrence() {
        let c = Cli::try_parse_from([
            "ckpt",
            "merge",
            "--include",
            "a.*",
            "in",
            "-o",
            "o",
            "--include",
            "b.*,{c,d}.*",
            "--exclude",
            "x",
        ])
        .unwrap();
        match c.command {
            Command::Merge(m) => {
                assert_eq!(m.inputs.paths, vec![PathBuf::from("in")]);
                assert_eq!(flat(&m.copy.include), ["a.*", "b.*", "{c,d}.*"]);
                assert_eq!(flat(&m.copy.exclude), ["x"]);
            }
            other => panic!("parsed as {other:?}"),
        }
        let c = Cli::try_parse_from([
            "ckpt", "reshard", "in", "-o", "o", "--to", "2", "--shard", "a=0,b=1", "--shard", "c=1",
        ])
        .unwrap();
        match c.command {
            Command::Reshard(r) => assert_eq!(
                flat(&r.shard),
                [("a".into(), 0), ("b".into(), 1), ("c".into(), 1)]
            ),
            other => panic!("parsed as {other:?}"),
        }
        assert!(Cli::try_parse_from(["ckpt", "reshard", "i", "-o", "o", "--to", "0"]).is_err());
        let c = Cli::try_parse_from([
            "ckpt",
            "merge",
            "i",
            "-o",
            "o",
            "--rank",
            "1",
            "--world-size",
            "2",
        ])
        .unwrap();
        match c.command {
            Command::Merge(m) => {
                assert_eq!((m.rank.as_deref(), m.world_size), (Some("1"), Some(2)))
            }
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn help_lists_the_demo_commands_apart() {
        let cmd = command();
        for name in DEMO_COMMANDS {
            let sub = cmd.find_subcommand(name).unwrap();
            assert!(sub.is_hide_set(), "{name}");
        }
        let after = cmd.get_after_help().unwrap().to_string();
        for name in DEMO_COMMANDS {
            assert!(after.contains(&format!("  {name} ")), "{name}: {after}");
        }
        assert!(command()
            .try_get_matches_from(["ckpt", "train", "--help"])
            .is_err_and(|e| e.kind() == clap::error::ErrorKind::DisplayHelp));
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
                assert_eq!(m.copy.dtype, Some(crate::args::Cast::Dtype(Dtype::F16)));
                assert_eq!(m.max_shard_size, Some(5_000_000_000));
            }
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn orbax_format_and_item_flags() {
        let c = Cli::try_parse_from([
            "ckpt",
            "merge",
            "a",
            "-o",
            "b",
            "--format",
            "orbax",
            "--orbax-item",
            "items",
        ])
        .unwrap();
        match c.command {
            Command::Merge(m) => {
                assert_eq!(m.format, "orbax");
                assert_eq!(m.orbax.orbax_item.as_deref(), Some("items"));
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(Cli::try_parse_from(["ckpt", "merge", "a", "-o", "b", "--orbax-item"]).is_err());
        let c = Cli::try_parse_from([
            "ckpt",
            "reshard",
            "a",
            "-o",
            "b",
            "--to",
            "2",
            "--format",
            "orbax",
            "--orbax-item",
            "params",
        ])
        .unwrap();
        match c.command {
            Command::Reshard(r) => {
                assert_eq!(r.format, "orbax");
                assert_eq!(r.orbax.orbax_item.as_deref(), Some("params"));
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(Cli::try_parse_from([
            "ckpt",
            "reshard",
            "a",
            "-o",
            "b",
            "--to",
            "2",
            "--orbax-item"
        ])
        .is_err());
    }
}

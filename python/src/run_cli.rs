//! The `ckpt` console script: the binary's CLI (src/cli.rs) run in-process, with the
//! binary's exit codes (0 success, 1 a problem found or an error, 2 bad usage).

use crate::cli;
use clap::Parser;
use pyo3::prelude::*;
use std::process::ExitCode;

/// Runs `ckpt` with `argv` (program name first) and returns its exit code.
#[pyfunction]
pub(crate) fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| {
        let parsed = match cli::Cli::try_parse_from(argv) {
            Ok(c) => c,
            Err(e) => {
                // --help and --version print to stdout and succeed; the rest is usage.
                let _ = e.print();
                return e.exit_code();
            }
        };
        let code = match cli::run(parsed) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("ckpt: error: {}", cli::message(&e));
                ExitCode::from(if cli::is_usage(&e) { 2 } else { 1 })
            }
        };
        // ExitCode has no accessor for its value: find the byte it was made from.
        (0..=255u8)
            .find(|&c| ExitCode::from(c) == code)
            .map_or(1, i32::from)
    })
}

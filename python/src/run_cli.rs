//! The `ckpt` console script: the binary's CLI (src/cli.rs) run in-process, with the
//! binary's exit codes (0 success, 1 a problem found or an error, 2 bad usage).

use crate::cli;
use pyo3::prelude::*;
use std::ffi::OsString;
use std::process::ExitCode;

/// Runs `ckpt` with `argv` (program name first) and returns its exit code.
#[pyfunction]
pub(crate) fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| {
        // The binary's own entry: old spellings of list options, --json errors, the
        // grouped --help, exit codes.
        let code = cli::main(argv.into_iter().map(OsString::from).collect());
        // ExitCode has no accessor for its value: find the byte it was made from.
        (0..=255u8)
            .find(|&c| ExitCode::from(c) == code)
            .map_or(1, i32::from)
    })
}

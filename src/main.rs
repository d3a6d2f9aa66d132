//! `ckpt`: merge, reshard, check and load checkpoints of models trained on many devices.
//!
//! The binary is a thin shell: clap parses, each subcommand turns its arguments into a
//! library request and prints the result. Exit codes: 0 success, 1 a problem was found
//! or an error occurred, 2 bad usage.

mod cli;
mod demo;
mod report;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`ckpt inspect big | head`), as Unix tools do, instead
    // of panicking inside println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = cli::Cli::parse();
    match cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ckpt: error: {}", message(&e));
            ExitCode::from(if cli::is_usage(&e) { 2 } else { 1 })
        }
    }
}

/// The error and its causes, each said once: a cause whose text its wrapper already
/// includes (`path: No such file or directory` over `No such file or directory`) is
/// not repeated.
fn message(e: &anyhow::Error) -> String {
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

//! `ckpt`: merge, reshard, check and load checkpoints of models trained on many devices.
//!
//! The binary is a thin shell: clap parses, each subcommand turns its arguments into a
//! library request and prints the result. Exit codes: 0 success, 1 a problem was found
//! or an error occurred, 2 bad usage; under `--json` an error is printed as the object
//! `{"error": MESSAGE, "exit_code": CODE}` on stdout instead of the text line on stderr.

mod args;
mod cli;
mod commands;
mod demo;
mod pictures;
mod report;

use std::process::ExitCode;

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`ckpt inspect big | head`), as Unix tools do, instead
    // of panicking inside println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    install_bus_error_handler();
    cli::main(std::env::args_os().collect())
}

/// An input truncated by another program while mapped raises SIGBUS on the next read
/// past its new end. Instead of dying without a word: name the file (from the faulting
/// address), remove the temporaries of this run's outputs, exit 1.
fn install_bus_error_handler() {
    extern "C" fn on_bus_error(
        _sig: libc::c_int,
        info: *mut libc::siginfo_t,
        _ctx: *mut libc::c_void,
    ) {
        use std::sync::atomic::{AtomicBool, Ordering};
        static HANDLING: AtomicBool = AtomicBool::new(false);
        if HANDLING.swap(true, Ordering::SeqCst) {
            // Another thread faulted too: the first one speaks and exits.
            loop {
                // SAFETY: pause is async-signal-safe.
                unsafe { libc::pause() };
            }
        }
        // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers.
        let addr = unsafe { (*info).si_addr() } as usize;
        // Not async-signal-safe (it formats and allocates), but the fault is raised
        // while copying mapped bytes, not inside the allocator, and the process ends
        // here either way.
        let msg = ckpt_core::fault::bus_error_message(addr);
        ckpt_core::fault::remove_registered_temporaries();
        eprintln!("ckpt: error: {msg}");
        // SAFETY: _exit ends the process without running anything else.
        unsafe { libc::_exit(1) };
    }
    // SAFETY: installing a handler before any thread starts; the struct is zeroed and
    // then filled as sigaction(2) requires.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_bus_error as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

//! What the benchmarks share: running a command and measuring it.

use std::process::Command;
use std::time::Instant;

/// Runs a command, returns (seconds, peak RSS of the child in MiB, its CPU seconds).
pub fn timed(cmd: &mut Command) -> (f64, f64, f64) {
    let t = Instant::now();
    let child = cmd.spawn().expect("spawn");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain FFI calls on a child we own; rusage is written by the kernel.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    let secs = t.elapsed().as_secs_f64();
    assert!(
        r == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?} failed"
    );
    std::mem::forget(child);
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (
        secs,
        ru.ru_maxrss as f64 / 1024.0,
        tv(ru.ru_utime) + tv(ru.ru_stime),
    )
}

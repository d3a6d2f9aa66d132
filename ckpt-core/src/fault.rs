//! What the process can say and undo when an input shrinks under it.
//!
//! Inputs are memory-mapped; if another program truncates one while ckpt reads it, the
//! next access past the new end raises SIGBUS, which would kill the process with no
//! word and leave its temporaries behind. The binary installs a SIGBUS handler that
//! asks this module which input the faulting address belongs to (every mapping is
//! registered here) and which temporaries to remove (every staged output is), then
//! exits with code 1. The registries are only `try_lock`ed from the handler: the fault
//! happens while copying mapped bytes, never while holding these locks, and if a lock
//! is held anyway the handler says less rather than deadlock.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static MAPS: Mutex<Vec<(usize, usize, PathBuf)>> = Mutex::new(Vec::new());
static TEMPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records that `len` bytes at `start` map the file `path`.
pub(crate) fn register_map(start: usize, len: usize, path: &Path) {
    lock(&MAPS).push((start, len, path.to_path_buf()));
}

/// Forgets the mapping at `start`.
pub(crate) fn unregister_map(start: usize) {
    lock(&MAPS).retain(|m| m.0 != start);
}

/// Drops the pages holding `addr..addr + len` from the resident set when they lie in a
/// registered file mapping (read-only and file-backed: they come back from the page
/// cache if read again); memory the process owns is never touched. For parsers that
/// read a few bytes here and there through a mapping (a zip archive's entry headers),
/// where each read may map a whole large folio of the page cache.
pub(crate) fn forget_mapped(addr: usize, len: usize) {
    const PAGE: usize = 4096;
    let Some((start, map_len)) = lock(&MAPS)
        .iter()
        .find(|(s, l, _)| addr >= *s && addr.saturating_add(len) <= s + l)
        .map(|(s, l, _)| (*s, *l))
    else {
        return;
    };
    let lo = (addr - start) / PAGE * PAGE;
    let hi = ((addr - start + len).div_ceil(PAGE) * PAGE).min(map_len);
    if hi > lo {
        // SAFETY: a registered mapping is a read-only, file-backed mapping of an input
        // (formats::map_file), alive while registered; dropping its pages loses nothing.
        unsafe {
            libc::madvise(
                (start + lo) as *mut libc::c_void,
                hi - lo,
                libc::MADV_DONTNEED,
            );
        }
    }
}

/// Records a temporary output to remove if the process dies of a bus error.
pub(crate) fn register_temp(path: &Path) {
    lock(&TEMPS).push(path.to_path_buf());
}

/// Forgets a temporary (renamed into place or removed).
pub(crate) fn unregister_temp(path: &Path) {
    lock(&TEMPS).retain(|p| p != path);
}

/// The message for a bus error at `addr`: names the input whose mapping holds it.
/// For the SIGBUS handler only.
#[must_use]
pub fn bus_error_message(addr: usize) -> String {
    let file = MAPS.try_lock().ok().and_then(|maps| {
        maps.iter()
            .find(|(s, l, _)| addr >= *s && addr < s + l)
            .map(|(_, _, p)| p.display().to_string())
    });
    match file {
        Some(f) => format!(
            "{f}: the file shrank while it was being read (truncated or rewritten by another program); nothing was written"
        ),
        None => "bus error reading a mapped input (a file shrank while it was being read); nothing was written".into(),
    }
}

/// Removes every registered temporary. For the SIGBUS handler only.
pub fn remove_registered_temporaries() {
    if let Ok(temps) = TEMPS.try_lock() {
        for p in temps.iter() {
            let _ = match std::fs::symlink_metadata(p) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
                Ok(_) => std::fs::remove_file(p),
                Err(_) => Ok(()),
            };
        }
    }
}

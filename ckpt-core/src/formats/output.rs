//! `StagedDir`: an output directory that appears complete or not at all.

use crate::error::{Error, IoContext, Result};
use crate::formats::writer::WritePart;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A directory built under a temporary name beside its destination and renamed into
/// place by [`StagedDir::commit`]; dropped uncommitted, it is removed.
#[derive(Debug)]
pub struct StagedDir {
    dest: PathBuf,
    tmp: PathBuf,
    force: bool,
    done: bool,
}

impl StagedDir {
    /// Starts building `dest`.
    ///
    /// # Errors
    /// `dest` exists and `force` is false; I/O errors.
    pub fn new(dest: &Path, force: bool) -> Result<StagedDir> {
        // First: a killed replace may have left the only complete copy aside.
        remove_stale_temps(dest);
        if dest.exists() && !force {
            return Err(Error::OutputExists {
                path: dest.to_path_buf(),
            });
        }
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).at(&parent)?;
        let tmp = temp_name(dest);
        std::fs::create_dir(&tmp).at(&tmp)?;
        crate::fault::register_temp(&tmp);
        // Files written under it are streamed under their final names when the output
        // goes to a URL.
        ckpt_storage::alias_dir(&tmp, dest);
        Ok(StagedDir {
            dest: dest.to_path_buf(),
            tmp,
            force,
            done: false,
        })
    }

    /// Where to write the contents.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Moves the finished directory into place (replacing an old one when forced).
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn commit(mut self) -> Result<()> {
        std::fs::File::open(&self.tmp)
            .and_then(|d| d.sync_all())
            .at(&self.tmp)?;
        if self.dest.exists() {
            if !self.force {
                return Err(Error::OutputExists {
                    path: self.dest.clone(),
                });
            }
            replace_atomically(&self.tmp, &self.dest)?;
        } else {
            std::fs::rename(&self.tmp, &self.dest).at(&self.dest)?;
        }
        crate::fault::unregister_temp(&self.tmp);
        ckpt_storage::unalias_dir(&self.tmp);
        self.done = true;
        Ok(())
    }

    /// Moves the finished file `name` of the directory to the destination's path (an
    /// output that is one file, such as a GGUF; an old file there replaced when
    /// forced), and removes the directory.
    ///
    /// # Errors
    /// I/O errors, with the path; a destination that exists without `force`.
    pub fn commit_file(mut self, name: &str) -> Result<()> {
        let file = self.tmp.join(name);
        if self.dest.exists() && !self.force {
            return Err(Error::OutputExists {
                path: self.dest.clone(),
            });
        }
        if self.dest.is_dir() {
            return Err(Error::Unsupported {
                problem: format!(
                    "{}: is a directory; the output is one file",
                    self.dest.display()
                ),
            });
        }
        std::fs::rename(&file, &self.dest).at(&self.dest)?;
        if let Some(parent) = self.dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::File::open(parent)
                .and_then(|d| d.sync_all())
                .at(parent)?;
        }
        let _ = std::fs::remove_dir_all(&self.tmp);
        crate::fault::unregister_temp(&self.tmp);
        ckpt_storage::unalias_dir(&self.tmp);
        self.done = true;
        Ok(())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.tmp);
            crate::fault::unregister_temp(&self.tmp);
            ckpt_storage::unalias_dir(&self.tmp);
        }
    }
}

/// Refuses an output that lies inside (or is) one of the inputs.
///
/// # Errors
/// [`Error::Unsupported`] naming both paths.
pub fn check_output_outside_inputs(out: &Path, inputs: &[PathBuf]) -> Result<()> {
    let abs = |p: &Path| -> PathBuf {
        std::fs::canonicalize(p).unwrap_or_else(|_| {
            // Not there yet: resolve the parent instead.
            match (p.parent(), p.file_name()) {
                (Some(par), Some(name)) if !par.as_os_str().is_empty() => {
                    std::fs::canonicalize(par)
                        .unwrap_or_else(|_| par.to_path_buf())
                        .join(name)
                }
                _ => std::env::current_dir().unwrap_or_default().join(p),
            }
        })
    };
    let o = abs(out);
    for i in inputs {
        let i_abs = abs(i);
        // A file input only forbids outputs that are it or contain it: a new directory
        // beside it (`merge /data/model.safetensors -o /data/merged`) touches nothing.
        let overlaps = if i_abs.is_file() {
            i_abs.starts_with(&o)
        } else {
            o.starts_with(&i_abs) || i_abs.starts_with(&o)
        };
        if overlaps {
            return Err(Error::Unsupported {
                problem: format!(
                    "output {} overlaps input {}: write it elsewhere",
                    out.display(),
                    i.display()
                ),
            });
        }
    }
    Ok(())
}

/// Copies the carried files (`config.json`, `trainer_state.json`) into `dir`.
///
/// # Errors
/// I/O errors, with the path.
pub fn copy_carried(
    carried: &std::collections::BTreeMap<String, PathBuf>,
    dir: &Path,
) -> Result<()> {
    for (name, from) in carried {
        // Through the storage layer: in a bucket's tree the file may stand for an
        // object not yet fetched.
        let bytes = super::read_small(from)?;
        write_file_atomic(&dir.join(name), &bytes)?;
    }
    Ok(())
}

/// Removes temporaries of `dest` left by runs that were killed before they could clean
/// up (`.<name>.tmp-<pid>-<n>` whose process is gone), so an interrupted run leaves no
/// litter behind once the same output is written again; an old output set aside by a
/// killed replace (`.<name>.old-<pid>-<n>`) is put back when `dest` is missing.
pub fn remove_stale_temps(dest: &Path) {
    let Some(name) = dest.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return;
    };
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp_prefix = format!(".{name}.tmp-");
    let old_prefix = format!(".{name}.old-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let (rest, is_old) = match (
            file.strip_prefix(&tmp_prefix),
            file.strip_prefix(&old_prefix),
        ) {
            (Some(r), _) => (r, false),
            (_, Some(r)) => (r, true),
            _ => continue,
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let p = e.path();
        // An old output set aside by a replace that was killed before the new one took
        // its place is the only complete copy: put it back rather than delete it.
        if is_old && std::fs::symlink_metadata(dest).is_err() {
            let _ = std::fs::rename(&p, dest);
            continue;
        }
        remove_any(&p);
    }
}

/// Removes a file or a directory tree, whichever `p` is (errors ignored: best effort).
fn remove_any(p: &Path) {
    let _ = match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(_) => Ok(()),
    };
}

/// Puts `new` (a complete file or directory) at `dest`, replacing what is there, so that
/// `dest` names a complete old or a complete new output at every instant: on Linux one
/// `renameat2(RENAME_EXCHANGE)` swaps them, then the old one (now at `new`'s name) is
/// deleted. Where the filesystem cannot exchange, the old one is renamed aside to
/// `.<name>.old-<pid>-<n>` first; a run killed between the two renames leaves it there,
/// and the next write of the same output puts it back (see [`remove_stale_temps`]),
/// never deletes it.
///
/// # Errors
/// I/O errors, with the path.
pub fn replace_atomically(new: &Path, dest: &Path) -> Result<()> {
    if std::fs::symlink_metadata(dest).is_err() {
        return std::fs::rename(new, dest).at(dest);
    }
    if exchange(new, dest).is_ok() {
        remove_any(new);
        return Ok(());
    }
    let old = dest.with_file_name(format!(
        ".{}.old-{}-{}",
        dest.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id(),
        next_temp_number()
    ));
    std::fs::rename(dest, &old).at(dest)?;
    crash_point("replace");
    std::fs::rename(new, dest).at(dest)?;
    remove_any(&old);
    Ok(())
}

/// Swaps two paths atomically (Linux `renameat2` with `RENAME_EXCHANGE`).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    if std::env::var_os("CKPT_TEST_NO_EXCHANGE").is_some() {
        return Err(std::io::Error::from(std::io::ErrorKind::Unsupported));
    }
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: two valid NUL-terminated paths relative to the working directory.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// For crash tests: `CKPT_TEST_CRASH_AT=<point>` aborts the process at that point, as a
/// kill would, so a test can check what a crash there leaves behind.
pub(crate) fn crash_point(point: &str) {
    if std::env::var("CKPT_TEST_CRASH_AT").is_ok_and(|p| p == point) {
        std::process::abort();
    }
}

/// A temporary name beside `dest`, unique to this process and call.
pub(crate) fn temp_name(dest: &Path) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dest.with_file_name(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        next_temp_number()
    ))
}

fn next_temp_number() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Creates the temporary file an output `dest` is written under (beside it, exclusive,
/// registered for removal on a bus error), after clearing dead runs' temporaries.
///
/// # Errors
/// I/O errors, with the path.
pub(crate) fn create_staged_file(dest: &Path) -> Result<(PathBuf, File)> {
    remove_stale_temps(dest);
    let tmp = temp_name(dest);
    let file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&tmp)
        .at(&tmp)?;
    crate::fault::register_temp(&tmp);
    Ok((tmp, file))
}

/// Syncs a staged file and renames it to `dest`.
///
/// # Errors
/// I/O errors, with the path.
pub(crate) fn commit_staged_file(file: &File, tmp: &Path, dest: &Path) -> Result<()> {
    file.sync_all().at(tmp)?;
    std::fs::rename(tmp, dest).at(dest)?;
    crate::fault::unregister_temp(tmp);
    Ok(())
}

/// Linux's `IOV_MAX`: most buffers one `pwritev` takes.
const IOV_MAX: usize = 1024;

/// `pwritev` until every byte of `parts` is written from `offset` on (std has no
/// positional vectored write; partial writes and interrupts are resumed).
fn write_all_vectored_at(file: &File, parts: &[&[u8]], mut offset: u64) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind, IoSlice};
    use std::os::fd::AsRawFd;
    let mut slices: Vec<IoSlice<'_>> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| IoSlice::new(p))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let at = libc::off_t::try_from(offset)
            .map_err(|_| Error::new(ErrorKind::InvalidInput, "write offset over i64::MAX"))?;
        let n = rest.len().min(IOV_MAX);
        // SAFETY: `IoSlice` is ABI-compatible with `iovec` on Unix (std guarantees it);
        // the first `n` slices borrow memory that outlives the call.
        let r = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                rest.as_ptr().cast::<libc::iovec>(),
                n as libc::c_int,
                at,
            )
        };
        if r < 0 {
            let e = Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(Error::from(ErrorKind::WriteZero));
        }
        offset += r as u64;
        IoSlice::advance_slices(&mut rest, r as usize);
    }
    Ok(())
}

/// Parts at least this long that lie in an input file are copied into the output by the
/// kernel (`copy_file_range`), file to file, rather than from the input's mapping;
/// shorter ones go in the `pwritev` batches, where one call covers up to 1024 of them.
const KERNEL_COPY_MIN: usize = 64 << 10;

/// Which parts are copied by the kernel: those of [`KERNEL_COPY_MIN`] bytes or more,
/// unless `CKPT_TEST_COPY_RANGE` says otherwise (for the tests comparing outputs, and
/// to measure the threshold): `off` writes every part from its bytes (the fallback
/// path), a number is the least length copied by the kernel (`1`: every part that lies
/// in a file, so that small test files take the kernel path).
fn kernel_copy_min() -> Option<usize> {
    static MIN: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| match std::env::var("CKPT_TEST_COPY_RANGE") {
        Ok(v) if v == "off" => None,
        Ok(v) => Some(v.parse().unwrap_or(KERNEL_COPY_MIN)),
        Err(_) => Some(KERNEL_COPY_MIN),
    })
}

/// [`StagedFile::write_parts_at`] into a file that is not staged (an OCDBT database's
/// data file, committed by its manifest): long runs of input files copied by the
/// kernel, the others from their bytes.
///
/// # Errors
/// I/O errors, with `path`.
pub(crate) fn write_parts_to(
    file: &File,
    path: &Path,
    parts: &[WritePart<'_>],
    offset: u64,
) -> Result<()> {
    write_parts_all_at(file, parts, offset, kernel_copy_min()).at(path)
}

/// Writes `parts` one after the other from `offset`: long parts of input files by
/// [`copy_file_range_at`], the others (and whatever the kernel would not copy) from
/// their bytes by [`write_all_vectored_at`].
fn write_parts_all_at(
    file: &File,
    parts: &[WritePart<'_>],
    offset: u64,
    kernel_min: Option<usize>,
) -> std::io::Result<()> {
    let mut batch: Vec<&[u8]> = Vec::new();
    let (mut batch_at, mut at) = (offset, offset);
    for p in parts {
        let len = p.bytes.len();
        let from = p.from.filter(|_| kernel_min.is_some_and(|min| len >= min));
        let Some((src, src_at)) = from else {
            batch.push(p.bytes);
            at += len as u64;
            continue;
        };
        write_all_vectored_at(file, &batch, batch_at)?;
        batch.clear();
        let copied = copy_file_range_at(src, src_at, file, at, len);
        if copied < len {
            write_all_vectored_at(file, &[&p.bytes[copied..]], at + copied as u64)?;
        }
        at += len as u64;
        batch_at = at;
    }
    write_all_vectored_at(file, &batch, batch_at)
}

/// Copies `len` bytes at `src_at` of `src` to `dst_at` of `dst` in the kernel, without
/// passing them through this process; returns how many it copied. It stops at the first
/// error of any kind (another file system, `EXDEV`; a kernel or file system without the
/// call, `ENOSYS`/`EOPNOTSUPP`/`EINVAL`; a sandbox refusing it, `EPERM`; or a real I/O
/// error) and at an input shorter than its mapping: the caller writes the rest from the
/// mapped bytes, which either works or fails with the error that names the problem (a
/// truncated input faults in this process, where the SIGBUS handler names it).
fn copy_file_range_at(src: &File, src_at: u64, dst: &File, dst_at: u64, len: usize) -> usize {
    use std::os::fd::AsRawFd;
    let mut done = 0;
    while done < len {
        let (Ok(mut off_in), Ok(mut off_out)) = (
            libc::loff_t::try_from(src_at + done as u64),
            libc::loff_t::try_from(dst_at + done as u64),
        ) else {
            break;
        };
        // SAFETY: plain file descriptors that outlive the call, and offsets owned here;
        // the kernel reads and writes the files, never this process's memory.
        let r = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                len - done,
                0,
            )
        };
        if r < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if r <= 0 {
            break;
        }
        done += r as usize;
    }
    done
}

/// Removes a staged file that will not be committed.
pub(crate) fn discard_staged_file(tmp: &Path) {
    let _ = std::fs::remove_file(tmp);
    crate::fault::unregister_temp(tmp);
}

/// Bytes written to an output between two requests to start writing them out.
const WRITEBACK_EVERY: u64 = 64 << 20;

/// An output file being written under a temporary name beside its destination: it
/// appears at `dest` complete, on [`StagedFile::commit`], or not at all (dropped
/// without a commit, it is removed). Every format's writer writes through one.
///
/// In an output at a URL, its writes are also reported to the storage layer, which
/// uploads each part of the file once it is whole ([`ckpt_storage::FileStream`]).
#[derive(Debug)]
pub(crate) struct StagedFile {
    tmp: PathBuf,
    dest: PathBuf,
    file: File,
    committed: bool,
    /// Bytes written since the page cache was last asked to start writing them out.
    unflushed: std::sync::atomic::AtomicU64,
    stream: Option<ckpt_storage::FileStream>,
}

impl StagedFile {
    /// Creates the temporary file for `dest` (see [`create_staged_file`]).
    pub(crate) fn create(dest: &Path) -> Result<StagedFile> {
        let (tmp, file) = create_staged_file(dest)?;
        let stream = ckpt_storage::stream_file(dest, &file);
        Ok(StagedFile {
            tmp,
            dest: dest.to_path_buf(),
            file,
            committed: false,
            unflushed: std::sync::atomic::AtomicU64::new(0),
            stream,
        })
    }

    /// Counts `n` bytes written, and every [`WRITEBACK_EVERY`] bytes asks the kernel to
    /// start writing the file's dirty pages to the disk (`sync_file_range` with
    /// `SYNC_FILE_RANGE_WRITE`: it starts the I/O and does not wait for it). Otherwise the
    /// kernel starts only when dirty pages pass its background threshold (a tenth of
    /// memory by default, more than most outputs), so the whole file would be written
    /// out by the commit's `fsync`, after the copy, instead of while it runs.
    fn written(&self, offset: u64, n: u64, rewritable: bool) -> Result<()> {
        use std::sync::atomic::Ordering;
        if let Some(s) = &self.stream {
            // Its pages go to the bucket and are released, not written to this disk.
            return Ok(s.written(offset, n, rewritable)?);
        }
        let before = self.unflushed.fetch_add(n, Ordering::Relaxed);
        if before + n >= WRITEBACK_EVERY && before < WRITEBACK_EVERY {
            self.unflushed.store(0, Ordering::Relaxed);
            // Advice only: an error (a file system without it) changes nothing.
            // SAFETY: a valid descriptor; no memory is passed.
            unsafe {
                libc::sync_file_range(
                    std::os::fd::AsRawFd::as_raw_fd(&self.file),
                    0,
                    0,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
        }
        Ok(())
    }

    /// The final name.
    pub(crate) fn dest(&self) -> &Path {
        &self.dest
    }

    pub(crate) fn set_len(&self, len: u64) -> Result<()> {
        if let Some(s) = &self.stream {
            s.resized(len);
        }
        self.file.set_len(len).at(&self.tmp)
    }

    pub(crate) fn write_at(&self, bytes: &[u8], offset: u64) -> Result<()> {
        self.file.write_all_at(bytes, offset).at(&self.tmp)?;
        self.written(offset, bytes.len() as u64, false)
    }

    /// [`StagedFile::write_at`] of bytes the writer writes again before it commits (a
    /// header it patches at its finish): in an output at a URL their parts are uploaded
    /// only at the end.
    pub(crate) fn write_rewritable_at(&self, bytes: &[u8], offset: u64) -> Result<()> {
        self.file.write_all_at(bytes, offset).at(&self.tmp)?;
        self.written(offset, bytes.len() as u64, true)
    }

    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if let Some(s) = &self.stream {
            s.readable(offset, buf.len() as u64)?;
        }
        self.file.read_exact_at(buf, offset).at(&self.tmp)
    }

    /// Writes `parts` one after the other from `offset`: the copy engine hands over
    /// runs still in the inputs' mappings, so the only copy of the bytes is the
    /// kernel's into the page cache: for long runs from the input file's own cached
    /// pages (`copy_file_range`, which costs less CPU than copying from the mapping),
    /// for the others from the mapping, with as few `pwritev` calls as the limit of
    /// 1024 buffers per call allows.
    pub(crate) fn write_parts_at(&self, parts: &[WritePart<'_>], offset: u64) -> Result<()> {
        write_parts_all_at(&self.file, parts, offset, kernel_copy_min()).at(&self.tmp)?;
        self.written(
            offset,
            parts.iter().map(|p| p.bytes.len() as u64).sum(),
            false,
        )
    }

    /// Syncs the data and renames the file to its final name.
    pub(crate) fn commit(mut self) -> Result<()> {
        commit_staged_file(&self.file, &self.tmp, &self.dest)?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        if !self.committed {
            discard_staged_file(&self.tmp);
            if let Some(s) = &self.stream {
                s.discard();
            }
        }
    }
}

/// Writes a small file atomically (temporary name, sync, rename).
///
/// # Errors
/// I/O errors, with the path.
pub fn write_file_atomic(dest: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_name(dest);
    let result = (|| {
        let f = File::create(&tmp).at(&tmp)?;
        f.write_all_at(bytes, 0).at(&tmp)?;
        f.sync_all().at(&tmp)?;
        std::fs::rename(&tmp, dest).at(dest)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` written to `dir/name`, opened read-only as an input is.
    fn input(dir: &Path, name: &str, bytes: &[u8]) -> File {
        std::fs::write(dir.join(name), bytes).unwrap();
        File::open(dir.join(name)).unwrap()
    }

    fn output(dir: &Path) -> File {
        File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.join("out"))
            .unwrap()
    }

    /// The input file's bytes differ from the bytes its parts carry, so the output shows
    /// which path wrote each part: the kernel's copy (the file's) or the write (the part's).
    #[test]
    fn long_parts_of_files_are_copied_by_the_kernel_the_others_written_from_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let disk: Vec<u8> = (0..300u32).map(|i| (i * 7 % 251) as u8).collect();
        let src = input(dir.path(), "in", &disk);
        let mem = vec![0xaa; 300];
        let parts = [
            WritePart {
                bytes: &mem[..100],
                from: Some((&src, 0)),
            },
            WritePart {
                bytes: &mem[100..110],
                from: Some((&src, 100)),
            },
            WritePart::from(&mem[110..200]),
            WritePart {
                bytes: &mem[200..300],
                from: Some((&src, 200)),
            },
        ];
        let out = output(dir.path());
        write_parts_all_at(&out, &parts, 5, Some(50)).unwrap();
        let mut want = vec![0; 5];
        want.extend_from_slice(&disk[..100]);
        want.extend_from_slice(&mem[100..200]);
        want.extend_from_slice(&disk[200..]);
        assert_eq!(std::fs::read(dir.path().join("out")).unwrap(), want);
        // Without the kernel copy every part is written from its bytes.
        write_parts_all_at(&out, &parts, 5, None).unwrap();
        assert_eq!(std::fs::read(dir.path().join("out")).unwrap()[5..], mem[..]);
    }

    #[test]
    fn what_the_kernel_does_not_copy_is_written_from_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let disk = vec![1u8; 100];
        let mem = vec![2u8; 100];
        // Not open for reading: copy_file_range fails (EBADF) and copies nothing.
        input(dir.path(), "in", &disk);
        let unreadable = File::options()
            .write(true)
            .open(dir.path().join("in"))
            .unwrap();
        // Shorter than its part claims (truncated after mapping): copied up to its end.
        let short = input(dir.path(), "short", &disk[..60]);
        let out = output(dir.path());
        let part = |f| WritePart {
            bytes: &mem,
            from: Some((f, 0)),
        };
        write_parts_all_at(&out, &[part(&unreadable), part(&short)], 0, Some(1)).unwrap();
        let mut want = mem.clone();
        want.extend_from_slice(&disk[..60]);
        want.extend_from_slice(&mem[60..]);
        assert_eq!(std::fs::read(dir.path().join("out")).unwrap(), want);
    }
}

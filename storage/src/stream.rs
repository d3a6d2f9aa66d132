//! Output files uploaded while they are written: each full part of a staged file goes up
//! as a part of its multipart upload as soon as every byte of it has been written, and
//! its local copy is then released (a hole punched in the staged file), so an output at
//! a URL takes about the parts still being written on local disk, not its whole size,
//! and the uploads run during the copy instead of after it.
//!
//! The writers do not know: ckpt-core's staged files report their writes here
//! ([`stream_file`], [`FileStream`]). The rules that keep this exact:
//! - a part is sent only once every byte of it has been written (an interval set per
//!   part, so a byte written twice is not counted twice);
//! - bytes a writer marks as rewritable (headers it patches at its finish) keep their
//!   parts local until the publish, which sends them then;
//! - a part written again after it was sent is sent again at the publish, from its
//!   local copy, which is released only when no write came after the send; a write to
//!   (or read of) a released part is refused as an error, never served from the hole;
//! - the upload is created, and its journal put beside the output, before its first
//!   part is sent, so a killed run leaves nothing the next run cannot find and abort.
//!
//! What is not a full part when the writer is done (the last part, rewritten parts,
//! parts of files that were never written through a staged file) is sent by
//! [`crate::Output::publish`], which completes every upload.

use crate::error::{Error, Result};
use crate::location::ObjectUrl;
use crate::store::{block_on, runtime, Store};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutPayload};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Parts in flight while the writers write (memory: this many parts of
/// [`PART_BYTES`]; fewer than the publish's [`crate::UPLOADS`], since the reads'
/// buffers are in use at the same time).
pub const STREAM_UPLOADS: usize = 3;

/// Bytes per uploaded part (S3 takes 5 MiB to 5 GiB, up to 10 000 parts: 16 MiB parts
/// reach 156 GiB per file; larger files get larger parts: [`part_bytes`]).
pub const PART_BYTES: u64 = 16 << 20;

/// The outputs being streamed by this process.
static STREAMS: RwLock<Vec<Arc<Streaming>>> = RwLock::new(Vec::new());
/// How many of them there are, for [`upload_buffer_bytes`].
static STREAMING: AtomicU64 = AtomicU64::new(0);

/// Memory the uploads of the outputs being streamed may take, which the reads' budget
/// leaves to them ([`crate::paged`]): twice their parts in flight. Measured on a 921 MB
/// reshard from a bucket to a bucket: with 4 parts in flight and only they counted, the
/// peak RSS was 234 to 267 MB; with 3 counted twice, 192 to 210 MB in the same time.
pub(crate) fn upload_buffer_bytes() -> u64 {
    STREAMING
        .load(Ordering::Relaxed)
        .saturating_mul(2 * STREAM_UPLOADS as u64 * PART_BYTES)
}
/// Temporary directories that become another path when complete (ckpt-core's staged
/// directories): a file written under one is streamed under its final name.
static ALIASES: RwLock<Vec<(PathBuf, PathBuf)>> = RwLock::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Says that the directory `tmp` is being built to become `dest` (renamed into place
/// when complete), so files written under it are streamed to `dest`'s keys.
pub fn alias_dir(tmp: &Path, dest: &Path) {
    ALIASES
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((tmp.to_path_buf(), dest.to_path_buf()));
}

/// Forgets an [`alias_dir`] (the directory was renamed into place or removed).
pub fn unalias_dir(tmp: &Path) {
    ALIASES
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .retain(|(t, _)| t != tmp);
}

/// The final path of `path`, through the aliases of the directories above it.
fn final_path(path: &Path) -> PathBuf {
    let aliases = ALIASES
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut p = path.to_path_buf();
    // Nested staged directories: resolve until no alias applies.
    for _ in 0..aliases.len() {
        let Some((tmp, dest)) = aliases.iter().find(|(t, _)| p.starts_with(t)) else {
            break;
        };
        let rest = p.strip_prefix(tmp).unwrap_or(Path::new("")).to_path_buf();
        p = if rest.as_os_str().is_empty() {
            dest.clone()
        } else {
            dest.join(rest)
        };
    }
    p
}

/// What happened to one part of a file.
#[derive(Debug, Clone, Default)]
enum Sent {
    /// Not sent (yet).
    #[default]
    No,
    /// Its request is in flight.
    Sending,
    /// Sent, and its local copy kept (written again while it was being sent).
    Kept(PartId),
    /// Sent, and its local copy released.
    Released(PartId),
}

#[derive(Debug, Default)]
struct Part {
    /// Written byte ranges within the part, sorted and disjoint.
    written: Vec<(u64, u64)>,
    /// Holds bytes the writer may rewrite: sent only by the publish.
    pinned: bool,
    /// Written again after its send started.
    dirty: bool,
    sent: Sent,
}

impl Part {
    /// Bytes of the part written.
    fn covered(&self) -> u64 {
        self.written.iter().map(|(s, e)| e - s).sum()
    }

    /// Adds `[lo, hi)` and returns the bytes it newly covers.
    fn add(&mut self, lo: u64, hi: u64) -> u64 {
        let before = self.covered();
        let mut merged = Vec::with_capacity(self.written.len() + 1);
        let (mut a, mut b) = (lo, hi);
        for &(s, e) in &self.written {
            if e < a || s > b {
                merged.push((s, e));
            } else {
                a = a.min(s);
                b = b.max(e);
            }
        }
        merged.push((a, b));
        merged.sort_unstable();
        self.written = merged;
        self.covered() - before
    }
}

#[derive(Debug, Default)]
struct FileState {
    /// Bytes per part: fixed when the first part is sent.
    part: u64,
    /// The length the writer set (`set_len`), which sizes the parts of large files.
    size_hint: u64,
    parts: HashMap<u64, Part>,
    /// The multipart upload, once created.
    upload: Option<String>,
    /// Dropped without being committed (or replaced by a later file of the same name):
    /// its upload is aborted, never completed.
    discarded: bool,
}

/// One staged file of a streamed output.
#[derive(Debug)]
struct StreamedFile {
    local: PathBuf,
    key: Key,
    /// The staged file, for reading parts back and releasing them.
    file: File,
    state: Mutex<FileState>,
    /// Held while the file's multipart upload is being created.
    creating: Mutex<()>,
}

/// Every upload of one output at a URL.
pub(crate) struct Streaming {
    url: ObjectUrl,
    store: Arc<Store>,
    mp: Arc<dyn MultipartStore>,
    /// The output's local path (a file or a directory) that the writers write.
    local: PathBuf,
    /// The process writing (0 for the CLI, the rank for Python's ranks): its journals'
    /// names.
    writer: u64,
    /// Handed over to the publish ([`Streaming::finish`]): not to be abandoned.
    finished: AtomicBool,
    files: Mutex<Vec<Arc<StreamedFile>>>,
    slots: Arc<tokio::sync::Semaphore>,
    failure: Mutex<Option<Error>>,
    failed: AtomicBool,
    journals: Mutex<Vec<Key>>,
    /// Bytes written to the staged files and not released, and the most there were.
    held: AtomicU64,
    peak: AtomicU64,
    sent: AtomicU64,
}

impl std::fmt::Debug for Streaming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streaming")
            .field("url", &self.url.to_string())
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// The files written under a local directory, streamed to an output at a URL while they
/// are written: for a process that stages its part of an output itself (a rank of
/// Python's `save_state_dict`, then [`crate::stage_files`]). Dropped without being
/// handed to [`crate::stage_files`], its uploads are aborted.
#[derive(Debug)]
pub struct Stream(pub(crate) Arc<Streaming>);

impl Stream {
    /// Streams the files written under `local` (the local copy of the output at `url`,
    /// a directory) as the writer `writer` (the rank: its journals' names). `None` for a
    /// store without multipart uploads (its files are sent whole when staged).
    ///
    /// # Errors
    /// A bad or read-only URL; no client for the store.
    pub fn start(local: &Path, url: &Path, writer: u64) -> Result<Option<Stream>> {
        let url = ObjectUrl::parse(url)?;
        let store = crate::store::store_for(&url)?;
        Ok(Streaming::start(&url, store, local, writer).map(Stream))
    }

    /// Aborts what was sent, unless the uploads were handed over.
    pub fn abandon(&self) {
        self.0.abandon();
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// What the publish needs of one streamed file.
#[derive(Debug)]
pub(crate) struct StreamedUpload {
    pub(crate) upload: String,
    pub(crate) part: u64,
    /// Parts sent whose uploaded bytes are final, by part index.
    pub(crate) done: HashMap<u64, PartId>,
    /// Parts that were sent and released: they cannot be sent again.
    pub(crate) released: std::collections::HashSet<u64>,
}

impl Streaming {
    /// Starts streaming the files written under `local` to `url`, registered so that
    /// [`stream_file`] finds it.
    pub(crate) fn start(
        url: &ObjectUrl,
        store: Arc<Store>,
        local: &Path,
        writer: u64,
    ) -> Option<Arc<Self>> {
        let mp = store.multipart.clone()?;
        let s = Arc::new(Streaming {
            url: url.clone(),
            store,
            mp,
            local: local.to_path_buf(),
            writer,
            finished: AtomicBool::new(false),
            files: Mutex::new(Vec::new()),
            slots: Arc::new(tokio::sync::Semaphore::new(STREAM_UPLOADS)),
            failure: Mutex::new(None),
            failed: AtomicBool::new(false),
            journals: Mutex::new(Vec::new()),
            held: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            sent: AtomicU64::new(0),
        });
        STREAMS
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(s.clone());
        STREAMING.fetch_add(1, Ordering::Relaxed);
        Some(s)
    }

    /// Stops finding this output for new files.
    pub(crate) fn unregister(self: &Arc<Self>) {
        let mut streams = STREAMS
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = streams.len();
        streams.retain(|s| !Arc::ptr_eq(s, self));
        if streams.len() < before {
            STREAMING.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn shown(&self, key: &Key) -> String {
        format!("{}/{}", self.url.root(), key)
    }

    fn fail(&self, e: Error) {
        let mut f = lock(&self.failure);
        if f.is_none() {
            *f = Some(e);
        }
        self.failed.store(true, Ordering::Release);
    }

    /// The first failure of an upload, if any (taken: reported once).
    fn take_failure(&self) -> Result<()> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        Err(lock(&self.failure)
            .take()
            .unwrap_or_else(|| Error::Request {
                url: self.url.to_string(),
                detail: "an upload of this output failed".into(),
            }))
    }

    /// Waits for every part in flight; then the first failure, if any.
    fn drain(&self) -> Result<()> {
        let all = u32::try_from(STREAM_UPLOADS).unwrap_or(u32::MAX);
        if let Ok(p) = block_on(self.slots.clone().acquire_many_owned(all)) {
            drop(p);
        }
        self.take_failure()
    }

    /// Waits for the parts in flight and hands over what the publish completes, by
    /// object key; the uploads of discarded files are aborted. No new file is streamed
    /// after this.
    pub(crate) fn finish(self: &Arc<Self>) -> Result<HashMap<String, StreamedUpload>> {
        self.unregister();
        self.finished.store(true, Ordering::Release);
        self.drain()?;
        let mut out = HashMap::new();
        let mut abort = Vec::new();
        for f in lock(&self.files).iter() {
            let st = lock(&f.state);
            let Some(upload) = st.upload.clone() else {
                continue;
            };
            if st.discarded {
                abort.push((f.key.clone(), upload));
                continue;
            }
            let mut done = HashMap::new();
            let mut released = std::collections::HashSet::new();
            for (&k, p) in &st.parts {
                match &p.sent {
                    Sent::Released(id) => {
                        released.insert(k);
                        done.insert(k, id.clone());
                    }
                    Sent::Kept(id) if !p.dirty => {
                        done.insert(k, id.clone());
                    }
                    _ => {}
                }
            }
            out.insert(
                f.key.as_ref().to_string(),
                StreamedUpload {
                    upload,
                    part: st.part,
                    done,
                    released,
                },
            );
        }
        block_on(async {
            for (key, id) in abort {
                let _ = self.mp.abort_multipart(&key, &id).await;
            }
        });
        if std::env::var_os("CKPT_UPLOAD_TRACE").is_some() {
            let hwm = std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("VmHWM:"))
                        .map(|l| l["VmHWM:".len()..].trim().to_string())
                })
                .unwrap_or_default();
            eprintln!(
                "ckpt: streamed {} parts while writing; staged bytes on local disk at most {}; peak RSS before the publish {hwm}",
                self.sent.load(Ordering::Relaxed),
                self.peak.load(Ordering::Relaxed)
            );
        }
        Ok(out)
    }

    /// The journals of the streamed uploads (deleted by the publish when done).
    pub(crate) fn journals(&self) -> Vec<Key> {
        lock(&self.journals).clone()
    }

    /// Gives up unless [`Streaming::finish`] handed the uploads over: waits for the parts
    /// in flight, aborts every upload and deletes the journals.
    fn abandon(self: &Arc<Self>) {
        self.unregister();
        if self.finished.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.drain();
        let uploads: Vec<(Key, String)> = lock(&self.files)
            .iter()
            .filter_map(|f| lock(&f.state).upload.clone().map(|u| (f.key.clone(), u)))
            .collect();
        let journals = self.journals();
        block_on(async {
            for (key, id) in uploads {
                let _ = self.mp.abort_multipart(&key, &id).await;
            }
            for j in journals {
                let _ = self.store.objects.delete(&j).await;
            }
        });
    }

    /// The object key of the local file `path` (its final path), if it lies in this
    /// output.
    fn key_of(&self, path: &Path) -> Option<Key> {
        if path == self.local {
            return Some(Key::from(self.url.key()));
        }
        let rel = path.strip_prefix(&self.local).ok()?;
        let rel = rel.to_string_lossy().replace('\\', "/");
        Some(Key::from(format!("{}/{rel}", self.url.key())))
    }

    /// Creates `f`'s multipart upload and puts its journal, once.
    fn ensure_upload(&self, f: &StreamedFile) -> Result<String> {
        if let Some(u) = lock(&f.state).upload.clone() {
            return Ok(u);
        }
        // Two threads completing two parts of one file at once must not make two uploads
        // (the state's lock is not held across the request).
        let _one = lock(&f.creating);
        if let Some(u) = lock(&f.state).upload.clone() {
            return Ok(u);
        }
        let id = block_on(self.mp.create_multipart(&f.key))
            .map_err(|e| Error::from_store(&self.shown(&f.key), e))?;
        let n = {
            let mut j = lock(&self.journals);
            let key = crate::journal::stream_journal_key(&self.url, self.writer, j.len());
            j.push(key.clone());
            key
        };
        let journal = crate::journal::journal_text(&[(f.key.as_ref(), Some(id.as_str()))], true);
        if let Err(e) = block_on(self.store.objects.put(&n, PutPayload::from(journal))) {
            let _ = block_on(self.mp.abort_multipart(&f.key, &id));
            return Err(Error::from_store(&self.shown(&n), e));
        }
        lock(&f.state).upload = Some(id.clone());
        Ok(id)
    }

    /// Sends part `k` of `f` (the writer's thread waits for a free slot: the
    /// back-pressure that bounds memory and local disk).
    fn send(self: &Arc<Self>, f: &Arc<StreamedFile>, k: u64, part: u64) -> Result<()> {
        self.take_failure()?;
        let permit = block_on(self.slots.clone().acquire_owned()).map_err(|_| Error::Request {
            url: self.url.to_string(),
            detail: "the upload slots were closed".into(),
        })?;
        let id = self.ensure_upload(f)?;
        let mut buf = vec![0u8; usize::try_from(part).unwrap_or(usize::MAX)];
        std::os::unix::fs::FileExt::read_exact_at(&f.file, &mut buf, k * part).map_err(|e| {
            Error::Io {
                path: f.local.clone(),
                source: e,
            }
        })?;
        let (s, f) = (self.clone(), f.clone());
        runtime().spawn(async move {
            let got =
                s.mp.put_part(&f.key, &id, k as usize, PutPayload::from(buf))
                    .await;
            match got {
                Ok(pid) => {
                    s.sent.fetch_add(1, Ordering::Relaxed);
                    let mut st = lock(&f.state);
                    let p = st.parts.entry(k).or_default();
                    if p.dirty {
                        p.sent = Sent::Kept(pid);
                    } else {
                        p.sent = Sent::Released(pid);
                        p.written = Vec::new();
                        release(&f.file, k * part, part);
                        s.held.fetch_sub(part, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    lock(&f.state).parts.entry(k).or_default().sent = Sent::No;
                    s.fail(Error::from_store(&s.shown(&f.key), e));
                }
            }
            drop(permit);
        });
        Ok(())
    }
}

/// Gives the disk blocks of `[at, at + len)` back (the bytes read as zeros after).
fn release(file: &File, at: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(at), Ok(len)) = (libc::off_t::try_from(at), libc::off_t::try_from(len)) else {
        return;
    };
    // Best effort: a file system without hole punching keeps the blocks, which costs
    // disk, not correctness (a released part is never read or written again).
    // SAFETY: a valid descriptor; no memory is passed.
    unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            at,
            len,
        );
    }
}

/// A staged output file whose writes are reported, so that its full parts go up while
/// the rest is written (see the module's description).
#[derive(Debug)]
pub struct FileStream {
    stream: Arc<Streaming>,
    file: Arc<StreamedFile>,
}

/// The stream for a staged file being written at `dest` (its final local name, or a
/// name under a directory given to [`alias_dir`]), when `dest` belongs to an output at a
/// URL; `file` is the staged file.
#[must_use]
pub fn stream_file(dest: &Path, file: &File) -> Option<FileStream> {
    let streams = STREAMS
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if streams.is_empty() {
        return None;
    }
    let path = final_path(dest);
    let (stream, key) = streams
        .iter()
        .find_map(|s| s.key_of(&path).map(|k| (s.clone(), k)))?;
    let file = Arc::new(StreamedFile {
        local: path,
        key,
        file: file.try_clone().ok()?,
        state: Mutex::new(FileState::default()),
        creating: Mutex::new(()),
    });
    {
        let mut files = lock(&stream.files);
        // A file written again under the same name replaces the earlier one.
        for old in files.iter().filter(|f| f.key == file.key) {
            lock(&old.state).discarded = true;
        }
        files.push(file.clone());
    }
    Some(FileStream { stream, file })
}

impl FileStream {
    /// The writer set the file's length (the part size follows it for large files).
    pub fn resized(&self, len: u64) {
        lock(&self.file.state).size_hint = len;
    }

    /// `[offset, offset + len)` was written; `rewritable`: the writer may write these
    /// bytes again before it is done (their parts stay local until the publish). Full
    /// parts are sent; the caller may wait for a free upload slot.
    ///
    /// # Errors
    /// A write into a part already released (a writer that wrote bytes twice without
    /// saying so); a failed upload of this output.
    pub fn written(&self, offset: u64, len: u64, rewritable: bool) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let mut ready = Vec::new();
        let part;
        {
            let mut st = lock(&self.file.state);
            if st.part == 0 {
                st.part = part_bytes(st.size_hint);
            }
            part = st.part;
            let end = offset
                .checked_add(len)
                .ok_or_else(|| self.error("write past 2^64 bytes"))?;
            let mut added = 0;
            for k in offset / part..=(end - 1) / part {
                let (lo, hi) = (
                    offset.max(k * part) - k * part,
                    end.min((k + 1) * part) - k * part,
                );
                let p = st.parts.entry(k).or_default();
                match p.sent {
                    Sent::Released(_) => {
                        return Err(self.error(&format!(
                            "bytes {offset}..{end} written after part {k} was uploaded and released"
                        )))
                    }
                    Sent::Sending | Sent::Kept(_) => p.dirty = true,
                    Sent::No => {}
                }
                p.pinned |= rewritable;
                added += p.add(lo, hi);
                if p.covered() == part && !p.pinned && matches!(p.sent, Sent::No) {
                    p.sent = Sent::Sending;
                    ready.push(k);
                }
            }
            let held = self.stream.held.fetch_add(added, Ordering::Relaxed) + added;
            self.stream.peak.fetch_max(held, Ordering::Relaxed);
        }
        for k in ready {
            if let Err(e) = self.stream.send(&self.file, k, part) {
                lock(&self.file.state).parts.entry(k).or_default().sent = Sent::No;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Refuses a read of released bytes (they are in the bucket now, not on disk).
    ///
    /// # Errors
    /// The range touches a released part.
    pub fn readable(&self, offset: u64, len: u64) -> Result<()> {
        let st = lock(&self.file.state);
        if st.part == 0 || len == 0 {
            return Ok(());
        }
        let end = offset.saturating_add(len);
        for k in offset / st.part..=(end - 1) / st.part {
            if let Some(Part {
                sent: Sent::Released(_),
                ..
            }) = st.parts.get(&k)
            {
                return Err(self.error(&format!(
                    "bytes {offset}..{end} read back after part {k} was uploaded and released"
                )));
            }
        }
        Ok(())
    }

    /// The staged file was dropped without being committed: its upload is aborted.
    pub fn discard(&self) {
        lock(&self.file.state).discarded = true;
    }

    fn error(&self, what: &str) -> Error {
        Error::Io {
            path: self.file.local.clone(),
            source: std::io::Error::other(format!(
                "{what} (streaming to {})",
                self.stream.shown(&self.file.key)
            )),
        }
    }
}

/// Bytes per part of a file of (about) `size` bytes: [`PART_BYTES`], or more
/// where that would need over 10 000 parts.
pub(crate) fn part_bytes(size: u64) -> u64 {
    PART_BYTES.max(size.div_ceil(10_000).next_multiple_of(1 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use std::os::unix::fs::FileExt;

    const P: u64 = PART_BYTES;

    /// A streamed output `s3://b/out` kept in memory, written at `dir/out`.
    fn streaming(dir: &Path) -> (Arc<Streaming>, Arc<Store>, ObjectUrl) {
        let mem = Arc::new(InMemory::new());
        let store = Arc::new(Store {
            objects: mem.clone(),
            multipart: Some(mem),
        });
        let url = ObjectUrl::parse(Path::new("s3://b/out")).unwrap();
        let s = Streaming::start(&url, store.clone(), &dir.join("out"), 0).unwrap();
        (s, store, url)
    }

    fn new_file(path: &Path) -> File {
        File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .unwrap()
    }

    fn pattern(len: u64, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    /// Writes `bytes` at `at` in the file and reports it.
    fn write(f: &File, s: &FileStream, bytes: &[u8], at: u64, rewritable: bool) -> Result<()> {
        f.write_all_at(bytes, at).unwrap();
        s.written(at, bytes.len() as u64, rewritable)
    }

    fn sent(f: &FileStream) -> Vec<(u64, &'static str)> {
        let st = lock(&f.file.state);
        let mut v: Vec<(u64, &'static str)> = st
            .parts
            .iter()
            .map(|(&k, p)| {
                let what = match p.sent {
                    Sent::No => "no",
                    Sent::Sending => "sending",
                    Sent::Kept(_) => "kept",
                    Sent::Released(_) => "released",
                };
                (k, what)
            })
            .collect();
        v.sort_unstable();
        v
    }

    fn object(store: &Store, key: &str) -> Vec<u8> {
        block_on(async {
            store
                .objects
                .get(&Key::from(key))
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
        })
        .to_vec()
    }

    fn publish(s: &Arc<Streaming>, store: &Arc<Store>, url: &ObjectUrl, local: &Path) {
        let done = s.finish().unwrap();
        crate::publish::publish_tree(store, url, local, false, false, &done, &s.journals())
            .unwrap();
    }

    #[test]
    fn whole_parts_go_up_while_the_file_is_written_and_leave_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let (s, store, url) = streaming(dir.path());
        let local = dir.path().join("out");
        let f = new_file(&local);
        let fs = stream_file(&local, &f).unwrap();
        let data = pattern(2 * P + P / 2, 7);
        // Out of order and in uneven pieces: part 1 first, then part 0 in two halves
        // (written twice where they overlap), then the tail.
        write(&f, &fs, &data[P as usize..2 * P as usize], P, false).unwrap();
        write(&f, &fs, &data[..(P / 2 + 10) as usize], 0, false).unwrap();
        let now = sent(&fs);
        assert_eq!(now[0], (0, "no"));
        assert!(
            now[1] == (1, "sending") || now[1] == (1, "released"),
            "{now:?}"
        );
        write(&f, &fs, &data[(P / 2) as usize..P as usize], P / 2, false).unwrap();
        write(&f, &fs, &data[2 * P as usize..], 2 * P, false).unwrap();
        s.drain().unwrap();
        assert_eq!(sent(&fs), vec![(0, "released"), (1, "released"), (2, "no")]);
        // Released: the hole reads as zeros, and the stream refuses to serve it.
        let mut back = vec![1u8; 64];
        f.read_exact_at(&mut back, 100).unwrap();
        assert_eq!(back, vec![0u8; 64]);
        let e = fs.readable(100, 64).unwrap_err().to_string();
        assert!(
            e.contains("read back after part 0 was uploaded and released"),
            "{e}"
        );
        let e = fs.written(P + 5, 1, false).unwrap_err().to_string();
        assert!(
            e.contains("written after part 1 was uploaded and released"),
            "{e}"
        );
        assert!(e.contains("s3://b/out"), "{e}");
        // The journal names the upload before the publish, for a killed run's clean-up.
        let journals = s.journals();
        assert_eq!(journals.len(), 1);
        let j: serde_json::Value =
            serde_json::from_slice(&object(&store, journals[0].as_ref())).unwrap();
        assert_eq!(j["objects"][0]["key"], "out");
        assert_eq!(j["objects"][0]["abort_only"], true);
        publish(&s, &store, &url, &local);
        assert!(
            object(&store, "out") == data,
            "the object is the bytes written"
        );
        assert!(
            block_on(store.objects.head(&journals[0])).is_err(),
            "journal left"
        );
    }

    #[test]
    fn parts_written_again_or_marked_rewritable_go_up_at_the_publish() {
        let dir = tempfile::tempdir().unwrap();
        let (s, store, url) = streaming(dir.path());
        let local = dir.path().join("out");
        std::fs::create_dir(&local).unwrap();
        let path = local.join("model.safetensors");
        let f = new_file(&path);
        let fs = stream_file(&path, &f).unwrap();
        fs.resized(3 * P);
        let mut data = pattern(3 * P, 3);
        // A header the writer patches at its finish: its part stays.
        write(&f, &fs, &data[..100], 0, true).unwrap();
        write(&f, &fs, &data[100..], 100, false).unwrap();
        s.drain().unwrap();
        assert_eq!(sent(&fs), vec![(0, "no"), (1, "released"), (2, "released")]);
        data[..100].copy_from_slice(&pattern(100, 99));
        write(&f, &fs, &data[..100], 0, true).unwrap();
        // A part written again once its send has started is kept and sent again.
        let mut st = lock(&fs.file.state);
        st.parts.get_mut(&2).unwrap().sent = Sent::Sending;
        st.parts.get_mut(&2).unwrap().written = vec![(0, P)];
        drop(st);
        data[(2 * P) as usize..(2 * P + 3) as usize].copy_from_slice(b"new");
        // (the released local copy of part 2 is gone: put the bytes back as a writer
        // that kept them would have them)
        f.write_all_at(&data[(2 * P) as usize..], 2 * P).unwrap();
        fs.written(2 * P, 3, false).unwrap();
        lock(&fs.file.state).parts.get_mut(&2).unwrap().sent = Sent::Kept(PartId {
            content_id: "stale".into(),
        });
        // A file dropped uncommitted: its upload is aborted, never completed.
        let other = local.join("gone.bin");
        let g = new_file(&other);
        let gs = stream_file(&other, &g).unwrap();
        write(&g, &gs, &pattern(P, 1), 0, false).unwrap();
        gs.discard();
        std::fs::remove_file(&other).unwrap();
        publish(&s, &store, &url, &local);
        assert!(object(&store, "out/model.safetensors") == data);
        assert!(block_on(store.objects.head(&Key::from("out/gone.bin"))).is_err());
    }

    #[test]
    fn files_of_staged_directories_stream_under_their_final_names() {
        let dir = tempfile::tempdir().unwrap();
        let (s, store, url) = streaming(dir.path());
        let local = dir.path().join("out");
        let tmp = dir.path().join(".out.tmp-1-1");
        std::fs::create_dir_all(tmp.join("ckpt_0")).unwrap();
        alias_dir(&tmp, &local);
        let path = tmp.join("ckpt_0/a.safetensors");
        let f = new_file(&path);
        let fs = stream_file(&path, &f).unwrap();
        assert_eq!(fs.file.key.as_ref(), "out/ckpt_0/a.safetensors");
        let data = pattern(P + 1, 5);
        write(&f, &fs, &data, 0, false).unwrap();
        std::fs::rename(&tmp, &local).unwrap();
        unalias_dir(&tmp);
        publish(&s, &store, &url, &local);
        assert!(object(&store, "out/ckpt_0/a.safetensors") == data);
        // A path outside every streamed output is not streamed.
        let elsewhere = dir.path().join("elsewhere");
        assert!(stream_file(&elsewhere, &f).is_none());
    }

    #[test]
    fn parts_follow_the_size_of_large_files() {
        assert_eq!(part_bytes(0), P);
        assert_eq!(part_bytes(100 * P), P);
        let big = 400u64 << 30;
        let p = part_bytes(big);
        assert!(
            p > P && big.div_ceil(p) <= 10_000 && p.is_multiple_of(1 << 20),
            "{p}"
        );
    }
}

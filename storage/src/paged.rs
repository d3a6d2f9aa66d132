//! Demand paging of remote objects: a placeholder mapped as anonymous memory whose
//! pages the kernel asks this module for on first touch (Linux `userfaultfd`), so that
//! every reader and the copy engine read an object in a bucket through a mapping, as
//! they read a local file, without learning that it is remote.
//!
//! - A fault at an address starts a stream of the object from the block (4 MiB) that
//!   holds it: ranged requests of a segment (64 MiB) each, read as the bytes arrive,
//!   each block installed (and its waiting threads woken) as soon as it is complete,
//!   the next segment requested when one ends. A reader going through an object in
//!   order therefore costs one request per segment, whatever the block size: some
//!   S3-compatible servers read the whole object to answer any ranged request, so
//!   many small requests would cost them the object each time.
//! - A stream reads ahead only while the resident and in-flight blocks of all objects
//!   together stay under [`BUDGET_BYTES`]; past it, it stops before a block no thread
//!   waits for (a later touch starts it again), and delivers only the blocks threads
//!   wait on. The copy engine releases what it has consumed (a block all of whose pages
//!   are consumed is dropped at once), so a streaming merge reads each byte once.
//!   Over the budget all the same (every resident block still to be read), the least
//!   recently filled blocks are dropped (`MADV_DONTNEED`); a later touch fetches them
//!   again.
//! - A stream broken off is started again from the block it had reached, up to the
//!   store's retry count; a block the store cannot give then ends the process (exit 1)
//!   with the object named: the thread that touched the page waits inside the kernel
//!   and cannot be handed an error ([`crate::set_fatal_hook`] removes the temporaries).
//! - `userfaultfd` needs Linux and, for the kernel's own reads of such pages (a write
//!   to a file from the mapping), `CAP_SYS_PTRACE` or `vm.unprivileged_userfaultfd=1`;
//!   where it cannot be had, or `CKPT_REMOTE_PAGING=0`, [`Paged::map`] says so and
//!   callers download the object into its placeholder instead
//!   ([`crate::materialize`]).

use crate::mirror::RemoteObject;
use crate::store::{fatal, runtime};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use userfaultfd::{Event, Uffd, UffdBuilder};

/// The unit pages are installed and dropped in.
pub const BLOCK_BYTES: u64 = 4 << 20;
/// Bytes asked for per request (streamed, installed block by block).
pub const SEGMENT_BYTES: u64 = 64 << 20;
/// Resident plus in-flight bytes of all paged objects together.
pub const BUDGET_BYTES: u64 = 192 << 20;
/// Attempts at a segment whose stream breaks off (each resuming where it stopped).
const STREAM_ATTEMPTS: u32 = 4;

const PAGE: u64 = 4096;

/// A remote object mapped read-only, its pages fetched on demand.
pub struct Paged {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Paged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Paged({})", self.inner.object.url)
    }
}

struct Inner {
    object: Arc<RemoteObject>,
    base: usize,
    /// The mapping's length (the object's, rounded up to pages).
    len: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Set when the mapping is being unmapped: late fetches are dropped.
    closed: bool,
    resident: BTreeSet<u64>,
    /// Blocks a stream has claimed and will install (or unclaim when it stops).
    claimed: BTreeSet<u64>,
    /// Claimed blocks a thread waits on: a stream never stops before these.
    awaited: BTreeSet<u64>,
    /// Pages of resident blocks released by their reader (a bit a page).
    released: BTreeMap<u64, Vec<u64>>,
}

impl Inner {
    fn blocks(&self) -> u64 {
        self.object.size.div_ceil(BLOCK_BYTES)
    }

    fn block_range(&self, k: u64) -> std::ops::Range<u64> {
        k * BLOCK_BYTES..((k + 1) * BLOCK_BYTES).min(self.object.size)
    }

    /// Bytes the mapping gives block `k` (its object bytes rounded up to pages).
    fn mapped_len(&self, k: u64) -> usize {
        let r = self.block_range(k);
        ((r.end - r.start).div_ceil(PAGE) * PAGE) as usize
    }
}

/// The process's one `userfaultfd`, its fault thread, and the budget.
struct Pager {
    uffd: Uffd,
    /// Live mappings by base address.
    maps: Mutex<BTreeMap<usize, Weak<Inner>>>,
    /// Filled blocks, least recently filled first, with the bytes they hold.
    lru: Mutex<(VecDeque<(Weak<Inner>, u64)>, u64)>,
}

fn pager() -> Option<&'static Pager> {
    static PAGER: OnceLock<Option<&'static Pager>> = OnceLock::new();
    *PAGER.get_or_init(|| {
        if std::env::var("CKPT_REMOTE_PAGING").is_ok_and(|v| v == "0") {
            return None;
        }
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .create()
            .ok()?;
        let pager: &'static Pager = Box::leak(Box::new(Pager {
            uffd,
            maps: Mutex::new(BTreeMap::new()),
            lru: Mutex::new((VecDeque::new(), 0)),
        }));
        std::thread::Builder::new()
            .name("ckpt-pager".into())
            .spawn(move || pager.serve())
            .ok()?;
        Some(pager)
    })
}

/// Whether remote objects are demand-paged in this process (else they are downloaded
/// into their placeholders before being read).
#[must_use]
pub fn available() -> bool {
    pager().is_some()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Paged {
    /// Maps `object` for demand paging; `None` where paging is not available.
    #[must_use]
    pub fn map(object: &Arc<RemoteObject>) -> Option<Paged> {
        let pager = pager()?;
        let len = (object.size.div_ceil(PAGE) * PAGE) as usize;
        if len == 0 {
            return None;
        }
        // SAFETY: a fresh private anonymous mapping, owned by the returned value.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        if pager.uffd.register(base, len).is_err() {
            // SAFETY: the mapping made above, never handed out.
            unsafe { libc::munmap(base, len) };
            return None;
        }
        let inner = Arc::new(Inner {
            object: object.clone(),
            base: base as usize,
            len,
            state: Mutex::new(State::default()),
        });
        lock(&pager.maps).insert(base as usize, Arc::downgrade(&inner));
        Some(Paged { inner })
    }

    /// The object's bytes (each page fetched on first touch).
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes at `base` are mapped for as long as `self` lives; the
        // object's first `size` bytes never change (a page dropped and fetched again
        // holds the same bytes).
        unsafe {
            std::slice::from_raw_parts(
                self.inner.base as *const u8,
                self.inner.object.size as usize,
            )
        }
    }

    /// The object.
    #[must_use]
    pub fn object(&self) -> &Arc<RemoteObject> {
        &self.inner.object
    }

    /// Marks bytes `range` consumed; a block all of whose pages are consumed is
    /// dropped, leaving the budget to the blocks still to come. (A copy reads each byte
    /// once, but the pieces it reads are not aligned to blocks: counted by pages.)
    pub fn release(&self, range: std::ops::Range<u64>) {
        if range.is_empty() {
            return;
        }
        let inner = &self.inner;
        let (first, last) = (range.start / BLOCK_BYTES, (range.end - 1) / BLOCK_BYTES);
        let mut done = Vec::new();
        {
            let mut st = lock(&inner.state);
            for k in first..=last {
                // Marked whether or not the block is there now (pages of headers are
                // released before their block is first fetched); kept when it is
                // dropped: consumed bytes stay consumed.
                let base = k * BLOCK_BYTES;
                let pages = (inner.mapped_len(k) as u64) / PAGE;
                let bits = st
                    .released
                    .entry(k)
                    .or_insert_with(|| vec![0u64; pages.div_ceil(64) as usize]);
                let lo = (range.start.max(base) - base) / PAGE;
                let hi = ((range.end.min(base + BLOCK_BYTES) - base).div_ceil(PAGE)).min(pages);
                for p in lo..hi {
                    bits[(p / 64) as usize] |= 1 << (p % 64);
                }
                let all = (0..pages).all(|p| bits[(p / 64) as usize] & (1 << (p % 64)) != 0);
                if all && st.resident.contains(&k) {
                    done.push(k);
                }
            }
        }
        for k in done {
            drop_block(inner, k);
        }
    }
}

impl Drop for Paged {
    fn drop(&mut self) {
        lock(&self.inner.state).closed = true;
        if let Some(p) = pager() {
            lock(&p.maps).remove(&self.inner.base);
            let _ = p.uffd.unregister(self.inner.base as *mut _, self.inner.len);
            let mut lru = lock(&p.lru);
            let mut freed = 0;
            let me = Arc::as_ptr(&self.inner);
            lru.0.retain(|(w, k)| {
                let mine = w.as_ptr() == me;
                if mine {
                    freed += self.inner.mapped_len(*k) as u64;
                }
                !mine
            });
            lru.1 -= freed.min(lru.1);
        }
        // SAFETY: the mapping made by `map`; no reference to it outlives `self`.
        unsafe { libc::munmap(self.inner.base as *mut _, self.inner.len) };
    }
}

/// Drops block `k` of `inner` if resident.
fn drop_block(inner: &Inner, k: u64) {
    let mut st = lock(&inner.state);
    if st.closed || !st.resident.remove(&k) {
        return;
    }
    let at = inner.base + (k * BLOCK_BYTES) as usize;
    // SAFETY: inside the mapping; anonymous private pages dropped are faulted in again
    // (through the pager) on the next touch.
    unsafe { libc::madvise(at as *mut _, inner.mapped_len(k), libc::MADV_DONTNEED) };
    drop(st);
    if let Some(p) = pager() {
        let mut lru = lock(&p.lru);
        let me = inner as *const Inner;
        if let Some(i) = lru.0.iter().position(|(w, b)| w.as_ptr() == me && *b == k) {
            lru.0.remove(i);
            lru.1 -= (inner.mapped_len(k) as u64).min(lru.1);
        }
    }
}

impl Pager {
    /// The fault thread: each fault asks for its block (and the blocks after it).
    fn serve(&'static self) {
        let fd = self.uffd.as_raw_fd();
        loop {
            let mut poll = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut poll, 1, -1) } < 0 {
                continue;
            }
            while let Ok(Some(event)) = self.uffd.read_event() {
                if let Event::Pagefault { addr, .. } = event {
                    self.fault(addr as usize);
                }
            }
        }
    }

    fn fault(&'static self, addr: usize) {
        let inner = {
            let maps = lock(&self.maps);
            maps.range(..=addr)
                .next_back()
                .and_then(|(_, w)| w.upgrade())
                .filter(|i| addr < i.base + i.len)
        };
        let Some(inner) = inner else {
            return;
        };
        let k = ((addr - inner.base) as u64) / BLOCK_BYTES;
        {
            let mut st = lock(&inner.state);
            if st.resident.contains(&k) {
                // Filled between the fault and now: wake the thread waiting.
                let at = inner.base + (k * BLOCK_BYTES) as usize;
                let _ = self.uffd.wake(at as *mut _, inner.mapped_len(k));
                return;
            }
            st.awaited.insert(k);
            if st.claimed.contains(&k) {
                // A stream is on its way to it.
                return;
            }
        }
        if trace() {
            eprintln!("ckpt-pager: stream {} from block {k}", inner.object.url);
        }
        runtime().spawn(self.stream_from(inner, k));
    }

    /// Claims the blocks of one segment from `first` (up to the first block resident or
    /// claimed already, and the object's end): the range to ask for, or `None`.
    fn claim(inner: &Inner, first: u64) -> Option<std::ops::Range<u64>> {
        let mut st = lock(&inner.state);
        if st.closed {
            return None;
        }
        let per = SEGMENT_BYTES / BLOCK_BYTES;
        let mut end = first;
        while end < inner.blocks()
            && end < first + per
            && !st.resident.contains(&end)
            && !st.claimed.contains(&end)
        {
            st.claimed.insert(end);
            end += 1;
        }
        (end > first).then_some(first..end)
    }

    /// Waits, before a stream assembles block `k`, while the budget is spent and no
    /// thread waits on a block it claimed from `k` to `claimed_end` (the connection
    /// waits with it: the server holds back what is not read); false once the mapping
    /// is closed.
    async fn room_for(&self, inner: &Inner, k: u64, claimed_end: u64) -> bool {
        loop {
            {
                let st = lock(&inner.state);
                if st.closed {
                    return false;
                }
                if st.awaited.range(k..claimed_end.max(k + 1)).next().is_some()
                    || !self.over_budget()
                {
                    return true;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    fn over_budget(&self) -> bool {
        lock(&self.lru).1 + self.in_flight_bytes() + BLOCK_BYTES > budget()
    }

    /// Streams the object from block `first` on, segment after segment, installing each
    /// block as it completes; ahead of the blocks threads wait on only within the
    /// budget.
    async fn stream_from(&'static self, inner: Arc<Inner>, first: u64) {
        use futures::StreamExt;
        let mut next = first;
        loop {
            // Read ahead into the next segment only with room for it (the first is
            // always awaited).
            if !self.room_for(&inner, next, next + 1).await {
                return;
            }
            let Some(seg) = Self::claim(&inner, next) else {
                return;
            };
            let _buffer = InFlight::block();
            let mut k = seg.start;
            let mut attempts = 0;
            while k < seg.end {
                let bytes = k * BLOCK_BYTES..(seg.end * BLOCK_BYTES).min(inner.object.size);
                let mut stream = match inner.object.stream(bytes).await {
                    Ok(s) => s,
                    Err(e) => fatal(&e.to_string()),
                };
                let mut block = Vec::with_capacity(BLOCK_BYTES as usize);
                let problem = loop {
                    let want = inner.block_range(k);
                    let want = (want.end - want.start) as usize;
                    if block.len() >= want {
                        let rest = block.split_off(want);
                        self.fill(&inner, k, &block);
                        block = rest;
                        k += 1;
                        attempts = 0;
                        if k == seg.end {
                            break None;
                        }
                        if !self.room_for(&inner, k, seg.end).await {
                            return;
                        }
                        continue;
                    }
                    match stream.next().await {
                        Some(Ok(chunk)) => block.extend_from_slice(&chunk),
                        Some(Err(e)) => break Some(e.to_string()),
                        None => {
                            break Some(format!(
                                "the object ended within block {k}: it changed or is shorter than listed ({} bytes)",
                                inner.object.size
                            ))
                        }
                    }
                };
                if let Some(problem) = problem {
                    // Broken off (a dropped connection, a timeout while the budget held
                    // the stream back): again from the block it had reached.
                    attempts += 1;
                    if attempts >= STREAM_ATTEMPTS {
                        fatal(&format!("{}: {problem}", inner.object.url));
                    }
                }
            }
            next = seg.end;
            if next >= inner.blocks() {
                return;
            }
        }
    }

    fn in_flight_bytes(&self) -> u64 {
        IN_FLIGHT.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Copies a fetched block into the mapping (waking the threads waiting on it) and
    /// keeps the budget.
    fn fill(&self, inner: &Arc<Inner>, k: u64, bytes: &[u8]) {
        let len = inner.mapped_len(k);
        let padded;
        let src: &[u8] = if bytes.len() == len {
            bytes
        } else {
            let mut v = vec![0u8; len];
            v[..bytes.len()].copy_from_slice(bytes);
            padded = v;
            &padded
        };
        {
            let mut st = lock(&inner.state);
            st.claimed.remove(&k);
            st.awaited.remove(&k);
            if st.closed {
                return;
            }
            let at = inner.base + (k * BLOCK_BYTES) as usize;
            // SAFETY: `at..at+len` lies in a registered mapping that stays mapped while
            // `closed` is false (checked under the same lock `Drop` takes first).
            let whole = unsafe { self.uffd.copy(src.as_ptr().cast(), at as *mut _, len, true) };
            if whole.map_or(true, |n| n != len) {
                // Some pages are there already (a release dropped part of the block):
                // page by page, leaving those.
                for p in (0..len).step_by(PAGE as usize) {
                    // SAFETY: as above, one page.
                    let _ = unsafe {
                        self.uffd.copy(
                            src[p..].as_ptr().cast(),
                            (at + p) as *mut _,
                            PAGE as usize,
                            false,
                        )
                    };
                }
                let _ = self.uffd.wake(at as *mut _, len);
            }
            st.resident.insert(k);
        }
        if trace() {
            eprintln!("ckpt-pager: {} block {k} in", inner.object.url);
        }
        let mut evict = Vec::new();
        {
            let mut lru = lock(&self.lru);
            lru.0.push_back((Arc::downgrade(inner), k));
            lru.1 += len as u64;
            while lru.1 + self.in_flight_bytes() > budget() && lru.0.len() > 1 {
                let (w, b) = lru.0.pop_front().expect("non-empty");
                if let Some(i) = w.upgrade() {
                    lru.1 -= (i.mapped_len(b) as u64).min(lru.1);
                    evict.push((i, b));
                }
            }
        }
        for (i, b) in evict {
            let mut st = lock(&i.state);
            if !st.closed && st.resident.remove(&b) {
                let at = i.base + (b * BLOCK_BYTES) as usize;
                // SAFETY: inside the live mapping (not closed, under its lock).
                unsafe { libc::madvise(at as *mut _, i.mapped_len(b), libc::MADV_DONTNEED) };
            }
        }
    }
}

/// Bytes of the blocks streams are assembling (one block a stream).
static IN_FLIGHT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A stream's block buffer, counted in [`IN_FLIGHT`] while it lives.
struct InFlight;

impl InFlight {
    fn block() -> InFlight {
        IN_FLIGHT.fetch_add(BLOCK_BYTES, std::sync::atomic::Ordering::Relaxed);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(BLOCK_BYTES, std::sync::atomic::Ordering::Relaxed);
    }
}

/// [`BUDGET_BYTES`], or `CKPT_PAGER_BUDGET_MB` where set.
fn budget() -> u64 {
    static B: OnceLock<u64> = OnceLock::new();
    *B.get_or_init(|| {
        std::env::var("CKPT_PAGER_BUDGET_MB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(BUDGET_BYTES, |mb| mb << 20)
    })
}

/// `CKPT_PAGER_TRACE=1`: each fetch said on stderr (for tuning and benchmarks).
fn trace() -> bool {
    static T: OnceLock<bool> = OnceLock::new();
    *T.get_or_init(|| std::env::var("CKPT_PAGER_TRACE").is_ok_and(|v| v == "1"))
}

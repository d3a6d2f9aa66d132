//! Demand paging of remote objects: a placeholder mapped as anonymous memory whose
//! pages the kernel asks this module for on first touch (Linux `userfaultfd`), so that
//! every reader and the copy engine read an object in a bucket through a mapping, as
//! they read a local file, without learning that it is remote.
//!
//! - A fault at an address starts a stream of the object from the block (1 MiB) that
//!   holds it: ranged requests of a segment (up to 1 GiB) each, read as the bytes arrive,
//!   each block installed (and its waiting threads woken) as soon as it is complete,
//!   the next segment requested when one ends. A reader going through an object in
//!   order therefore costs one request per segment, whatever the block size: some
//!   S3-compatible servers read the whole object to answer any ranged request, so
//!   many small requests would cost them the object each time.
//! - A stream reads ahead only while the resident and in-flight blocks of all objects
//!   together stay under half of [`BUDGET_BYTES`]; past it, it stops before a block no thread
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
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use userfaultfd::{Event, Uffd, UffdBuilder};

/// The unit pages are installed and dropped in (small, so that the blocks a copy has
/// begun but not finished, one or two per object it streams from, hold little).
pub const BLOCK_BYTES: u64 = 1 << 20;
/// Bytes asked for per request at most (streamed, installed block by block, the
/// request's end cut short when a stream stops): large, since each request costs some
/// servers a read of the whole object (1 GiB: 6.5 s against 9.3 s for 64 MiB on the
/// 1.2 GB benchmark against moto).
pub const SEGMENT_BYTES: u64 = 1 << 30;
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

/// The blocks a stream is to install: `pos` next, up to `end` (lowered when a thread
/// waits on a block far ahead, which a stream of its own then serves).
#[derive(Clone, Copy)]
struct Claim {
    pos: u64,
    end: u64,
}

/// Blocks ahead of a stream's position within which a thread waiting is served by
/// that stream rather than a new one.
const NEAR_BLOCKS: u64 = 32;
/// The read-ahead window of an object nothing has consumed yet ([`State::window`]).
const INITIAL_WINDOW_BLOCKS: u64 = 4;

#[derive(Default)]
struct State {
    /// Set when the mapping is being unmapped: late fetches are dropped.
    closed: bool,
    resident: BTreeSet<u64>,
    /// The streams of this object by id: each installs blocks `pos..end` in order
    /// (its claim), then claims the next segment or ends.
    streams: BTreeMap<u64, Claim>,
    next_stream: u64,
    /// Claimed blocks a thread waits on: a stream never stops before these.
    awaited: BTreeSet<u64>,
    /// Bytes of each block released by their readers: disjoint, sorted, merged
    /// intervals relative to the block's start.
    released: BTreeMap<u64, Vec<(u64, u64)>>,
    /// One past the last block a reader has reached (touched and found missing, or
    /// consumed whole): streams read ahead of it by at most the window.
    frontier: u64,
    /// The read-ahead window, in blocks: [`INITIAL_WINDOW_BLOCKS`] (0 here: not yet
    /// set), doubled at each fault (a reader that outran the stream, or jumped).
    window: u64,
}

impl State {
    /// The stream whose claim holds block `k`.
    fn claimant(&self, k: u64) -> Option<u64> {
        self.streams
            .iter()
            .find(|(_, c)| c.pos <= k && k < c.end)
            .map(|(&id, _)| id)
    }

    /// The end of a segment from `k`: at most `per` blocks, stopping before a block
    /// resident or claimed and at the object's end (`blocks`).
    fn free_end(&self, k: u64, per: u64, blocks: u64) -> u64 {
        let mut end = k;
        while end < blocks
            && end < k + per
            && !self.resident.contains(&end)
            && self.claimant(end).is_none()
        {
            end += 1;
        }
        end
    }

    /// Whether a stream at block `pos` may read on without a reader waiting: within
    /// the window of the frontier and within the object's share of the read-ahead
    /// budget among the streams running. The window starts small and doubles at each
    /// fault (the kernel's read-ahead grows the same way), so that a header read at
    /// open fetches a few blocks, not half the budget: opening a checkpoint's files one
    /// by one let the first object's stream fill the budget, and the copy, reading
    /// every file abreast (DCP's sharded safetensors), then got the other objects'
    /// blocks one fault at a time until that object was consumed.
    fn may_read_ahead(&self, pos: u64, share: u64) -> bool {
        let window = self
            .window
            .max(INITIAL_WINDOW_BLOCKS)
            .min(share / BLOCK_BYTES);
        pos < self.frontier.saturating_add(window.max(1))
    }

    /// A reader reached block `k`.
    fn reached(&mut self, k: u64) {
        self.frontier = self.frontier.max(k + 1);
    }

    fn add_stream(&mut self, pos: u64, end: u64) -> u64 {
        let id = self.next_stream;
        self.next_stream += 1;
        self.streams.insert(id, Claim { pos, end });
        id
    }
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
    lru: Mutex<FilledBlocks>,
}

/// Filled blocks (mapping, block index), least recently filled first, and the bytes
/// they hold together.
type FilledBlocks = (VecDeque<(Weak<Inner>, u64)>, u64);

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

    /// Marks bytes `range` consumed; a block all of whose bytes are consumed is dropped,
    /// leaving the budget to the blocks still to come. Counted by bytes, not pages: the
    /// pieces a copy reads share pages with their neighbours, and a block dropped while
    /// a neighbour is still to be read would be fetched again (a new request, which some
    /// servers answer by reading the whole object).
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
                // Marked whether or not the block is there now (headers are released
                // before their block is first fetched); kept when it is dropped:
                // consumed bytes stay consumed.
                let block = inner.block_range(k);
                let lo = range.start.max(block.start) - block.start;
                let hi = range.end.min(block.end) - block.start;
                let spans = st.released.entry(k).or_default();
                add_span(spans, lo, hi);
                let whole = spans.as_slice() == [(0, block.end - block.start)];
                if whole && st.resident.contains(&k) {
                    done.push(k);
                }
            }
        }
        for k in done {
            if trace() {
                eprintln!("ckpt-pager: {} block {k} consumed", inner.object.url);
            }
            // Forgotten once dropped: a second reader of the same bytes fetches the
            // block again, which then stays until read whole again (or evicted) rather
            // than being dropped under another thread still reading it.
            {
                let mut st = lock(&inner.state);
                st.released.remove(&k);
                st.reached(k);
            }
            drop_block(inner, k);
        }
    }
}

/// Adds `lo..hi` to the sorted, disjoint intervals `spans`, merging what touches it.
fn add_span(spans: &mut Vec<(u64, u64)>, lo: u64, hi: u64) {
    let (mut lo, mut hi) = (lo, hi);
    let mut out = Vec::with_capacity(spans.len() + 1);
    let mut placed = false;
    for &(a, b) in spans.iter() {
        if b < lo {
            out.push((a, b));
        } else if hi < a {
            if !placed {
                out.push((lo, hi));
                placed = true;
            }
            out.push((a, b));
        } else {
            lo = lo.min(a);
            hi = hi.max(b);
        }
    }
    if !placed {
        out.push((lo, hi));
    }
    *spans = out;
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
        let id = {
            let mut st = lock(&inner.state);
            if st.resident.contains(&k) {
                // Filled between the fault and now: wake the thread waiting.
                let at = inner.base + (k * BLOCK_BYTES) as usize;
                let _ = self.uffd.wake(at as *mut _, inner.mapped_len(k));
                return;
            }
            st.awaited.insert(k);
            st.reached(k);
            st.window = st.window.max(INITIAL_WINDOW_BLOCKS / 2).saturating_mul(2);
            match st.claimant(k) {
                Some(id) if k < st.streams[&id].pos + NEAR_BLOCKS => return,
                Some(id) => {
                    // Far ahead of the stream that claimed it: that stream stops
                    // before it, and a new one reads from it to the old end.
                    let claim = st.streams.get_mut(&id).expect("claimant");
                    let end = claim.end;
                    claim.end = k;
                    st.add_stream(k, end)
                }
                None => {
                    let end = st.free_end(k, segment_bytes() / BLOCK_BYTES, inner.blocks());
                    st.add_stream(k, end)
                }
            }
        };
        if trace() {
            eprintln!("ckpt-pager: stream {} from block {k}", inner.object.url);
        }
        runtime().spawn(self.stream(inner, id));
    }

    /// Waits, before a stream installs its next block, while the read-ahead budget is
    /// spent and no thread waits on a block of its claim (the connection waits with
    /// it: the server holds back what is not read). The claim, or `None` once the
    /// mapping is closed or the claim is gone.
    async fn room_for(&self, inner: &Inner, id: u64) -> Option<Claim> {
        loop {
            {
                let st = lock(&inner.state);
                if st.closed {
                    return None;
                }
                let c = *st.streams.get(&id)?;
                let share = budget() / 2 / STREAMS.load(Ordering::Relaxed).max(1);
                if c.pos >= c.end
                    || st.awaited.range(c.pos..c.end).next().is_some()
                    || !self.over_budget() && st.may_read_ahead(c.pos, share)
                {
                    return Some(c);
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Whether reading ahead would pass half the budget: the other half is kept for
    /// the blocks threads wait on, so that they need not push out blocks in use.
    fn over_budget(&self) -> bool {
        lock(&self.lru).1 + self.in_flight_bytes() + BLOCK_BYTES > budget() / 2
    }

    /// Stream `id` of `inner`: installs the blocks of its claim in order, from one ranged
    /// request (again from where it broke off, if it does), then claims the next
    /// segment while there is room, until the object's end or a block resident or
    /// claimed already. Its claim is removed when it ends.
    async fn stream(&'static self, inner: Arc<Inner>, id: u64) {
        STREAMS.fetch_add(1, Ordering::Relaxed);
        self.stream_claim(&inner, id).await;
        lock(&inner.state).streams.remove(&id);
        STREAMS.fetch_sub(1, Ordering::Relaxed);
    }

    async fn stream_claim(&'static self, inner: &Arc<Inner>, id: u64) {
        use futures::StreamExt;
        let _buffer = InFlight::block();
        let mut attempts = 0;
        loop {
            let Some(mut c) = self.room_for(inner, id).await else {
                return;
            };
            if c.pos >= c.end {
                // The claim is done: the next segment, if there is room for it (the
                // first was awaited) and nothing else holds it.
                let mut st = lock(&inner.state);
                let end = st.free_end(c.pos, segment_bytes() / BLOCK_BYTES, inner.blocks());
                if end == c.pos {
                    return;
                }
                st.streams.insert(id, Claim { pos: c.pos, end });
                c.end = end;
            }
            let bytes = c.pos * BLOCK_BYTES..(c.end * BLOCK_BYTES).min(inner.object.size);
            let mut body = match inner.object.stream(bytes).await {
                Ok(s) => s,
                Err(e) => fatal(&e.to_string()),
            };
            let mut k = c.pos;
            let mut block = Vec::with_capacity(BLOCK_BYTES as usize);
            let problem = loop {
                let want = inner.block_range(k);
                let want = (want.end - want.start) as usize;
                if block.len() >= want {
                    self.fill(inner, id, k, &block[..want]);
                    // The rest (part of one body chunk) to the front, the buffer's
                    // capacity kept: a new buffer per block grew by doubling, copying
                    // each byte about twice more.
                    block.drain(..want);
                    k += 1;
                    attempts = 0;
                    {
                        let st = lock(&inner.state);
                        let Some(claim) = st.streams.get(&id) else {
                            return;
                        };
                        if k >= claim.end {
                            // This request's part of the claim is done (or the claim
                            // was cut short by a stream of its own ahead).
                            break None;
                        }
                    }
                    if self.room_for(inner, id).await.is_none() {
                        return;
                    }
                    continue;
                }
                match body.next().await {
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
    }

    fn in_flight_bytes(&self) -> u64 {
        IN_FLIGHT.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Copies a fetched block into the mapping (waking the threads waiting on it) and
    /// keeps the budget.
    fn fill(&self, inner: &Arc<Inner>, id: u64, k: u64, bytes: &[u8]) {
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
            st.awaited.remove(&k);
            // The stream's claim moves past `k` under the same lock that makes it
            // resident: a fault in between would otherwise find `k` neither resident
            // nor behind the stream, and wait for a stream that has gone on.
            if let Some(claim) = st.streams.get_mut(&id) {
                claim.pos = claim.pos.max(k + 1);
            }
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
            if trace() {
                eprintln!(
                    "ckpt-pager: {} block {b} evicted (consumed {:?})",
                    i.object.url,
                    st.released.get(&b)
                );
            }
            if !st.closed && st.resident.remove(&b) {
                let at = i.base + (b * BLOCK_BYTES) as usize;
                // SAFETY: inside the live mapping (not closed, under its lock).
                unsafe { libc::madvise(at as *mut _, i.mapped_len(b), libc::MADV_DONTNEED) };
            }
        }
    }
}

/// Streams running, over all objects: each object's read-ahead is at most its share
/// of the budget among them.
static STREAMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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
    let whole = *B.get_or_init(|| {
        std::env::var("CKPT_PAGER_BUDGET_MB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(BUDGET_BYTES, |mb| mb << 20)
    });
    // The parts of outputs going up while they are written share the process's memory
    // with the reads (reshard from a bucket to a bucket: 262 MB peak RSS without this,
    // 204 to 222 MB with it, in the same time).
    whole
        .saturating_sub(crate::stream::upload_buffer_bytes())
        .max(whole / 4)
}

/// [`SEGMENT_BYTES`], or `CKPT_SEGMENT_MB` where set (for tuning against a store).
fn segment_bytes() -> u64 {
    static S: OnceLock<u64> = OnceLock::new();
    *S.get_or_init(|| {
        std::env::var("CKPT_SEGMENT_MB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&mb| mb > 0)
            .map_or(SEGMENT_BYTES, |mb| mb << 20)
    })
}

/// `CKPT_PAGER_TRACE=1`: each fetch said on stderr (for tuning and benchmarks).
fn trace() -> bool {
    static T: OnceLock<bool> = OnceLock::new();
    *T.get_or_init(|| std::env::var("CKPT_PAGER_TRACE").is_ok_and(|v| v == "1"))
}

#[cfg(test)]
mod tests {
    use super::add_span;

    #[test]
    fn spans_merge_into_the_bytes_consumed() {
        let mut s = vec![];
        add_span(&mut s, 10, 20);
        add_span(&mut s, 30, 40);
        assert_eq!(s, [(10, 20), (30, 40)]);
        add_span(&mut s, 0, 5);
        assert_eq!(s, [(0, 5), (10, 20), (30, 40)]);
        // Touching and overlapping spans merge; a page shared by two pieces counts
        // only once both are read.
        add_span(&mut s, 20, 30);
        assert_eq!(s, [(0, 5), (10, 40)]);
        add_span(&mut s, 3, 12);
        assert_eq!(s, [(0, 40)]);
        add_span(&mut s, 50, 60);
        add_span(&mut s, 35, 55);
        assert_eq!(s, [(0, 60)]);
    }
}

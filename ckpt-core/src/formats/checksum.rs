//! Per-tensor checksums: CRC-32C of each tensor's bytes, recorded by every file ckpt
//! writes and checked by every command that reads a tensor whole.
//!
//! CRC-32C because it is hardware-accelerated (SSE 4.2, ARMv8) and, unlike xxh3,
//! combinable: `crc(a ++ b)` follows from `crc(a)`, `crc(b)` and `len(b)`. The copy
//! engine writes a tensor as slabs in parallel and in any order; the writer hashes each
//! slab as it passes and combines them in offset order at the end, so the checksum
//! costs no second pass over the data.

use crate::error::{Error, Result};
use rayon::prelude::*;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

/// Key of `__metadata__` holding the checksums: a JSON object (as a string) mapping
/// each tensor's name to `"crc32c:<8 lowercase hex digits>"`.
pub const CHECKSUMS_KEY: &str = "ckpt.checksums";

/// Bytes hashed at once when checking a stored tensor (then its pages are released).
pub(crate) const CHUNK: usize = 4 << 20;

static ENABLED: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// The setting of the call running on this thread ([`with_checksums`]), which wins
    /// over the process-wide one.
    static SCOPED: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Turns checksums off for this process (neither written nor checked): for measuring
/// what they cost, never for normal use. A library call that takes the setting per call
/// (the Python binding's `checksums=`) uses [`with_checksums`] instead, which touches
/// no other call.
pub fn set_checksums_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Runs `f` with checksums on or off for this call only: the setting is this thread's
/// until `f` returns (restored on unwinding too), so calls on other threads keep
/// theirs. Every place that decides whether to write or check checksums reads the
/// setting on the thread that started the operation, before any work goes to the
/// thread pool (writers capture it when they are created), so the pool's threads need
/// not see it.
pub fn with_checksums<R>(on: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(SCOPED.with(|c| c.replace(Some(on))));
    f()
}

/// Whether checksums are written and checked (the default): this thread's
/// [`with_checksums`] setting if one is running, else the process-wide one.
#[must_use]
pub fn checksums_enabled() -> bool {
    SCOPED
        .with(Cell::get)
        .unwrap_or_else(|| ENABLED.load(Ordering::Relaxed))
}

/// The CRC-32C of a tensor's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Checksum(pub u32);

impl std::fmt::Display for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "crc32c:{:08x}", self.0)
    }
}

impl Checksum {
    /// The checksum of `bytes`, hashed in parallel chunks.
    #[must_use]
    pub fn of(bytes: &[u8]) -> Checksum {
        Checksum::of_chunks(bytes, &|_| {})
    }

    /// The checksum of `bytes`, calling `done(range)` after each chunk is hashed (to
    /// release its pages from a mapping).
    pub(crate) fn of_chunks(
        bytes: &[u8],
        done: &(dyn Fn(std::ops::Range<u64>) + Sync),
    ) -> Checksum {
        // One chunk: no work to share between threads.
        if bytes.len() <= CHUNK {
            let sum = Checksum(crc32c::crc32c(bytes));
            if !bytes.is_empty() {
                done(0..bytes.len() as u64);
            }
            return sum;
        }
        let parts: Vec<(u32, u64)> = bytes
            .par_chunks(CHUNK)
            .enumerate()
            .map(|(i, c)| {
                let crc = crc32c::crc32c(c);
                let lo = (i * CHUNK) as u64;
                done(lo..lo + c.len() as u64);
                (crc, c.len() as u64)
            })
            .collect();
        Checksum::combine(parts.into_iter().map(|(crc, len)| (Checksum(crc), len)))
    }

    /// Joins the checksums of consecutive parts `(checksum, length)` in order.
    #[must_use]
    pub fn combine(parts: impl IntoIterator<Item = (Checksum, u64)>) -> Checksum {
        // The first part is its own checksum (combining it with the empty prefix's 0
        // gives the same): skipping that call matters where tensors are tiny and many,
        // each one part, and a combine costs more than hashing a few hundred bytes.
        let mut parts = parts.into_iter();
        let Some((first, _)) = parts.next() else {
            return Checksum(0);
        };
        Checksum(parts.fold(first.0, |acc, (c, len)| {
            crc32c::crc32c_combine(acc, c.0, len as usize)
        }))
    }

    /// Parses `crc32c:<hex>`.
    ///
    /// # Errors
    /// Any other text.
    pub fn parse(text: &str) -> std::result::Result<Checksum, String> {
        text.strip_prefix("crc32c:")
            .filter(|h| h.len() == 8)
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .map(Checksum)
            .ok_or_else(|| format!("`{text}` is not a checksum (crc32c:<8 hex digits>)"))
    }
}

/// The `__metadata__` value recording `sums` (tensor name to checksum).
#[must_use]
pub(crate) fn encode_checksums(sums: &BTreeMap<String, Checksum>) -> String {
    // The same text as a JSON object built key by key (sorted, compact), without one.
    let texts: BTreeMap<&str, String> = sums
        .iter()
        .map(|(k, v)| (k.as_str(), v.to_string()))
        .collect();
    serde_json::to_string(&texts).unwrap_or_default()
}

/// Reads the value of [`CHECKSUMS_KEY`].
///
/// # Errors
/// Malformed JSON or checksums ([`Error::InvalidHeader`]).
/// A file's recorded checksums: one per tensor in the file's order, or by name.
#[derive(Debug)]
pub(crate) enum Recorded {
    /// The checksum of each tensor (`None`: none recorded), in the file's order.
    ByPosition(Vec<Option<Checksum>>),
    /// By name, where the record does not list exactly the file's tensors in order.
    ByName(BTreeMap<String, Checksum>),
}

/// A checksum read from its text as the JSON is parsed (no string kept).
struct Parsed(Checksum);

impl<'de> serde::Deserialize<'de> for Parsed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = <crate::json::Name<'de>>::deserialize(d)?;
        Checksum::parse(&text.0)
            .map(Parsed)
            .map_err(serde::de::Error::custom)
    }
}

/// The `ckpt.checksums` record `text` of a file whose tensors are `names`: by position
/// when it lists some of those names in their order (ckpt writes both in name order),
/// which takes no map and no copy of a name; otherwise by name ([`decode_checksums`]).
///
/// # Errors
/// As [`decode_checksums`].
pub(crate) fn recorded_checksums<'n>(
    text: &str,
    names: impl ExactSizeIterator<Item = &'n str>,
) -> Result<Recorded> {
    if let Ok(members) = serde_json::from_str::<crate::json::Members<Parsed>>(text) {
        if let Some(sums) = members.in_order_of(names) {
            return Ok(Recorded::ByPosition(
                sums.into_iter().map(|p| p.map(|p| p.0)).collect(),
            ));
        }
    }
    decode_checksums(text).map(Recorded::ByName)
}

pub(crate) fn decode_checksums(text: &str) -> Result<BTreeMap<String, Checksum>> {
    let bad = |problem: String| Error::InvalidHeader { problem };
    // The common case straight into its types; anything else through the checked path
    // below, which says what is wrong.
    if let Ok(sums) = serde_json::from_str::<BTreeMap<String, Parsed>>(text) {
        return Ok(sums
            .into_iter()
            .map(|(name, Parsed(c))| (name, c))
            .collect());
    }
    let doc: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| bad(format!("`{CHECKSUMS_KEY}` is not JSON: {e}")))?;
    let obj = doc
        .as_object()
        .ok_or_else(|| bad(format!("`{CHECKSUMS_KEY}` must be an object")))?;
    obj.iter()
        .map(|(name, v)| {
            let sum = v
                .as_str()
                .ok_or_else(|| "not a string".to_string())
                .and_then(Checksum::parse)
                .map_err(|e| bad(format!("`{CHECKSUMS_KEY}` of tensor `{name}`: {e}")))?;
            Ok((name.clone(), sum))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_setting_is_its_threads_alone_and_restored() {
        assert!(checksums_enabled());
        let other = std::thread::spawn(|| {
            with_checksums(false, || {
                assert!(!checksums_enabled());
                std::thread::sleep(std::time::Duration::from_millis(50));
                assert!(!checksums_enabled());
            });
            checksums_enabled()
        });
        // While the other thread runs with checksums off, this one keeps them on.
        for _ in 0..10 {
            assert!(checksums_enabled());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(other.join().unwrap(), "restored after the call");
        with_checksums(false, || {
            with_checksums(true, || assert!(checksums_enabled()))
        });
        let _ = std::panic::catch_unwind(|| with_checksums(false, || panic!("unwinds")));
        assert!(checksums_enabled(), "restored on unwinding");
    }

    #[test]
    fn parts_combine_to_the_whole() {
        let data: Vec<u8> = (0..3 * CHUNK + 123).map(|i| (i * 31 % 251) as u8).collect();
        let whole = Checksum(crc32c::crc32c(&data));
        assert_eq!(Checksum::of(&data), whole);
        let (a, b) = data.split_at(1000);
        let (b, c) = b.split_at(CHUNK);
        let parts = [a, b, c].map(|p| (Checksum(crc32c::crc32c(p)), p.len() as u64));
        assert_eq!(Checksum::combine(parts), whole);
        assert_eq!(Checksum::of(&[]), Checksum(0));
    }

    #[test]
    fn text_round_trip_and_errors() {
        let sums: BTreeMap<String, Checksum> = [
            ("a".to_string(), Checksum(0xdead_beef)),
            ("b\"x".into(), Checksum(7)),
        ]
        .into();
        let text = encode_checksums(&sums);
        assert_eq!(decode_checksums(&text).unwrap(), sums);
        assert_eq!(Checksum(7).to_string(), "crc32c:00000007");
        let e = decode_checksums(r#"{"w":"crc32c:xyz"}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "invalid safetensors header: `ckpt.checksums` of tensor `w`: `crc32c:xyz` is not a checksum (crc32c:<8 hex digits>)"
        );
    }
}

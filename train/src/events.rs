//! TensorBoard event files: a run's loss, test accuracy and throughput curves, where
//! `tensorboard --logdir` finds them, written scalar by scalar while the run goes.
//!
//! The file is a sequence of TFRecords, each (as TensorBoard's
//! `summary/writer/record_writer.py` and TensorFlow's `core/lib/io/record_writer.cc`
//! write them, little-endian): `u64` length, `u32` masked CRC-32C of those 8 bytes, the
//! data, `u32` masked CRC-32C of the data, where the mask is `((crc >> 15) | (crc <<
//! 17)) + 0xa282ead8`. Each record is an `Event` protobuf (`tensorboard/compat/proto/
//! event.proto`): `wall_time` (1, double), `step` (2, int64), `file_version` (3,
//! string, `brain.Event:2` in the first record) and `summary` (5): a `Summary` of
//! `value`s (1), each a `tag` (1, string) and a `simple_value` (2, float). The messages
//! are declared with prost's derive (already a dependency of ckpt-core) with only the
//! fields written.

use crate::error::{IoContext, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// `tensorboard.Event`, the fields written.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorboard.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `tensorboard.Summary.Value`, a scalar.
#[derive(Clone, PartialEq, prost::Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    // TensorFlow's `((crc >> 15) | (crc << 17)) + 0xa282ead8`, a rotation.
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The `Event` record of one scalar.
fn scalar_event(wall_time: f64, tag: &str, step: i64, value: f32) -> Vec<u8> {
    use prost::Message;
    record(
        &Event {
            wall_time,
            step,
            file_version: None,
            summary: Some(Summary {
                value: vec![Value {
                    tag: tag.to_string(),
                    simple_value: Some(value),
                }],
            }),
        }
        .encode_to_vec(),
    )
}

/// The first record of every event file: `file_version = "brain.Event:2"`.
fn version_event(wall_time: f64) -> Vec<u8> {
    use prost::Message;
    record(
        &Event {
            wall_time,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        }
        .encode_to_vec(),
    )
}

/// Seconds since the epoch, as TensorBoard stamps events.
fn now() -> std::time::Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// The last field of TensorBoard's file names: a counter of the files this process
/// opened (`EventFileWriter`'s `_global_uid`), so that two runs started by one process
/// within a second (library users, tests) do not share a name.
static FILE_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A run's event file, written while the run goes: every scalar is one record appended
/// and handed to the kernel at once, so `tensorboard --logdir` plots the curves during
/// training, and a run killed midway leaves every scalar logged so far.
///
/// The file is written in place, not under a temporary name: it is a log that
/// TensorBoard tails. Each record carries its length and two checksums, so a record cut
/// short by a kill is recognisably incomplete (TensorBoard's reader waits for its end
/// and never shows it), and the records before it stay readable.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates the event file in `dir` (created when missing) under TensorBoard's
    /// naming, `events.out.tfevents.<seconds>.<host>.<pid>.<n>` (the name its loader
    /// looks for), and writes the version record.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).at(dir)?;
        let t = now();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let uid = FILE_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!(
            "events.out.tfevents.{:010}.{host}.{}.{uid}",
            t.as_secs(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .at(&path)?;
        let mut w = EventWriter { path, file };
        w.append(&version_event(t.as_secs_f64()))?;
        Ok(w)
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `value` of `tag` at `step`, stamped now.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn scalar(&mut self, tag: &str, step: i64, value: f32) -> Result<()> {
        self.append(&scalar_event(now().as_secs_f64(), tag, step, value))
    }

    /// One record in one `write` call: `File` has no user-space buffer, so the record
    /// is in the kernel (visible to readers, kept if the process dies) on return.
    fn append(&mut self, record: &[u8]) -> Result<()> {
        self.file.write_all(record).at(&self.path)
    }

    /// Syncs the file to disk at the end of the run; returns its path.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn finish(self) -> Result<PathBuf> {
        self.file.sync_all().at(&self.path)?;
        Ok(self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_frame_and_checksum_their_data() {
        let r = record(b"abc");
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        // CRC-32C of "abc" is 0x364b3fb7 (RFC 3720's polynomial); masked as TFRecord does.
        let crc: u32 = 0x364b_3fb7;
        let masked = crc.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(&r[15..], &masked.to_le_bytes());
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
    }

    /// Splits an event file into its records' data, checking the framing.
    fn records(mut bytes: &[u8]) -> Vec<Event> {
        use prost::Message;
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            assert_eq!(bytes[8..12], masked_crc(&bytes[..8]).to_le_bytes());
            let data = &bytes[12..12 + len];
            assert_eq!(bytes[12 + len..16 + len], masked_crc(data).to_le_bytes());
            out.push(Event::decode(data).unwrap());
            bytes = &bytes[16 + len..];
        }
        out
    }

    #[test]
    fn each_scalar_is_in_the_file_as_soon_as_it_is_logged() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let path = w.path().to_path_buf();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let first = records(&std::fs::read(&path).unwrap());
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].file_version.as_deref(), Some("brain.Event:2"));
        w.scalar("train/loss", 7, 0.25).unwrap();
        // Read before the writer finishes: the scalar is already there.
        let now = records(&std::fs::read(&path).unwrap());
        assert_eq!(now.len(), 2);
        assert_eq!(now[1].step, 7);
        assert!(now[1].wall_time >= first[0].wall_time);
        let v = &now[1].summary.as_ref().unwrap().value[0];
        assert_eq!((v.tag.as_str(), v.simple_value), ("train/loss", Some(0.25)));
        w.scalar("test/accuracy", 1, 0.5).unwrap();
        assert_eq!(w.finish().unwrap(), path);
        assert_eq!(records(&std::fs::read(&path).unwrap()).len(), 3);
        // A second writer in the same directory and second gets its own file.
        let other = EventWriter::create(dir.path()).unwrap();
        assert_ne!(other.path(), path);
    }
}

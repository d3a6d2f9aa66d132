//! TensorBoard event files: a run's loss, test accuracy and throughput curves, where
//! `tensorboard --logdir` finds them.
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

use crate::error::{Error, Result};
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
    ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8)
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

/// Scalars of a run, written as one TensorBoard event file.
#[derive(Clone, Debug, Default)]
pub struct Scalars {
    /// `(tag, step, value)`, in the order written.
    pub points: Vec<(String, i64, f32)>,
}

impl Scalars {
    /// Adds `value` of `tag` at `step`.
    pub fn add(&mut self, tag: &str, step: i64, value: f32) {
        self.points.push((tag.to_string(), step, value));
    }

    /// The event file's bytes: the version record, then one record per point, all
    /// stamped `wall_time` (seconds since the epoch).
    #[must_use]
    pub fn encode(&self, wall_time: f64) -> Vec<u8> {
        use prost::Message;
        let mut out = record(
            &Event {
                wall_time,
                step: 0,
                file_version: Some("brain.Event:2".into()),
                summary: None,
            }
            .encode_to_vec(),
        );
        for (tag, step, v) in &self.points {
            out.extend(record(
                &Event {
                    wall_time,
                    step: *step,
                    file_version: None,
                    summary: Some(Summary {
                        value: vec![Value {
                            tag: tag.clone(),
                            simple_value: Some(*v),
                        }],
                    }),
                }
                .encode_to_vec(),
            ));
        }
        out
    }

    /// Writes the event file into `dir` under TensorBoard's naming
    /// (`events.out.tfevents.<seconds>.<host>.<pid>.0`, the name its loader looks for),
    /// through a temporary name and a rename; returns its path.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{:010}.{host}.{}.0",
            now.as_secs(),
            std::process::id()
        );
        let path = dir.join(name);
        let tmp = dir.join(format!(".{}.tmp", std::process::id()));
        let io = |e: std::io::Error| Error::Io {
            path: path.clone(),
            source: e,
        };
        let bytes = self.encode(now.as_secs_f64());
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok(path)
    }
}

/// The curves of a finished run: `train/loss` and `train/images_per_sec` at every
/// update (global step numbers, so that a resumed run continues the curves), and
/// `test/accuracy` after each epoch, plotted against the epoch number.
#[must_use]
pub fn run_scalars(report: &crate::TrainReport) -> Scalars {
    let mut s = Scalars::default();
    let n = report.losses.len();
    // Images per update, from the run's mean throughput: updates all have the global
    // batch, so each one's throughput is that over its own time.
    let total: f64 = report.step_seconds.iter().sum();
    let per_update = if n > 0 {
        report.images_per_sec * total / n as f64
    } else {
        0.0
    };
    for (i, loss) in report.losses.iter().enumerate() {
        let step = (report.start_step + i as u64 + 1) as i64;
        s.add("train/loss", step, *loss);
        if let Some(&t) = report.step_seconds.get(i) {
            if t > 0.0 {
                s.add("train/images_per_sec", step, (per_update / t) as f32);
            }
        }
    }
    for (epoch, acc) in &report.test_accuracy {
        s.add("test/accuracy", *epoch as i64, *acc);
    }
    s
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
        let masked = ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8);
        assert_eq!(&r[15..], &masked.to_le_bytes());
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
    }

    #[test]
    fn events_decode_back() {
        use prost::Message;
        let mut s = Scalars::default();
        s.add("train/loss", 7, 0.25);
        let bytes = s.encode(1.5);
        let first_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let second = &bytes[16 + first_len..];
        let len = u64::from_le_bytes(second[..8].try_into().unwrap()) as usize;
        let e = Event::decode(&second[12..12 + len]).unwrap();
        assert_eq!(e.step, 7);
        assert_eq!(e.wall_time, 1.5);
        let v = &e.summary.unwrap().value[0];
        assert_eq!((v.tag.as_str(), v.simple_value), ("train/loss", Some(0.25)));
    }
}

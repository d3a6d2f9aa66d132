//! An item's `_sharding`, written: each `jax.Array` leaf's `NamedSharding` (its mesh's
//! shape, axis names and types, device ids, and the partition spec) as orbax-checkpoint
//! 0.12.8 stores it (`NamedShardingMetadata.to_serialized_string`,
//! `_src/metadata/sharding.py`; the file written by tensorstore's `json` driver at
//! `/<base64 of the parameter name>`, `get_sharding_tensorstore_spec`,
//! `_src/serialization/tensorstore_utils.py`). docs/orbax.md, "What ckpt writes".
//!
//! The file is one JSON object, compact with its keys sorted (tensorstore's JSON), whose
//! keys are `base64.urlsafe_b64encode(param_name)` and whose values are strings holding
//! Python's `json.dumps` of the sharding (separators `", "` and `": "`, keys in orbax's
//! order):
//!
//! ```text
//! {"cC53":"{\"sharding_type\": \"NamedSharding\", \"shape\": [2, 4], \"axis_names\": [\"dp\", \"tp\"],
//!   \"axis_types\": [\"AxisType.Auto\", \"AxisType.Auto\"], \"partition_spec\": [\"dp\", [\"tp\"]]...
//! ```

use base64::Engine;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io;

/// The file's name in the item directory (`_SHARDING_FILE_NAME`, `jax_array_handlers.py`).
pub(crate) const SHARDING_FILE: &str = "_sharding";

/// A mesh axis's type as orbax writes `str(jax.sharding.AxisType.Auto)`, the type of
/// every axis of a `jax.sharding.Mesh` made without `axis_types`.
const AUTO: &str = "AxisType.Auto";

/// One entry of a partition spec: the mesh axes one array dimension is split over, in
/// split order (major first), as `PartitionSpec` holds it: `None` for none, the name for
/// one, a tuple for several.
fn spec_entry(axes: &[String]) -> Value {
    match axes {
        [] => Value::Null,
        [one] => Value::String(one.clone()),
        many => Value::Array(many.iter().cloned().map(Value::String).collect()),
    }
}

/// `NamedShardingMetadata` as `to_serialized_string` lays it out (field order kept).
#[derive(Serialize)]
struct Named<'a> {
    sharding_type: &'static str,
    shape: &'a [u64],
    axis_names: Vec<&'a str>,
    axis_types: Vec<&'static str>,
    partition_spec: Vec<Value>,
    device_mesh: DeviceMesh,
}

#[derive(Serialize)]
struct DeviceMesh {
    mesh: Value,
}

/// The device ids of a mesh of `sizes`, nested as the mesh's device array
/// (`devices.tolist()`), ids row-major from 0 (`np.arange(n).reshape(sizes)`, the
/// devices `jax.make_mesh` and `Mesh(np.array(jax.devices()).reshape(...))` use).
fn device_ids(sizes: &[u64], first: &mut u64) -> Value {
    match sizes.split_first() {
        None => {
            let id = *first;
            *first += 1;
            serde_json::json!({ "id": id })
        }
        Some((&n, rest)) => Value::Array((0..n).map(|_| device_ids(rest, first)).collect()),
    }
}

/// Python's `json.dumps` separators: `", "` between items, `": "` after a key.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// One array's `NamedSharding` on the mesh `axes` (name, size; devices row-major),
/// `spec` the axes each dimension is split over (trailing unsplit dimensions may be
/// left out, as `PartitionSpec('tp')` leaves them), serialized as orbax does. The mesh's
/// axis names are ASCII (ckpt's mesh axes are letters, digits and `_`), which Python's
/// `ensure_ascii` leaves as they are.
pub(crate) fn named_sharding(axes: &[(String, u64)], spec: &[Vec<String>]) -> String {
    let sizes: Vec<u64> = axes.iter().map(|a| a.1).collect();
    let named = Named {
        sharding_type: "NamedSharding",
        shape: &sizes,
        axis_names: axes.iter().map(|a| a.0.as_str()).collect(),
        axis_types: vec![AUTO; axes.len()],
        partition_spec: spec.iter().map(|a| spec_entry(a)).collect(),
        device_mesh: DeviceMesh {
            mesh: device_ids(&sizes, &mut 0),
        },
    };
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
    // Serializing strings, numbers and lists into a Vec cannot fail.
    let _ = named.serialize(&mut ser);
    String::from_utf8(out).unwrap_or_default()
}

/// The `_sharding` file for `arrays` (parameter name, serialized sharding).
pub(crate) fn sharding_file<'a>(arrays: impl IntoIterator<Item = (&'a str, String)>) -> String {
    let b64 = base64::engine::general_purpose::URL_SAFE;
    let doc: BTreeMap<String, String> = arrays
        .into_iter()
        .map(|(name, s)| (b64.encode(name.as_bytes()), s))
        .collect();
    serde_json::to_string(&doc).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What orbax 0.12.8 wrote (jax 0.10.2, 8 CPU devices) for
    /// `{"p": {"a": P("dp", "tp"), "b": P(("dp", "tp"))}, "c": P(None), "d": P("tp")}`
    /// on `Mesh(devices.reshape(2, 4), ("dp", "tp"))`, byte for byte.
    #[test]
    fn as_orbax_writes_it() {
        let axes = [("dp".to_string(), 2), ("tp".to_string(), 4)];
        let s = |v: &[&[&str]]| -> Vec<Vec<String>> {
            v.iter()
                .map(|d| d.iter().map(|a| a.to_string()).collect())
                .collect()
        };
        let file = sharding_file([
            ("c", named_sharding(&axes, &s(&[&[]]))),
            ("d", named_sharding(&axes, &s(&[&["tp"]]))),
            ("p.a", named_sharding(&axes, &s(&[&["dp"], &["tp"]]))),
            ("p.b", named_sharding(&axes, &s(&[&["dp", "tp"]]))),
        ]);
        let mesh = r#"\"shape\": [2, 4], \"axis_names\": [\"dp\", \"tp\"], \"axis_types\": [\"AxisType.Auto\", \"AxisType.Auto\"]"#;
        let devices = r#"\"device_mesh\": {\"mesh\": [[{\"id\": 0}, {\"id\": 1}, {\"id\": 2}, {\"id\": 3}], [{\"id\": 4}, {\"id\": 5}, {\"id\": 6}, {\"id\": 7}]]}"#;
        let entry = |key: &str, spec: &str| {
            format!(
                r#""{key}":"{{\"sharding_type\": \"NamedSharding\", {mesh}, \"partition_spec\": {spec}, {devices}}}""#
            )
        };
        let want = format!(
            "{{{},{},{},{}}}",
            entry("Yw==", "[null]"),
            entry("ZA==", r#"[\"tp\"]"#),
            entry("cC5h", r#"[\"dp\", \"tp\"]"#),
            entry("cC5i", r#"[[\"dp\", \"tp\"]]"#)
        );
        assert_eq!(file, want);
    }
}

//! `Strategy`: the mesh and every tensor's layout, as stored in `strategy.json`.
//! The format is specified in `docs/strategy.md`.

use crate::error::{Error, Result};
use crate::layout::mesh::Mesh;
use crate::layout::Dtype;
use crate::layout::{Placement, TensorLayout};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Value of the `format` field.
pub const STRATEGY_FORMAT: &str = "ckpt-strategy";
/// The version this code writes and reads.
pub const STRATEGY_VERSION: u64 = 1;

/// A device mesh and the layout of every tensor on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Strategy {
    /// The mesh all tensors are laid out on.
    pub mesh: Mesh,
    /// Layouts by tensor name.
    pub tensors: BTreeMap<String, TensorLayout>,
}

/// Parses a dtype name as safetensors writes it (`BF16`, `F8_E4M3`, ...).
///
/// # Errors
/// An unknown name.
pub fn parse_dtype(name: &str) -> std::result::Result<Dtype, String> {
    serde_json::from_value::<Dtype>(Value::String(name.to_string()))
        .map_err(|_| format!("unknown dtype `{name}`"))
}

/// The name safetensors uses for a dtype.
#[must_use]
pub fn dtype_name(dtype: Dtype) -> String {
    match serde_json::to_value(dtype) {
        Ok(Value::String(s)) => s,
        _ => format!("{dtype:?}"),
    }
}

impl Strategy {
    /// An empty strategy on a mesh.
    #[must_use]
    pub fn new(mesh: Mesh) -> Strategy {
        Strategy {
            mesh,
            tensors: BTreeMap::new(),
        }
    }

    /// Adds a tensor, validating its layout against the mesh.
    ///
    /// # Errors
    /// An invalid layout (see [`TensorLayout::validate`]).
    pub fn insert(&mut self, name: impl Into<String>, layout: TensorLayout) -> Result<()> {
        let name = name.into();
        layout.validate(&name, &self.mesh)?;
        self.tensors.insert(name, layout);
        Ok(())
    }

    /// The strategy as the JSON document of `docs/strategy.md`.
    #[must_use]
    pub fn to_json(&self) -> String {
        let axes: Vec<Value> = self
            .mesh
            .axes()
            .iter()
            .map(|a| json!({"name": a.name, "size": a.size}))
            .collect();
        let mut mesh = Map::new();
        mesh.insert("axes".into(), Value::Array(axes));
        if let Some(p) = self.mesh.pipeline() {
            mesh.insert(
                "pipeline_axis".into(),
                Value::String(self.mesh.axes()[p].name.clone()),
            );
        }
        let mut tensors = Map::new();
        for (name, l) in &self.tensors {
            let mut t = Map::new();
            t.insert("shape".into(), json!(l.shape));
            t.insert("dtype".into(), Value::String(dtype_name(l.dtype)));
            t.insert(
                "placements".into(),
                Value::Array(
                    l.placements
                        .iter()
                        .map(|p| Value::String(p.to_string()))
                        .collect(),
                ),
            );
            if let Some(s) = l.stage {
                t.insert("stage".into(), json!(s));
            }
            tensors.insert(name.clone(), Value::Object(t));
        }
        let doc = json!({
            "format": STRATEGY_FORMAT,
            "version": STRATEGY_VERSION,
            "mesh": Value::Object(mesh),
            "tensors": Value::Object(tensors),
        });
        let mut s = serde_json::to_string_pretty(&doc).unwrap_or_default();
        s.push('\n');
        s
    }

    /// A short, stable hash of the strategy (hex SHA-256 of its JSON, first 16 bytes).
    #[must_use]
    pub fn hash(&self) -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(self.to_json().as_bytes());
        d[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses and validates a strategy document. Errors name the tensor and problem.
    ///
    /// # Errors
    /// Malformed JSON, a wrong format or version, unknown fields, an invalid mesh or
    /// any invalid tensor layout.
    pub fn from_json(text: &str) -> Result<Strategy> {
        let bad = |problem: String| Error::InvalidStrategy { problem };
        let doc: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = doc
            .as_object()
            .ok_or_else(|| bad("the document must be a JSON object".into()))?;
        only_keys(
            obj,
            &["format", "version", "mesh", "tensors"],
            "the document",
        )
        .map_err(bad)?;
        match obj.get("format").and_then(Value::as_str) {
            Some(STRATEGY_FORMAT) => {}
            other => {
                return Err(bad(format!(
                    "`format` must be \"{STRATEGY_FORMAT}\", found {other:?}"
                )))
            }
        }
        match obj.get("version").and_then(Value::as_u64) {
            Some(STRATEGY_VERSION) => {}
            other => {
                return Err(bad(format!(
                    "unsupported version {other:?} (this build reads {STRATEGY_VERSION})"
                )))
            }
        }
        let mesh_obj = obj
            .get("mesh")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("`mesh` must be an object".into()))?;
        only_keys(mesh_obj, &["axes", "pipeline_axis"], "`mesh`").map_err(bad)?;
        let mut axes = Vec::new();
        for a in mesh_obj
            .get("axes")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("`mesh.axes` must be an array".into()))?
        {
            let name = a.get("name").and_then(Value::as_str);
            let size = a.get("size").and_then(Value::as_u64);
            match (name, size, a.as_object().map(Map::len)) {
                (Some(n), Some(s), Some(2)) => axes.push((n.to_string(), s)),
                _ => {
                    return Err(bad(format!(
                        "mesh axis {a} must be {{\"name\": string, \"size\": integer}}"
                    )))
                }
            }
        }
        let mut mesh = Mesh::new(axes)?;
        match mesh_obj.get("pipeline_axis") {
            None | Some(Value::Null) => {}
            Some(Value::String(p)) => mesh = mesh.with_pipeline(p)?,
            Some(v) => {
                return Err(bad(format!(
                    "`mesh.pipeline_axis` must be a string, found {v}"
                )))
            }
        }
        let mut strategy = Strategy::new(mesh);
        let tensors = obj
            .get("tensors")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("`tensors` must be an object".into()))?;
        for (name, t) in tensors {
            let layout = parse_tensor(name, t, &strategy.mesh)?;
            strategy.insert(name.clone(), layout)?;
        }
        Ok(strategy)
    }

    /// Reads and parses `strategy.json`.
    ///
    /// # Errors
    /// I/O errors and parse errors, with the path.
    pub fn read(path: &std::path::Path) -> Result<Strategy> {
        // Through the storage layer: in a bucket's tree the file may stand for an
        // object not yet fetched.
        ckpt_storage::materialize(path)?;
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.into(),
            source,
        })?;
        Strategy::from_json(&text).map_err(|e| e.with_path(path))
    }
}

fn only_keys(
    obj: &Map<String, Value>,
    allowed: &[&str],
    what: &str,
) -> std::result::Result<(), String> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "unknown field `{k}` in {what} (allowed: {})",
            allowed.join(", ")
        )),
        None => Ok(()),
    }
}

fn parse_tensor(name: &str, t: &Value, mesh: &Mesh) -> Result<TensorLayout> {
    let bad = |problem: String| Error::InvalidLayout {
        tensor: name.to_string(),
        problem,
    };
    let obj = t
        .as_object()
        .ok_or_else(|| bad("must be an object".into()))?;
    only_keys(
        obj,
        &["shape", "dtype", "placements", "stage"],
        "the tensor",
    )
    .map_err(bad)?;
    let shape = obj
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
        .ok_or_else(|| bad("`shape` must be an array of non-negative integers".into()))?;
    let dtype = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`dtype` must be a string".into()))
        .and_then(|d| parse_dtype(d).map_err(bad))?;
    let placements = match obj.get("placements") {
        None => vec![Placement::Replicate; mesh.axes().len()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|p| {
                p.as_str()
                    .ok_or_else(|| format!("placement {p} must be a string"))
                    .and_then(Placement::parse)
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(bad)?,
        // The object form names the mesh axes: {"tp": "Shard(0)"}; unnamed axes replicate.
        Some(Value::Object(m)) => {
            let mut p = vec![Placement::Replicate; mesh.axes().len()];
            for (axis, v) in m {
                let i = mesh
                    .axis_index(axis)
                    .ok_or_else(|| bad(format!("unknown mesh axis `{axis}`")))?;
                p[i] = v
                    .as_str()
                    .ok_or_else(|| format!("placement {v} must be a string"))
                    .and_then(Placement::parse)
                    .map_err(bad)?;
            }
            p
        }
        Some(v) => {
            return Err(bad(format!(
                "`placements` must be an array or object, found {v}"
            )))
        }
    };
    let stage = match obj.get("stage") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| bad(format!("`stage` must be an integer, found {v}")))?,
        ),
    };
    Ok(TensorLayout {
        shape,
        dtype,
        placements,
        stage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(tensor: &str) -> String {
        format!(
            r#"{{"format":"ckpt-strategy","version":1,"mesh":{{"axes":[{{"name":"dp","size":2}},{{"name":"tp","size":2}}]}},"tensors":{{"w":{tensor}}}}}"#
        )
    }

    #[test]
    fn round_trip() {
        let mut s = Strategy::new(
            Mesh::parse("pp=2,tp=2")
                .unwrap()
                .with_pipeline("pp")
                .unwrap(),
        );
        s.insert(
            "a",
            TensorLayout::new(
                vec![6, 4],
                Dtype::BF16,
                vec![Placement::Replicate, Placement::blocked(0, 3)],
            )
            .with_stage(1),
        )
        .unwrap();
        s.insert(
            "b",
            TensorLayout::new(vec![], Dtype::F8_E4M3, vec![Placement::Replicate; 2]),
        )
        .unwrap();
        let back = Strategy::from_json(&s.to_json()).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.hash(), s.hash());
    }

    #[test]
    fn errors_name_tensor_and_problem() {
        let cases = [
            (
                r#"{"shape":[4],"dtype":"Q7","placements":["Replicate","Replicate"]}"#,
                "tensor `w`: unknown dtype `Q7`",
            ),
            (
                r#"{"shape":[4],"dtype":"F32","placements":["Replicate","Shard(1)"]}"#,
                "tensor `w`: shard dim 1 on axis `tp` is out of range",
            ),
            (
                r#"{"shape":[4],"dtype":"F32","placements":{"ep":"Shard(0)"}}"#,
                "tensor `w`: unknown mesh axis `ep`",
            ),
            (
                r#"{"shape":[4],"dtype":"F32","placements":["Replicate","Shard(0,blocks=3)"]}"#,
                "tensor `w`: blocks=3 on axis `tp` do not divide dim 0 of size 4",
            ),
            (
                r#"{"shape":[4],"dtype":"F32","placements":["Replicate"]}"#,
                "tensor `w`: 1 placements for a mesh of 2 axes",
            ),
            (
                r#"{"shape":[4],"dtype":"F32","colour":1}"#,
                "tensor `w`: unknown field `colour`",
            ),
        ];
        for (t, want) in cases {
            let e = Strategy::from_json(&doc(t)).unwrap_err().to_string();
            assert!(e.starts_with(want), "{e} should start with {want}");
        }
        let e = Strategy::from_json("{}").unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid strategy: `format` must be \"ckpt-strategy\", found None"
        );
    }
}

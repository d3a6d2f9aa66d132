//! `Strategy`: the mesh and every tensor's layout, as stored in `strategy.json`.
//! The format is specified in `docs/strategy.md`.

use crate::error::{Error, Result};
use crate::layout::mesh::Mesh;
use crate::layout::{Dtype, Placement, TensorLayout};
use serde_json::{Map, Value};
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
    use serde::Deserialize;
    let name_de = serde::de::value::StrDeserializer::<serde::de::value::Error>::new(name);
    Dtype::deserialize(name_de).map_err(|_| format!("unknown dtype `{name}`"))
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

    /// The strategy as the JSON document of `docs/strategy.md`: pretty-printed, keys in
    /// sorted order (the text the hash is taken of).
    #[must_use]
    pub fn to_json(&self) -> String {
        let doc = written::Doc {
            format: STRATEGY_FORMAT,
            mesh: written::Mesh {
                axes: self
                    .mesh
                    .axes()
                    .iter()
                    .map(|a| written::Axis {
                        name: &a.name,
                        size: a.size,
                    })
                    .collect(),
                pipeline_axis: self
                    .mesh
                    .pipeline()
                    .map(|p| self.mesh.axes()[p].name.as_str()),
            },
            tensors: written::Tensors(&self.tensors),
            version: STRATEGY_VERSION,
        };
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
        if let Some(strategy) = well_formed::strategy(text) {
            return Ok(strategy);
        }
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
        let text = Strategy::read_text(path)?;
        Strategy::from_json(&text).map_err(|e| e.with_path(path))
    }

    /// The text of a strategy file, unparsed.
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn read_text(path: &std::path::Path) -> Result<String> {
        // Through the storage layer: in a bucket's tree the file may stand for an
        // object not yet fetched.
        ckpt_storage::materialize(path)?;
        std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.into(),
            source,
        })
    }
}

/// The document as written, field by field in sorted order (as a JSON object's keys
/// are printed), without building a JSON tree of a hundred thousand tensors.
mod written {
    use crate::layout::{Dtype, Placement, TensorLayout};
    use serde::{Serialize, Serializer};
    use std::collections::BTreeMap;

    #[derive(Serialize)]
    pub(super) struct Doc<'a> {
        pub format: &'a str,
        pub mesh: Mesh<'a>,
        pub tensors: Tensors<'a>,
        pub version: u64,
    }

    #[derive(Serialize)]
    pub(super) struct Mesh<'a> {
        pub axes: Vec<Axis<'a>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub pipeline_axis: Option<&'a str>,
    }

    #[derive(Serialize)]
    pub(super) struct Axis<'a> {
        pub name: &'a str,
        pub size: u64,
    }

    pub(super) struct Tensors<'a>(pub &'a BTreeMap<String, TensorLayout>);

    #[derive(Serialize)]
    struct Tensor<'a> {
        dtype: Dtype,
        placements: Placements<'a>,
        shape: &'a [u64],
        #[serde(skip_serializing_if = "Option::is_none")]
        stage: Option<u64>,
    }

    struct Placements<'a>(&'a [Placement]);

    impl Serialize for Tensors<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_map(self.0.iter().map(|(name, l)| {
                let tensor = Tensor {
                    dtype: l.dtype,
                    placements: Placements(&l.placements),
                    shape: &l.shape,
                    stage: l.stage,
                };
                (name, tensor)
            }))
        }
    }

    impl Serialize for Placements<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            struct Text<'a>(&'a Placement);
            impl Serialize for Text<'_> {
                fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    s.collect_str(self.0)
                }
            }
            s.collect_seq(self.0.iter().map(Text))
        }
    }
}

/// A well-formed document read straight into its types ([`crate::json`]); `None` for
/// anything else, which the checked parse reads to say what is wrong.
mod well_formed {
    use super::{parse_dtype, Strategy, STRATEGY_FORMAT, STRATEGY_VERSION};
    use crate::json::Object;
    use crate::layout::mesh::Mesh;
    use crate::layout::{Placement, TensorLayout};
    use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        format: String,
        version: u64,
        mesh: Object<MeshFields>,
        tensors: BTreeMap<String, Object<Tensor>>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct MeshFields {
        axes: Vec<Object<Axis>>,
        #[serde(default)]
        pipeline_axis: Option<String>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Axis {
        name: String,
        size: u64,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Tensor {
        shape: Vec<u64>,
        dtype: String,
        #[serde(default)]
        placements: Placements,
        #[serde(default)]
        stage: Option<u64>,
    }

    /// `placements` as given: absent, a list, or an object naming mesh axes (`null`
    /// is neither, and falls to the checked parse).
    #[derive(Default)]
    enum Placements {
        #[default]
        Absent,
        List(Vec<String>),
        Named(Vec<(String, String)>),
    }

    impl<'de> Deserialize<'de> for Placements {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visit;
            impl<'de> Visitor<'de> for Visit {
                type Value = Placements;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a list or an object of placements")
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Placements, A::Error> {
                    let mut list = Vec::new();
                    while let Some(p) = seq.next_element()? {
                        list.push(p);
                    }
                    Ok(Placements::List(list))
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Placements, A::Error> {
                    let mut named = Vec::new();
                    while let Some(entry) = map.next_entry()? {
                        named.push(entry);
                    }
                    Ok(Placements::Named(named))
                }
            }
            d.deserialize_any(Visit)
        }
    }

    pub(super) fn strategy(text: &str) -> Option<Strategy> {
        let doc: Doc = serde_json::from_str(text).ok()?;
        if doc.format != STRATEGY_FORMAT || doc.version != STRATEGY_VERSION {
            return None;
        }
        let axes = doc.mesh.0.axes.into_iter().map(|a| (a.0.name, a.0.size));
        let mut mesh = Mesh::new(axes.collect()).ok()?;
        if let Some(p) = &doc.mesh.0.pipeline_axis {
            mesh = mesh.with_pipeline(p).ok()?;
        }
        let mut strategy = Strategy::new(mesh);
        for (name, Object(t)) in doc.tensors {
            let axes = strategy.mesh.axes().len();
            let placements = match t.placements {
                Placements::Absent => vec![Placement::Replicate; axes],
                Placements::List(list) => list
                    .iter()
                    .map(|p| Placement::parse(p).ok())
                    .collect::<Option<Vec<_>>>()?,
                Placements::Named(named) => {
                    let mut p = vec![Placement::Replicate; axes];
                    for (axis, text) in named {
                        p[strategy.mesh.axis_index(&axis)?] = Placement::parse(&text).ok()?;
                    }
                    p
                }
            };
            let layout = TensorLayout {
                shape: t.shape,
                dtype: parse_dtype(&t.dtype).ok()?,
                placements,
                stage: t.stage,
            };
            strategy.insert(name, layout).ok()?;
        }
        Some(strategy)
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

    /// The typed parse takes no document the checked one refuses, and where it takes
    /// one gives the same strategy; the document written is the JSON object printed
    /// with its keys sorted, as a `serde_json::Value` prints it.
    #[test]
    fn the_typed_paths_agree_with_the_checked_ones() {
        let refused = [
            r#"{"shape":[4],"dtype":"F32","placements":null}"#,
            r#"["F32",[4]]"#,
            r#"{"shape":[4],"dtype":"F32","placements":[0,1]}"#,
            r#"{"shape":[4],"dtype":"F32","placements":{"tp":1}}"#,
            r#"{"shape":[4],"dtype":"F32","stage":"1"}"#,
        ];
        for t in refused {
            assert!(well_formed::strategy(&doc(t)).is_none(), "{t}");
            assert!(Strategy::from_json(&doc(t)).is_err(), "{t}");
        }
        // A field twice: the checked parse takes the last, the typed one leaves it to it.
        let twice = doc(r#"{"shape":[4],"dtype":"F32","shape":[4]}"#);
        assert!(well_formed::strategy(&twice).is_none());
        assert!(Strategy::from_json(&twice).is_ok());
        let array_axis =
            r#"{"format":"ckpt-strategy","version":1,"mesh":{"axes":[["dp",2]]},"tensors":{}}"#;
        assert!(well_formed::strategy(array_axis).is_none());
        assert!(Strategy::from_json(array_axis).is_err());
        let taken = [
            r#"{"shape":[4],"dtype":"F32"}"#,
            r#"{"shape":[4],"dtype":"F32","placements":{"tp":"Shard(0)"},"stage":null}"#,
            r#"{"shape":[6,4],"dtype":"BF16","placements":["Replicate","Shard(0,blocks=3)"]}"#,
        ];
        for t in taken {
            let typed = well_formed::strategy(&doc(t)).expect(t);
            assert_eq!(typed, Strategy::from_json(&doc(t)).unwrap());
        }

        let mut s = Strategy::new(
            Mesh::parse("pp=2,tp=2")
                .unwrap()
                .with_pipeline("pp")
                .unwrap(),
        );
        let l = TensorLayout::new(
            vec![6, 4],
            Dtype::BF16,
            vec![Placement::Replicate, Placement::blocked(0, 3)],
        );
        s.insert("b.w", l.clone().with_stage(1)).unwrap();
        s.insert(
            "a",
            TensorLayout::new(vec![], Dtype::F8_E4M3, vec![Placement::Replicate; 2]),
        )
        .unwrap();
        let tensors: serde_json::Map<String, Value> = s
            .tensors
            .iter()
            .map(|(name, l)| {
                let mut t = serde_json::json!({
                    "shape": l.shape,
                    "dtype": dtype_name(l.dtype),
                    "placements": l.placements.iter().map(ToString::to_string).collect::<Vec<_>>(),
                });
                if let Some(stage) = l.stage {
                    t["stage"] = stage.into();
                }
                (name.clone(), t)
            })
            .collect();
        let value = serde_json::json!({
            "format": STRATEGY_FORMAT,
            "version": STRATEGY_VERSION,
            "mesh": {"axes": [{"name": "pp", "size": 2}, {"name": "tp", "size": 2}], "pipeline_axis": "pp"},
            "tensors": tensors,
        });
        assert_eq!(
            s.to_json(),
            serde_json::to_string_pretty(&value).unwrap() + "\n"
        );
        let empty = Strategy::new(Mesh::parse("tp=2").unwrap());
        assert!(
            empty.to_json().contains(r#""tensors": {}"#),
            "{}",
            empty.to_json()
        );
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

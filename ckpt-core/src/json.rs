//! JSON documents read straight into their types, for the fast path of every header
//! and record that can hold a hundred thousand entries.
//!
//! Each reader keeps its checked path, which reads a `serde_json::Value` and says
//! exactly what is wrong, and tries the typed parse first: a well-formed document
//! never builds a tree (whose allocation and freeing cost more than the rest of
//! opening a checkpoint of many small tensors), and anything the typed parse does not
//! take falls to the checked path. The typed parse must therefore take no document the
//! checked one refuses: [`Object`] keeps derived structs from also taking arrays.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use std::marker::PhantomData;

/// A JSON object read into `T`. serde's derived structs also take a JSON array of the
/// fields in order, which no document of ours allows.
pub(crate) struct Object<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Visit<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Object)
            }
        }
        d.deserialize_map(Visit(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Pair {
        a: u64,
        b: String,
    }

    #[test]
    fn takes_objects_only() {
        let ok: Object<Pair> = serde_json::from_str(r#"{"b":"x","a":1}"#).unwrap();
        assert_eq!(
            ok.0,
            Pair {
                a: 1,
                b: "x".into()
            }
        );
        // A derived struct alone takes the array form; Object does not.
        assert!(serde_json::from_str::<Pair>(r#"[1,"x"]"#).is_ok());
        assert!(serde_json::from_str::<Object<Pair>>(r#"[1,"x"]"#).is_err());
        assert!(serde_json::from_str::<Object<Pair>>(r#"{"a":1,"b":"x","c":2}"#).is_err());
        assert!(serde_json::from_str::<Object<Pair>>(r#"{"a":1,"a":2,"b":"x"}"#).is_err());
    }
}

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
use std::borrow::Cow;
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

/// A JSON object as its members in document order, each name borrowed from the text
/// where it holds no escape: no map built and no name copied. Records keyed by tensor
/// name (`DCP_SHARDING_INFO`, `ckpt.checksums`) list the names in the order of the
/// file's tensors, so they are matched to them in one pass.
pub(crate) struct Members<'de, V>(pub Vec<(Cow<'de, str>, V)>);

/// A JSON string, borrowed from the text where it holds no escape. (serde's own
/// `Cow<str>` always copies.)
pub(crate) struct Name<'de>(pub Cow<'de, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v)))
            }
        }
        d.deserialize_str(Visit)
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Members<'de, V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Visit<V> {
            type Value = Members<'de, V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de, V>, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(Name(k)) = map.next_key::<Name<'de>>()? {
                    out.push((k, map.next_value()?));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(Visit(PhantomData))
    }
}

impl<V> Members<'_, V> {
    /// The value of each of `names` (`None` for a name the object does not have), when
    /// the members name some of `names` in their order (then no name is there twice,
    /// as `names` are distinct); `None` otherwise (a member of another name, or out of
    /// order), and the caller reads the object by name.
    pub(crate) fn in_order_of<'n>(
        self,
        names: impl ExactSizeIterator<Item = &'n str>,
    ) -> Option<Vec<Option<V>>> {
        let mut out: Vec<Option<V>> = Vec::with_capacity(names.len());
        let mut members = self.0.into_iter().peekable();
        for name in names {
            match members.peek() {
                Some((k, _)) if k == name => out.push(members.next().map(|(_, v)| v)),
                _ => out.push(None),
            }
        }
        members.peek().is_none().then_some(out)
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

    #[test]
    fn members_borrow_names_and_match_in_order() {
        let text = r#"{"a":1,"b\u0041":2}"#;
        let m: Members<u64> = serde_json::from_str(text).unwrap();
        assert!(matches!(m.0[0].0, Cow::Borrowed("a")));
        assert_eq!(m.0[1].0, "bA");
        assert_eq!(
            m.in_order_of(["0", "a", "b", "bA", "c"].into_iter()),
            Some(vec![None, Some(1), None, Some(2), None])
        );
        let m: Members<u64> = serde_json::from_str(text).unwrap();
        assert_eq!(m.in_order_of(["bA", "a"].into_iter()), None);
        let m: Members<u64> = serde_json::from_str(text).unwrap();
        assert_eq!(m.in_order_of(["a"].into_iter()), None);
        // A name twice never matches distinct names.
        let m: Members<u64> = serde_json::from_str(r#"{"a":1,"a":2}"#).unwrap();
        assert_eq!(m.in_order_of(["a", "b"].into_iter()), None);
        assert!(serde_json::from_str::<Members<u64>>("[1]").is_err());
    }
}

//! Object URLs: which store, which bucket, which key; printed without credentials.

use crate::error::{Error, Result};
use std::path::Path;

/// The schemes ckpt reaches through object stores.
const SCHEMES: [&str; 8] = ["s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https"];

/// Whether `path` is written as a URL of an object store (`s3://…`, `gs://…`, …) rather
/// than a local path.
#[must_use]
pub fn is_url(path: &Path) -> bool {
    path.to_str()
        .and_then(|s| s.split_once("://"))
        .is_some_and(|(scheme, _)| SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()))
}

/// A parsed object URL: a store (scheme and bucket, or the server of an `http(s)`
/// URL) and a key under it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectUrl {
    url: url::Url,
}

impl ObjectUrl {
    /// Parses `path` as an object URL.
    ///
    /// # Errors
    /// Not a URL of a scheme ckpt knows, or without a bucket.
    pub fn parse(path: &Path) -> Result<ObjectUrl> {
        let text = path.to_str().unwrap_or_default();
        let bad = |problem: &str| Error::BadUrl {
            url: redact(text),
            problem: problem.into(),
        };
        if !is_url(path) {
            return Err(bad(
                "not an object store URL (s3://, gs://, az://, http(s)://)",
            ));
        }
        let url = url::Url::parse(text).map_err(|e| bad(&e.to_string()))?;
        if url.host_str().unwrap_or("").is_empty() {
            return Err(bad("no bucket (s3://BUCKET/KEY)"));
        }
        Ok(ObjectUrl { url })
    }

    /// The scheme, lower case.
    #[must_use]
    pub fn scheme(&self) -> &str {
        self.url.scheme()
    }

    /// Whether the store can be written (an `http(s)` server is read-only here).
    #[must_use]
    pub fn writable(&self) -> bool {
        !matches!(self.scheme(), "http" | "https")
    }

    /// The store's root URL (`s3://bucket`) as printed: without user or password.
    #[must_use]
    pub fn root(&self) -> String {
        let mut u = self.url.clone();
        let _ = u.set_username("");
        let _ = u.set_password(None);
        u.set_path("");
        u.set_query(None);
        u.set_fragment(None);
        u.to_string().trim_end_matches('/').to_string()
    }

    /// The store's root URL as given (with any user and password, which an `http(s)`
    /// server may need), for building the client; never printed.
    pub(crate) fn client_root(&self) -> String {
        let mut u = self.url.clone();
        u.set_path("");
        u.set_query(None);
        u.set_fragment(None);
        u.to_string().trim_end_matches('/').to_string()
    }

    /// The key (no leading or trailing `/`).
    #[must_use]
    pub fn key(&self) -> String {
        let p = percent_decode(self.url.path());
        p.trim_matches('/').to_string()
    }

    /// This URL with `rel` appended to its key.
    #[must_use]
    pub fn join(&self, rel: &str) -> String {
        let key = self.key();
        if key.is_empty() {
            format!("{}/{rel}", self.root())
        } else {
            format!("{}/{key}/{rel}", self.root())
        }
    }

    /// The last component of the key (the name a local copy gets).
    #[must_use]
    pub fn name(&self) -> String {
        let key = self.key();
        key.rsplit('/')
            .next()
            .filter(|n| !n.is_empty())
            .unwrap_or("object")
            .to_string()
    }
}

impl std::fmt::Display for ObjectUrl {
    /// The URL without user, password, query or fragment: nothing secret is printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.key().as_str() {
            "" => write!(f, "{}", self.root()),
            k => write!(f, "{}/{k}", self.root()),
        }
    }
}

/// `text` with any `user:password@` and query string removed.
fn redact(text: &str) -> String {
    let text = text.split(['?', '#']).next().unwrap_or("");
    let Some((scheme, rest)) = text.split_once("://") else {
        return text.to_string();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let host = authority.rsplit('@').next().unwrap_or(authority);
    format!("{scheme}://{host}{path}")
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_to_store_and_key() {
        let u = ObjectUrl::parse(Path::new("s3://bucket/run/iter_0000001/")).unwrap();
        assert_eq!(u.root(), "s3://bucket");
        assert_eq!(u.key(), "run/iter_0000001");
        assert_eq!(u.name(), "iter_0000001");
        assert_eq!(u.join("a.pt"), "s3://bucket/run/iter_0000001/a.pt");
        assert!(is_url(Path::new("gs://b/x")));
        assert!(!is_url(Path::new("/tmp/s3:/x")));
        assert!(!is_url(Path::new("ckpt_0")));
        assert!(ObjectUrl::parse(Path::new("s3:///x")).is_err());
    }

    #[test]
    fn secrets_are_not_printed() {
        let u =
            ObjectUrl::parse(Path::new("https://user:pw@host/m/x.safetensors?sig=abc")).unwrap();
        let shown = u.to_string();
        assert!(!shown.contains("pw") && !shown.contains("sig"), "{shown}");
        assert_eq!(redact("https://u:pw@h/x?q=1"), "https://h/x");
    }
}

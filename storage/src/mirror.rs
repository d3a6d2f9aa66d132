//! A URL's objects as a local tree: listing replaces the directory walk. Discovery and
//! every format's reader see the same names and sizes as in the bucket; small objects
//! (metadata, configs, trackers) are downloaded whole, large ones are sparse
//! placeholders whose bytes come on demand ([`crate::paged`], or [`materialize`]).

use crate::error::{Error, IoAt, Result};
use crate::location::ObjectUrl;
use crate::store::{block_on, store_for, Store};
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, Weak};

/// Objects at most this large are downloaded whole when a URL is mirrored (they are
/// what discovery reads whole: JSON, trackers, DCP `.metadata`, strategy files); larger
/// ones are fetched only where read. `CKPT_SMALL_OBJECT_BYTES` overrides it (tests set
/// it low to send small fixtures through the on-demand path).
pub const SMALL_OBJECT_BYTES: u64 = 1 << 20;

fn small_object_bytes() -> u64 {
    std::env::var("CKPT_SMALL_OBJECT_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SMALL_OBJECT_BYTES)
}

/// Requests in flight while mirroring (listing results downloaded, placeholders made).
const MIRROR_REQUESTS: usize = 16;

/// One large object of a mirror: where it is, how long, and the placeholder that
/// stands for it.
pub struct RemoteObject {
    pub(crate) store: Arc<Store>,
    pub(crate) key: object_store::path::Path,
    /// The object's URL, for messages.
    pub url: String,
    /// Its size in bytes (from the listing).
    pub size: u64,
    /// The placeholder's path in the mirror.
    pub local: PathBuf,
}

impl std::fmt::Debug for RemoteObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteObject({}, {} bytes)", self.url, self.size)
    }
}

impl RemoteObject {
    /// Bytes `range` of the object (one ranged request, retried by the store).
    ///
    /// # Errors
    /// The request failed after the retries; the object was shorter than listed.
    pub fn get_range(&self, range: std::ops::Range<u64>) -> Result<bytes::Bytes> {
        block_on(self.fetch(range))
    }

    pub(crate) async fn fetch(&self, range: std::ops::Range<u64>) -> Result<bytes::Bytes> {
        let want = range.end - range.start;
        let b = self
            .store
            .objects
            .get_range(&self.key, range.clone())
            .await
            .map_err(|e| Error::from_store(&self.url, e))?;
        if b.len() as u64 != want {
            return Err(Error::Request {
                url: self.url.clone(),
                detail: format!(
                    "bytes [{}, {}) asked, {} returned: the object changed or is shorter than listed ({} bytes)",
                    range.start,
                    range.end,
                    b.len(),
                    self.size
                ),
            });
        }
        Ok(b)
    }
}

impl RemoteObject {
    /// Bytes `range` of the object as they arrive, in the chunks the connection gives
    /// (one ranged request, its start retried by the store; a failure while reading
    /// is the caller's to retry from where it got to).
    ///
    /// # Errors
    /// The request failed after the retries.
    pub(crate) async fn stream(
        &self,
        range: std::ops::Range<u64>,
    ) -> Result<futures::stream::BoxStream<'static, Result<bytes::Bytes>>> {
        let url = self.url.clone();
        let got = self
            .store
            .objects
            .get_opts(
                &self.key,
                object_store::GetOptions::new().with_range(Some(range)),
            )
            .await
            .map_err(|e| Error::from_store(&url, e))?;
        Ok(got
            .into_stream()
            .map_err(move |e| Error::from_store(&url, e))
            .boxed())
    }
}

/// The placeholders of every live mirror, by local path.
static PLACEHOLDERS: RwLock<Option<HashMap<PathBuf, Arc<RemoteObject>>>> = RwLock::new(None);
/// Every mirror root made by this process and its URL, for messages (kept after the
/// mirror is gone: an error is printed after the checkpoint that made it is dropped).
static ROOTS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// The remote object a local path stands for, when it is a placeholder not yet
/// materialized.
#[must_use]
pub fn placeholder(path: &Path) -> Option<Arc<RemoteObject>> {
    let map = PLACEHOLDERS
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let map = map.as_ref()?;
    map.get(path).cloned().or_else(|| {
        let c = std::fs::canonicalize(path).ok()?;
        map.get(&c).cloned()
    })
}

/// `text` with every mirror's local root replaced by its URL: what errors and reports
/// print, so that they name objects, not temporary files.
#[must_use]
pub fn unmirror_text(text: &str) -> String {
    let roots = ROOTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out = text.to_string();
    for (local, url) in roots.iter() {
        out = out.replace(local.as_str(), url);
    }
    out
}

/// Records that `local` stands for `url` in messages ([`unmirror_text`]).
pub(crate) fn name_root(local: &Path, url: &str) {
    ROOTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((local.display().to_string(), url.to_string()));
}

/// A URL's objects as a local tree, alive as long as this value (its temporary
/// directory and placeholders are removed when it is dropped).
#[derive(Debug)]
pub struct Mirror {
    url: ObjectUrl,
    root: PathBuf,
    local: PathBuf,
    objects: Vec<Arc<RemoteObject>>,
}

impl Mirror {
    /// The local path standing for the URL (a directory for a prefix, a file for an
    /// object).
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.local
    }

    /// The URL.
    #[must_use]
    pub fn url(&self) -> &ObjectUrl {
        &self.url
    }

    /// The large objects, fetched on demand.
    #[must_use]
    pub fn remote_objects(&self) -> &[Arc<RemoteObject>] {
        &self.objects
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        if let Ok(mut map) = PLACEHOLDERS.write() {
            if let Some(map) = map.as_mut() {
                for o in &self.objects {
                    map.remove(&o.local);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Mirrors `url` (a prefix, or one object): lists it, downloads the small objects and
/// makes placeholders for the large ones. Mirrors are shared: a URL mirrored while an
/// earlier mirror of it is alive gets that one.
///
/// # Errors
/// Nothing at the URL, no access, no such bucket, failed requests: each naming the URL.
pub fn mirror(url: &ObjectUrl) -> Result<Arc<Mirror>> {
    static LIVE: Mutex<Vec<(String, Weak<Mirror>)>> = Mutex::new(Vec::new());
    let shown = url.to_string();
    {
        let mut live = LIVE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        live.retain(|(_, w)| w.strong_count() > 0);
        if let Some(m) = live
            .iter()
            .find(|(u, _)| *u == shown)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(m);
        }
    }
    let store = store_for(url)?;
    let key = url.key();
    let prefix = object_store::path::Path::from(key.as_str());
    // Under the key as a prefix (a directory), else the key itself (one object).
    let listed: Vec<object_store::ObjectMeta> = block_on(
        store
            .objects
            .list(if key.is_empty() { None } else { Some(&prefix) })
            .try_collect(),
    )
    .map_err(|e| Error::from_store(&shown, e))?;
    let (objects, single) = if listed.is_empty() {
        let meta =
            block_on(store.objects.head(&prefix)).map_err(|e| Error::from_store(&shown, e))?;
        (vec![meta], true)
    } else {
        (listed, false)
    };
    let root = tempdir()?;
    name_root(&root.join(url.name()), &shown);
    let local = root.join(url.name());
    let small = small_object_bytes();
    let mut remote = Vec::new();
    let mut downloads = Vec::new();
    for meta in objects {
        let rel = if single {
            String::new()
        } else {
            let full = meta.location.to_string();
            full.strip_prefix(&key)
                .unwrap_or(&full)
                .trim_start_matches('/')
                .to_string()
        };
        let path = if rel.is_empty() {
            local.clone()
        } else {
            local.join(&rel)
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        let object_url = if rel.is_empty() {
            shown.clone()
        } else {
            format!("{shown}/{rel}")
        };
        if meta.size <= small {
            downloads.push((meta.location, path, object_url));
        } else {
            let f = std::fs::File::create(&path).at(&path)?;
            // Sparse: the placeholder has the object's size and takes no space.
            f.set_len(meta.size).at(&path)?;
            remote.push(Arc::new(RemoteObject {
                store: store.clone(),
                key: meta.location,
                url: object_url,
                size: meta.size,
                local: path,
            }));
        }
    }
    let s = store.clone();
    block_on(
        futures::stream::iter(downloads.into_iter().map(|(key, path, object_url)| {
            let s = s.clone();
            async move {
                let bytes = async { s.objects.get(&key).await?.bytes().await }
                    .await
                    .map_err(|e| Error::from_store(&object_url, e))?;
                std::fs::write(&path, &bytes).at(&path)
            }
        }))
        .buffer_unordered(MIRROR_REQUESTS)
        .try_collect::<Vec<()>>(),
    )?;
    {
        let mut map = PLACEHOLDERS
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let map = map.get_or_insert_with(HashMap::new);
        for o in &remote {
            map.insert(o.local.clone(), o.clone());
        }
    }
    let m = Arc::new(Mirror {
        url: url.clone(),
        root,
        local,
        objects: remote,
    });
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((shown, Arc::downgrade(&m)));
    Ok(m)
}

/// A new directory under the temporary directory (`TMPDIR`), unique to this call.
/// Those that killed processes left there are removed first.
pub(crate) fn tempdir() -> Result<PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    static SWEPT: std::sync::Once = std::sync::Once::new();
    let base = std::env::temp_dir();
    SWEPT.call_once(|| remove_dead_tempdirs(&base));
    let dir = base.join(format!(
        "ckpt-remote-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).at(&dir)?;
    Ok(dir)
}

/// Removes the `ckpt-remote-<pid>-<n>` directories under `base` whose process is gone (a
/// `kill -9` or a crash leaves its mirror and its staged output there; a process that
/// ends normally removes its own).
fn remove_dead_tempdirs(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("ckpt-remote-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Makes `path`, if it is a placeholder, a local copy of its object (streamed in
/// ranges, never whole in memory), so that it can be read as a file: for the few
/// readers that read through a handle rather than a mapping (`.ckptz`'s positional
/// reads), and for every read where demand paging is not available. A path that is
/// not a placeholder is left as it is.
///
/// # Errors
/// The requests or the local writes failed.
pub fn materialize(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileExt;
    // One materialization at a time per process: two readers of one placeholder must
    // not both download it.
    static ONE: Mutex<()> = Mutex::new(());
    let _one = ONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(obj) = placeholder(path) else {
        return Ok(());
    };
    const PART: u64 = 16 << 20;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&obj.local)
        .at(&obj.local)?;
    let parts: Vec<std::ops::Range<u64>> = (0..obj.size.div_ceil(PART))
        .map(|k| k * PART..((k + 1) * PART).min(obj.size))
        .collect();
    let o = obj.clone();
    block_on(
        futures::stream::iter(parts.into_iter().map(|r| {
            let o = o.clone();
            let file = &file;
            async move {
                let b = o.fetch(r.clone()).await?;
                file.write_all_at(&b, r.start).at(&o.local)
            }
        }))
        .buffer_unordered(4)
        .try_collect::<Vec<()>>(),
    )?;
    file.sync_data().at(&obj.local)?;
    if let Ok(mut map) = PLACEHOLDERS.write() {
        if let Some(map) = map.as_mut() {
            map.remove(&obj.local);
        }
    }
    Ok(())
}

/// The whole of a file that may be a placeholder (materialized first): for readers of
/// small files that may be large objects (a DCP `.metadata` over the small-object size).
///
/// # Errors
/// As [`materialize`] and [`std::fs::read`].
pub fn read_whole(path: &Path) -> Result<Vec<u8>> {
    materialize(path)?;
    std::fs::read(path).at(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_temporaries_of_dead_processes_are_removed_and_no_others() {
        let base = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let gone = base.path().join(format!("ckpt-remote-{dead}-0"));
        std::fs::create_dir_all(gone.join("out")).unwrap();
        std::fs::write(gone.join("out/model.safetensors"), b"left").unwrap();
        let mine = base
            .path()
            .join(format!("ckpt-remote-{}-7", std::process::id()));
        std::fs::create_dir(&mine).unwrap();
        let other = base.path().join("ckpt-remote-notapid");
        std::fs::create_dir(&other).unwrap();
        remove_dead_tempdirs(base.path());
        assert!(!gone.exists());
        assert!(mine.exists() && other.exists());
    }
}

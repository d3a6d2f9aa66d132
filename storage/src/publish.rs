//! Outputs at a URL: written locally by the ordinary writers (each file committed by
//! its own rename; whole parts already sent while they write, [`crate::stream`]), then
//! published so that the checkpoint appears complete or not at all to a reader that
//! opens it by its entry file.
//!
//! 1. Journals (`<output>.ckpt-partial/*.json`, beside the output prefix, never under
//!    it) name the uploads made; those left by a killed run are acted on when the
//!    output is opened: their uploads aborted, the objects they had completed deleted.
//! 2. Every file larger than [`PART_BYTES`] is a multipart upload; the parts not sent
//!    while writing go up in parallel ([`UPLOADS`] at a time), and nothing is visible
//!    while parts are uploaded.
//! 3. The uploads are completed and the small files put (each atomic), the files
//!    named in [`COMMIT_LAST`] (what readers open first: the index, `.metadata`,
//!    `latest`) after all the others.
//! 4. Objects of an older output at the prefix that the new one does not have are
//!    deleted (only with `force`), and the journals are deleted.

use crate::error::{Error, IoAt, Result};
use crate::journal::{journal_key, journal_prefix, journal_text};
use crate::location::ObjectUrl;
use crate::store::{block_on, store_for, Store};
use crate::stream::{Stream, StreamedUpload, Streaming, PART_BYTES};
use futures::{StreamExt, TryStreamExt};
use object_store::multipart::PartId;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Parts in flight at once (memory: this many parts).
pub const UPLOADS: usize = 8;

/// The names readers open first, completed after every other object: while they are
/// missing, a reader finds no checkpoint at all.
pub const COMMIT_LAST: [&str; 9] = [
    "model.safetensors.index.json",
    "model.ckptz.index.json",
    ".metadata",
    "latest",
    "latest_checkpointed_iteration.txt",
    "strategy.json",
    "config.json",
    "metadata.json",
    // Orbax's commit mark of a step and of an item.
    "commit_success.txt",
];

/// Where an output goes: a local path as it is, or a URL written through a local
/// staging directory and published by [`Output::publish`].
#[derive(Debug)]
pub struct Output {
    url: Option<ObjectUrl>,
    local: PathBuf,
    staging: Option<PathBuf>,
    force: bool,
    /// A killed run's journals were found (and acted on) when the output was opened:
    /// objects at the prefix are its leftovers, not an output to refuse.
    had_journal: bool,
    /// The uploads of the files' parts made while they are written.
    stream: Option<Stream>,
}

impl Output {
    /// An output at `path` (a local path or a URL).
    ///
    /// # Errors
    /// A URL of a read-only store, or a bad URL.
    pub fn new(path: &Path, force: bool) -> Result<Output> {
        if !crate::location::is_url(path) {
            return Ok(Output {
                url: None,
                local: path.to_path_buf(),
                staging: None,
                force,
                had_journal: false,
                stream: None,
            });
        }
        let url = ObjectUrl::parse(path)?;
        if !url.writable() {
            return Err(Error::BadUrl {
                url: url.to_string(),
                problem: "http(s) URLs are read-only: write to s3://, gs:// or az://".into(),
            });
        }
        // A killed run's journals first (its uploads aborted, what it completed deleted):
        // this run's parts go up while it writes, so the clean-up cannot wait for the
        // publish.
        let store = store_for(&url)?;
        let had_journal = clean_up(&store, &url)?;
        if !force && !had_journal {
            let prefix = Key::from(url.key());
            let any =
                block_on(async { store.objects.list(Some(&prefix)).next().await.transpose() })
                    .map_err(|e| Error::from_store(&url.to_string(), e))?;
            if any.is_some() {
                return Err(Error::Exists {
                    url: url.to_string(),
                });
            }
        }
        let staging = crate::mirror::tempdir()?;
        let local = staging.join(url.name());
        crate::mirror::name_root(&local, &url.to_string());
        let stream = Streaming::start(&url, store, &local, 0).map(Stream);
        Ok(Output {
            url: Some(url),
            local,
            staging: Some(staging),
            force,
            had_journal,
            stream,
        })
    }

    /// The local path the writers write to.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.local
    }

    /// The staging directory to remove if the process is killed (`None` for a local
    /// output).
    #[must_use]
    pub fn staging(&self) -> Option<&Path> {
        self.staging.as_deref()
    }

    /// Whether the output is a URL.
    #[must_use]
    pub fn is_remote(&self) -> bool {
        self.url.is_some()
    }

    /// Publishes the written output to its URL (nothing to do for a local one).
    ///
    /// # Errors
    /// An output already at the URL (without `force`), failed requests: nothing of
    /// this output is left visible, and the journal says what to clean up otherwise.
    pub fn publish(&self) -> Result<()> {
        let Some(url) = &self.url else {
            return Ok(());
        };
        let store = store_for(url)?;
        let (streamed, stream_journals) = match &self.stream {
            Some(s) => (s.0.finish(), s.0.journals()),
            None => (Ok(HashMap::new()), Vec::new()),
        };
        let result = streamed.and_then(|streamed| {
            publish_tree(
                &store,
                url,
                &self.local,
                self.force,
                self.had_journal,
                &streamed,
                &stream_journals,
            )
        });
        if result.is_err() {
            // Nothing of this output stays: the uploads aborted, what completed deleted.
            let _ = clean_up(&store, url);
        }
        result
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        // The stream (dropped with the output) aborts its uploads unless published.
        if let Some(s) = &self.staging {
            let _ = std::fs::remove_dir_all(s);
        }
    }
}

/// One file to publish.
struct Upload {
    local: PathBuf,
    key: Key,
    size: u64,
    last: bool,
}

fn files(local: &Path, url: &ObjectUrl) -> Result<Vec<Upload>> {
    let mut out = Vec::new();
    let meta = std::fs::metadata(local).at(local)?;
    if meta.is_file() {
        out.push(Upload {
            local: local.to_path_buf(),
            key: Key::from(url.key()),
            size: meta.len(),
            last: true,
        });
        return Ok(out);
    }
    let mut stack = vec![local.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).at(&dir)? {
            let p = e.at(&dir)?.path();
            let m = std::fs::metadata(&p).at(&p)?;
            if m.is_dir() {
                stack.push(p);
                continue;
            }
            let rel = p
                .strip_prefix(local)
                .unwrap_or(&p)
                .to_string_lossy()
                .replace('\\', "/");
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            out.push(Upload {
                key: Key::from(format!("{}/{rel}", url.key())),
                local: p.clone(),
                size: m.len(),
                last: COMMIT_LAST.contains(&name),
            });
        }
    }
    out.sort_by(|a, b| a.key.as_ref().cmp(b.key.as_ref()));
    Ok(out)
}

fn shown(url: &ObjectUrl, key: &Key) -> String {
    format!("{}/{}", url.root(), key)
}

/// Acts on the journals left by a killed run: aborts their uploads, deletes what they
/// completed. Returns whether there was one.
fn clean_up(store: &Store, url: &ObjectUrl) -> Result<bool> {
    let journals: Vec<Key> = block_on(
        store
            .objects
            .list(Some(&journal_prefix(url)))
            .map_ok(|m| m.location)
            .try_collect(),
    )
    .map_err(|e| Error::from_store(&url.to_string(), e))?;
    for jk in &journals {
        let text = match block_on(async { store.objects.get(jk).await?.bytes().await }) {
            Ok(b) => b,
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(Error::from_store(&shown(url, jk), e)),
        };
        let doc: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
        let entries = doc
            .get("objects")
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default();
        block_on(async {
            for e in entries {
                let Some(key) = e.get("key").and_then(|k| k.as_str()) else {
                    continue;
                };
                let key = Key::from(key);
                if let (Some(id), Some(mp)) =
                    (e.get("upload").and_then(|u| u.as_str()), &store.multipart)
                {
                    let _ = mp.abort_multipart(&key, &id.to_string()).await;
                }
                if e.get("abort_only").and_then(serde_json::Value::as_bool) == Some(true) {
                    continue;
                }
                match store.objects.delete(&key).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(Error::from_store(&shown(url, &key), e)),
                }
            }
            store
                .objects
                .delete(jk)
                .await
                .map_err(|e| Error::from_store(&shown(url, jk), e))
        })?;
    }
    Ok(!journals.is_empty())
}

/// One large file's multipart upload in the publish: its id, its part size, and the
/// parts already sent while it was written (by index).
struct Multipart<'a> {
    upload: &'a Upload,
    id: String,
    part: u64,
    done: HashMap<u64, PartId>,
}

pub(crate) fn publish_tree(
    store: &Arc<Store>,
    url: &ObjectUrl,
    local: &Path,
    force: bool,
    had_journal: bool,
    streamed: &HashMap<String, StreamedUpload>,
    stream_journals: &[Key],
) -> Result<()> {
    let uploads = files(local, url)?;
    let prefix = Key::from(url.key());
    let existing: Vec<Key> = block_on(
        store
            .objects
            .list(Some(&prefix))
            .map_ok(|m| m.location)
            .try_collect(),
    )
    .map_err(|e| Error::from_store(&url.to_string(), e))?;
    if !existing.is_empty() && !force && !had_journal {
        return Err(Error::Exists {
            url: url.to_string(),
        });
    }
    let part = uploads
        .iter()
        .map(|u| crate::stream::part_bytes(u.size))
        .max()
        .unwrap_or(PART_BYTES);
    let mp = store.multipart.clone().ok_or_else(|| Error::BadUrl {
        url: url.to_string(),
        problem: "this store takes no multipart uploads".into(),
    })?;
    // 1. The uploads (those of parts sent while writing exist already), and the journal
    //    that names them all.
    let multiparts = multiparts(&mp, url, &uploads, part, streamed, |u| u.size > part)?;
    let named: Vec<(&str, Option<&str>)> = uploads
        .iter()
        .map(|u| {
            let id = multiparts
                .iter()
                .find(|m| std::ptr::eq(m.upload, u))
                .map(|m| m.id.as_str());
            (u.key.as_ref(), id)
        })
        .collect();
    let jk = journal_key(url, 0);
    block_on(
        store
            .objects
            .put(&jk, PutPayload::from(journal_text(&named, false))),
    )
    .map_err(|e| Error::from_store(&shown(url, &jk), e))?;
    // 2. Every part not sent yet, in parallel.
    let parts = send_parts(&mp, url, &multiparts)?;
    // 3. Complete and put: data first, entry files last.
    for last in [false, true] {
        block_on(
            futures::stream::iter(uploads.iter().filter(|u| u.last == last).map(|u| {
                let mp = mp.clone();
                let objects = store.objects.clone();
                let slot = multiparts.iter().position(|m| std::ptr::eq(m.upload, u));
                let (id, ps) = match slot {
                    Some(j) => (Some(multiparts[j].id.clone()), parts[j].clone()),
                    None => (None, Vec::new()),
                };
                async move {
                    let sent = match id {
                        Some(id) => mp.complete_multipart(&u.key, &id, ps).await.map(|_| ()),
                        None => {
                            let bytes = std::fs::read(&u.local).at(&u.local)?;
                            objects
                                .put(&u.key, PutPayload::from(bytes))
                                .await
                                .map(|_| ())
                        }
                    };
                    sent.map_err(|e| Error::from_store(&shown(url, &u.key), e))
                }
            }))
            .buffer_unordered(UPLOADS)
            .try_collect::<Vec<()>>(),
        )?;
    }
    // 4. What the old output had and the new one has not; the journals.
    let new: std::collections::HashSet<&str> = uploads.iter().map(|u| u.key.as_ref()).collect();
    block_on(async {
        for k in existing.iter().filter(|k| !new.contains(k.as_ref())) {
            let _ = store.objects.delete(k).await;
        }
        for j in stream_journals {
            store.objects.delete(j).await?;
        }
        store.objects.delete(&jk).await
    })
    .map_err(|e| Error::from_store(&shown(url, &jk), e))
}

/// The multipart uploads of `uploads`: those whose parts went up while they were
/// written, with those parts; new ones (`part` bytes per part) for the others that
/// `needs_one`.
fn multiparts<'a>(
    mp: &Arc<dyn object_store::multipart::MultipartStore>,
    url: &ObjectUrl,
    uploads: &'a [Upload],
    part: u64,
    streamed: &HashMap<String, StreamedUpload>,
    needs_one: impl Fn(&Upload) -> bool,
) -> Result<Vec<Multipart<'a>>> {
    let fresh: Vec<&Upload> = uploads
        .iter()
        .filter(|u| !streamed.contains_key(u.key.as_ref()) && needs_one(u))
        .collect();
    let ids: Vec<String> = block_on(
        futures::stream::iter(fresh.iter().map(|u| {
            let mp = mp.clone();
            async move {
                mp.create_multipart(&u.key)
                    .await
                    .map_err(|e| Error::from_store(&shown(url, &u.key), e))
            }
        }))
        .buffered(UPLOADS)
        .try_collect(),
    )?;
    let mut out: Vec<Multipart<'a>> = fresh
        .into_iter()
        .zip(ids)
        .map(|(u, id)| Multipart {
            upload: u,
            id,
            part,
            done: HashMap::new(),
        })
        .collect();
    for u in uploads {
        if let Some(s) = streamed.get(u.key.as_ref()) {
            out.push(streamed_parts(u, s)?);
        }
    }
    Ok(out)
}

/// The upload of a file some of whose parts went up while it was written: the parts
/// of its final length that are sent and final are kept; the others (the last, parts
/// written again) are sent from the staged file, which still holds them.
fn streamed_parts<'a>(u: &'a Upload, s: &StreamedUpload) -> Result<Multipart<'a>> {
    let n = u.size.div_ceil(s.part).max(1);
    let mut done = HashMap::new();
    for k in 0..n {
        let full = (k + 1) * s.part <= u.size;
        match s.done.get(&k) {
            Some(id) if full => {
                done.insert(k, id.clone());
            }
            _ if s.released.contains(&k) => {
                return Err(Error::Io {
                    path: u.local.clone(),
                    source: std::io::Error::other(format!(
                        "part {k} was uploaded and released, then changed (the file was cut short)"
                    )),
                })
            }
            _ => {}
        }
    }
    Ok(Multipart {
        upload: u,
        id: s.upload.clone(),
        part: s.part,
        done,
    })
}

/// Sends every part of every upload that is not in its `done`, [`UPLOADS`] at a time
/// (memory: that many parts); each upload's part ids in order.
fn send_parts(
    mp: &Arc<dyn object_store::multipart::MultipartStore>,
    url: &ObjectUrl,
    files: &[Multipart<'_>],
) -> Result<Vec<Vec<PartId>>> {
    let jobs: Vec<(usize, u64)> = files
        .iter()
        .enumerate()
        .flat_map(|(j, m)| {
            (0..m.upload.size.div_ceil(m.part).max(1))
                .filter(|p| !m.done.contains_key(p))
                .map(move |p| (j, p))
        })
        .collect();
    let sent: Vec<(usize, u64, PartId)> = block_on(
        futures::stream::iter(jobs.into_iter().map(|(j, p)| {
            let mp = mp.clone();
            let m = &files[j];
            async move {
                let start = p * m.part;
                let bytes = read_at(&m.upload.local, start, m.part.min(m.upload.size - start))?;
                let pid = mp
                    .put_part(&m.upload.key, &m.id, p as usize, PutPayload::from(bytes))
                    .await
                    .map_err(|e| Error::from_store(&shown(url, &m.upload.key), e))?;
                Ok::<_, Error>((j, p, pid))
            }
        }))
        .buffer_unordered(UPLOADS)
        .try_collect(),
    )?;
    let mut parts: Vec<Vec<Option<PartId>>> = files
        .iter()
        .map(|m| {
            (0..m.upload.size.div_ceil(m.part).max(1))
                .map(|p| m.done.get(&p).cloned())
                .collect()
        })
        .collect();
    for (j, p, pid) in sent {
        parts[j][p as usize] = Some(pid);
    }
    Ok(parts
        .into_iter()
        .map(|ps| {
            ps.into_iter()
                .map(|p| p.expect("every part was sent"))
                .collect()
        })
        .collect())
}

fn read_at(path: &Path, start: u64, len: u64) -> Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).at(path)?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, start).at(path)?;
    Ok(buf)
}

/// Prepares `path` (a URL) for writers that each stage part of it ([`stage_files`]):
/// acts on the journals a killed run left (aborts its uploads, deletes what it
/// completed) and refuses an output already there. Called once, before any writer
/// stages.
///
/// # Errors
/// An output at the URL; failed requests; a read-only store.
pub fn prepare_staged(path: &Path) -> Result<()> {
    let url = ObjectUrl::parse(path)?;
    if !url.writable() {
        return Err(Error::BadUrl {
            url: url.to_string(),
            problem: "http(s) URLs are read-only: write to s3://, gs:// or az://".into(),
        });
    }
    let store = store_for(&url)?;
    clean_up(&store, &url)?;
    let prefix = Key::from(url.key());
    let any = block_on(async { store.objects.list(Some(&prefix)).next().await.transpose() })
        .map_err(|e| Error::from_store(&url.to_string(), e))?;
    if any.is_some() {
        return Err(Error::Exists {
            url: url.to_string(),
        });
    }
    Ok(())
}

/// Uploads the files under `local` (one writer's part of the output at `path`, a
/// URL; their keys are their paths relative to `local`) as multipart uploads whose
/// parts are all sent and which are not completed, so nothing is visible yet; a journal
/// (`<output>.ckpt-partial/<writer>.json`) names them for the clean-up after a kill.
/// Returns what [`commit_staged`] needs to complete them (JSON).
///
/// # Errors
/// Failed requests; an empty file (a multipart upload needs a part).
pub fn stage_files(
    local: &Path,
    path: &Path,
    writer: u64,
    stream: Option<&Stream>,
) -> Result<String> {
    let url = ObjectUrl::parse(path)?;
    let store = store_for(&url)?;
    let mp = store.multipart.clone().ok_or_else(|| Error::BadUrl {
        url: url.to_string(),
        problem: "this store takes no multipart uploads".into(),
    })?;
    let streamed = match stream {
        Some(s) => s.0.finish()?,
        None => HashMap::new(),
    };
    let uploads = files(local, &url)?;
    if let Some(u) = uploads.iter().find(|u| u.size == 0) {
        return Err(Error::Io {
            path: u.local.clone(),
            source: std::io::Error::other("an empty file cannot be staged as a multipart upload"),
        });
    }
    let part = uploads
        .iter()
        .map(|u| crate::stream::part_bytes(u.size))
        .max()
        .unwrap_or(PART_BYTES);
    // Every file is a multipart upload here (rank 0 completes them all).
    let sending = multiparts(&mp, &url, &uploads, part, &streamed, |_| true)?;
    let named: Vec<(&str, Option<&str>)> = sending
        .iter()
        .map(|m| (m.upload.key.as_ref(), Some(m.id.as_str())))
        .collect();
    let jk = journal_key(&url, writer);
    block_on(
        store
            .objects
            .put(&jk, PutPayload::from(journal_text(&named, false))),
    )
    .map_err(|e| Error::from_store(&shown(&url, &jk), e))?;
    let parts: Vec<Vec<String>> = send_parts(&mp, &url, &sending)?
        .into_iter()
        .map(|ps| ps.into_iter().map(|p| p.content_id).collect())
        .collect();
    Ok(serde_json::json!({
        "writer": writer,
        "files": sending.iter().zip(&parts).map(|(m, ps)| serde_json::json!({
            "key": m.upload.key.as_ref(), "upload": m.id, "parts": ps, "last": m.upload.last,
        })).collect::<Vec<_>>(),
    })
    .to_string())
}

/// Completes the uploads every writer staged ([`stage_files`]'s JSON, one per writer)
/// into the output at `path`: the data first, the entry files ([`COMMIT_LAST`]) last,
/// then deletes the journals. On a failure the uploads are aborted and what completed
/// deleted.
///
/// # Errors
/// A staged description that is not [`stage_files`]'s; failed requests.
pub fn commit_staged(path: &Path, staged: &[String]) -> Result<()> {
    let url = ObjectUrl::parse(path)?;
    let store = store_for(&url)?;
    let mp = store.multipart.clone().ok_or_else(|| Error::BadUrl {
        url: url.to_string(),
        problem: "this store takes no multipart uploads".into(),
    })?;
    let bad = |what: &str| Error::BadUrl {
        url: url.to_string(),
        problem: format!("a staged part of the output is not ckpt's description: {what}"),
    };
    let mut all: Vec<(Key, String, Vec<PartId>, bool)> = Vec::new();
    for text in staged {
        let doc: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
        for f in doc
            .get("files")
            .and_then(|v| v.as_array())
            .ok_or_else(|| bad("no files"))?
        {
            let key = f
                .get("key")
                .and_then(|v| v.as_str())
                .ok_or_else(|| bad("a file without a key"))?;
            let id = f
                .get("upload")
                .and_then(|v| v.as_str())
                .ok_or_else(|| bad("a file without an upload"))?;
            let parts = f
                .get("parts")
                .and_then(|v| v.as_array())
                .ok_or_else(|| bad("a file without parts"))?
                .iter()
                .map(|p| {
                    p.as_str().map(|c| PartId {
                        content_id: c.to_string(),
                    })
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("a part that is not a string"))?;
            let last = f.get("last").and_then(|v| v.as_bool()).unwrap_or(false);
            all.push((Key::from(key), id.to_string(), parts, last));
        }
    }
    let result = (|| -> Result<()> {
        for last in [false, true] {
            block_on(
                futures::stream::iter(all.iter().filter(|f| f.3 == last).map(
                    |(key, id, parts, _)| {
                        let mp = mp.clone();
                        let url = &url;
                        async move {
                            mp.complete_multipart(key, id, parts.clone())
                                .await
                                .map(|_| ())
                                .map_err(|e| Error::from_store(&shown(url, key), e))
                        }
                    },
                ))
                .buffer_unordered(UPLOADS)
                .try_collect::<Vec<()>>(),
            )?;
        }
        Ok(())
    })();
    match result {
        Ok(()) => {
            let journals: Vec<Key> = block_on(
                store
                    .objects
                    .list(Some(&journal_prefix(&url)))
                    .map_ok(|m| m.location)
                    .try_collect(),
            )
            .map_err(|e| Error::from_store(&url.to_string(), e))?;
            block_on(async {
                for j in &journals {
                    store.objects.delete(j).await?;
                }
                Ok::<(), object_store::Error>(())
            })
            .map_err(|e| Error::from_store(&url.to_string(), e))
        }
        Err(e) => {
            let _ = clean_up(&store, &url);
            Err(e)
        }
    }
}

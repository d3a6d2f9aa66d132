//! The stores: one `object_store` client per store root (scheme and bucket), built from
//! the configuration users already have, and the runtime their requests run on.

use crate::error::{Error, Result};
use crate::location::ObjectUrl;
use object_store::multipart::MultipartStore;
use object_store::{ObjectStore, RetryConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// A store: the client and, where the store has one, its multipart interface (with
/// upload ids, which the journal records so that a later run can abort them).
pub(crate) struct Store {
    pub(crate) objects: Arc<dyn ObjectStore>,
    pub(crate) multipart: Option<Arc<dyn MultipartStore>>,
}

/// Runs `f` to completion on the storage runtime (a small multi-threaded tokio runtime
/// shared by the whole process; the caller's thread blocks).
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

/// The runtime (created on first use).
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("ckpt-storage")
            .enable_all()
            .build()
            .expect("the storage runtime starts")
    })
}

/// What to do when a demand-paged read cannot be served (the store is gone after the
/// retries): the reading thread waits in a page fault and cannot be given an error, so
/// the process says which object failed and exits with code 1 after this hook has
/// removed its temporaries (ckpt-core sets it to its SIGBUS clean-up).
pub fn set_fatal_hook(hook: fn()) {
    let _ = FATAL_HOOK.set(hook);
}

static FATAL_HOOK: OnceLock<fn()> = OnceLock::new();

pub(crate) fn fatal(message: &str) -> ! {
    eprintln!("ckpt: error: {message}; nothing was written");
    if let Some(h) = FATAL_HOOK.get() {
        h();
    }
    std::process::exit(1)
}

/// Retries: object_store's exponential backoff (100 ms doubling, up to 15 s) on
/// throttling, server errors and dropped connections, at most 5 times and 60 s per
/// request (object_store's own default, 10 times and 3 minutes, leaves a stopped
/// server unreported for minutes). `CKPT_STORAGE_RETRIES` overrides the count.
fn retry() -> RetryConfig {
    let max_retries = std::env::var("CKPT_STORAGE_RETRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    RetryConfig {
        max_retries,
        retry_timeout: Duration::from_secs(60),
        ..RetryConfig::default()
    }
}

/// The store of `url` (built once per root and kept).
pub(crate) fn store_for(url: &ObjectUrl) -> Result<Arc<Store>> {
    static STORES: Mutex<Option<HashMap<String, Arc<Store>>>> = Mutex::new(None);
    let root = url.client_root();
    // Keyed by the configuration too: a process whose environment changes (a test's
    // new endpoint, a new profile) gets a new client, not one bound to the old settings.
    let mut config: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            ["AWS_", "GOOGLE_", "AZURE_", "HOME"]
                .iter()
                .any(|p| k.starts_with(p))
        })
        .collect();
    config.sort();
    let key = format!("{root}\n{config:?}");
    let mut stores = STORES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(s) = stores.get_or_insert_with(HashMap::new).get(&key) {
        return Ok(s.clone());
    }
    let bad = |e: object_store::Error| Error::BadUrl {
        url: url.to_string(),
        problem: e.to_string(),
    };
    // HTTPS through rustls with ring (storage/Cargo.toml): the process's provider,
    // installed once before the first client is built (an error only says that one
    // is installed already).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let store = match url.scheme() {
        "s3" | "s3a" => {
            let mut b = object_store::aws::AmazonS3Builder::from_env();
            for (k, v) in aws_files() {
                b = b.with_config(k, v);
            }
            // AWS_ENDPOINT_URL (the AWS CLI's and SDKs' name) where AWS_ENDPOINT is not set.
            if std::env::var_os("AWS_ENDPOINT").is_none() {
                if let Ok(e) = std::env::var("AWS_ENDPOINT_URL") {
                    b = b.with_endpoint(e);
                }
            }
            let s = Arc::new(
                b.with_url(root.clone())
                    .with_retry(retry())
                    .build()
                    .map_err(bad)?,
            );
            Store {
                objects: s.clone(),
                multipart: Some(s),
            }
        }
        "gs" => {
            let s = Arc::new(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(root.clone())
                    .with_retry(retry())
                    .build()
                    .map_err(bad)?,
            );
            Store {
                objects: s.clone(),
                multipart: Some(s),
            }
        }
        "az" | "abfs" | "abfss" => {
            let s = Arc::new(
                object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(root.clone())
                    .with_retry(retry())
                    .build()
                    .map_err(bad)?,
            );
            Store {
                objects: s.clone(),
                multipart: Some(s),
            }
        }
        _ => Store {
            objects: Arc::new(
                object_store::http::HttpBuilder::new()
                    .with_url(root.clone())
                    .with_retry(retry())
                    .build()
                    .map_err(bad)?,
            ),
            multipart: None,
        },
    };
    let store = Arc::new(store);
    stores
        .get_or_insert_with(HashMap::new)
        .insert(key, store.clone());
    Ok(store)
}

/// What the AWS shared files say for the profile in use (`AWS_PROFILE`, else
/// `default`), for the keys the environment does not set: `aws_access_key_id`,
/// `aws_secret_access_key` and `aws_session_token` from the credentials file
/// (`AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/credentials`), `region` and
/// `endpoint_url` from the config file (`AWS_CONFIG_FILE`, else `~/.aws/config`,
/// where profiles other than `default` are headed `[profile NAME]`).
fn aws_files() -> Vec<(object_store::aws::AmazonS3ConfigKey, String)> {
    use object_store::aws::AmazonS3ConfigKey as K;
    let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
    let file = |var: &str, name: &str| {
        std::env::var_os(var)
            .map(std::path::PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
    };
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    let section = |path: Option<std::path::PathBuf>, header: &str| {
        path.and_then(|p| ini::Ini::load_from_file(p).ok())
            .and_then(|i| {
                i.section(Some(header)).map(|s| {
                    s.iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect::<HashMap<_, _>>()
                })
            })
            .unwrap_or_default()
    };
    let creds = section(file("AWS_SHARED_CREDENTIALS_FILE", "credentials"), &profile);
    let config_header = if profile == "default" {
        "default".to_string()
    } else {
        format!("profile {profile}")
    };
    let config = section(file("AWS_CONFIG_FILE", "config"), &config_header);
    let mut out = Vec::new();
    let mut take = |map: &HashMap<String, String>, name: &str, env: &str, key: K| {
        if std::env::var_os(env).is_none() {
            if let Some(v) = map.get(name) {
                out.push((key, v.clone()));
            }
        }
    };
    take(
        &creds,
        "aws_access_key_id",
        "AWS_ACCESS_KEY_ID",
        K::AccessKeyId,
    );
    take(
        &creds,
        "aws_secret_access_key",
        "AWS_SECRET_ACCESS_KEY",
        K::SecretAccessKey,
    );
    take(&creds, "aws_session_token", "AWS_SESSION_TOKEN", K::Token);
    take(&config, "region", "AWS_DEFAULT_REGION", K::Region);
    if std::env::var_os("AWS_ENDPOINT_URL").is_none() {
        take(&config, "endpoint_url", "AWS_ENDPOINT", K::Endpoint);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    /// HTTPS goes through rustls with the ring provider `store_for` installs (reqwest's
    /// rustls brings none of its own here): a request to a port where nothing listens
    /// is an error, not a panic for want of a provider.
    #[test]
    fn https_requests_fail_as_errors_not_panics() {
        let url = ObjectUrl::parse(std::path::Path::new("https://127.0.0.1:9/ckpt/x")).unwrap();
        let store = store_for(&url).unwrap();
        let got = block_on(store.objects.head(&object_store::path::Path::from("x")));
        let e = got.expect_err("nothing listens on port 9");
        assert!(e.to_string().contains("127.0.0.1"), "{e}");
    }
}

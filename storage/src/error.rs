//! The storage layer's errors: each names the object (as a URL without credentials)
//! and what went wrong.

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong reaching a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not a URL ckpt reads or writes.
    #[error("{url}: {problem}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Nothing at the URL: no object and no object under it as a prefix.
    #[error("{url}: no such object or prefix")]
    NotFound {
        /// The URL.
        url: String,
    },
    /// The store refused the credentials or the access.
    #[error("{url}: access denied ({detail}): check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY)")]
    Denied {
        /// The URL.
        url: String,
        /// The store's words.
        detail: String,
    },
    /// Any other failure of a request, after the retries.
    #[error("{url}: {detail}")]
    Request {
        /// The object or prefix.
        url: String,
        /// The store's words.
        detail: String,
    },
    /// An output exists and was not to be replaced.
    #[error("{url} already exists (use --force to replace it)")]
    Exists {
        /// The output.
        url: String,
    },
    /// A local file of the staging or mirror tree.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// Words an `object_store` error about `url`, with the retries already spent.
    pub(crate) fn from_store(url: &str, e: object_store::Error) -> Error {
        use object_store::Error as E;
        match e {
            E::NotFound { .. } => Error::NotFound { url: url.into() },
            E::PermissionDenied { source, .. } | E::Unauthenticated { source, .. } => {
                Error::Denied {
                    url: url.into(),
                    detail: source.to_string(),
                }
            }
            other => {
                let detail = other.to_string();
                // S3 says a missing bucket and bad keys in its error body, which
                // object_store passes on in a generic error.
                if detail.contains("NoSuchBucket") {
                    Error::Request {
                        url: url.into(),
                        detail: "no such bucket".into(),
                    }
                } else if [
                    "InvalidAccessKeyId",
                    "SignatureDoesNotMatch",
                    "AccessDenied",
                    "403 Forbidden",
                ]
                .iter()
                .any(|w| detail.contains(w))
                {
                    Error::Denied {
                        url: url.into(),
                        detail,
                    }
                } else {
                    Error::Request {
                        url: url.into(),
                        detail,
                    }
                }
            }
        }
    }
}

pub(crate) trait IoAt<T> {
    fn at(self, path: &std::path::Path) -> Result<T>;
}

impl<T> IoAt<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

//! Where checkpoints live: local files and object stores (`s3://`, `gs://`, `az://`,
//! read-only `http(s)://`) behind one layer, so that every reader and writer of ckpt
//! works on both without learning which it has.
//!
//! - **Reading** ([`mirror`]): a URL's objects are listed once and laid out as a local
//!   tree of the same names and sizes (small objects downloaded, large ones sparse
//!   placeholders), so discovery walks it as it walks a directory; a placeholder's
//!   bytes come on demand: [`paged`] maps it with pages fetched in large ranged
//!   requests on first touch (Linux `userfaultfd`), read ahead, and dropped again under
//!   a fixed budget; where `userfaultfd` is not allowed, [`materialize`] streams the
//!   object into its placeholder first.
//! - **Writing** ([`Output`]): an output URL is written to a local staging directory by
//!   the ordinary writers, then published: every large file as a multipart upload whose
//!   parts go in parallel and which completes only when all are sent, small files as
//!   single atomic puts, and each format's entry file (the index, `.metadata`,
//!   `latest`) last; a journal beside the output lets the next run clean up after a
//!   killed one (docs/storage.md).
//! - **Where**: [`ObjectUrl`] parses the URLs; the stores are Apache Arrow's
//!   `object_store`, configured the way users already configure them (the AWS variables
//!   and files, `AWS_ENDPOINT_URL`; the GCS and Azure variables).

mod error;
mod location;
mod mirror;
pub mod paged;
pub use crate::paged::Paged;
mod publish;
mod store;

pub use crate::error::{Error, Result};
pub use crate::location::{is_url, ObjectUrl};
pub use crate::mirror::{
    materialize, mirror, placeholder, read_whole, unmirror_text, Mirror, RemoteObject,
    SMALL_OBJECT_BYTES,
};
pub use crate::publish::{
    commit_staged, prepare_staged, stage_files, Output, COMMIT_LAST, PART_BYTES, UPLOADS,
};
pub use crate::store::set_fatal_hook;

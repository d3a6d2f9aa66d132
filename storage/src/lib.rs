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
//!   the ordinary writers, whose whole parts go up as multipart-upload parts while they
//!   write (and leave the disk: [`stream_file`]); then it is published: the rest of
//!   every part sent, each upload completed only when all its parts are, small files
//!   as single atomic puts, and each format's entry file (the index, `.metadata`,
//!   `latest`) last; journals beside the output let the next run clean up after a
//!   killed one (docs/storage.md).
//! - **Where**: [`ObjectUrl`] parses the URLs; the stores are Apache Arrow's
//!   `object_store`, configured the way users already configure them (the AWS variables
//!   and files, `AWS_ENDPOINT_URL`; the GCS and Azure variables).

mod error;
mod journal;
mod location;
mod mirror;
pub mod paged;
pub use crate::paged::Paged;
mod publish;
mod store;
mod stream;

pub use crate::error::{Error, Result};
pub use crate::location::{is_url, ObjectUrl};
pub use crate::mirror::{
    materialize, mirror, placeholder, read_whole, unmirror_text, Mirror, RemoteObject,
    SMALL_OBJECT_BYTES,
};
pub use crate::publish::{
    commit_staged, prepare_staged, stage_files, Output, COMMIT_LAST, UPLOADS,
};
pub use crate::store::set_fatal_hook;
pub use crate::stream::{
    alias_dir, stream_file, unalias_dir, FileStream, Stream, PART_BYTES, STREAM_UPLOADS,
};

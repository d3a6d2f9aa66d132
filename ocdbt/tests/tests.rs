//! Integration tests of `ckpt-ocdbt`, built into one binary (`autotests = false`):
//! the orbax/tensorstore fixtures read, round trips through the writer, the damaged
//! input catalogue, and (with `CKPT_PYTHON_JAX`) tensorstore and orbax reading what the
//! writer wrote.

mod damage;
mod fixtures;
mod round_trip;
mod tensorstore;
mod util;

//! Plan report (in progress).

//! The HTML report (in progress).

//! What the commands say about their work, as text for a terminal or as JSON: the
//! `inspect` table, the `verify` verdict, the summaries of a copy, a conversion and a
//! reshard plan. The CLI only prints these; the Python package and tests can read the
//! same words.

mod inspect;
mod summary;
mod verify;

pub use self::inspect::{inspect_json, inspect_text, placements_text};
pub use self::summary::{
    convert_json, convert_text, merge_plan_json, merge_plan_text, plan_json, plan_text, CopySummary,
};
pub use self::verify::{verify_json, verify_text};

/// A byte count for people: `1.50 GB`, `12.00 kB`, `7 B`.
#[must_use]
pub fn human_bytes(n: u64) -> String {
    let n = n as f64;
    for (unit, div) in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)] {
        if n >= div {
            return format!("{:.2} {unit}", n / div);
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn human_bytes_picks_the_unit() {
        assert_eq!(human_bytes(7), "7 B");
        assert_eq!(human_bytes(12_000), "12.00 kB");
        assert_eq!(human_bytes(1_500_000_000), "1.50 GB");
    }
}

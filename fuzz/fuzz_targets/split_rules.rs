//! The split-rules parser (a strategy file's `rules` section) must never panic; what it
//! accepts must answer name lookups.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = ckpt_core::layout::split_rules::is_split_rules(data);
    let Ok(rules) =
        ckpt_core::layout::split_rules::SplitRules::parse(text, std::path::Path::new("rules.json"))
    else {
        return;
    };
    let _ = rules.is_empty();
});

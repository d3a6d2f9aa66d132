//! Layout pictures (issue 27): `inspect --show`, `inspect --json` pieces, `inspect
//! --html`, and the reshard plan's reads against what the copy then reports.

use crate::util::Dir;

#[test]
fn show_draws_the_uneven_vocabulary_split() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    // 37 rows over 4 ranks as torch.chunk cuts them: 10, 10, 10, 7.
    let o = d.ok(&["inspect", "ex", "--show", "embed.weight"]);
    let s = &o.stdout;
    assert!(!s.contains('\x1b'), "no colours off a terminal: {s}");
    assert!(
        s.starts_with("tensor `embed.weight`  BF16 [37, 16]  4 piece(s) in 4 file(s)"),
        "{s}"
    );
    for (r, rows) in ["0..10", "10..20", "20..30", "30..37"].iter().enumerate() {
        let bytes = if r == 3 { 7 * 16 * 2 } else { 10 * 16 * 2 };
        assert!(
            s.contains(&format!("  {r}  rank {r}  [{rows}, 0..16]  {bytes} B\n")),
            "{s}"
        );
    }
    // 37 rows drawn on 32 lines: each rank's rows are its own run of lines.
    let grid: Vec<String> = s
        .lines()
        .filter(|l| l.contains(" |"))
        .map(|l| {
            l.split('|')
                .nth(1)
                .unwrap()
                .chars()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect()
        })
        .collect();
    assert_eq!(grid.len(), 32);
    assert_eq!(grid.first().unwrap(), "0");
    assert_eq!(grid.last().unwrap(), "3");
    let mut order = grid.clone();
    order.dedup();
    assert_eq!(order, ["0", "1", "2", "3"]);
}

#[test]
fn show_takes_globs_and_names_a_miss() {
    let d = Dir::new();
    d.example("ex", "dp=2,tp=2");
    let o = d.ok(&["inspect", "ex", "--show", "layers.*.attn.qkv.weight"]);
    assert_eq!(
        o.stdout.matches("tensor `layers.").count(),
        2,
        "{}",
        o.stdout
    );
    // Replicated data is written once: the dp=1 ranks hold nothing, and say so.
    assert!(
        o.stdout
            .contains("  -  holds nothing of it: rank 2, rank 3\n"),
        "{}",
        o.stdout
    );
    let o = d.fails(&["inspect", "ex", "--show", "nope*"]);
    assert!(
        o.stderr.contains("no tensor matches `nope*`"),
        "{}",
        o.stderr
    );
}

#[test]
fn json_pieces_tile_each_tensor() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    let o = d.ok(&["inspect", "ex", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    for t in v["tensors"].as_array().unwrap() {
        let numel: u64 = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .product();
        let owned: u64 = t["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| !p["copy"].as_bool().unwrap())
            .map(|p| {
                p["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .product::<u64>()
            })
            .sum();
        assert_eq!(owned, numel, "{}", t["name"]);
    }
    let o = d.ok(&["inspect", "ex", "--show", "embed.weight", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let p = &v["tensors"][0]["pieces"];
    assert_eq!(p[3]["start"], serde_json::json!([30, 0]));
    assert_eq!(p[3]["shape"], serde_json::json!([7, 16]));
    assert_eq!(p[3]["rank"], 3);
}

#[test]
fn html_report_is_one_self_contained_file() {
    let d = Dir::new();
    d.example("ex", "tp=2");
    let o = d.ok(&["inspect", "ex", "--html", "r.html"]);
    assert!(o.stderr.contains("wrote r.html"), "{}", o.stderr);
    let page = std::fs::read_to_string(d.path("r.html")).unwrap();
    // The one URL is SVG's namespace name, an identifier that is never fetched.
    let bare = page.replace("\"http://www.w3.org/2000/svg\"", "");
    for fetch in [
        "src=",
        "href=",
        "url(",
        "@import",
        "fetch(",
        "XMLHttpRequest",
        "http://",
        "https://",
    ] {
        assert!(!bare.contains(fetch), "the report fetches nothing: {fetch}");
    }
    let start = page
        .find(r#"<script type="application/json" id="data">"#)
        .unwrap();
    let json = &page[start..];
    let json = &json[json.find('>').unwrap() + 1..json.find("</script>").unwrap()];
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let o = d.ok(&["inspect", "ex", "--json"]);
    let inspect: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(
        v["tensors"].as_array().unwrap().len(),
        inspect["tensors"].as_array().unwrap().len()
    );
    assert_eq!(v["summary"]["ranks"], 2);
    // No temporary file is left beside it.
    let names: Vec<_> = std::fs::read_dir(d.tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn plan_reads_are_what_the_reshard_then_reports() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    let o = d.ok(&["reshard", "ex", "-o", "r3", "--to", "3", "--plan", "--json"]);
    let plan: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert!(!d.path("r3").exists());
    let files = plan["files"].as_array().unwrap();
    assert_eq!(files.len(), 3);
    for f in files {
        let reads = f["reads"].as_array().unwrap();
        let sum: u64 = reads.iter().map(|r| r["bytes"].as_u64().unwrap()).sum();
        assert_eq!(sum, f["bytes_read"].as_u64().unwrap());
        for r in reads {
            let (a, b) = (
                r["span"][0].as_u64().unwrap(),
                r["span"][1].as_u64().unwrap(),
            );
            assert!(b - a >= r["bytes"].as_u64().unwrap(), "{r}");
            assert!(r["path"].as_str().unwrap().contains("ckpt_"), "{r}");
        }
    }
    let largest = files
        .iter()
        .map(|f| f["bytes_read"].as_u64().unwrap())
        .max()
        .unwrap();
    assert_eq!(plan["largest_read"]["bytes"], largest);
    let o = d.ok(&["reshard", "ex", "-o", "r3", "--to", "3", "--json"]);
    let done: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(done["bytes_read"], plan["bytes_read"]);
    assert_eq!(done["bytes_written"], plan["bytes_written"]);
    let o = d.ok(&["reshard", "ex", "-o", "r3b", "--to", "3", "--plan"]);
    assert!(o.stdout.contains("total: reads "), "{}", o.stdout);
    assert!(o.stdout.contains("largest read: "), "{}", o.stdout);
    assert!(o.stdout.contains("embed.weight  bytes "), "{}", o.stdout);
}

#[test]
fn show_draws_a_missing_rank_as_a_gap() {
    let d = Dir::new();
    d.example("ex", "tp=4");
    std::fs::remove_dir_all(d.path("ex/ckpt_2")).unwrap();
    // The picture is drawn all the same, the hole marked, and the exit says a problem.
    let o = d.fails(&["inspect", "ex", "--show", "embed.weight"]);
    let gap_rows: Vec<&str> = o
        .stdout
        .lines()
        .filter(|l| l.contains(" |") && l.split('|').nth(1).unwrap().chars().all(|c| c == '.'))
        .collect();
    // Rows 20..30 of 37 were rank 2's, one line per row.
    assert_eq!(gap_rows.len(), 10, "{}", o.stdout);
    assert!(gap_rows[0].trim_start().starts_with("20 |"), "{}", o.stdout);
    assert!(
        o.stdout.contains(". = held by no file: data missing"),
        "{}",
        o.stdout
    );
    assert!(
        o.stderr.contains("elements [20..30, 0..16] are missing"),
        "{}",
        o.stderr
    );
}

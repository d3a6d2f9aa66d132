//! The import graph of every crate of the workspace has no circle, and the layers keep
//! their order (docs/architecture.md): the layout algebra imports neither the formats
//! nor the engine, a format imports no other format (shared codecs apart), and the
//! engine names no format.
//!
//! A scan of the sources, not of the compiler's view: every `crate::…`, `super::…`,
//! `self::…` path (in `use` lines and in code, comments and test modules left out) is
//! resolved to the file that defines the module it names; a path through the crate
//! root's flat `pub use` list is followed to the module the name comes from. Each file
//! is one node; an edge is "this file names something of that file".

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One crate: its module files by module path (`""` is the root).
struct Crate {
    name: String,
    files: BTreeMap<String, PathBuf>,
}

/// The workspace's crates (library and binary roots; `src/bin/*` are their own roots).
fn crates() -> Vec<Crate> {
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut out = Vec::new();
    for (name, dir, root) in [
        ("ckpt-core", "ckpt-core/src", "lib.rs"),
        ("ckpt-storage", "storage/src", "lib.rs"),
        ("ckpt-python", "python/src", "lib.rs"),
        ("ckpt-merge", "merge/src", "lib.rs"),
        ("ckpt-reshard", "reshard/src", "lib.rs"),
        ("ckpt-train", "train/src", "lib.rs"),
        ("ckpt-infer", "infer/src", "lib.rs"),
        ("ckpt", "src", "main.rs"),
    ] {
        let dir = ws.join(dir);
        if !dir.join(root).is_file() {
            continue;
        }
        let mut files = BTreeMap::new();
        files.insert(String::new(), dir.join(root));
        collect(&dir, &dir, &mut files);
        out.push(Crate {
            name: name.into(),
            files,
        });
    }
    out
}

/// Every `*.rs` under `dir` by module path (`a/b.rs` is `a::b`), roots and `bin/` aside.
fn collect(base: &Path, dir: &Path, files: &mut BTreeMap<String, PathBuf>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        let rel = p.strip_prefix(base).unwrap();
        if rel.starts_with("bin") {
            continue;
        }
        if p.is_dir() {
            collect(base, &p, files);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let rel = rel.with_extension("");
            let parts: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if parts == ["lib"] || parts == ["main"] {
                continue;
            }
            let module = if parts.last().is_some_and(|l| l == "mod") {
                parts[..parts.len() - 1].join("::")
            } else {
                parts.join("::")
            };
            files.insert(module, p);
        }
    }
}

/// The file's code: line comments, and the test module at its end, removed.
fn code(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap();
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|n| n.trim_start().starts_with("mod "))
        {
            break;
        }
        let kept = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(kept);
        out.push('\n');
    }
    out
}

/// Every path a file names, each as its segments: `use` trees expanded
/// (`crate::a::{b, c::D}` gives `crate::a::b` and `crate::a::c::D`), plus the paths in
/// code that start with `crate::`, `super::` or `self::`.
fn paths(code: &str) -> Vec<(Vec<String>, bool)> {
    let mut out = Vec::new();
    let mut rest = code;
    // The code with its `use` statements blanked, for the scan of paths in code.
    let mut body = code.to_string();
    // `use` statements (with `pub`/`pub(crate)` in front or not).
    while let Some(i) = find_use(rest) {
        let after = &rest[i..];
        let Some(end) = after.find(';') else { break };
        // `X as Y` keeps `X`: the alias is marked before whitespace goes.
        let spaced = after[4..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let tree: String = spaced
            .replace(" as ", "@")
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        let mut found = Vec::new();
        expand(&tree, &[], &mut found);
        // `pub use` / `pub(crate) use`: a re-export.
        let reexport = rest[..i].trim_end().ends_with("pub") || rest[..i].trim_end().ends_with(')');
        out.extend(found.into_iter().map(|p| (p, reexport)));
        let at = code.len() - after.len();
        body.replace_range(at..at + end, &" ".repeat(end));
        rest = &after[end..];
    }
    // Paths in code.
    let code = body.as_str();
    let bytes = code.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        for (i, _) in code.match_indices(start) {
            if i > 0
                && (bytes[i - 1].is_ascii_alphanumeric()
                    || bytes[i - 1] == b'_'
                    || bytes[i - 1] == b':')
            {
                continue;
            }
            let seg: String = code[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let p = seg
                .split("::")
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            out.push((p, false));
        }
    }
    out
}

/// The code with its `use` statements blanked.
fn blank_uses(code: &str) -> String {
    let mut body = code.to_string();
    let mut rest = code;
    while let Some(i) = find_use(rest) {
        let after = &rest[i..];
        let Some(end) = after.find(';') else { break };
        let at = code.len() - after.len();
        body.replace_range(at..at + end, &" ".repeat(end));
        rest = &after[end..];
    }
    body
}

/// Position of the next `use ` keyword that begins a statement.
fn find_use(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(j) = s[from..].find("use ") {
        let i = from + j;
        let before = if i == 0 { b'\n' } else { b[i - 1] };
        if matches!(before, b'\n' | b' ' | b'\t' | b')' | b'{' | b';') {
            return Some(i);
        }
        from = i + 4;
    }
    None
}

/// Expands a `use` tree (whitespace removed) under `prefix`.
fn expand(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let (head, group) = match tree.find('{') {
        Some(i) if tree.ends_with('}') => (&tree[..i], Some(&tree[i + 1..tree.len() - 1])),
        _ => (tree, None),
    };
    let mut p: Vec<String> = prefix.to_vec();
    for s in head.split("::").filter(|s| !s.is_empty()) {
        let s = s.split('@').next().unwrap_or(s);
        p.push(s.to_string());
    }
    match group {
        None => {
            if let Some(last) = p.last_mut() {
                *last = last.split('@').next().unwrap_or("").to_string();
            }
            out.push(p)
        }
        Some(g) => {
            for item in split_top(g) {
                expand(item, &p, out);
            }
        }
    }
}

/// Splits `a,b::{c,d},e` at the commas outside braces.
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut last) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[last..i]);
                last = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[last..]);
    out.into_iter().filter(|x| !x.is_empty()).collect()
}

/// The module a path names, from module `from`: the longest prefix that is a module
/// file; a name re-exported by the crate root is followed to where it comes from.
fn resolve(
    c: &Crate,
    from: &str,
    path: &[String],
    root_names: &BTreeMap<String, String>,
) -> Option<String> {
    let mut base: Vec<String> = if from.is_empty() {
        vec![]
    } else {
        from.split("::").map(String::from).collect()
    };
    let mut segs = path;
    match segs.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            segs = &segs[1..];
        }
        Some("super") => {
            while segs.first().is_some_and(|s| s == "super") {
                base.pop();
                segs = &segs[1..];
            }
        }
        Some("self") => segs = &segs[1..],
        Some(first) => {
            // A relative path: a child module of `from`, else not ours.
            let mut child = base.clone();
            child.push(first.to_string());
            if !c.files.contains_key(&child.join("::")) {
                return None;
            }
        }
        None => return None,
    }
    let mut full = base;
    full.extend(segs.iter().cloned());
    for n in (0..=full.len()).rev() {
        let m = full[..n].join("::");
        if c.files.contains_key(&m) {
            if m.is_empty() {
                // Through the root: where the name is defined.
                return full.first().and_then(|name| root_names.get(name).cloned());
            }
            return Some(m);
        }
    }
    None
}

/// The crate root's `pub use` list: each name to the module it is taken from.
fn root_names(c: &Crate) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let root = code(&c.files[""]);
    for (p, _) in paths(&root) {
        if p.len() < 2 || p[0] != "crate" {
            continue;
        }
        let module = resolve(c, "", &p, &BTreeMap::new());
        if let Some(m) = module {
            out.insert(p.last().unwrap().clone(), m);
        }
    }
    // `pub use crate::a::b::{X as Y}` re-exports under `Y`: add the alias names too.
    for line in root.split(';') {
        let flat: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
        if !flat.contains("use crate::") {
            continue;
        }
        for piece in flat.split([',', '{', '}']) {
            if let Some((orig, alias)) = piece.split_once(" as ") {
                let orig = orig.trim().rsplit("::").next().unwrap_or("").to_string();
                if let Some(m) = out.get(&orig).cloned() {
                    out.insert(alias.trim().to_string(), m);
                }
            }
        }
    }
    out
}

/// The edges of a crate's graph (file to file, self-edges and the root left out).
fn graph(c: &Crate) -> BTreeMap<String, BTreeSet<String>> {
    let names = root_names(c);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, path) in &c.files {
        if m.is_empty() {
            continue;
        }
        let e = g.entry(m.clone()).or_default();
        let text = code(path);
        let mut found = paths(&text);
        // Paths in code through a child module (`ckptz::read(..)` in formats.rs).
        let body = blank_uses(&text);
        let prefix = if m.is_empty() {
            String::new()
        } else {
            format!("{m}::")
        };
        for child in c.files.keys().filter_map(|k| k.strip_prefix(&prefix)) {
            if child.contains("::") || child.is_empty() {
                continue;
            }
            let pat = format!("{child}::");
            let b = body.as_bytes();
            let used = body.match_indices(&pat).any(|(i, _)| {
                i == 0
                    || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':')
            });
            if used {
                found.push((vec!["self".to_string(), child.to_string()], false));
            }
        }
        for (p, reexport) in found {
            if let Some(t) = resolve(c, m, &p, &names) {
                // A module re-exporting its own submodules' items is their facade,
                // not a user of them (`comm.rs`: `pub use self::mpi::run_mpi`).
                let facade = reexport && t.starts_with(&format!("{m}::"));
                if &t != m && !t.is_empty() && !facade {
                    e.insert(t);
                }
            }
        }
    }
    g
}

/// A circle of the graph, if there is one (depth-first search).
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        mark: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        mark.insert(n.to_string(), Mark::Open);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match mark.get(m.as_str()).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let i = stack.iter().position(|s| s == m).unwrap();
                    let mut c = stack[i..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                Mark::New => {
                    if let Some(c) = visit(m, g, mark, stack) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        mark.insert(n.to_string(), Mark::Done);
        None
    }
    let mut mark = BTreeMap::new();
    for n in g.keys() {
        if mark.get(n.as_str()).copied().unwrap_or(Mark::New) == Mark::New {
            if let Some(c) = visit(n, g, &mut mark, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The modules that lie on a circle, by group (strongly connected components of more
/// than one module, Tarjan's algorithm), each with one circle through it.
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        on: BTreeSet<&'a str>,
        stack: Vec<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn strong<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        let g = t.g;
        for w in g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                strong(t, w);
                let l = t.low[w].min(t.low[v]);
                t.low.insert(v, l);
            } else if t.on.contains(w) {
                let l = t.index[w].min(t.low[v]);
                t.low.insert(v, l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        on: BTreeSet::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            strong(&mut t, v);
        }
    }
    t.out
}

/// Circles known and not yet cut, each with what cuts it: `(crate, its modules, how)`.
/// A circle that is not exactly one of these fails the test, so none is added unseen.
const KNOWN_CIRCLES: [(&str, &[&str], &str); 0] = [];

#[test]
fn no_import_cycle_in_any_crate() {
    let crates = crates();
    assert!(crates.len() >= 8, "workspace crates not found");
    let mut found = Vec::new();
    for c in &crates {
        let g = graph(c);
        for comp in circles(&g) {
            let known = KNOWN_CIRCLES
                .iter()
                .any(|(k, mods, _)| *k == c.name && mods.iter().eq(comp.iter()));
            if known {
                continue;
            }
            // One circle through the group, to say where to cut.
            let keep: BTreeSet<&String> = comp.iter().collect();
            let sub: BTreeMap<String, BTreeSet<String>> = comp
                .iter()
                .map(|m| {
                    let to = g[m].iter().filter(|t| keep.contains(t)).cloned().collect();
                    (m.clone(), to)
                })
                .collect();
            let cycle = find_cycle(&sub).unwrap_or_default();
            found.push(format!(
                "{}: {{{}}}, e.g. {}",
                c.name,
                comp.join(", "),
                cycle.join(" -> ")
            ));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// Modules of formats/ that are shared by the formats rather than formats themselves:
/// the reader and writer traits, the detection table, codecs, the output commit.
const SHARED: [&str; 6] = [
    "formats::reader",
    "formats::writer",
    "formats::detect",
    "formats::pickle",
    "formats::checksum",
    "formats::output",
];

/// A format built on another's codec, said here so that it is a decision, not drift:
/// `(format, the format it builds on, why)`.
const BUILDS_ON: [(&str, &str, &str); 14] = [
    (
        "formats::deepspeed_tp",
        "formats::deepspeed",
        "a tensor-parallel DeepSpeed checkpoint is one ZeRO checkpoint per rank, each read with the ZeRO reader",
    ),
    (
        "formats::deepspeed_tp",
        "formats::torch_save",
        "DeepSpeed's model states are torch.save archives (their values described in messages)",
    ),
    (
        "formats::deepspeed_write",
        "formats::deepspeed",
        "the ZeRO writer validates its source with the ZeRO reader first",
    ),
    (
        "formats::deepspeed_write",
        "formats::torch_save",
        "the ZeRO writer re-emits DeepSpeed's torch.save pickles around new partitions",
    ),
    (
        "formats::deepspeed_write",
        "formats::torch_write",
        "ZeRO optimizer states are written as torch.save archives",
    ),
    (
        "formats::ucp",
        "formats::torch_save",
        "a universal checkpoint's state files are torch.save archives",
    ),
    (
        "formats::ucp",
        "formats::torch_write",
        "a universal checkpoint is written as torch.save archives",
    ),
    (
        "formats::ucp",
        "formats::deepspeed",
        "a universal checkpoint is DeepSpeed's: it is converted from (and copies) a ZeRO tag directory's files, read with the ZeRO reader's helpers",
    ),
    (
        "formats::deepspeed",
        "formats::torch_save",
        "DeepSpeed's model and optimizer states are torch.save archives",
    ),
    (
        "formats::megatron",
        "formats::torch_save",
        "a legacy Megatron rank file (model_optim_rng.pt) is a torch.save archive",
    ),
    (
        "formats::megatron",
        "formats::distcp",
        "a Megatron dist_ckpt is a DCP directory: its dp_reshardable optimizer buckets are mapped to parameters in its metadata",
    ),
    (
        "formats::distcp",
        "formats::torch_save",
        "a .distcp file is a run of torch.save archives",
    ),
    (
        "formats::distcp",
        "formats::torch_write",
        "DCP output is written as torch.save archives",
    ),
    (
        "formats::ckptz",
        "formats::safetensors",
        "a .ckptz header is safetensors' JSON description plus chunk tables",
    ),
];

/// Engine modules that name a format on purpose: `(module, format, why)`.
const ENGINE_NAMES: [(&str, &str, &str); 2] = [
    (
        "engine::convert",
        "formats::ckptz",
        "`ckpt compress`/`decompress` is the conversion to and from .ckptz itself",
    ),
    (
        "engine::convert",
        "formats::safetensors",
        "compress keeps the safetensors header it read, to give it back byte for byte",
    ),
];

fn is_leaf_format(m: &str) -> bool {
    m.starts_with("formats::")
        && !SHARED
            .iter()
            .any(|s| m == *s || m.starts_with(&format!("{s}::")))
}

/// The format a module belongs to (`formats::ckptz::codec` is part of `formats::ckptz`).
fn format_of(m: &str) -> Option<String> {
    is_leaf_format(m).then(|| m.split("::").take(2).collect::<Vec<_>>().join("::"))
}

/// Every import of `g` (ckpt-core's graph) that goes against the layers.
fn violations(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut bad = Vec::new();
    for (from, tos) in g {
        for to in tos {
            let algebra = from == "layout" || from.starts_with("layout::");
            if algebra
                && (to == "formats"
                    || to.starts_with("formats::")
                    || to.starts_with("engine")
                    || to == "checkpoint"
                    || to.starts_with("checkpoint::"))
            {
                bad.push(format!("the algebra module {from} imports {to}"));
            }
            let engine = from == "engine" || from.starts_with("engine::");
            let named = format_of(to)
                .is_some_and(|f| ENGINE_NAMES.iter().any(|(m, g, _)| m == from && *g == f));
            if engine && is_leaf_format(to) && !named {
                bad.push(format!("the engine module {from} names the format {to}"));
            }
            if let (Some(a), Some(b)) = (format_of(from), format_of(to)) {
                if a != b && !BUILDS_ON.iter().any(|(x, y, _)| *x == a && *y == b) {
                    bad.push(format!("the format {from} imports the format {to}"));
                }
            }
            let writer = |m: &str| m == "write" || m.starts_with("write::");
            if !writer(from) && writer(to) {
                bad.push(format!(
                    "{from} imports the checkpoint writer {to}, the layer above every other"
                ));
            }
            if is_leaf_format(from)
                && (to.starts_with("engine")
                    || to == "checkpoint"
                    || to.starts_with("checkpoint::"))
            {
                bad.push(format!("the format {from} imports {to}, a layer above it"));
            }
        }
    }
    bad
}

#[test]
fn layers_import_downwards_only() {
    let core = crates()
        .into_iter()
        .find(|c| c.name == "ckpt-core")
        .unwrap();
    let bad = violations(&graph(&core));
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

/// The layer rules on a planted graph: each kind of upward import is caught, and the
/// allowed ones pass.
#[test]
fn layer_rules_catch_planted_violations() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut edge = |a: &str, b: &str| {
        g.entry(a.into()).or_default().insert(b.into());
    };
    edge("layout::plan", "layout::region"); // allowed
    edge("formats::safetensors", "formats"); // allowed: the interface
    edge("engine::copy", "formats::detect"); // allowed: the table
    edge("layout::plan", "checkpoint"); // algebra upwards
    edge("engine::copy", "formats::safetensors"); // engine names a format
    edge("formats::mindspore_ckpt", "formats::safetensors"); // format to format
    edge("formats::safetensors", "engine::copy"); // format upwards
    edge("write::megatron", "engine::copy"); // allowed: writers are the top floor
    edge("checkpoint::hf_view", "write::megatron"); // a writer imported from below
    let bad = violations(&g);
    assert_eq!(bad.len(), 5, "{bad:?}");
    assert!(
        bad.iter()
            .any(|b| b.contains("checkpoint::hf_view imports the checkpoint writer")),
        "{bad:?}"
    );
    assert!(
        bad.iter()
            .any(|b| b.contains("engine::copy names the format formats::safetensors")),
        "{bad:?}"
    );
}

/// The scanner itself: a planted circle is found, a chain is not one.
#[test]
fn cycle_finder_finds_a_planted_circle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert_eq!(find_cycle(&g), None);
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    g.entry("d".into()).or_default().insert("a".into());
    assert_eq!(
        circles(&g),
        vec![vec!["a".to_string(), "b".into(), "c".into()]]
    );
}

#[test]
fn use_trees_expand() {
    let p = paths("use crate::a::{b, c::{D, E as F}};\nfn f() { super::g::h(); }\n");
    let s: Vec<String> = p.iter().map(|(v, _)| v.join("::")).collect();
    assert!(s.contains(&"crate::a::b".to_string()), "{s:?}");
    assert!(s.contains(&"crate::a::c::D".to_string()), "{s:?}");
    assert!(s.contains(&"crate::a::c::E".to_string()), "{s:?}");
    assert!(s.contains(&"super::g::h".to_string()), "{s:?}");
}

/// What the crate root declares itself: its modules (`mod x;`, with a `#[path]` too)
/// and the items it defines (`struct`, `fn`, ...), as opposed to the names it
/// re-exports from below.
fn root_own_names(c: &Crate) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = c
        .files
        .keys()
        .filter(|k| !k.is_empty() && !k.contains("::"))
        .cloned()
        .collect();
    let root = code(&c.files[""]);
    let words: Vec<&str> = root
        .split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    for w in words.windows(2) {
        if matches!(
            w[0],
            "mod" | "struct" | "enum" | "fn" | "const" | "static" | "type" | "trait"
        ) {
            out.insert(w[1].to_string());
        }
    }
    out
}

/// Every `crate::Name` a module below the root names, where `Name` is not one of the
/// root's modules: an item reached through the root's re-exports, which hides the layer
/// it comes from (and may run back up).
fn through_root(c: &Crate) -> Vec<String> {
    let own = root_own_names(c);
    let mut bad = Vec::new();
    for (m, path) in &c.files {
        if m.is_empty() {
            continue;
        }
        for (p, _) in paths(&code(path)) {
            if p.len() >= 2 && p[0] == "crate" && !own.contains(&p[1]) {
                bad.push(format!(
                    "{}: {m} names crate::{}",
                    c.name,
                    p[1..].join("::")
                ));
            }
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

/// Inside a crate, modules import by module path (`crate::layout::region::Region`),
/// never an item through the root's `pub use` list (`crate::Region`): the root is the
/// public surface, not the internal wiring (docs/architecture.md).
#[test]
fn modules_import_by_module_path_not_through_the_root() {
    let bad: Vec<String> = crates().iter().flat_map(through_root).collect();
    assert!(
        bad.is_empty(),
        "imports through the crate root's re-exports:\n{}",
        bad.join("\n")
    );
}

//! The shape of `src/` that docs/architecture.md promises: no two files
//! import each other, directly or around a circle (a folder's `mod.rs` and
//! its own files aside), and the lower layers never import the ones above.
//! Read from the source text (`crate::` and `super::` paths outside comments
//! and unit tests), so a move that breaks the shape fails here, by name.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path ("node::forward") -> the text of its file.
fn modules() -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(concat!(env!("CARGO_MANIFEST_DIR"), "/src")).unwrap();
                let mut parts: Vec<String> =
                    rel.with_extension("").iter().map(|s| s.to_string_lossy().into_owned()).collect();
                if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                    parts.pop();
                }
                let text = std::fs::read_to_string(&p).unwrap();
                out.insert(parts.join("::"), text);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")), &mut out);
    out
}

/// The code of a file: without comments and without its unit tests.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// Paths following `prefix` in `code`, e.g. `crate::` -> ["node::Node", ...].
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<&'a str> {
    code.match_indices(prefix)
        .filter(|(i, _)| *i == 0 || !code.as_bytes()[i - 1].is_ascii_alphanumeric())
        .map(|(i, _)| {
            let rest = &code[i + prefix.len()..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

/// The longest module that `path` names.
fn resolve<'m>(mods: &'m BTreeMap<String, String>, path: &str) -> Option<&'m String> {
    let parts: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    (1..=parts.len()).rev().find_map(|k| mods.get_key_value(&parts[..k].join("::")).map(|(k, _)| k))
}

/// Which modules each module imports (its ancestors, its own descendants excluded).
fn imports(mods: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for (m, text) in mods {
        let c = code(text);
        let parent: Vec<&str> = m.split("::").collect();
        let is_dir_module = mods.keys().any(|k| k.starts_with(&format!("{m}::")));
        let base = if is_dir_module { parent.clone() } else { parent[..parent.len().saturating_sub(1)].to_vec() };
        let mut set = BTreeSet::new();
        for p in paths_after(&c, "crate::") {
            set.extend(resolve(mods, p).cloned());
        }
        for p in paths_after(&c, "super::") {
            let up = if is_dir_module { &base[..base.len().saturating_sub(1)] } else { &base[..] };
            set.extend(resolve(mods, &format!("{}::{p}", up.join("::"))).cloned());
        }
        set.retain(|t| t != m && !m.starts_with(&format!("{t}::")) && !t.starts_with(&format!("{m}::")));
        out.insert(m.clone(), set);
    }
    out
}

#[test]
fn no_file_of_src_imports_around_a_circle() {
    let mods = modules();
    assert!(mods.contains_key("node::forward") && mods.contains_key("link::transport"), "read the wrong tree");
    let graph = imports(&mods);
    // For each module, every module it reaches; a module that reaches itself is in a circle.
    let mut circles = Vec::new();
    for start in graph.keys() {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&String> = graph[start].iter().collect();
        let mut back = BTreeMap::new();
        while let Some(m) = todo.pop() {
            if !seen.insert(m.clone()) {
                continue;
            }
            for n in &graph[m] {
                back.entry(n.clone()).or_insert_with(|| m.clone());
                todo.push(n);
            }
        }
        if seen.contains(start) {
            circles.push(format!("{start} (via {})", back[start]));
        }
    }
    assert!(circles.is_empty(), "files importing around a circle: {circles:?}");
}

#[test]
fn lower_layers_never_import_the_ones_above() {
    let graph = imports(&modules());
    let above = ["node", "amqp", "http", "serve", "ctl", "perf"];
    let layers = [
        "ids", "message", "api", "link", "raft", "queue", "metadata", "owners", "metrics", "peers", "wire", "failover",
        "timing",
    ];
    let mut wrong = Vec::new();
    for (m, to) in &graph {
        if !layers.iter().any(|l| m == l || m.starts_with(&format!("{l}::"))) {
            continue;
        }
        for t in to {
            if above.iter().any(|a| t == a || t.starts_with(&format!("{a}::"))) {
                wrong.push(format!("{m} -> {t}"));
            }
        }
    }
    assert!(wrong.is_empty(), "a lower layer imports an upper one: {wrong:?}");
    // The leaves import nothing of the crate but each other and metadata's router types.
    // The node link carries frames it does not read: it knows no queue,
    // metadata, Raft or node type, only what the words spoken over it
    // (`wire`) and TLS need of it.
    let link: BTreeSet<&String> = graph.iter().filter(|(m, _)| m.starts_with("link")).flat_map(|(_, to)| to).collect();
    let bad: Vec<&&String> =
        link.iter().filter(|t| !t.starts_with("link") && !["ids", "tls"].contains(&t.as_str())).collect();
    assert!(bad.is_empty(), "link imports {bad:?}");
    // Whether a peer is alive is decided from pings and dials alone:
    // `peers` knows no node, link, queue or metadata type.
    let peers: BTreeSet<&String> = graph
        .iter()
        .filter(|(m, _)| m.as_str() == "peers" || m.starts_with("peers::"))
        .flat_map(|(_, to)| to)
        .collect();
    let bad: Vec<&&String> = peers.iter().filter(|t| !t.starts_with("peers") && t.as_str() != "ids").collect();
    assert!(bad.is_empty(), "peers imports {bad:?}");
    // Raft's plumbing is generic over what a group's entries carry: it
    // knows no queue or metadata type (they instantiate it).
    let raft: BTreeSet<&String> = graph
        .iter()
        .filter(|(m, _)| m.as_str() == "raft" || m.starts_with("raft::"))
        .flat_map(|(_, to)| to)
        .filter(|t| !t.starts_with("raft"))
        .collect();
    assert!(raft.iter().all(|t| t.as_str() == "ids"), "raft imports {raft:?}");
    for leaf in ["ids", "message"] {
        let allowed = ["ids"];
        let bad: Vec<&String> = graph[leaf].iter().filter(|t| !allowed.contains(&t.as_str())).collect();
        assert!(bad.is_empty(), "the leaf {leaf} imports {bad:?}");
    }
}

/// The same at the level of top-level modules, where a circle is two
/// concerns that cannot be read apart: none is allowed. (Raft's plumbing
/// is generic over what a group's entries carry; the queue and the
/// metadata each instantiate it, and it names neither.)
#[test]
fn top_level_modules_form_no_circle() {
    let graph = imports(&modules());
    let top = |m: &str| m.split("::").next().unwrap_or("").to_string();
    let mut tops: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, to) in &graph {
        let from = top(m);
        let entry = tops.entry(from.clone()).or_default();
        entry.extend(to.iter().map(|t| top(t)).filter(|t| *t != from && !t.is_empty()));
    }
    let reaches = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<String> = tops.get(from).into_iter().flatten().cloned().collect();
        while let Some(m) = todo.pop() {
            if seen.insert(m.clone()) {
                todo.extend(tops.get(&m).into_iter().flatten().cloned());
            }
        }
        seen
    };
    let in_circles: BTreeSet<String> = tops.keys().filter(|m| reaches(m).contains(*m)).cloned().collect();
    assert!(in_circles.is_empty(), "top-level modules in an import circle: {in_circles:?}");
    assert!(tops.contains_key("link") && tops.contains_key("node"), "read the wrong tree");
}

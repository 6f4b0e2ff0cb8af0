//! The crate's import graph: no file-level cycles, and every `crate::`/`super::` import points
//! down the layer order that docs/design.md draws (the CLI on top, the weight readers at the
//! bottom). Unit-test modules may reach anywhere and are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level modules, highest first: a module imports only from modules after it.
const LAYERS: &[&str] = &[
    "cli",
    "pipeline",
    "report",
    "gate",
    "verify",
    "diagnose",
    "endpoint",
    "any_backend",
    "cuda",
    "exec",
    "synth",
    "shard",
    "compare",
    "trace",
    "model",
    "weights",
    "dtype",
    "progress",
    "rng",
];

/// The executor's parts, highest first, in the same way: the forward above the weight access it
/// asks, the backends below that, their kernels, storage and ops below them, the number types at
/// the bottom.
const EXEC_LAYERS: &[&str] = &[
    "selftest",
    "forward",
    "attention",
    "tp",
    "source",
    "faults",
    "backend",
    "cpu",
    "storage",
    "ops",
    "passes",
    "mat",
    "real",
];

type ModPath = Vec<String>;

/// Every `.rs` file under `src/` by its module path (`src/exec/mod.rs` is `exec`).
fn source_files(dir: &Path, prefix: &[String], out: &mut BTreeMap<ModPath, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            let mut p = prefix.to_vec();
            p.push(name);
            source_files(&path, &p, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let mut module = prefix.to_vec();
            if !matches!(name.as_str(), "mod" | "lib" | "main") {
                module.push(name);
            }
            let text = std::fs::read_to_string(&path).unwrap();
            out.insert(module, text);
        }
    }
}

/// The source without comments and without its unit-test module.
fn code_of(text: &str) -> String {
    let body = text.split("#[cfg(test)]\nmod tests").next().unwrap();
    body.lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths `crate::…`/`super::…` in `code` names, groups `{a, b::c}` expanded, each made
/// absolute from `module`.
fn imported_paths(code: &str, module: &[String]) -> Vec<ModPath> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    for start in ["crate::", "super::"] {
        let mut at = 0;
        while let Some(found) = code[at..].find(start) {
            let i = at + found;
            at = i + start.len();
            if i > 0
                && (bytes[i - 1].is_ascii_alphanumeric()
                    || bytes[i - 1] == b'_'
                    || bytes[i - 1] == b':')
            {
                continue;
            }
            let base: ModPath = if start == "crate::" {
                Vec::new()
            } else {
                module[..module.len().saturating_sub(1)].to_vec()
            };
            expand(&code[at..], base, &mut out);
        }
    }
    out
}

/// Reads `seg::seg::{…}` from the head of `rest` onto `base`.
fn expand(rest: &str, mut base: ModPath, out: &mut Vec<ModPath>) {
    let mut s = rest;
    loop {
        let ident: String = s
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            break;
        }
        s = &s[ident.len()..];
        match ident.as_str() {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => base.push(ident),
        }
        match s.strip_prefix("::") {
            Some(next) => s = next,
            None => break,
        }
    }
    if let Some(group) = s.strip_prefix('{') {
        let mut depth = 1;
        let mut item_start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' | ',' if depth == 1 => {
                    expand(group[item_start..i].trim_start(), base.clone(), out);
                    item_start = i + 1;
                    if c == '}' {
                        break;
                    }
                }
                '}' => depth -= 1,
                _ => {}
            }
        }
    } else {
        out.push(base);
    }
}

type Graph = BTreeMap<ModPath, BTreeSet<ModPath>>;

/// The import graph of `src/`.
fn file_graph() -> Graph {
    let mut files = BTreeMap::new();
    source_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &[],
        &mut files,
    );
    graph_of(&files)
}

/// The import graph between files (module path to source): an edge to the longest module
/// prefix of each imported path.
fn graph_of(files: &BTreeMap<ModPath, String>) -> Graph {
    let modules: BTreeSet<ModPath> = files.keys().cloned().collect();
    files
        .iter()
        .map(|(module, text)| {
            let targets = imported_paths(&code_of(text), module)
                .into_iter()
                .filter_map(|p| {
                    (0..=p.len())
                        .rev()
                        .map(|n| p[..n].to_vec())
                        .find(|m| modules.contains(m))
                })
                .filter(|t| t != module && !module.starts_with(t))
                .collect();
            (module.clone(), targets)
        })
        .collect()
}

/// Every import cycle, as `a -> b -> a`, one per file that reaches itself (depth-first search
/// from each file).
fn cycles(graph: &Graph) -> Vec<String> {
    let mut found = Vec::new();
    for start in graph.keys() {
        let mut stack: Vec<(ModPath, Vec<ModPath>)> = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        'search: while let Some((at, trail)) = stack.pop() {
            for next in &graph[&at] {
                if next == start {
                    let names: Vec<String> = trail.iter().map(|m| m.join("::")).collect();
                    found.push(format!("{} -> {}", names.join(" -> "), start.join("::")));
                    break 'search;
                }
                if seen.insert(next.clone()) {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    found
}

/// Every import from a lower layer to a higher one, as `from -> to`: between top-level modules
/// by [`LAYERS`], and between the executor's parts by [`EXEC_LAYERS`].
fn upward_imports(graph: &Graph) -> Vec<String> {
    let mut upward = Vec::new();
    for (from, targets) in graph {
        for to in targets {
            if points_up(from, to) {
                upward.push(format!("{} -> {}", from.join("::"), to.join("::")));
            }
        }
    }
    upward
}

/// Whether an import from `from` to `to` goes up a layer table (or into no layer): the
/// top-level table, or the executor's where both are inside `exec`.
fn points_up(from: &ModPath, to: &ModPath) -> bool {
    let (table, level): (&[&str], usize) = match (from.as_slice(), to.as_slice()) {
        ([a, x, ..], [b, y, ..]) if a == "exec" && b == "exec" && x != y => (EXEC_LAYERS, 1),
        _ => (LAYERS, 0),
    };
    let rank = |m: &ModPath| {
        m.get(level)
            .and_then(|part| table.iter().position(|l| l == part))
    };
    match rank(from) {
        Some(from_rank) => rank(to).is_none_or(|to_rank| to_rank < from_rank),
        None => false,
    }
}

#[test]
fn no_file_imports_itself_back() {
    let found = cycles(&file_graph());
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn imports_point_down_the_layers() {
    let upward = upward_imports(&file_graph());
    assert!(
        upward.is_empty(),
        "imports from a lower layer to a higher one (or into no layer):\n{}",
        upward.join("\n")
    );
}

#[test]
fn a_planted_cycle_and_upward_import_are_found() {
    let files: BTreeMap<ModPath, String> = [
        ("cuda::backend", "use super::ranks::Ranks;"),
        (
            "cuda::ranks",
            "use super::backend::Cuda;\nuse crate::weights::X;",
        ),
        ("weights", "use crate::pipeline::bisect;"),
        ("exec::ops", "use crate::exec::backend::Backend;"),
        ("exec::backend", ""),
        ("exec::cpu", "use crate::exec::ops::rope;"),
        ("pipeline", ""),
    ]
    .into_iter()
    .map(|(m, code)| (m.split("::").map(String::from).collect(), code.to_string()))
    .collect();
    let graph = graph_of(&files);
    assert_eq!(
        cycles(&graph),
        [
            "cuda::backend -> cuda::ranks -> cuda::backend",
            "cuda::ranks -> cuda::backend -> cuda::ranks"
        ]
    );
    assert_eq!(
        upward_imports(&graph),
        ["exec::ops -> exec::backend", "weights -> pipeline"]
    );
}

#[test]
fn every_top_level_module_and_executor_part_has_a_layer() {
    let graph = file_graph();
    let tops: BTreeSet<&String> = graph.keys().filter_map(|m| m.first()).collect();
    for top in tops {
        assert!(
            LAYERS.contains(&top.as_str()),
            "src/{top} is in no layer of LAYERS"
        );
    }
    let parts: BTreeSet<&String> = graph
        .keys()
        .filter(|m| m.first().is_some_and(|top| top == "exec"))
        .filter_map(|m| m.get(1))
        .collect();
    for part in parts {
        assert!(
            EXEC_LAYERS.contains(&part.as_str()),
            "src/exec/{part} is in no layer of EXEC_LAYERS"
        );
    }
}

#[test]
fn the_reader_sees_grouped_imports_and_skips_comments_and_tests() {
    // The graph's own reader: groups, nested groups, `super` and `self`.
    let module: ModPath = vec!["exec".into(), "forward".into()];
    let paths = imported_paths(
        "use crate::model::{stage::Stage, names::{A, B}};\nuse super::mat::Mat;\nlet x = super::super::dtype::F;",
        &module,
    );
    let joined: BTreeSet<String> = paths.iter().map(|p| p.join("::")).collect();
    for want in [
        "model::stage::Stage",
        "model::names::A",
        "model::names::B",
        "exec::mat::Mat",
        "dtype::F",
    ] {
        assert!(joined.contains(want), "{want} not read from {joined:?}");
    }
    // Comments and the unit-test module are not read.
    let code = code_of("use crate::a::X; // crate::b\n#[cfg(test)]\nmod tests { use crate::c; }");
    let only: Vec<String> = imported_paths(&code, &["b".into()])
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(only, vec!["a::X"]);
}

//! The daemon's top-level modules must not import each other in a circle (docs/architecture.md,
//! "Module map"): each `crate::x` path outside comments and tests is an edge from the module
//! that names it to `x`, and the graph must be acyclic, with the deploy above the runtime.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Edges between top-level modules of `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap();
            let first = rel.components().next().unwrap().as_os_str();
            let top = first.to_str().unwrap().trim_end_matches(".rs").to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            // Unit tests may reach anywhere.
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            let deps = g.entry(top.clone()).or_default();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let name: String = line[i + "crate::".len()..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != top {
                        deps.insert(name);
                    }
                }
            }
        }
    }
    g
}

/// A cycle through `node`, if any (depth-first).
fn cycle_from(
    g: &BTreeMap<String, BTreeSet<String>>,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    let node = path.last().unwrap().clone();
    for next in g.get(&node).into_iter().flatten() {
        if let Some(at) = path.iter().position(|n| n == next) {
            let mut cycle = path[at..].to_vec();
            cycle.push(next.clone());
            return Some(cycle);
        }
        if done.contains(next) {
            continue;
        }
        path.push(next.clone());
        if let Some(c) = cycle_from(g, path, done) {
            return Some(c);
        }
        path.pop();
    }
    done.insert(node);
    None
}

#[test]
fn the_daemons_modules_import_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = graph(&src);
    assert!(
        g.contains_key("runtime") && g.contains_key("deploy"),
        "{g:?}"
    );
    let mut done = BTreeSet::new();
    for node in g.keys() {
        if let Some(c) = cycle_from(&g, &mut vec![node.clone()], &mut done) {
            panic!("modules import each other in a circle: {}", c.join(" -> "));
        }
    }
    assert!(g["deploy"].contains("runtime"));
    assert!(
        !g["runtime"].contains("deploy"),
        "the runtime must not use the deploy"
    );
}

#[test]
fn a_cycle_is_found() {
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    g.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    let c = cycle_from(&g, &mut vec!["a".to_string()], &mut BTreeSet::new());
    assert_eq!(c.unwrap(), ["a", "b", "c", "a"]);
}

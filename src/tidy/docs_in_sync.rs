//! The docs stay true to each other and to the code: rust-analyzer's docs-in-sync idea, for kmqd's three kinds of
//! drift.
//!
//! - Cross-references: every `docs/X.md, "Section"` (also `docs/X.md ("Section"`, `docs/X.md "Section"`, several
//!   sections joined by `and`, and a bare `X.md, "Section"`, which means the file beside the one that names it, in
//!   docs/, or at the root) in the repository's sources, scripts, configs and docs names a heading of that file.
//!   A reference may wrap across comment lines.
//! - The codemap: docs/CODEMAP.md's "Layout" names every Rust file under src/ (the rule is in [`codemap_names`]),
//!   and every source file the docs name by its path exists.
//! - docs/CONFIG.md's defaults: each key whose default cell is one TOML value (`"5s"`, `8`, `["normal"]`) gets
//!   that value when a config leaves the key out (which is what `config::defaults` is for). Cells that describe
//!   a default instead of giving it ("adaptive", "required", "—", `workers + 4096`) cannot be compared and are
//!   skipped; so are keys that are never left out alone (a `[plugins.NAME]`'s `file`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use regex::Regex;

use super::{files, read, root};

/// Where references are looked for: (directory or file, the file names looked at).
const SOURCES: &[(&str, &[&str])] = &[
    ("src", &[".rs", ".lua"]),
    ("docs", &[".md"]),
    ("plugins", &[".rs", ".h", ".c", ".md", ".toml"]),
    ("tests", &[".rs"]),
    ("bench", &[".rs", ".md"]),
    ("harness", &[".rs"]),
    ("model", &[".rs", ".md"]),
    ("fuzz/fuzz_targets", &[".rs"]),
    ("sdk", &[".py", ".js", ".md"]),
    ("config", &[".toml"]),
    ("systemd", &[".service"]),
    ("debian", &[""]),
    ("scripts", &[""]),
];

/// Directories never entered: build output and dependencies, and src/tidy/, whose tests quote references of every
/// form, dangling ones included.
const SKIPPED_DIRS: &[&str] = &[
    "target",
    "node_modules",
    "__pycache__",
    "corpus",
    "artifacts",
    "tidy",
];

/// Every file references are looked for in.
fn reference_sources() -> Vec<PathBuf> {
    let mut sources: Vec<PathBuf> = SOURCES
        .iter()
        .flat_map(|(dir, extensions)| files(dir, extensions, SKIPPED_DIRS))
        .collect();
    sources.extend(["README.md", "ARCHITECTURE.md"].map(PathBuf::from));
    sources
}

/// The text of `path` with its line breaks, and the comment markers that begin its lines, turned into spaces,
/// so that a reference wrapped across comment lines reads as one; a Rust string's `\"` is a quote.
fn joined(path: &Path, text: &str) -> String {
    let breaks = if path.extension().is_some_and(|ext| ext == "md") {
        Regex::new(r"\s*\n\s*").unwrap()
    } else {
        Regex::new(r"[ \t]*\n[ \t]*(?://[/!]?|#+|--|\*)?[ \t]*").unwrap()
    };
    breaks.replace_all(text, " ").replace("\\\"", "\"")
}

/// A heading or a reference to one as compared: without backticks, trimmed, lowercase.
fn normal(heading: &str) -> String {
    heading.replace('`', "").trim().to_lowercase()
}

/// The headings of a Markdown text (outside code blocks), normalised.
fn headings(markdown: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut headings = BTreeSet::new();
    for line in markdown.lines() {
        if line.starts_with("```") || line.starts_with("~~~") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            let text = line.trim_start_matches('#');
            if text.starts_with(' ') {
                headings.insert(normal(text));
            }
        }
    }
    headings
}

/// Whether `reference` names one of `headings`: the heading itself, or without its parenthesised date or note
/// ("The drain's poll" for "The drain's poll (2026-12-04)") or its subtitle ("In any language" for "In any
/// language: the exec plugin").
fn names_heading(headings: &BTreeSet<String>, reference: &str) -> bool {
    let reference = normal(reference);
    headings.iter().any(|heading| {
        heading == &reference
            || heading
                .strip_prefix(&reference)
                .is_some_and(|rest| rest.starts_with(" (") || rest.starts_with(": "))
    })
}

/// The Markdown file a reference from `from` names as `name`: `docs/X.md` from the root; a bare `X.md` beside
/// `from`, else in docs/, else at the root.
fn target(from: &Path, name: &str) -> Option<PathBuf> {
    let candidates = if name.contains('/') {
        vec![PathBuf::from(name)]
    } else {
        let beside = from.parent().unwrap_or(Path::new("")).join(name);
        vec![beside, Path::new("docs").join(name), PathBuf::from(name)]
    };
    candidates
        .into_iter()
        .find(|path| root().join(path).is_file())
}

/// Every reference of `text` (from the file `from`): the file it names and each section, in order.
fn references(text: &str) -> Vec<(String, Vec<String>)> {
    let reference = Regex::new(
        r#"((?:[\w.-]+/)*[\w-]+\.md)[,:]? \(?("[^"]+"(?:(?:,? and |,? or |, )"[^"]+")*)"#,
    )
    .unwrap();
    let section = Regex::new(r#""([^"]+)""#).unwrap();
    reference
        .captures_iter(text)
        .map(|found| {
            let sections = section
                .captures_iter(&found[2])
                .map(|s| s[1].to_string())
                .collect();
            (found[1].to_string(), sections)
        })
        .collect()
}

/// Every reference in the repository that names no heading of its file (or no file), one line each.
fn dangling_references() -> (usize, Vec<String>) {
    let mut headings_of: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    let mut dangling = Vec::new();
    let mut checked = 0;
    for from in reference_sources() {
        let Ok(text) = std::fs::read_to_string(root().join(&from)) else {
            continue; // not text
        };
        for (name, sections) in references(&joined(&from, &text)) {
            let Some(file) = target(&from, &name) else {
                dangling.push(format!("{}: {name} does not exist", from.display()));
                continue;
            };
            let headings = headings_of
                .entry(file.clone())
                .or_insert_with(|| headings(&read(&file)));
            for section in sections {
                checked += 1;
                if !names_heading(headings, &section) {
                    dangling.push(format!(
                        "{}: {name}, \"{section}\": no such heading in {}",
                        from.display(),
                        file.display()
                    ));
                }
            }
        }
    }
    dangling.sort();
    dangling.dedup();
    (checked, dangling)
}

#[test]
fn every_reference_to_a_section_of_the_docs_names_a_heading() {
    let (checked, dangling) = dangling_references();
    assert!(
        checked > 100,
        "only {checked} references found: is the pattern still right?"
    );
    assert!(
        dangling.is_empty(),
        "references to sections that do not exist ({} of {checked}):\n{}",
        dangling.len(),
        dangling.join("\n")
    );
}

#[test]
fn references_are_read_in_every_form_the_docs_use() {
    let found = |text: &str| references(&joined(Path::new("src/x.rs"), text));
    let one = |file: &str, section: &str| vec![(file.to_string(), vec![section.to_string()])];
    assert_eq!(
        found("see docs/OPERATIONS.md, \"ACL rules\"."),
        one("docs/OPERATIONS.md", "ACL rules")
    );
    assert_eq!(
        found("(docs/OPERATIONS.md (\"Reloading\"))"),
        one("docs/OPERATIONS.md", "Reloading")
    );
    assert_eq!(
        found("docs/OPERATIONS.md \"Sizing\""),
        one("docs/OPERATIONS.md", "Sizing")
    );
    assert_eq!(
        found("//! see docs/PERFORMANCE.md,\n//! \"The 1 ms rows\""),
        one("docs/PERFORMANCE.md", "The 1 ms rows")
    );
    assert_eq!(
        found("\"docs/OPERATIONS.md, \\\"ACL rules\\\"\""),
        one("docs/OPERATIONS.md", "ACL rules")
    );
    assert_eq!(
        found("docs/RELIABILITY.md, \"Outcomes\" and \"Poison pills\""),
        vec![(
            "docs/RELIABILITY.md".to_string(),
            vec!["Outcomes".to_string(), "Poison pills".to_string()]
        )]
    );
    assert_eq!(
        found("OPERATIONS.md, \"Sizing\""),
        one("OPERATIONS.md", "Sizing")
    );
    assert_eq!(found("docs/OPERATIONS.md says \"hello\""), vec![]);
}

/// Every source file of this repository that `text` names by its path (`src/observed.rs`, `tests/it/chaos/mod.rs`,
/// `../src/policy.rs` in a link from docs/); not what a build or a run writes (`bench/peers-DATE/`, a `.deb`),
/// nor a file outside the repository (`../shared/bench/peers/driver.py`), which the docs name too.
fn named_paths(text: &str) -> BTreeSet<String> {
    let path = Regex::new(r"[\w./-]+\.(?:rs|lua|h|c|py|js)\b").unwrap();
    let roots = [
        "src/", "tests/", "plugins/", "bench/", "harness/", "model/", "fuzz/", "sdk/",
    ];
    path.find_iter(text)
        .map(|found| found.as_str().trim_start_matches("../"))
        .filter(|path| roots.iter().any(|root| path.starts_with(root)))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_path_the_docs_name_exists() {
    // Not docs/design/: its notes quote the peers' sources by their paths.
    let mut docs = files("docs", &[".md"], &["design"]);
    docs.extend(["README.md", "ARCHITECTURE.md"].map(PathBuf::from));
    let mut missing = Vec::new();
    for doc in docs {
        for path in named_paths(&read(&doc)) {
            if !root().join(&path).exists() {
                missing.push(format!("{}: {path}", doc.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs name files that do not exist (moved or renamed?):\n{}",
        missing.join("\n")
    );
}

/// The codemap's rows: for each, the paths of its first column (a path after the first is relative to the
/// first's directory, as in "`src/daemon/heartbeat.rs`, `monitor.rs`") and the row's whole text.
fn codemap() -> Vec<(Vec<String>, String)> {
    let codemap = read(Path::new("docs/CODEMAP.md"));
    let layout = codemap
        .split("\n## Layout\n")
        .nth(1)
        .expect("docs/CODEMAP.md has a \"Layout\" section")
        .split("\n## ")
        .next()
        .unwrap();
    let item = Regex::new(r"`([^`]+)`").unwrap();
    layout
        .lines()
        .filter(|line| line.starts_with("| `src/"))
        .map(|row| {
            let first_column = row.split(" | ").next().unwrap();
            let mut paths: Vec<String> = Vec::new();
            for found in item.captures_iter(first_column) {
                let path = &found[1];
                let path = match paths.first() {
                    Some(first) if !path.starts_with("src/") => {
                        let dir = &first[..first.trim_end_matches('/').rfind('/').unwrap() + 1];
                        format!("{dir}{path}")
                    }
                    _ => path.to_string(),
                };
                paths.push(path);
            }
            (paths, row.to_string())
        })
        .collect()
}

/// Whether the codemap names `file` (a Rust file under src/, relative to the root): its row lists it by path; or
/// the row of the nearest directory the codemap lists names it by its file name (`` `acker.rs` `` in the row of
/// `src/daemon/lane/`). A directory's `mod.rs` is named with the directory: by a row of its own, or as
/// `` `name/` `` in its parent's row.
fn codemap_names(rows: &[(Vec<String>, String)], file: &str) -> bool {
    if rows
        .iter()
        .any(|(paths, _)| paths.iter().any(|p| p == file))
    {
        return true;
    }
    let (named, mut dir) = match file.strip_suffix("/mod.rs") {
        Some(dir) => {
            if rows
                .iter()
                .any(|(paths, _)| paths.iter().any(|p| *p == format!("{dir}/")))
            {
                return true;
            }
            let name = &dir[dir.rfind('/').unwrap() + 1..];
            (format!("`{name}/`"), dir.to_string())
        }
        None => {
            let name = &file[file.rfind('/').unwrap() + 1..];
            (format!("`{name}`"), file.to_string())
        }
    };
    while let Some(slash) = dir.rfind('/') {
        dir.truncate(slash + 1);
        if let Some((_, row)) = rows.iter().find(|(paths, _)| paths.contains(&dir)) {
            return row.contains(&named);
        }
        dir.pop();
    }
    false
}

#[test]
fn the_codemap_names_every_source_file() {
    let rows = codemap();
    assert!(rows.len() > 20, "codemap rows: {rows:?}");
    let missing: Vec<String> = files("src", &[".rs"], &[])
        .iter()
        .map(|file| file.to_string_lossy().into_owned())
        .filter(|file| !codemap_names(&rows, file))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/CODEMAP.md (\"Layout\") does not name:\n{}",
        missing.join("\n")
    );
}

/// The rows of docs/CONFIG.md's key tables: (section, key, default cell).
fn documented_defaults() -> Vec<(String, String, String)> {
    let config = read(Path::new("docs/CONFIG.md"));
    let mut section = String::new();
    let mut rows = Vec::new();
    for line in config.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            section = heading.replace('`', "");
        } else if let Some(row) = line.strip_prefix("| `") {
            let cells: Vec<&str> = row.split(" | ").collect();
            let key = cells[0].trim_end_matches('`');
            // A row of two keys ("`tls_cert_file`, `tls_key_file`") has no single value to set.
            if cells.len() >= 3 && !key.contains('`') {
                rows.push((section.clone(), key.to_string(), cells[1].to_string()));
            }
        }
    }
    rows
}

/// The smallest config with `section` in it (and what that section needs), to which a key of the section may be
/// appended; `None` for a section whose keys are not compared.
fn config_with(section: &str) -> Option<&'static str> {
    Some(match section {
        "[redis]" => "[redis]\n",
        "[daemon]" => "[daemon]\n",
        "[[queues]]" => "[[queues]]\nname = \"q\"\nmode = \"safe\"\n",
        "[[schedules]]" => {
            "[[queues]]\nname = \"q\"\nmode = \"safe\"\n\
             [[schedules]]\nname = \"s\"\nqueue = \"q\"\ntype = \"t\"\nevery = \"1m\"\n"
        }
        "[plugins.NAME]" => "[plugins.p]\nfile = \"p.so\"\n",
        "[dashboard]" => "[dashboard]\n",
        _ => return None,
    })
}

#[test]
fn the_defaults_in_config_md_are_the_configs() {
    let parse = |text: &str| crate::config::Config::parse(Path::new("kmqd.toml"), text);
    let literal = Regex::new(r"^`([^`]+)`(?: \(.*\))?$").unwrap();
    let (mut compared, mut skipped, mut wrong) = (Vec::new(), Vec::new(), Vec::new());
    for (section, key, default) in documented_defaults() {
        let value = literal
            .captures(&default)
            .map(|found| found[1].to_string())
            .filter(|value| format!("v = {value}").parse::<toml::Table>().is_ok());
        let (Some(base), Some(value)) = (config_with(&section), value) else {
            skipped.push(format!("{section} {key}: {default}"));
            continue;
        };
        let without = parse(base).unwrap_or_else(|e| panic!("{section}: {e}"));
        match parse(&format!("{base}{key} = {value}\n")) {
            Ok(with) if format!("{with:?}") == format!("{without:?}") => compared.push(key),
            Ok(_) => wrong.push(format!(
                "{section} {key}: documented default {value}, but leaving it out is not the same"
            )),
            Err(error) => wrong.push(format!(
                "{section} {key}: documented default {value} is refused: {error}"
            )),
        }
    }
    // Shown with --nocapture: what the test could not compare.
    println!("not compared (no single TOML value): {skipped:#?}");
    assert!(compared.len() > 20, "only {compared:?} compared");
    assert!(
        wrong.is_empty(),
        "docs/CONFIG.md's defaults column disagrees with the config:\n{}",
        wrong.join("\n")
    );
}

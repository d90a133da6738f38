//! No module imports one above it: the rules of ARCHITECTURE.md's "Layout", checked on every path the code names.
//!
//! Each file under src/ is read as Rust tokens (proc-macro2's lexer: comments and strings are not code, macro
//! arguments are), and every path that starts at `crate`, `super` or `self`, `use` trees included, is resolved to
//! the module it names from the crate root. A path that names a module above the file's breaks a rule:
//!
//! 1. a module outside `cli`, `daemon` and `dashboard` (the broker, the task format, the config, the pure
//!    decisions, what a queue's threads share, the client) names none of those three;
//! 2. `daemon` names neither `cli` nor `dashboard`;
//! 3. a per-daemon module (a file of `daemon/` outside the lane and the supervisor: `daemon/mod.rs` and the parts
//!    split out of it, `SUPERVISOR`) names only `daemon`'s modules that are not the supervisor's, never the
//!    supervisor's own items;
//! 4. the lane (`daemon/lane/`) names nothing of `daemon` but the lane itself: the per-daemon threads act on the
//!    lanes, never the other way round.
//!
//! Paths without `crate`, `super` or `self` (a child module's, an external crate's) cannot reach up, and
//! `src/main.rs` is a crate of its own, which names the library as `kmqd`.
//!
//! Two rules more keep the outcome path as ARCHITECTURE.md ("Who resolves a task") draws it (issue 35, the review's
//! P1, where the verdict zig-zagged through five files and the worker and `started` imported each other):
//!
//! 5. one place decides a task's outcome: `QueueContext::settle` (src/queue.rs) is the only caller of
//!    `policy::decide`, `settlement::log` and `settlement::record`, and no module it calls into (`BELOW_DECISION`)
//!    names `queue`;
//! 6. the lane's files (but its `mod.rs`, their parent) import each other in no circle.

use std::path::Path;

use proc_macro2::{Delimiter, TokenStream, TokenTree};

use super::{files, read};

/// The modules on top, which only the command line's `main` may name.
const TOP: [&str; 3] = ["cli", "daemon", "dashboard"];

/// The modules of `daemon/` that are parts of the supervisor, split out of `daemon/mod.rs` to keep it readable:
/// like `mod.rs` they may name the supervisor's items, and no per-daemon module may name them.
const SUPERVISOR: [&str; 4] = ["owners", "reload", "startup", "threads"];

/// The module path of a source file: `src/daemon/lane/mod.rs` is `["daemon", "lane"]`, `src/lib.rs` is `[]`.
fn module_of(file: &str) -> Vec<String> {
    let inside = file.strip_prefix("src/").unwrap_or(file);
    let inside = inside.strip_suffix(".rs").unwrap_or(inside);
    let mut module: Vec<String> = inside.split('/').map(str::to_string).collect();
    if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
        module.pop();
    }
    module
}

/// Every path `source` names from the crate root (`crate::daemon::lane::Lane` is `["daemon", "lane", "Lane"]`;
/// a glob names its module), as seen from the module `module`.
fn named_paths(module: &[String], source: &str) -> Vec<Vec<String>> {
    let tokens: TokenStream = source
        .parse()
        .unwrap_or_else(|e| panic!("cannot read {module:?} as Rust tokens: {e:?}"));
    let mut paths = Vec::new();
    walk(tokens, module, &mut paths);
    paths
}

/// Collects the paths of `tokens`, which are inside `module` (an inline `mod name { ... }` extends it).
fn walk(tokens: TokenStream, module: &[String], paths: &mut Vec<Vec<String>>) {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    for (i, token) in tokens.iter().enumerate() {
        match token {
            TokenTree::Group(group) => {
                let before = |back: usize| i.checked_sub(back).map(|j| &tokens[j]);
                let inline_module = match (before(2), before(1)) {
                    (Some(TokenTree::Ident(keyword)), Some(TokenTree::Ident(name)))
                        if keyword == "mod" && group.delimiter() == Delimiter::Brace =>
                    {
                        Some(name.to_string())
                    }
                    _ => None,
                };
                match inline_module {
                    Some(name) => {
                        let mut inner = module.to_vec();
                        inner.push(name);
                        walk(group.stream(), &inner, paths);
                    }
                    None => walk(group.stream(), module, paths),
                }
            }
            TokenTree::Ident(ident)
                if is_path_sep(&tokens, i + 1) && !is_path_sep_before(&tokens, i) =>
            {
                let start = match ident.to_string().as_str() {
                    "crate" => Vec::new(),
                    "self" => module.to_vec(),
                    "super" => module[..module.len().saturating_sub(1)].to_vec(),
                    _ => continue,
                };
                path(&tokens[i + 3..], start, paths);
            }
            _ => {}
        }
    }
}

/// Resolves the rest of a path (after its first segment and `::`) onto `prefix`; a `{...}` tree names each of its
/// branches.
fn path(tokens: &[TokenTree], mut prefix: Vec<String>, paths: &mut Vec<Vec<String>>) {
    let mut i = 0;
    loop {
        match tokens.get(i) {
            Some(TokenTree::Ident(ident)) if ident == "self" => {}
            Some(TokenTree::Ident(ident)) if ident == "super" => {
                prefix.pop();
            }
            Some(TokenTree::Ident(ident)) => prefix.push(ident.to_string()),
            Some(TokenTree::Group(group)) if group.delimiter() == Delimiter::Brace => {
                let inner: Vec<TokenTree> = group.stream().into_iter().collect();
                for branch in
                    inner.split(|t| matches!(t, TokenTree::Punct(p) if p.as_char() == ','))
                {
                    if !branch.is_empty() {
                        path(branch, prefix.clone(), paths);
                    }
                }
                return;
            }
            _ => break,
        }
        if !is_path_sep(tokens, i + 1) {
            break;
        }
        i += 3;
    }
    paths.push(prefix);
}

/// Whether `tokens[at..]` starts with `::`.
fn is_path_sep(tokens: &[TokenTree], at: usize) -> bool {
    matches!(
        (tokens.get(at), tokens.get(at + 1)),
        (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) if a.as_char() == ':' && b.as_char() == ':'
    )
}

/// Whether `tokens[at]` follows a `::` (a segment inside a path, not its start).
fn is_path_sep_before(tokens: &[TokenTree], at: usize) -> bool {
    at >= 2 && is_path_sep(tokens, at - 2)
}

/// The rule `named` breaks when the file `file` (of module `module`) names it, if any. `daemon_modules` are the
/// modules declared in `daemon/`.
fn broken_rule(file: &str, named: &[String], daemon_modules: &[String]) -> Option<&'static str> {
    fn top(path: &[String]) -> Option<&str> {
        path.first().map(String::as_str)
    }
    let file_module = module_of(file);
    let file_top = top(&file_module);
    let named_top = top(named);
    let names_top = named_top.is_some_and(|t| TOP.contains(&t));
    if !file_top.is_some_and(|t| TOP.contains(&t)) && names_top {
        return Some(
            "a module below the daemon, the command line and the dashboard names one of them",
        );
    }
    if file_top == Some("daemon") && names_top && named_top != Some("daemon") {
        return Some("the daemon names the command line or the dashboard");
    }
    let in_supervisor = file == "src/daemon/mod.rs"
        || file_module
            .get(1)
            .is_some_and(|m| file_top == Some("daemon") && SUPERVISOR.contains(&m.as_str()));
    if named_top != Some("daemon") || in_supervisor || !file.starts_with("src/daemon/") {
        return None;
    }
    let named_module = named.get(1).map(String::as_str);
    if file.starts_with("src/daemon/lane/") {
        return (named_module != Some("lane")).then_some(
            "the lane names the daemon above it: per-daemon threads act on lanes, not the reverse",
        );
    }
    let is_module = named_module
        .is_some_and(|m| daemon_modules.iter().any(|d| d == m) && !SUPERVISOR.contains(&m));
    (!is_module).then_some("a per-daemon module names the supervisor's own items")
}

/// The modules declared in `daemon/`: its files and directories.
fn daemon_modules() -> Vec<String> {
    files("src/daemon", &[".rs"], &[])
        .iter()
        .filter_map(|file| {
            let module = module_of(&file.to_string_lossy());
            module.get(1).cloned()
        })
        .collect()
}

/// Every rule broken by every file under src/, one line each.
fn broken_rules() -> Vec<String> {
    let daemon_modules = daemon_modules();
    let mut broken = Vec::new();
    for file in files("src", &[".rs"], &[]) {
        let file = file.to_string_lossy().into_owned();
        if file == "src/main.rs" {
            continue;
        }
        let source = read(Path::new(&file));
        for named in named_paths(&module_of(&file), &source) {
            if let Some(rule) = broken_rule(&file, &named, &daemon_modules) {
                broken.push(format!("{file} names crate::{}: {rule}", named.join("::")));
            }
        }
    }
    broken.dedup();
    broken
}

/// The modules `QueueContext::settle` calls into to decide an outcome: none of them may name `queue` (rule 5).
const BELOW_DECISION: [&str; 5] = ["broker", "config", "policy", "settlement", "task"];

/// The steps of the decision, which only `QueueContext::settle` takes (rule 5), each as (module, item).
const DECISION_STEPS: [(&str, &str); 3] = [
    ("policy", "decide"),
    ("settlement", "log"),
    ("settlement", "record"),
];

/// Whether `source` (of module `module`) names `item` of module `of`: through a path that resolves to it
/// (`crate::policy::decide`, `use super::policy::{decide}`), or as `of::item` after `of` was imported (`use
/// crate::policy; policy::decide(..)`). A glob import (`use crate::policy::*`) is not seen.
fn names_item(module: &[String], source: &str, (of, item): (&str, &str)) -> bool {
    fn spelled(tokens: TokenStream, of: &str, item: &str) -> bool {
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        tokens.iter().enumerate().any(|(i, token)| match token {
            TokenTree::Group(group) => spelled(group.stream(), of, item),
            TokenTree::Ident(ident) => {
                *ident == of
                    && is_path_sep(&tokens, i + 1)
                    && matches!(tokens.get(i + 3), Some(TokenTree::Ident(next)) if *next == item)
            }
            _ => false,
        })
    }
    let tokens: TokenStream = source
        .parse()
        .unwrap_or_else(|e| panic!("cannot read {module:?} as Rust tokens: {e:?}"));
    spelled(tokens, of, item)
        || named_paths(module, source)
            .iter()
            .any(|named| named.len() == 2 && named[0] == of && named[1] == item)
}

/// Rule 5's breaks by `file`, one line each.
fn decision_breaks(file: &str, source: &str) -> Vec<String> {
    let module = module_of(file);
    let own = |of: &str| module.first().is_some_and(|m| m == of);
    let mut broken = Vec::new();
    if file != "src/queue.rs" {
        for (of, item) in DECISION_STEPS {
            if !own(of) && names_item(&module, source, (of, item)) {
                broken.push(format!(
                    "{file} names {of}::{item}: only QueueContext::settle (src/queue.rs) decides an outcome"
                ));
            }
        }
    }
    if BELOW_DECISION.iter().any(|below| own(below))
        && named_paths(&module, source)
            .iter()
            .any(|named| named.first().is_some_and(|m| m == "queue"))
    {
        broken.push(format!(
            "{file} names crate::queue: a module the decision calls into names the decision point"
        ));
    }
    broken
}

/// A circle of imports between the lane's files (rule 6), as `a -> b -> a`, if there is one: `imports` maps each
/// of the lane's modules to those of them it names.
fn lane_circle(imports: &std::collections::BTreeMap<String, Vec<String>>) -> Option<String> {
    fn visit(
        at: &str,
        imports: &std::collections::BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<String> {
        if let Some(start) = path.iter().position(|m| m == at) {
            let mut circle = path[start..].to_vec();
            circle.push(at.to_string());
            return Some(circle.join(" -> "));
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_string());
        for next in imports.get(at).into_iter().flatten() {
            if let Some(circle) = visit(next, imports, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(at.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    imports
        .keys()
        .find_map(|module| visit(module, imports, &mut Vec::new(), &mut done))
}

/// Which of the lane's modules each of the lane's files (but `mod.rs`) names.
fn lane_imports() -> std::collections::BTreeMap<String, Vec<String>> {
    let files: Vec<String> = files("src/daemon/lane", &[".rs"], &[])
        .iter()
        .map(|file| file.to_string_lossy().into_owned())
        .filter(|file| file != "src/daemon/lane/mod.rs")
        .collect();
    let lane_module = |file: &str| module_of(file).get(2).cloned();
    let modules: Vec<String> = files.iter().filter_map(|file| lane_module(file)).collect();
    files
        .iter()
        .filter_map(|file| {
            let module = lane_module(file)?;
            let mut named: Vec<String> = named_paths(&module_of(file), &read(Path::new(file)))
                .into_iter()
                .filter(|named| named.len() > 2 && named[0] == "daemon" && named[1] == "lane")
                .map(|named| named[2].clone())
                .filter(|named| modules.contains(named) && *named != module)
                .collect();
            named.sort();
            named.dedup();
            Some((module, named))
        })
        .collect()
}

#[test]
fn one_place_decides_an_outcome() {
    let broken: Vec<String> = files("src", &[".rs"], &[])
        .iter()
        .map(|file| file.to_string_lossy().into_owned())
        .filter(|file| file != "src/main.rs")
        .flat_map(|file| decision_breaks(&file, &read(Path::new(&file))))
        .collect();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_lane_s_files_import_each_other_in_no_circle() {
    let imports = lane_imports();
    assert!(imports.contains_key("worker") && imports.contains_key("started"));
    if let Some(circle) = lane_circle(&imports) {
        panic!("the lane's files import each other in a circle: {circle}");
    }
}

/// Checks the checkers of rules 5 and 6.
#[test]
fn the_decision_and_circle_rules_catch_what_they_name() {
    let breaks = |file: &str, source: &str| decision_breaks(file, source).len();
    assert_eq!(
        breaks(
            "src/queue.rs",
            "use crate::policy; fn f() { policy::decide(); }"
        ),
        0
    );
    assert_eq!(
        breaks(
            "src/daemon/lane/resolve.rs",
            "fn f() { self.queue.settle(t, v, None); }"
        ),
        0
    );
    assert_eq!(
        breaks(
            "src/daemon/lane/resolve.rs",
            "use crate::policy; fn f() { policy::decide(); }"
        ),
        1
    );
    assert_eq!(
        breaks(
            "src/daemon/monitor.rs",
            "use crate::settlement::{self, record};"
        ),
        1
    );
    assert_eq!(
        breaks(
            "src/settlement.rs",
            "fn f() { crate::policy::decide(); record(); }"
        ),
        1
    );
    assert_eq!(breaks("src/policy.rs", "fn f() { decide(); }"), 0);
    assert_eq!(
        breaks("src/settlement.rs", "use crate::queue::QueueContext;"),
        1
    );
    assert_eq!(
        breaks(
            "src/broker/tasks.rs",
            "/// [`crate::queue::QueueContext`]\nfn f() {}"
        ),
        0
    );
    let imports = |pairs: &[(&str, &[&str])]| {
        pairs
            .iter()
            .map(|(module, named)| {
                (
                    module.to_string(),
                    named.iter().map(|n| n.to_string()).collect(),
                )
            })
            .collect()
    };
    assert_eq!(
        lane_circle(&imports(&[
            ("started", &["resolve"]),
            ("worker", &["jobs", "resolve", "started"]),
        ])),
        None
    );
    assert_eq!(
        lane_circle(&imports(&[
            ("started", &["worker"]),
            ("worker", &["jobs", "started"]),
        ]))
        .as_deref(),
        Some("started -> worker -> started")
    );
}

#[test]
fn no_module_imports_one_above_it() {
    let broken = broken_rules();
    assert!(
        broken.is_empty(),
        "the layering of ARCHITECTURE.md (\"Layout\") is broken:\n{}",
        broken.join("\n")
    );
}

/// Checks the checker: what each kind of file may and may not name.
#[test]
fn the_layering_rules_catch_each_kind_of_upward_path() {
    let daemon_modules: Vec<String> = [
        "lane",
        "heartbeat",
        "watchdog",
        "metrics",
        "threads",
        "reload",
    ]
    .map(String::from)
    .to_vec();
    let check = |file: &str, source: &str| -> Vec<String> {
        named_paths(&module_of(file), source)
            .iter()
            .filter_map(|named| broken_rule(file, named, &daemon_modules).map(|_| named.join("::")))
            .collect()
    };
    let none: [&str; 0] = [];
    // Root modules: sideways and down is fine; any path into the top modules is not, however it is spelled.
    assert_eq!(
        check(
            "src/settler.rs",
            "use crate::broker::{self, Session}; use crate::pulse::Pulse;"
        ),
        none
    );
    assert_eq!(
        check("src/settler.rs", "use crate::daemon::watchdog::Pulse;"),
        ["daemon::watchdog::Pulse"]
    );
    assert_eq!(
        check("src/broker/keys.rs", "use super::super::cli::Exit;"),
        ["cli::Exit"]
    );
    assert_eq!(
        check("src/retry.rs", "use crate::{shutdown, dashboard::api};"),
        ["dashboard::api"]
    );
    assert_eq!(
        check(
            "src/retry.rs",
            "fn f() { crate::daemon::metrics::count(); }"
        ),
        ["daemon::metrics::count"]
    );
    assert_eq!(
        check(
            "src/retry.rs",
            "fn f() { tracing::info!(\"{}\", crate::cli::x()); }"
        ),
        ["cli::x"]
    );
    assert_eq!(
        check(
            "src/client.rs",
            "use crate::client::Client; // crate::daemon::x"
        ),
        none
    );
    assert_eq!(
        check("src/client.rs", "/// [`crate::daemon::run`]\nfn f() {}"),
        none
    );
    assert_eq!(
        check(
            "src/client.rs",
            "pub(crate) fn f() { let s = \"crate::cli\"; }"
        ),
        none
    );
    // The daemon: not the command line; the lane: nothing of the daemon but itself, however it is spelled.
    assert_eq!(
        check("src/daemon/report.rs", "use crate::cli::colour;"),
        ["cli::colour"]
    );
    assert_eq!(
        check("src/daemon/lane/mod.rs", "use super::heartbeat::X;"),
        ["daemon::heartbeat::X"]
    );
    assert_eq!(
        check(
            "src/daemon/lane/acker.rs",
            "use super::super::watchdog::Bounds;"
        ),
        ["daemon::watchdog::Bounds"]
    );
    assert_eq!(
        check(
            "src/daemon/lane/acker.rs",
            "use crate::daemon::{lane::Lane, metrics};"
        ),
        ["daemon::metrics"]
    );
    assert_eq!(
        check(
            "src/daemon/lane/acker.rs",
            "use super::Lane; use crate::daemon::lane::jobs;"
        ),
        none
    );
    assert_eq!(
        check("src/daemon/lane/mod.rs", "mod tests { use super::*; }"),
        none
    );
    // Per-daemon modules: their siblings, not the supervisor's items; the supervisor's own tests may.
    assert_eq!(
        check(
            "src/daemon/heartbeat.rs",
            "use super::lane::{Lane, LaneSet};"
        ),
        none
    );
    assert_eq!(
        check("src/daemon/heartbeat.rs", "use super::Supervisor;"),
        ["daemon::Supervisor"]
    );
    assert_eq!(
        check("src/daemon/mod.rs", "mod tests { use super::*; }"),
        none
    );
    // The supervisor's parts: the supervisor's items, as mod.rs does; no per-daemon module names them.
    assert_eq!(
        check(
            "src/daemon/reload/apply.rs",
            "use crate::daemon::{Supervisor, notify}; pub(in crate::daemon) fn f() {}"
        ),
        none
    );
    assert_eq!(
        check("src/daemon/threads.rs", "use super::DaemonError;"),
        none
    );
    assert_eq!(
        check("src/daemon/heartbeat.rs", "use super::threads::Role;"),
        ["daemon::threads::Role"]
    );
    assert_eq!(
        check(
            "src/daemon/lane/held.rs",
            "use crate::daemon::reload::Plan;"
        ),
        ["daemon::reload::Plan"]
    );
}

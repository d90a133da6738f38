//! The keys of a queue's priority levels that its config does not name (review L5). A daemon claims, pops,
//! promotes and counts only its config's levels, so the tasks of a level the config dropped (its ready list, retry
//! and delayed sets, quarantine lists, limited types' flows) wait there for good, out of `kmqd stats`' sight, unless a daemon serves that
//! level: a config names it again, or an operator moves them (docs/OPERATIONS.md, "Removing a priority level").
//! Found with `SCAN` on the queue's node, which reads the node's whole keyspace a thousand keys at a time: cheap on
//! a Redis kept for kmqd, about a second per million keys beside it; so only at start and after a reload that
//! dropped a level.

use std::collections::BTreeMap;

use super::{Conn, QueueKeys, Result, owner_info, owners};

/// One level the config does not name and the keys of it that hold tasks, each with how many.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stranded {
    pub(crate) level: String,
    /// (key, tasks it holds), in key order.
    pub(crate) keys: Vec<(String, u64)>,
}

impl Stranded {
    /// How many tasks the level's keys hold in all.
    pub fn tasks(&self) -> u64 {
        self.keys.iter().map(|(_, tasks)| tasks).sum()
    }
}

/// The kind of a level's key that holds tasks, from its name after `PREFIX:{QUEUE}:` (`ready:L`, `retry:L`,
/// `delayed:L`, `quarantine:G:L`, a limited type's `flow:L:MEMBER`), with the level; `None` for any other key of
/// the queue (a level's `ring:L` names its flows, and holds no task). A level name never holds a `:` (config
/// validation), so `processing:OWNER:L` and its claim lists are not mistaken for one.
fn level_key(rest: &str) -> Option<(Kind, &str)> {
    let (kind, level) = rest.split_once(':')?;
    let (kind, level) = match kind {
        "ready" => (Kind::List, level),
        "retry" | "delayed" => (Kind::Zset, level),
        "quarantine" => {
            let (group, level) = level.split_once(':')?;
            group.parse::<usize>().ok()?;
            (Kind::List, level)
        }
        "flow" => (Kind::List, level.split_once(':')?.0),
        _ => return None,
    };
    (!level.is_empty() && !level.contains(':')).then_some((kind, level))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    List,
    Zset,
}

/// Redis's glob, escaped: the queue's base as a literal prefix of the `SCAN` pattern.
fn glob_literal(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The levels of `keys`' queue that hold tasks in Redis although `keys.levels` does not name them and no live
/// owner registered them (a daemon with another config serves those), in level order.
pub(crate) fn stranded(conn: &mut Conn, keys: &QueueKeys) -> Result<Vec<Stranded>> {
    let base = keys.base();
    let pattern = format!("{}:*", glob_literal(base));
    let mut found: BTreeMap<String, Vec<(String, Kind)>> = BTreeMap::new();
    let mut cursor = 0u64;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000);
        // To the queue's node (in a cluster, the one that holds its slot), every page.
        let (next, names): (u64, Vec<String>) = conn.query_at(&keys.owners, &scan)?;
        for name in names {
            let Some(rest) = name.strip_prefix(base).and_then(|r| r.strip_prefix(':')) else {
                continue;
            };
            if let Some((kind, level)) = level_key(rest)
                && !keys.levels.iter().any(|known| known == level)
            {
                found
                    .entry(level.to_string())
                    .or_default()
                    .push((name.clone(), kind));
            }
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    if found.is_empty() {
        return Ok(Vec::new());
    }
    // A level a live owner registered is served, by a daemon with another config (a rolling change).
    let (now_ms, registered) = owners(conn, keys)?;
    for (owner, deadline) in registered {
        if deadline > now_ms
            && let Some(info) = owner_info(conn, keys, &owner)?
        {
            found.retain(|level, _| !info.levels.contains(level));
        }
    }
    let mut stranded = Vec::new();
    for (level, mut named) in found {
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut held = Vec::new();
        for (key, kind) in named {
            // A key of another type (written by hand) holds no task of kmqd's.
            let found_type: String = redis::cmd("TYPE").arg(&key).query(conn)?;
            let count: u64 = match (kind, found_type.as_str()) {
                (Kind::List, "list") => redis::cmd("LLEN").arg(&key).query(conn)?,
                (Kind::Zset, "zset") => redis::cmd("ZCARD").arg(&key).query(conn)?,
                _ => 0,
            };
            if count > 0 {
                held.push((key, count));
            }
        }
        if !held.is_empty() {
            stranded.push(Stranded { level, keys: held });
        }
    }
    Ok(stranded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_of_a_level_are_told_from_the_queue_s_other_keys() {
        let cases = [
            ("ready:high", Some((Kind::List, "high"))),
            ("retry:high", Some((Kind::Zset, "high"))),
            ("delayed:high", Some((Kind::Zset, "high"))),
            ("quarantine:64:high", Some((Kind::List, "high"))),
            ("quarantine:x:high", None),
            ("flow:high::report%3A%7Bx%7D", Some((Kind::List, "high"))),
            ("flow:high", None),
            ("ring:high", None),
            ("delayed-tasks", None),
            ("processing:host-1-2-ab.1:high", None),
            ("processing:host-1-2-ab.1:high:40", None),
            ("ready:", None),
            ("ready:a:b", None),
            ("stats", None),
            ("rate:q:1000", None),
        ];
        for (rest, expected) in cases {
            assert_eq!(level_key(rest), expected, "{rest}");
        }
    }

    #[test]
    fn a_scan_pattern_takes_the_queue_s_base_literally() {
        assert_eq!(glob_literal("kmq:{jobs}"), "kmq:{jobs}");
        assert_eq!(glob_literal("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}

//! The producers' conformance suite (clients/conformance/README.md) run through `kmqd::Client`, the reference
//! producer: every case's calls against a real redis-server, then exactly the keys it names. Each client in
//! `clients/` runs the same files, so a case that holds here holds for what the daemons read.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::*;

/// How far a `$ms_near_now` value may be from Redis's clock (plus its offset): a slow machine's calls take
/// seconds, never this long.
const NEAR_MS: i64 = 5_000;

fn cases_dir() -> PathBuf {
    workspace_dir().join("clients/conformance/cases")
}

/// Every case file, in name order.
fn case_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(cases_dir())
        .expect("clients/conformance/cases is readable")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    files
}

/// What the runner remembers while it checks one case: the captured ids and Redis's clock after the calls.
struct Checker {
    captures: HashMap<String, String>,
    now_ms: i64,
}

impl Checker {
    /// Matches `actual` (a stored string, or a JSON value from a reply or a decoded envelope) against `expected`
    /// (a value or a matcher); `subset`: objects need only the fields `expected` names (a `show` place).
    fn check(
        &mut self,
        at: &str,
        expected: &Value,
        actual: &Value,
        subset: bool,
    ) -> Result<(), String> {
        let text = match actual {
            Value::String(text) => Some(text.clone()),
            Value::Number(number) => Some(number.to_string()),
            _ => None,
        };
        if let Value::Object(map) = expected
            && map.len() == 1
        {
            let (key, argument) = map.iter().next().expect("one entry");
            let mismatch = |what: &str| Err(format!("{at}: {actual} is not {what}"));
            match key.as_str() {
                "json" => {
                    let Some(text) = &text else {
                        return mismatch("JSON text");
                    };
                    let decoded: Value = serde_json::from_str(text)
                        .map_err(|error| format!("{at}: {text:?} is not JSON: {error}"))?;
                    return self.check(at, argument, &decoded, false);
                }
                "$ms_near_now" => {
                    let offset = argument.as_i64().expect("$ms_near_now takes an integer");
                    let ms = text.as_deref().and_then(|text| text.parse::<f64>().ok());
                    return match ms {
                        Some(ms) if (ms as i64 - (self.now_ms + offset)).abs() <= NEAR_MS => Ok(()),
                        _ => mismatch(&format!("within {NEAR_MS} ms of now + {offset}")),
                    };
                }
                "$uuid" => {
                    return match text.as_deref().is_some_and(is_uuid) {
                        true => Ok(()),
                        false => mismatch("a UUID"),
                    };
                }
                "$capture" => {
                    let name = argument.as_str().expect("$capture takes a name");
                    let Some(text) = text else {
                        return mismatch("a string to capture");
                    };
                    self.captures.insert(name.to_string(), text);
                    return Ok(());
                }
                "$same_as" => {
                    let name = argument.as_str().expect("$same_as takes a name");
                    let captured = self
                        .captures
                        .get(name)
                        .ok_or_else(|| format!("{at}: nothing was captured as {name:?} before"))?;
                    return match text.as_deref() == Some(captured.as_str()) {
                        true => Ok(()),
                        false => mismatch(&format!("{captured:?} (captured as {name:?})")),
                    };
                }
                _ => {}
            }
        }
        match (expected, actual) {
            (Value::Object(want), Value::Object(have)) => {
                if !subset {
                    let extra: Vec<&String> =
                        have.keys().filter(|k| !want.contains_key(*k)).collect();
                    if !extra.is_empty() {
                        return Err(format!("{at}: unexpected fields {extra:?} in {actual}"));
                    }
                }
                for (key, value) in want {
                    let field = have
                        .get(key)
                        .ok_or_else(|| format!("{at}: no field {key:?} in {actual}"))?;
                    self.check(&format!("{at}.{key}"), value, field, subset)?;
                }
                Ok(())
            }
            (Value::Array(want), Value::Array(have)) => {
                if want.len() != have.len() {
                    return Err(format!(
                        "{at}: {} items, expected {}: {actual}",
                        have.len(),
                        want.len()
                    ));
                }
                for (n, (value, item)) in want.iter().zip(have).enumerate() {
                    self.check(&format!("{at}[{n}]"), value, item, subset)?;
                }
                Ok(())
            }
            // A number matches a stored integer's text, or the same number.
            (Value::Number(number), _) if text.as_deref() == Some(number.to_string().as_str()) => {
                Ok(())
            }
            _ if expected == actual => Ok(()),
            _ => Err(format!("{at}: {actual} is not {expected}")),
        }
    }
}

fn is_uuid(text: &str) -> bool {
    let parts: Vec<&str> = text.split('-').collect();
    parts.iter().map(|part| part.len()).eq([8, 4, 4, 4, 12])
        && parts
            .iter()
            .all(|part| part.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The Redis commands of a case's `given`, each as its words.
fn given(case: &Value) -> Vec<Vec<&str>> {
    let commands = case["given"].as_array().expect("given is a list");
    commands
        .iter()
        .map(|command| {
            let words = command.as_array().expect("a command is a list of words");
            words
                .iter()
                .map(|w| w.as_str().expect("a word is a string"))
                .collect()
        })
        .collect()
}

/// The config for a case's queues: each with the levels and default a daemon wrote into its meta hash in the
/// case's `given` (clients/conformance/README.md, "The queue's shape"), else the one level `normal`.
fn queues_config(case: &Value) -> String {
    let mut shapes: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
    for call in case["calls"].as_array().expect("calls is a list") {
        let mut queues = Vec::new();
        match call["queue"].as_str() {
            Some(queue) => queues.push(queue.to_string()),
            // A flow names its queues in its nodes.
            None => flow_queues(&call["flow"], &mut queues),
        }
        for queue in queues {
            shapes.entry(queue).or_default();
        }
    }
    for words in given(case) {
        if !words[0].eq_ignore_ascii_case("HSET") {
            continue;
        }
        for (queue, shape) in shapes.iter_mut() {
            if words[1] == format!("kmq:{{{queue}}}:meta") {
                for pair in words[2..].chunks(2) {
                    match pair[0] {
                        "levels" => shape.0 = Some(pair[1].to_string()),
                        "default_priority" => shape.1 = Some(pair[1].to_string()),
                        _ => {}
                    }
                }
            }
        }
    }
    shapes
        .iter()
        .map(|(queue, (levels, default))| {
            let mut text = format!("[[queues]]\nname = \"{queue}\"\nmode = \"safe\"\n");
            if let Some(levels) = levels {
                let quoted: Vec<String> = levels.split(',').map(|l| format!("\"{l}\"")).collect();
                text += &format!("priorities = [{}]\n", quoted.join(", "));
            }
            if let Some(default) = default {
                text += &format!("default_priority = \"{default}\"\n");
            }
            text
        })
        .collect()
}

/// Every queue a flow's nodes name (clients/conformance/README.md, `push_flow`), so that the config has each.
fn flow_queues(node: &Value, queues: &mut Vec<String>) {
    if let Some(queue) = node["queue"].as_str() {
        queues.push(queue.to_string());
    }
    for dep in node["after"].as_array().into_iter().flatten() {
        flow_queues(dep, queues);
    }
}

/// A case's task as a `NewTask` (a bad one is refused by the push, not here).
fn new_task(kind: &Value, data: &Value, options: &Value) -> kmqd::NewTask {
    let data = serde_json::value::to_raw_value(data).expect("JSON serializes");
    let mut task = kmqd::NewTask::with_data(kind.as_str().expect("type is a string"), data);
    for (option, value) in options.as_object().into_iter().flatten() {
        task = match option.as_str() {
            "id" => task.id(value.as_str().unwrap()),
            "priority" => task.priority(value.as_str().unwrap()),
            "unique" if value == &json!(true) => task.unique(),
            "unique" => task,
            "group" => task.group(value.as_str().unwrap()),
            "delay_ms" => task.delay(Duration::from_millis(value.as_u64().unwrap())),
            "at_ms" => task.at(value.as_i64().unwrap()),
            "expires_at_ms" => task.expires_at(value.as_i64().unwrap()),
            "expires_in_ms" => task.expires_in(Duration::from_millis(value.as_u64().unwrap())),
            "debounce_ms" => task.debounce(Duration::from_millis(value.as_u64().unwrap())),
            "unique_for_ms" => task.unique_for(Duration::from_millis(value.as_u64().unwrap())),
            "traceparent" => {
                let state = options["tracestate"].as_str().map(str::to_string);
                task.trace(value.as_str().unwrap(), state)
            }
            "tracestate" => task, // taken with traceparent
            other => {
                panic!("kmqd::Client has no option {other:?}: give the case a \"skip\" for rust")
            }
        };
    }
    task
}

fn error_kind(error: kmqd::ClientError) -> Value {
    let kind = match error {
        kmqd::ClientError::UnknownPriority { .. } => "unknown_priority",
        kmqd::ClientError::UniqueWithoutId | kmqd::ClientError::Data(_) => "invalid_argument",
        other => panic!("a call failed: {other}"),
    };
    json!({ "error": kind })
}

/// Runs one call through the client: what it came to, in the case's words.
fn run_call(client: &kmqd::Client, call: &Value) -> Value {
    if call["call"] == "push_flow" {
        return match client.push_flow(&call["flow"].to_string()) {
            Ok(pushed) => {
                let tasks: Vec<Value> = pushed
                    .tasks
                    .iter()
                    .map(|(queue, id, _)| json!({ "queue": queue, "id": id }))
                    .collect();
                json!({ "tasks": tasks })
            }
            // The refusal names the node first: `PATH: what is wrong`.
            Err(kmqd::ClientError::Data(message)) => {
                let at = message.split_once(": ").map_or("", |(at, _)| at);
                json!({ "error": "invalid_flow", "at": at })
            }
            Err(other) => panic!("push_flow failed: {other}"),
        };
    }
    let queue = call["queue"].as_str().unwrap();
    match call["call"].as_str().unwrap() {
        "push" => match client.push(
            queue,
            new_task(&call["type"], &call["data"], &call["options"]),
        ) {
            Ok(kmqd::Pushed::Accepted(id)) => json!({ "id": id }),
            Ok(kmqd::Pushed::Duplicate(_)) => json!({ "error": "duplicate" }),
            Err(error) => error_kind(error),
        },
        "push_batch" => {
            let tasks = call["tasks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|task| new_task(&task["type"], &task["data"], &task["options"]));
            match client.push_batch(queue, tasks.collect::<Vec<_>>()) {
                Ok(pushed) if pushed.iter().all(kmqd::Pushed::is_accepted) => {
                    json!({ "ids": pushed.iter().map(|p| p.id()).collect::<Vec<_>>() })
                }
                Ok(pushed) => json!({ "results": format!("{pushed:?}") }),
                Err(error) => error_kind(error),
            }
        }
        "cancel" => {
            let removed = client.cancel(queue, call["id"].as_str().unwrap()).unwrap();
            json!({ "removed": removed })
        }
        "show" => {
            let found = client.find(queue, call["id"].as_str().unwrap()).unwrap();
            json!({ "found": found })
        }
        other => panic!("the runner has no call {other:?}"),
    }
}

/// Every key Redis holds, each as the case format writes it (a zset as member → score).
fn redis_state(redis: &RedisServer) -> BTreeMap<String, Value> {
    let keys: Vec<String> = redis.cmd(&["KEYS", "*"]);
    keys.into_iter()
        .map(|key| {
            let kind: String = redis.cmd(&["TYPE", &key]);
            let value = match kind.as_str() {
                "list" => json!({ "list": redis.cmd::<Vec<String>>(&["LRANGE", &key, "0", "-1"]) }),
                "hash" => {
                    json!({ "hash": redis.cmd::<BTreeMap<String, String>>(&["HGETALL", &key]) })
                }
                "string" => json!({ "string": redis.cmd::<String>(&["GET", &key]) }),
                "set" => json!({ "set": redis.cmd::<Vec<String>>(&["SMEMBERS", &key]) }),
                "zset" => {
                    let scored: Vec<(String, f64)> =
                        redis.cmd(&["ZRANGE", &key, "0", "-1", "WITHSCORES"]);
                    let scored: serde_json::Map<String, Value> = scored
                        .into_iter()
                        .map(|(member, score)| (member, json!(score as i64)))
                        .collect();
                    json!({ "zset": scored })
                }
                other => panic!("key {key} has type {other}"),
            };
            (key, value)
        })
        .collect()
}

/// Checks the keys Redis holds against the case's `then.keys`: the same names, each value matching.
fn check_keys(checker: &mut Checker, expected: &Value, redis: &RedisServer) -> Result<(), String> {
    let state = redis_state(redis);
    let expected = expected.as_object().expect("then.keys is an object");
    let unexpected: Vec<&String> = state
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .collect();
    let missing: Vec<&String> = expected
        .keys()
        .filter(|k| !state.contains_key(*k))
        .collect();
    if !unexpected.is_empty() || !missing.is_empty() {
        return Err(format!(
            "keys: unexpected {unexpected:?}, missing {missing:?}; Redis holds {state:?}"
        ));
    }
    for (key, want) in expected {
        let have = &state[key];
        let want = match want.get("zset") {
            // A zset as member → score, in any order.
            Some(Value::Array(pairs)) => {
                let map: serde_json::Map<String, Value> = pairs
                    .iter()
                    .map(|pair| (pair[0].as_str().unwrap().to_string(), pair[1].clone()))
                    .collect();
                json!({ "zset": map })
            }
            _ => want.clone(),
        };
        let want = match want.get("set") {
            Some(Value::Array(members)) => {
                let mut members = members.clone();
                members.sort_by_key(|m| m.to_string());
                json!({ "set": members })
            }
            _ => want,
        };
        let mut have = have.clone();
        if let Some(Value::Array(members)) = have.get_mut("set") {
            members.sort_by_key(|m| m.to_string());
        }
        checker.check(key, &want, &have, false)?;
    }
    Ok(())
}

/// Runs one case; an error names what differed. `clients` keeps a client per config text, since most cases share
/// one and a client's pool is slow to make on a loaded machine.
fn run_case(
    path: &Path,
    case: &Value,
    redis: &RedisServer,
    clients: &mut HashMap<String, (TestDir, kmqd::Client)>,
) -> Result<(), String> {
    let _: String = redis.cmd(&["FLUSHALL"]);
    for words in given(case) {
        let _: redis::Value = redis.cmd(&words);
    }
    let (_, client) = clients
        .entry(queues_config(case))
        .or_insert_with_key(|queues| {
            let dir = TestDir::new();
            let config = dir.config(redis, queues);
            let client = client(&config);
            (dir, client)
        });
    let mut outcomes = Vec::new();
    for call in case["calls"].as_array().unwrap() {
        outcomes.push(run_call(client, call));
    }
    let time: Vec<String> = redis.cmd(&["TIME"]);
    let now_ms = time[0].parse::<i64>().unwrap() * 1000 + time[1].parse::<i64>().unwrap() / 1000;
    let mut checker = Checker {
        captures: HashMap::new(),
        now_ms,
    };
    for (n, (call, outcome)) in case["calls"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&outcomes)
        .enumerate()
    {
        let subset = call["call"] == "show";
        checker.check(
            &format!("call {n} ({})", call["call"]),
            &call["expect"],
            outcome,
            subset,
        )?;
    }
    check_keys(&mut checker, &case["then"]["keys"], redis)
        .map_err(|error| format!("{error}\n({} ran)", path.display()))
}

#[test]
fn every_conformance_case_holds_for_the_rust_client() {
    let redis = RedisServer::start();
    let mut failures = Vec::new();
    let mut clients = HashMap::new();
    let mut ran = 0;
    for path in case_files() {
        let case: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        if let Some(reason) = case["skip"]["rust"].as_str() {
            eprintln!("skipped {}: {reason}", path.display());
            continue;
        }
        ran += 1;
        if let Err(error) = run_case(&path, &case, &redis, &mut clients) {
            failures.push(format!("{} ({}): {error}", path.display(), case["name"]));
        }
    }
    assert!(ran >= 8, "only {ran} conformance cases ran");
    assert!(
        failures.is_empty(),
        "{} cases failed:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The Python client ships the scripts it runs (clients/python/kmq/scripts/, symbolic links to src/broker/scripts/
/// whose contents its wheel holds): each must be kmqd's own, byte for byte, or its pushes and cancels drift from
/// what the daemons read. A link replaced by a copy fails here once the script changes.
#[test]
fn the_python_clients_scripts_are_kmqds_byte_for_byte() {
    let copies = workspace_dir().join("clients/python/kmq/scripts");
    let mut compared = 0;
    for entry in fs::read_dir(&copies).unwrap() {
        let copy = entry.unwrap().path();
        let name = copy.file_name().unwrap();
        let original = workspace_dir().join("src/broker/scripts").join(name);
        assert!(
            fs::read(&copy).unwrap() == fs::read(&original).unwrap(),
            "{} differs from {}: copy it again",
            copy.display(),
            original.display()
        );
        compared += 1;
    }
    assert_eq!(
        compared, 6,
        "push.lua, checks.lua, remove.lua, unique_hold.lua, deps.lua and flow_push.lua are shipped"
    );
}

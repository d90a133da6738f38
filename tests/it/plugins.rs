//! Plugins (docs/PLUGINS.md): every refusal of the loader names the file and says what to fix; a misbehaving
//! plugin fails its task, never the daemon; `handle` runs on many threads at once; the C example, the exec plugin
//! and the C snippet of docs/PLUGINS.md run tasks end to end.
//!
//! The C plugins are compiled by the tests with the system C compiler; the Rust ones are this workspace's crates.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kmq_plugin::testing::process_is_alive;
use kmqd::NewTask;
use kmqd::broker::QueueStats;
use kmqd::plugin::Registry;

use crate::support::*;

/// The loader's test plugin: correct as is, each `-D` flag breaks one rule (see the file's header).
fn configurable_c() -> PathBuf {
    workspace_dir().join("tests/it/c/configurable.c")
}

fn hello_c() -> PathBuf {
    workspace_dir().join("plugins/c-example/kmq_hello.c")
}

const QUEUE: &str = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\n";

/// A config for `check-config`, which needs no Redis: the test's plugins dir, one queue, then `plugins` (TOML
/// `[plugins.NAME]` sections).
fn offline_config(dir: &TestDir, plugins: &str) -> PathBuf {
    let text = format!(
        "[redis]\nurl = \"unix://{}\"\n\n[daemon]\nplugins_dir = \"{}\"\n\n{QUEUE}\n{plugins}\n",
        dir.path("no-redis.sock").display(),
        dir.plugins_dir().display(),
    );
    let path = dir.path("kmqd.toml");
    fs::write(&path, text).unwrap();
    path
}

/// Runs `kmqd check-config` on `config`; asserts it refuses with exit code 2 and returns standard error.
fn refused(config: &Path) -> String {
    let (code, out, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(
        code, 2,
        "check-config must refuse; stdout:\n{out}\nstderr:\n{err}"
    );
    // `kmqd: FILE:LINE:COLUMN: plugin...`: the line of the `[plugins.NAME]` section refused.
    let at = err
        .strip_prefix(&format!("kmqd: {}:", config.display()))
        .and_then(|rest| rest.split_once(": plugin"))
        .map(|(at, _)| at.to_string());
    assert!(
        at.as_deref()
            .is_some_and(|at| at.split(':').all(|n| n.parse::<u32>().is_ok()) && at.contains(':')),
        "the message names the config file and the section's line: {err}"
    );
    err
}

/// [`refused`], and the message contains `expected`.
fn assert_refused_with(config: &Path, expected: &str) {
    let err = refused(config);
    assert!(err.contains(expected), "expected {expected:?} in: {err}");
}

fn canonical(path: &Path) -> String {
    path.canonicalize().unwrap().display().to_string()
}

#[test]
fn check_config_refuses_each_broken_c_plugin_naming_the_file_and_the_fix() {
    struct Case {
        what: &'static str,
        defines: &'static [&'static str],
        expected: &'static [&'static str],
    }
    let cases = [
        Case {
            what: "another ABI version in the descriptor",
            defines: &["PLUGIN_ABI_VERSION=2"],
            expected: &[
                "built for ABI version 2, but this kmqd speaks version 1",
                "rebuild the plugin against this kmqd's kmq_plugin.h",
            ],
        },
        Case {
            what: "only the entry point of another ABI version",
            defines: &["PLUGIN_SYMBOL=kmq_plugin_v2", "PLUGIN_ABI_VERSION=2"],
            expected: &["built for ABI version 2, but this kmqd speaks version 1"],
        },
        Case {
            what: "no entry point at all",
            defines: &["PLUGIN_SYMBOL=not_a_kmq_plugin"],
            expected: &[
                "no kmq_plugin_v1 symbol, so it is not a kmqd plugin",
                "export `const kmq_plugin *kmq_plugin_v1(void)`",
            ],
        },
        Case {
            what: "a descriptor smaller than v1's",
            defines: &["PLUGIN_STRUCT_SIZE=16"],
            expected: &[
                "struct_size is 16 bytes, smaller than the 40 bytes of ABI v1",
                "set struct_size = sizeof(kmq_plugin)",
            ],
        },
        Case {
            what: "no handle function",
            defines: &["PLUGIN_NO_HANDLE"],
            expected: &[
                "bad descriptor: its handle is NULL; set it to the function that runs a task",
            ],
        },
        Case {
            what: "an init that fails",
            defines: &["PLUGIN_INIT_FAILS"],
            expected: &[
                "(configurable): init failed: cannot reach the license server at 10.0.0.1:7000",
                "its config is the table plugins.bad.config",
            ],
        },
        Case {
            what: "no task types",
            defines: &["PLUGIN_NO_TYPES"],
            expected: &["it handles no task types; list them"],
        },
    ];
    for case in cases {
        let dir = TestDir::new();
        let library = dir.plugins_dir().join("libbad.so");
        compile_c_plugin(&configurable_c(), case.defines, &library);
        let config = offline_config(&dir, "[plugins.bad]\nfile = \"libbad.so\"\n");
        let err = refused(&config);
        assert!(
            err.contains(&format!("plugin {}", canonical(&library))),
            "{}: the message names the library: {err}",
            case.what
        );
        for expected in case.expected {
            assert!(
                err.contains(expected),
                "{}: expected {expected:?} in: {err}",
                case.what
            );
        }
    }
}

#[test]
fn the_configurable_c_plugin_is_accepted_when_nothing_is_broken() {
    // The control for the test above: the refusals come from the flags, not from the plugin.
    let dir = TestDir::new();
    let library = dir.plugins_dir().join("libgood.so");
    compile_c_plugin(&configurable_c(), &[], &library);
    let config = offline_config(&dir, "[plugins.good]\nfile = \"libgood.so\"\n");
    let (code, out, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "plugin configurable ({}): types [\"c.test\"]",
            canonical(&library)
        )),
        "{out}"
    );
}

#[test]
fn a_missing_plugin_file_is_refused_with_what_to_fix() {
    let dir = TestDir::new();
    let config = offline_config(&dir, "[plugins.gone]\nfile = \"libgone.so\"\n");
    assert_refused_with(
        &config,
        &format!(
            "plugin {}: no such file; build the plugin and copy it there, or fix plugins.gone.file",
            dir.plugins_dir().join("libgone.so").display()
        ),
    );
}

#[test]
fn a_file_that_is_not_a_shared_library_is_refused() {
    let dir = TestDir::new();
    let fake = dir.plugins_dir().join("libfake.so");
    fs::write(&fake, "#!/bin/sh\necho not a library\n").unwrap();
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let err = refused(&offline_config(
        &dir,
        "[plugins.fake]\nfile = \"libfake.so\"\n",
    ));
    assert!(
        err.contains(&format!("plugin {}: cannot load:", canonical(&fake)))
            && err.contains("it must be a shared library (.so) built for this machine"),
        "{err}"
    );
}

#[test]
fn a_task_type_claimed_by_two_plugins_is_refused_naming_both_files() {
    let dir = TestDir::new();
    let rival = dir.plugins_dir().join("librival.so");
    compile_c_plugin(&configurable_c(), &["PLUGIN_TYPE=\"test\""], &rival);
    let err = refused(&offline_config(
        &dir,
        "[plugins.rival]\nfile = \"librival.so\"\n[plugins.testkit]\nfile = \"libkmq_testkit.so\"\n",
    ));
    let testkit = dir.plugins_dir().join("libkmq_testkit.so");
    assert!(
        err.contains(&format!(
            "plugins {} and {} both handle task type \"test\"; a type must belong to one plugin",
            canonical(&rival),
            canonical(&testkit)
        )),
        "{err}"
    );
}

#[test]
fn two_sections_of_one_file_that_claim_the_same_type_are_refused_naming_both_whatever_the_path() {
    // One file may serve several sections (each its own init and config), but a type still has one owner: the
    // testkit plugin claims "test" whatever its config.
    let dir = TestDir::new();
    let testkit = dir.plugins_dir().join("libkmq_testkit.so");
    std::os::unix::fs::symlink(&testkit, dir.plugins_dir().join("libsymlink.so")).unwrap();
    fs::hard_link(&testkit, dir.plugins_dir().join("libhardlink.so")).unwrap();
    for (other, reached_as) in [
        ("libkmq_testkit.so", None),
        ("libsymlink.so", None),
        (
            "libhardlink.so",
            Some(dir.plugins_dir().join("libhardlink.so")),
        ),
    ] {
        let config = offline_config(
            &dir,
            &format!(
                "[plugins.first]\nfile = \"libkmq_testkit.so\"\n[plugins.second]\nfile = \"{other}\"\n"
            ),
        );
        let err = refused(&config);
        let mut expected = format!(
            "plugins.first and plugins.second, two sections of the same file {}",
            canonical(&testkit)
        );
        if let Some(path) = reached_as {
            expected.push_str(&format!(" (also reached as {})", canonical(&path)));
        }
        expected.push_str(", both handle task type \"test\"; a type must belong to one plugin: give each section its own types");
        assert!(
            err.contains(&expected),
            "{other}: expected {expected:?} in: {err}"
        );
    }
}

#[test]
fn a_plugin_or_its_directory_writable_by_group_or_others_is_refused() {
    let dir = TestDir::new();
    let config = offline_config(&dir, "[plugins.testkit]\nfile = \"libkmq_testkit.so\"\n");
    let plugin = dir.plugins_dir().join("libkmq_testkit.so");
    fs::set_permissions(&plugin, fs::Permissions::from_mode(0o775)).unwrap();
    assert_refused_with(
        &config,
        &format!(
            "plugin {0}: refused: its file {0} is writable by group or others (mode 775); run chmod go-w on it",
            canonical(&plugin)
        ),
    );
    fs::set_permissions(&plugin, fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(dir.plugins_dir(), fs::Permissions::from_mode(0o777)).unwrap();
    assert_refused_with(
        &config,
        &format!(
            "refused: its directory {} is writable by group or others (mode 777); run chmod go-w on it",
            canonical(&dir.plugins_dir())
        ),
    );
}

#[test]
fn a_symlink_in_a_writable_plugins_dir_is_refused_though_its_target_is_safe() {
    // The target's own directory is fine, but whoever can write plugins_dir can point the link elsewhere.
    let dir = TestDir::new();
    let elsewhere = dir.path("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    fs::set_permissions(&elsewhere, fs::Permissions::from_mode(0o755)).unwrap();
    let target = elsewhere.join("libkmq_testkit.so");
    fs::rename(dir.plugins_dir().join("libkmq_testkit.so"), &target).unwrap();
    std::os::unix::fs::symlink(&target, dir.plugins_dir().join("libkmq_testkit.so")).unwrap();
    let config = offline_config(&dir, "[plugins.testkit]\nfile = \"libkmq_testkit.so\"\n");
    let (code, _, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(
        code, 0,
        "a safe link into a safe directory is accepted: {err}"
    );
    fs::set_permissions(dir.plugins_dir(), fs::Permissions::from_mode(0o757)).unwrap();
    assert_refused_with(
        &config,
        &format!(
            "plugin {}: refused: its directory {} is writable by group or others (mode 757)",
            canonical(&target),
            canonical(&dir.plugins_dir())
        ),
    );
}

/// The plugin of `dir`'s testkit moved two directories down, to `outer/inner/`, and a config naming it there:
/// whoever can write `outer` could swap `inner` for a directory of theirs between a check and the load.
fn plugin_under_outer(dir: &TestDir) -> (PathBuf, PathBuf, PathBuf) {
    let outer = dir.path("outer");
    let inner = outer.join("inner");
    fs::create_dir_all(&inner).unwrap();
    for directory in [&outer, &inner] {
        fs::set_permissions(directory, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let plugin = inner.join("libkmq_testkit.so");
    fs::rename(dir.plugins_dir().join("libkmq_testkit.so"), &plugin).unwrap();
    let config = offline_config(
        dir,
        &format!("[plugins.testkit]\nfile = \"{}\"\n", plugin.display()),
    );
    (config, outer, plugin)
}

/// Review L9: the checks looked at the file and its directory by path, then the loader opened the path again, so
/// a directory higher up that others could write let them swap what was loaded for what was checked. Every
/// directory from `/` down is checked now, through the descriptors the file is opened by.
#[test]
fn a_plugin_under_an_ancestor_directory_writable_by_group_or_others_is_refused_naming_it() {
    let dir = TestDir::new();
    let (config, outer, plugin) = plugin_under_outer(&dir);
    let check = |config: &Path| {
        kmqd(
            &["--config", config.to_str().unwrap(), "check-config"],
            None,
        )
    };
    let (code, _, err) = check(&config);
    assert_eq!(
        code, 0,
        "safe directories all the way down are accepted: {err}"
    );
    for mode in [0o777, 0o775, 0o757] {
        fs::set_permissions(&outer, fs::Permissions::from_mode(mode)).unwrap();
        assert_refused_with(
            &config,
            &format!(
                "plugin {}: refused: its ancestor directory {} is writable by group or others (mode {mode:o}); \
                 run chmod go-w on it",
                canonical(&plugin),
                canonical(&outer)
            ),
        );
    }
    // The sticky bit (as on /tmp, which the test's own directory is under): only an entry's owner may rename or
    // remove it, and `inner` is checked for its owner.
    fs::set_permissions(&outer, fs::Permissions::from_mode(0o1777)).unwrap();
    let (code, _, err) = check(&config);
    assert_eq!(code, 0, "a sticky ancestor is accepted: {err}");
}

/// The owner check needs a file owned by someone who is neither root nor us, which only root can make. These
/// tests run as root (here and in CI); anyone else gets this failure rather than a silent skip.
fn assert_running_as_root() {
    let probe = tempfile::NamedTempFile::new().unwrap();
    let uid = std::os::unix::fs::MetadataExt::uid(&probe.as_file().metadata().unwrap());
    assert_eq!(
        uid, 0,
        "this test chowns a plugin to another user, which needs root; run the test suite as root (CI does)"
    );
}

#[test]
fn a_plugin_or_directory_owned_by_another_user_is_refused() {
    assert_running_as_root();
    const NOBODY: u32 = 65534;
    let dir = TestDir::new();
    let config = offline_config(&dir, "[plugins.testkit]\nfile = \"libkmq_testkit.so\"\n");
    let plugin = dir.plugins_dir().join("libkmq_testkit.so");
    std::os::unix::fs::chown(&plugin, Some(NOBODY), None).unwrap();
    assert_refused_with(
        &config,
        &format!(
            "refused: its file {} is owned by uid 65534, which is neither root nor the daemon's user (uid 0); run chown root on it",
            canonical(&plugin)
        ),
    );
    std::os::unix::fs::chown(&plugin, Some(0), None).unwrap();
    std::os::unix::fs::chown(dir.plugins_dir(), Some(NOBODY), None).unwrap();
    assert_refused_with(
        &config,
        &format!(
            "refused: its directory {} is owned by uid 65534",
            canonical(&dir.plugins_dir())
        ),
    );
    // A directory higher up (review L9), even with the sticky bit: its owner may rename what is in it.
    let dir = TestDir::new();
    let (config, outer, _) = plugin_under_outer(&dir);
    std::os::unix::fs::chown(&outer, Some(NOBODY), None).unwrap();
    for mode in [0o755, 0o1777] {
        fs::set_permissions(&outer, fs::Permissions::from_mode(mode)).unwrap();
        assert_refused_with(
            &config,
            &format!(
                "refused: its ancestor directory {} is owned by uid 65534, which is neither root nor the daemon's \
                 user (uid 0)",
                canonical(&outer)
            ),
        );
    }
}

#[test]
fn the_c_example_refuses_a_config_table_with_its_own_message() {
    let dir = TestDir::new();
    let library = dir.plugins_dir().join("libkmq_hello.so");
    compile_c_plugin(&hello_c(), &[], &library);
    let config = offline_config(
        &dir,
        "[plugins.hello]\nfile = \"libkmq_hello.so\"\nconfig = { greeting = \"hi\" }\n",
    );
    assert_refused_with(
        &config,
        &format!(
            "plugin {} (hello): init failed: kmq_hello takes no config: remove the config table of its [plugins.NAME] section",
            canonical(&library)
        ),
    );
}

/// Waits (up to `within`) until `count` tasks of queue "jobs" have ended, done or dead-lettered; returns the
/// stats then.
fn all_ended(config: &Path, count: u64, within: Duration) -> QueueStats {
    eventually(within, &format!("{count} tasks of jobs to end"), || {
        let s = stats(config, "jobs");
        (s.done + s.dead == count, s)
    })
}

fn reason_of(records: &[serde_json::Value], id: &str) -> String {
    records
        .iter()
        .find(|record| record["id"] == id)
        .and_then(|record| record["reason"].as_str())
        .unwrap_or_else(|| panic!("no dead letter for {id} in {records:?}"))
        .to_string()
}

fn push(config: &Path, queue: &str, kind: &str, id: &str, data: &str) {
    let pushed = client(config)
        .push(queue, NewTask::new(kind, data).unwrap().id(id))
        .unwrap();
    assert!(pushed.is_accepted(), "{id}");
}

#[test]
fn the_c_example_runs_tasks_end_to_end_through_the_real_daemon() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    compile_c_plugin(&hello_c(), &[], &dir.plugins_dir().join("libkmq_hello.so"));
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 4\nbackoff = \"10ms\"\nretry_times = 1\n\
         execution_timeout = \"300ms\"\n\n[plugins.hello]\nfile = \"libkmq_hello.so\"\n",
    );
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    for i in 0..5 {
        push(&config, "jobs", "hello", &format!("greet-{i}"), "\"world\"");
    }
    push(&config, "jobs", "hello", "fails", "\"fail\"");
    push(&config, "jobs", "hello", "no-data", "null");
    push(&config, "jobs", "hello", "retries", "\"retry\"");
    push(&config, "jobs", "hello", "waits", "\"wait\"");
    let s = all_ended(&config, 9, Duration::from_secs(30));
    assert_eq!((s.done, s.dead, s.retried), (5, 4, 2), "{s:?}");
    let dead = dead_records(&redis, "jobs");
    assert_eq!(reason_of(&dead, "fails"), "hello: asked to fail");
    assert_eq!(
        reason_of(&dead, "no-data"),
        "hello: no data, nobody to greet"
    );
    assert_eq!(
        reason_of(&dead, "retries"),
        "hello: asked to retry; no retries left after 2 runs"
    );
    assert!(
        reason_of(&dead, "waits").starts_with("execution timeout: still running after 300ms"),
        "{dead:?}"
    );
    // on_dead runs after the dead letter is stored, from the acker or the monitor: poll the log for it.
    let log = eventually(
        Duration::from_secs(10),
        "on_dead for every dead task",
        || {
            let log = daemon.log_text();
            (log.matches("kmq_hello: task ").count() == 4, log)
        },
    );
    assert!(
        log.contains("kmq_hello: hello, \"world\"! (task greet-3, attempt 0)"),
        "{log}"
    );
    assert!(
        log.contains("kmq_hello: task fails is dead: hello: asked to fail"),
        "{log}"
    );
    assert!(
        log.contains("kmq_hello: task retries is dead: hello: asked to retry"),
        "{log}"
    );

    daemon.signal(15);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        daemon.log_text()
    );
    // shutdown ran once, after every handle returned: 5 greetings, fail, null, retry twice, wait twice.
    let log = daemon.log_text();
    assert!(log.contains("kmq_hello: handled 11 tasks"), "{log}");
}

#[test]
fn a_status_outside_the_abi_is_a_handler_error_not_a_crash() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    compile_c_plugin(
        &configurable_c(),
        &["PLUGIN_STATUS=7"],
        &dir.plugins_dir().join("libodd.so"),
    );
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\non_handler_error = \"dead\"\n\n\
         [plugins.odd]\nfile = \"libodd.so\"\n",
    );
    let daemon = TestDaemon::start(&config);
    push(&config, "jobs", "c.test", "odd", "{}");
    push(&config, "jobs", "test", "normal", "{}");
    let dead = eventually(
        Duration::from_secs(10),
        "the odd task's dead letter",
        || {
            let dead = dead_records(&redis, "jobs");
            (dead.len() == 1, dead)
        },
    );
    assert_eq!(
        reason_of(&dead, "odd"),
        "plugin configurable returned status 7, which is not a kmq_status"
    );
    eventually(
        Duration::from_secs(10),
        "the other plugin's task to be done",
        || (stats(&config, "jobs").done == 1, ()),
    );
    daemon.stop();
}

/// A C plugin hands a result on through `kmq_host`; the same plugin with the descriptor of a plugin built before
/// `kmq_host` (its `struct_size` ends before `host`) is never offered it, and still finishes its tasks, with no
/// result kept.
#[test]
fn a_plugin_built_before_kmq_host_finishes_tasks_without_a_result() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let result = r#"PLUGIN_RESULT="{\"rows\":3}""#;
    compile_c_plugin(
        &configurable_c(),
        &[result, "PLUGIN_TYPE=\"c.new\""],
        &dir.plugins_dir().join("libnew.so"),
    );
    compile_c_plugin(
        &configurable_c(),
        &[
            result,
            "PLUGIN_TYPE=\"c.old\"",
            "PLUGIN_STRUCT_SIZE=offsetof(kmq_plugin,host)",
        ],
        &dir.plugins_dir().join("libold.so"),
    );
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nkeep_results = \"1h\"\n\n\
         [plugins.new]\nfile = \"libnew.so\"\n\n[plugins.old]\nfile = \"libold.so\"\n",
    );
    let daemon = TestDaemon::start(&config);
    push(&config, "jobs", "c.new", "new", "{}");
    push(&config, "jobs", "c.old", "old", "{}");
    let kept = |id: &str| redis.kept_result("jobs", id);
    let (new, old) = eventually(Duration::from_secs(10), "both results kept", || {
        let both = (kept("new"), kept("old"));
        (both.0.is_some() && both.1.is_some(), both)
    });
    assert_eq!(new.unwrap()["result"], serde_json::json!({"rows": 3}));
    let old = old.unwrap();
    assert_eq!(
        (&old["state"], &old["result"]),
        (&serde_json::json!("done"), &serde_json::Value::Null)
    );
    daemon.stop();
}

#[test]
fn handle_is_called_on_many_worker_threads_at_once() {
    const WORKERS: usize = 8;
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &format!("[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = {WORKERS}\n"),
    );
    let daemon = TestDaemon::start(&config);
    let gate = dir.path("gate");
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    for i in 0..WORKERS {
        push(&config, "jobs", "test", &format!("t{i}"), &data);
    }
    // No run can return before the gate exists, so seeing every run started means they are all inside `handle`
    // at the same time, each on its own worker thread.
    let records = eventually(Duration::from_secs(10), "every run to start", || {
        let records = dir.records();
        (records.starts.len() == WORKERS, records)
    });
    assert!(
        records.ends.is_empty(),
        "none returned before the gate opened: {records:?}"
    );
    fs::write(&gate, "").unwrap();
    eventually(Duration::from_secs(10), "every task to be done", || {
        let s = stats(&config, "jobs");
        (s.done == WORKERS as u64, s)
    });
    daemon.stop();
}

#[test]
fn a_plugin_panicking_on_every_tenth_task_under_load_fails_only_those_tasks() {
    const TASKS: usize = 1000;
    let redis = RedisServer::start();
    let dir = TestDir::new();
    // Two queues, both 16 workers: panics follow each queue's on_handler_error (docs/PLUGINS.md).
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"retrying\"\nmode = \"safe\"\nworkers = 16\nretry_times = 2\nbackoff = \"10ms\"\n\n\
         [[queues]]\nname = \"dying\"\nmode = \"safe\"\nworkers = 16\non_handler_error = \"dead\"\n",
    );
    // The real binary, so that "the daemon keeps running" means the process.
    let mut daemon =
        Process::start_with_env(&config, dir.path("kmqd.log"), &[("RUST_BACKTRACE", "0")]);
    let client = client(&config);
    for queue in ["retrying", "dying"] {
        let tasks: Vec<NewTask> = (0..TASKS)
            .map(|i| {
                let data = if i % 10 == 0 {
                    r#"{"outcome":"panic"}"#
                } else {
                    "{}"
                };
                NewTask::new("test", data)
                    .unwrap()
                    .id(format!("{queue}-{i}"))
            })
            .collect();
        assert!(
            client
                .push_batch(queue, tasks)
                .unwrap()
                .iter()
                .all(|p| p.is_accepted())
        );
    }
    for queue in ["retrying", "dying"] {
        let s = eventually(Duration::from_secs(60), "the queue to drain", || {
            let s = stats(&config, queue);
            (
                s.ready + s.processing + s.delayed == 0 && s.done + s.dead == TASKS as u64,
                s,
            )
        });
        assert_eq!((s.done, s.dead), (900, 100), "{queue}: {s:?}");
        let dead = dead_records(&redis, queue);
        assert_eq!(dead.len(), 100, "{queue}");
        for record in &dead {
            let id = record["id"].as_str().unwrap();
            let n: usize = id.rsplit('-').next().unwrap().parse().unwrap();
            assert_eq!(
                n % 10,
                0,
                "{queue}: only the panicking tasks are dead, not {id}"
            );
            let reason = record["reason"].as_str().unwrap();
            assert!(
                reason.starts_with(&format!("panic: testkit: asked to panic (task {id})")),
                "{queue}: {reason}"
            );
        }
    }
    let records = dir.records();
    for i in 0..TASKS {
        let runs = if i % 10 == 0 { (3, 1) } else { (1, 1) };
        assert_eq!(
            (
                records.runs_of(&format!("retrying-{i}")),
                records.runs_of(&format!("dying-{i}"))
            ),
            runs,
            "task {i}: a panicking task runs retry_times + 1 times on a retrying queue, once on a dying one"
        );
    }
    // The daemon kept running through 400 panics: it still takes new work, and stops cleanly.
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "{}",
        daemon.log_text()
    );
    push(&config, "dying", "test", "after", "{}");
    eventually(
        Duration::from_secs(10),
        "a task pushed after the panics to be done",
        || {
            let s = stats(&config, "dying");
            (s.done == 901, s)
        },
    );
    daemon.signal(15);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        daemon.log_text()
    );
    let log = daemon.log_text();
    assert_eq!(
        log.matches("panic: testkit: asked to panic").count(),
        400,
        "every panic is in the log, once, in its task's event"
    );
    assert_eq!(
        log.matches(" panicked at ").count(),
        0,
        "the SDK's panic hook prints nothing for a panic in handle (the task's event has it)"
    );
}

/// The exec plugin's test handler: what it does depends on the task's data, read from standard input.
const SHELL_HANDLER: &str = r#"#!/bin/sh
data=$(cat)
case "$data" in
    '"done"') exit 0 ;;
    '"retry"') echo "try again later" >&2; exit 75 ;;
    '"fail"') echo "reading customer $KMQ_TASK_ID" >&2; echo "no such customer" >&2; exit 3 ;;
    '"hang"')
        sleep 600 &
        echo $! > "$1/$KMQ_TASK_ID-$KMQ_ATTEMPT.background"
        echo $$ > "$1/$KMQ_TASK_ID-$KMQ_ATTEMPT.command"
        wait ;;
    *) echo "unexpected data: $data" >&2; exit 64 ;;
esac
"#;

/// The process ids a "hang" run of the shell handler wrote: (command, background).
fn hung_pids(dir: &TestDir, id: &str, attempt: u32) -> (u32, u32) {
    let read = |suffix: &str| -> u32 {
        let path = dir.path(&format!("{id}-{attempt}.{suffix}"));
        let text = eventually(Duration::from_secs(10), "the handler's pid file", || {
            let text = fs::read_to_string(&path).unwrap_or_default();
            (text.ends_with('\n'), text)
        });
        text.trim().parse().unwrap()
    };
    (read("command"), read("background"))
}

#[test]
fn the_exec_plugin_runs_a_shell_script_end_to_end() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let exec = built_plugin("kmq-exec");
    // One file, two sections: two instances, each with its own init, config and types.
    dir.install_plugin(&exec, "libkmq_exec.so");
    let handler = dir.path("handler.sh");
    fs::write(&handler, SHELL_HANDLER).unwrap();
    fs::set_permissions(&handler, fs::Permissions::from_mode(0o755)).unwrap();
    let plugin = |name: &str, file: &str, timeout: &str, kind: &str| {
        format!(
            "[plugins.{name}]\nfile = \"{file}\"\nconfig = {{ command = \"{}\", args = [\"{}\"], timeout = \"{timeout}\", types = [\"{kind}\"] }}\n",
            handler.display(),
            dir.path("").display()
        )
    };
    let config = dir.config(
        &redis,
        &format!(
            "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 4\nretry_times = 1\nbackoff = \"10ms\"\n\n\
             [[queues]]\nname = \"slow\"\nmode = \"safe\"\nexecution_timeout = \"2s\"\nretry_times = 0\n\n{}{}",
            // Time enough for a loaded machine to start the shell and let it write its pid files before it is
            // killed (at 500 ms it once was not: the files never came).
            plugin("shell", "libkmq_exec.so", "2s", "shell"),
            plugin("slow", "libkmq_exec.so", "1h", "shell.slow"),
        ),
    );
    let daemon = TestDaemon::start(&config);
    for i in 0..3 {
        push(&config, "jobs", "shell", &format!("ok-{i}"), "\"done\"");
    }
    push(&config, "jobs", "shell", "flaky", "\"retry\"");
    push(&config, "jobs", "shell", "broken", "\"fail\"");
    push(&config, "jobs", "shell", "stuck", "\"hang\"");
    push(&config, "slow", "shell.slow", "cancelled", "\"hang\"");

    let s = all_ended(&config, 6, Duration::from_secs(30));
    assert_eq!((s.done, s.dead), (3, 3), "{s:?}");
    let dead = dead_records(&redis, "jobs");
    assert_eq!(
        reason_of(&dead, "flaky"),
        "exit status 75 (retry): try again later; no retries left after 2 runs"
    );
    assert_eq!(
        reason_of(&dead, "broken"),
        "exit status 3: reading customer broken\nno such customer"
    );
    assert_eq!(
        reason_of(&dead, "stuck"),
        "exec: timed out after 2s; killed; no retries left after 2 runs"
    );
    for attempt in 0..2 {
        let (command, background) = hung_pids(&dir, "stuck", attempt);
        // SIGKILL takes effect a moment after it is sent.
        eventually(
            Duration::from_secs(10),
            "the timed-out command and its child to be dead",
            || {
                (
                    !process_is_alive(command) && !process_is_alive(background),
                    (attempt, command, background),
                )
            },
        );
    }

    // The daemon cancels the run at the queue's execution_timeout, long before the plugin's own timeout; the
    // plugin kills the command and everything it started.
    let dead = eventually(
        Duration::from_secs(10),
        "the cancelled task's dead letter",
        || {
            let dead = dead_records(&redis, "slow");
            (dead.len() == 1, dead)
        },
    );
    assert!(
        reason_of(&dead, "cancelled").starts_with("execution timeout: still running after 2s"),
        "{dead:?}"
    );
    let (command, background) = hung_pids(&dir, "cancelled", 0);
    eventually(
        Duration::from_secs(10),
        "the cancelled command and its child to be killed",
        || {
            (
                !process_is_alive(command) && !process_is_alive(background),
                (command, background),
            )
        },
    );
    daemon.stop();
}

/// A per-task command gets SIGKILL when its daemon is killed with SIGKILL (the parent-death signal, as persistent
/// handler processes do), so it does not run on beside the re-run that another daemon recovers (review L4: it
/// ran on, outside systemd for as long as it liked).
#[test]
fn a_daemon_killed_with_sigkill_leaves_no_per_task_command_behind() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    dir.install_plugin(&built_plugin("kmq-exec"), "libkmq_exec.so");
    let handler = dir.path("handler.sh");
    fs::write(&handler, SHELL_HANDLER).unwrap();
    fs::set_permissions(&handler, fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.config(
        &redis,
        &format!(
            "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\n\n\
             [plugins.shell]\nfile = \"libkmq_exec.so\"\nconfig = {{ command = \"{}\", args = [\"{}\"], \
             timeout = \"1h\", types = [\"shell\"] }}\n",
            handler.display(),
            dir.path("").display()
        ),
    );
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    push(&config, "jobs", "shell", "hung", "\"hang\"");
    let (command, background) = hung_pids(&dir, "hung", 0);
    daemon.kill9();
    eventually(
        Duration::from_secs(10),
        "the command of the killed daemon to be dead (parent-death signal)",
        || (!process_is_alive(command), command),
    );
    // What the command started in the background is beyond the signal (it is not inherited): under systemd the
    // unit's cgroup ends it; here the test does (kill(1): the tests have no unsafe code).
    let _ = std::process::Command::new("kill")
        .args(["-9", &background.to_string()])
        .status();
}

/// The contents of every fenced block of `markdown` whose info string is `language`, unindented by the fence's
/// own indentation (blocks inside list items are indented).
fn fenced_blocks(markdown: &str, language: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &mut current {
            None if trimmed.starts_with("```")
                && trimmed.trim_start_matches('`').trim() == language =>
            {
                current = Some((indent, String::new()));
            }
            Some((_, block)) if trimmed.starts_with("```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            Some((indent, block)) => {
                block.push_str(line.get(*indent..).unwrap_or(trimmed));
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

fn guide() -> String {
    fs::read_to_string(workspace_dir().join("docs/PLUGINS.md")).unwrap()
}

#[test]
fn the_c_plugin_of_the_guide_runs_tasks_through_the_daemon() {
    let blocks = fenced_blocks(&guide(), "c");
    assert_eq!(blocks.len(), 1, "docs/PLUGINS.md has one C plugin");
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let source = dir.path("greet.c");
    fs::write(&source, &blocks[0]).unwrap();
    compile_c_plugin(&source, &[], &dir.plugins_dir().join("libgreet.so"));
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nretry_times = 1\nbackoff = \"10ms\"\n\n\
         [plugins.greet]\nfile = \"libgreet.so\"\n",
    );
    let daemon = TestDaemon::start(&config);
    push(&config, "jobs", "greet", "ada", "\"Ada\"");
    push(&config, "jobs", "greet", "nobody", "null");
    push(&config, "jobs", "greet", "later", "\"later\"");
    let s = all_ended(&config, 3, Duration::from_secs(20));
    assert_eq!((s.done, s.dead, s.retried), (1, 2, 1), "{s:?}");
    let dead = dead_records(&redis, "jobs");
    assert_eq!(reason_of(&dead, "nobody"), "nobody to greet");
    assert_eq!(
        reason_of(&dead, "later"),
        "not now; no retries left after 2 runs"
    );
    daemon.stop();
}

#[test]
fn the_rust_plugin_of_the_guide_runs_tasks_as_the_guide_deploys_it() {
    // plugins/guide-example is the guide's Rust block, compiled; the config is the guide's deploy section.
    let deploy = fenced_blocks(&guide(), "toml")
        .into_iter()
        .find(|block| block.contains("[plugins.images]"))
        .expect("docs/PLUGINS.md shows how to deploy the images plugin");
    let redis = RedisServer::start();
    let dir = TestDir::new();
    dir.install_plugin(&built_plugin("kmq-guide-example"), "libkmq_images.so");
    let config = dir.config(&redis, &format!("{QUEUE}\n{deploy}"));
    let daemon = TestDaemon::start(&config);
    push(
        &config,
        "jobs",
        "image.resize",
        "small",
        r#"{"path": "a.png", "width": 640}"#,
    );
    push(
        &config,
        "jobs",
        "image.resize",
        "large",
        r#"{"path": "b.png", "width": 4000}"#,
    );
    let s = all_ended(&config, 2, Duration::from_secs(20));
    assert_eq!((s.done, s.dead), (1, 1), "{s:?}");
    assert_eq!(
        reason_of(&dead_records(&redis, "jobs"), "large"),
        "b.png: width 4000 is over max_width 1920"
    );
    daemon.stop();
}

#[test]
fn every_plugin_section_of_the_guide_is_a_valid_config() {
    let sections: Vec<String> = fenced_blocks(&guide(), "toml")
        .into_iter()
        .filter(|block| block.contains("[plugins."))
        .collect();
    assert!(
        sections.len() >= 2,
        "the exec and the deploy sections: {sections:?}"
    );
    let dir = TestDir::new();
    for section in sections {
        let path = offline_config(&dir, &section);
        let config = kmqd::Config::load(&path).unwrap_or_else(|error| panic!("{error}\n{section}"));
        assert_eq!(
            config.plugins.len(),
            section.matches("[plugins.").count(),
            "{section}"
        );
    }
}

#[test]
fn one_file_serves_several_sections_and_a_reload_keeps_each_instance_by_file_and_section() {
    let dir = TestDir::new();
    dir.install_plugin(&built_plugin("kmq-exec"), "libkmq_exec.so");
    let handler = dir.path("handler.sh");
    fs::write(&handler, "#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&handler, fs::Permissions::from_mode(0o755)).unwrap();
    let section = |name: &str, timeout: &str| {
        format!(
            "[plugins.{name}]\nfile = \"libkmq_exec.so\"\nconfig = {{ command = \"{}\", timeout = \"{timeout}\", types = [\"{name}.run\"] }}\n",
            handler.display()
        )
    };
    let config = |sections: &[String]| {
        kmqd::Config::load(&offline_config(&dir, &sections.concat())).unwrap()
    };
    // The plugins dir's drop-ins (testkit, echo) come after the sections.
    let first = Registry::load(&config(&[section("a", "1s"), section("b", "1s")])).unwrap();
    let [a, b, ..] = first.plugins() else {
        panic!("two instances: {:?}", first.plugins().len());
    };
    assert_eq!(
        (a.section.as_str(), &a.types[..]),
        ("a", &["a.run".to_string()][..])
    );
    assert_eq!(
        (b.section.as_str(), &b.types[..]),
        ("b", &["b.run".to_string()][..])
    );
    assert!(
        Arc::ptr_eq(&a.library, &b.library),
        "the file is loaded once"
    );

    // b's config changes, c is added: a and b keep their instances (b's config needs a restart), c is one more
    // init on the library already loaded.
    let (second, changes) = Registry::reload(
        &config(&[section("a", "1s"), section("b", "2s"), section("c", "1s")]),
        &first,
    )
    .unwrap();
    let [a2, b2, c, ..] = second.plugins() else {
        panic!("three instances: {:?}", second.plugins().len());
    };
    assert!(
        Arc::ptr_eq(a, a2) && Arc::ptr_eq(b, b2),
        "reused by file and section"
    );
    assert_eq!(c.types, ["c.run"]);
    assert!(Arc::ptr_eq(&c.library, &a.library));
    assert_eq!(changes.needs_restart, ["plugins.b.config"]);
    assert_eq!(changes.loaded.len(), 1, "{:?}", changes.loaded);
    assert_eq!(
        second.for_type("b.run").map(|p| p.section.as_str()),
        Some("b")
    );
}

//! Redis's time a grouped claim takes, this build's claim.lua against another's (docs/PERFORMANCE.md, "The
//! grouped claim's checks before its writes"): a measurement, not a check, so ignored by default. Run with
//!
//! ```text
//! printf '#!lua\n' > FILE
//! for f in checks rate turns types groups claim; do git show REV:src/broker/scripts/$f.lua >> FILE; done
//! KMQD_CLAIM_BEFORE=FILE cargo test --test it claim_cost -- --ignored --nocapture
//! ```
//!
//! for a REV whose claim.lua takes the same keys and arguments as this build's.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kmqd::broker::{self, sources};
use kmqd::{Config, NewTask};

use crate::support::proxy::FaultProxy;
use crate::support::*;

/// One claim.lua call as the proxy saw it (EVALSHA, its SHA, the key count, keys, arguments), replayed with the
/// script `sha` and claim number `number` (ARGV[7], and the claim's lists and scopes keys, which name it).
fn replay(call: &[Vec<u8>], sha: &str, number: u64) -> redis::Cmd {
    let keys: usize = String::from_utf8_lossy(&call[2]).parse().unwrap();
    let claim_at = 3 + keys + 6;
    let claim = format!(":{}", String::from_utf8_lossy(&call[claim_at]));
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(&call[2]);
    for (at, arg) in call.iter().enumerate().skip(3) {
        let text = String::from_utf8_lossy(arg);
        if at == claim_at {
            cmd.arg(number);
        } else if at < 3 + keys
            && (text.ends_with(&claim) || text.ends_with(&format!("{claim}:scopes")))
        {
            cmd.arg(text.replacen(&claim, &format!(":{number}"), 1));
        } else {
            cmd.arg(arg.as_slice());
        }
    }
    cmd
}

/// 40,000 tasks over 1,000 groups (`[queues.groups]` without limits), claims of 16 tasks: two warm-up rounds (the
/// claims' intake moves the ready list into the groups' flows), then ten rounds of 100 claims of each script,
/// alternated; prints `usec_per_call` of each round (`INFO commandstats`, reset before it).
#[test]
#[ignore = "a measurement: KMQD_CLAIM_BEFORE names the other claim.lua"]
fn claim_cost() {
    let before =
        std::fs::read(std::env::var("KMQD_CLAIM_BEFORE").expect("KMQD_CLAIM_BEFORE")).unwrap();
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues = "[[queues]]\nname = \"grouped\"\nmode = \"safe\"\nworkers = 4\n[queues.groups]\n";
    let path = dir.config_for_url(&proxy.url(), "", queues);
    let config = Config::load(&path).unwrap();
    let queue = kmqd::queue::QueueContext::new(&config, &config.queues[0], "test:0");
    for chunk in 0..40 {
        let tasks = (0..1000).map(|i| {
            NewTask::new("test", "7")
                .unwrap()
                .id(format!("t{chunk}-{i}"))
                .group(format!("g{i}"))
        });
        client(&path).push_batch("grouped", tasks).unwrap();
    }
    let after_sha = redis::Script::new(sources::CLAIM).get_hash().to_string();
    let captured: Arc<Mutex<Option<Vec<Vec<u8>>>>> = Arc::default();
    {
        let (captured, sha) = (Arc::clone(&captured), after_sha.clone());
        proxy.observe(move |args| {
            if args.len() > 2 && String::from_utf8_lossy(&args[1]).eq_ignore_ascii_case(&sha) {
                captured
                    .lock()
                    .unwrap()
                    .get_or_insert_with(|| args.to_vec());
            }
        });
    }
    let mut through: broker::Conn = redis::Client::open(proxy.url())
        .unwrap()
        .get_connection()
        .unwrap()
        .into();
    let lease = Duration::from_secs(3600);
    let batch = crate::safe_mode::dead_daemon_claims(&mut through, &queue, "cost.1", 0, 16, lease);
    assert_eq!(batch.tasks.len(), 16);
    let call = captured.lock().unwrap().clone().expect("the claim's call");
    let mut direct = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let before_sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(before)
        .query(&mut direct)
        .unwrap();
    let mut number = 1000;
    for round in 0..12 {
        for (name, sha) in [("before", &before_sha), ("this build", &after_sha)] {
            let _: () = redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query(&mut direct)
                .unwrap();
            for _ in 0..if round < 2 { 40 } else { 100 } {
                number += 1;
                let _: redis::Value = replay(&call, sha, number).query(&mut direct).unwrap();
            }
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query(&mut direct)
                .unwrap();
            let line = info
                .lines()
                .find(|line| line.starts_with("cmdstat_evalsha"))
                .unwrap();
            eprintln!("round {round}, {name}: {line}");
        }
    }
}

//! kmqd's own connection to a Redis node (src/broker/node.rs, its reply reader src/broker/resp.rs) against
//! redis-rs's `Connection` on the same server: the same values and errors for the replies kmqd reads, a refused
//! login reported as redis-rs reports it, and a connection that failed mid-reply closed rather than reused.

use std::time::Duration;

use kmqd::broker::{BrokerError, Conn, Connector};
use kmqd::config::Config;
use redis::{ConnectionLike, IntoConnectionInfo, RedisResult, Value};

use crate::support::proxy::{Fault, FaultProxy};
use crate::support::{RedisServer, TestDir, eventually, safe_queue};

/// A connector for `redis` (a `[redis]` section's lines), through kmqd's config.
fn connector(dir: &TestDir, redis: &str) -> Connector {
    let path = dir.config_raw(redis, "", &safe_queue(""));
    Connector::new(&Config::load(&path).unwrap().redis).unwrap()
}

/// Runs `command` on both connections; returns both results.
fn both(
    ours: &mut Conn,
    theirs: &mut Conn,
    command: &redis::Cmd,
) -> (RedisResult<Value>, RedisResult<Value>) {
    (command.query(ours), command.query(theirs))
}

fn assert_same(what: &str, ours: RedisResult<Value>, theirs: RedisResult<Value>) {
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "{what}"),
        (Err(a), Err(b)) => {
            assert_eq!(a.kind(), b.kind(), "{what}: {a} / {b}");
            assert_eq!(a.code(), b.code(), "{what}: {a} / {b}");
        }
        _ => panic!("{what}: kmqd's {ours:?}, redis-rs's {theirs:?}"),
    }
}

#[test]
fn kmqds_own_connection_reads_every_reply_as_redis_rs_does() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let mut ours = connector(&dir, &format!("url = \"{}\"", redis.url()))
        .connect()
        .unwrap();
    assert!(ours.reads_replies_itself());
    let mut theirs = redis.connection();
    assert!(!theirs.reads_replies_itself());

    // A payload larger than the reader's buffer, with CRLFs and every byte value in it.
    let large: Vec<u8> = (0..300_000u32).map(|i| (i % 256) as u8).collect();
    redis::cmd("RPUSH")
        .arg("l")
        .arg(&large[..])
        .arg("")
        .arg("é\r\n")
        .query::<i64>(&mut ours)
        .unwrap();
    let script = r#"return {1, -2, "three", false, {"nested", {redis.call('LLEN', KEYS[1])}}, redis.status_reply('PONG')}"#;
    let calls: Vec<(&str, redis::Cmd)> = vec![
        (
            "LRANGE",
            redis::cmd("LRANGE").arg("l").arg(0).arg(-1).clone(),
        ),
        ("a missing key", redis::cmd("GET").arg("nothing").clone()),
        (
            "nested tables",
            redis::cmd("EVAL").arg(script).arg(1).arg("l").clone(),
        ),
        ("an error reply", redis::cmd("LPUSH").arg("l").clone()),
        (
            "a script's own error",
            redis::cmd("EVAL")
                .arg("return redis.error_reply('LEASELOST owner x has no live lease')")
                .arg(0)
                .clone(),
        ),
        ("a type error", redis::cmd("GET").arg("l").clone()),
        ("a status", redis::cmd("PING").clone()),
    ];
    for (what, command) in &calls {
        let (a, b) = both(&mut ours, &mut theirs, command);
        assert_same(what, a, b);
    }

    // A transaction whose script ran and failed: the error is a value among EXEC's replies.
    let mut transaction = redis::pipe();
    transaction
        .atomic()
        .ignore_errors()
        .cmd("EVALSHA")
        .arg("0123456789012345678901234567890123456789")
        .arg(0)
        .cmd("LRANGE")
        .arg("l")
        .arg(1)
        .arg(-1);
    let a = transaction.query::<Vec<Value>>(&mut ours);
    let b = transaction.query::<Vec<Value>>(&mut theirs);
    assert_same(
        "a transaction's NOSCRIPT",
        a.map(Value::Array),
        b.map(Value::Array),
    );

    // A transaction Redis discarded because it refused a command when it was queued.
    let mut refused = redis::pipe();
    refused
        .atomic()
        .cmd("LRANGE")
        .arg("l")
        .arg(0)
        .arg(-1)
        .cmd("NOSUCHCOMMAND");
    let a = refused.query::<Vec<Value>>(&mut ours);
    let b = refused.query::<Vec<Value>>(&mut theirs);
    let error = a.as_ref().expect_err("discarded");
    assert!(error.to_string().contains("NOSUCHCOMMAND"), "{error}");
    assert_same(
        "a discarded transaction",
        a.map(Value::Array),
        b.map(Value::Array),
    );

    // Both still in step after every error.
    let (a, b) = both(&mut ours, &mut theirs, redis::cmd("LLEN").arg("l"));
    assert_same("after the errors", a, b);
    assert!(ours.is_open());
}

#[test]
fn a_refused_password_is_the_error_redis_rs_reports_and_a_config_error() {
    let redis = RedisServer::start();
    redis.cmd::<()>(&["CONFIG", "SET", "requirepass", "right"]);
    let dir = TestDir::new();
    let url = redis.url();
    let with_password = |password: &str| {
        let file = dir.path(&format!("{password}.password"));
        std::fs::write(&file, password).unwrap();
        connector(
            &dir,
            &format!("url = \"{url}\"\npassword_file = \"{}\"", file.display()),
        )
    };
    let wrong = with_password("wrong").connect().err().expect("refused");
    let info = url.as_str().into_connection_info().unwrap();
    let settings = info.redis_settings().clone().set_password("wrong");
    let direct = redis::Client::open(info.set_redis_settings(settings))
        .and_then(|client| client.get_connection())
        .err()
        .expect("refused");
    let BrokerError::Redis(error) = &wrong else {
        panic!("{wrong:?}");
    };
    assert_eq!(error.kind(), direct.kind(), "{error} / {direct}");
    assert_eq!(error.code(), direct.code(), "{error} / {direct}");
    assert!(wrong.is_config_error(), "{wrong}");

    let mut right = with_password("right").connect().unwrap();
    assert!(right.reads_replies_itself());
    assert_eq!(
        redis::cmd("PING").query::<String>(&mut right).unwrap(),
        "PONG"
    );
}

#[test]
fn a_connection_whose_reply_timed_out_is_closed_and_never_reads_the_late_reply() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let connector = connector(
        &dir,
        &format!("url = \"{}\"\nio_timeout = \"300ms\"", proxy.url()),
    );
    let mut connection = connector.connect().unwrap();
    assert!(connection.reads_replies_itself());
    redis::cmd("SET")
        .arg("k")
        .arg("before")
        .query::<()>(&mut connection)
        .unwrap();
    let stall = proxy.add(Fault::Stall {
        duration: Duration::from_millis(1000),
    });
    let error = redis::cmd("GET")
        .arg("k")
        .query::<String>(&mut connection)
        .expect_err("the stall outlasts the read timeout");
    assert!(error.is_timeout(), "{error}");
    assert_eq!(stall.fired(), 1);
    assert!(!connection.is_open());
    // The late reply (`before`) arrives once the stall ends; the closed connection never hands it to a later
    // command as its reply.
    redis.cmd::<()>(&["SET", "k", "after"]);
    eventually(Duration::from_secs(5), "the stall to end", || {
        let value = connector
            .connect()
            .ok()
            .map(|mut fresh| redis::cmd("GET").arg("k").query::<String>(&mut fresh));
        (matches!(value.as_ref(), Some(Ok(v)) if v == "after"), value)
    });
    let late = redis::cmd("GET").arg("k").query::<String>(&mut connection);
    let error = late.expect_err("closed");
    assert!(error.is_connection_dropped(), "{error}");
}

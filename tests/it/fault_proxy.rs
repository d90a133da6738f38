//! The fault-injecting proxy (`support::proxy`) and the redis-server controls the fault tests rely on. Each test
//! asserts the fault's effect from both sides: what the client saw through the proxy, and what Redis holds, read
//! on a direct connection.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use redis::RedisResult;

use crate::support::proxy::{
    AfterDrop, Command, Fault, FaultProxy, Matcher, parse_command, parse_reply,
};
use crate::support::{Fsync, RedisOptions, RedisServer, Signal, eventually};

/// The read timeout of clients through the proxy: what a Hang costs a test.
const READ_TIMEOUT: Duration = Duration::from_millis(300);

/// A client through the proxy, with a short read timeout so that a hung connection fails fast.
fn through(proxy: &FaultProxy) -> redis::Connection {
    through_with_timeout(proxy, READ_TIMEOUT)
}

fn through_with_timeout(proxy: &FaultProxy, timeout: Duration) -> redis::Connection {
    let connection = redis::Client::open(proxy.url())
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect through the proxy");
    connection.set_read_timeout(Some(timeout)).unwrap();
    connection
}

fn incr(connection: &mut dyn redis::ConnectionLike, key: &str) -> RedisResult<i64> {
    redis::cmd("INCR").arg(key).query(connection)
}

/// A counter read on a direct connection (0 when absent).
fn counter(redis: &RedisServer, key: &str) -> i64 {
    let value: Option<i64> = redis.cmd(&["GET", key]);
    value.unwrap_or(0)
}

/// How many clients Redis has (the lines of CLIENT LIST, the asking connection included).
fn redis_clients(redis: &RedisServer) -> usize {
    let list: String = redis.cmd(&["CLIENT", "LIST"]);
    list.lines().count()
}

/// Reads replies from a raw socket until EOF (or `timeout` of silence); returns them one by one, split by the
/// proxy's own parser, and whether the connection ended with EOF.
fn read_replies(stream: &mut TcpStream, timeout: Duration) -> (Vec<Vec<u8>>, bool) {
    stream.set_read_timeout(Some(timeout)).unwrap();
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 65536];
    let eof = loop {
        match stream.read(&mut chunk) {
            Ok(0) => break true,
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    (split_replies(&bytes), eof)
}

fn split_replies(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut replies = Vec::new();
    while let Some(frame) = parse_reply(bytes).expect("valid RESP") {
        replies.push(bytes[..frame.len].to_vec());
        bytes = &bytes[frame.len..];
    }
    assert!(bytes.is_empty(), "a partial reply was left: {bytes:?}");
    replies
}

/// Reads exactly `count` replies from a raw socket.
fn read_n_replies(stream: &mut TcpStream, count: usize) -> Vec<Vec<u8>> {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 65536];
    loop {
        let mut rest = &bytes[..];
        let mut replies = Vec::new();
        while let Some(frame) = parse_reply(rest).expect("valid RESP") {
            replies.push(rest[..frame.len].to_vec());
            rest = &rest[frame.len..];
        }
        if replies.len() >= count {
            assert_eq!(replies.len(), count, "more replies than commands");
            return replies;
        }
        let n = stream.read(&mut chunk).expect("a reply within 5 s");
        assert!(n > 0, "EOF after {} of {count} replies", replies.len());
        bytes.extend_from_slice(&chunk[..n]);
    }
}

fn resp_command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// A test that fails unwinds through its servers, and each reports the tail of its log, so the failure shows
/// Redis's side beside the panic message (the architecture review's A0.4: only a failed start carried the log).
#[test]
fn a_redis_server_dropped_by_a_failing_test_reports_its_log() {
    let redis = RedisServer::start();
    assert_eq!(
        redis.panic_report(),
        None,
        "nothing to report while no test fails"
    );
    /// Reads the report as the server's own drop does: while the failing closure unwinds.
    struct Probe<'a>(&'a RedisServer, &'a std::sync::Mutex<Option<String>>);
    impl Drop for Probe<'_> {
        fn drop(&mut self) {
            *self.1.lock().unwrap() = self.0.panic_report();
        }
    }
    let report = std::sync::Mutex::new(None);
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _probe = Probe(&redis, &report);
        panic!("a failing assertion (this test's own, expected)");
    }));
    assert!(failed.is_err());
    let report = report
        .into_inner()
        .unwrap()
        .expect("a report while the test unwinds");
    assert!(
        report.contains("dropped by a failing test")
            && report.contains("ready to accept connections"),
        "{report}"
    );
}

#[test]
fn drop_reply_with_close_loses_the_reply_of_an_incr_that_ran() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut client = through(&proxy);
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("incr"),
        nth: 1,
        then: AfterDrop::Close,
    });

    let started = Instant::now();
    let error = incr(&mut client, "counter").expect_err("the reply was dropped");
    assert!(
        error.is_connection_dropped(),
        "the client saw its connection closed, not {error:?}"
    );
    assert!(
        started.elapsed() < READ_TIMEOUT,
        "an EOF, not a timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(counter(&redis, "counter"), 1, "the INCR ran in Redis");
    assert_eq!(rule.fired(), 1);
    assert!(!redis::ConnectionLike::is_open(&client));
    eventually(
        Duration::from_secs(2),
        "the proxied connection to close",
        || (proxy.connections() == 0, proxy.connections()),
    );

    // One-shot: the next INCR, on a new connection, gets its reply.
    let mut again = through(&proxy);
    assert_eq!(incr(&mut again, "counter").unwrap(), 2);
    assert_eq!(rule.fired(), 1);
}

#[test]
fn drop_reply_with_hang_times_the_client_out_after_the_incr_ran() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut client = through(&proxy);
    proxy.add(Fault::DropReply {
        matching: Matcher::command("INCR"),
        nth: 1,
        then: AfterDrop::Hang,
    });

    let started = Instant::now();
    let error = incr(&mut client, "counter").expect_err("the reply was dropped");
    assert!(error.is_timeout(), "a read timeout, not {error:?}");
    assert!(started.elapsed() >= READ_TIMEOUT);
    assert_eq!(counter(&redis, "counter"), 1, "the INCR ran in Redis");

    // The connection stays open, and silent: the next command on it times out too, and never reaches Redis.
    assert_eq!(proxy.connections(), 1);
    let error = incr(&mut client, "counter").expect_err("a hung connection stays hung");
    assert!(error.is_timeout(), "{error:?}");
    assert_eq!(counter(&redis, "counter"), 1);
    assert_eq!(proxy.seen(&Matcher::command("INCR")), 1);
    drop(client);
    eventually(
        Duration::from_secs(2),
        "the hung connection to close",
        || (proxy.connections() == 0, proxy.connections()),
    );
}

#[test]
fn drop_reply_counts_the_nth_command_one_by_one_even_in_a_pipeline() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut client = through(&proxy);
    // Counted from when the fault is added, one command at a time.
    assert_eq!(incr(&mut client, "counter").unwrap(), 1);
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("INCR"),
        nth: 3,
        then: AfterDrop::Close,
    });
    assert_eq!(incr(&mut client, "counter").unwrap(), 2);
    assert_eq!(incr(&mut client, "counter").unwrap(), 3);
    assert_eq!(rule.fired(), 0);
    assert!(incr(&mut client, "counter").is_err(), "the 3rd INCR since");
    assert_eq!(counter(&redis, "counter"), 4);

    // A pipeline of 5 INCRs arrives in one write: the 3rd reply is dropped, the 2 before it are delivered, and
    // the 5 INCRs all ran.
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("INCR"),
        nth: 3,
        then: AfterDrop::Close,
    });
    let mut raw = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    let pipeline: Vec<u8> = (0..5)
        .flat_map(|_| resp_command(&[b"INCR", b"pipelined"]))
        .collect();
    raw.write_all(&pipeline).unwrap();
    let (replies, eof) = read_replies(&mut raw, Duration::from_secs(5));
    assert!(eof, "the connection was closed");
    assert_eq!(replies, vec![b":1\r\n".to_vec(), b":2\r\n".to_vec()]);
    assert_eq!(rule.fired(), 1);
    assert_eq!(counter(&redis, "pipelined"), 5, "every pipelined INCR ran");

    // The redis crate's pipeline fails as a whole.
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("INCR"),
        nth: 3,
        then: AfterDrop::Close,
    });
    let mut client = through(&proxy);
    let mut pipe = redis::pipe();
    for _ in 0..5 {
        pipe.cmd("INCR").arg("crate");
    }
    let result: RedisResult<Vec<i64>> = pipe.query(&mut client);
    assert!(result.is_err(), "{result:?}");
    assert_eq!(rule.fired(), 1);
    assert_eq!(counter(&redis, "crate"), 5);
}

#[test]
fn drop_request_loses_the_command_before_it_reaches_redis() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);

    let mut client = through(&proxy);
    let rule = proxy.add(Fault::DropRequest {
        matching: Matcher::command("INCR"),
        nth: 1,
        then: AfterDrop::Close,
    });
    let started = Instant::now();
    let error = incr(&mut client, "closed").expect_err("the request was dropped");
    assert!(error.is_connection_dropped(), "{error:?}");
    assert!(started.elapsed() < READ_TIMEOUT);
    assert_eq!(rule.fired(), 1);
    assert_eq!(counter(&redis, "closed"), 0, "the INCR never ran");
    assert_eq!(proxy.seen(&Matcher::command("INCR")), 0);

    let mut client = through(&proxy);
    proxy.add(Fault::DropRequest {
        matching: Matcher::command("INCR"),
        nth: 1,
        then: AfterDrop::Hang,
    });
    let error = incr(&mut client, "hung").expect_err("the request was dropped");
    assert!(error.is_timeout(), "{error:?}");
    assert_eq!(counter(&redis, "hung"), 0, "the INCR never ran");

    // In a pipeline: the commands before the dropped one run, the dropped one and those after it do not.
    proxy.add(Fault::DropRequest {
        matching: Matcher::command("INCR"),
        nth: 2,
        then: AfterDrop::Close,
    });
    let mut client = through(&proxy);
    let mut pipe = redis::pipe();
    pipe.cmd("INCR").arg("pipelined");
    pipe.cmd("INCR").arg("pipelined");
    pipe.cmd("SET").arg("after").arg("1");
    let result: RedisResult<Vec<redis::Value>> = pipe.query(&mut client);
    assert!(result.is_err(), "{result:?}");
    // The client is cut at once; the INCR forwarded before the dropped one may still be on its way to Redis.
    eventually(
        Duration::from_secs(10),
        "the INCR before the dropped one ran",
        || {
            (
                counter(&redis, "pipelined") == 1,
                counter(&redis, "pipelined"),
            )
        },
    );
    assert_eq!(counter(&redis, "after"), 0);
    assert_eq!(proxy.seen(&Matcher::command("INCR")), 1);
}

#[test]
fn drop_reply_on_a_script_matches_eval_and_evalsha() {
    const SOURCE: &str = "return redis.call('INCR', KEYS[1])";
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let script = Matcher::script(SOURCE);
    let sha = redis::Script::new(SOURCE).get_hash().to_string();

    // EVAL with the body.
    let rule = proxy.add(Fault::DropReply {
        matching: script.clone(),
        nth: 1,
        then: AfterDrop::Close,
    });
    let mut client = through(&proxy);
    let eval: RedisResult<i64> = redis::cmd("EVAL")
        .arg(SOURCE)
        .arg(1)
        .arg("counter")
        .query(&mut client);
    assert!(eval.is_err(), "{eval:?}");
    assert_eq!(rule.fired(), 1);
    assert_eq!(counter(&redis, "counter"), 1, "the script ran");

    // EVALSHA with its SHA1, in upper case too (EVAL cached the script).
    proxy.add(Fault::DropReply {
        matching: script.clone(),
        nth: 1,
        then: AfterDrop::Close,
    });
    let mut client = through(&proxy);
    let evalsha: RedisResult<i64> = redis::cmd("EVALSHA")
        .arg(sha.to_uppercase())
        .arg(1)
        .arg("counter")
        .query(&mut client);
    assert!(evalsha.is_err(), "{evalsha:?}");
    assert_eq!(counter(&redis, "counter"), 2, "the script ran");

    // Another script does not match.
    let mut client = through(&proxy);
    let other: i64 = redis::cmd("EVAL")
        .arg("return 7")
        .arg(0)
        .query(&mut client)
        .unwrap();
    assert_eq!(other, 7);

    // redis::Script::invoke on a cold script cache: EVALSHA (NOSCRIPT), SCRIPT LOAD, EVALSHA. The NOSCRIPT reply
    // is not counted (the script did not run), so nth 1 is the run that happened.
    let _: () = redis.cmd(&["SCRIPT", "FLUSH"]);
    let rule = proxy.add(Fault::DropReply {
        matching: script.clone(),
        nth: 1,
        then: AfterDrop::Close,
    });
    let seen_before = proxy.seen(&script);
    let invoked: RedisResult<i64> = redis::Script::new(SOURCE)
        .key("counter")
        .invoke(&mut client);
    assert!(invoked.is_err(), "{invoked:?}");
    assert_eq!(rule.fired(), 1);
    assert_eq!(counter(&redis, "counter"), 3, "the script ran once");
    assert_eq!(proxy.seen(&script) - seen_before, 2, "EVALSHA twice");
    assert_eq!(
        proxy.seen(&Matcher::new(|args| args.len() >= 2
            && args[0].eq_ignore_ascii_case(b"SCRIPT")
            && args[1].eq_ignore_ascii_case(b"LOAD"))),
        1,
        "redis 1.8 loads the body with SCRIPT LOAD, it does not send EVAL"
    );
}

#[test]
fn drop_reply_of_a_blocking_pop_after_it_took_the_item() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("BLPOP"),
        nth: 1,
        then: AfterDrop::Close,
    });
    let mut client = through_with_timeout(&proxy, Duration::from_secs(5));
    let popper = std::thread::spawn(move || {
        let popped: RedisResult<Option<(String, String)>> =
            redis::cmd("BLPOP").arg("list").arg(5).query(&mut client);
        popped
    });
    redis.wait_blocked_in("blpop");
    let _: i64 = redis.cmd(&["RPUSH", "list", "task"]);
    let popped = popper.join().unwrap();
    assert!(popped.is_err(), "{popped:?}");
    assert_eq!(rule.fired(), 1);
    let left: i64 = redis.cmd(&["LLEN", "list"]);
    assert_eq!(left, 0, "the BLPOP took the item");
}

#[test]
fn after_a_close_redis_still_runs_what_it_was_sent() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("INCR"),
        nth: 1,
        then: AfterDrop::Close,
    });
    // The INCR's reply is dropped while the BLPOP behind it blocks; the SET after the BLPOP runs only once it
    // unblocks. A network cut does not stop Redis from running what it received, so neither does the proxy.
    let mut raw = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    let mut pipeline = resp_command(&[b"INCR", b"counter"]);
    pipeline.extend(resp_command(&[b"BLPOP", b"list", b"5"]));
    pipeline.extend(resp_command(&[b"SET", b"after", b"1"]));
    raw.write_all(&pipeline).unwrap();
    let (replies, eof) = read_replies(&mut raw, Duration::from_secs(5));
    assert!(eof && replies.is_empty(), "{replies:?}");
    assert_eq!(rule.fired(), 1);
    assert_eq!(proxy.connections(), 0, "the client side is closed");
    redis.wait_blocked_in("blpop");
    let _: i64 = redis.cmd(&["RPUSH", "list", "task"]);
    eventually(
        Duration::from_secs(2),
        "the SET after the BLPOP to run",
        || {
            let after = counter(&redis, "after");
            (after == 1, after)
        },
    );
    let left: i64 = redis.cmd(&["LLEN", "list"]);
    assert_eq!(left, 0);
    eventually(Duration::from_secs(2), "the Redis side to close", || {
        let clients = redis_clients(&redis);
        (clients == 1, clients)
    });
}

#[test]
fn stall_holds_both_directions_until_it_ends() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut client = through_with_timeout(&proxy, Duration::from_secs(5));
    let duration = Duration::from_millis(500);

    let before = Instant::now();
    let rule = proxy.add(Fault::Stall { duration });
    let sender = std::thread::spawn(move || {
        let value = incr(&mut client, "counter");
        (value, Instant::now())
    });
    eventually(Duration::from_secs(2), "the proxy to hold the INCR", || {
        (rule.fired() >= 1, rule.fired())
    });
    // Meanwhile Redis itself answers, and has not seen the INCR.
    let mut direct = redis.connection();
    let pong: String = redis::cmd("PING").query(&mut direct).unwrap();
    assert_eq!(pong, "PONG");
    let during = counter(&redis, "counter");
    let checked_during_stall = before.elapsed() < duration;
    let (value, replied_at) = sender.join().unwrap();
    assert_eq!(value.unwrap(), 1);
    assert!(
        replied_at - before >= duration,
        "the reply came {:?} after the stall began",
        replied_at - before
    );
    if checked_during_stall {
        assert_eq!(during, 0, "the INCR was held, not run, during the stall");
    }
    // Over: traffic flows again.
    let mut client = through(&proxy);
    assert_eq!(incr(&mut client, "counter").unwrap(), 2);
}

#[test]
fn latency_delays_every_reply_in_order_until_removed() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut client = through_with_timeout(&proxy, Duration::from_secs(5));
    let delay = Duration::from_millis(150);
    let rule = proxy.add(Fault::Latency { delay });

    let started = Instant::now();
    let pong: String = redis::cmd("PING").query(&mut client).unwrap();
    assert_eq!(pong, "PONG");
    assert!(started.elapsed() >= delay, "{:?}", started.elapsed());

    // A pipeline's replies arrive together: each is delayed from its arrival, not one after the other.
    let started = Instant::now();
    let mut pipe = redis::pipe();
    for _ in 0..3 {
        pipe.cmd("INCR").arg("counter");
    }
    let values: Vec<i64> = pipe.query(&mut client).unwrap();
    let elapsed = started.elapsed();
    assert_eq!(values, vec![1, 2, 3], "in order");
    assert!(elapsed >= delay, "{elapsed:?}");
    assert!(elapsed < delay * 3, "not cumulative: {elapsed:?}");
    assert_eq!(rule.fired(), 4, "PING and 3 INCRs were delayed");

    rule.remove();
    let started = Instant::now();
    let _: String = redis::cmd("PING").query(&mut client).unwrap();
    assert!(
        started.elapsed() < delay,
        "removed: {:?}",
        started.elapsed()
    );
}

#[test]
fn delay_reply_holds_the_nth_reply_and_those_behind_it_after_the_command_ran() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut client = through_with_timeout(&proxy, Duration::from_secs(5));
    let delay = Duration::from_millis(400);
    let rule = proxy.add(Fault::DelayReply {
        matching: Matcher::command("INCR"),
        nth: 2,
        delay,
    });
    // The first INCR is not the nth: its reply comes at once.
    let started = Instant::now();
    assert_eq!(incr(&mut client, "counter").unwrap(), 1);
    assert!(started.elapsed() < delay, "{:?}", started.elapsed());
    assert_eq!(rule.fired(), 0);

    // A pipeline of a PING, the 2nd INCR and a GET, in one write: the PING's reply comes at once, the INCR's is
    // held (the INCR ran in Redis meanwhile), and the GET's waits behind it.
    let mut raw = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    let mut pipeline = resp_command(&[b"PING"]);
    pipeline.extend(resp_command(&[b"INCR", b"counter"]));
    pipeline.extend(resp_command(&[b"GET", b"counter"]));
    let started = Instant::now();
    raw.write_all(&pipeline).unwrap();
    assert_eq!(read_n_replies(&mut raw, 1), vec![b"+PONG\r\n".to_vec()]);
    assert!(started.elapsed() < delay, "{:?}", started.elapsed());
    eventually(Duration::from_secs(2), "the INCR to run in Redis", || {
        let value = counter(&redis, "counter");
        (value == 2, value)
    });
    assert!(
        started.elapsed() < delay,
        "the INCR ran before its reply came: {:?}",
        started.elapsed()
    );
    let rest = read_n_replies(&mut raw, 2);
    let elapsed = started.elapsed();
    assert_eq!(rest, vec![b":2\r\n".to_vec(), b"$1\r\n2\r\n".to_vec()]);
    assert!(elapsed >= delay, "held {delay:?}: {elapsed:?}");
    assert!(elapsed < delay * 3, "held once: {elapsed:?}");
    assert_eq!(rule.fired(), 1);

    // One-shot: the next INCR's reply comes at once.
    let started = Instant::now();
    assert_eq!(incr(&mut client, "counter").unwrap(), 3);
    assert!(started.elapsed() < delay, "{:?}", started.elapsed());
    assert_eq!(rule.fired(), 1);
}

#[test]
fn delay_request_holds_the_nth_command_and_those_behind_it_before_redis_runs_them() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let delay = Duration::from_millis(400);
    let rule = proxy.add(Fault::DelayRequest {
        matching: Matcher::command("INCR"),
        nth: 1,
        delay,
        survive_close: false,
    });
    // A PING, the INCR and a SET in one write: the PING goes at once, the INCR is held, the SET waits behind it.
    let mut raw = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    let mut pipeline = resp_command(&[b"PING"]);
    pipeline.extend(resp_command(&[b"INCR", b"counter"]));
    pipeline.extend(resp_command(&[b"SET", b"after", b"1"]));
    let started = Instant::now();
    raw.write_all(&pipeline).unwrap();
    assert_eq!(read_n_replies(&mut raw, 1), vec![b"+PONG\r\n".to_vec()]);
    let during = (
        counter(&redis, "counter"),
        counter(&redis, "after"),
        proxy.seen(&Matcher::command("INCR")),
    );
    let checked_during_delay = started.elapsed() < delay;
    let rest = read_n_replies(&mut raw, 2);
    assert_eq!(rest, vec![b":1\r\n".to_vec(), b"+OK\r\n".to_vec()]);
    assert!(started.elapsed() >= delay, "{:?}", started.elapsed());
    if checked_during_delay {
        assert_eq!(
            during,
            (0, 0, 0),
            "Redis saw neither the INCR nor the SET behind it"
        );
    }
    assert_eq!(rule.fired(), 1);
    assert_eq!(proxy.seen(&Matcher::command("INCR")), 1);

    // One-shot: the next INCR goes at once.
    let mut client = through(&proxy);
    let started = Instant::now();
    assert_eq!(incr(&mut client, "counter").unwrap(), 2);
    assert!(started.elapsed() < delay, "{:?}", started.elapsed());
}

#[test]
fn a_delayed_request_dies_with_its_connection_unless_it_survives_the_close() {
    for survive_close in [false, true] {
        let redis = RedisServer::start();
        let proxy = FaultProxy::start(&redis);
        let delay = Duration::from_millis(600);
        let rule = proxy.add(Fault::DelayRequest {
            matching: Matcher::command("INCR"),
            nth: 1,
            delay,
            survive_close,
        });
        // The client gives up on its read timeout (shorter than the delay), closes, and sends its call again on a
        // new connection, where it runs.
        let started = Instant::now();
        let mut client = through(&proxy);
        let error = incr(&mut client, "counter").expect_err("no reply within the read timeout");
        assert!(error.is_timeout(), "{survive_close}: {error:?}");
        drop(client);
        let mut again = through(&proxy);
        assert_eq!(
            incr(&mut again, "counter").unwrap(),
            1,
            "the call sent again"
        );
        assert!(started.elapsed() < delay, "{:?}", started.elapsed());
        assert_eq!(rule.fired(), 1);
        if survive_close {
            // The first call reaches Redis late, after the one sent again: a late duplicate.
            eventually(Duration::from_secs(3), "the late INCR to run", || {
                let value = counter(&redis, "counter");
                (value == 2, value)
            });
            assert!(started.elapsed() >= delay, "{:?}", started.elapsed());
        } else {
            std::thread::sleep(delay * 2);
            assert_eq!(counter(&redis, "counter"), 1, "dropped with its connection");
        }
        // Either way the first connection ends, on both sides: this one and `again` are Redis's clients left.
        eventually(
            Duration::from_secs(3),
            "the closed connection's Redis side to close",
            || {
                let clients = redis_clients(&redis);
                (clients == 2, clients)
            },
        );
        assert_eq!(proxy.connections(), 1);
    }
}

#[test]
fn cut_all_closes_every_live_connection_both_sides() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut first = through(&proxy);
    let mut second = through(&proxy);
    assert_eq!(proxy.connections(), 2);
    eventually(
        Duration::from_secs(2),
        "two proxied clients and one direct",
        || {
            let clients = redis_clients(&redis);
            (clients == 3, clients)
        },
    );

    proxy.cut_all();
    assert_eq!(proxy.connections(), 0);
    for client in [&mut first, &mut second] {
        let error = redis::cmd("PING").query::<String>(client).expect_err("cut");
        assert!(
            error.is_connection_dropped() || error.is_io_error(),
            "{error:?}"
        );
    }
    eventually(
        Duration::from_secs(2),
        "Redis to see the cut connections close",
        || {
            let clients = redis_clients(&redis);
            (clients == 1, clients)
        },
    );

    // New connections still work.
    let mut third = through(&proxy);
    assert_eq!(incr(&mut third, "counter").unwrap(), 1);
    assert_eq!(proxy.connections(), 1);
}

#[test]
fn refuse_makes_redis_look_down_until_lifted() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut live = through(&proxy);

    proxy.refuse(true);
    assert!(redis::cmd("PING").query::<String>(&mut live).is_err());
    let refused = redis::Client::open(proxy.url())
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(2));
    assert!(refused.is_err(), "a new connection is closed at once");
    assert_eq!(proxy.connections(), 0);

    proxy.refuse(false);
    let mut client = through(&proxy);
    assert_eq!(incr(&mut client, "counter").unwrap(), 1);
}

#[test]
fn a_subscriber_through_the_proxy_receives_what_is_published_directly() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut subscriber = through_with_timeout(&proxy, Duration::from_secs(2));
    let mut pubsub = subscriber.as_pubsub();
    pubsub.subscribe("news").unwrap();
    pubsub.subscribe("more").unwrap();
    for i in 0..3 {
        let receivers: i64 = redis.cmd(&["PUBLISH", "news", &format!("item {i}")]);
        assert_eq!(receivers, 1);
    }
    for i in 0..3 {
        let message = pubsub.get_message().unwrap();
        assert_eq!(message.get_channel_name(), "news");
        assert_eq!(
            message.get_payload::<String>().unwrap(),
            format!("item {i}")
        );
    }
    drop(pubsub);
    // Leaving pub/sub (UNSUBSCRIBE, PUNSUBSCRIBE: one reply per channel) keeps the connection usable.
    assert_eq!(incr(&mut subscriber, "counter").unwrap(), 1);
}

#[test]
fn resp3_pushes_and_attributes_pass_unpaired_and_every_type_intact() {
    let redis = RedisServer::start_with(RedisOptions {
        debug_command: true,
        ..RedisOptions::default()
    });
    let proxy = FaultProxy::start(&redis);
    let types = [
        "string", "integer", "double", "bignum", "null", "array", "set", "map", "attrib", "push",
        "verbatim", "true", "false",
    ];
    let mut script = resp_command(&[b"HELLO", b"3"]);
    for kind in types {
        script.extend(resp_command(&[b"DEBUG", b"PROTOCOL", kind.as_bytes()]));
    }
    // Redis sends 1 + 13 replies and one push frame (before the reply of DEBUG PROTOCOL push).
    let expected = 1 + types.len() + 1;
    let mut direct = std::os::unix::net::UnixStream::connect(&redis.socket).unwrap();
    direct.write_all(&script).unwrap();
    direct
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut direct_bytes = Vec::new();
    let mut chunk = [0u8; 65536];
    while split_replies_count(&direct_bytes) < expected {
        let n = direct.read(&mut chunk).unwrap();
        assert!(n > 0);
        direct_bytes.extend_from_slice(&chunk[..n]);
    }
    let mut proxied = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    proxied.write_all(&script).unwrap();
    let proxied_replies = read_n_replies(&mut proxied, expected);
    let direct_replies = split_replies(&direct_bytes);
    assert!(proxied_replies[0].starts_with(b"%7\r\n"), "HELLO 3's map");
    // The HELLO replies differ only in the client id.
    assert_eq!(
        proxied_replies[1..],
        direct_replies[1..],
        "byte for byte the same"
    );

    // Pairing skips the push: with the reply of PING dropped, everything before it arrives, then EOF.
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("PING"),
        nth: 1,
        then: AfterDrop::Close,
    });
    let mut script = Vec::new();
    for args in [
        &[&b"DEBUG"[..], b"PROTOCOL", b"push"][..],
        &[b"DEBUG", b"PROTOCOL", b"attrib"],
        &[b"GET", b"missing"],
        &[b"PING"],
    ] {
        script.extend(resp_command(args));
    }
    proxied.write_all(&script).unwrap();
    let (replies, eof) = read_replies(&mut proxied, Duration::from_secs(5));
    assert!(eof);
    assert_eq!(rule.fired(), 1);
    assert_eq!(replies.len(), 4, "{replies:?}");
    assert!(replies[0].starts_with(b">2\r\n"), "the push");
    assert!(replies[1].starts_with(b"$40\r\nSome real reply following the push"));
    assert!(
        replies[2].starts_with(b"|1\r\n"),
        "the attribute and its reply"
    );
    assert_eq!(replies[3], b"_\r\n", "GET's RESP3 null");
}

fn split_replies_count(mut bytes: &[u8]) -> usize {
    let mut count = 0;
    while let Ok(Some(frame)) = parse_reply(bytes) {
        count += 1;
        bytes = &bytes[frame.len..];
    }
    count
}

#[test]
fn big_replies_and_big_pipelines_pass_intact() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let mut client = through_with_timeout(&proxy, Duration::from_secs(10));

    // 3 MiB, with CRLFs and RESP type bytes inside, both ways.
    let big: Vec<u8> = (0..3 * 1024 * 1024u32)
        .map(|i| b"*$\r\n+-:0123456789abcdef"[(i % 23) as usize])
        .collect();
    let _: () = redis::cmd("SET")
        .arg("big")
        .arg(&big)
        .query(&mut client)
        .unwrap();
    let back: Vec<u8> = redis::cmd("GET").arg("big").query(&mut client).unwrap();
    assert!(back == big, "the big value came back intact");

    // 10,000 commands in one pipeline, and a 10,000-element reply.
    let mut pipe = redis::pipe();
    for i in 0..10_000 {
        pipe.cmd("RPUSH").arg("list").arg(format!("item-{i}"));
    }
    let lengths: Vec<i64> = pipe.query(&mut client).unwrap();
    assert_eq!(lengths, (1..=10_000).collect::<Vec<i64>>());
    let items: Vec<String> = redis::cmd("LRANGE")
        .arg("list")
        .arg(0)
        .arg(-1)
        .query(&mut client)
        .unwrap();
    assert_eq!(items.len(), 10_000);
    assert!(
        items
            .iter()
            .enumerate()
            .all(|(i, s)| *s == format!("item-{i}"))
    );
    assert_eq!(proxy.seen(&Matcher::command("RPUSH")), 10_000);

    // A dropped reply in the middle of a 10,000-command pipeline: every INCR the proxy forwarded ran.
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::command("INCR"),
        nth: 5_000,
        then: AfterDrop::Close,
    });
    let mut pipe = redis::pipe();
    for _ in 0..10_000 {
        pipe.cmd("INCR").arg("counter");
    }
    let result: RedisResult<Vec<i64>> = pipe.query(&mut client);
    assert!(result.is_err());
    assert_eq!(rule.fired(), 1);
    let forwarded = proxy.seen(&Matcher::command("INCR")) as i64;
    assert!(forwarded >= 5_000, "{forwarded}");
    eventually(
        Duration::from_secs(5),
        "every forwarded INCR to run",
        || {
            let ran = counter(&redis, "counter");
            (ran == forwarded, (ran, forwarded))
        },
    );
}

#[test]
fn seen_counts_every_forwarded_command_inline_ones_too() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let _client = through(&proxy);
    // The redis crate's own connection setup: CLIENT SETINFO LIB-NAME and LIB-VER.
    assert_eq!(proxy.seen(&Matcher::command("CLIENT")), 2);
    assert_eq!(proxy.seen(&Matcher::any()), 2);

    let mut raw = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    raw.write_all(
        b"PING\r\nset greeting \"hello world\"\r\n\r\n  get   greeting\nSET q 'it''s'\r\n",
    )
    .unwrap();
    let replies = read_n_replies(&mut raw, 4);
    assert_eq!(
        replies,
        vec![
            b"+PONG\r\n".to_vec(),
            b"+OK\r\n".to_vec(),
            b"$11\r\nhello world\r\n".to_vec(),
            b"-ERR Protocol error: unbalanced quotes in request\r\n".to_vec(),
        ]
    );
    assert_eq!(proxy.seen(&Matcher::command("ping")), 1);
    let exact = Matcher::new(|args| {
        args == [
            b"set".to_vec(),
            b"greeting".to_vec(),
            b"hello world".to_vec(),
        ]
    });
    assert_eq!(proxy.seen(&exact), 1);
    assert_eq!(proxy.seen(&Matcher::command("GET")), 1);
    let value: String = redis.cmd(&["GET", "greeting"]);
    assert_eq!(value, "hello world");

    // A dropped request is not counted; a pipeline counts command by command.
    proxy.add(Fault::DropRequest {
        matching: Matcher::command("DEL"),
        nth: 1,
        then: AfterDrop::Close,
    });
    let mut client = through(&proxy);
    let _ = redis::cmd("DEL").arg("greeting").query::<i64>(&mut client);
    assert_eq!(proxy.seen(&Matcher::command("DEL")), 0);
    let mut client = through(&proxy);
    let mut pipe = redis::pipe();
    pipe.cmd("EXISTS").arg("greeting").cmd("EXISTS").arg("x");
    let exists: Vec<i64> = pipe.query(&mut client).unwrap();
    assert_eq!(exists, vec![1, 0]);
    assert_eq!(proxy.seen(&Matcher::command("EXISTS")), 2);
}

#[test]
fn restart_with_aof_keeps_data_and_without_aof_loses_it() {
    // A crash (SIGKILL) with appendfsync always: every acknowledged write survives.
    let mut redis = RedisServer::with_aof(Fsync::Always);
    let proxy = FaultProxy::start(&redis);
    let mut client = through(&proxy);
    let _: () = redis::cmd("SET")
        .arg("kept")
        .arg("yes")
        .query(&mut client)
        .unwrap();
    let pid = redis.pid();
    redis.stop(Signal::Kill);
    let error = redis::cmd("GET")
        .arg("kept")
        .query::<String>(&mut client)
        .expect_err("Redis is gone");
    assert!(
        error.is_connection_dropped() || error.is_io_error(),
        "{error:?}"
    );
    assert!(
        redis::Client::open(proxy.url())
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(1))
            .is_err(),
        "no Redis behind the proxy"
    );
    redis.restart();
    assert_ne!(redis.pid(), pid);
    let mut client = through(&proxy);
    let kept: Option<String> = redis::cmd("GET").arg("kept").query(&mut client).unwrap();
    assert_eq!(kept.as_deref(), Some("yes"), "replayed from the AOF");

    // A clean stop with everysec: SIGTERM flushes and fsyncs.
    let mut redis = RedisServer::with_aof(Fsync::EverySec);
    let _: () = redis.cmd(&["SET", "kept", "too"]);
    redis.stop(Signal::Term);
    redis.restart();
    let kept: Option<String> = redis.cmd(&["GET", "kept"]);
    assert_eq!(kept.as_deref(), Some("too"));

    // Without persistence a restart starts empty.
    let mut redis = RedisServer::start();
    let _: () = redis.cmd(&["SET", "lost", "yes"]);
    redis.restart();
    let lost: Option<String> = redis.cmd(&["GET", "lost"]);
    assert_eq!(lost, None);
}

#[test]
fn pause_stalls_redis_until_resume() {
    let redis = RedisServer::start();
    let mut impatient = redis.connection();
    impatient.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let mut waiting = std::os::unix::net::UnixStream::connect(&redis.socket).unwrap();

    redis.pause();
    let error = redis::cmd("PING")
        .query::<String>(&mut impatient)
        .expect_err("a paused Redis does not answer");
    assert!(error.is_timeout(), "{error:?}");
    // Sent while paused (the write returns once the kernel has it): no reply comes until the resume.
    waiting
        .write_all(&resp_command(&[b"INCR", b"counter"]))
        .unwrap();
    waiting.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let mut reply = [0u8; 64];
    let silent = waiting.read(&mut reply);
    assert!(
        silent
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "{silent:?}"
    );

    redis.resume();
    waiting
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let n = waiting.read(&mut reply).unwrap();
    assert_eq!(
        &reply[..n],
        b":1\r\n",
        "the INCR sent while paused ran after the resume"
    );
    // The impatient client skips its late PONG and works again.
    let value = incr(&mut impatient, "counter").unwrap();
    assert_eq!(value, 2);
}

#[test]
fn dropping_the_proxy_closes_everything_and_joins_its_threads() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let port = proxy.port();
    let mut hung = through(&proxy);
    proxy.add(Fault::DropReply {
        matching: Matcher::command("INCR"),
        nth: 1,
        then: AfterDrop::Hang,
    });
    assert!(incr(&mut hung, "counter").is_err());
    let mut stalled = through_with_timeout(&proxy, Duration::from_secs(10));
    let _idle = through(&proxy);
    let stall = proxy.add(Fault::Stall {
        duration: Duration::from_secs(30),
    });
    let waiter = std::thread::spawn(move || redis::cmd("PING").query::<String>(&mut stalled));
    eventually(Duration::from_secs(2), "the stall to hold the PING", || {
        (stall.fired() >= 1, stall.fired())
    });
    // An acceptor, and three threads for each of the three connections.
    assert_eq!(proxy_threads(port), 10);

    let started = Instant::now();
    drop(proxy);
    let took = started.elapsed();
    assert!(took < Duration::from_millis(500), "drop took {took:?}");
    assert_eq!(proxy_threads(port), 0, "no thread outlives the proxy");
    let result = waiter.join().unwrap();
    assert!(result.is_err(), "the stalled PING saw its connection close");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// This process's threads named after the proxy on `port`.
fn proxy_threads(port: u16) -> usize {
    let prefix = format!("fp{port}-");
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(&prefix))
        .count()
}

/// A command's bytes, and the arguments the parser must find in them.
type CommandCase = (&'static [u8], Option<Vec<&'static [u8]>>);

#[test]
fn resp_parsers_delimit_every_type_wherever_tcp_splits_it() {
    let replies: Vec<&[u8]> = vec![
        b"+OK\r\n",
        b"-ERR unknown command\r\n",
        b":-42\r\n",
        b"$5\r\nhe\r\no\r\n",
        b"$0\r\n\r\n",
        b"$-1\r\n",
        b"*-1\r\n",
        b"*0\r\n",
        b"*3\r\n:1\r\n*2\r\n+a\r\n$1\r\nb\r\n%1\r\n+k\r\n~2\r\n#t\r\n,1.5\r\n",
        b"_\r\n",
        b",inf\r\n",
        b"#f\r\n",
        b"(123456789012345678901234567890\r\n",
        b"!21\r\nSYNTAX invalid syntax\r\n",
        b"=15\r\ntxt:Some string\r\n",
        b"%2\r\n+first\r\n:1\r\n+second\r\n*1\r\n:2\r\n",
        b"~0\r\n",
        b">3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$3\r\nhi!\r\n",
        b"|1\r\n+ttl\r\n:3600\r\n$5\r\nvalue\r\n",
        b"*2\r\n|1\r\n+a\r\n+b\r\n:1\r\n:2\r\n",
        b"$?\r\n;4\r\nHell\r\n;1\r\no\r\n;0\r\n",
        b"*?\r\n:1\r\n*?\r\n+x\r\n.\r\n.\r\n",
        b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
    ];
    let stream: Vec<u8> = replies.concat();
    let mut at = 0;
    for (i, reply) in replies.iter().enumerate() {
        for cut in 0..reply.len() {
            assert_eq!(
                parse_reply(&stream[at..at + cut]),
                Ok(None),
                "reply {i} cut at {cut}"
            );
        }
        let frame = parse_reply(&stream[at..]).unwrap().unwrap();
        assert_eq!(frame.len, reply.len(), "reply {i}");
        at += frame.len;
    }
    assert_eq!(
        parse_reply(b"|1\r\n+ttl\r\n:3600\r\n>1\r\n+p\r\n")
            .unwrap()
            .unwrap()
            .kind,
        b'>',
        "an attribute's value decides the kind"
    );
    assert!(parse_reply(b"@oops\r\n").is_err());

    let commands: Vec<CommandCase> = vec![
        (
            b"*2\r\n$3\r\nGET\r\n$4\r\nk\r\nk\r\n",
            Some(vec![b"GET", b"k\r\nk"]),
        ),
        (b"*0\r\n", None),
        (b"PING\r\n", Some(vec![b"PING"])),
        (b"\r\n", None),
        (b"set a \"x\\x41\\n\"\n", Some(vec![b"set", b"a", b"xA\n"])),
        (b"*1\r\n$0\r\n\r\n", Some(vec![b""])),
    ];
    let stream: Vec<u8> = commands
        .iter()
        .flat_map(|(bytes, _)| bytes.to_vec())
        .collect();
    let mut at = 0;
    for (i, (bytes, args)) in commands.iter().enumerate() {
        for cut in 0..bytes.len() {
            assert_eq!(
                parse_command(&stream[at..at + cut]),
                Ok(None),
                "command {i} cut at {cut}"
            );
        }
        let Command { len, args: parsed } = parse_command(&stream[at..]).unwrap().unwrap();
        assert_eq!(len, bytes.len(), "command {i}");
        let expected = args
            .as_ref()
            .map(|args| args.iter().map(|a| a.to_vec()).collect::<Vec<_>>());
        assert_eq!(parsed, expected, "command {i}");
        at += len;
    }
    assert!(parse_command(b"*1\r\n:1\r\n").is_err());
}

//! A fault-injecting TCP proxy between kmqd and the test's redis-server, modelled on Shopify/toxiproxy's
//! "toxics" but aware of the Redis protocol, so a test can break exactly one command out of thousands.
//!
//! [`FaultProxy::start`] listens on a free port of 127.0.0.1 and forwards every connection it accepts to the
//! redis-server's unix socket; [`FaultProxy::url`] goes into the daemon's `[redis] url`. The proxy parses what
//! the client sends into commands (RESP arrays of bulk strings, or inline commands), one by one even when a
//! pipeline or a MULTI/EXEC block arrives in one write, and what Redis sends back into complete replies (every
//! RESP2 and RESP3 type, nested aggregates, attributes, streamed strings and aggregates), and pairs each reply
//! with its command in order. That pairing is what lets a fault act on "the reply of the third INCR".
//!
//! The faults, and what each one stands for in production:
//!
//! - [`Fault::DropReply`]: **the reply is lost after Redis ran the command.** The command reaches Redis and runs
//!   (a task was claimed, a settlement applied), but the connection breaks before its reply arrives
//!   ([`AfterDrop::Close`]: the client sees EOF) or the network goes silent ([`AfterDrop::Hang`]: the client
//!   hits its read timeout). The client cannot tell whether the command ran, and must not assume it did not: this
//!   is the fault that finds double claims and lost acknowledgements.
//! - [`Fault::DropRequest`]: **the request is lost.** The command never reaches Redis; the client sees the same
//!   EOF or timeout as above. Whatever the client does next must be correct both ways, and this fault is the
//!   other half of that proof.
//! - [`Fault::Stall`]: **Redis stalls past the client's read timeout** (a long fork, a slow script, a swapped
//!   host, a congested link), as seen from the network: every byte in both directions is held for the duration,
//!   then delivered in order, so commands sent meanwhile run only after it. Unlike
//!   `RedisServer::pause`, other clients (direct connections) are not affected.
//! - [`Fault::Latency`]: **a slow network or a slow Redis**: every reply is delivered `delay` late, in order.
//! - [`Fault::DelayRequest`]: **one request reaches Redis late**, after a delay in the network: everything the
//!   client sends after it on that connection waits behind it. With `survive_close`, it still reaches Redis after
//!   the client gave up and closed the connection, as the kernel goes on retransmitting an orphaned socket's data
//!   after `close()`, or a buffering proxy or load balancer delivers it: a late duplicate of a call the client
//!   has meanwhile sent again on another connection. This is the fault that finds a call applied twice.
//! - [`Fault::DelayReply`]: **one reply comes back late, but within the client's read timeout**: the command ran
//!   in Redis at once, and its reply is held for `delay` before it is delivered (a retransmitted segment, a
//!   congested link, a `WAIT` that took long, a client thread descheduled between its send and its read). What
//!   the client does with the reply then may race what other connections did meanwhile: this is the fault that
//!   finds decisions taken on a reply after the world moved on (a claim that lands after its lease was lost).
//!
//! Besides faults: [`FaultProxy::cut_all`] is a network cut (every live connection closed, new ones work),
//! [`FaultProxy::refuse`] is Redis down (connections accepted and closed at once), [`FaultProxy::seen`] counts
//! the commands that were forwarded, so a test can wait for "the daemon has sent its next claim" instead of
//! sleeping.
//!
//! Things a test writer must know:
//!
//! - Every connection sends a pipeline of its own when it connects, the redis crate's and kmqd's own
//!   (src/broker/node.rs) alike (`AUTH` with a password, `SELECT` when the db is not 0, `CLIENT SETINFO
//!   LIB-NAME`, `CLIENT SETINFO LIB-VER`): a fault on [`Matcher::any`] with `nth: 1` breaks the next
//!   *connection*, not the next command. An r2d2 pool with `test_on_check_out` (r2d2's default; kmqd's pool
//!   turns it off) also sends `PING` on every checkout. Match on the command or script you mean.
//! - `redis::Script::invoke` (redis 1.8) sends `EVALSHA`; when Redis answers NOSCRIPT it sends `SCRIPT LOAD`
//!   with the body, then `EVALSHA` again. A `-NOSCRIPT` reply means the script did not run, so [`Fault::DropReply`]
//!   does not count it: "the nth run of this script" stays the nth run, cold script cache or not. Both EVALSHAs
//!   count in [`FaultProxy::seen`] (it counts what was forwarded, not what ran).
//! - Inside MULTI, each command is answered `+QUEUED` and runs at EXEC: to lose the results of a transaction
//!   that ran, drop the reply of `EXEC`.
//! - A command sent behind a blocking one in the same write (an idle kmqd fetcher sends its claim or pop behind
//!   its `BLPOP` or `BLMOVE`) runs only once the wait ends: a DropReply or DelayReply rule added while it waits
//!   (after `wait_blocked_in`) matches it too, as it would a command sent after the wait. Request faults do not:
//!   the request has gone.
//! - After a read timeout the redis crate keeps the connection and skips the late reply when it comes, and
//!   kmqd's own connection closes itself; after an EOF both mark the connection closed (a pool then replaces
//!   it). A hung connection (after [`AfterDrop::Hang`]) stays hung: every later command on it times out too. A Hang costs the client its
//!   whole read timeout: kmqd's is `[redis] io_timeout` (10 s by default; tests set it lower) outside blocking calls.
//! - A connection that sends SUBSCRIBE, PSUBSCRIBE, SSUBSCRIBE, their UNSUBSCRIBE counterparts, MONITOR or
//!   `CLIENT REPLY` no longer gets one reply per command; from then on its replies are forwarded without pairing
//!   (faults on its requests still act), and RESP3 push frames (`>`) are never paired on any connection.
//!
//! Each connection has three threads (client to Redis, Redis to the proxy, the proxy to the client: the last one
//! is where Stall, Latency and DelayReply hold replies, so that a reply's delay counts from when it arrived).
//! Dropping the proxy stops accepting, closes every connection and joins every thread.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::RedisServer;

/// What a connection's threads read at a time.
const READ_CHUNK: usize = 64 * 1024;

/// The proxy. See the module docs.
pub struct FaultProxy {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

/// A fault, added with [`FaultProxy::add`].
#[derive(Clone, Debug)]
pub enum Fault {
    /// The nth command (1 = the next one) matching `matching`, counted from when the fault is added, is forwarded
    /// to Redis (so it RUNS), but its reply is swallowed; then `then` decides what the client sees. One-shot.
    /// A `-NOSCRIPT` reply is not counted (the script did not run; see the module docs).
    DropReply {
        matching: Matcher,
        nth: usize,
        then: AfterDrop,
    },
    /// The nth matching command never reaches Redis (nor does anything the client sends after it on that
    /// connection); then `then`. One-shot.
    DropRequest {
        matching: Matcher,
        nth: usize,
        then: AfterDrop,
    },
    /// Holds all traffic, both directions, on every connection (and new ones), for `duration` from when it is
    /// added, then delivers it in order: a stalled Redis as seen from the network. One-shot (ends by itself, or
    /// when removed).
    Stall { duration: Duration },
    /// Delays every reply by `delay` from when it arrived from Redis (replies stay in order) until removed: a
    /// slow Redis or network. Several latencies add up.
    Latency { delay: Duration },
    /// The reply of the nth command (1 = the next one) matching `matching`, counted from when the fault is added,
    /// is held `delay` from when it arrived from Redis, then delivered; the replies after it on that connection
    /// wait behind it, as on a real socket (a latency in force adds up with it). The command itself runs in Redis
    /// at once. One-shot. A `-NOSCRIPT` reply is not counted (the script did not run; see the module docs).
    DelayReply {
        matching: Matcher,
        nth: usize,
        delay: Duration,
    },
    /// The nth command (1 = the next one) matching `matching`, counted from when the fault is added, is held
    /// `delay` from when the proxy read it, then forwarded to Redis; what the client sends after it on that
    /// connection waits behind it, as on a real socket. If the connection closes meanwhile (the client gave up on
    /// its read timeout, or a Hang or Close cut it), the command is dropped, unless `survive_close`: then it still
    /// reaches Redis when its delay is over, and runs there, with nobody to read the reply. One-shot. A connection
    /// cut by [`FaultProxy::cut_all`] or [`FaultProxy::refuse`] loses it either way (its Redis side is closed).
    DelayRequest {
        matching: Matcher,
        nth: usize,
        delay: Duration,
        survive_close: bool,
    },
}

/// What the client sees after a dropped reply or request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterDrop {
    /// The client connection is closed right after (the client sees EOF: a lost reply with a reset). Replies
    /// already on their way to the client before the dropped one are still delivered first; whatever the proxy
    /// had already forwarded to Redis still runs there (the proxy keeps the Redis side open until those replies
    /// arrived, then closes it).
    Close,
    /// The connection stays open but nothing more is sent to the client on it (the client hits its read
    /// timeout), and nothing more the client sends on it reaches Redis: a connection gone silent.
    Hang,
}

/// A test over a command's arguments.
type Predicate = dyn Fn(&[Vec<u8>]) -> bool + Send + Sync;

/// Which commands a fault acts on: a predicate over a command's arguments (the command name first, as sent).
#[derive(Clone)]
pub struct Matcher {
    describe: String,
    test: Arc<Predicate>,
}

impl Matcher {
    /// Every command.
    pub fn any() -> Matcher {
        Matcher {
            describe: "any command".into(),
            test: Arc::new(|_| true),
        }
    }

    /// Commands whose first argument is `name`, ASCII case-insensitive (`"incr"` matches `INCR`). Only the first
    /// word: `command("CLIENT")` matches every CLIENT subcommand.
    pub fn command(name: &str) -> Matcher {
        let name = name.as_bytes().to_vec();
        Matcher {
            describe: format!("command {}", String::from_utf8_lossy(&name)),
            test: Arc::new(move |args| args.first().is_some_and(|a| a.eq_ignore_ascii_case(&name))),
        }
    }

    /// Runs of the Lua script `source`: `EVAL` / `EVAL_RO` with exactly that body, or `EVALSHA` / `EVALSHA_RO`
    /// with its SHA1 (hex, any case), which is what `redis::Script` sends.
    pub fn script(source: &str) -> Matcher {
        let body = source.as_bytes().to_vec();
        let sha = redis::Script::new(source).get_hash().as_bytes().to_vec();
        Matcher {
            describe: format!("script {}", String::from_utf8_lossy(&sha)),
            test: Arc::new(move |args| {
                let (Some(name), Some(first)) = (args.first(), args.get(1)) else {
                    return false;
                };
                if name.eq_ignore_ascii_case(b"EVAL") || name.eq_ignore_ascii_case(b"EVAL_RO") {
                    *first == body
                } else if name.eq_ignore_ascii_case(b"EVALSHA")
                    || name.eq_ignore_ascii_case(b"EVALSHA_RO")
                {
                    first.eq_ignore_ascii_case(&sha)
                } else {
                    false
                }
            }),
        }
    }

    /// A safe-mode claim, by either of its scripts: claim_plain.lua, which a plain queue's claims go to first, or
    /// claim.lua (every other queue's, and what claim_plain.lua leaves).
    pub fn claims() -> Matcher {
        let (plain, generic) = (
            Matcher::script(kmqd::broker::sources::CLAIM_PLAIN),
            Matcher::script(kmqd::broker::sources::CLAIM),
        );
        Matcher {
            describe: format!("{} or {}", plain.describe, generic.describe),
            test: Arc::new(move |args| plain.matches(args) || generic.matches(args)),
        }
    }

    /// Any predicate over a command's arguments.
    pub fn new(f: impl Fn(&[Vec<u8>]) -> bool + Send + Sync + 'static) -> Matcher {
        Matcher {
            describe: "custom matcher".into(),
            test: Arc::new(f),
        }
    }

    /// Whether `args` (a command's arguments, name first) match.
    pub fn matches(&self, args: &[Vec<u8>]) -> bool {
        (self.test)(args)
    }
}

impl fmt::Debug for Matcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Matcher({})", self.describe)
    }
}

/// A fault that was added: how often it acted, and a way to remove it. Dropping the handle does not remove the
/// fault (`proxy.add(...)` alone is a fault for the rest of the test).
#[derive(Debug)]
pub struct Rule {
    id: u64,
    fired: Arc<AtomicUsize>,
    shared: Arc<Shared>,
}

impl Rule {
    /// How many times the fault acted: 0 or 1 for a drop or a delay of one reply or request (they are one-shot),
    /// counted when it takes the command; for a stall, how many reads (of
    /// either direction) it held back; for a latency, how many replies it delayed.
    pub fn fired(&self) -> usize {
        self.fired.load(Ordering::SeqCst)
    }

    /// Removes the fault (a no-op for a one-shot fault that already acted or a stall that ended). Traffic held
    /// by a stall or a latency is released at once.
    pub fn remove(self) {
        let mut state = self.shared.lock();
        state.rules.retain(|rule| rule.id != self.id);
        drop(state);
        self.shared.changed.notify_all();
    }
}

impl FaultProxy {
    /// Listens on 127.0.0.1 (a free port) and forwards every connection to the test's redis-server (its unix
    /// socket). The upstream is named by its socket path, so a restarted server is reached again by new
    /// connections.
    pub fn start(upstream: &RedisServer) -> FaultProxy {
        FaultProxy::start_to(&upstream.socket)
    }

    /// As [`FaultProxy::start`], to any unix socket speaking RESP.
    pub fn start_to(socket: &Path) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("the proxy binds a free port");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream: socket.to_path_buf(),
            port: addr.port(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("fp{}-accept", addr.port()))
                .spawn(move || accept_loop(&shared, listener))
                .unwrap()
        };
        FaultProxy {
            shared,
            addr,
            acceptor: Some(acceptor),
        }
    }

    /// "redis://127.0.0.1:PORT/0", to put in a kmqd config's `[redis] url`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.addr.port())
    }

    /// The port the proxy listens on (its threads are named `fp{port}-...`).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Adds a fault; it acts until removed (or, for one-shot faults, once). Returns a handle.
    pub fn add(&self, fault: Fault) -> Rule {
        let fired = Arc::new(AtomicUsize::new(0));
        let mut state = self.shared.lock();
        state.next_rule += 1;
        let id = state.next_rule;
        let kind = match fault {
            Fault::DropReply {
                matching,
                nth,
                then,
            } => Kind::DropReply {
                matching,
                nth: nth.max(1),
                then,
                matched: 0,
            },
            Fault::DropRequest {
                matching,
                nth,
                then,
            } => Kind::DropRequest {
                matching,
                nth: nth.max(1),
                then,
                matched: 0,
            },
            Fault::Stall { duration } => Kind::Stall {
                until: Instant::now() + duration,
            },
            Fault::Latency { delay } => Kind::Latency { delay },
            Fault::DelayReply {
                matching,
                nth,
                delay,
            } => Kind::DelayReply {
                matching,
                nth: nth.max(1),
                delay,
                matched: 0,
            },
            Fault::DelayRequest {
                matching,
                nth,
                delay,
                survive_close,
            } => Kind::DelayRequest {
                matching,
                nth: nth.max(1),
                delay,
                survive_close,
                matched: 0,
            },
        };
        state.rules.push(ActiveRule {
            id,
            kind,
            fired: Arc::clone(&fired),
        });
        drop(state);
        self.shared.changed.notify_all();
        Rule {
            id,
            fired,
            shared: Arc::clone(&self.shared),
        }
    }

    /// Closes every live connection now, both sides: a network cut. New connections still work.
    pub fn cut_all(&self) {
        self.shared.cut_all();
    }

    /// While true, new connections are accepted and closed at once and live ones are cut: Redis "down" (as a
    /// load balancer in front of a dead Redis looks). `refuse(false)` lets new connections through again.
    pub fn refuse(&self, refuse: bool) {
        self.shared.lock().refusing = refuse;
        if refuse {
            self.shared.cut_all();
        }
    }

    /// Live proxied connections (whose client side is open).
    pub fn connections(&self) -> usize {
        let state = self.shared.lock();
        state
            .connections
            .values()
            .filter(|conn| !conn.client_closed.load(Ordering::SeqCst))
            .count()
    }

    /// Calls `observer` with every command (name first) on every connection before it is forwarded to Redis, on
    /// the proxy's thread of that connection, which waits for it: the observer may look at Redis (on a
    /// connection of its own) as it is before the command runs. Commands that arrive together (a pipeline, a
    /// transaction) are all observed before the first is forwarded.
    pub fn observe(&self, observer: impl Fn(&[Vec<u8>]) + Send + Sync + 'static) {
        self.shared.lock().observers.push(Arc::new(observer));
    }

    /// How many commands matching were forwarded to Redis so far, on all connections (dropped requests are not
    /// counted; commands that Redis then refused, such as an EVALSHA answered NOSCRIPT, are).
    pub fn seen(&self, matcher: &Matcher) -> usize {
        let state = self.shared.lock();
        state
            .forwarded
            .iter()
            .filter(|args| matcher.matches(args))
            .count()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        // Wake the acceptor out of accept(): it sees `shutdown` and returns.
        let _ = TcpStream::connect(self.addr);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        self.shared.cut_all();
        let threads = std::mem::take(&mut self.shared.lock().threads);
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// What the proxy's threads share.
#[derive(Debug)]
struct Shared {
    upstream: PathBuf,
    port: u16,
    state: Mutex<State>,
    /// Notified when the faults change or a connection closes: wakes threads holding traffic.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    shutdown: bool,
    refusing: bool,
    rules: Vec<ActiveRule>,
    next_rule: u64,
    connections: HashMap<u64, Arc<Conn>>,
    next_connection: u64,
    threads: Vec<JoinHandle<()>>,
    /// Every command forwarded, for [`FaultProxy::seen`].
    forwarded: Vec<Vec<Vec<u8>>>,
    /// Called with each command before it is forwarded ([`FaultProxy::observe`]).
    observers: Vec<Arc<Observer>>,
}

/// A test's look at each command before Redis gets it.
type Observer = dyn Fn(&[Vec<u8>]) + Send + Sync;

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("State")
            .field("rules", &self.rules.len())
            .field("connections", &self.connections.len())
            .finish_non_exhaustive()
    }
}

struct ActiveRule {
    id: u64,
    kind: Kind,
    fired: Arc<AtomicUsize>,
}

enum Kind {
    DropReply {
        matching: Matcher,
        nth: usize,
        then: AfterDrop,
        matched: usize,
    },
    DropRequest {
        matching: Matcher,
        nth: usize,
        then: AfterDrop,
        matched: usize,
    },
    Stall {
        until: Instant,
    },
    Latency {
        delay: Duration,
    },
    DelayReply {
        matching: Matcher,
        nth: usize,
        delay: Duration,
        matched: usize,
    },
    DelayRequest {
        matching: Matcher,
        nth: usize,
        delay: Duration,
        survive_close: bool,
        matched: usize,
    },
}

impl Shared {
    /// The state, even if a test's matcher panicked while holding it.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn cut_all(&self) {
        let connections: Vec<Arc<Conn>> = self.lock().connections.values().cloned().collect();
        for conn in connections {
            conn.cut(self);
        }
    }

    /// Sleeps until `until`; false when the proxy shuts down meanwhile. Unlike [`Shared::wait_until`], a closed
    /// connection does not end the wait.
    fn sleep_until(&self, until: Instant) -> bool {
        let mut state = self.lock();
        loop {
            if state.shutdown {
                return false;
            }
            let now = Instant::now();
            if until <= now {
                return true;
            }
            state = self
                .changed
                .wait_timeout(state, until - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// Blocks until `go_at(state)` is `None` or in the past, re-evaluating it whenever the faults change; false
    /// when the connection closed or the proxy shuts down meanwhile (the caller then stops).
    fn wait_until(
        &self,
        conn: &Conn,
        mut go_at: impl FnMut(&mut State) -> Option<Instant>,
    ) -> bool {
        let mut state = self.lock();
        loop {
            if state.shutdown || conn.client_closed.load(Ordering::SeqCst) {
                return false;
            }
            let Some(at) = go_at(&mut state) else {
                return true;
            };
            let now = Instant::now();
            if at <= now {
                return true;
            }
            state = self
                .changed
                .wait_timeout(state, at - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }
}

impl State {
    /// When the current stall ends (None: no stall); forgets stalls that ended, and counts a hold for each
    /// stall still running when `count` says so.
    fn stall_until(&mut self, count: bool) -> Option<Instant> {
        let now = Instant::now();
        self.rules
            .retain(|rule| !matches!(rule.kind, Kind::Stall { until } if until <= now));
        let mut end = None;
        for rule in &self.rules {
            if let Kind::Stall { until } = rule.kind {
                if count {
                    rule.fired.fetch_add(1, Ordering::SeqCst);
                }
                end = end.max(Some(until));
            }
        }
        end
    }

    /// The sum of the latencies in force.
    fn latency(&self) -> Duration {
        self.rules
            .iter()
            .map(|rule| match rule.kind {
                Kind::Latency { delay } => delay,
                _ => Duration::ZERO,
            })
            .sum()
    }
}

/// One proxied connection.
struct Conn {
    id: u64,
    client: TcpStream,
    upstream: UnixStream,
    /// The client side is closed: the connection no longer counts as live, held traffic is dropped.
    client_closed: AtomicBool,
    /// What the client sends is read and discarded (after a dropped request, a Hang or a Close).
    requests_blackholed: AtomicBool,
    pending: Mutex<Pending>,
    /// The three threads still running; the last one to end unregisters the connection.
    threads_left: AtomicUsize,
}

/// The commands forwarded on a connection whose replies have not come back yet, in order.
#[derive(Default)]
struct Pending {
    queue: VecDeque<Entry>,
    /// A subscribe (or similar) was forwarded: replies are no longer paired from the request side's view.
    unpaired_requests: bool,
    /// The reply side reached that subscribe: replies are forwarded without pairing.
    unpaired: bool,
    /// Nothing more goes to the client (Hang).
    hung: bool,
    /// The client side was closed by a Close: the Redis side stays open until the forwarded commands were
    /// answered (so they all run), then closes.
    draining: bool,
}

enum Entry {
    /// A command; the DropReply and DelayReply rules it matched when it was forwarded.
    Command(Candidates),
    /// From here on, replies are not paired.
    Unpaired,
}

/// The DropReply and DelayReply rules a forwarded command may answer to.
struct Candidates {
    /// The ids of those it matched when it was forwarded.
    rules: Vec<u64>,
    /// A command sent behind a blocking one in the same write (kmqd's idle fetcher sends its claim or pop behind
    /// its `BLPOP` or `BLMOVE`): the last rule id when it was forwarded, and its arguments. Redis runs it only once
    /// the wait ends, so a rule added while it waits (once a test saw the fetcher blocked) matches it too, when its
    /// reply comes, as it would a command sent after the wait.
    behind_a_wait: Option<(u64, Vec<Vec<u8>>)>,
}

impl Candidates {
    /// The rules the reply counts for: those matched when it was forwarded, and those added since that match it
    /// when it waited behind a blocking command.
    fn rules(self, state: &State) -> Vec<u64> {
        let mut rules = self.rules;
        if let Some((last, args)) = self.behind_a_wait {
            rules.extend(
                reply_rule_candidates(state, &args)
                    .into_iter()
                    .filter(|&id| id > last),
            );
        }
        rules
    }
}

/// Commands that block until something happens in Redis (kmqd's idle waits among them).
fn blocks(args: &[Vec<u8>]) -> bool {
    let name = args[0].to_ascii_uppercase();
    [
        &b"BLPOP"[..],
        b"BRPOP",
        b"BLMOVE",
        b"BLMPOP",
        b"BRPOPLPUSH",
        b"BZPOPMIN",
        b"BZPOPMAX",
    ]
    .contains(&name.as_slice())
}

impl Pending {
    /// Whether a forwarded command still waits for its reply. O(1): the queue holds commands, then at most one
    /// `Unpaired` marker (no command is queued after it).
    fn commands_pending(&self) -> bool {
        matches!(self.queue.front(), Some(Entry::Command(_)))
    }
}

impl Conn {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Closes both sides now.
    fn cut(&self, shared: &Shared) {
        self.close_client(shared);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }

    fn close_client(&self, shared: &Shared) {
        self.client_closed.store(true, Ordering::SeqCst);
        self.requests_blackholed.store(true, Ordering::SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        // Threads holding traffic for this connection wake up and stop.
        let _guard = shared.lock();
        shared.changed.notify_all();
    }

    /// Starts a Close: the client side closes once what is already queued for it was written; the Redis side
    /// once every forwarded command was answered. Called with the pending lock held.
    fn begin_close(&self, pending: &mut Pending, out: &Sender<Out>) {
        self.requests_blackholed.store(true, Ordering::SeqCst);
        pending.draining = true;
        let _ = out.send(Out::Close);
        if !pending.commands_pending() || pending.unpaired || pending.unpaired_requests {
            let _ = self.upstream.shutdown(Shutdown::Both);
        }
    }

    /// Starts a Hang: nothing more in either direction. Called with the pending lock held.
    fn begin_hang(&self, pending: &mut Pending) {
        self.requests_blackholed.store(true, Ordering::SeqCst);
        pending.hung = true;
    }
}

/// What the reply thread hands the client writer.
enum Out {
    /// Replies (whole ones), as they arrived from Redis at `arrived`, held `held` longer than the latency in force
    /// holds them (a DelayReply fired on the first of them).
    Data {
        bytes: Vec<u8>,
        replies: usize,
        arrived: Instant,
        held: Duration,
    },
    /// Close the client side after what came before.
    Close,
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let mut state = shared.lock();
        if state.shutdown {
            return;
        }
        if state.refusing {
            drop(state);
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let Ok(upstream) = UnixStream::connect(&shared.upstream) else {
            // Redis is down: the client sees its connection closed at once, as through a load balancer.
            drop(state);
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        // Replies are written as soon as they may be: Nagle's algorithm would add up to 40 ms to each.
        let _ = client.set_nodelay(true);
        state.next_connection += 1;
        let id = state.next_connection;
        let (Ok(client_clone), Ok(upstream_clone)) = (client.try_clone(), upstream.try_clone())
        else {
            continue;
        };
        let conn = Arc::new(Conn {
            id,
            client: client_clone,
            upstream: upstream_clone,
            client_closed: AtomicBool::new(false),
            requests_blackholed: AtomicBool::new(false),
            pending: Mutex::new(Pending::default()),
            threads_left: AtomicUsize::new(3),
        });
        state.connections.insert(id, Arc::clone(&conn));
        state.threads.retain(|thread| !thread.is_finished());
        let (out_tx, out_rx) = std::sync::mpsc::channel();
        let port = shared.port;
        let spawn = |name: &str, body: Box<dyn FnOnce() + Send>| {
            let shared = Arc::clone(shared);
            let conn = Arc::clone(&conn);
            std::thread::Builder::new()
                .name(format!("fp{port}-{id}{name}"))
                .spawn(move || {
                    body();
                    if conn.threads_left.fetch_sub(1, Ordering::SeqCst) == 1 {
                        shared.lock().connections.remove(&conn.id);
                    }
                })
                .expect("spawn a proxy thread")
        };
        let requests = {
            let (shared, conn, out) = (Arc::clone(shared), Arc::clone(&conn), out_tx.clone());
            let (client, upstream) = (client.try_clone(), upstream.try_clone());
            spawn(
                "req",
                Box::new(move || {
                    if let (Ok(client), Ok(upstream)) = (client, upstream) {
                        forward_requests(&shared, &conn, client, upstream, &out);
                    }
                }),
            )
        };
        let replies = {
            let (shared, conn) = (Arc::clone(shared), Arc::clone(&conn));
            spawn(
                "rep",
                Box::new(move || forward_replies(&shared, &conn, upstream, &out_tx)),
            )
        };
        let writer = {
            let (shared, conn) = (Arc::clone(shared), Arc::clone(&conn));
            spawn(
                "out",
                Box::new(move || write_replies(&shared, &conn, client, &out_rx)),
            )
        };
        state.threads.extend([requests, replies, writer]);
    }
}

/// Client → Redis: parses commands, applies DropRequest and DelayRequest, records DropReply and DelayReply
/// candidates, forwards.
fn forward_requests(
    shared: &Shared,
    conn: &Conn,
    mut client: TcpStream,
    mut upstream: UnixStream,
    out: &Sender<Out>,
) {
    let mut chunk = vec![0u8; READ_CHUNK];
    let mut requests = Requests::default();
    // A command a DelayRequest holds: nothing after it is forwarded before it, and the client is still read meanwhile
    // (with a read timeout that ends with the hold), so that a close is seen when it comes.
    let mut hold: Option<Hold> = None;
    loop {
        if let Some(held) = &hold {
            let left = held.until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let held = hold.take().expect("a hold");
                let _ = client.set_read_timeout(None);
                if !held.release(shared, conn, &mut upstream) {
                    break;
                }
                // What the client sent meanwhile goes now.
                match requests.forward(shared, conn, &mut upstream, out) {
                    Some(next) => hold = next,
                    None => break,
                }
                continue;
            }
            let _ = client.set_read_timeout(Some(left));
        }
        let n = match client.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(error)
                if hold.is_some()
                    && matches!(
                        error.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
            {
                continue;
            }
            Err(_) => break,
        };
        let mut counted = false;
        if !shared.wait_until(conn, |state| {
            let until = state.stall_until(!counted);
            counted = true;
            until
        }) {
            break;
        }
        if conn.requests_blackholed.load(Ordering::SeqCst) {
            continue;
        }
        requests.buf.extend_from_slice(&chunk[..n]);
        if hold.is_some() {
            // It waits behind the held command, as on a real socket.
            continue;
        }
        match requests.forward(shared, conn, &mut upstream, out) {
            Some(next) => hold = next,
            None => break,
        }
    }
    // The client went away (or was closed). A command held with `survive_close` still reaches Redis once its
    // delay is over (the Redis side then closes once it was answered).
    if let Some(held) = hold.filter(|held| held.survive_close)
        && shared.sleep_until(held.until)
        && held.release(shared, conn, &mut upstream)
    {
        conn.begin_close(&mut conn.pending(), out);
    }
    // After a Close the reply thread closes the Redis side once the forwarded commands were answered; otherwise
    // close it now.
    if !conn.pending().draining {
        conn.cut(shared);
    }
}

/// What a connection's client sent and the proxy has not forwarded yet, and how it parses it.
#[derive(Default)]
struct Requests {
    buf: Vec<u8>,
    /// After a protocol error the rest is forwarded as it comes: Redis answers the error and closes.
    raw: bool,
    /// A subscribe (or similar) was forwarded: no more pairing on this connection.
    unpaired: bool,
}

/// A command a DelayRequest holds, with what forwarding it takes.
struct Hold {
    until: Instant,
    survive_close: bool,
    bytes: Vec<u8>,
    /// Its pairing entries, queued when it is forwarded.
    entries: Vec<Entry>,
    /// Its arguments, for `seen`.
    args: Vec<Vec<u8>>,
}

impl Hold {
    /// Forwards the held command; false when the Redis side is gone. Unless it survives a close, it is dropped when
    /// the connection was cut meanwhile (a Hang or a Close).
    fn release(self, shared: &Shared, conn: &Conn, upstream: &mut UnixStream) -> bool {
        {
            let mut pending = conn.pending();
            if (pending.hung || pending.draining) && !self.survive_close {
                return true;
            }
            pending.queue.extend(self.entries);
            shared.lock().forwarded.push(self.args);
        }
        upstream.write_all(&self.bytes).is_ok()
    }
}

impl Requests {
    /// Parses what the client sent and forwards every whole command, up to a command a DelayRequest holds, which
    /// it returns (what follows it stays in `buf`). `None` when the Redis side is gone.
    fn forward(
        &mut self,
        shared: &Shared,
        conn: &Conn,
        upstream: &mut UnixStream,
        out: &Sender<Out>,
    ) -> Option<Option<Hold>> {
        let buf = &self.buf;
        // What is forwarded is always a prefix of `buf`: a dropped request blackholes what follows it.
        let mut end = 0;
        let mut entries = Vec::new();
        let mut forwarded = Vec::new();
        let mut cut = None;
        let mut hold = None;
        // Whether a blocking command came before, in this write.
        let mut behind_a_wait = false;
        if self.raw {
            end = buf.len();
        } else {
            let mut state = shared.lock();
            loop {
                match parse_command(&buf[end..]) {
                    Ok(None) => break,
                    Err(_) => {
                        self.raw = true;
                        end = buf.len();
                        if !self.unpaired {
                            entries.push(Entry::Unpaired);
                            self.unpaired = true;
                        }
                        break;
                    }
                    Ok(Some(Command { len, args: None })) => end += len,
                    Ok(Some(Command {
                        len,
                        args: Some(args),
                    })) => {
                        if let Some(then) = drop_request(&mut state, &args) {
                            cut = Some(then);
                            break;
                        }
                        let mut entry = Vec::new();
                        if !self.unpaired && breaks_pairing(&args) {
                            entry.push(Entry::Unpaired);
                            self.unpaired = true;
                        }
                        if !self.unpaired {
                            entry.push(Entry::Command(Candidates {
                                rules: reply_rule_candidates(&state, &args),
                                behind_a_wait: behind_a_wait
                                    .then(|| (state.next_rule, args.clone())),
                            }));
                        }
                        behind_a_wait |= blocks(&args);
                        if let Some((delay, survive_close)) = delay_request(&mut state, &args) {
                            hold = Some(Hold {
                                until: Instant::now() + delay,
                                survive_close,
                                bytes: buf[end..end + len].to_vec(),
                                entries: entry,
                                args,
                            });
                            break;
                        }
                        entries.extend(entry);
                        forwarded.push(args);
                        end += len;
                    }
                }
            }
        }
        if !forwarded.is_empty() {
            let observers = shared.lock().observers.clone();
            for observer in &observers {
                for args in &forwarded {
                    observer(args);
                }
            }
        }
        {
            // The state lock is released: the reply thread takes pending, then state.
            let mut pending = conn.pending();
            if pending.hung || pending.draining {
                // The reply side cut the connection meanwhile: nothing more goes to Redis.
                self.buf.clear();
                return Some(None);
            }
            pending.unpaired_requests = self.unpaired;
            // Queued before the bytes go out, so the reply always finds its command.
            pending.queue.extend(entries);
            shared.lock().forwarded.extend(forwarded);
            match cut {
                Some(AfterDrop::Close) => conn.begin_close(&mut pending, out),
                Some(AfterDrop::Hang) => conn.begin_hang(&mut pending),
                None => {}
            }
        }
        if end > 0 && upstream.write_all(&self.buf[..end]).is_err() {
            return None;
        }
        if let Some(held) = &hold {
            end += held.bytes.len();
        }
        self.buf.drain(..end);
        if cut.is_some() {
            self.buf.clear();
        }
        Some(hold)
    }
}

/// Whether a DelayRequest rule holds this command (and is used up): for how long, and whether it survives a close.
/// The delays of several rules add up.
fn delay_request(state: &mut State, args: &[Vec<u8>]) -> Option<(Duration, bool)> {
    let mut hold: Option<(Duration, bool)> = None;
    let mut used = Vec::new();
    for rule in &mut state.rules {
        if let Kind::DelayRequest {
            matching,
            nth,
            delay,
            survive_close,
            matched,
        } = &mut rule.kind
            && matching.matches(args)
        {
            *matched += 1;
            if *matched == *nth {
                rule.fired.fetch_add(1, Ordering::SeqCst);
                used.push(rule.id);
                let (before, survives) = hold.unwrap_or_default();
                hold = Some((before + *delay, survives || *survive_close));
            }
        }
    }
    state.rules.retain(|rule| !used.contains(&rule.id));
    hold
}

/// Whether a DropRequest rule takes this command (and is used up).
fn drop_request(state: &mut State, args: &[Vec<u8>]) -> Option<AfterDrop> {
    let mut action = None;
    let mut used = Vec::new();
    for rule in &mut state.rules {
        if let Kind::DropRequest {
            matching,
            nth,
            then,
            matched,
        } = &mut rule.kind
            && matching.matches(args)
        {
            *matched += 1;
            if *matched == *nth {
                rule.fired.fetch_add(1, Ordering::SeqCst);
                used.push(rule.id);
                action = merge(action, *then);
            }
        }
    }
    state.rules.retain(|rule| !used.contains(&rule.id));
    action
}

/// The DropReply and DelayReply rules a forwarded command matches (their count is taken when its reply arrives).
fn reply_rule_candidates(state: &State, args: &[Vec<u8>]) -> Vec<u64> {
    state
        .rules
        .iter()
        .filter(|rule| match &rule.kind {
            Kind::DropReply { matching, .. } | Kind::DelayReply { matching, .. } => {
                matching.matches(args)
            }
            _ => false,
        })
        .map(|rule| rule.id)
        .collect()
}

/// Close wins over Hang when two faults act on one command.
fn merge(action: Option<AfterDrop>, then: AfterDrop) -> Option<AfterDrop> {
    match action {
        Some(AfterDrop::Close) => Some(AfterDrop::Close),
        _ => Some(then),
    }
}

/// Commands after which a connection no longer gets exactly one reply per command.
fn breaks_pairing(args: &[Vec<u8>]) -> bool {
    let name = &args[0];
    [
        &b"SUBSCRIBE"[..],
        b"PSUBSCRIBE",
        b"SSUBSCRIBE",
        b"UNSUBSCRIBE",
        b"PUNSUBSCRIBE",
        b"SUNSUBSCRIBE",
        b"MONITOR",
    ]
    .iter()
    .any(|c| name.eq_ignore_ascii_case(c))
        || (name.eq_ignore_ascii_case(b"CLIENT")
            && args
                .get(1)
                .is_some_and(|a| a.eq_ignore_ascii_case(b"REPLY")))
}

/// Redis → the client writer: parses replies, pairs them with commands, applies DropReply.
fn forward_replies(shared: &Shared, conn: &Conn, mut upstream: UnixStream, out: &Sender<Out>) {
    let mut chunk = vec![0u8; READ_CHUNK];
    let mut buf: Vec<u8> = Vec::new();
    // After a protocol error, bytes are forwarded as they come.
    let mut raw = false;
    loop {
        let n = match upstream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let arrived = Instant::now();
        buf.extend_from_slice(&chunk[..n]);
        let mut pending = conn.pending();
        let mut bytes = Vec::new();
        let mut replies = 0;
        // How long a DelayReply holds `bytes` (from the delayed reply on, which starts them).
        let mut held = Duration::ZERO;
        let mut at = 0;
        while !raw {
            if pending.hung {
                at = buf.len();
                break;
            }
            let frame = match parse_reply(&buf[at..]) {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(_) => {
                    raw = true;
                    break;
                }
            };
            let reply = &buf[at..at + frame.len];
            at += frame.len;
            while let Some(Entry::Unpaired) = pending.queue.front() {
                pending.queue.pop_front();
                pending.unpaired = true;
            }
            // Push frames are out of band (RESP3 pub/sub, client tracking): they answer no command.
            let command = if frame.kind != b'>' && !pending.unpaired {
                pending.queue.pop_front()
            } else {
                None
            };
            if pending.draining {
                // The client side is closed: Redis finishes what it was sent, then its side closes.
                if !pending.commands_pending() || pending.unpaired {
                    let _ = conn.upstream.shutdown(Shutdown::Both);
                }
                continue;
            }
            let (dropped, delay) = match command {
                Some(Entry::Command(candidates))
                    if (!candidates.rules.is_empty() || candidates.behind_a_wait.is_some())
                        && !is_noscript(&reply[frame.value_at..]) =>
                {
                    let mut state = shared.lock();
                    let rules = candidates.rules(&state);
                    if rules.is_empty() {
                        (None, Duration::ZERO)
                    } else {
                        take_reply_faults(&mut state, &rules)
                    }
                }
                _ => (None, Duration::ZERO),
            };
            if dropped.is_none() && delay > Duration::ZERO {
                // The replies before it go now; it and those after it wait.
                if !bytes.is_empty() {
                    let _ = out.send(Out::Data {
                        bytes: std::mem::take(&mut bytes),
                        replies: std::mem::take(&mut replies),
                        arrived,
                        held,
                    });
                }
                held = delay;
            }
            match dropped {
                None => {
                    bytes.extend_from_slice(reply);
                    replies += 1;
                }
                // The loop's next turn discards the rest.
                Some(AfterDrop::Hang) => conn.begin_hang(&mut pending),
                Some(AfterDrop::Close) => {
                    // The replies before the dropped one still reach the client, then the EOF.
                    if !bytes.is_empty() {
                        let _ = out.send(Out::Data {
                            bytes: std::mem::take(&mut bytes),
                            replies,
                            arrived,
                            held,
                        });
                    }
                    conn.begin_close(&mut pending, out);
                }
            }
        }
        if raw {
            if !pending.hung && !pending.draining {
                bytes.extend_from_slice(&buf[at..]);
                replies += 1;
            }
            at = buf.len();
        }
        buf.drain(..at);
        if !bytes.is_empty() {
            // Sent with the pending lock held, so that a Close decided by the request thread comes after it.
            let _ = out.send(Out::Data {
                bytes,
                replies,
                arrived,
                held,
            });
        }
    }
    // Redis closed the connection (or it was cut): the client sees EOF after what it was already sent; a hung
    // connection stays silent until the client gives up or the test cuts it.
    if !conn.pending().hung {
        let _ = out.send(Out::Close);
    }
}

/// Counts a reply for the DropReply and DelayReply rules its command matched; a rule whose nth it is fires (and is
/// used up). Returns what to do with the reply: drop it (and then what), and how long to hold it (the delays of
/// several rules add up).
fn take_reply_faults(state: &mut State, rules: &[u64]) -> (Option<AfterDrop>, Duration) {
    let mut action = None;
    let mut held = Duration::ZERO;
    let mut used = Vec::new();
    for rule in &mut state.rules {
        if !rules.contains(&rule.id) {
            continue;
        }
        let (nth, matched) = match &mut rule.kind {
            Kind::DropReply { nth, matched, .. } | Kind::DelayReply { nth, matched, .. } => {
                (*nth, matched)
            }
            _ => continue,
        };
        *matched += 1;
        if *matched != nth {
            continue;
        }
        rule.fired.fetch_add(1, Ordering::SeqCst);
        used.push(rule.id);
        match &rule.kind {
            Kind::DropReply { then, .. } => action = merge(action, *then),
            Kind::DelayReply { delay, .. } => held += *delay,
            _ => {}
        }
    }
    state.rules.retain(|rule| !used.contains(&rule.id));
    (action, held)
}

/// Whether a reply (its top-level value) is Redis's NOSCRIPT error: EVALSHA of a script it does not have, which
/// did not run.
fn is_noscript(value: &[u8]) -> bool {
    if value.starts_with(b"-NOSCRIPT") {
        return true;
    }
    // A RESP3 blob error: !<len>\r\nNOSCRIPT ...
    value.first() == Some(&b'!')
        && value
            .windows(2)
            .position(|w| w == b"\r\n")
            .is_some_and(|i| value[i + 2..].starts_with(b"NOSCRIPT"))
}

/// The proxy → the client: holds replies during a stall, for the latency in force and a delayed reply's delay,
/// then writes them (in order: what comes after a held reply waits behind it).
fn write_replies(shared: &Shared, conn: &Conn, mut client: TcpStream, out: &Receiver<Out>) {
    while let Ok(message) = out.recv() {
        let Out::Data {
            bytes,
            replies,
            arrived,
            held,
        } = message
        else {
            break;
        };
        let mut first = true;
        let go = shared.wait_until(conn, |state| {
            let stall = state.stall_until(first);
            // The latency is read again on every wake-up: removing it releases what it holds.
            let latency = state.latency();
            if first && latency > Duration::ZERO {
                for rule in &state.rules {
                    if let Kind::Latency { .. } = rule.kind {
                        rule.fired.fetch_add(replies, Ordering::SeqCst);
                    }
                }
            }
            first = false;
            stall.max(Some(arrived + latency + held))
        });
        if !go || client.write_all(&bytes).is_err() {
            break;
        }
    }
    // Out::Close, or the client went away, or the connection was cut.
    conn.close_client(shared);
}

/// A RESP protocol error: not a command or reply the proxy can delimit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProtocolError(pub String);

/// A complete command at the front of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    /// Its length in bytes.
    pub len: usize,
    /// Its arguments, the name first; `None` for what Redis ignores without a reply.
    pub args: Option<Vec<Vec<u8>>>,
}

/// Parses one client command from the front of `buf`: `Ok(None)` when it is incomplete, else its length and its
/// arguments (`None` for what Redis ignores without a reply: an empty inline line, `*0` or `*-1`).
pub fn parse_command(buf: &[u8]) -> Result<Option<Command>, ProtocolError> {
    if buf.is_empty() {
        return Ok(None);
    }
    if buf[0] != b'*' {
        // An inline command: one line, arguments split as redis-cli and Redis do (quotes allowed).
        let Some(newline) = buf.iter().position(|&b| b == b'\n') else {
            return Ok(None);
        };
        let line = buf[..newline]
            .strip_suffix(b"\r")
            .unwrap_or(&buf[..newline]);
        let args = split_inline(line)?;
        return Ok(Some(Command {
            len: newline + 1,
            args: (!args.is_empty()).then_some(args),
        }));
    }
    let Some((count, mut at)) = line_int(buf, 0)? else {
        return Ok(None);
    };
    if count <= 0 {
        return Ok(Some(Command {
            len: at,
            args: None,
        }));
    }
    if count > 1024 * 1024 {
        return Err(ProtocolError(format!("invalid multibulk length {count}")));
    }
    let mut args = Vec::with_capacity(count as usize);
    for _ in 0..count {
        if at >= buf.len() {
            return Ok(None);
        }
        if buf[at] != b'$' {
            return Err(ProtocolError(format!(
                "expected '$', got {:?}",
                buf[at] as char
            )));
        }
        let Some((len, data)) = line_int(buf, at)? else {
            return Ok(None);
        };
        if !(0..=512 * 1024 * 1024).contains(&len) {
            return Err(ProtocolError(format!("invalid bulk length {len}")));
        }
        let end = data + len as usize;
        if buf.len() < end + 2 {
            return Ok(None);
        }
        if &buf[end..end + 2] != b"\r\n" {
            return Err(ProtocolError("bulk string not followed by CRLF".into()));
        }
        args.push(buf[data..end].to_vec());
        at = end + 2;
    }
    Ok(Some(Command {
        len: at,
        args: Some(args),
    }))
}

/// Splits an inline command as Redis's `sdssplitargs` does: whitespace-separated, with "double quotes" (and
/// \n, \r, \t, \b, \a, \\, \", \xHH escapes) and 'single quotes' (and \').
fn split_inline(line: &[u8]) -> Result<Vec<Vec<u8>>, ProtocolError> {
    let unbalanced = || ProtocolError("unbalanced quotes in inline command".into());
    let mut args = Vec::new();
    let mut i = 0;
    loop {
        while i < line.len() && line[i].is_ascii_whitespace() {
            i += 1;
        }
        if i == line.len() {
            return Ok(args);
        }
        let mut arg = Vec::new();
        match line[i] {
            b'"' => {
                i += 1;
                loop {
                    match line.get(i) {
                        None => return Err(unbalanced()),
                        Some(b'"') => {
                            i += 1;
                            break;
                        }
                        Some(b'\\') if i + 3 < line.len() && line[i + 1] == b'x' => {
                            let hex = std::str::from_utf8(&line[i + 2..i + 4]).ok();
                            match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                                Some(byte) => {
                                    arg.push(byte);
                                    i += 4;
                                }
                                None => {
                                    arg.push(b'x');
                                    i += 2;
                                }
                            }
                        }
                        Some(b'\\') if i + 1 < line.len() => {
                            arg.push(match line[i + 1] {
                                b'n' => b'\n',
                                b'r' => b'\r',
                                b't' => b'\t',
                                b'b' => 8,
                                b'a' => 7,
                                other => other,
                            });
                            i += 2;
                        }
                        Some(&byte) => {
                            arg.push(byte);
                            i += 1;
                        }
                    }
                }
                if i < line.len() && !line[i].is_ascii_whitespace() {
                    return Err(unbalanced());
                }
            }
            b'\'' => {
                i += 1;
                loop {
                    match line.get(i) {
                        None => return Err(unbalanced()),
                        Some(b'\'') => {
                            i += 1;
                            break;
                        }
                        Some(b'\\') if line.get(i + 1) == Some(&b'\'') => {
                            arg.push(b'\'');
                            i += 2;
                        }
                        Some(&byte) => {
                            arg.push(byte);
                            i += 1;
                        }
                    }
                }
                if i < line.len() && !line[i].is_ascii_whitespace() {
                    return Err(unbalanced());
                }
            }
            _ => {
                while i < line.len() && !line[i].is_ascii_whitespace() {
                    arg.push(line[i]);
                    i += 1;
                }
            }
        }
        args.push(arg);
    }
}

/// A complete reply at the front of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyFrame {
    /// Its length in bytes, attributes included.
    pub len: usize,
    /// The type byte of its value (`+`, `-`, `$`, `*`, `%`, `>`, ...), after any attributes.
    pub kind: u8,
    /// Where its value starts (after any attributes).
    pub value_at: usize,
}

/// Parses one complete reply (RESP2 or RESP3) from the front of `buf`; `Ok(None)` when it is incomplete.
/// Iterative, so that deeply nested aggregates cannot overflow the stack.
pub fn parse_reply(buf: &[u8]) -> Result<Option<ReplyFrame>, ProtocolError> {
    enum Frame {
        /// An aggregate still waiting for `left` values; an attribute's values do not count as a value of its
        /// parent (the value it annotates follows).
        Counted { left: usize, attribute: bool },
        /// A streamed aggregate (`*?`), ended by `.`.
        Streamed,
    }
    // The root waits for one value.
    let mut stack = vec![Frame::Counted {
        left: 1,
        attribute: false,
    }];
    let mut at = 0;
    let mut kind = 0;
    let mut value_at = 0;
    loop {
        if at >= buf.len() {
            return Ok(None);
        }
        let t = buf[at];
        let Some(line_end) = find_crlf(buf, at + 1) else {
            return Ok(None);
        };
        let line = &buf[at + 1..line_end];
        let next = line_end + 2;
        if stack.len() == 1 && t != b'|' {
            kind = t;
            value_at = at;
        }
        match t {
            b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => at = next,
            b'$' | b'!' | b'=' if line == b"?" => {
                // A streamed string: ;len chunks, ended by ;0.
                at = next;
                loop {
                    if at >= buf.len() {
                        return Ok(None);
                    }
                    if buf[at] != b';' {
                        return Err(ProtocolError("expected a ';' chunk".into()));
                    }
                    let Some((len, data)) = line_int(buf, at)? else {
                        return Ok(None);
                    };
                    if len == 0 {
                        at = data;
                        break;
                    }
                    match bulk_end(buf, data, len)? {
                        Some(end) => at = end,
                        None => return Ok(None),
                    }
                }
            }
            b'$' | b'!' | b'=' => {
                let len = int(line)?;
                if len < 0 {
                    at = next;
                } else {
                    match bulk_end(buf, next, len)? {
                        Some(end) => at = end,
                        None => return Ok(None),
                    }
                }
            }
            b'*' | b'~' | b'>' | b'%' | b'|' => {
                at = next;
                if line == b"?" {
                    stack.push(Frame::Streamed);
                    continue;
                }
                let n = int(line)?;
                let per = if t == b'%' || t == b'|' { 2 } else { 1 };
                if n > 0 {
                    stack.push(Frame::Counted {
                        left: n as usize * per,
                        attribute: t == b'|',
                    });
                    continue;
                }
                if t == b'|' {
                    // An empty attribute annotates the value that follows.
                    continue;
                }
            }
            b'.' if line.is_empty() && matches!(stack.last(), Some(Frame::Streamed)) => {
                stack.pop();
                at = next;
            }
            other => {
                return Err(ProtocolError(format!(
                    "unknown RESP type byte {:?}",
                    other as char
                )));
            }
        }
        // A value ended at `at`: it counts for its parent, which may end in turn.
        loop {
            match stack.last_mut() {
                Some(Frame::Counted { left, attribute }) => {
                    *left -= 1;
                    if *left > 0 {
                        break;
                    }
                    let attribute = *attribute;
                    stack.pop();
                    if stack.is_empty() {
                        return Ok(Some(ReplyFrame {
                            len: at,
                            kind,
                            value_at,
                        }));
                    }
                    if attribute {
                        break;
                    }
                }
                Some(Frame::Streamed) => break,
                None => unreachable!("the root frame ends the parse"),
            }
        }
    }
}

/// Where the CRLF ending the line that starts at `from` is.
fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|i| from + i)
}

/// The integer on the line at `at` (after its type byte), and where the next line starts.
fn line_int(buf: &[u8], at: usize) -> Result<Option<(i64, usize)>, ProtocolError> {
    let Some(end) = find_crlf(buf, at + 1) else {
        return Ok(None);
    };
    Ok(Some((int(&buf[at + 1..end])?, end + 2)))
}

fn int(text: &[u8]) -> Result<i64, ProtocolError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ProtocolError(format!("bad length {:?}", String::from_utf8_lossy(text))))
}

/// The end of `len` bytes of data at `data` and their CRLF; `None` while incomplete.
fn bulk_end(buf: &[u8], data: usize, len: i64) -> Result<Option<usize>, ProtocolError> {
    // Redis's proto-max-bulk-len is at most 512 MiB by default; anything near usize::MAX is garbage.
    if !(0..1 << 40).contains(&len) {
        return Err(ProtocolError(format!("bad blob length {len}")));
    }
    let end = data + len as usize;
    if buf.len() < end + 2 {
        return Ok(None);
    }
    if &buf[end..end + 2] != b"\r\n" {
        return Err(ProtocolError("blob not followed by CRLF".into()));
    }
    Ok(Some(end + 2))
}

//! The small HTTP/1.1 server of the metrics endpoint and the dashboard, bounded in everything a client can make
//! it hold (review H3): a client that is slow, idle, endless or simply many costs a bounded amount of memory,
//! threads and file descriptors, and for a bounded time, never the daemon's health.
//!
//! Synchronous, as the rest of kmqd: one thread (the caller's) runs an event loop over `poll(2)` that accepts
//! connections and reads their requests, and a fixed pool of handler threads answers the complete ones. So a
//! connection costs a thread only while its answer is made and written; a client that sends its request slowly,
//! or not at all, holds a socket and a buffer of at most [`Limits::max_head`] plus [`Limits::max_body`] bytes, for
//! at most [`Limits::head_timeout`] (the head) and [`Limits::io_timeout`] (the body, then the answer's write).
//!
//! - At most [`Limits::max_connections`] connections are open at a time, those being read and those queued for
//!   or being answered by a handler; one beyond is answered 503 and closed at once, without a thread.
//! - A head over [`Limits::max_head`] bytes or [`Limits::max_headers`] headers gets 431; a body over
//!   [`Limits::max_body`] bytes gets 413; a body without a `Content-Length` (chunked) gets 411; a request
//!   `httparse` cannot read gets 400; a head or body not in within its timeout gets 408 (or, when nothing came,
//!   just the close). All logged at debug: a scanner must not flood the daemon's log.
//! - An accept that fails (EMFILE, ENFILE: out of file descriptors) is logged once per burst and retried every
//!   [`ACCEPT_BACKOFF`]; the loop goes on serving the connections it has, and accepts again once it can.
//! - Every answer is the last on its connection (`Connection: close`): no keep-alive to bound.
//! - The loop and the handlers stop within about [`TICK`] of the shutdown trigger (a handler first finishes the
//!   request in hand; the requests still queued are closed unanswered); [`Server::run`] returns once all have.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rustix::event::{PollFd, PollFlags, Timespec};

use crate::shutdown::Listener;

/// The longest the event loop blocks in `poll`, and a handler in one write: how soon both see the shutdown.
pub const TICK: Duration = Duration::from_millis(100);

/// How long the accept loop pauses after an accept failed (out of file descriptors, most likely): long enough
/// not to spin on a listener that stays readable, short enough that a freed descriptor is used soon.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What a server holds at most, and for how long.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Handler threads, started with the server: requests answered at a time.
    pub handlers: usize,
    /// Connections open at a time (being read, queued for a handler, or being answered).
    pub max_connections: usize,
    /// From the accept to the end of the request's head.
    pub head_timeout: Duration,
    /// From the end of the head to the end of the body, and then for writing the answer.
    pub io_timeout: Duration,
    /// The request line and headers, in bytes.
    pub max_head: usize,
    /// The headers of a request.
    pub max_headers: usize,
    /// A request's body, in bytes.
    pub max_body: usize,
}

impl Limits {
    /// The bounds both servers use, with `handlers` threads and bodies up to `max_body` bytes.
    pub const fn new(handlers: usize, max_body: usize) -> Limits {
        Limits {
            handlers,
            max_connections: 64,
            head_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(10),
            max_head: 16 * 1024,
            max_headers: 64,
            max_body,
        }
    }
}

/// A complete request: its head, parsed, and its whole body.
#[derive(Debug)]
pub struct Request {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    peer: SocketAddr,
}

impl Request {
    /// As sent (`GET`, `POST`): methods are case-sensitive.
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The request target as sent: the path and the query string, still percent-encoded.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The value of the first header called `name` (in any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(field, _)| field.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The client's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
}

/// An answer: a status, headers and a body (`Content-Length` and `Connection: close` are added when sent).
#[derive(Debug)]
pub struct Response {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

impl Response {
    pub fn new(status: u16, content_type: &str, body: impl Into<Vec<u8>>) -> Response {
        Response {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
        .header("Content-Type", content_type)
    }

    /// A plain-text answer.
    pub fn text(status: u16, body: &str) -> Response {
        Response::new(status, "text/plain; charset=utf-8", body)
    }

    /// Adds a header. Names and values are the server's own, never a client's: a line break in one would split
    /// the answer, so it is refused as the programming error it is.
    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Response {
        let value = value.into();
        assert!(
            !value.contains(['\r', '\n']),
            "a header value with a line break: {value:?}"
        );
        self.headers.push((name, value));
        self
    }

    /// The bytes on the wire; the head only, with the body's length, for an answer to HEAD.
    fn encode(&self, head_only: bool) -> Vec<u8> {
        let mut out = format!("HTTP/1.1 {} {}\r\n", self.status, reason(self.status));
        for (name, value) in &self.headers {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str(&format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.body.len()
        ));
        let mut out = out.into_bytes();
        if !head_only {
            out.extend_from_slice(&self.body);
        }
        out
    }
}

/// The reason phrase of the statuses kmqd answers with.
fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        421 => "Misdirected Request",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// A server with its handler threads started, to [`Server::run`] on the thread that accepts and reads.
pub struct Server {
    listener: TcpListener,
    name: String,
    limits: Limits,
    /// To the handler threads: dropped when [`Server::run`] returns, which ends them once the queue is empty.
    jobs: Sender<Job>,
    threads: Vec<std::thread::JoinHandle<()>>,
    stop: Listener,
}

impl Server {
    /// Starts the handler threads of `listener`, named `NAME-0`, `NAME-1`, ..., which answer with `handler`
    /// until `stop` fires.
    pub fn start<H>(
        listener: TcpListener,
        name: &str,
        limits: Limits,
        handler: H,
        stop: Listener,
    ) -> io::Result<Server>
    where
        H: Fn(&Request) -> Response + Send + Sync + 'static,
    {
        listener.set_nonblocking(true)?;
        // Never full: every request in it holds one of `max_connections` open slots.
        let (jobs_tx, jobs) = crossbeam_channel::bounded(limits.max_connections);
        let handler = Arc::new(handler);
        let mut threads = Vec::with_capacity(limits.handlers);
        for n in 0..limits.handlers {
            let jobs: Receiver<Job> = jobs.clone();
            let handler = Arc::clone(&handler);
            let stop = stop.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{n}"))
                .spawn(move || {
                    // Ends when the event loop dropped its sender and the queue is empty. What is still queued
                    // at the shutdown is closed unanswered: 64 scrapes waiting for Redis would hold it up.
                    for job in jobs {
                        if !stop.is_triggered() {
                            answer(job, &*handler, limits, &stop);
                        }
                    }
                });
            match spawned {
                Ok(thread) => threads.push(thread),
                Err(error) => {
                    drop(jobs_tx);
                    join(threads);
                    return Err(error);
                }
            }
        }
        Ok(Server {
            listener,
            name: name.to_string(),
            limits,
            jobs: jobs_tx,
            threads,
            stop,
        })
    }

    /// Accepts and reads requests until `stop` fires, then joins the handler threads (each finishes the request
    /// in hand first).
    pub fn run(self) {
        let Server {
            listener,
            name,
            limits,
            jobs,
            threads,
            stop,
        } = self;
        EventLoop {
            listener,
            name: &name,
            limits,
            open: Arc::default(),
            reading: Vec::new(),
            jobs,
            accept_paused_until: None,
            accept_failing: false,
        }
        .run(&stop);
        join(threads);
    }
}

fn join(threads: Vec<std::thread::JoinHandle<()>>) {
    for thread in threads {
        // A handler's panic is caught around the handler; one elsewhere has been reported by the panic hook.
        let _ = thread.join();
    }
}

/// One of the `max_connections`: given back when its connection is closed, wherever that happens.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A complete request on its way to a handler, with its connection.
struct Job {
    request: Request,
    stream: TcpStream,
    _slot: Slot,
}

/// The accepting and reading side, on the caller's thread.
struct EventLoop<'a> {
    listener: TcpListener,
    name: &'a str,
    limits: Limits,
    /// Connections open: those in `reading`, and those sent to the handlers until they close them.
    open: Arc<AtomicUsize>,
    /// Connections whose request is still coming.
    reading: Vec<Reading>,
    jobs: Sender<Job>,
    /// Set after an accept failed: the listener is left out of `poll` until then.
    accept_paused_until: Option<Instant>,
    /// An accept failure was logged and no accept has worked since: one warning per burst.
    accept_failing: bool,
}

impl EventLoop<'_> {
    fn run(mut self, stop: &Listener) {
        while !stop.is_triggered() {
            let now = Instant::now();
            self.expire(now);
            let accepting = self.accept_paused_until.is_none_or(|until| now >= until);
            if accepting {
                self.accept_paused_until = None;
            }
            let wake_at = self
                .reading
                .iter()
                .map(|conn| conn.deadline)
                .chain(self.accept_paused_until)
                .min()
                .map_or(TICK, |at| at.saturating_duration_since(now).min(TICK));
            let ready = match self.poll(accepting, wake_at) {
                Ok(ready) => ready,
                Err(error) => {
                    // EINTR, or ENOMEM: nothing to do but try again after a breath.
                    tracing::debug!(server = self.name, %error, "poll failed");
                    stop.wait(TICK);
                    continue;
                }
            };
            let (listener_ready, conns_ready) = match accepting {
                true => (ready[0], &ready[1..]),
                false => (false, &ready[..]),
            };
            // Back to front, so that removing a connection does not move one still to visit.
            for index in (0..conns_ready.len()).rev() {
                if conns_ready[index] {
                    self.read(index);
                }
            }
            if listener_ready {
                self.accept();
            }
        }
        tracing::debug!(server = self.name, "HTTP server stopped");
    }

    /// Which of the listener (first, when `accepting`) and the connections being read are readable, or hung up,
    /// after waiting at most `timeout`.
    fn poll(&self, accepting: bool, timeout: Duration) -> io::Result<Vec<bool>> {
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(self.reading.len() + 1);
        if accepting {
            fds.push(PollFd::new(&self.listener, PollFlags::IN));
        }
        fds.extend(
            self.reading
                .iter()
                .map(|conn| PollFd::new(&conn.stream, PollFlags::IN)),
        );
        // TICK at most: a Duration that always fits.
        let timeout = Timespec::try_from(timeout).expect("a timeout under a second");
        rustix::event::poll(&mut fds, Some(&timeout))?;
        Ok(fds.iter().map(|fd| !fd.revents().is_empty()).collect())
    }

    /// Accepts what is waiting, refusing what is over the connection cap.
    fn accept(&mut self) {
        // Bounded, so that a flood of connections cannot starve those being read.
        for _ in 0..self.limits.max_connections {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if self.accept_failing {
                        self.accept_failing = false;
                        tracing::info!(server = self.name, "accepting connections again");
                    }
                    if self.open.load(Ordering::Relaxed) >= self.limits.max_connections {
                        tracing::debug!(server = self.name, %peer, "too many connections: refused");
                        refuse(stream, 503, "too many connections; try again later\n");
                        continue;
                    }
                    if let Err(error) = stream.set_nonblocking(true) {
                        tracing::debug!(server = self.name, %peer, %error, "cannot read a connection");
                        continue;
                    }
                    self.open.fetch_add(1, Ordering::Relaxed);
                    let slot = Slot(Arc::clone(&self.open));
                    let deadline = Instant::now() + self.limits.head_timeout;
                    self.reading
                        .push(Reading::new(stream, peer, slot, deadline));
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                // Interrupted, or a client that left before its connection was accepted.
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(error) => {
                    if !self.accept_failing {
                        self.accept_failing = true;
                        tracing::warn!(
                            server = self.name,
                            %error,
                            "cannot accept connections (out of file descriptors?); retrying every {ACCEPT_BACKOFF:?}"
                        );
                    }
                    self.accept_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    /// Reads what connection `index` sent; sends it to the handlers once its request is complete.
    fn read(&mut self, index: usize) {
        let conn = &mut self.reading[index];
        match conn.read(&self.limits) {
            Progress::More => {}
            Progress::Closed => {
                self.reading.swap_remove(index);
            }
            Progress::Refused(status, why) => {
                let conn = self.reading.swap_remove(index);
                tracing::debug!(server = self.name, peer = %conn.peer, status, why, "request refused");
                refuse(conn.stream, status, &format!("{why}\n"));
            }
            Progress::Complete(request) => {
                let conn = self.reading.swap_remove(index);
                if let Err(error) = conn.stream.set_nonblocking(false) {
                    tracing::debug!(server = self.name, peer = %conn.peer, %error, "cannot answer a connection");
                    return;
                }
                let job = Job {
                    request,
                    stream: conn.stream,
                    _slot: conn.slot,
                };
                if let Err(error) = self.jobs.try_send(job) {
                    // Cannot happen (the queue holds as many as there are slots), but if it did: a clear answer.
                    refuse(error.into_inner().stream, 503, "too many requests\n");
                }
            }
        }
    }

    /// Closes the connections whose head or body did not come in time.
    fn expire(&mut self, now: Instant) {
        for index in (0..self.reading.len()).rev() {
            if now < self.reading[index].deadline {
                continue;
            }
            let conn = self.reading.swap_remove(index);
            let received = conn.buf.len();
            tracing::debug!(server = self.name, peer = %conn.peer, received, "request timed out");
            // A client that sent nothing is just closed: it asked nothing.
            if received > 0 {
                refuse(conn.stream, 408, "the request did not come in time\n");
            }
        }
    }
}

/// What one read of a connection came to.
enum Progress {
    More,
    Complete(Request),
    /// Answer with this status, saying why, and close.
    Refused(u16, &'static str),
    /// The client closed before its request was complete, or its connection broke.
    Closed,
}

/// A connection whose request is still coming.
struct Reading {
    stream: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    /// What it sent so far: never more than the head's and the body's caps.
    buf: Vec<u8>,
    /// Where the search for the head's end goes on (it has been searched before).
    scanned: usize,
    head: Option<Head>,
    /// When it is closed unless complete: `head_timeout` after the accept, then `io_timeout` after the head.
    deadline: Instant,
    /// `100 Continue` was sent (or it was not asked for).
    continued: bool,
}

/// A parsed request head, waiting for its body.
struct Head {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    /// Where the body starts in the buffer, and how long it is.
    end: usize,
    body_len: usize,
}

impl Reading {
    fn new(stream: TcpStream, peer: SocketAddr, slot: Slot, deadline: Instant) -> Reading {
        Reading {
            stream,
            peer,
            slot,
            buf: Vec::new(),
            scanned: 0,
            head: None,
            deadline,
            continued: false,
        }
    }

    fn read(&mut self, limits: &Limits) -> Progress {
        // Read no more than the request may hold: the head's cap until the head ends, then the body's length.
        let wanted = match &self.head {
            None => limits.max_head,
            Some(head) => head.end + head.body_len,
        };
        let mut chunk = [0u8; 8192];
        let room = wanted.saturating_sub(self.buf.len()).clamp(1, chunk.len());
        let got = match self.stream.read(&mut chunk[..room]) {
            Ok(0) => return Progress::Closed,
            Ok(got) => got,
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                return Progress::More;
            }
            Err(_) => return Progress::Closed,
        };
        self.buf.extend_from_slice(&chunk[..got]);
        if self.head.is_none() {
            let Some(end) = head_end(&self.buf, self.scanned) else {
                if self.buf.len() >= limits.max_head {
                    return Progress::Refused(431, "the request's head is too large");
                }
                // A terminator may straddle this read and the next.
                self.scanned = self.buf.len().saturating_sub(2);
                return Progress::More;
            };
            if end > limits.max_head {
                return Progress::Refused(431, "the request's head is too large");
            }
            match parse_head(&self.buf[..end], limits) {
                Ok(head) => {
                    self.continued = !expects_continue(&head.headers) || head.body_len == 0;
                    self.head = Some(head);
                    self.deadline = Instant::now() + limits.io_timeout;
                }
                Err((status, why)) => return Progress::Refused(status, why),
            }
        }
        let head = self.head.as_ref().expect("parsed above");
        if self.buf.len() < head.end + head.body_len {
            if !self.continued {
                self.continued = true;
                // Small, on a connection nothing was written to yet: it fits the socket's buffer; if it did
                // not, the client sends its body after its own wait anyway.
                let _ = self.stream.write(b"HTTP/1.1 100 Continue\r\n\r\n");
            }
            return Progress::More;
        }
        let head = self.head.take().expect("parsed above");
        let mut body = std::mem::take(&mut self.buf);
        body.drain(..head.end);
        body.truncate(head.body_len);
        Progress::Complete(Request {
            method: head.method,
            target: head.target,
            headers: head.headers,
            body,
            peer: self.peer,
        })
    }
}

/// Where the head in `buf` ends (after its empty line, `\r\n\r\n` or a bare `\n\n`), searching from `from`.
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(offset) = buf[at..].iter().position(|&byte| byte == b'\n') {
        let newline = at + offset;
        match (buf.get(newline + 1), buf.get(newline + 2)) {
            (Some(b'\n'), _) => return Some(newline + 2),
            (Some(b'\r'), Some(b'\n')) => return Some(newline + 3),
            _ => at = newline + 1,
        }
    }
    None
}

/// A complete head (`head` ends with its empty line), or the status to refuse it with and why.
fn parse_head(head: &[u8], limits: &Limits) -> Result<Head, (u16, &'static str)> {
    let mut headers = vec![httparse::EMPTY_HEADER; limits.max_headers];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err((400, "a malformed request")),
        Err(httparse::Error::TooManyHeaders) => {
            return Err((431, "the request has too many headers"));
        }
        Err(_) => return Err((400, "a malformed request")),
    }
    let (Some(method), Some(target)) = (request.method, request.path) else {
        return Err((400, "a malformed request"));
    };
    let headers: Vec<(String, String)> = request
        .headers
        .iter()
        .map(|header| {
            (
                header.name.to_string(),
                String::from_utf8_lossy(header.value).into_owned(),
            )
        })
        .collect();
    if headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("Transfer-Encoding"))
    {
        return Err((
            411,
            "a body needs a Content-Length (chunked bodies are not read)",
        ));
    }
    let mut lengths = headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("Content-Length"))
        .map(|(_, value)| value.trim());
    let body_len = match lengths.next() {
        None => 0,
        Some(first) => {
            if lengths.any(|other| other != first) || !first.bytes().all(|b| b.is_ascii_digit()) {
                return Err((400, "a malformed Content-Length"));
            }
            match first.parse::<usize>() {
                Ok(len) if len <= limits.max_body => len,
                Ok(_) => return Err((413, "the request's body is too large")),
                // All digits, so only too large for a usize.
                Err(_) => return Err((413, "the request's body is too large")),
            }
        }
    };
    Ok(Head {
        method: method.to_string(),
        target: target.to_string(),
        headers,
        end: head.len(),
        body_len,
    })
}

fn expects_continue(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("Expect") && value.trim().eq_ignore_ascii_case("100-continue")
    })
}

/// Answers a connection from the event loop, without waiting: a short answer fits an empty socket buffer, and a
/// client that does not read it is not waited for.
fn refuse(stream: TcpStream, status: u16, body: &str) {
    let _ = stream.set_nonblocking(true);
    let _ = (&stream).write(&Response::text(status, body).encode(false));
    let _ = stream.shutdown(Shutdown::Write);
}

/// A handler thread's work: the answer to one request, written within `io_timeout`, then the close.
fn answer<H>(job: Job, handler: &H, limits: Limits, stop: &Listener)
where
    H: Fn(&Request) -> Response,
{
    let Job {
        request,
        mut stream,
        _slot,
    } = job;
    let response = catch_unwind(AssertUnwindSafe(|| handler(&request))).unwrap_or_else(|_| {
        tracing::error!(path = request.target(), "an HTTP handler panicked");
        Response::text(500, "internal error\n")
    });
    let bytes = response.encode(request.method() == "HEAD");
    let deadline = Instant::now() + limits.io_timeout;
    if let Err(error) = write_within(&mut stream, &bytes, deadline, stop) {
        tracing::debug!(peer = %request.peer(), %error, "the answer could not be sent");
    }
    let _ = stream.shutdown(Shutdown::Write);
}

/// Writes `bytes` by `deadline`, in writes of at most [`TICK`] each, giving up when `stop` fires.
fn write_within(
    stream: &mut TcpStream,
    mut bytes: &[u8],
    deadline: Instant,
    stop: &Listener,
) -> io::Result<()> {
    stream.set_write_timeout(Some(TICK))?;
    while !bytes.is_empty() {
        match stream.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => bytes = &bytes[written..],
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if stop.is_triggered() || Instant::now() >= deadline {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shutdown::Trigger;

    /// A server on a free loopback port answering with the request's body, until the trigger fires.
    fn echo_server(limits: Limits) -> (SocketAddr, Trigger, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Trigger::new();
        let echo = |request: &Request| Response::new(200, "text/plain", request.body().to_vec());
        let server = Server::start(listener, "test-http", limits, echo, stop.listener()).unwrap();
        (addr, stop, std::thread::spawn(move || server.run()))
    }

    /// What the server answered on `stream` before it closed it.
    fn answer(mut stream: TcpStream) -> String {
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    }

    #[test]
    fn a_connection_over_the_cap_is_answered_503_while_the_others_are_held() {
        let limits = Limits {
            max_connections: 2,
            ..Limits::new(1, 0)
        };
        let (addr, stop, server) = echo_server(limits);
        // Accepted in the order they connected: the first two are held, waiting for their heads.
        let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let over = answer(TcpStream::connect(addr).unwrap());
        assert!(
            over.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{over}"
        );
        drop(held);
        stop.fire();
        server.join().unwrap();
    }

    #[test]
    fn a_head_that_does_not_come_in_time_is_answered_408() {
        let limits = Limits {
            head_timeout: Duration::from_millis(50),
            ..Limits::new(1, 0)
        };
        let (addr, stop, server) = echo_server(limits);
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
        let answer = answer(slow);
        assert!(
            answer.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
            "{answer}"
        );
        stop.fire();
        server.join().unwrap();
    }

    #[test]
    fn a_body_that_waits_for_100_continue_is_asked_for_and_read_whole() {
        let (addr, stop, server) = echo_server(Limits::new(1, 16));
        let mut client = TcpStream::connect(addr).unwrap();
        client
            .write_all(b"POST /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
            .unwrap();
        let mut interim = [0u8; 25];
        client.read_exact(&mut interim).unwrap();
        assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
        client.write_all(b"hel").unwrap();
        client.write_all(b"lo").unwrap();
        let answer = answer(client);
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nhello"), "{answer}");
        stop.fire();
        server.join().unwrap();
    }

    #[test]
    fn the_head_ends_at_its_empty_line_with_or_without_carriage_returns() {
        let check = |buf: &[u8], from: usize, expected: Option<usize>| {
            assert_eq!(
                head_end(buf, from),
                expected,
                "{:?}",
                String::from_utf8_lossy(buf)
            );
        };
        check(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody", 0, Some(27));
        check(b"GET / HTTP/1.1\nHost: x\n\nbody", 0, Some(24));
        check(b"GET / HTTP/1.1\r\nHost: x\r\n", 0, None);
        check(b"GET / HTTP/1.1\r\nHost: x\r\n\r", 0, None);
        // Searching again from two bytes before the end finds a terminator split between two reads.
        check(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 24, Some(27));
    }

    #[test]
    fn heads_are_parsed_or_refused_with_the_status_that_says_why() {
        let limits = Limits::new(1, 10);
        let check = |head: &str, expected: Result<usize, u16>| {
            let got = parse_head(head.as_bytes(), &limits)
                .map(|head| head.body_len)
                .map_err(|(status, _)| status);
            assert_eq!(got, expected, "{head:?}");
        };
        check("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", Ok(0));
        check("POST /a HTTP/1.1\r\nContent-Length: 10\r\n\r\n", Ok(10));
        check("POST /a HTTP/1.1\r\nContent-Length: 11\r\n\r\n", Err(413));
        check(
            "POST /a HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            Err(413),
        );
        check("POST /a HTTP/1.1\r\nContent-Length: -1\r\n\r\n", Err(400));
        check(
            "POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            Err(400),
        );
        check(
            "POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            Err(411),
        );
        check("NOT HTTP\r\n\r\n", Err(400));
        let many: String = (0..65).map(|n| format!("X-{n}: y\r\n")).collect();
        check(&format!("GET / HTTP/1.1\r\n{many}\r\n"), Err(431));
    }

    #[test]
    fn an_answer_to_head_has_the_length_of_its_body_but_not_the_body() {
        let response = Response::text(200, "hello\n");
        let full = String::from_utf8(response.encode(false)).unwrap();
        assert!(full.starts_with("HTTP/1.1 200 OK\r\n"), "{full}");
        assert!(
            full.contains("Content-Length: 6\r\nConnection: close\r\n\r\nhello\n"),
            "{full}"
        );
        let head = String::from_utf8(response.encode(true)).unwrap();
        assert!(
            head.ends_with("Content-Length: 6\r\nConnection: close\r\n\r\n"),
            "{head}"
        );
    }
}

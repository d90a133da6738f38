//! One long-lived handler process: its three pipes, each served by a thread of its own, the tasks it holds, and
//! its end, which fails those tasks with why it ended.
//!
//! - the task lines: the worker that hands a task over writes its line into the child's standard input itself,
//!   without waiting (the pipe is non-blocking; the pipe is the queue, and a task costs no hand-off to another
//!   thread). One worker writes at a time, outside the lock, taking along the lines others appended meanwhile.
//!   What a full pipe does not take waits in order, and `kmq-exec-input` writes it, blocking, while the workers
//!   go on appending theirs behind it: a worker never blocks on a child that reads slowly (it only waits for its
//!   answer, and can be cancelled meanwhile). Decided after a profile of the daemon showed half its time in
//!   context switches, a writer thread woken per task among them (docs/PERFORMANCE.md);
//! - `kmq-exec-output` reads the hello, then the answers, and hands each to where it goes: the daemon's completion of a
//!   started task, or the worker waiting in `handle`;
//! - `kmq-exec-stderr` copies standard error, line by line, to the daemon's standard error (its log) naming the
//!   tasks the child held at the time, and keeps its tail for the reason of a crash. Before an answer is handed
//!   over, the output thread lets it catch up with what the child wrote to standard error before that answer
//!   ([`Child::catch_up_stderr`]), so a handler's last lines are named after the task that wrote them.
//!
//! The child is reaped by [`Child::end`] only, which runs once, under the lock the exit checks take: nothing is
//! ever signalled or waited for through a process id after it was reaped (and could be reused).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use kmq_plugin::{Completion, Outcome};

use super::protocol::{self, Line};
use crate::config::Program;
use crate::per_task::DRAIN_BOUND;
use crate::process;
use crate::tail::Tail;

/// What a child tells its pool.
pub enum Event {
    /// It wrote a valid hello: it takes tasks from now on.
    Ready,
    /// A task it held is over (answered, given up, or failed by its end): its slot is free.
    Settled,
    /// It is gone and reaped. `ready`: it had said hello; `planned`: kmqd stopped it (recycling, shutdown).
    Ended {
        ready: bool,
        planned: bool,
        reason: String,
    },
}

pub type Events = Box<dyn Fn(u32, Event) + Send + Sync>;

/// How many times a worker writes, besides its own line, the lines other workers appended meanwhile, before it
/// leaves the rest to the `kmq-exec-input` thread.
const WRITE_ROUNDS: u32 = 4;

/// The longest an answer waits for the stderr thread to catch up (see [`Child::catch_up_stderr`]).
const CATCH_UP_BOUND: Duration = Duration::from_millis(50);

/// Why a child ends.
pub enum Cause {
    /// Its standard output closed, or it exited.
    Exited,
    /// After its hello, it wrote a line that names no task (or one longer than the protocol allows).
    Protocol(String),
    /// Its first line is not a hello this kmqd speaks.
    BadHello(String),
    /// It wrote no hello within `start_timeout`.
    NoHello(Duration),
    /// kmqd kills it: a task it held timed out or was cancelled. SIGTERM, then SIGKILL after `kill_grace`.
    Killed(String),
    /// kmqd stops it, idle: its input closes, then SIGTERM, then SIGKILL, `kill_grace` apart.
    Stop,
}

struct Held {
    /// Set, with `tasks` taken, when the child ends: nothing is handed to it afterwards.
    ended: bool,
    tasks: HashMap<String, Answer>,
}

/// Where a task's outcome goes, and until when it may run.
pub struct Answer {
    pub reply: Reply,
    /// The plugin's `timeout` for it, watched by the pool thread.
    pub deadline: Option<Instant>,
}

pub enum Reply {
    /// A worker waits in `handle` (a host without `start`): a one-slot channel (an unbounded one allocates a
    /// block of slots per task). The worker watches its cancel flag itself.
    Worker(mpsc::SyncSender<Outcome>),
    /// A task the host started: completed from whichever thread has its outcome. The pool thread watches its
    /// cancel flag.
    Started(Completion),
}

/// Why the pool thread gives up on a task (see [`Child::due`]).
pub enum Due {
    TimedOut,
    Cancelled,
}

/// The child's standard input (see the module's doc).
struct Input {
    /// `None` once it is closed, or broke (the child's end fails its tasks then).
    pipe: Option<Arc<File>>,
    /// Bytes the pipe did not take yet, in order, for the `kmq-exec-input` thread to write.
    pending: Vec<u8>,
    /// From a line the pipe did not take whole until the `kmq-exec-input` thread has written all that is pending:
    /// lines go to `pending` behind it, never straight into the pipe, so that they stay in order and whole.
    behind: bool,
    /// A worker is writing what it took from `pending` (outside the lock): the others append behind it.
    writing: bool,
    /// The child ends: its input closes once what is pending is written.
    closing: bool,
}

struct Reaped {
    process: std::process::Child,
    status: Option<io::Result<ExitStatus>>,
}

pub struct Child {
    pub pid: u32,
    name: String,
    kill_grace: Duration,
    ready: AtomicBool,
    /// It answered at least one task.
    answered: AtomicBool,
    /// Held through [`Child::end`]: a second call waits for the first to be over.
    ending: Mutex<()>,
    input: Mutex<Input>,
    /// Signalled when `pending` fills, or the input is to close.
    input_waiting: Condvar,
    held: Mutex<Held>,
    process: Mutex<Reaped>,
    stderr_tail: Arc<Mutex<Tail>>,
    /// Held while the stderr thread reads and copies a chunk: with it held and nothing unread in the pipe,
    /// everything the child wrote so far has been copied. `None` once the pipe is closed.
    stderr_reading: Mutex<Option<RawFd>>,
    stderr_closed: Mutex<mpsc::Receiver<()>>,
    events: Events,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `exit status 3` or `killed by signal 9`.
pub fn status_text(status: &io::Result<ExitStatus>) -> String {
    match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(code), _) => format!("exit status {code}"),
            (None, Some(signal)) => format!("killed by signal {signal}"),
            (None, None) => format!("{status:?}"),
        },
        Err(error) => format!("cannot wait for it: {error}"),
    }
}

impl Child {
    /// Starts the program as a handler process that holds up to `concurrency` tasks at once.
    pub fn spawn(
        program: &Program,
        concurrency: usize,
        kill_grace: Duration,
        events: Events,
    ) -> io::Result<Arc<Child>> {
        let mut command = program.command();
        command
            .env("KMQ_PROTOCOL", protocol::VERSION.to_string())
            .env("KMQ_CONCURRENCY", concurrency.to_string());
        let mut process = command.spawn()?;
        let pid = process.id();
        // The pipes were requested in `Program::command`, so they are there.
        let stdin = process.stdin.take().expect("stdin is piped");
        let stdout = process.stdout.take().expect("stdout is piped");
        let stderr = process.stderr.take().expect("stderr is piped");
        let stdin = Arc::new(File::from(OwnedFd::from(stdin)));
        let nonblocking = process::set_nonblocking(stdin.as_raw_fd());
        let (closed, stderr_closed) = mpsc::channel();
        let child = Arc::new(Child {
            pid,
            name: program.name(),
            kill_grace,
            ready: AtomicBool::new(false),
            answered: AtomicBool::new(false),
            ending: Mutex::new(()),
            input: Mutex::new(Input {
                pipe: Some(Arc::clone(&stdin)),
                pending: Vec::new(),
                behind: false,
                writing: false,
                closing: false,
            }),
            input_waiting: Condvar::new(),
            held: Mutex::new(Held {
                ended: false,
                tasks: HashMap::new(),
            }),
            process: Mutex::new(Reaped {
                process,
                status: None,
            }),
            stderr_tail: Arc::new(Mutex::new(Tail::default())),
            stderr_reading: Mutex::new(Some(stderr.as_raw_fd())),
            stderr_closed: Mutex::new(stderr_closed),
            events,
        });
        let started = nonblocking
            .and_then(|()| {
                let writer = Arc::clone(&child);
                std::thread::Builder::new()
                    .name("kmq-exec-input".into())
                    .spawn(move || writer.write_pending(&stdin))
            })
            .and_then(|_| {
                let reader = Arc::clone(&child);
                std::thread::Builder::new()
                    .name("kmq-exec-output".into())
                    .spawn(move || reader.read_output(stdout))
            })
            .and_then(|_| {
                let copier = Arc::clone(&child);
                std::thread::Builder::new()
                    .name("kmq-exec-stderr".into())
                    .spawn(move || {
                        copier.copy_stderr(stderr);
                        let _ = closed.send(());
                    })
            });
        if let Err(error) = started {
            // Not through `end`: the pool is not told about a child it never had (and holds its lock now).
            lock(&child.held).ended = true;
            lock(&child.input).pipe = None;
            child.input_waiting.notify_one();
            let mut reaped = lock(&child.process);
            process::kill_group(pid);
            reaped.status = Some(reaped.process.wait());
            return Err(error);
        }
        Ok(child)
    }

    /// Hands a task line over; the answer back when the child has ended (nothing is handed to it any more).
    pub fn submit(&self, id: &str, line: Vec<u8>, answer: Answer) -> Result<(), Answer> {
        {
            let mut held = lock(&self.held);
            if held.ended {
                return Err(answer);
            }
            held.tasks.insert(id.to_string(), answer);
        }
        self.write_line(&line);
        Ok(())
    }

    /// Sends a task's outcome where it goes, after telling the pool its slot is free. No lock of the child is
    /// held: a started task's completion runs the daemon's code.
    pub fn reply(&self, answer: Answer, outcome: Outcome) {
        (self.events)(self.pid, Event::Settled);
        match answer.reply {
            Reply::Worker(sender) => {
                let _ = sender.send(outcome);
            }
            Reply::Started(done) => done.complete(outcome),
        }
    }

    /// The tasks it holds that are past their deadline, or started and cancelled by the daemon.
    pub fn due(&self, now: Instant) -> Vec<(String, Due)> {
        lock(&self.held)
            .tasks
            .iter()
            .filter_map(|(id, answer)| {
                if answer.deadline.is_some_and(|deadline| now >= deadline) {
                    Some((id.clone(), Due::TimedOut))
                } else if matches!(&answer.reply, Reply::Started(done) if done.is_cancelled()) {
                    Some((id.clone(), Due::Cancelled))
                } else {
                    None
                }
            })
            .collect()
    }

    /// Writes `line` into the child's input, or queues what the pipe does not take for the `kmq-exec-input`
    /// thread; never waits for the child to read. An input that broke drops it: the child's end fails the task.
    fn write_line(&self, line: &[u8]) {
        let mut input = lock(&self.input);
        let Some(pipe) = input.pipe.clone() else {
            return;
        };
        input.pending.extend_from_slice(line);
        if input.behind || input.writing {
            // Whoever writes takes this line along with its own.
            return;
        }
        // This worker writes, outside the lock: the others append behind it meanwhile and go on, rather than
        // wait for the lock through a system call (which wakes the child, which may take this core).
        input.writing = true;
        let mut chunk = Vec::new();
        for round in 1.. {
            if round > WRITE_ROUNDS {
                // Others keep appending: the `kmq-exec-input` thread takes over, and this worker waits for its
                // answer (and its cancel) again.
                input.behind = true;
                break;
            }
            std::mem::swap(&mut chunk, &mut input.pending);
            drop(input);
            let written = write_some(&pipe, &chunk);
            input = lock(&self.input);
            match written {
                Ok(n) if n == chunk.len() => {
                    chunk.clear();
                    if input.pending.is_empty() {
                        break;
                    }
                }
                Ok(n) => {
                    // The pipe is full: the rest, then what came meanwhile, for the `kmq-exec-input` thread.
                    chunk.drain(..n);
                    chunk.extend_from_slice(&input.pending);
                    input.pending = chunk;
                    input.behind = true;
                    break;
                }
                Err(_) => {
                    input.pipe = None;
                    input.pending.clear();
                    break;
                }
            }
        }
        input.writing = false;
        if input.behind || input.closing || input.pipe.is_none() {
            self.input_waiting.notify_one();
        }
    }

    /// Closes the child's input once what is pending is written (the `kmq-exec-input` thread closes it).
    fn close_input(&self) {
        lock(&self.input).closing = true;
        self.input_waiting.notify_one();
    }

    /// The `kmq-exec-input` thread: writes what the pipe did not take at once, blocking, until the input is to
    /// close (then closes it once no worker writes: the last reference to the pipe is this thread's) or breaks.
    fn write_pending(&self, pipe: &File) {
        let mut chunk = Vec::new();
        let mut input = lock(&self.input);
        loop {
            if input.pipe.is_none() {
                return;
            }
            if input.behind && !input.pending.is_empty() {
                std::mem::swap(&mut chunk, &mut input.pending);
                drop(input);
                let written = write_waiting(pipe, &chunk);
                chunk.clear();
                input = lock(&self.input);
                if !written {
                    input.pipe = None;
                    input.pending.clear();
                    return;
                }
                continue;
            }
            input.behind = false;
            if input.closing && !input.writing && input.pending.is_empty() {
                input.pipe = None;
                return;
            }
            input = self
                .input_waiting
                .wait(input)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Takes a task back before its answer came; `None` when its outcome is already on its way.
    pub fn withdraw(&self, id: &str) -> Option<Answer> {
        lock(&self.held).tasks.remove(id)
    }

    /// Whether it ever answered a task (a malformed answer too: it read the task and wrote back).
    pub fn has_answered(&self) -> bool {
        self.answered.load(Ordering::SeqCst)
    }

    /// Whether it may be handed the task `id`: it has not ended, and holds no task of that id (the protocol
    /// names tasks by id).
    pub fn can_take(&self, id: &str) -> bool {
        let held = lock(&self.held);
        !held.ended && !held.tasks.contains_key(id)
    }

    /// Whether the process has exited (or was reaped by [`Child::end`]).
    pub fn has_exited(&self) -> bool {
        let reaped = lock(&self.process);
        reaped.status.is_some() || process::has_exited(self.pid).unwrap_or(true)
    }

    /// Its resident memory, in bytes (`VmRSS` of /proc/PID/status); `None` once it is gone.
    pub fn rss(&self) -> Option<u64> {
        let reaped = lock(&self.process);
        if reaped.status.is_some() {
            return None;
        }
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// Stops and reaps the child, then fails the tasks it held (retry, with why it ended and the tail of its
    /// standard error) and tells the pool. Runs once: a second call returns `None`; the first returns the
    /// child's end as `(status, stderr tail)`.
    pub fn end(&self, cause: Cause) -> Option<(String, String)> {
        let _ending = lock(&self.ending);
        let tasks = {
            let mut held = lock(&self.held);
            if held.ended {
                return None;
            }
            held.ended = true;
            std::mem::take(&mut held.tasks)
        };
        // The writer thread ends once it has written what was queued, closing the child's standard input.
        self.close_input();
        let status = {
            let mut reaped = lock(&self.process);
            match &cause {
                Cause::Stop => {
                    if !self.exits_within(self.kill_grace) {
                        process::terminate_group(self.pid);
                        self.exits_within(self.kill_grace);
                    }
                }
                Cause::Killed(_) => {
                    process::terminate_group(self.pid);
                    self.exits_within(self.kill_grace);
                }
                Cause::Exited | Cause::Protocol(_) | Cause::BadHello(_) | Cause::NoHello(_) => {}
            }
            // Whatever is left of the group: the child itself, or what it started.
            process::kill_group(self.pid);
            let status = reaped.process.wait();
            let text = status_text(&status);
            reaped.status = Some(status);
            text
        };
        let _ = lock(&self.stderr_closed).recv_timeout(DRAIN_BOUND);
        let tail = lock(&self.stderr_tail).text();
        let pid = self.pid;
        let head = match &cause {
            Cause::Exited => format!("exec: handler process {pid} exited ({status})"),
            Cause::Protocol(problem) => format!(
                "exec: handler process {pid} wrote a line that is not an answer ({problem}); restarted"
            ),
            Cause::BadHello(problem) => {
                format!("exec: handler process {pid} is not ready: {problem}; killed")
            }
            Cause::NoHello(within) => format!(
                "exec: handler process {pid} wrote no hello line within {}; killed",
                humantime::format_duration(*within)
            ),
            Cause::Killed(why) => format!("exec: handler process {pid} was killed: {why}"),
            Cause::Stop => format!("exec: handler process {pid} was stopped ({status})"),
        };
        let reason = with_tail(head, &tail);
        let planned = matches!(cause, Cause::Stop | Cause::Killed(_));
        if !planned && self.ready.load(Ordering::SeqCst) {
            kmq_plugin::log_line(&format!("kmq-exec: {}[{pid}]: {reason}", self.name));
        }
        // The pool first: once a task's worker has its outcome, this child is no longer among the pool's.
        (self.events)(
            pid,
            Event::Ended {
                ready: self.ready.load(Ordering::SeqCst),
                planned,
                reason: reason.clone(),
            },
        );
        for (_, answer) in tasks {
            self.reply(answer, Outcome::retry(reason.clone()));
        }
        Some((status, tail))
    }

    /// What its standard error ended with so far.
    pub fn stderr_tail(&self) -> String {
        lock(&self.stderr_tail).text()
    }

    /// Polls (without reaping) until the child exits; false if it is still running after `within`.
    fn exits_within(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if process::has_exited(self.pid).unwrap_or(true) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The `kmq-exec-output` thread: the hello, then answers, until the child's output ends or breaks the
    /// protocol.
    fn read_output(&self, stdout: impl Read) {
        let mut reader = BufReader::with_capacity(64 << 10, Counted::new(stdout));
        let mut line = Vec::new();
        loop {
            line.clear();
            let reads = reader.get_ref().reads;
            match reader
                .by_ref()
                .take(protocol::MAX_LINE)
                .read_until(b'\n', &mut line)
            {
                Ok(0) | Err(_) => {
                    self.end(Cause::Exited);
                    return;
                }
                Ok(_) if line.last() != Some(&b'\n') && line.len() as u64 >= protocol::MAX_LINE => {
                    self.end(Cause::Protocol(format!(
                        "a line longer than {} bytes",
                        protocol::MAX_LINE
                    )));
                    return;
                }
                Ok(_) => {}
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if !self.ready.load(Ordering::SeqCst) {
                match protocol::check_hello(&line) {
                    Ok(()) => {
                        self.ready.store(true, Ordering::SeqCst);
                        (self.events)(self.pid, Event::Ready);
                    }
                    Err(problem) => {
                        self.end(Cause::BadHello(problem));
                        return;
                    }
                }
                continue;
            }
            // Once per read from the pipe, not per answer: the answers a read brought were all written after
            // whatever standard error had before that read.
            if reader.get_ref().reads != reads {
                self.catch_up_stderr();
            }
            match protocol::parse_answer(&line) {
                Line::Answer { id, outcome } => self.deliver(&id, outcome),
                Line::Bad { id, problem } => self.deliver(
                    &id,
                    Outcome::fail(format!(
                        "exec: the handler's answer is malformed: {problem}"
                    )),
                ),
                Line::Progress {
                    id,
                    fraction,
                    message,
                } => self.progress(&id, fraction, &message),
                Line::BadProgress { id, problem } => kmq_plugin::log_line(&format!(
                    "kmq-exec: {}[{}]: a malformed progress line for task {id:?} ({problem}); ignored",
                    self.name, self.pid
                )),
                Line::Foreign { problem } => {
                    self.end(Cause::Protocol(problem));
                    return;
                }
            }
        }
    }

    /// Hands a task's progress report to the host, if the child holds the task. A task run through `handle`
    /// (a host without `start`) has no run handle here: its reports are dropped.
    fn progress(&self, id: &str, fraction: f32, message: &str) {
        let held = lock(&self.held);
        match held.tasks.get(id) {
            Some(Answer {
                reply: Reply::Started(done),
                ..
            }) => done.progress(fraction, message),
            Some(_) => {}
            None => kmq_plugin::log_line(&format!(
                "kmq-exec: {}[{}]: a progress line for task {id:?}, which it does not hold; ignored",
                self.name, self.pid
            )),
        }
    }

    fn deliver(&self, id: &str, outcome: Outcome) {
        let answer = lock(&self.held).tasks.remove(id);
        match answer {
            Some(answer) => {
                self.answered.store(true, Ordering::SeqCst);
                self.reply(answer, outcome);
            }
            // A task it does not hold (already cancelled, or never given): nothing to settle.
            None => kmq_plugin::log_line(&format!(
                "kmq-exec: {}[{}]: an answer for task {id:?}, which it does not hold; ignored",
                self.name, self.pid
            )),
        }
    }

    /// Waits until the stderr thread has copied everything the child wrote to standard error so far: what it
    /// wrote before an answer is then logged while the answer's task is still held. Bounded: a child that writes
    /// standard error without pause delays its answers by at most [`CATCH_UP_BOUND`].
    fn catch_up_stderr(&self) {
        let deadline = Instant::now() + CATCH_UP_BOUND;
        loop {
            {
                let reading = lock(&self.stderr_reading);
                match *reading {
                    Some(fd) if process::unread_bytes(fd) > 0 => {}
                    _ => return,
                }
            }
            if Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// The `kmq-exec-stderr` thread: each line to the daemon's standard error, naming the tasks held.
    fn copy_stderr(&self, mut stderr: impl Read + AsRawFd) {
        let fd = stderr.as_raw_fd();
        let mut chunk = [0u8; 8192];
        let mut partial = Vec::new();
        loop {
            process::wait_readable(fd);
            let mut reading = lock(&self.stderr_reading);
            let n = match stderr.read(&mut chunk) {
                Ok(0) => 0,
                Ok(n) => n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => 0,
            };
            if n == 0 {
                // Closed before the pipe is dropped (on return): nobody asks about its descriptor any more.
                *reading = None;
                if !partial.is_empty() {
                    self.copy_line(&partial);
                }
                return;
            }
            lock(&self.stderr_tail).push(&chunk[..n]);
            partial.extend_from_slice(&chunk[..n]);
            let mut start = 0;
            while let Some(end) = partial[start..].iter().position(|b| *b == b'\n') {
                self.copy_line(&partial[start..start + end]);
                start += end + 1;
            }
            partial.drain(..start);
            if partial.len() > 64 << 10 {
                // A "line" this long without a newline: copy it as it is, rather than hold it.
                self.copy_line(&partial);
                partial.clear();
            }
            drop(reading);
        }
    }

    fn copy_line(&self, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end();
        let tasks: Vec<String> = lock(&self.held).tasks.keys().cloned().collect();
        let during = match tasks.as_slice() {
            [] => String::new(),
            [one] => format!(" task {one}"),
            many => format!(" tasks {}", many.join(", ")),
        };
        kmq_plugin::log_line(&format!(
            "kmq-exec: {}[{}]{during}: {text}",
            self.name, self.pid
        ));
    }
}

/// A reader that counts its reads, so that its [`BufReader`] tells when a line took a read from the pipe.
struct Counted<R> {
    inner: R,
    reads: u64,
}

impl<R> Counted<R> {
    fn new(inner: R) -> Counted<R> {
        Counted { inner, reads: 0 }
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reads += 1;
        self.inner.read(buf)
    }
}

/// `head: tail`, or `head` when the tail is empty.
pub fn with_tail(head: String, tail: &str) -> String {
    if tail.is_empty() {
        head
    } else {
        format!("{head}: {tail}")
    }
}

/// Writes what the non-blocking `pipe` takes of `bytes` without waiting: all of it, or less when it is full.
fn write_some(pipe: &File, bytes: &[u8]) -> io::Result<usize> {
    let mut written = 0;
    while written < bytes.len() {
        match (&*pipe).write(&bytes[written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => written += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
            Err(error) => return Err(error),
        }
    }
    Ok(written)
}

/// Writes all of `bytes` into the non-blocking `pipe`, waiting while it is full; false when it broke.
fn write_waiting(pipe: &File, mut bytes: &[u8]) -> bool {
    while !bytes.is_empty() {
        match (&*pipe).write(bytes) {
            Ok(n) if n > 0 => bytes = &bytes[n..],
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                process::wait_writable(pipe.as_raw_fd());
            }
            Ok(_) | Err(_) => return false,
        }
    }
    true
}

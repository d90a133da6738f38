//! The checks: conservation on atomic snapshots of Redis, the running counts (the limited queue's, the typed
//! queue's `slow` type's) sampled throughout, and, from the run records, the run budget of every task and the runs
//! of a limit at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::RedisServer;

use super::faults::Kind;
use super::ledger::{Facts, Ledger, Pushed, Run};
use kmqd::broker::keys::{group_scope, type_scope};

use super::workload::{
    GROUPS, HOLDS_AT_MOST_MS, Mode, POPPED_HELD_MAX, Queue, RETRY_TIMES, SLOW, Shape, TEST, Work,
};
use super::world::{Event, SLACK_US, What, World, lock, now_us, rel};

/// One atomic look at a queue's keys (ARGV[1]: `kmq:{queue}`): the tasks in each place (a type's or a group's
/// flows count as ready, as `kmqd stats` counts them: they wait, they are not lost), the counters, the running
/// count of the scope ARGV[2] (`q`, or a type's `t:TYPE`) and what it must equal, then the same pair for each
/// further scope ARGV[3..] (a group's `g:GROUP`).
pub(super) const SNAPSHOT: &str = r"
local base = ARGV[1]
local function sum(pattern, command)
  local n = 0
  for _, key in ipairs(redis.call('KEYS', pattern)) do
    n = n + redis.call(command, key)
  end
  return n
end
-- What the owners hold: each claim set's scores (a claim's tasks not yet settled); claim lists and their bitmaps,
-- which match the same pattern, are counted through their set.
local function held()
  local n = 0
  for _, key in ipairs(redis.call('KEYS', base .. ':processing:*')) do
    if redis.call('TYPE', key).ok == 'zset' then
      local scored = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
      for j = 2, #scored, 2 do n = n + tonumber(scored[j]) end
    end
  end
  return n
end
-- The positions not yet settled of the runs counted in `scope`: claim.lua writes a scopes string beside each list
-- it takes under a limit, a line `N SCOPE...` per run of the list in position order (`N q` alone without type
-- limits); a run's unsettled positions are its size less the bits set in its range of the list's bitmap.
local function counted(scope)
  local n = 0
  for _, key in ipairs(redis.call('KEYS', base .. ':processing:*')) do
    if redis.call('TYPE', key).ok == 'zset' then
      for _, claim in ipairs(redis.call('ZRANGE', key, 0, -1)) do
        local list = key .. ':' .. claim
        local from = 0
        for line in string.gmatch(redis.call('GET', list .. ':scopes') or '', '[^\n]+') do
          local size, named = string.match(line, '^(%d+) ?(.*)$')
          size = tonumber(size)
          if string.find(' ' .. named .. ' ', ' ' .. scope .. ' ', 1, true) then
            n = n + size - redis.call('BITCOUNT', list .. ':settled', from, from + size - 1, 'BIT')
          end
          from = from + size
        end
      end
    end
  end
  return n
end
local function counter(name)
  return tonumber(redis.call('HGET', base .. ':stats', name) or '0')
end
local function running(scope)
  return tonumber(redis.call('HGET', base .. ':running', scope) or '0')
end
local out = {
  sum(base .. ':ready:*', 'LLEN') + sum(base .. ':flow:*', 'LLEN'), sum(base .. ':quarantine:*', 'LLEN'), held(),
  sum(base .. ':delayed:*', 'ZCARD'), sum(base .. ':retry:*', 'ZCARD'), redis.call('LLEN', base .. ':dead'),
  counter('pushed'), counter('done'), counter('cancelled'),
  running(ARGV[2]), counted(ARGV[2]), counter('running_underflow')
}
for i = 3, #ARGV do
  out[#out + 1] = running(ARGV[i])
  out[#out + 1] = counted(ARGV[i])
end
return out
";

/// What was seen of a running count while the suite ran (the limited queue's `q`, the typed queue's `t:slow`).
#[derive(Default)]
pub(super) struct LimitWatch {
    /// Samples of the count (every 20 ms), how many found it at its bound, and the most seen.
    pub(super) samples: u64,
    pub(super) at_limit: u64,
    pub(super) most: u64,
    /// The most `running_underflow` seen (it must stay 0).
    pub(super) underflow: u64,
    /// Atomic snapshots that compared the count with the unsettled positions of the counted claim lists.
    pub(super) exact: u64,
    /// The count and `running_underflow` once every daemon stopped.
    pub(super) at_rest: (Option<i64>, Option<i64>),
    /// The queue's `done` counter, and when it was seen to grow (µs): a limited queue stuck shows as a long gap.
    pub(super) done: Option<u64>,
    pub(super) completions: Vec<u64>,
    /// Every sample of the count: (µs, count).
    pub(super) series: Vec<(u64, u64)>,
}

/// One atomic look at a queue (the [`SNAPSHOT`] script).
#[derive(Clone, Copy, Debug)]
pub(super) struct Snapshot {
    pub(super) ready: i64,
    pub(super) quarantine: i64,
    pub(super) processing: i64,
    pub(super) delayed: i64,
    pub(super) retry: i64,
    pub(super) dead: i64,
    pub(super) pushed: i64,
    pub(super) done: i64,
    pub(super) cancelled: i64,
    /// The count (`running` field `q`, or the queue's counted type's), the unsettled positions of the claim lists
    /// counted in it, and `running_underflow`.
    pub(super) running: i64,
    pub(super) counted: i64,
    pub(super) underflow: i64,
    /// On the grouped queue, each group's count (`g:GROUP`, [`GROUPS`] in order) and the unsettled positions of
    /// the runs counted in it; zeros on the other queues.
    pub(super) groups: [(i64, i64); GROUPS.len()],
    /// On the grouped queue, the same pair for its limited type beside the groups (`t:slow`); zeros elsewhere.
    pub(super) slow: (i64, i64),
}

pub(super) fn snapshot(
    connection: &mut impl redis::ConnectionLike,
    queue: Queue,
) -> redis::RedisResult<Snapshot> {
    let scope = queue.counted().map_or("q", |(scope, _)| scope);
    let script = redis::Script::new(SNAPSHOT);
    let mut invocation = script.prepare_invoke();
    invocation.arg(queue.base()).arg(scope);
    if queue == Queue::Grouped {
        for group in GROUPS {
            invocation.arg(group_scope(group));
        }
        invocation.arg(type_scope(SLOW));
    }
    let parts: Vec<i64> = invocation.invoke(connection)?;
    let mut groups = [(0, 0); GROUPS.len()];
    let mut slow = (0, 0);
    if queue == Queue::Grouped {
        for (n, pair) in groups.iter_mut().enumerate() {
            *pair = (parts[12 + 2 * n], parts[13 + 2 * n]);
        }
        let at = 12 + 2 * GROUPS.len();
        slow = (parts[at], parts[at + 1]);
    }
    let [
        ready,
        quarantine,
        processing,
        delayed,
        retry,
        dead,
        pushed,
        done,
        cancelled,
        running,
        counted,
        underflow,
    ] = parts[..12]
    else {
        panic!("the snapshot script returns twelve numbers and a pair a further scope: {parts:?}");
    };
    Ok(Snapshot {
        ready,
        quarantine,
        processing,
        delayed,
        retry,
        dead,
        pushed,
        done,
        cancelled,
        running,
        counted,
        underflow,
        groups,
        slow,
    })
}

impl World<'_> {
    /// Checks conservation on one atomic snapshot of the queue's keys (a script: nothing moves while it runs):
    /// every task pushed since Redis last came back empty is ready, quarantined, processing (under any owner,
    /// registered or not), delayed, waiting to retry, dead, done or cancelled; in default mode, or popped (in a
    /// daemon's memory, or lost with it), so Redis holds at most what was pushed, and after Redis lost its data at
    /// most [`POPPED_HELD_MAX`] more: the tasks the daemons held then, settled since into a Redis that never
    /// counted their push (in safe mode their owners' settles are fenced off). For a queue with a running count
    /// checked throughout (the limited queue, the typed one), also that count (see [`World::check_count`]).
    pub(super) fn check_conservation(&self, redis: &RedisServer, queue: Queue, when: &str) {
        let snap = match snapshot(&mut redis.connection(), queue) {
            Ok(snap) => snap,
            Err(error) => {
                self.violation(format!(
                    "the conservation snapshot of {} failed {when}: {error}",
                    queue.name()
                ));
                return;
            }
        };
        self.count("conservation snapshots");
        let Snapshot {
            ready,
            quarantine,
            processing,
            delayed,
            retry,
            dead,
            pushed,
            done,
            cancelled,
            ..
        } = snap;
        let held = ready + quarantine + processing + delayed + retry + dead + done + cancelled;
        let balanced = match queue.mode() {
            Mode::Safe => held == pushed,
            Mode::Default if self.epoch.load(Ordering::SeqCst) == 0 => held <= pushed,
            Mode::Default => held <= pushed + POPPED_HELD_MAX,
        };
        if !balanced {
            self.violation(format!(
                "conservation of {} ({:?} mode) {when}: pushed {pushed}, held {held}: ready {ready} + quarantined {quarantine} + \
                 processing {processing} + delayed {delayed} + retrying {retry} + dead {dead} + done {done} + cancelled \
                 {cancelled}",
                queue.name(),
                queue.mode()
            ));
        }
        if queue.counted().is_some() {
            self.check_count(queue, &snap, when);
        }
        if queue == Queue::Grouped {
            self.check_group_counts(&snap, when);
        }
    }

    /// What was seen of the running count of `queue` (one of those [`Queue::counted`] names).
    pub(super) fn with_watch<R>(&self, queue: Queue, f: impl FnOnce(&mut LimitWatch) -> R) -> R {
        match queue {
            Queue::Typed => f(&mut lock(&self.typed).count),
            Queue::Grouped => f(&mut lock(&self.grouped).queue),
            _ => f(&mut lock(&self.watch)),
        }
    }

    /// The invariant of a running limit on one atomic snapshot: the count equals the unsettled positions of the
    /// runs of claim lists counted in it, is at most the largest limit in use, and no settle took it below 0.
    pub(super) fn check_count(&self, queue: Queue, snap: &Snapshot, when: &str) {
        let Some((scope, bound)) = queue.counted() else {
            return;
        };
        self.with_watch(queue, |watch| watch.exact += 1);
        if snap.running != snap.counted || snap.running > bound as i64 || snap.running < 0 {
            self.violation(format!(
                "{}'s running count {scope} {when}: {} in Redis, {} unsettled positions of claim lists counted in \
                 it (bound {bound}); {snap:?}",
                queue.name(),
                snap.running,
                snap.counted
            ));
        }
        self.check_underflow(queue, snap.underflow as u64, when);
    }

    /// `running_underflow` of a queue with a running limit must stay 0; a new value is a violation once.
    pub(super) fn check_underflow(&self, queue: Queue, underflow: u64, when: &str) {
        let risen = self.with_watch(queue, |watch| {
            let risen = underflow > watch.underflow;
            watch.underflow = watch.underflow.max(underflow);
            risen
        });
        if risen {
            self.violation(format!(
                "{}'s running_underflow is {underflow} {when}: a settle would have taken a count below 0",
                queue.name()
            ));
        }
    }
}

/// Samples, every 20 ms on a direct connection: jobs' `done` counter, recording when it grew; each running count
/// checked throughout ([`Queue::counted`]: the limited queue's, the typed queue's `slow`'s) and its queue's
/// `running_underflow`, each sample checked against the bound; what the typed queue's limits hold back
/// ([`World::sample_types`]); each group's count of the grouped queue ([`World::sample_groups`]); and every 25th
/// time an atomic snapshot of each such queue, its counts checked against its claim lists (a failed read, Redis
/// being down or stalled, is read again).
pub(super) fn sample(world: &World<'_>, url: &str) {
    let mut connection: Option<redis::Connection> = None;
    let mut last: Option<u64> = None;
    let mut turn: u64 = 0;
    while world.running.load(Ordering::SeqCst) {
        turn += 1;
        world.sampler_turn(now_us());
        if connection.is_none() {
            connection = redis::Client::open(url)
                .and_then(|client| client.get_connection_with_timeout(Duration::from_millis(500)))
                .ok();
            if let Some(connection) = &connection {
                let _ = connection.set_read_timeout(Some(Duration::from_millis(500)));
            }
        }
        if let Some(conn) = connection.as_mut() {
            let done: redis::RedisResult<Option<u64>> = redis::cmd("HGET")
                .arg("kmq:{jobs}:stats")
                .arg("done")
                .query(conn);
            match done {
                Ok(done) => {
                    let done = done.unwrap_or(0);
                    if last.is_some_and(|last| last != done) && done != 0 {
                        lock(&world.completions).push(now_us());
                    }
                    last = Some(done);
                }
                Err(_) => connection = None,
            }
        }
        for queue in Queue::ALL {
            if let Some(conn) = connection.as_mut() {
                if world.sample_count(conn, queue).is_err() {
                    connection = None;
                }
            }
        }
        if let Some(conn) = connection.as_mut() {
            if world.sample_types(conn).is_err() {
                connection = None;
            }
        }
        if let Some(conn) = connection.as_mut() {
            if world.sample_groups(conn).is_err() {
                connection = None;
            }
        }
        if turn % 25 == 0 {
            for queue in Queue::ALL
                .into_iter()
                .filter(|queue| queue.counted().is_some() || *queue == Queue::Grouped)
            {
                if let Some(conn) = connection.as_mut() {
                    match snapshot(conn, queue) {
                        Ok(snap) if queue == Queue::Grouped => {
                            world.check_group_counts(&snap, "in a sample")
                        }
                        Ok(snap) => world.check_count(queue, &snap, "in a sample"),
                        Err(_) => connection = None,
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl World<'_> {
    /// One sample of the running count of `queue`, if it has one checked throughout ([`Queue::counted`]), and of
    /// its `running_underflow` and `done`: the count is checked against its bound (above it, or below 0, is a
    /// violation).
    fn sample_count(&self, conn: &mut redis::Connection, queue: Queue) -> redis::RedisResult<()> {
        let Some((scope, bound)) = queue.counted() else {
            return Ok(());
        };
        let base = queue.base();
        let (running, underflow, done): (Option<i64>, Option<u64>, Option<u64>) = redis::pipe()
            .cmd("HGET")
            .arg(format!("{base}:running"))
            .arg(scope)
            .cmd("HGET")
            .arg(format!("{base}:stats"))
            .arg("running_underflow")
            .cmd("HGET")
            .arg(format!("{base}:stats"))
            .arg("done")
            .query(conn)?;
        let running = running.unwrap_or(0);
        let at = now_us();
        self.with_watch(queue, |watch| {
            watch.samples += 1;
            let done = done.unwrap_or(0);
            if watch.done.is_some_and(|last| last != done) && done != 0 {
                watch.completions.push(at);
            }
            watch.done = Some(done);
            watch.most = watch.most.max(running.max(0) as u64);
            watch.series.push((at, running.max(0) as u64));
            if running == bound as i64 {
                watch.at_limit += 1;
            }
        });
        if running > bound as i64 || running < 0 {
            self.violation(format!(
                "{}'s running count {scope} is {running}, outside 0 to its largest limit {bound}",
                queue.name()
            ));
        }
        self.check_underflow(queue, underflow.unwrap_or(0), "in a sample");
        Ok(())
    }
}

/// The run budget, from kmqd's documented rules (docs/RELIABILITY.md, "Outcomes" and "Poison pills"):
///
/// - a run that fails (handler error, execution timeout) or a crash while the task ran alone is *charged*: the
///   task's next run has `attempt + 1`, and it is dead-lettered once `attempt == retry_times`, so the attempt
///   numbers of its runs stay within `0..=retry_times`: at most `retry_times + 1` charged runs;
/// - a task merely held by a daemon that lost it (killed, crashed by a neighbour, paused past its lease, stopped
///   past `shutdown_grace`, or whose lease Redis lost in a restart, a stall or a data loss) comes back
///   *uncharged*: it may run again with the same attempt number, once per such loss;
/// - a push whose reply was lost may have queued the task anyway: each such copy has a budget of its own;
/// - in default mode (at most once) a task is never handed back once it ran, whatever happens to its daemon: only
///   Redis losing or rewinding its writes brings it back (see [`Mode`]).
///
/// So the bound is `runs <= (retry_times + 1) * copies + losses`, which grows with the kills: checked in its
/// stronger, per-run form: every attempt number is at most `retry_times`, and every run of a task at an attempt
/// number it already ran at must follow an event that took the previous such run from the daemon that ran it
/// (an [`Event`] that [`Event::explains`] it for the task's mode), except at most one such run per possibly
/// duplicated push. A run again without such a cause is an **over-run**.
pub(super) struct RunCheck {
    /// Tasks with an unexplained run.
    pub(super) over_runs: Vec<String>,
    /// Runs at an attempt number above retry_times.
    pub(super) over_attempts: Vec<String>,
    /// Repeated runs by the event that explains them (those of a default-mode queue marked so).
    pub(super) causes: BTreeMap<String, u64>,
    /// The most runs of one task.
    pub(super) max_runs: usize,
    /// Tasks run more than once.
    pub(super) rerun_tasks: usize,
    /// Tasks run more than retry_times + 1 times (allowed by the rules above when losses explain it).
    pub(super) past_naive_bound: usize,
    /// Runs again explained only by the kmqd defect [`zombie_wake_up`] describes.
    pub(super) zombie_wake_ups: Vec<String>,
    /// Runs at an attempt number the task had already run at, and the tasks with such runs.
    pub(super) same_attempt_runs: usize,
    pub(super) same_attempt_tasks: usize,
    /// Of those, the runs of a default-mode queue's tasks.
    pub(super) at_most_once_repeats: usize,
}

pub(super) fn check_runs(
    t0_us: u64,
    facts: &Facts,
    ledger: &Ledger,
    events: &[Event],
    instances: &[(usize, Shape)],
) -> RunCheck {
    let mut check = RunCheck {
        over_runs: Vec::new(),
        over_attempts: Vec::new(),
        causes: BTreeMap::new(),
        max_runs: 0,
        rerun_tasks: 0,
        past_naive_bound: 0,
        zombie_wake_ups: Vec::new(),
        same_attempt_runs: 0,
        same_attempt_tasks: 0,
        at_most_once_repeats: 0,
    };
    for id in &ledger.order {
        let Some(runs) = facts.runs.get(id) else {
            continue;
        };
        let mut runs = runs.clone();
        runs.sort_by_key(|run| run.start_us);
        check.max_runs = check.max_runs.max(runs.len());
        if runs.len() > 1 {
            check.rerun_tasks += 1;
        }
        if runs.len() > RETRY_TIMES as usize + 1 {
            check.past_naive_bound += 1;
        }
        let duplicates = ledger.tasks[id].maybe_copies as usize;
        let mode = ledger.tasks[id].queue.mode();
        let mut by_attempt: BTreeMap<u32, Vec<Run>> = BTreeMap::new();
        for run in &runs {
            if run.attempt > RETRY_TIMES {
                check
                    .over_attempts
                    .push(format!("{id} ran at attempt {}", run.attempt));
            }
            by_attempt.entry(run.attempt).or_default().push(*run);
        }
        let repeats: usize = by_attempt.values().map(|group| group.len() - 1).sum();
        check.same_attempt_runs += repeats;
        if mode == Mode::Default {
            check.at_most_once_repeats += repeats;
        }
        if repeats > 0 {
            check.same_attempt_tasks += 1;
        }
        for (attempt, group) in &by_attempt {
            let mut unexplained = Vec::new();
            // A run that answered throttle is followed by another at the same attempt, by design: the
            // throttles its process recorded for it explain as many runs after a run of that process (a run
            // cut short by a fault before it could throttle is the fault's).
            let mut throttled: HashMap<usize, usize> = HashMap::new();
            for pair in group.windows(2) {
                let (first, again) = (pair[0], pair[1]);
                let left = throttled.entry(first.instance).or_insert_with(|| {
                    facts
                        .throttles
                        .get(&(id.clone(), *attempt, first.instance))
                        .copied()
                        .unwrap_or(0)
                });
                let event = events.iter().find(|event| {
                    event.explains(mode, first.instance, first.start_us, again.start_us)
                });
                match event {
                    None if *left > 0 => {
                        *left -= 1;
                        *check
                            .causes
                            .entry("handler throttle".to_string())
                            .or_default() += 1;
                    }
                    Some(event) => {
                        let cause = match mode {
                            Mode::Safe => event.label().to_string(),
                            Mode::Default => format!("{} (default mode)", event.label()),
                        };
                        *check.causes.entry(cause).or_default() += 1;
                    }
                    None if mode == Mode::Safe && zombie_wake_up(events, again) => {
                        check.zombie_wake_ups.push(format!(
                            "{id} ran at {} on process #{}, then again at {} on process #{} as it woke from a \
                             pause past its lease",
                            rel(t0_us, first.start_us),
                            first.instance,
                            rel(t0_us, again.start_us),
                            again.instance
                        ));
                    }
                    None => unexplained.push((first, again)),
                }
            }
            let allowed = unexplained.len().min(duplicates);
            if allowed > 0 {
                *check
                    .causes
                    .entry("duplicate push".to_string())
                    .or_default() += allowed as u64;
            }
            if unexplained.len() > duplicates {
                let mut text = format!(
                    "{id} ({:?}, {} possible duplicate pushes) ran again at attempt {attempt} without a cause:",
                    ledger.tasks[id].work, duplicates
                );
                for (first, again) in &unexplained {
                    let (slot, shape) = instances[first.instance];
                    let _ = write!(
                        text,
                        " run at {} on process #{} (daemon {slot}, config {shape:?}) then at {} on process #{}; \
                         events around:",
                        rel(t0_us, first.start_us),
                        first.instance,
                        rel(t0_us, again.start_us),
                        again.instance
                    );
                    let around = events.iter().filter(|event| {
                        event.to_us + 3_000_000 >= first.start_us
                            && event.from_us <= again.start_us + 1_000_000
                    });
                    for event in around {
                        let _ = write!(
                            text,
                            " [{} {}..{} on {:?} {}]",
                            event.label(),
                            rel(t0_us, event.from_us),
                            rel(t0_us, event.to_us),
                            event.instance,
                            event.note
                        );
                    }
                    text.push(';');
                }
                text.push_str(" all its runs:");
                for run in &runs {
                    let _ = write!(
                        text,
                        " [attempt {} at {} on #{}]",
                        run.attempt,
                        rel(t0_us, run.start_us),
                        run.instance
                    );
                }
                check.over_runs.push(text);
            }
        }
    }
    check
}

/// Whether `run` started on a daemon in the second after it woke from a pause past its lease (a zombie).
///
/// Such a run is a violation: a daemon woken after its lease ran out must not start the tasks it had claimed
/// before the pause and that were waiting for a worker (the monitors handed them to other daemons meanwhile). This
/// suite found kmqd doing it, in the milliseconds before its heartbeat found the lease gone; workers now start a
/// safe-mode task only while its lease is surely live (`Ownership::may_start`), and
/// `faults::a_daemon_woken_from_a_pause_past_its_lease_starts_none_of_the_tasks_it_lost` pins it.
pub(super) fn zombie_wake_up(events: &[Event], run: Run) -> bool {
    events.iter().any(|event| {
        event.what == What::Fault(Kind::Zombie)
            && event.instance == Some(run.instance)
            && event.to_us <= run.start_us + SLACK_US
            && run.start_us <= event.to_us + 1_000_000
    })
}

/// What the run records say of a limit: of a running limit, its runs at once ([`check_limit`]); of a rate, its
/// starts within a window ([`check_rate`](super::types::check_rate)).
#[derive(Debug, Default)]
pub(super) struct LimitCheck {
    /// The most runs at once, each counted from its start for as long as it surely held its slot (the most starts
    /// within a window).
    pub(super) most: usize,
    /// When that was first reached (µs).
    pub(super) most_at: u64,
    /// Runs counted, and runs left out because a fault may have taken their daemon's lease meanwhile (starts
    /// left out near a fault).
    pub(super) counted: usize,
    pub(super) excused: usize,
    /// Starts that made more than `bound` runs at once (starts within a window), and the first ten of them with
    /// those runs (of a rate, the first of each stretch of them, ten at most).
    pub(super) over_count: usize,
    pub(super) over: Vec<String>,
}

/// At no instant more than `bound` handlers of the tasks a limit counts (`counts`: the limited queue's, the typed
/// queue's `slow` ones) running, from the run records.
///
/// The records give each run's start (testkit's µs stamp) but not its end, so a run counts from its start for as
/// long as it surely held its slot: its sleep (a run lasts at least that; nothing cancels it earlier but a lost
/// lease, and its execution timeout is longer), at most [`HOLDS_AT_MOST_MS`] (a deaf handler's slot is freed by its
/// execution timeout while it still sleeps); a pill's run, which aborts at once, counts for nothing. A slot is given
/// back only by the settle after the run, so two such stretches that overlap held two slots at once. Runs that a
/// fault may have taken from their daemon meanwhile are left out: those an [`Event`] explains a run again for (its
/// daemon killed, crashed, paused, stopped or its lease lost, or a Redis-wide fault), the same attribution as
/// [`check_runs`]: the monitors give such a run's slot to another daemon while it may still run (RELIABILITY.md,
/// "Running limits").
pub(super) fn check_limit(
    t0_us: u64,
    facts: &Facts,
    ledger: &Ledger,
    events: &[Event],
    bound: usize,
    counts: impl Fn(&Pushed) -> bool,
) -> LimitCheck {
    let mut check = LimitCheck::default();
    // (time, +1 at a start or -1 at an end, run): ends before starts at the same µs.
    let mut edges: Vec<(u64, i8, usize)> = Vec::new();
    let mut runs: Vec<(&str, Run, u64)> = Vec::new();
    for id in &ledger.order {
        let task = &ledger.tasks[id];
        if !counts(task) {
            continue;
        }
        let holds_us = task.sleep_ms.min(HOLDS_AT_MOST_MS) * 1000;
        if holds_us == 0 {
            continue;
        }
        for run in facts.runs.get(id).into_iter().flatten() {
            let end = run.start_us + holds_us;
            if events
                .iter()
                .any(|event| event.explains(Mode::Safe, run.instance, run.start_us, end))
            {
                check.excused += 1;
                continue;
            }
            check.counted += 1;
            edges.push((run.start_us, 1, runs.len()));
            edges.push((end, -1, runs.len()));
            runs.push((id, *run, end));
        }
    }
    edges.sort_by_key(|&(at, delta, _)| (at, delta));
    let mut now: BTreeSet<usize> = BTreeSet::new();
    for (at, delta, run) in edges {
        if delta < 0 {
            now.remove(&run);
            continue;
        }
        now.insert(run);
        if now.len() > check.most {
            check.most = now.len();
            check.most_at = at;
        }
        if now.len() > bound {
            check.over_count += 1;
        }
        if now.len() > bound && check.over.len() < 10 {
            let mut text = format!("{} runs at {}:", now.len(), rel(t0_us, at));
            for &n in &now {
                let (id, run, end) = runs[n];
                let _ = write!(
                    text,
                    " [{id} attempt {} on process #{} {}..{}]",
                    run.attempt,
                    run.instance,
                    rel(t0_us, run.start_us),
                    rel(t0_us, end)
                );
            }
            check.over.push(text);
        }
    }
    check
}

/// The run-budget check itself, on made-up runs: a run again at the same attempt number passes only with a cause
/// (a loss of the daemon that ran it, a Redis-wide fault, or a possibly duplicated push); in default mode only
/// Redis losing or rewinding its writes is one (or a duplicated push).
#[test]
fn the_run_budget_check_flags_runs_again_without_a_cause() {
    let run = |start_us: u64, attempt: u32, instance: usize| Run {
        start_us,
        attempt,
        instance,
    };
    let event = |what: What, instance: Option<usize>, from_us: u64, to_us: u64| Event {
        what,
        instance,
        from_us,
        to_us,
        note: String::new(),
    };
    let mut facts = Facts::default();
    let mut ledger = Ledger::default();
    let tasks: [(&str, u32, Vec<Run>); 10] = [
        // Retried: two attempt numbers, no cause needed.
        (
            "retried",
            0,
            vec![run(1_000_000, 0, 0), run(2_000_000, 1, 1)],
        ),
        // Its daemon was killed after the first run started.
        (
            "killed",
            0,
            vec![run(1_000_000, 0, 0), run(4_000_000, 0, 1)],
        ),
        // Again at the same attempt with nothing in between: an over-run.
        (
            "again",
            0,
            vec![run(10_000_000, 0, 1), run(11_000_000, 0, 2)],
        ),
        // The same, but a push of it may have been applied twice.
        (
            "duplicate",
            1,
            vec![run(10_000_000, 0, 1), run(11_000_000, 0, 2)],
        ),
        // Process 0 was killed, but this ran on process 2: the kill explains nothing here.
        (
            "elsewhere",
            0,
            vec![run(1_000_000, 0, 2), run(4_000_000, 0, 1)],
        ),
        // A Redis stall explains a run again on any daemon.
        (
            "stalled",
            0,
            vec![run(20_000_000, 0, 2), run(23_000_000, 0, 1)],
        ),
        // Recovered from the zombie process 2 and run on process 1, then started by the zombie as it woke.
        (
            "woke",
            0,
            vec![run(31_000_000, 0, 1), run(33_050_000, 0, 2)],
        ),
        // Redis rewound between the two runs: it forgot the settle.
        (
            "rewound",
            0,
            vec![run(39_500_000, 0, 0), run(41_000_000, 0, 1)],
        ),
        // In default mode the same: at most once does not hold across a rewind.
        (
            "default-rewound",
            0,
            vec![run(39_500_000, 0, 0), run(41_000_000, 0, 1)],
        ),
        // In default mode a kill of the daemon that ran it explains nothing: a popped task never comes back.
        (
            "default-killed",
            0,
            vec![run(1_000_000, 0, 0), run(4_000_000, 0, 1)],
        ),
    ];
    for (id, maybe_copies, runs) in tasks {
        facts.runs.insert(id.to_string(), runs);
        ledger.order.push(id.to_string());
        ledger.tasks.insert(
            id.to_string(),
            Pushed {
                queue: if id.starts_with("default") {
                    Queue::Popped
                } else {
                    Queue::Jobs
                },
                kind: TEST,
                group: None,
                work: Work::Normal,
                level: 1,
                data: "{}".to_string(),
                sleep_ms: 10,
                maybe_copies,
                acked_us: None,
            },
        );
    }
    let events = [
        event(What::Fault(Kind::Kill9), Some(0), 2_000_000, 2_000_000),
        event(What::Fault(Kind::ClientKill), None, 10_500_000, 10_500_000),
        event(What::Fault(Kind::RedisStall), None, 21_000_000, 23_000_000),
        event(What::Fault(Kind::Zombie), Some(2), 29_000_000, 33_000_000),
        event(What::Fault(Kind::RedisRewind), None, 40_000_000, 40_500_000),
    ];
    let instances = [(0, Shape::A), (1, Shape::A), (2, Shape::B)];
    let check = check_runs(0, &facts, &ledger, &events, &instances);
    let flagged: Vec<&str> = check
        .over_runs
        .iter()
        .map(|text| text.split(' ').next().unwrap())
        .collect();
    assert_eq!(
        flagged,
        ["again", "elsewhere", "default-killed"],
        "{:#?}",
        check.over_runs
    );
    let causes: Vec<(&str, u64)> = check
        .causes
        .iter()
        .map(|(cause, n)| (cause.as_str(), *n))
        .collect();
    assert_eq!(
        causes,
        [
            ("duplicate push", 1),
            ("kill -9", 1),
            ("redis rewind (everysec)", 1),
            ("redis rewind (everysec) (default mode)", 1),
            ("redis stall", 1)
        ]
    );
    assert_eq!(
        check.zombie_wake_ups.len(),
        1,
        "{:?}",
        check.zombie_wake_ups
    );
    assert!(check.zombie_wake_ups[0].starts_with("woke "));
    assert_eq!((check.same_attempt_runs, check.same_attempt_tasks), (9, 9));
    assert!(check.over_attempts.is_empty());
}

/// The limit check itself, on made-up runs: runs count from their start for their sleep (a deaf one for at most
/// [`HOLDS_AT_MOST_MS`], a pill not at all), only the limited queue's, and a run a fault may have taken from its
/// daemon is left out.
#[test]
fn the_limit_check_counts_runs_at_once_and_leaves_out_those_a_fault_took() {
    let mut facts = Facts::default();
    let mut ledger = Ledger::default();
    let mut add = |id: &str, queue: Queue, work: Work, sleep_ms: u64, runs: Vec<(u64, usize)>| {
        let runs = runs
            .into_iter()
            .map(|(start_us, instance)| Run {
                start_us,
                attempt: 0,
                instance,
            })
            .collect();
        facts.runs.insert(id.to_string(), runs);
        ledger.order.push(id.to_string());
        ledger.tasks.insert(
            id.to_string(),
            Pushed {
                queue,
                kind: TEST,
                group: None,
                work,
                level: 1,
                data: "{}".to_string(),
                sleep_ms,
                maybe_copies: 0,
                acked_us: None,
            },
        );
    };
    // Four at once, then each start after an end: never more than four.
    for (n, start) in [
        1_000_000, 1_010_000, 1_020_000, 1_030_000, 1_060_000, 1_065_000,
    ]
    .into_iter()
    .enumerate()
    {
        add(
            &format!("a{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(start, n % 3)],
        );
    }
    // Five at once: one start above the bound.
    for n in 0..5 {
        add(
            &format!("b{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(10_000_000 + n * 4_000, 1)],
        );
    }
    // A jobs task and a pill beside them count for nothing.
    add("jobs", Queue::Jobs, Work::Normal, 50, vec![(10_001_000, 0)]);
    add("pill", Queue::Limited, Work::Pill, 0, vec![(10_002_000, 0)]);
    // Five at once, one of them on a daemon killed as it ran: left out.
    for n in 0..4 {
        add(
            &format!("c{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(20_000_000 + n * 1_000, 0)],
        );
    }
    add(
        "killed",
        Queue::Limited,
        Work::Normal,
        50,
        vec![(20_010_000, 2)],
    );
    // A deaf run holds its slot for at most HOLDS_AT_MOST_MS, then four more.
    add(
        "deaf",
        Queue::Limited,
        Work::Deaf,
        3000,
        vec![(30_000_000, 0)],
    );
    for n in 0..4 {
        add(
            &format!("d{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(30_000_000 + HOLDS_AT_MOST_MS * 1000 + n * 1_000, 1)],
        );
    }
    let events = [Event {
        what: What::Fault(Kind::Kill9),
        instance: Some(2),
        from_us: 20_030_000,
        to_us: 20_030_000,
        note: String::new(),
    }];
    let check = check_limit(0, &facts, &ledger, &events, 4, |task| {
        task.queue == Queue::Limited
    });
    assert_eq!(check.over_count, 1, "{:?}", check.over);
    assert!(
        check.over[0].starts_with("5 runs at +10.02s: [b0 "),
        "{:?}",
        check.over
    );
    assert_eq!((check.most, check.most_at), (5, 10_016_000));
    assert_eq!((check.counted, check.excused), (6 + 5 + 4 + 1 + 4, 1));
}

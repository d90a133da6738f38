//! How deep a lane's prefetch is when the config leaves `prefetch` out: adapted to what the lane measures.
//!
//! Little's law says what keeps the workers busy: the tasks waiting for them must last while a freed slot comes
//! back as a waiting task (its settle, then the claim's round trip), so the prefetch must be about the workers'
//! throughput times that lead time. No-op handlers on a busy Redis need thousands; 100 ms handlers a handful,
//! and holding more would only keep tasks from other daemons that have idle workers. Both factors move with the
//! handlers, the host's load and Redis's, so rather than estimate them the fetcher watches their effects, over
//! windows of [`WINDOW`] (and at least one fetch):
//!
//! - **grow**: the live workers spent more than [`IDLE_GROW`] of the window waiting for a task, while Redis had
//!   more (every fetch of the window came back with all it asked for) and the workers had run out (some fetch
//!   came back to find no task left waiting; with tasks left at every one, the idle time was the host's
//!   scheduling, which a deeper prefetch does not cure): the prefetch doubles; it grows
//!   [`MAX_GROWTH`]-fold when the workers were idle more than half the time (the pipeline is far too shallow then,
//!   and the share undercounts: a worker still waiting when the window ends adds its wait later). Starving
//!   workers end a window early, after [`STARVING_WINDOW`], so that a backlog of no-op tasks reaches the bound
//!   within about 10 ms (two windows of 25 ms took a quarter of a 200,000-task drain);
//! - **shrink**: otherwise, the fewest tasks still waiting for a worker when a fetch came back (the low point of
//!   each cycle; over the window, the standing queue, as CoDel calls it: tasks that were claimed early for
//!   nothing) comes off, by half;
//! - **floor**: the shrink stops at [`FLOOR_WORK`] of the window's rate (tasks taken per second), so that a lane
//!   whose workers keep up claims and settles in batches of milliseconds of work rather than whatever its
//!   shortest standing queue was. The floor raises nothing: only starving workers grow the prefetch.
//!
//! The prefetch stays between 1 and `max_held - workers` (0 when `max_held = workers`: the channels are sized for
//! `max_held`); it starts at `workers` (the old fixed default), or lower if `max_held` says so. With a
//! deep backlog of no-op tasks it reaches the bound within a few windows (docs/PERFORMANCE.md, "Defaults that
//! find the speed"). A configured `prefetch` is never changed: the fetcher then has no `Depth`.
//!
//! The cost per task is nothing: the workers add their idle time to one atomic when they find no job (not per
//! task), and the fetcher reads the clock once per fetch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::capacity::Capacity;

/// How long the fetcher watches before it changes the prefetch.
pub const WINDOW: Duration = Duration::from_millis(25);

/// How soon a window may end early, when the workers starve: idle more than half of it, with a backlog.
pub const STARVING_WINDOW: Duration = Duration::from_millis(5);

/// The least work a shrinking prefetch keeps, at the rate the lane's fetches took tasks over the window: however
/// short the standing queue, it does not shrink below this. Each claim then takes at least half of it, and (with
/// the acker's lingers) each settle frees that much: fewer, larger calls, where a busy lane's small ones each cost
/// Redis a script's fixed part and preempt a worker. The floor itself keeps a task waiting here for a worker
/// about this long at most, while another daemon may have an idle one.
pub const FLOOR_WORK: Duration = Duration::from_millis(20);

/// What one window multiplies the prefetch by when the workers were idle more than half of it.
pub const MAX_GROWTH: usize = 16;

/// The share of the workers' time spent waiting for a task, with a backlog in Redis, that makes the prefetch grow.
pub const IDLE_GROW: f64 = 0.02;

/// Time the workers spent waiting for a task, added up (nanoseconds).
#[derive(Debug, Default)]
pub struct IdleTime(AtomicU64);

impl IdleTime {
    /// A worker waited `idle` for a task.
    pub fn add(&self, idle: Duration) {
        self.0.fetch_add(
            u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn total(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The fetcher's controller of an adaptive prefetch.
#[derive(Debug)]
pub struct Depth {
    max: usize,
    /// When the window began, and the workers' idle total then.
    since: Instant,
    idle_at_start: u64,
    /// Whether every fetch of the window took all it asked for; the fewest tasks left waiting when one came back.
    backlog: bool,
    low_water: usize,
    /// Tasks the window's fetches took: over its length, the lane's rate.
    taken: usize,
}

/// What a window decided: the prefetch before and after, and why (for the debug log).
#[derive(Debug, PartialEq)]
pub struct Change {
    pub from: usize,
    pub to: usize,
    /// The workers' idle share of the window.
    pub idle: f64,
    pub low_water: usize,
}

impl Depth {
    /// A controller that keeps the prefetch at most `max`.
    pub fn new(max: usize, idle: &IdleTime, now: Instant) -> Depth {
        Depth::window(max, now, idle.total())
    }

    /// A window that begins at `since`, when the workers' idle total was `idle_at_start`.
    fn window(max: usize, since: Instant, idle_at_start: u64) -> Depth {
        Depth {
            max,
            since,
            idle_at_start,
            backlog: true,
            low_water: usize::MAX,
            taken: 0,
        }
    }

    /// What the window's fetches took in [`FLOOR_WORK`], at the rate they took it over `elapsed`.
    fn work_floor(&self, elapsed: Duration) -> usize {
        let rate = self.taken as f64 / elapsed.as_secs_f64().max(f64::EPSILON);
        (rate * FLOOR_WORK.as_secs_f64()) as usize
    }

    /// One fetch: `waiting` tasks still waited for a worker when it came back, it asked for `asked` and took
    /// `taken`. At the end of a window, sets the capacity's prefetch and says what changed.
    pub fn fetched(
        &mut self,
        capacity: &Capacity,
        idle: &IdleTime,
        (waiting, asked, taken): (usize, usize, usize),
        now: Instant,
    ) -> Option<Change> {
        self.backlog &= asked > 0 && taken >= asked;
        self.low_water = self.low_water.min(waiting);
        self.taken = self.taken.saturating_add(taken);
        let elapsed = now.saturating_duration_since(self.since);
        if elapsed < STARVING_WINDOW {
            return None;
        }
        let idle_ns = idle.total();
        let live = capacity.live_workers().max(1);
        let share = idle_ns.saturating_sub(self.idle_at_start) as f64
            / (live as f64 * elapsed.as_nanos().max(1) as f64);
        // The workers ran out while Redis had more: idle time they spent is the prefetch's doing.
        let ran_dry = self.backlog && self.low_water == 0;
        let starving = ran_dry && share > 0.5;
        if elapsed < WINDOW && !starving {
            return None;
        }
        let from = capacity.prefetch();
        let floor = self.max.min(1);
        let to = if ran_dry && share > IDLE_GROW {
            let growth = if starving { MAX_GROWTH } else { 2 };
            from.max(1).saturating_mul(growth).clamp(floor, self.max)
        } else {
            // Never below the floor of work, nor raised to it: only a starving lane grows.
            let least = from.min(self.work_floor(elapsed));
            from.saturating_sub(self.low_water.div_ceil(2))
                .max(least)
                .clamp(floor, self.max)
        };
        let change = Change {
            from,
            to,
            idle: share,
            low_water: self.low_water,
        };
        *self = Depth::window(self.max, now, idle_ns);
        if to == from {
            return None;
        }
        capacity.set_prefetch(to);
        Some(change)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane's capacity, its workers' idle clock and a controller, on a clock of its own.
    struct Rig {
        capacity: Capacity,
        clock: IdleTime,
        depth: Depth,
        start: Instant,
    }

    impl Rig {
        fn new(workers: usize, prefetch: usize, max: usize) -> Rig {
            let (clock, start) = (IdleTime::default(), Instant::now());
            let depth = Depth::new(max, &clock, start);
            let capacity = Capacity::new(workers, prefetch, 1000);
            Rig {
                capacity,
                clock,
                depth,
                start,
            }
        }

        /// The next window: the workers idle for `idle` in all, and `fetches` (the last one at its end).
        fn window(&mut self, idle: Duration, fetches: &[(usize, usize, usize)]) -> Option<Change> {
            self.clock.add(idle);
            let mut last = None;
            for (i, fetch) in fetches.iter().enumerate() {
                let at = self.start
                    + if i + 1 == fetches.len() {
                        WINDOW
                    } else {
                        Duration::ZERO
                    };
                last = self.depth.fetched(&self.capacity, &self.clock, *fetch, at);
            }
            self.start += WINDOW;
            last
        }

        fn prefetch(&self) -> usize {
            self.capacity.prefetch()
        }
    }

    #[test]
    fn idle_workers_with_a_backlog_grow_the_prefetch_up_to_the_bound() {
        let mut rig = Rig::new(4, 4, 200);
        // 4 workers, each idle for half the window: 50 % idle, every fetch full: double.
        let change = rig.window(WINDOW * 2, &[(0, 8, 8), (0, 8, 8)]);
        assert_eq!(change.map(|c| (c.from, c.to)), Some((4, 8)));
        // 75 % idle: far too shallow.
        rig.window(WINDOW * 3, &[(0, 8, 8)]);
        assert_eq!(rig.prefetch(), 8 * MAX_GROWTH);
        // Idle throughout: never beyond max_held - workers.
        rig.window(WINDOW * 4, &[(0, 8, 8)]);
        assert_eq!(rig.prefetch(), 200);
    }

    #[test]
    fn idle_workers_on_a_drained_queue_do_not_grow_it() {
        let mut rig = Rig::new(4, 4, 20);
        // One fetch of the window took less than it asked for: Redis had no more, prefetching more would not help.
        assert_eq!(rig.window(WINDOW * 4, &[(0, 8, 8), (0, 8, 3)]), None);
        assert_eq!(rig.prefetch(), 4);
    }

    #[test]
    fn a_standing_queue_of_waiting_tasks_is_halved_off_down_to_one() {
        let mut rig = Rig::new(4, 64, 1000);
        // Busy workers (no idle time), and at least 40 tasks waited at every fetch: 20 come off (two tasks taken
        // in the window: 80/s, a floor of work of one task).
        let change = rig.window(Duration::ZERO, &[(50, 1, 1), (40, 1, 1)]);
        assert_eq!(
            change.map(|c| (c.from, c.to, c.low_water)),
            Some((64, 44, 40))
        );
        for _ in 0..20 {
            let waiting = rig.prefetch();
            rig.window(Duration::ZERO, &[(waiting, 1, 1)]);
        }
        assert_eq!(rig.prefetch(), 1, "never below one");
    }

    #[test]
    fn a_standing_queue_comes_off_only_down_to_the_floor_of_work() {
        let mut rig = Rig::new(2, 3000, 4000);
        // Busy workers, 2,000 tasks left waiting at every fetch, 2,000 taken in the window of 25 ms: 80,000/s, of
        // which FLOOR_WORK (20 ms) is 1,600. Half the standing queue would take it to 2,000; the floor allows that.
        let change = rig.window(Duration::ZERO, &[(2000, 1000, 1000), (2000, 1000, 1000)]);
        assert_eq!(change.map(|c| (c.from, c.to)), Some((3000, 2000)));
        // Half of 1,000 more would take it to 1,500: the floor stops it at 1,600.
        let change = rig.window(Duration::ZERO, &[(1000, 1000, 1000), (1000, 1000, 1000)]);
        assert_eq!(change.map(|c| (c.from, c.to)), Some((2000, 1600)));
        let change = rig.window(Duration::ZERO, &[(1000, 1000, 1000), (1000, 1000, 1000)]);
        assert_eq!(
            change, None,
            "at the floor, the standing queue takes it no lower"
        );
        // The lane slows to 40 tasks a window (1,600/s, a floor of 32): the queue comes off again.
        let change = rig.window(Duration::ZERO, &[(1000, 20, 20), (1000, 20, 20)]);
        assert_eq!(change.map(|c| (c.from, c.to)), Some((1600, 1100)));
        // The floor raises nothing: a lane faster than its prefetch's floor keeps it, with tasks to spare.
        let mut rig = Rig::new(2, 100, 4000);
        let change = rig.window(Duration::ZERO, &[(10, 1000, 1000), (10, 1000, 1000)]);
        assert_eq!(change, None);
    }

    #[test]
    fn idle_workers_that_always_had_tasks_waiting_do_not_grow_it() {
        let mut rig = Rig::new(4, 64, 1000);
        // Idle a third of the time, yet 10 tasks were left at every fetch: the wait was not for want of tasks.
        let change = rig.window(WINDOW * 4 / 3, &[(10, 32, 32), (12, 32, 32)]);
        assert_eq!(change.map(|c| (c.from, c.to)), Some((64, 59)));
    }

    #[test]
    fn little_idle_time_does_not_grow_it() {
        let mut rig = Rig::new(100, 4, 1000);
        // 100 workers idle for one window in all: 1 % of their time, under IDLE_GROW.
        assert_eq!(rig.window(WINDOW, &[(0, 4, 4)]), None);
        assert_eq!(rig.prefetch(), 4);
    }

    #[test]
    fn max_held_equal_to_workers_keeps_it_at_zero() {
        let mut rig = Rig::new(4, 0, 0);
        rig.window(WINDOW * 4, &[(0, 4, 4)]);
        assert_eq!(rig.prefetch(), 0);
    }

    #[test]
    fn starving_workers_end_a_window_early() {
        let mut rig = Rig::new(4, 4, 1000);
        // 4 workers idle for 3 of the first 5 ms each (60 %), every fetch full, none left waiting.
        rig.clock.add(STARVING_WINDOW * 12 / 5);
        let early = rig.start + STARVING_WINDOW;
        let before = rig.start + STARVING_WINDOW / 2;
        assert_eq!(
            rig.depth
                .fetched(&rig.capacity, &rig.clock, (0, 8, 8), before),
            None,
            "not before STARVING_WINDOW"
        );
        let change = rig
            .depth
            .fetched(&rig.capacity, &rig.clock, (0, 8, 8), early);
        assert_eq!(change.map(|c| (c.from, c.to)), Some((4, 4 * MAX_GROWTH)));
        // Idle under half the time is not starving: that window waits for its end.
        rig.clock.add(STARVING_WINDOW * 4 / 5);
        let soon = early + STARVING_WINDOW;
        assert_eq!(
            rig.depth
                .fetched(&rig.capacity, &rig.clock, (0, 8, 8), soon),
            None
        );
    }

    #[test]
    fn a_window_ends_only_after_its_time() {
        let mut rig = Rig::new(4, 4, 20);
        // Idle a quarter of the time by half the window (an eighth by its end): growing, not starving.
        rig.clock.add(WINDOW / 2);
        let half = rig.start + WINDOW / 2;
        for _ in 0..100 {
            assert_eq!(
                rig.depth
                    .fetched(&rig.capacity, &rig.clock, (0, 8, 8), half),
                None
            );
        }
        let end = rig.start + WINDOW;
        assert!(
            rig.depth
                .fetched(&rig.capacity, &rig.clock, (0, 8, 8), end)
                .is_some()
        );
    }
}

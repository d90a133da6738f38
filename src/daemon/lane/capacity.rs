//! How many tasks a lane may hold, and so how many the fetcher may claim: the one owner of that number.
//!
//! A lane holds a task from the claim until the acker has settled it in Redis, whether it waits for a worker, runs,
//! or waits for its settlement; what it may hold at once is bounded, so the daemon's memory stays bounded however
//! far Redis or the acker fall behind. The bound counts *live* workers: a worker stuck inside a handler that
//! ignored its cancel flag (see `resolve`) can start nothing, so it takes its share of the bound with it:
//!
//! ```text
//! limit = live + ceil(prefetch * live / workers)      live = workers - stuck      (0 when every worker is stuck)
//! ```
//!
//! With no stuck worker that is `workers + prefetch`. `prefetch` is the configured one, or, when the config leaves
//! it out, what the fetcher's [`Depth`](super::depth::Depth) sets it to as it measures the lane; never more than
//! `max_held - workers`. The job queue and the outcome lists have no bound of their own (they are not channels:
//! `jobs`, `outcomes`): this one bounds them, since neither can hold more tasks than the lane holds. The fetcher
//! claims at most `limit - held`;
//! when stuck workers shrink the limit below what is held, the lane claims nothing until it falls back, and the
//! timeouts thread hands back tasks that wait behind workers that are all stuck (so another daemon runs them).
//!
//! To claim in batches rather than one task per freed slot, the fetcher waits until `threshold` tasks may be
//! claimed (half the prefetch, at most `batch`: the other half still waiting for workers covers the claim's round
//! trip), unless the workers run dry first (a worker that finds no job [`Capacity::nudge`]s it). Releasing is an
//! atomic subtraction; the fetcher is woken only when the free count crosses the threshold.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::poison::{lock, recover};

#[derive(Debug)]
pub struct Capacity {
    workers: usize,
    /// Set by the fetcher only (`set_prefetch`), read by everyone.
    prefetch: AtomicUsize,
    batch: usize,
    /// Tasks claimed and not yet settled (or forgotten). The fetcher adds to it (`acquire`), and the acker when a
    /// settle claimed tasks in the place of those it settled (`settled`), never beyond the limit.
    held: AtomicUsize,
    /// Workers inside a handler whose task was taken from them more than STUCK_AFTER ago.
    stuck: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Capacity {
    /// `workers`, the first `prefetch`, and `batch`, the most one claim takes.
    pub fn new(workers: usize, prefetch: usize, batch: usize) -> Capacity {
        Capacity {
            workers: workers.max(1),
            prefetch: AtomicUsize::new(prefetch),
            batch: batch.max(1),
            held: AtomicUsize::new(0),
            stuck: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    /// Workers not stuck in a handler.
    pub fn live_workers(&self) -> usize {
        self.workers
            .saturating_sub(self.stuck.load(Ordering::Acquire))
    }

    /// Workers stuck in a handler that ignored its cancel flag.
    pub fn stuck_workers(&self) -> usize {
        self.stuck.load(Ordering::Acquire)
    }

    /// Tasks held: claimed and not yet settled.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// The prefetch now: tasks that may wait for a worker beyond one per worker.
    pub fn prefetch(&self) -> usize {
        self.prefetch.load(Ordering::Acquire)
    }

    /// Changes the prefetch (the fetcher's `Depth`, within what the channels were sized for).
    pub fn set_prefetch(&self, prefetch: usize) {
        let before = self.free();
        self.prefetch.store(prefetch, Ordering::Release);
        self.wake_if_crossed(before);
    }

    /// How many free slots make the fetcher claim without waiting for the workers to run dry.
    fn threshold(&self) -> usize {
        self.batch.min(self.prefetch().div_ceil(2)).max(1)
    }

    /// How many more held tasks must be released before the fetcher claims a batch (0 when it may now): what
    /// the acker gathers before a settle, so that each settle frees one claim's worth.
    pub fn short_of_a_claim(&self) -> usize {
        self.threshold().saturating_sub(self.free())
    }

    /// The most tasks the lane may hold now.
    pub fn limit(&self) -> usize {
        let live = self.live_workers();
        if live == 0 {
            return 0;
        }
        live + (self.prefetch() * live).div_ceil(self.workers)
    }

    /// How many more tasks may be claimed now.
    pub fn free(&self) -> usize {
        self.limit().saturating_sub(self.held())
    }

    /// Waits up to `timeout` until the threshold may be claimed, or until something may and `starving()` says the
    /// workers have nothing to do; then reserves up to `max`. Returns how many it reserved (0 on timeout); the
    /// caller gives back what it did not claim with [`Capacity::release`].
    pub fn acquire(&self, max: usize, timeout: Duration, starving: impl Fn() -> bool) -> usize {
        let deadline = Instant::now() + timeout;
        let mut guard = lock(&self.lock);
        loop {
            let free = self.free();
            if free >= self.threshold() || (free > 0 && starving()) {
                // Only the fetcher adds to `held` beyond what is released (the acker's handovers replace tasks
                // still held), so `free` cannot shrink below this between the check and the add but for stuck
                // workers, which only delays the next claim.
                let taken = free.min(max);
                self.held.fetch_add(taken, Ordering::AcqRel);
                return taken;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return 0;
            };
            guard = recover(self.wake.wait_timeout(guard, left)).0;
        }
    }

    /// Gives back `n` reserved or held tasks (settled, forgotten, or never claimed).
    pub fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let before = self.free();
        let previous = self.held.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(previous >= n, "released more than held");
        self.wake_if_crossed(before);
    }

    /// How many tasks a settle of `settling` held tasks may claim in their place (docs/design/flow-control.md,
    /// "The slot handed over in the settle"): at most one each, and no more than the limit leaves once they are
    /// gone, so that the lane holds no more than its limit whatever the fetcher reserved meanwhile (it reserves
    /// only what is free while these are still held).
    pub fn in_place_of(&self, settling: usize) -> usize {
        let others = self.held().saturating_sub(settling);
        self.limit().saturating_sub(others).min(settling)
    }

    /// The acker settled `settled` held tasks, and its settle claimed `claimed` in their place: it gives back
    /// the difference, or (a settle some of whose outcomes Redis refused, which stay held) holds the excess.
    pub fn settled(&self, settled: usize, claimed: usize) {
        if claimed > settled {
            self.held.fetch_add(claimed - settled, Ordering::AcqRel);
        } else {
            self.release(settled - claimed);
        }
    }

    /// A worker is stuck in a handler: it no longer counts as live.
    pub fn stuck(&self) {
        self.stuck.fetch_add(1, Ordering::AcqRel);
    }

    /// A stuck worker's handler returned: it is live again.
    pub fn unstuck(&self) {
        let before = self.free();
        self.stuck.fetch_sub(1, Ordering::AcqRel);
        self.wake_if_crossed(before);
    }

    fn wake_if_crossed(&self, before: usize) {
        let threshold = self.threshold();
        if before < threshold && self.free() >= threshold {
            let _guard = lock(&self.lock);
            self.wake.notify_one();
        }
    }

    /// A worker found no job waiting: wake the fetcher even below the threshold.
    pub fn nudge(&self) {
        let _guard = lock(&self.lock);
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn claims_batch_up_to_the_threshold_unless_workers_starve() {
        // Threshold: half the prefetch of 6.
        let capacity = Capacity::new(4, 6, 1000);
        assert_eq!(capacity.acquire(100, Duration::ZERO, || false), 10);
        capacity.release(2);
        assert_eq!(
            capacity.acquire(100, Duration::from_millis(1), || false),
            0,
            "2 free, below the threshold of 3"
        );
        assert_eq!(
            capacity.acquire(100, Duration::ZERO, || true),
            2,
            "starving workers get what is free"
        );
        capacity.release(5);
        assert_eq!(
            capacity.acquire(3, Duration::ZERO, || false),
            3,
            "at most max"
        );
        assert_eq!(capacity.acquire(100, Duration::ZERO, || true), 2);
        assert_eq!(capacity.held(), 10);
    }

    #[test]
    fn short_of_a_claim_counts_the_releases_that_let_the_fetcher_claim_its_batch() {
        // 2 workers, prefetch 400: the limit is 402, the threshold 200.
        let capacity = Capacity::new(2, 400, 1000);
        assert_eq!(capacity.short_of_a_claim(), 0, "nothing held: it may claim");
        assert_eq!(capacity.acquire(1000, Duration::ZERO, || false), 402);
        assert_eq!(capacity.short_of_a_claim(), 200);
        capacity.release(150);
        assert_eq!(capacity.short_of_a_claim(), 50);
        capacity.release(50);
        assert_eq!(capacity.short_of_a_claim(), 0);
        assert_eq!(
            capacity.acquire(1000, Duration::ZERO, || false),
            200,
            "what it reported short is what the claim waited for"
        );
        // A claim batch smaller than half the prefetch is the threshold.
        let capacity = Capacity::new(2, 400, 50);
        assert_eq!(capacity.acquire(1000, Duration::ZERO, || false), 402);
        assert_eq!(capacity.short_of_a_claim(), 50);
    }

    #[test]
    fn a_settle_claims_in_place_of_its_tasks_no_more_than_the_limit_leaves() {
        // 4 workers, no prefetch: the limit is 4.
        let capacity = Capacity::new(4, 0, 1000);
        assert_eq!(capacity.acquire(3, Duration::ZERO, || false), 3);
        assert_eq!(capacity.in_place_of(2), 2, "one each");
        // The fetcher reserves the free slot while the two are settled: still one each, never past the limit.
        assert_eq!(capacity.acquire(4, Duration::ZERO, || false), 1);
        assert_eq!(capacity.in_place_of(2), 2);
        capacity.settled(2, 1);
        assert_eq!(capacity.held(), 3, "one given back, one claimed in place");
        capacity.stuck();
        capacity.stuck();
        assert_eq!(capacity.in_place_of(3), 2, "the limit fell to 2");
        // Some outcomes refused (still held) while the settle claimed for more: the excess is held.
        capacity.settled(0, 1);
        assert_eq!(capacity.held(), 4);
    }

    #[test]
    fn stuck_workers_take_their_share_of_the_prefetch_with_them() {
        let capacity = Capacity::new(4, 4, 1);
        assert_eq!(capacity.limit(), 8);
        capacity.stuck();
        assert_eq!(capacity.limit(), 3 + 3);
        capacity.stuck();
        capacity.stuck();
        assert_eq!(capacity.limit(), 1 + 1);
        capacity.stuck();
        assert_eq!(
            capacity.limit(),
            0,
            "nothing is claimed when every worker is stuck"
        );
        assert_eq!(capacity.acquire(10, Duration::ZERO, || true), 0);
        capacity.unstuck();
        assert_eq!(capacity.acquire(10, Duration::ZERO, || true), 2);
    }

    #[test]
    fn crossing_the_threshold_wakes_a_waiting_fetcher() {
        // Threshold: half the prefetch of 4.
        let capacity = Arc::new(Capacity::new(2, 4, 1000));
        assert_eq!(capacity.acquire(6, Duration::ZERO, || false), 6);
        let waiter = {
            let capacity = Arc::clone(&capacity);
            std::thread::spawn(move || capacity.acquire(6, Duration::from_secs(60), || false))
        };
        capacity.release(1);
        capacity.release(1);
        assert_eq!(
            waiter.join().unwrap(),
            2,
            "woken by the release that reached the threshold, not the timeout"
        );
    }

    #[test]
    fn a_stuck_worker_returning_wakes_a_waiting_fetcher() {
        let capacity = Arc::new(Capacity::new(1, 0, 1));
        capacity.stuck();
        let waiter = {
            let capacity = Arc::clone(&capacity);
            std::thread::spawn(move || capacity.acquire(4, Duration::from_secs(60), || false))
        };
        capacity.unstuck();
        assert_eq!(waiter.join().unwrap(), 1);
    }
}

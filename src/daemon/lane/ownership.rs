//! The lease identity of a lane: this daemon's owner on the queue, what it knows of that owner's lease, the
//! journal bumps Redis acknowledged for it, and each worker's cheap view of it. Its own module because it is a
//! concept apart from the tasks the lane holds: the fetcher registers owners, the heartbeat renews and loses them,
//! the workers ask it before starting a task, the settler counts its bumps.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::broker::{LeaseClock, Token};
use crate::poison::lock;

/// The least forward step of Redis's clock that counts as one: a tenth of the lease, at least a second. Redis's
/// clock runs as this daemon's does between two looks, give or take a slewing NTP (chrony slews by up to 8 %) and,
/// for a look that only knows when it was sent (the monitor's), the time its reply waited; a false alarm costs a
/// renewal's round trip of no task starts here, and a lease of deferred recoveries in a monitor. A smaller step
/// shortens the lease by less than the margin, which the renewals, a third of the lease apart, keep far from its
/// end.
pub fn step_margin(lease: Duration) -> Duration {
    (lease / 10).max(Duration::from_secs(1))
}

/// This daemon's owner on the queue (its identity, with one lease for every task it holds), what this daemon
/// knows of that lease, and the counter its claim tokens come from.
///
/// The fetcher registers an owner on its first fetch; when the lease is lost (the daemon was silent longer than
/// `lease_timeout`, or Redis lost it), the heartbeat or the fetcher drops it and the fetcher registers a new one.
/// Tasks claimed under the old owner keep their tokens, so their late outcomes are fenced against the monitors.
/// Owner ids are this daemon run's instance id and a generation: unique without asking Redis.
///
/// The lease is a deadline on Redis's clock; the workers, which cannot ask Redis before every task, believe in it
/// on the local monotonic clock (which also runs while the process is stopped): for the time left that Redis
/// answered to the last registration or renewal, counted from when that call was *sent* (Redis counted from when
/// it ran, a little later). A worker starts a task only while that holds ([`Ownership::may_start`]), so a daemon
/// woken from a pause longer than its lease starts nothing the monitors may have handed to another daemon
/// meanwhile.
///
/// The two clocks agree only while Redis's does not step (review M2): an NTP step, a resumed VM or a failover to a
/// host whose clock runs ahead moves every deadline closer at once, and the monitors recover leases the daemons
/// still believe in. So the daemon watches Redis's clock against its own through every claim, which answers the
/// lease's time left: a claim that saw the deadline of the last renewal and found less of it left than this daemon
/// believes, by more than [`step_margin`] even counted from when its reply came back, saw Redis's clock step
/// forward under the lease. Then no task starts ([`Ownership::may_start`] is false, the lease *in doubt*) until a
/// renewal sent after that claim's reply confirms the lease on Redis's new clock, and the heartbeat is woken to
/// send one at once ([`Ownership::renewal_wanted`]): a step that left some of the lease is renewed before it runs
/// out, one that left none is found lost, and either way no task starts on a belief Redis no longer shares. A
/// step backward only lengthens the lease as Redis counts it, and needs nothing.
#[derive(Debug)]
pub struct Ownership {
    instance: String,
    current: Mutex<Option<Current>>,
    /// Bumped under `current`'s lock by every change that [`Ownership::may_start`] reads (a registration, a
    /// renewal, a loss, a doubt): a worker's [`LeaseView`] is good while it is unchanged.
    changes: AtomicU64,
    generation: AtomicU64,
    next_token: AtomicU64,
    /// "Renew now", from a claim that put the lease in doubt to the heartbeat, which waits on the receiver beside
    /// its timer. One pending message is enough: the renewal it asks for is sent after every doubt raised before
    /// the heartbeat took it.
    renew_now: (Sender<()>, Receiver<()>),
}

/// One worker's copy of the current owner and how long its lease is surely live, kept while
/// [`Ownership`]'s `changes` is unchanged: a task's lease check costs one load of a line written once per
/// heartbeat, instead of a lock every worker would take for every task and bounce between the cores
/// (docs/PERFORMANCE.md, "Workers that share less"), as [`crate::plugin::Reader`] does for the plugins.
#[derive(Debug)]
pub struct LeaseView {
    seen: u64,
    lease: Option<ViewedLease>,
}

#[derive(Debug)]
struct ViewedLease {
    /// The current owner's id, as its tokens share it: compared by pointer first.
    owner: Arc<str>,
    /// The same id in an allocation of this view's own, which the settlements of this worker's tasks name (see
    /// [`LeaseView::token`]).
    own: Arc<str>,
    /// Until when its lease is surely live; `None` while it is in doubt.
    good_until: Option<Instant>,
}

impl LeaseView {
    /// `token` as a settlement of this worker's carries it: naming its owner by this view's own copy of the id
    /// when it is the current owner. A copy of the shared `Arc` per task would write its count, a line the
    /// fetcher, every worker and the acker would write for every task; with its own copy, a worker shares the
    /// count with the acker alone, which drops a batch of them at once.
    pub fn token(&self, token: &Token) -> Token {
        let owner = match &self.lease {
            Some(lease) if Arc::ptr_eq(&lease.owner, &token.owner) => &lease.own,
            _ => &token.owner,
        };
        Token {
            owner: Arc::clone(owner),
            id: token.id.clone(),
        }
    }

    /// Whether `owner`, the owner of a task of this worker's that [`Ownership::may_start`] just refused with this
    /// view, was lost for good: it is not the current owner (an owner was current before any task of it was
    /// claimed, and never is again once lost: a new owner has a new id). Otherwise it is only in doubt: current,
    /// its lease not renewed yet, or not confirmed since Redis's clock stepped.
    pub fn is_lost(&self, owner: &Arc<str>) -> bool {
        self.lease
            .as_ref()
            .is_none_or(|lease| !Arc::ptr_eq(&lease.owner, owner) && lease.owner != *owner)
    }
}

impl Default for LeaseView {
    fn default() -> LeaseView {
        LeaseView {
            // No count of changes: the first check reads the current owner.
            seen: u64::MAX,
            lease: None,
        }
    }
}

#[derive(Debug)]
struct Current {
    owner: Arc<str>,
    /// Until when the lease is surely live, by this daemon's clock: the time left Redis answered to the last
    /// registration or renewal, from when it was sent.
    good_until: Instant,
    /// The lease's deadline on Redis's clock (ms), as that call set it: a claim that answers this deadline's time
    /// left measures Redis's clock against `good_until`.
    deadline_ms: i64,
    /// Set when a claim found Redis's clock stepped forward under the lease, to when its reply came: no task
    /// starts until a renewal sent at or after it (so run on Redis's new clock) confirms the lease.
    doubt: Option<Instant>,
    /// How many of the owner's journal bumps Redis acknowledged (renew.lua): one per claim that took tasks, per
    /// adoption that found a lost claim's tasks, per settle call of the owner answered with a bump (a call sent
    /// again is answered once). A count, not the highest value seen: after a rewind lost k bumps, Redis's journal
    /// stays k below it whatever is claimed and settled next.
    journal: u64,
}

/// A call that read Redis's clock, by this daemon's: when it was sent, and when its reply came back. Redis ran it
/// in between.
#[derive(Clone, Copy, Debug)]
pub struct Exchange {
    pub sent: Instant,
    pub answered: Instant,
}

impl Ownership {
    pub fn new(instance: &str) -> Ownership {
        Ownership {
            instance: instance.to_string(),
            current: Mutex::new(None),
            changes: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            next_token: AtomicU64::new(0),
            renew_now: crossbeam_channel::bounded(1),
        }
    }

    /// The owner to claim under, if one is registered.
    pub fn current(&self) -> Option<Arc<str>> {
        lock(&self.current)
            .as_ref()
            .map(|current| Arc::clone(&current.owner))
    }

    /// An owner id never used before, to register.
    pub fn new_id(&self) -> Arc<str> {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        Arc::from(format!("{}.{generation}", self.instance))
    }

    /// Records a newly registered owner, whose registration `call` Redis answered with `lease`.
    pub fn set(&self, owner: Arc<str>, call: Exchange, lease: LeaseClock) {
        let mut current = lock(&self.current);
        *current = Some(Current {
            owner,
            good_until: call.sent + left(lease),
            deadline_ms: lease.now_ms.saturating_add(lease.left_ms),
            doubt: None,
            journal: 0,
        });
        self.changed();
    }

    /// Tells the workers' views that what `may_start` reads changed; called with `current`'s lock held, after the
    /// change, so that a view that sees the new count reads the new value.
    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// Redis answered a call of `owner` that added one to its journal: a claim that took tasks, an adoption that
    /// found the lost claim's tasks (that claim's bump), a settle call's answer with a journal (the first or the
    /// stored one: the settler reads one answer per call). Counted only from an answer, never for a call whose
    /// reply was lost: so the count never exceeds Redis's journal unless Redis lost writes, and falls behind it
    /// only until the lost reply is resolved (the claim adopted, the settle call answered); the fetcher's and the
    /// acker's bumps add up in any order.
    pub fn bumped(&self, owner: &str) {
        if let Some(current) = lock(&self.current).as_mut()
            && &*current.owner == owner
        {
            current.journal += 1;
        }
    }

    /// How many journal bumps of `owner` Redis acknowledged (0 if it is not current): Redis's journal is at least
    /// this unless it lost acknowledged writes (renew.lua).
    pub fn journal(&self, owner: &str) -> u64 {
        lock(&self.current)
            .as_ref()
            .filter(|current| &*current.owner == owner)
            .map_or(0, |current| current.journal)
    }

    /// `owner`'s lease was renewed by `call`, which Redis answered with `lease`. Returns true when that ended a
    /// doubt: the call was sent after the claim that raised it, so it ran on Redis's clock as it is now.
    pub fn renewed(&self, owner: &str, call: Exchange, lease: LeaseClock) -> bool {
        let mut current = lock(&self.current);
        let Some(current) = current.as_mut().filter(|c| &*c.owner == owner) else {
            return false;
        };
        current.good_until = current.good_until.max(call.sent + left(lease));
        current.deadline_ms = lease.now_ms.saturating_add(lease.left_ms);
        let confirmed = current.doubt.is_some_and(|since| call.sent >= since);
        if confirmed {
            current.doubt = None;
        }
        self.changed();
        confirmed
    }

    /// A claim of `owner`'s, `call`, found `lease` (its time left of the lease, at Redis's clock then). When it
    /// found the deadline the last renewal set and less of it left, even counted from when its reply came back,
    /// than this daemon believes, by more than [`step_margin`] of `lease_timeout`, Redis's clock stepped forward
    /// under the lease: no task starts until a renewal sent from now on confirms it, and the heartbeat is asked
    /// for one at once. Returns how far the clock stepped (ms) when it puts the lease in doubt so.
    pub fn claimed(
        &self,
        owner: &str,
        call: Exchange,
        lease: LeaseClock,
        lease_timeout: Duration,
    ) -> Option<i64> {
        let mut current = lock(&self.current);
        let current = current.as_mut().filter(|c| &*c.owner == owner)?;
        // A claim that ran before the last renewal saw an older deadline, and one that ran after a renewal not yet
        // answered here a newer one: only this one's time left compares with `good_until`.
        if lease.now_ms.saturating_add(lease.left_ms) != current.deadline_ms {
            return None;
        }
        let redis_ends = call.answered + left(lease);
        let step = current.good_until.checked_duration_since(redis_ends)?;
        if step <= step_margin(lease_timeout) {
            return None;
        }
        current.doubt = Some(call.answered);
        self.changed();
        // Full: a renewal is asked for already, and will be sent after this doubt.
        let _ = self.renew_now.0.try_send(());
        Some(i64::try_from(step.as_millis()).unwrap_or(i64::MAX))
    }

    /// Whether a renewal of the current owner should be sent now: a claim found Redis's clock stepped under its
    /// lease, and no renewal confirmed it since.
    pub fn in_doubt(&self) -> bool {
        lock(&self.current)
            .as_ref()
            .is_some_and(|current| current.doubt.is_some())
    }

    /// What the heartbeat waits on, beside its timer, to renew at once a lease in doubt ([`Ownership::claimed`]).
    pub fn renewal_wanted(&self) -> &Receiver<()> {
        &self.renew_now.1
    }

    /// Whether a task claimed under `owner` may start at `now`: it is the current owner and its lease is surely live,
    /// not in doubt. `view`: the calling worker's, read again only when something changed since it was.
    pub fn may_start(&self, view: &mut LeaseView, owner: &Arc<str>, now: Instant) -> bool {
        if self.changes.load(Ordering::Acquire) != view.seen {
            let current = lock(&self.current);
            view.seen = self.changes.load(Ordering::Relaxed);
            view.lease = current.as_ref().map(|current| ViewedLease {
                owner: Arc::clone(&current.owner),
                own: Arc::from(&*current.owner),
                good_until: current.doubt.is_none().then_some(current.good_until),
            });
        }
        view.lease.as_ref().is_some_and(|lease| {
            (Arc::ptr_eq(&lease.owner, owner) || lease.owner == *owner)
                && lease.good_until.is_some_and(|until| now < until)
        })
    }

    /// Runs `f` if `owner` is the current owner, with the lock [`Ownership::lose`] takes held: `owner` cannot be
    /// lost between the look and the end of `f`. `None` when it is not current: its lease was lost, for good (a
    /// newer owner has a new id).
    pub fn while_current<R>(&self, owner: &str, f: impl FnOnce() -> R) -> Option<R> {
        let current = lock(&self.current);
        current
            .as_ref()
            .is_some_and(|current| &*current.owner == owner)
            .then(f)
    }

    /// Forgets `owner` after its lease was lost (unless a newer one replaced it already); true if it was current.
    pub fn lose(&self, owner: &str) -> bool {
        let mut current = lock(&self.current);
        if current.as_ref().is_some_and(|c| &*c.owner == owner) {
            *current = None;
            self.changed();
            return true;
        }
        false
    }

    /// Reserves `n` claim tokens; returns the first.
    pub fn tokens(&self, n: usize) -> u64 {
        self.next_token.fetch_add(n as u64, Ordering::Relaxed)
    }
}

/// A lease's time left as a duration (none if Redis answered a negative one).
fn left(lease: LeaseClock) -> Duration {
    Duration::from_millis(u64::try_from(lease.left_ms).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call answered at once.
    fn at(sent: Instant) -> Exchange {
        Exchange {
            sent,
            answered: sent,
        }
    }

    /// Redis's answer at its clock `now_ms`, with `left` of the lease.
    fn clock(now_ms: i64, left: Duration) -> LeaseClock {
        LeaseClock {
            now_ms,
            left_ms: left.as_millis() as i64,
        }
    }

    #[test]
    fn a_task_starts_only_while_its_owner_is_current_and_its_lease_surely_live() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let t0 = Instant::now();
        // One view throughout, as a worker keeps it: each change below must reach it.
        let mut view = LeaseView::default();
        assert!(
            !ownership.may_start(&mut view, &owner, t0),
            "not registered yet"
        );
        let lease = Duration::from_millis(50);
        ownership.set(Arc::clone(&owner), at(t0), clock(0, lease));
        assert!(ownership.may_start(&mut view, &owner, t0));
        assert!(!ownership.may_start(&mut view, &Arc::from("someone-else.1"), t0));
        let later = t0 + lease;
        assert!(
            !ownership.may_start(&mut view, &owner, later),
            "past the lease, as after a pause"
        );
        ownership.renewed(&owner, at(later), clock(0, lease));
        assert!(ownership.may_start(&mut view, &owner, later), "renewed");
        assert!(ownership.lose(&owner));
        assert!(!ownership.may_start(&mut view, &owner, later));
    }

    #[test]
    fn a_claim_that_finds_redis_clock_stepped_forward_stops_starts_until_a_renewal_sent_after_it() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let lease = Duration::from_secs(6);
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // Registered at Redis's 1,000,000 ms: the deadline is 1,006,000.
        ownership.set(Arc::clone(&owner), at(t0), clock(1_000_000, lease));
        let mut view = LeaseView::default();
        let claim = |sent: Duration, answered: Duration, now_ms: i64, left_ms: i64| {
            let call = Exchange {
                sent: t0 + sent,
                answered: t0 + answered,
            };
            let found = LeaseClock { now_ms, left_ms };
            ownership.claimed(&owner, call, found, lease)
        };
        // A second later on both clocks, and a reply that took 900 ms (Redis ran the claim at once): no step.
        assert_eq!(claim(ms(1000), ms(1010), 1_001_000, 5000), None);
        assert_eq!(claim(ms(1000), ms(1900), 1_001_000, 5000), None);
        // A claim that ran before the registration's deadline was set (another deadline): not compared.
        assert_eq!(claim(ms(1000), ms(1010), 1_004_000, 500), None);
        // Redis's clock 900 ms ahead: within the margin (a second).
        assert_eq!(claim(ms(1000), ms(1010), 1_001_900, 4100), None);
        assert!(ownership.may_start(&mut view, &owner, t0 + ms(1010)));
        assert!(ownership.renewal_wanted().try_recv().is_err());
        // 4.5 s ahead: half a second left of a lease this daemon believes in for five.
        assert_eq!(claim(ms(1000), ms(1010), 1_005_500, 500), Some(4490));
        assert!(ownership.in_doubt());
        assert!(
            !ownership.may_start(&mut view, &owner, t0 + ms(1020)),
            "no start while the lease is in doubt"
        );
        assert!(
            !view.is_lost(&owner),
            "in doubt, not lost: the worker waits"
        );
        assert!(
            ownership.renewal_wanted().try_recv().is_ok(),
            "the heartbeat is woken"
        );
        // A renewal sent before that claim's reply may have run before the step: it confirms nothing.
        let early = Exchange {
            sent: t0 + ms(1005),
            answered: t0 + ms(1030),
        };
        assert!(!ownership.renewed(&owner, early, clock(1_005_510, lease)));
        assert!(!ownership.may_start(&mut view, &owner, t0 + ms(1030)));
        // One sent after it did run on Redis's new clock.
        let after = Exchange {
            sent: t0 + ms(1040),
            answered: t0 + ms(1050),
        };
        assert!(ownership.renewed(&owner, after, clock(1_005_540, lease)));
        assert!(!ownership.in_doubt());
        assert!(ownership.may_start(&mut view, &owner, t0 + ms(1050)));
        assert!(
            !ownership.may_start(&mut view, &owner, t0 + ms(1040) + lease),
            "good for the renewal's lease from when it was sent"
        );
        // Claims of the renewed lease compare with its deadline now.
        assert_eq!(claim(ms(2000), ms(2010), 1_006_500, 5040), None);
    }

    #[test]
    fn a_workers_settlements_name_the_current_owner_by_its_own_copy_of_the_id() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let now = Instant::now();
        ownership.set(
            Arc::clone(&owner),
            at(now),
            clock(0, Duration::from_secs(30)),
        );
        let mut view = LeaseView::default();
        assert!(ownership.may_start(&mut view, &owner, now));
        let token = Token {
            owner: Arc::clone(&owner),
            id: crate::broker::TokenId::Listed {
                claim: 7,
                position: 3,
            },
        };
        let named = view.token(&token);
        assert_eq!(named, token, "the same owner and place");
        assert!(
            !Arc::ptr_eq(&named.owner, &owner),
            "the view's own copy: the shared id's count is not written"
        );
        assert!(Arc::ptr_eq(&view.token(&token).owner, &named.owner));
        let other = Token {
            owner: Arc::from("h-1-2-ab.0"),
            ..token
        };
        assert!(
            Arc::ptr_eq(&view.token(&other).owner, &other.owner),
            "another owner's token is named as it is"
        );
    }

    #[test]
    fn the_journal_counts_every_bump_of_the_current_owner_in_any_order() {
        let ownership = Arc::new(Ownership::new("h-1-2-ab"));
        let first = ownership.new_id();
        ownership.set(
            Arc::clone(&first),
            at(Instant::now()),
            clock(0, Duration::from_secs(30)),
        );
        // The fetcher's claims and the acker's settles, concurrently: a count, whatever the interleaving (the
        // highest value seen would be beaten by bumps made after a rewind).
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (ownership, owner) = (Arc::clone(&ownership), Arc::clone(&first));
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        ownership.bumped(&owner);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(ownership.journal(&first), 2000);
        // A new owner counts from 0; a late answer for the old one counts for nobody.
        assert!(ownership.lose(&first));
        let second = ownership.new_id();
        ownership.set(
            Arc::clone(&second),
            at(Instant::now()),
            clock(0, Duration::from_secs(30)),
        );
        ownership.bumped(&first);
        ownership.bumped(&second);
        assert_eq!(
            (ownership.journal(&first), ownership.journal(&second)),
            (0, 1)
        );
    }

    #[test]
    fn a_view_tells_a_lost_owner_from_one_in_doubt() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let t0 = Instant::now();
        let lease = Duration::from_millis(50);
        ownership.set(Arc::clone(&owner), at(t0), clock(0, lease));
        let mut view = LeaseView::default();
        assert!(!ownership.may_start(&mut view, &owner, t0 + lease));
        assert!(!view.is_lost(&owner), "current, not renewed yet: in doubt");
        assert!(ownership.lose(&owner));
        assert!(!ownership.may_start(&mut view, &owner, t0));
        assert!(view.is_lost(&owner), "forgotten");
        ownership.set(ownership.new_id(), at(t0), clock(0, lease));
        assert!(!ownership.may_start(&mut view, &owner, t0));
        assert!(view.is_lost(&owner), "replaced by a newer owner");
    }

    #[test]
    fn a_lost_owner_is_forgotten_only_if_still_current() {
        let ownership = Ownership::new("host-1-2-ab");
        let (first, second) = (ownership.new_id(), ownership.new_id());
        assert_eq!((&*first, &*second), ("host-1-2-ab.1", "host-1-2-ab.2"));
        let lease = Duration::from_secs(30);
        ownership.set(Arc::from("o1"), at(Instant::now()), clock(0, lease));
        ownership.set(Arc::from("o2"), at(Instant::now()), clock(0, lease));
        assert!(!ownership.lose("o1"), "o2 replaced it");
        assert_eq!(ownership.current().as_deref(), Some("o2"));
        assert!(ownership.lose("o2"));
        assert_eq!(ownership.current(), None);
        assert_eq!((ownership.tokens(10), ownership.tokens(5)), (0, 10));
    }
}

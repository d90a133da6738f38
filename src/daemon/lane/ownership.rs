//! The lease identity of a lane: this daemon's owner on the queue, what it knows of that owner's lease, the
//! journal bumps Redis acknowledged for it, and each worker's cheap view of it. Its own module because it is a
//! concept apart from the tasks the lane holds: the fetcher registers owners, the heartbeat renews and loses them,
//! the workers ask it before starting a task, the settler counts its bumps.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::lock;
use crate::broker::Token;

/// This daemon's owner on the queue (its identity, with one lease for every task it holds), what this daemon
/// knows of that lease, and the counter its claim tokens come from.
///
/// The fetcher registers an owner on its first fetch; when the lease is lost (the daemon was silent longer than
/// `lease_timeout`, or Redis lost it), the heartbeat or the fetcher drops it and the fetcher registers a new one.
/// Tasks claimed under the old owner keep their tokens, so their late outcomes are fenced against the monitors.
/// Owner ids are this daemon run's instance id and a generation: unique without asking Redis.
///
/// The lease is known good until `lease_timeout` after the last registration or renewal was *sent* (Redis
/// counts from when it ran, a little later), by the local monotonic clock, which also runs while the process is
/// stopped: a worker starts a task only while that holds ([`Ownership::may_start`]), so a daemon woken from a
/// pause longer than its lease starts nothing the monitors may have handed to another daemon meanwhile.
#[derive(Debug)]
pub struct Ownership {
    instance: String,
    current: Mutex<Option<Current>>,
    /// Bumped under `current`'s lock by every change that [`Ownership::may_start`] reads (a registration, a
    /// renewal, a loss): a worker's [`LeaseView`] is good while it is unchanged.
    changes: AtomicU64,
    generation: AtomicU64,
    next_token: AtomicU64,
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
    good_until: Instant,
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
    /// its lease not renewed yet.
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
    /// Until when the lease is surely live.
    good_until: Instant,
    /// How many of the owner's journal bumps Redis acknowledged (renew.lua): one per claim that took tasks, per
    /// adoption that found a lost claim's tasks, per settle call of the owner answered with a bump (a call sent
    /// again is answered once). A count, not the highest value seen: after a rewind lost k bumps, Redis's journal
    /// stays k below it whatever is claimed and settled next.
    journal: u64,
}

impl Ownership {
    pub fn new(instance: &str) -> Ownership {
        Ownership {
            instance: instance.to_string(),
            current: Mutex::new(None),
            changes: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            next_token: AtomicU64::new(0),
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

    /// Records a newly registered owner whose registration was sent at `sent` with a lease of `lease`.
    pub fn set(&self, owner: Arc<str>, sent: Instant, lease: Duration) {
        let mut current = lock(&self.current);
        *current = Some(Current {
            owner,
            good_until: sent + lease,
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

    /// `owner`'s lease was renewed by a call sent at `sent`.
    pub fn renewed(&self, owner: &str, sent: Instant, lease: Duration) {
        if let Some(current) = lock(&self.current).as_mut() {
            if &*current.owner == owner {
                current.good_until = current.good_until.max(sent + lease);
                self.changed();
            }
        }
    }

    /// Whether a task claimed under `owner` may start at `now`: it is the current owner and its lease is surely live.
    /// `view`: the calling worker's, read again only when something changed since it was.
    pub fn may_start(&self, view: &mut LeaseView, owner: &Arc<str>, now: Instant) -> bool {
        if self.changes.load(Ordering::Acquire) != view.seen {
            let current = lock(&self.current);
            view.seen = self.changes.load(Ordering::Relaxed);
            view.lease = current.as_ref().map(|current| ViewedLease {
                owner: Arc::clone(&current.owner),
                own: Arc::from(&*current.owner),
                good_until: current.good_until,
            });
        }
        view.lease.as_ref().is_some_and(|lease| {
            (Arc::ptr_eq(&lease.owner, owner) || lease.owner == *owner) && now < lease.good_until
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

#[cfg(test)]
mod tests {
    use super::*;

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
        ownership.set(Arc::clone(&owner), t0, lease);
        assert!(ownership.may_start(&mut view, &owner, t0));
        assert!(!ownership.may_start(&mut view, &Arc::from("someone-else.1"), t0));
        let later = t0 + lease;
        assert!(
            !ownership.may_start(&mut view, &owner, later),
            "past the lease, as after a pause"
        );
        ownership.renewed(&owner, later, lease);
        assert!(ownership.may_start(&mut view, &owner, later), "renewed");
        assert!(ownership.lose(&owner));
        assert!(!ownership.may_start(&mut view, &owner, later));
    }

    #[test]
    fn a_workers_settlements_name_the_current_owner_by_its_own_copy_of_the_id() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let now = Instant::now();
        ownership.set(Arc::clone(&owner), now, Duration::from_secs(30));
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
        ownership.set(Arc::clone(&first), Instant::now(), Duration::from_secs(30));
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
        ownership.set(Arc::clone(&second), Instant::now(), Duration::from_secs(30));
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
        ownership.set(Arc::clone(&owner), t0, lease);
        let mut view = LeaseView::default();
        assert!(!ownership.may_start(&mut view, &owner, t0 + lease));
        assert!(!view.is_lost(&owner), "current, not renewed yet: in doubt");
        assert!(ownership.lose(&owner));
        assert!(!ownership.may_start(&mut view, &owner, t0));
        assert!(view.is_lost(&owner), "forgotten");
        ownership.set(ownership.new_id(), t0, lease);
        assert!(!ownership.may_start(&mut view, &owner, t0));
        assert!(view.is_lost(&owner), "replaced by a newer owner");
    }

    #[test]
    fn a_lost_owner_is_forgotten_only_if_still_current() {
        let ownership = Ownership::new("host-1-2-ab");
        let (first, second) = (ownership.new_id(), ownership.new_id());
        assert_eq!((&*first, &*second), ("host-1-2-ab.1", "host-1-2-ab.2"));
        let lease = Duration::from_secs(30);
        ownership.set(Arc::from("o1"), Instant::now(), lease);
        ownership.set(Arc::from("o2"), Instant::now(), lease);
        assert!(!ownership.lose("o1"), "o2 replaced it");
        assert_eq!(ownership.current().as_deref(), Some("o2"));
        assert!(ownership.lose("o2"));
        assert_eq!(ownership.current(), None);
        assert_eq!((ownership.tokens(10), ownership.tokens(5)), (0, 10));
    }
}

//! The state (Redis plus each daemon's memory), the actions (one per script call or daemon step), and the
//! properties, as a [`stateright::Model`].

use stateright::{Model, Property};

use crate::redis::{
    ClaimCall, Claimed, Env, Fence, Holder, Lease, List, Op, OwnerId, PopCall, Popped,
    RECOVERED_MAX, Record, Redis, Settler, quarantine_stage,
};
use crate::setup::{
    ADMITS_BELOW, Behaviour, Config, Levels, Mode, Mutation, NO_LEAK, NO_TAKE_THROTTLED,
    NO_UNDERFLOW, RUNNING_BOUND, RUNNING_EXACT, SHARE_COMES_BACK, Setup, THROTTLE_UNCHARGED,
    UNFAIR_CHARGE, UNFAIR_DEAD, ZOMBIE_START,
};

/// Everything that decides what can happen next.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct State {
    pub redis: Redis,
    pub daemons: [Daemon; 2],
    /// Claim calls sent whose reply the fetcher gave up for lost, and that Redis has not run yet (a slow link, a
    /// request queued behind a stall): they run later, or never.
    pub in_flight: List<ClaimCall>,
    /// Pop calls under a running limit whose reply the fetcher gave up for lost, and that Redis has not run yet:
    /// they run later (their tasks then lost, at most once), or never.
    pub pops_in_flight: List<PopCall>,
    pub ghost: Ghost,
}

/// One daemon's memory for the queue: the fetcher's, the workers', the acker's, the monitor's, the heartbeat's.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Daemon {
    /// Index into [`Setup::configs`].
    pub config: u8,
    /// Which run of the daemon (a restart is a new instance: new owner ids, new settler identities).
    pub run: u8,
    /// `Ownership::generation`: owner ids made so far in this run.
    pub generation: u8,
    /// `Ownership::current`: the owner it claims (or, under a running limit, pops) under and whose lease its
    /// heartbeat renews. A default-mode daemon without a limit has none here (kmqd registers one, which holds
    /// nothing this model keeps).
    pub owner: Option<OwnerId>,
    /// `Ownership::good_until` may lie past the owner's deadline in Redis. Only with
    /// [`Mutation::RegisterRetryKeepsLease`] (register.lua before it renewed a live lease on a retry): the owner
    /// was registered by a register.lua sent again after a lost reply, which found it registered and did not
    /// extend the lease, while the fetcher counts the lease from when it sent the second call; until the
    /// heartbeat's next renewal (which runs later than that, so its deadline is later than `good_until`), or until
    /// `good_until` passes. Otherwise, and always with kmqd's register.lua, `good_until` is never later than the
    /// deadline (each is `lease_timeout` after a call, the daemon's from when it sent it, Redis's from when it ran:
    /// a register.lua retry for a live owner renews the lease from when it runs), so "believed good" implies "live
    /// in Redis".
    pub outliving: bool,
    /// `Fetcher::registering`: an owner id sent to register.lua whose reply was lost (sent again as is).
    pub registering: Option<OwnerId>,
    /// `Ownership::next_token`: tokens are unique within the run, increasing from claim to claim.
    pub next_token: u8,
    /// `lane.held`: the tasks claimed (or popped) and not yet settled, in a canonical order.
    pub held: List<Held>,
    /// `Fetcher::lost_claim`: a claim whose reply was lost; its capacity stays taken until adopted.
    pub lost_claim: Option<ClaimCall>,
    pub acker: Calls,
    pub monitor: Calls,
    /// The monitor's call whose reply was lost: the owner and the records, sent again as they are.
    pub monitor_call: Option<(OwnerId, List<Record>)>,
    /// SIGTERM received: no more claims or runs; hand back, settle, release, restart.
    pub stopping: bool,
    /// A pill's handler still runs although its task was taken from it (its lease was lost, or the daemon is
    /// stopping): an orphan (`Lane::orphaned`; its cancel flag is raised, which a crashing handler ignores). It
    /// crashes the daemon when it does. Only with [`Setup::orphans`].
    pub orphan: bool,
}

/// A settling party's calls (`Settler`): one at a time, sent again as the same call after a lost reply.
///
/// The call's number is not kept: settle.lua only ever compares the number it is sent with the one stored for
/// the same party, and a party's numbers never repeat, so a record of an earlier call can never match again.
/// The model numbers every call [`CALL`] and drops the party's stored record when it starts a new call: the
/// same answers as numbering them 1, 2, 3..., with a finite state space.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Calls {
    /// Its reply was lost: the same call is to be sent again.
    pub lost: bool,
    /// Ghost: Redis has applied it (the reply was lost after the script ran).
    pub applied: bool,
}

/// A task a daemon holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Held {
    /// Safe mode: the owner it was claimed under and its token; default mode: none.
    pub owner: Option<OwnerId>,
    pub token: Option<u8>,
    /// Safe mode: the claim whose list holds it (the settle call names it); 0 in default mode.
    pub claim: u8,
    /// Default mode under a running limit: the owner that popped it (`Fetched::popped_by`), whose share of
    /// `running` its settle gives back.
    pub popped_by: Option<OwnerId>,
    pub level: u8,
    pub env: Env,
    pub phase: Phase,
}

impl Held {
    /// Whose task it is for the acker (`broker::Holder::of`): one settle call per holder.
    pub fn holder(&self) -> Holder {
        match (self.owner, self.popped_by) {
            (Some(owner), _) => Holder::Claimed(owner),
            (None, Some(popper)) => Holder::Popped(popper),
            (None, None) => Holder::Nobody,
        }
    }
}

/// A held task's phase (resolve.rs, reduced to what reaches Redis).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Claimed, waiting for a worker.
    Waiting,
    /// A worker runs it.
    Running,
    /// Its outcome is decided (settle op and payload), not yet sent to Redis.
    Resolved(Op, Env),
    /// In the acker's current call.
    Settling(Op, Env),
}

/// What the properties need of the past (nothing here is read by the protocol), and the budgets spent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ghost {
    /// Tasks pushed (bit per task).
    pub pushed: u8,
    /// Tasks for which some worker decided "done" (an ack settlement was made).
    pub acked: u8,
    /// Per task: how often a default-mode daemon lost it (documented at-most-once).
    pub lost: [u8; 3],
    /// Tasks charged by a monitor for a crash while their owner held other tasks too.
    pub unfair: u8,
    /// A worker started a task whose token was no longer in its owner's processing hash (a monitor had recovered
    /// it: another daemon may be running it).
    pub zombie: bool,
    /// A running limit held a claim back (see [`EVENT_HELD_BACK`]) at some point: kept for the whole history
    /// (so that "every task is done" can be asked of histories in which the limit was in play), which only the
    /// scenarios with a limit that binds pay for.
    pub held_back: bool,
    /// Tasks whose handler has answered throttle ([`Behaviour::Throttles`]): the handler's world (the service
    /// it calls has pushed back once), read by the policy's stand-in; the envelope does not change.
    pub throttled: u8,
    /// A throttle settlement was applied and the task was not then at its ready list exactly as it was taken
    /// (charged, changed, or dead-lettered).
    pub throttle_charged: bool,
    /// A claim or a pop took a task while the queue's throttle key existed.
    pub took_while_throttled: bool,
    /// A claim or a pop under a running limit took a task while `running` was at the caller's `max_running`,
    /// or took more than it left.
    pub over_admitted: bool,
    /// What the step into this state did (the `EVENT_*` bits), for the `sometimes` properties. Only the last
    /// step's: bits kept for the whole history would multiply the states by every combination of past events.
    pub events: u32,
    pub crashes: u8,
    pub stalls: u8,
    pub lost_replies: u8,
    pub shutdowns: u8,
}

/// The number of the call a settling party is making (see [`Calls`]).
pub const CALL: u8 = 1;

/// A lost claim's tasks were adopted.
pub const EVENT_ADOPTED: u32 = 1 << 0;
/// A claim that ran late was refused with FENCED.
pub const EVENT_FENCED: u32 = 1 << 1;
/// A settle call sent again was answered from its stored last call.
pub const EVENT_ANSWERED: u32 = 1 << 2;
/// An owner's settlement was stale (a monitor had recovered the task first).
pub const EVENT_STALE: u32 = 1 << 3;
/// A monitor recovered a task at a level its own config does not have.
pub const EVENT_RECOVERED_UNSERVED: u32 = 1 << 4;
/// A monitor released an expired owner.
pub const EVENT_RELEASED: u32 = 1 << 5;
/// A default-mode settlement was applied.
pub const EVENT_DEFAULT_SETTLED: u32 = 1 << 6;
/// A claim took a quarantined group of more than one task.
pub const EVENT_GROUP: u32 = 1 << 7;
/// A claim took a task from `quarantine:1`, to run alone.
pub const EVENT_ALONE: u32 = 1 << 8;
/// A monitor charged a task its owner ran alone (retry_isolated or dead).
pub const EVENT_CHARGED: u32 = 1 << 9;
/// A default-mode pop took quarantined tasks.
pub const EVENT_POPPED_QUARANTINE: u32 = 1 << 10;
/// A running limit held a claim back: it took fewer tasks than the same claim without the limit would have.
pub const EVENT_HELD_BACK: u32 = 1 << 11;
/// A throttle held a claim back: it took nothing (state 6) where the same claim without the key would have
/// taken tasks.
pub const EVENT_THROTTLE_HELD: u32 = 1 << 12;
/// A monitor's release.lua gave an expired default-mode owner's share of `running` back.
pub const EVENT_SHARE_RELEASED: u32 = 1 << 13;
/// A default-mode settle ended tasks whose share release.lua had already given back: it subtracted less.
pub const EVENT_SHARE_GONE: u32 = 1 << 14;
/// A pop under a running limit was refused with LEASELOST (a pop that ran late, after its owner was given up
/// and its lease ran out).
pub const EVENT_POP_REFUSED: u32 = 1 << 15;

/// How a call's reply fares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    Delivered,
    /// The script ran; its reply was lost (a reset, a stall past the read timeout).
    Lost,
    /// The request never reached Redis (for a claim: it is still on its way and may run later).
    Unsent,
}

/// One step: a script call (named by its script) or a daemon's local step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// push.lua: a producer enqueues task N.
    Push(u8),
    /// register.lua: the fetcher registers a new owner (or sends a lost registration again).
    Register { daemon: u8, reply: Reply },
    /// claim.lua: the fetcher claims up to `max` tasks under its owner.
    Claim { daemon: u8, max: u8, reply: Reply },
    /// claim.lua: a claim sent earlier (reply given up for lost) finally runs in Redis.
    ClaimArrives(ClaimCall),
    /// adopt.lua: the fetcher learns what its lost claim took, and fences it off.
    Adopt(u8),
    /// pop.lua or LMPOP (default mode): the fetcher pops up to `max` tasks. Under a running limit the reply may
    /// be lost (the pop ran, or is still on its way): its tasks are lost (at most once) and the daemon gives its
    /// owner up (`ownership.lose`), so that the share counted under it comes back once its lease runs out.
    Pop { daemon: u8, max: u8, reply: Reply },
    /// pop.lua: a pop sent earlier (reply given up for lost) finally runs in Redis; nobody reads its reply.
    PopArrives(PopCall),
    /// A worker starts task N; a pill's run crashes the daemon (which restarts with the same config). In safe
    /// mode the handler of any other task returns in the same step (see `step`), and the worker starts it only
    /// while the lease of the task's owner is believed good (worker.rs `lease_allows`).
    StartRun { daemon: u8, task: u8 },
    /// Default mode: a worker's handler returns for task N, and the policy decides the settlement. (With
    /// [`Setup::orphans`], also a safe-mode pill's handler, which crashes the daemon.)
    FinishRun { daemon: u8, task: u8 },
    /// An orphaned pill's handler crashes its daemon (which restarts with the same config).
    OrphanCrash(u8),
    /// settle.lua (fence "owner"): the acker applies the resolved tasks of one holder (the claims' owner, the
    /// popping owner, or nobody).
    Settle {
        daemon: u8,
        holder: Holder,
        reply: Reply,
    },
    /// settle.lua: the acker sends its lost call again, as the same call.
    Resend { daemon: u8, reply: Reply },
    /// renew.lua answers 0: the heartbeat (or a claim's LEASELOST) finds the lease lost; the daemon forgets the
    /// owner's unresolved tasks and registers a new owner.
    RenewLost(u8),
    /// renew.lua answers 1 while the daemon's belief outlives the deadline (see [`Daemon::outliving`]: only with
    /// [`Mutation::RegisterRetryKeepsLease`]): the heartbeat's renewal runs after the registration was sent, so
    /// the belief is within the lease again. (Any other renewal of a live lease changes nothing this model keeps.)
    Renew(u8),
    /// `good_until` passes (time) while the daemon's belief outlives an expired deadline (only with
    /// [`Mutation::RegisterRetryKeepsLease`]): workers start nothing more under that owner.
    Lapse(u8),
    /// An owner's lease runs out: its daemon crashed, was restarted, is paused or failed to renew.
    Expire(OwnerId),
    /// kill -9, and a restart (possibly with another config: a rolling change).
    Crash { daemon: u8, config: u8 },
    /// The monitor: reads an expired owner's processing hash at one level, decides per task (policy.rs), and
    /// applies it with settle.lua (fence "expired").
    MonitorRecover {
        daemon: u8,
        owner: OwnerId,
        level: u8,
        reply: Reply,
    },
    /// settle.lua: the monitor sends its lost call again, as the same call.
    MonitorResend { daemon: u8, reply: Reply },
    /// release.lua (fence "expired"): the monitor forgets an expired owner that holds nothing.
    Release { daemon: u8, owner: OwnerId },
    /// promote.lua: a retry is due and goes to the front of its ready list.
    Promote { level: u8, task: u8 },
    /// The queue's throttle key expires (time): claims and pops take tasks again.
    ThrottleEnds,
    /// SIGTERM: stop claiming; every unresolved task is handed back (settle op "back").
    Shutdown(u8),
    /// release.lua (fence "owner") once everything is settled, then the daemon starts again (with `config`).
    ReleaseOwn { daemon: u8, config: u8 },
}

/// The model of one [`Setup`].
pub struct Protocol {
    pub setup: Setup,
    /// Explore each state once up to renumbering and the daemons' symmetry ([`crate::canon`]). Off for
    /// counterexamples meant to be read: ids and daemons would otherwise be renamed midway through a trace.
    pub reduce: bool,
}

impl Protocol {
    pub fn new(setup: Setup) -> Protocol {
        Protocol {
            setup,
            reduce: true,
        }
    }

    fn config(&self, daemon: &Daemon) -> Config {
        self.setup.configs[daemon.config as usize]
    }

    fn behaviour(&self, task: u8) -> Behaviour {
        self.setup.tasks[task as usize].0
    }

    fn free(&self, daemon: &Daemon) -> u8 {
        let reserved = daemon.lost_claim.map_or(0, |claim| claim.max);
        self.setup
            .slots
            .saturating_sub(daemon.held.len() as u8 + reserved)
    }

    /// The reply outcomes a call may have: lost ones only while the budget lasts.
    fn replies(&self, state: &State) -> &'static [Reply] {
        if state.ghost.lost_replies < self.setup.lost_replies {
            &[Reply::Delivered, Reply::Lost, Reply::Unsent]
        } else {
            &[Reply::Delivered]
        }
    }

    /// The levels a monitor recovers an expired owner at: the ones it registered (monitor.rs: "The owner's own
    /// levels, whatever this daemon's config says").
    fn recovery_levels(&self, state: &State, monitor: &Daemon, owner: OwnerId) -> Levels {
        if self.setup.mutation == Some(Mutation::MonitorOwnLevels) {
            return self.config(monitor).levels;
        }
        state
            .redis
            .owner(owner)
            .map_or(self.config(monitor).levels, |owner| owner.levels)
    }

    /// Whether some running daemon claims under `owner` (its heartbeat renews it).
    fn is_current(state: &State, owner: OwnerId) -> bool {
        state.daemons.iter().any(|d| d.owner == Some(owner))
    }

    /// policy::decide for a task whose handler returned (the worker's verdict). `throttled`: the task's handler
    /// has answered throttle before.
    fn finish(&self, env: Env, throttled: bool) -> (Op, Env) {
        let charged = Env {
            attempt: env.attempt + 1,
            ..env
        };
        match self.behaviour(env.task) {
            Behaviour::Flaky if env.attempt == 0 => {
                // HandlerError: out of retries -> dead; else retry after the backoff (to the retry zset).
                if env.attempt >= self.setup.retry_times {
                    (Op::Dead, env)
                } else {
                    (Op::Retry, charged)
                }
            }
            // Throttle -> the envelope as it was, uncharged (policy.rs: never dead-lettered for it).
            Behaviour::Throttles if !throttled => (Op::Throttle, env),
            // Done -> ack. (A pill never returns: its run crashes the daemon.)
            _ => (Op::Ack, env),
        }
    }

    /// The monitor's decision for one task of an expired owner (monitor.rs `recover_batch`, policy.rs
    /// `LeaseExpired`): the owner ran a quarantined group of 1 (`group == Some(1)`), so its task ran alone and is
    /// charged; any other is recovered uncharged, to the ready front or the quarantine stage of
    /// `quarantine_stage(recovered + 1)`.
    fn recover(&self, group: Option<u8>, level: u8, token: u8, claim: u8, env: Env) -> Record {
        let ran_alone = group == Some(1);
        let (op, payload) = if ran_alone {
            if env.attempt >= self.setup.retry_times {
                (Op::Dead, env)
            } else {
                let charged = Env {
                    attempt: env.attempt + 1,
                    ..env
                };
                (Op::RetryIsolated, charged)
            }
        } else {
            let recovered = Env {
                recovered: (env.recovered + 1).min(RECOVERED_MAX),
                ..env
            };
            let op = match quarantine_stage(env.recovered + 1) {
                Some(stage) => Op::RecoverIsolated(stage),
                None => Op::Recover,
            };
            (op, recovered)
        };
        Record {
            op,
            token: Some(token),
            claim,
            level,
            payload,
            charged: ran_alone,
        }
    }

    /// `Fetcher::lost_lease` / the heartbeat: forgets `owner` if it is still current, with its unresolved
    /// tasks (`Lane::forget_owner`); resolved ones are still settled, fenced by their tokens.
    fn lost_lease(daemon: &mut Daemon, owner: OwnerId) {
        if daemon.owner == Some(owner) {
            daemon.owner = None;
            daemon.outliving = false;
            let mut orphan = false;
            daemon.held.retain(|held| {
                let forgotten = held.owner == Some(owner)
                    && matches!(held.phase, Phase::Waiting | Phase::Running);
                // Only a pill is ever Running in safe mode (with `Setup::orphans`).
                orphan |= forgotten && held.phase == Phase::Running;
                !forgotten
            });
            daemon.orphan |= orphan;
        }
    }

    /// A daemon process ends (crash or graceful stop) and a new one starts with `config`. What it held in
    /// memory is gone: in safe mode it is still in Redis; in default mode it is lost.
    fn restart(state: &mut State, index: usize, config: u8) {
        let daemon = &state.daemons[index];
        for held in &daemon.held {
            let in_redis = matches!(held.phase, Phase::Settling(..)) && daemon.acker.applied;
            if held.token.is_none() && !in_redis {
                state.ghost.lost[held.env.task as usize] += 1;
            }
        }
        let run = daemon.run;
        if let Some(owner) = daemon.owner {
            // Ghost: what ended this owner's lease was a crash of a task it did not hold.
            if daemon.orphan {
                state.redis.crashed_by_orphan(owner);
            }
        }
        // That run's settle records can never be read again (see `Redis::settled`).
        state
            .redis
            .settled
            .retain(|(settler, _)| !(settler.daemon == index as u8 && settler.run == run));
        state.daemons[index] = Daemon {
            config,
            run: run + 1,
            ..fresh_daemon(config)
        };
    }

    /// The acker's current call: its records (the held tasks in `Settling`) and their holder.
    fn acker_call(daemon: &Daemon) -> (Holder, List<Record>) {
        let mut holder = Holder::Nobody;
        let records = daemon
            .held
            .iter()
            .filter_map(|held| match held.phase {
                Phase::Settling(op, payload) => {
                    holder = held.holder();
                    Some(Record {
                        op,
                        token: held.token,
                        claim: held.claim,
                        level: held.level,
                        payload,
                        charged: false,
                    })
                }
                _ => None,
            })
            .collect();
        (holder, records)
    }

    /// Sends the acker's current call (a new one, or the lost one again), and takes in the reply if it comes.
    fn send_acker_call(&self, state: &mut State, index: usize, reply: Reply) {
        let daemon = &state.daemons[index];
        let (holder, records) = Self::acker_call(daemon);
        // Ghost: each throttled task's envelope as the claim or pop gave it, to compare with what Redis holds
        // after the settle.
        let throttled: List<(u8, Env)> = daemon
            .held
            .iter()
            .filter(|held| matches!(held.phase, Phase::Settling(Op::Throttle, _)))
            .map(|held| (held.level, held.env))
            .collect();
        let settler = Settler {
            daemon: index as u8,
            run: daemon.run,
            monitor: false,
        };
        let call = CALL;
        if reply != Reply::Unsent {
            let share = match holder {
                Holder::Popped(popper) => state.redis.share(popper),
                _ => 0,
            };
            let answer = state.redis.settle(
                settler,
                call,
                Fence::Owner,
                holder,
                &records,
                self.setup.mutation,
            );
            state.ghost.unfair |= answer.unfair;
            if answer.answered_from_record {
                state.ghost.events |= EVENT_ANSWERED;
            }
            if answer.applied.iter().any(|ok| !ok) {
                state.ghost.events |= EVENT_STALE;
            }
            let ended = answer.applied.iter().filter(|ok| **ok).count();
            if holder.claimed().is_none() && ended > 0 {
                state.ghost.events |= EVENT_DEFAULT_SETTLED;
            }
            if matches!(holder, Holder::Popped(_)) && ended > usize::from(share) {
                state.ghost.events |= EVENT_SHARE_GONE;
            }
            if !answer.answered_from_record {
                state.daemons[index].acker.applied = true;
            }
            for (record, ok) in records.iter().zip(&answer.applied) {
                if !ok || record.op != Op::Throttle {
                    continue;
                }
                let Some(&(level, taken)) = throttled
                    .iter()
                    .find(|(_, env)| env.task == record.payload.task)
                else {
                    continue;
                };
                let requeued = state.redis.ready[level as usize].contains(&taken);
                let dead = state.redis.dead.iter().any(|e| e.task == taken.task);
                if !requeued || dead {
                    state.ghost.throttle_charged = true;
                }
            }
        }
        if reply == Reply::Delivered {
            // The party has its answer and never sends this call again: its record is dead data (see `Calls`).
            state.redis.new_call(settler);
        }
        let daemon = &mut state.daemons[index];
        if reply == Reply::Delivered {
            // Settled (applied or stale): forgotten, its capacity free again.
            daemon
                .held
                .retain(|held| !matches!(held.phase, Phase::Settling(..)));
            daemon.acker.lost = false;
            daemon.acker.applied = false;
        } else {
            daemon.acker.lost = true;
            state.ghost.lost_replies += 1;
        }
    }

    /// Sends the monitor's call for `owner` (a new one, or the lost one again).
    fn send_monitor_call(
        &self,
        state: &mut State,
        index: usize,
        owner: OwnerId,
        records: List<Record>,
        reply: Reply,
    ) {
        let daemon = &state.daemons[index];
        let settler = Settler {
            daemon: index as u8,
            run: daemon.run,
            monitor: true,
        };
        let own_levels = self.config(daemon).levels;
        let call = CALL;
        if reply != Reply::Unsent {
            let answer = state.redis.settle(
                settler,
                call,
                Fence::Expired,
                Holder::Claimed(owner),
                &records,
                self.setup.mutation,
            );
            state.ghost.unfair |= answer.unfair;
            if answer.answered_from_record {
                state.ghost.events |= EVENT_ANSWERED;
            }
            let charged = records
                .iter()
                .zip(&answer.applied)
                .any(|(record, ok)| *ok && record.charged);
            if charged {
                state.ghost.events |= EVENT_CHARGED;
            }
            let unserved = records
                .iter()
                .zip(&answer.applied)
                .any(|(record, ok)| *ok && !own_levels.contains(record.level));
            if unserved {
                state.ghost.events |= EVENT_RECOVERED_UNSERVED;
            }
        }
        if reply == Reply::Delivered {
            state.redis.new_call(settler);
        }
        let daemon = &mut state.daemons[index];
        if reply == Reply::Delivered {
            daemon.monitor.lost = false;
            daemon.monitor_call = None;
        } else {
            daemon.monitor.lost = true;
            daemon.monitor_call = Some((owner, records));
            state.ghost.lost_replies += 1;
        }
    }

    /// The held task `task` that is waiting (or, `running`, running), for StartRun / FinishRun.
    fn find(daemon: &Daemon, task: u8, running: bool) -> Option<usize> {
        daemon.held.iter().position(|held| {
            held.env.task == task
                && if running {
                    held.phase == Phase::Running
                } else {
                    held.phase == Phase::Waiting
                }
        })
    }

    /// A worker's handler returned for held task `at`: the policy decides its settlement.
    fn resolve(&self, state: &mut State, index: usize, at: usize) {
        let held = &mut state.daemons[index].held[at];
        let task = held.env.task;
        let (op, payload) = self.finish(held.env, state.ghost.throttled & (1 << task) != 0);
        if op == Op::Throttle {
            state.ghost.throttled |= 1 << task;
        }
        if op == Op::Ack {
            state.ghost.acked |= 1 << held.env.task;
        }
        held.phase = Phase::Resolved(op, payload);
        state.daemons[index].held.sort();
    }

    /// claim.lua on `state`, with the events of its answer. Whether the running limit held it back is told by
    /// running the same claim without the limit on a copy, when the limit leaves less than it asks for.
    fn claim(&self, state: &mut State, call: &ClaimCall) -> Claimed {
        let unlimited = Self::without_limit(&state.redis, call.max_running, call.max, |redis| {
            let call = ClaimCall {
                max_running: 0,
                ..*call
            };
            redis.claim(&call, self.setup.mutation).tasks().len()
        });
        let throttled = state.redis.throttle;
        let before = state.redis.running;
        let claimed = state.redis.claim(call, self.setup.mutation);
        if throttled && !claimed.tasks().is_empty() {
            state.ghost.took_while_throttled = true;
        }
        Self::check_admission(state, call.max_running, before, claimed.tasks().len());
        if claimed == Claimed::Throttled {
            let mut redis = state.redis.clone();
            redis.throttle = false;
            if !redis.claim(call, self.setup.mutation).tasks().is_empty() {
                state.ghost.events |= EVENT_THROTTLE_HELD;
            }
        }
        state.ghost.events |= Self::claim_events(&claimed);
        Self::held_back(state, unlimited, claimed.tasks().len());
        claimed
    }

    /// How many tasks a take that asks for `max` under `max_running` would take without the limit (`take` on a
    /// copy of Redis), when the limit leaves less than it asks for; `None` otherwise.
    fn without_limit(
        redis: &Redis,
        max_running: u8,
        max: u8,
        take: impl FnOnce(&mut Redis) -> usize,
    ) -> Option<usize> {
        let capped = max_running > 0 && max > max_running.saturating_sub(redis.running);
        capped.then(|| take(&mut redis.clone()))
    }

    /// Ghost: a limit held a take back, when it took fewer than `unlimited` (see [`Self::without_limit`]).
    fn held_back(state: &mut State, unlimited: Option<usize>, took: usize) {
        if unlimited.is_some_and(|n| n > took) {
            state.ghost.events |= EVENT_HELD_BACK;
            state.ghost.held_back = true;
        }
    }

    /// Ghost: a take under a running limit of `max_running` that found `before` in `running` and took `took`
    /// admitted only while the count was below its limit, and no more than the limit left.
    fn check_admission(state: &mut State, max_running: u8, before: u8, took: usize) {
        let admitted = max_running == 0
            || took == 0
            || (before < max_running && before as usize + took <= max_running as usize);
        if !admitted {
            state.ghost.over_admitted = true;
        }
    }

    /// pop.lua on `state`, with the events of its answer (a limit that held it back: as for a claim).
    fn pop(&self, state: &mut State, call: &PopCall) -> Popped {
        let mutation = self.setup.mutation;
        let unlimited = Self::without_limit(&state.redis, call.max_running, call.max, |redis| {
            let call = PopCall {
                max_running: 0,
                ..*call
            };
            redis.pop(&call, mutation).tasks().len()
        });
        let quarantined = (0..3).any(|stage| {
            call.levels
                .iter()
                .any(|level| !state.redis.quarantine[stage][level as usize].is_empty())
        });
        let throttled = state.redis.throttle;
        let before = state.redis.running;
        let popped = state.redis.pop(call, mutation);
        let took = popped.tasks().len();
        if throttled && took > 0 {
            state.ghost.took_while_throttled = true;
        }
        Self::check_admission(state, call.max_running, before, took);
        if quarantined && took > 0 && mutation != Some(Mutation::PopReadyOnly) {
            state.ghost.events |= EVENT_POPPED_QUARANTINE;
        }
        if popped == Popped::LeaseLost {
            state.ghost.events |= EVENT_POP_REFUSED;
        } else {
            Self::held_back(state, unlimited, took);
        }
        popped
    }

    /// The events of a claim's answer: a quarantined group of more than one task, or a group of 1.
    fn claim_events(claimed: &Claimed) -> u32 {
        match claimed {
            Claimed::Group(1, _) => EVENT_ALONE,
            Claimed::Group(_, took) if took.len() > 1 => EVENT_GROUP,
            _ => 0,
        }
    }

    /// Whether a worker may start a task held under `owner` (worker.rs `lease_allows`, `Ownership::may_start`):
    /// the owner is the daemon's current one and its lease believed good. The model keeps no clock: believed good
    /// is "live in Redis" (what `good_until` implies, see [`Daemon::outliving`]) or, while the belief outlives the
    /// deadline (only with [`Mutation::RegisterRetryKeepsLease`]), also once the deadline has passed. (A belief
    /// that lapses while Redis's lease is live only delays a start, which the interleavings cover.)
    fn may_start(&self, state: &State, daemon: &Daemon, owner: Option<OwnerId>) -> bool {
        let Some(owner) = owner else {
            // Default mode: no lease to check.
            return true;
        };
        if self.setup.mutation == Some(Mutation::NoLeaseCheck) {
            return true;
        }
        daemon.owner == Some(owner) && (state.redis.is_live(owner) || daemon.outliving)
    }

    /// Holds what a claim (under `owner`) or a pop (popped by `popper` under a limit) took.
    fn hold(
        daemon: &mut Daemon,
        owner: Option<OwnerId>,
        popper: Option<OwnerId>,
        claim: u8,
        took: &[(u8, u8, Env)],
    ) {
        for &(level, token, env) in took {
            daemon.held.push(Held {
                owner,
                token: owner.map(|_| token),
                claim,
                popped_by: popper,
                level,
                env,
                phase: Phase::Waiting,
            });
        }
        daemon.held.sort();
    }

    /// Whether no action is possible. Cheap necessary conditions first (a spare crash, a task still to push or
    /// held, a call still to answer each leave something to do): this runs on every state.
    pub fn is_terminal(&self, state: &State) -> bool {
        let ghost = &state.ghost;
        let busy = ghost.crashes < self.setup.crashes
            || ghost.shutdowns < self.setup.shutdowns
            || ghost.pushed.count_ones() < self.setup.tasks.len() as u32
            || !state.in_flight.is_empty()
            || !state.pops_in_flight.is_empty()
            || state.redis.throttle
            || state.daemons.iter().any(|d| {
                !d.held.is_empty() || d.lost_claim.is_some() || d.acker.lost || d.monitor.lost
            });
        if busy {
            return false;
        }
        let mut actions = Vec::new();
        self.actions(state, &mut actions);
        actions
            .into_iter()
            .all(|action| self.next_state(state, action).is_none())
    }

    /// How many places task `task` is in (it must be exactly one once pushed).
    pub fn places(state: &State, task: u8) -> usize {
        let redis = &state.redis;
        let is = |env: &Env| env.task == task;
        let lists: usize = (0..2)
            .map(|l| {
                redis.ready[l].iter().filter(|e| is(e)).count()
                    + (0..3)
                        .map(|stage| redis.quarantine[stage][l].iter().filter(|e| is(e)).count())
                        .sum::<usize>()
                    + redis.retry[l].iter().filter(|e| is(e)).count()
            })
            .sum();
        let processing = redis.processing.iter().filter(|p| is(&p.env)).count();
        let dead = redis.dead.iter().filter(|e| is(e)).count();
        // A default-mode task exists only in its daemon's memory until its settlement is applied.
        let memory: usize = state
            .daemons
            .iter()
            .map(|daemon| {
                daemon
                    .held
                    .iter()
                    .filter(|held| {
                        held.token.is_none()
                            && is(&held.env)
                            && !(matches!(held.phase, Phase::Settling(..)) && daemon.acker.applied)
                    })
                    .count()
            })
            .sum();
        lists
            + processing
            + dead
            + memory
            + redis.done[task as usize] as usize
            + state.ghost.lost[task as usize] as usize
    }
}

fn fresh_daemon(config: u8) -> Daemon {
    Daemon {
        config,
        run: 0,
        generation: 0,
        owner: None,
        outliving: false,
        registering: None,
        next_token: 0,
        held: List::new(),
        lost_claim: None,
        acker: Calls::default(),
        monitor: Calls::default(),
        monitor_call: None,
        stopping: false,
        orphan: false,
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let [a, b] = self.setup.initial;
        vec![State {
            redis: Redis::default(),
            daemons: [fresh_daemon(a), fresh_daemon(b)],
            in_flight: List::new(),
            pops_in_flight: List::new(),
            ghost: Ghost::default(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let setup = &self.setup;
        let ghost = &state.ghost;
        for task in 0..setup.tasks.len() as u8 {
            if ghost.pushed & (1 << task) == 0 {
                actions.push(Action::Push(task));
            }
        }
        for (index, daemon) in state.daemons.iter().enumerate() {
            let d = index as u8;
            let config = self.config(daemon);
            let free = self.free(daemon);
            if !daemon.stopping {
                match config.mode {
                    Mode::Safe => {
                        if daemon.lost_claim.is_some() {
                            actions.push(Action::Adopt(d));
                        } else if daemon.owner.is_none() {
                            for &reply in self.replies(state) {
                                if reply != Reply::Unsent {
                                    actions.push(Action::Register { daemon: d, reply });
                                }
                            }
                        } else if free > 0
                            && daemon.owner.is_some_and(|owner| state.redis.is_live(owner))
                        {
                            // A claim under an owner whose lease ran out is refused with LEASELOST, which
                            // RenewLost covers. It asks for every free slot (the fetcher's `want`).
                            for &reply in self.replies(state) {
                                actions.push(Action::Claim {
                                    daemon: d,
                                    max: free,
                                    reply,
                                });
                            }
                        }
                    }
                    Mode::Default if config.max_running > 0 => {
                        // Under a running limit the pops count under the daemon's owner: registered first.
                        if daemon.owner.is_none() {
                            for &reply in self.replies(state) {
                                if reply != Reply::Unsent {
                                    actions.push(Action::Register { daemon: d, reply });
                                }
                            }
                        } else if free > 0
                            && daemon.owner.is_some_and(|owner| {
                                state.redis.is_live(owner)
                                    || setup.mutation == Some(Mutation::PopWithoutLeaseCheck)
                            })
                        {
                            // A pop under an owner whose lease ran out is refused with LEASELOST, which RenewLost
                            // covers (pop.lua as it was, without the check, took tasks under it).
                            for &reply in self.replies(state) {
                                actions.push(Action::Pop {
                                    daemon: d,
                                    max: free,
                                    reply,
                                });
                            }
                        }
                    }
                    Mode::Default => {
                        // Without a limit a lost pop reply loses its tasks and nothing else: not explored.
                        if free > 0 {
                            actions.push(Action::Pop {
                                daemon: d,
                                max: free,
                                reply: Reply::Delivered,
                            });
                        }
                    }
                }
                for held in &daemon.held {
                    match held.phase {
                        Phase::Waiting if self.may_start(state, daemon, held.owner) => actions
                            .push(Action::StartRun {
                                daemon: d,
                                task: held.env.task,
                            }),
                        Phase::Running => actions.push(Action::FinishRun {
                            daemon: d,
                            task: held.env.task,
                        }),
                        _ => {}
                    }
                }
                if ghost.shutdowns < setup.shutdowns {
                    actions.push(Action::Shutdown(d));
                }
            }
            // The acker.
            if daemon.acker.lost {
                for &reply in self.replies(state) {
                    actions.push(Action::Resend { daemon: d, reply });
                }
            } else {
                let mut holders: Vec<Holder> = Vec::new();
                for held in &daemon.held {
                    if matches!(held.phase, Phase::Resolved(..))
                        && !holders.contains(&held.holder())
                    {
                        holders.push(held.holder());
                    }
                }
                for holder in holders {
                    for &reply in self.replies(state) {
                        actions.push(Action::Settle {
                            daemon: d,
                            holder,
                            reply,
                        });
                    }
                }
            }
            // The heartbeat, and the belief in the lease.
            if let Some(owner) = daemon.owner {
                let live = state.redis.is_live(owner);
                if !live {
                    actions.push(Action::RenewLost(d));
                }
                if daemon.outliving {
                    actions.push(if live {
                        Action::Renew(d)
                    } else {
                        Action::Lapse(d)
                    });
                }
                if !live && self.setup.mutation == Some(Mutation::RenewExpired) {
                    actions.push(Action::Renew(d));
                }
            }
            // The monitor.
            if daemon.monitor.lost {
                for &reply in self.replies(state) {
                    actions.push(Action::MonitorResend { daemon: d, reply });
                }
            } else {
                for owner in &state.redis.owners {
                    if owner.lease != Lease::Expired {
                        continue;
                    }
                    let levels = self.recovery_levels(state, daemon, owner.id);
                    for level in levels.iter() {
                        if state.redis.held_by(owner.id, level).next().is_some() {
                            for &reply in self.replies(state) {
                                actions.push(Action::MonitorRecover {
                                    daemon: d,
                                    owner: owner.id,
                                    level,
                                    reply,
                                });
                            }
                        }
                    }
                    actions.push(Action::Release {
                        daemon: d,
                        owner: owner.id,
                    });
                }
            }
            if daemon.orphan {
                actions.push(Action::OrphanCrash(d));
            }
            if ghost.crashes < setup.crashes {
                for config in 0..setup.configs.len() as u8 {
                    actions.push(Action::Crash { daemon: d, config });
                }
            }
            if daemon.stopping && daemon.held.is_empty() && !daemon.acker.lost {
                for config in 0..setup.configs.len() as u8 {
                    actions.push(Action::ReleaseOwn { daemon: d, config });
                }
            }
        }
        for call in &state.in_flight {
            actions.push(Action::ClaimArrives(*call));
        }
        for call in &state.pops_in_flight {
            actions.push(Action::PopArrives(*call));
        }
        for owner in &state.redis.owners {
            if owner.lease == Lease::Live
                && (!Self::is_current(state, owner.id) || ghost.stalls < setup.stalls)
            {
                actions.push(Action::Expire(owner.id));
            }
        }
        if state.redis.throttle {
            actions.push(Action::ThrottleEnds);
        }
        for level in 0..2u8 {
            for env in &state.redis.retry[level as usize] {
                actions.push(Action::Promote {
                    level,
                    task: env.task,
                });
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        state.ghost.events = 0;
        let state = self.step(state, action)?;
        Some(if self.reduce {
            crate::canon::canonical(state, self.setup.mutation)
        } else {
            state
        })
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let setup = &self.setup;
        let mut properties = vec![
            Property::always("conservation", conservation),
            Property::always("held tasks are in Redis", held_in_redis),
            Property::always("no stranded task", no_stranded_task),
            Property::always("settled once", settled_once),
            Property::always("drained at rest", drained_at_rest),
            Property::always(UNFAIR_CHARGE, charged_only_alone),
            Property::always(UNFAIR_DEAD, never_dead_for_a_neighbour),
            Property::always(ZOMBIE_START, no_zombie_start),
            Property::sometimes("every task that can finish is done", all_done),
            Property::sometimes("everything comes to rest", |model, state| {
                model.is_terminal(state)
            }),
        ];
        let has = |behaviour| setup.tasks.iter().any(|(b, _)| *b == behaviour);
        if has(Behaviour::Pill) {
            properties.push(Property::sometimes(
                "the pill is dead-lettered and the others are done",
                pill_dead_others_done,
            ));
            if setup.recovered < 3 {
                // (Tasks pushed as recovered three times go to `quarantine:1` when they come back.)
                properties.push(Property::sometimes(
                    "a quarantined group of more than one task is claimed",
                    happened::<EVENT_GROUP>,
                ));
            }
            properties.push(Property::sometimes(
                "a quarantined task is claimed to run alone",
                happened::<EVENT_ALONE>,
            ));
            properties.push(Property::sometimes(
                "a crash while a task ran alone is charged to it",
                happened::<EVENT_CHARGED>,
            ));
        }
        if setup.lost_replies > 0 {
            properties.push(Property::sometimes(
                "a settle call sent again is answered from its record",
                happened::<EVENT_ANSWERED>,
            ));
            if setup.configs.iter().any(|c| c.mode == Mode::Safe) {
                properties.push(Property::sometimes(
                    "a lost claim's tasks are adopted",
                    happened::<EVENT_ADOPTED>,
                ));
                properties.push(Property::sometimes(
                    "a claim that runs late is fenced",
                    happened::<EVENT_FENCED>,
                ));
            }
        }
        if setup.stalls > 0 {
            properties.push(Property::sometimes(
                "a late settlement is stale",
                happened::<EVENT_STALE>,
            ));
        }
        properties.push(Property::sometimes(
            "a monitor releases an expired owner",
            happened::<EVENT_RELEASED>,
        ));
        let levels: Vec<Levels> = setup.configs.iter().map(|c| c.levels).collect();
        if levels.iter().any(|l| *l != levels[0]) {
            properties.push(Property::sometimes(
                "a monitor recovers a task at a level its own config lacks",
                happened::<EVENT_RECOVERED_UNSERVED>,
            ));
        }
        let limit = setup.configs.iter().map(|c| c.max_running).max();
        if let Some(limit) = limit.filter(|limit| *limit > 0) {
            properties.push(Property::always(RUNNING_EXACT, running_exact));
            properties.push(Property::always(RUNNING_BOUND, never_above_the_limit));
            properties.push(Property::always(NO_UNDERFLOW, no_underflow));
            properties.push(Property::always(NO_LEAK, nothing_leaks_at_rest));
            properties.push(Property::always(ADMITS_BELOW, |_, state: &State| {
                !state.ghost.over_admitted
            }));
            let popping = setup
                .configs
                .iter()
                .any(|c| c.mode == Mode::Default && c.max_running > 0);
            if popping {
                properties.push(Property::always(SHARE_COMES_BACK, share_comes_back));
                let events: [(bool, &'static str, Condition); 3] = [
                    (
                        setup.crashes + setup.stalls + setup.lost_replies > 0,
                        "a monitor gives an expired owner's share back",
                        happened::<EVENT_SHARE_RELEASED>,
                    ),
                    (
                        setup.stalls > 0,
                        "a settle finds its share given back",
                        happened::<EVENT_SHARE_GONE>,
                    ),
                    (
                        setup.lost_replies > 0,
                        "a pop that runs late is refused",
                        happened::<EVENT_POP_REFUSED>,
                    ),
                ];
                for (possible, name, seen) in events {
                    if possible {
                        properties.push(Property::sometimes(name, seen));
                    }
                }
            }
            let least = setup
                .configs
                .iter()
                .map(|c| c.max_running)
                .filter(|limit| *limit > 0)
                .min()
                .unwrap_or(limit);
            if setup.tasks.len() > least as usize {
                properties.push(Property::sometimes(
                    "a limit held a claim or pop back",
                    happened::<EVENT_HELD_BACK>,
                ));
                properties.push(Property::sometimes(
                    "every task is done after a limit held a claim or pop back",
                    done_after_held_back,
                ));
            }
        }
        if has(Behaviour::Throttles) {
            properties.push(Property::always(THROTTLE_UNCHARGED, |_, state: &State| {
                !state.ghost.throttle_charged
            }));
            properties.push(Property::always(NO_TAKE_THROTTLED, |_, state: &State| {
                !state.ghost.took_while_throttled
            }));
            properties.push(Property::sometimes(
                "a throttle held a claim back",
                happened::<EVENT_THROTTLE_HELD>,
            ));
            properties.push(Property::sometimes(
                "a throttled task was done",
                |model: &Protocol, state: &State| {
                    (0..model.setup.tasks.len()).any(|task| {
                        state.ghost.throttled & (1 << task) != 0 && state.redis.done[task] == 1
                    })
                },
            ));
        }
        if setup.configs.iter().any(|c| c.mode == Mode::Default) {
            properties.push(Property::sometimes(
                "a default-mode settlement is applied",
                happened::<EVENT_DEFAULT_SETTLED>,
            ));
            if setup.recovered > 0 {
                properties.push(Property::sometimes(
                    "a default-mode pop takes quarantined tasks",
                    happened::<EVENT_POPPED_QUARANTINE>,
                ));
            }
        }
        properties
    }
}

impl Protocol {
    /// One action's effect, on a copy of the state.
    fn step(&self, mut state: State, action: Action) -> Option<State> {
        let setup = &self.setup;
        match action {
            Action::Push(task) => {
                state.ghost.pushed |= 1 << task;
                let level = setup.tasks[task as usize].1;
                let env = Env {
                    recovered: setup.recovered,
                    ..Env::new(task)
                };
                state.redis.push(level, env);
            }
            Action::Register { daemon, reply } => {
                let index = daemon as usize;
                let levels = self.config(&state.daemons[index]).levels;
                let d = &mut state.daemons[index];
                let id = match d.registering {
                    Some(id) => id,
                    None => {
                        d.generation += 1;
                        OwnerId {
                            daemon,
                            run: d.run,
                            generation: d.generation,
                        }
                    }
                };
                let (registered, renewed) = state.redis.register(id, levels, setup.mutation);
                let d = &mut state.daemons[index];
                if reply == Reply::Lost {
                    d.registering = Some(id);
                    state.ghost.lost_replies += 1;
                } else {
                    d.registering = None;
                    if registered {
                        // Fetcher::owner: `ownership.set(owner, sent, lease)`, `sent` being this call's. A retry
                        // that found the owner registered by the first call renewed the lease from when it ran,
                        // after it was sent: the belief is within the lease. (With RegisterRetryKeepsLease it
                        // left the first call's deadline, which runs from before this call was sent.)
                        d.owner = Some(id);
                        d.outliving = !renewed;
                    }
                }
            }
            Action::Claim { daemon, max, reply } => {
                let index = daemon as usize;
                let Config {
                    levels,
                    max_running,
                    ..
                } = self.config(&state.daemons[index]);
                let d = &mut state.daemons[index];
                let call = ClaimCall {
                    owner: d.owner?,
                    first: d.next_token,
                    max,
                    levels,
                    max_running,
                };
                d.next_token += max;
                match reply {
                    Reply::Delivered => {
                        let claimed = self.claim(&mut state, &call);
                        if state.ghost.events & EVENT_THROTTLE_HELD != 0 {
                            // Kept as a state only for the `sometimes` "a throttle held a claim back"; the tokens
                            // it reserved are never used, so the counter stays (a repeated claim is this state).
                            state.daemons[index].next_token -= max;
                            return Some(state);
                        }
                        if claimed.tasks().is_empty() {
                            // An empty claim (nothing ready; Waiting: the fetcher waits for its lane to be
                            // empty; Limited: it waits for a wake-up marker) changes nothing but the token
                            // counter: not worth a state. (It may delete a
                            // `group` the owner no longer runs, which is dead data: see `Owner::group`.)
                            return None;
                        }
                        Self::hold(
                            &mut state.daemons[index],
                            Some(call.owner),
                            None,
                            call.first,
                            claimed.tasks(),
                        );
                    }
                    Reply::Lost | Reply::Unsent => {
                        if reply == Reply::Lost {
                            self.claim(&mut state, &call);
                        } else {
                            state.in_flight.push(call);
                            state.in_flight.sort();
                        }
                        state.daemons[index].lost_claim = Some(call);
                        state.ghost.lost_replies += 1;
                    }
                }
            }
            Action::ClaimArrives(call) => {
                let at = state.in_flight.iter().position(|c| *c == call)?;
                state.in_flight.remove(at);
                let claimed = self.claim(&mut state, &call);
                if claimed == Claimed::Fenced {
                    state.ghost.events |= EVENT_FENCED;
                }
            }
            Action::Adopt(daemon) => {
                let index = daemon as usize;
                let lost = state.daemons[index].lost_claim.take()?;
                if setup.mutation == Some(Mutation::NoAdopt) {
                    // The broken fetcher gives the claim up: its capacity is released, its tokens forgotten.
                    return Some(state);
                }
                let levels = self.config(&state.daemons[index]).levels;
                match state.redis.adopt(lost.owner, lost.first, lost.max, levels) {
                    None => Self::lost_lease(&mut state.daemons[index], lost.owner),
                    Some(took) => {
                        if !took.is_empty() {
                            state.ghost.events |= EVENT_ADOPTED;
                        }
                        Self::hold(
                            &mut state.daemons[index],
                            Some(lost.owner),
                            None,
                            lost.first,
                            &took,
                        );
                    }
                }
            }
            Action::Pop { daemon, max, reply } => {
                let index = daemon as usize;
                let Config {
                    levels,
                    max_running,
                    ..
                } = self.config(&state.daemons[index]);
                let owner = if max_running > 0 {
                    Some(state.daemons[index].owner?)
                } else {
                    None
                };
                let call = PopCall {
                    owner,
                    max,
                    levels,
                    max_running,
                };
                match reply {
                    Reply::Delivered => {
                        let popped = self.pop(&mut state, &call);
                        if popped.tasks().is_empty() {
                            // Nothing (nothing ready, Limited, Throttled; LeaseLost is RenewLost's step, and
                            // `actions` offers no pop under an owner whose lease ran out).
                            return None;
                        }
                        let took: List<(u8, u8, Env)> = popped
                            .tasks()
                            .iter()
                            .map(|&(level, env)| (level, 0, env))
                            .collect();
                        Self::hold(&mut state.daemons[index], None, owner, 0, &took);
                    }
                    Reply::Lost | Reply::Unsent => {
                        if reply == Reply::Lost {
                            // It ran: what it took is lost (default mode is at most once).
                            for &(_, env) in self.pop(&mut state, &call).tasks() {
                                state.ghost.lost[env.task as usize] += 1;
                            }
                        } else {
                            state.pops_in_flight.push(call);
                            state.pops_in_flight.sort();
                        }
                        state.ghost.lost_replies += 1;
                        // Fetcher::pop: the owner is given up (renewed no more), so that its lease runs out and a
                        // monitor gives its share back; the next pop registers a new owner. Its earlier pops'
                        // tasks are still held, and settle against its share.
                        if setup.mutation != Some(Mutation::KeepOwnerAfterLostPop) {
                            let d = &mut state.daemons[index];
                            d.owner = None;
                            d.outliving = false;
                        }
                    }
                }
            }
            Action::PopArrives(call) => {
                let at = state.pops_in_flight.iter().position(|c| *c == call)?;
                state.pops_in_flight.remove(at);
                for &(_, env) in self.pop(&mut state, &call).tasks() {
                    state.ghost.lost[env.task as usize] += 1;
                }
            }
            Action::StartRun { daemon, task } => {
                let index = daemon as usize;
                let at = Self::find(&state.daemons[index], task, false)?;
                let held = state.daemons[index].held[at];
                if !self.may_start(&state, &state.daemons[index], held.owner) {
                    return None;
                }
                if let (Some(owner), Some(token)) = (held.owner, held.token) {
                    // Ghost: a run of a task its owner no longer holds in Redis.
                    if !state.redis.hexists(owner, held.level, token) {
                        state.ghost.zombie = true;
                    }
                }
                let held = &mut state.daemons[index].held[at];
                if self.behaviour(task) == Behaviour::Pill
                    && !(setup.orphans && held.token.is_some())
                {
                    let config = state.daemons[index].config;
                    Self::restart(&mut state, index, config);
                } else if held.token.is_some() && self.behaviour(task) != Behaviour::Pill {
                    // Safe mode: nothing tells a waiting task from a running one in Redis, or to the daemon's
                    // other parties (a lost lease forgets both, a graceful stop hands both back), so the run
                    // is one step: the handler returns at once.
                    Self::resolve(self, &mut state, index, at);
                } else {
                    held.phase = Phase::Running;
                    state.daemons[index].held.sort();
                }
            }
            Action::FinishRun { daemon, task } => {
                let index = daemon as usize;
                let at = Self::find(&state.daemons[index], task, true)?;
                if self.behaviour(task) == Behaviour::Pill {
                    let config = state.daemons[index].config;
                    Self::restart(&mut state, index, config);
                } else {
                    Self::resolve(self, &mut state, index, at);
                }
            }
            Action::OrphanCrash(daemon) => {
                let index = daemon as usize;
                if !state.daemons[index].orphan {
                    return None;
                }
                let config = state.daemons[index].config;
                Self::restart(&mut state, index, config);
            }
            Action::Settle {
                daemon,
                holder,
                reply,
            } => {
                let index = daemon as usize;
                let d = &mut state.daemons[index];
                for held in d.held.iter_mut() {
                    if let Phase::Resolved(op, payload) = held.phase {
                        if held.holder() == holder {
                            held.phase = Phase::Settling(op, payload);
                        }
                    }
                }
                d.held.sort();
                let settler = Settler {
                    daemon,
                    run: d.run,
                    monitor: false,
                };
                state.redis.new_call(settler);
                self.send_acker_call(&mut state, index, reply);
            }
            Action::Resend { daemon, reply } => {
                self.send_acker_call(&mut state, daemon as usize, reply);
            }
            Action::RenewLost(daemon) => {
                let d = &mut state.daemons[daemon as usize];
                let owner = d.owner?;
                Self::lost_lease(d, owner);
            }
            Action::Renew(daemon) => {
                let index = daemon as usize;
                let owner = state.daemons[index].owner?;
                if !state.redis.renew(owner, setup.mutation) {
                    return None;
                }
                state.daemons[index].outliving = false;
            }
            Action::Lapse(daemon) => {
                let d = &mut state.daemons[daemon as usize];
                if !d.outliving {
                    return None;
                }
                d.outliving = false;
            }
            Action::Expire(owner) => {
                if Self::is_current(&state, owner) {
                    state.ghost.stalls += 1;
                }
                state.redis.expire(owner);
            }
            Action::Crash { daemon, config } => {
                state.ghost.crashes += 1;
                Self::restart(&mut state, daemon as usize, config);
            }
            Action::MonitorRecover {
                daemon,
                owner,
                level,
                reply,
            } => {
                let index = daemon as usize;
                let group = state.redis.owner(owner)?.group;
                let records: List<Record> = state
                    .redis
                    .held_by(owner, level)
                    .map(|p| self.recover(group, level, p.token, p.claim, p.env))
                    .collect();
                state.redis.new_call(Settler {
                    daemon,
                    run: state.daemons[index].run,
                    monitor: true,
                });
                self.send_monitor_call(&mut state, index, owner, records, reply);
            }
            Action::MonitorResend { daemon, reply } => {
                let index = daemon as usize;
                let (owner, records) = state.daemons[index].monitor_call.clone()?;
                self.send_monitor_call(&mut state, index, owner, records, reply);
            }
            Action::Release { daemon, owner } => {
                let levels = self.recovery_levels(&state, &state.daemons[daemon as usize], owner);
                let (released, share) = state.redis.release(owner, levels, true, setup.mutation);
                if !released {
                    return None;
                }
                state.ghost.events |= EVENT_RELEASED;
                if share > 0 {
                    state.ghost.events |= EVENT_SHARE_RELEASED;
                }
            }
            Action::Promote { level, task } => {
                let at = state.redis.retry[level as usize]
                    .iter()
                    .position(|env| env.task == task)?;
                state.redis.promote(level, at);
            }
            Action::ThrottleEnds => {
                if !state.redis.throttle {
                    return None;
                }
                state.redis.throttle_ends();
            }
            Action::Shutdown(daemon) => {
                state.ghost.shutdowns += 1;
                let index = daemon as usize;
                let d = &mut state.daemons[index];
                d.stopping = true;
                // The fetcher stops: a lost claim's tasks, if it took any, come back through the lease.
                d.lost_claim = None;
                let mut lost = Vec::new();
                let mut orphan = false;
                d.held.retain(|held| {
                    match held.phase {
                        // Safe mode hands back running tasks too (at least once); default mode cannot (they
                        // might run twice at once) and reports them lost.
                        Phase::Running if held.token.is_none() => {
                            lost.push(held.env.task);
                            return false;
                        }
                        Phase::Waiting | Phase::Running => {
                            // A safe-mode pill handed back while it runs (`Setup::orphans`) runs on.
                            orphan |= held.phase == Phase::Running;
                            held.phase = Phase::Resolved(Op::Back, held.env);
                        }
                        _ => {}
                    }
                    true
                });
                d.orphan |= orphan;
                d.held.sort();
                for task in lost {
                    state.ghost.lost[task as usize] += 1;
                }
            }
            Action::ReleaseOwn { daemon, config } => {
                let index = daemon as usize;
                let d = &state.daemons[index];
                if let Some(owner) = d.owner {
                    let levels = self.config(d).levels;
                    state.redis.release(owner, levels, false, setup.mutation);
                }
                Self::restart(&mut state, index, config);
            }
        }
        Some(state)
    }
}

/// Every pushed task is in exactly one place: a ready, quarantine or retry list, some owner's processing hash,
/// the dead list, `done`, a default-mode daemon's memory, or lost by a default-mode daemon (at most once is that
/// mode's documented promise). Unpushed tasks are nowhere.
fn conservation(model: &Protocol, state: &State) -> bool {
    (0..model.setup.tasks.len() as u8).all(|task| {
        let expected = usize::from(state.ghost.pushed & (1 << task) != 0);
        Protocol::places(state, task) == expected
    })
}

/// A task a safe-mode daemon holds under a live lease is in that owner's processing hash (unless its
/// settlement was applied and the reply is on its way).
fn held_in_redis(_: &Protocol, state: &State) -> bool {
    state.daemons.iter().all(|daemon| {
        daemon.held.iter().all(|held| {
            let (Some(owner), Some(token)) = (held.owner, held.token) else {
                return true;
            };
            let settled = matches!(held.phase, Phase::Settling(..)) && daemon.acker.applied;
            settled
                || !state.redis.is_live(owner)
                || state
                    .redis
                    .held_by(owner, held.level)
                    .any(|p| p.token == token && p.env == held.env)
        })
    })
}

/// Every task in a processing hash belongs to a registered owner (so a monitor finds it once the lease runs
/// out), and a live owner's daemon holds every one of its tasks (or is about to adopt it): no task sits under a
/// token nobody holds while the lease that covers it is renewed.
fn no_stranded_task(_: &Protocol, state: &State) -> bool {
    let redis = &state.redis;
    let registered = redis
        .processing
        .iter()
        .all(|p| redis.owner(p.owner).is_some());
    let held = redis.processing.iter().all(|p| {
        if !redis.is_live(p.owner) {
            return true;
        }
        state.daemons.iter().all(|daemon| {
            // A stopping daemon drops its lost claim on purpose: those tasks come back through the lease.
            if daemon.owner != Some(p.owner) || daemon.stopping {
                return true;
            }
            let holds = daemon.held.iter().any(|h| {
                h.owner == Some(p.owner) && h.level == p.level && h.token == Some(p.token)
            });
            let adopting = daemon.lost_claim.is_some_and(|claim| {
                claim.owner == p.owner && (claim.first..claim.first + claim.max).contains(&p.token)
            });
            holds || adopting
        })
    });
    registered && held
}

/// `done` never exceeds the number of tasks some worker finished, and each task has at most one dead record.
fn settled_once(model: &Protocol, state: &State) -> bool {
    let done: u32 = state.redis.done.iter().map(|n| u32::from(*n)).sum();
    let dead_once = (0..model.setup.tasks.len() as u8)
        .all(|task| state.redis.dead.iter().filter(|e| e.task == task).count() <= 1);
    done <= state.ghost.acked.count_ones() && dead_once
}

/// When nothing more can happen, every task is done, dead, lost by a default-mode daemon, or waiting at a level
/// that no running daemon serves.
fn drained_at_rest(model: &Protocol, state: &State) -> bool {
    if !model.is_terminal(state) {
        return true;
    }
    let served = |level: u8| {
        state
            .daemons
            .iter()
            .any(|d| model.config(d).levels.contains(level))
    };
    let redis = &state.redis;
    let waiting = (0..2u8).all(|level| {
        !served(level)
            || (redis.ready[level as usize].is_empty()
                && (0..3).all(|stage| redis.quarantine[stage][level as usize].is_empty()))
    });
    waiting && redis.processing.is_empty() && (0..2).all(|level| redis.retry[level].is_empty())
}

/// A task that never crashes anything is charged for a crash only when its owner held nothing else.
fn charged_only_alone(model: &Protocol, state: &State) -> bool {
    model
        .setup
        .tasks
        .iter()
        .enumerate()
        .all(|(task, (behaviour, _))| {
            *behaviour == Behaviour::Pill || state.ghost.unfair & (1 << task) == 0
        })
}

/// No worker started a task its owner no longer held in Redis.
fn no_zombie_start(_: &Protocol, state: &State) -> bool {
    !state.ghost.zombie
}

/// A property's condition.
type Condition = fn(&Protocol, &State) -> bool;

/// Whether the event `BIT` happened on the way to this state.
fn happened<const BIT: u32>(_: &Protocol, state: &State) -> bool {
    state.ghost.events & BIT != 0
}

/// The consequence that matters of an unfair charge: a task that never crashed anything, dead-lettered as
/// "crashed the daemon N times".
fn never_dead_for_a_neighbour(model: &Protocol, state: &State) -> bool {
    state.redis.dead.iter().all(|env| {
        model.behaviour(env.task) == Behaviour::Pill || state.ghost.unfair & (1 << env.task) == 0
    })
}

/// `running`'s `q` is the number of positions of counted claim lists (those with a scopes string) whose settled
/// bit is not set, plus every default-mode owner's share (`popped-running:OWNER`): flow-control.md §4's
/// equality, for the one scope built so far.
fn running_exact(_: &Protocol, state: &State) -> bool {
    let counted = state.redis.processing.iter().filter(|p| p.counted).count();
    let shares: usize = state
        .redis
        .popped_running
        .iter()
        .map(|(_, n)| usize::from(*n))
        .sum();
    usize::from(state.redis.running) == counted + shares
}

/// Every default-mode share of `running` has a way back: its owner is registered and no running daemon renews it
/// (its lease runs out, and a monitor's release.lua gives the share back), or its owner is the current one of a
/// stopping daemon (whose release.lua gives it back), or the tasks popped under it that some daemon still holds,
/// unsettled, cover it (their settles give it back).
fn share_comes_back(_: &Protocol, state: &State) -> bool {
    state.redis.popped_running.iter().all(|&(owner, share)| {
        let registered = state.redis.owner(owner).is_some();
        let current = state.daemons.iter().find(|d| d.owner == Some(owner));
        if registered && current.is_none() || current.is_some_and(|d| d.stopping) {
            return true;
        }
        let held: usize = state
            .daemons
            .iter()
            .map(|d| {
                d.held
                    .iter()
                    .filter(|h| {
                        h.popped_by == Some(owner)
                            && !(matches!(h.phase, Phase::Settling(..)) && d.acker.applied)
                    })
                    .count()
            })
            .sum();
        usize::from(share) <= held
    })
}

/// `running` never exceeds `max_running`: the largest of the configs in play (each scenario uses one value).
fn never_above_the_limit(model: &Protocol, state: &State) -> bool {
    let limit = model.setup.configs.iter().map(|c| c.max_running).max();
    limit.is_none_or(|limit| state.redis.running <= limit)
}

/// Every task is done, in a history in which a running limit held a claim back.
fn done_after_held_back(model: &Protocol, state: &State) -> bool {
    state.ghost.held_back && all_done(model, state)
}

/// settle.lua never had to stop a count at 0.
fn no_underflow(_: &Protocol, state: &State) -> bool {
    state.redis.running_underflow == 0
}

/// When no claim list and no default-mode share remains, nothing is counted.
fn nothing_leaks_at_rest(_: &Protocol, state: &State) -> bool {
    !state.redis.processing.is_empty()
        || !state.redis.popped_running.is_empty()
        || state.redis.running == 0
}

fn all_done(model: &Protocol, state: &State) -> bool {
    model
        .setup
        .tasks
        .iter()
        .enumerate()
        .all(|(task, (behaviour, _))| *behaviour == Behaviour::Pill || state.redis.done[task] == 1)
}

fn pill_dead_others_done(model: &Protocol, state: &State) -> bool {
    model
        .setup
        .tasks
        .iter()
        .enumerate()
        .all(|(task, (behaviour, _))| match behaviour {
            Behaviour::Pill => state.redis.dead.iter().any(|e| e.task as usize == task),
            _ => state.redis.done[task] == 1,
        })
}

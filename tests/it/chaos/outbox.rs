//! Redis losing writes, and the producer's outbox that makes up for them: Redis restarted empty, or rewound (an
//! `appendfsync everysec` Redis killed with its host, the last fraction of a second of its append-only file lost,
//! as a failover to a lagging replica or a restored backup also leave it). After either, the producer pushes again
//! every task that Redis no longer holds and that has no final state, as a producer that keeps each task in an
//! outbox until it learns its outcome would; each loss starts a new epoch of the ledger.
//!
//! What kmqd answers for across a rewind depends on the mode: safe mode loses nothing Redis kept and runs again
//! what Redis forgot was settled (at least once); default mode's at most once holds only while Redis keeps its
//! writes, so a task popped in the lost tail runs again ([`Event::explains`](super::world::Event::explains)).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::support::*;

use super::faults::{Injector, Kind};
use super::ledger::Epoch;
use super::workload::{LEASE, Mode, QUEUES, Queue};
use super::world::{What, lock, now_us};

/// Every task id a queue's keys hold (ARGV[1]: `kmq:{queue}`), whatever the key: the envelopes of its ready,
/// quarantine, claim and retry lists and sets, its delayed tasks' hash, its dead records. What is not a task's JSON
/// (owners, markers, bitmaps, counters) is passed over.
const IDS: &str = r"
local ids = {}
local function add(text)
  local ok, task = pcall(cjson.decode, text)
  if ok and type(task) == 'table' and type(task.id) == 'string' then ids[#ids + 1] = task.id end
end
for _, key in ipairs(redis.call('KEYS', ARGV[1] .. ':*')) do
  local kind = redis.call('TYPE', key).ok
  if kind == 'list' then
    for _, item in ipairs(redis.call('LRANGE', key, 0, -1)) do add(item) end
  elseif kind == 'zset' then
    for _, item in ipairs(redis.call('ZRANGE', key, 0, -1)) do add(item) end
  elseif kind == 'hash' then
    for _, item in ipairs(redis.call('HVALS', key)) do add(item) end
  end
end
return ids
";

/// The ids of the tasks a queue holds unsettled (their bit clear in their list's bitmap) in the claim lists of its
/// owners whose lease runs (ARGV[1]: `kmq:{queue}`; docs/PROTOCOL.md, "Key layout": a claim list is
/// `processing:OWNER:L:C`, its bitmap beside it, the owners' deadlines on Redis's clock).
const CLAIMED: &str = r"
local base = ARGV[1]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ids = {}
for _, key in ipairs(redis.call('KEYS', base .. ':processing:*')) do
  if redis.call('TYPE', key).ok == 'list' then
    local owner = string.match(string.sub(key, #base + 13), '^([^:]+):')
    local deadline = owner and redis.call('ZSCORE', base .. ':owners', owner)
    if deadline and tonumber(deadline) > now then
      for position, item in ipairs(redis.call('LRANGE', key, 0, -1)) do
        if redis.call('GETBIT', key .. ':settled', position - 1) == 0 then
          local ok, task = pcall(cjson.decode, item)
          if ok and type(task) == 'table' and type(task.id) == 'string' then ids[#ids + 1] = task.id end
        end
      end
    end
  end
end
return ids
";

impl Injector<'_, '_> {
    /// Redis loses everything; the producer, as one with an outbox would, pushes again every task that has no
    /// final state yet.
    pub(super) fn empty_redis(&mut self) -> String {
        let world = self.world;
        let from = now_us();
        let _gate = world.gate.write().unwrap();
        self.before_a_loss("at the end of an epoch");
        let signal = if self.rng.coin() {
            Signal::Term
        } else {
            Signal::Kill
        };
        self.redis.stop(signal);
        let aof = self.redis.dir().join("appendonlydir");
        std::fs::remove_dir_all(&aof).unwrap_or_else(|e| panic!("remove {}: {e}", aof.display()));
        self.redis.restart();
        let epoch = self.new_epoch([0; QUEUES]);
        let again = self.push_again(&HashSet::new());
        world.event(
            What::Fault(Kind::RedisEmpty),
            None,
            from,
            format!("epoch {epoch}"),
        );
        format!(
            "redis-server stopped ({signal:?}), AOF deleted, restarted empty (epoch {epoch}); {again} tasks pushed again"
        )
    }

    /// Redis on `appendfsync everysec` dies with its host: what it wrote in its last 0.2 to 1 s was in the host's
    /// page cache only, and is gone. It starts again on the rest of its append-only file, which Redis reads up to
    /// the last whole command (`aof-load-truncated`, a transaction cut short left out): an older state, consistent
    /// in itself, that the daemons and the producer never saw. The outbox pushes again what Redis forgot it was
    /// given.
    pub(super) fn rewind_redis(&mut self) -> String {
        let world = self.world;
        let from = now_us();
        let _: () = self
            .redis
            .cmd(&["CONFIG", "SET", "appendfsync", "everysec"]);
        let dir = self.redis.dir().join("appendonlydir");
        let kept = last_incr_file(&dir)
            .and_then(|file| Some((std::fs::metadata(&file).ok()?.len(), file)));
        let tail = self.rng.ms(200, 1000);
        std::thread::sleep(tail);
        // No push straddles the loss: the outbox knows which pushes Redis acknowledged before it.
        let gate = world.gate.write().unwrap();
        self.before_a_loss("before a rewind");
        self.redis.stop(Signal::Kill);
        let lost = match kept {
            // The file Redis was appending to is still the last one (no rewrite began meanwhile).
            Some((length, file)) if last_incr_file(&dir).as_ref() == Some(&file) => {
                let written = std::fs::metadata(&file).map_or(0, |m| m.len());
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&file)
                    .and_then(|open| open.set_len(length))
                    .unwrap_or_else(|e| panic!("truncate {}: {e}", file.display()));
                Some(written.saturating_sub(length))
            }
            _ => None,
        };
        self.redis.restart();
        let mut kept_pushes = [0; QUEUES];
        for queue in Queue::ALL {
            let pushed: Option<u64> =
                self.redis
                    .cmd(&["HGET", &format!("{}:stats", queue.base()), "pushed"]);
            kept_pushes[queue.index()] = pushed.unwrap_or(0);
        }
        let epoch = self.new_epoch(kept_pushes);
        let held = ids_in(&self.redis);
        let again = self.push_again(&held);
        drop(gate);
        let what = match lost {
            Some(bytes) => {
                world.count("rewinds");
                world.add("rewound bytes", bytes);
                format!(
                    "the last {bytes} bytes of its AOF ({} ms) lost",
                    tail.as_millis()
                )
            }
            None => "its AOF was being rewritten: nothing lost".to_string(),
        };
        world.event(
            What::Fault(Kind::RedisRewind),
            None,
            from,
            format!("epoch {epoch}"),
        );
        let stranded = self.wait_nothing_stranded();
        format!(
            "redis-server on everysec killed with its host: {what}, restarted on the rest (epoch {epoch}); {again} \
             tasks pushed again; {stranded}"
        )
    }

    /// After a rewind, the tasks whose settle Redis forgot must not stay in a claim list under a lease that is
    /// still renewed (review H1): the daemon that ran them never settles them again, so only its owner given up
    /// (the heartbeat's journal check) and the monitors' recovery take them out. A task whose run ended (done, by
    /// the records) and that a live owner holds unsettled right after the rewind must leave every live owner's
    /// claim lists at least once within three leases (a task may come back, claimed again after a retry: it left
    /// meanwhile); one that never does is stranded, a violation. Returns what it saw.
    fn wait_nothing_stranded(&self) -> String {
        let world = self.world;
        let started = Instant::now();
        let mut candidates: HashSet<String> = {
            let claimed = claimed_under_live_owners(&self.redis);
            let guard = world.facts();
            claimed
                .into_iter()
                .filter(|id| guard.1.done.contains(id))
                .collect()
        };
        let forgotten = candidates.len();
        while !candidates.is_empty() && started.elapsed() < 3 * LEASE {
            std::thread::sleep(Duration::from_millis(100));
            let claimed = claimed_under_live_owners(&self.redis);
            candidates.retain(|id| claimed.contains(id));
        }
        if !candidates.is_empty() {
            let mut stranded: Vec<&String> = candidates.iter().collect();
            stranded.sort();
            world.violation(format!(
                "after a rewind, {} tasks whose run had ended stayed unsettled under a live owner for {:.1} s (Redis \
                 forgot their settle, and nothing gave the owner up): {stranded:?}",
                stranded.len(),
                started.elapsed().as_secs_f64()
            ));
        }
        world.add("rewound settles", forgotten as u64);
        format!(
            "{forgotten} ended tasks Redis held unsettled under live owners, {} of them after {:.1} s",
            candidates.len(),
            started.elapsed().as_secs_f64()
        )
    }

    /// What is known before Redis loses writes: each queue's conservation then, and what was dead-lettered (an
    /// outbox learns that from the dead list). The caller holds the push gate.
    fn before_a_loss(&self, when: &str) {
        for queue in Queue::ALL {
            self.world.check_conservation(&self.redis, queue, when);
        }
        self.world.read_dead_list(&self.redis);
    }

    /// Starts a new epoch whose queues' `pushed` counters began at `kept`. Returns its number.
    fn new_epoch(&self, kept: [u64; QUEUES]) -> u32 {
        let epoch = self.world.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        lock(&self.world.ledger).epochs.push(Epoch {
            base: kept,
            ..Epoch::default()
        });
        epoch
    }

    /// The outbox: pushes again every task without a final state that Redis does not hold (`held`: the ids it
    /// does), but for a default-mode task that started (its daemon has it, or lost it: at most once). Returns how
    /// many. The caller holds the push gate.
    fn push_again(&self, held: &HashSet<String>) -> usize {
        let world = self.world;
        let started: HashSet<String> = world.facts().1.runs.keys().cloned().collect();
        let missing: Vec<(Queue, String)> = world
            .unfinished(false)
            .into_iter()
            .filter(|(queue, id)| {
                let popped_and_started = queue.mode() == Mode::Default && started.contains(id);
                !held.contains(id) && !popped_and_started
            })
            .collect();
        for queue in Queue::ALL {
            let ids: Vec<String> = missing
                .iter()
                .filter(|(of, _)| *of == queue)
                .map(|(_, id)| id.clone())
                .collect();
            for chunk in ids.chunks(500) {
                world.push(&self.client, chunk);
            }
        }
        lock(&world.ledger).repushed += missing.len() as u64;
        missing.len()
    }
}

/// The ids of the tasks each queue holds unsettled in the claim lists of its live owners (see [`CLAIMED`]).
fn claimed_under_live_owners(redis: &RedisServer) -> HashSet<String> {
    let mut ids = HashSet::new();
    for queue in Queue::ALL {
        let held: Vec<String> = redis::Script::new(CLAIMED)
            .arg(queue.base())
            .invoke(&mut redis.connection())
            .unwrap_or_else(|e| panic!("the claimed tasks of {}: {e}", queue.name()));
        ids.extend(held);
    }
    ids
}

/// The ids of every task Redis holds, in any queue (see [`IDS`]).
fn ids_in(redis: &RedisServer) -> HashSet<String> {
    let mut ids = HashSet::new();
    for queue in Queue::ALL {
        let held: Vec<String> = redis::Script::new(IDS)
            .arg(queue.base())
            .invoke(&mut redis.connection())
            .unwrap_or_else(|e| panic!("the ids {} holds: {e}", queue.name()));
        ids.extend(held);
    }
    ids
}

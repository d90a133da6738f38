//! Every Redis key name kmqd uses is built here (docs/PROTOCOL.md, "Key layout").
//!
//! All keys of a queue carry the queue name as a hash tag, `PREFIX:{QUEUE}:...`, so every script touches one
//! Redis Cluster slot.

use crate::config::QueueConfig;

/// The keys (and the one pub/sub channel) of one queue.
#[derive(Clone, Debug)]
pub struct QueueKeys {
    /// The priority levels, highest first (claim tokens and level keys are named after them).
    pub levels: Vec<String>,
    /// Ready lists, one per priority level, highest first.
    pub ready: Vec<String>,
    /// Delayed tasks per level: zset task id -> due ms; they go to the back of the ready list when due.
    pub delayed: Vec<String>,
    /// The envelopes of delayed tasks: hash task id -> envelope. Keyed by id so that the delay-queue operations
    /// (exists, cancel, remaining delay) cost O(log n), not a scan.
    pub delayed_tasks: String,
    /// Retries waiting out their backoff per level: zset envelope -> due ms; they go to the front when due.
    pub retry: Vec<String>,
    /// Safe mode: hash token -> envelope of every claimed, unsettled task.
    pub processing: String,
    /// Safe mode: zset token -> lease deadline ms.
    pub leases: String,
    /// Counter that makes claim tokens unique.
    pub seq: String,
    /// Dead-letter list of JSON records, newest first, bounded by `dead_max`.
    pub dead: String,
    /// Hash unique id -> ms it was taken, for unique tasks that are delayed, ready or processing.
    pub unique: String,
    /// Hash of counters: pushed, done, retried, failed, dead_lettered, cancelled.
    pub stats: String,
    /// Wake-up markers for idle fetchers (at most one element).
    pub wake: String,
    /// Periodic tasks: hash schedule name -> the last slot fired (ms).
    pub schedules: String,
    /// Hash with the protocol version of the queue's keys.
    pub meta: String,
    /// Pub/sub channel that tells delay pollers a task became due sooner than they planned.
    pub delay_channel: String,
}

impl QueueKeys {
    /// The keys of `queue` under `prefix`.
    pub fn new(prefix: &str, queue: &str, levels: &[String]) -> QueueKeys {
        let base = format!("{prefix}:{{{queue}}}");
        let per_level = |kind: &str| {
            levels
                .iter()
                .map(|level| format!("{base}:{kind}:{level}"))
                .collect()
        };
        QueueKeys {
            levels: levels.to_vec(),
            ready: per_level("ready"),
            delayed: per_level("delayed"),
            delayed_tasks: format!("{base}:delayed-tasks"),
            retry: per_level("retry"),
            processing: format!("{base}:processing"),
            leases: format!("{base}:leases"),
            seq: format!("{base}:seq"),
            dead: format!("{base}:dead"),
            unique: format!("{base}:unique"),
            stats: format!("{base}:stats"),
            wake: format!("{base}:wake"),
            meta: format!("{base}:meta"),
            schedules: format!("{base}:schedules"),

            delay_channel: format!("{base}:delay-wake"),
        }
    }

    /// The keys of a configured queue.
    pub fn for_queue(prefix: &str, queue: &QueueConfig) -> QueueKeys {
        QueueKeys::new(prefix, &queue.name, &queue.priorities)
    }

    /// Number of priority levels.
    pub fn levels(&self) -> usize {
        self.ready.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let keys = QueueKeys::new("kmq", "mail", &["high".into(), "low".into()]);
        assert_eq!(
            keys.ready,
            ["kmq:{mail}:ready:high", "kmq:{mail}:ready:low"]
        );
        assert_eq!(keys.retry[1], "kmq:{mail}:retry:low");
        assert_eq!(keys.processing, "kmq:{mail}:processing");
        let all = [
            &keys.ready[0],
            &keys.delayed[0],
            &keys.leases,
            &keys.dead,
            &keys.unique,
            &keys.stats,
            &keys.wake,
        ];
        assert!(all.iter().all(|key| key.starts_with("kmq:{mail}:")));
    }
}

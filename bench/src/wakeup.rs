//! Push to start: an idle daemon's wake-up, and how late a delayed task starts (the testkit's record of each
//! start, read as it grows).

use super::*;

/// Reads the testkit record file from `offset` on; returns start times (µs) by task id and the new offset.
pub(crate) fn read_starts(
    path: &Path,
    offset: u64,
    starts: &mut HashMap<String, u64>,
) -> Result<u64, String> {
    let Ok(mut file) = std::fs::File::open(path) else {
        return Ok(offset);
    };
    file.seek(SeekFrom::Start(offset))
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(|e| e.to_string())?;
    // Only whole lines: a line being written is read next time.
    let complete = text.rfind('\n').map_or(0, |i| i + 1);
    for line in text[..complete].lines() {
        let mut parts = line.split(' ');
        if parts.next() == Some("start") {
            if let (Some(id), Some(time)) = (parts.next(), parts.nth(2)) {
                starts.insert(id.to_string(), time.parse().unwrap_or(0));
            }
        }
    }
    Ok(offset + complete as u64)
}

/// Waits until a fetcher of the daemon blocks in Redis (it has gone idle).
pub(crate) fn wait_idle(bench: &Bench, mode: &str) -> Result<(), String> {
    // Safe mode blocks on the wake-up list; default mode on its one ready list (BLMOVE; builds before
    // 2026-12 used BLMPOP, which `--daemon` may still run).
    let commands: &[&str] = if mode == "safe" {
        &["cmd=blpop"]
    } else {
        &["cmd=blmove", "cmd=blmpop"]
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut connection = bench.redis()?;
    loop {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut connection)
            .map_err(|e| e.to_string())?;
        if commands.iter().any(|command| clients.contains(command)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the daemon's fetcher never went idle".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub(crate) fn wake_up(bench: &Bench, mode: &str) -> Result<Figure, String> {
    let (client, daemon, mut starts) = recorded_daemon(bench, &format!("wakeup-{mode}"), mode)?;
    let (mut p50, mut p99) = (Vec::new(), Vec::new());
    for run in 0..bench.options.runs {
        let latencies = idle_samples(bench, mode, &client, &mut starts, &format!("w{run}"), 200)?;
        p50.push(percentile(&latencies, 50.0));
        p99.push(percentile(&latencies, 99.0));
    }
    daemon.stop();
    Ok(figure(
        "wakeup",
        format!("{mode} mode, idle daemon: push to handler start, p50"),
        "µs",
        p50,
        vec![("p99 µs".into(), p99)],
    ))
}

/// A daemon of `mode` for the queue `q`, on an empty Redis, whose testkit records every start (config and record
/// file named `name`): its client, the daemon, and its starts, read as they come.
pub(crate) fn recorded_daemon(
    bench: &Bench,
    name: &str,
    mode: &str,
) -> Result<(Client, Daemon, Starts), String> {
    let record = bench.dir.path().join(format!("{name}.log"));
    let _ = std::fs::remove_file(&record);
    let config = bench.config(name, mode, Some(&record))?;
    let client = bench.client(&config)?;
    bench.flush()?;
    let daemon = bench.daemon(&config)?;
    Ok((client, daemon, Starts::new(record)))
}

/// The start times the testkit recorded so far, read on as its record file grows.
pub(crate) struct Starts {
    pub(crate) record: PathBuf,
    pub(crate) offset: u64,
    pub(crate) by_id: HashMap<String, u64>,
}

impl Starts {
    pub(crate) fn new(record: PathBuf) -> Starts {
        Starts {
            record,
            offset: 0,
            by_id: HashMap::new(),
        }
    }

    /// When the task `id` started (µs since the epoch), waiting up to 10 s for it.
    pub(crate) fn wait_for(&mut self, id: &str) -> Result<u64, String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.offset = read_starts(&self.record, self.offset, &mut self.by_id)?;
            if let Some(started) = self.by_id.get(id) {
                return Ok(*started);
            }
            if Instant::now() > deadline {
                return Err(format!("task {id} did not start within 10 s"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// `count` tasks pushed one at a time to the idle daemon of `client`'s queue (each once its fetcher blocks in
/// Redis again), ids `prefix-N`: each one's time from just before its push to its handler's start, µs.
pub(crate) fn idle_samples(
    bench: &Bench,
    mode: &str,
    client: &Client,
    starts: &mut Starts,
    prefix: &str,
    count: usize,
) -> Result<Vec<f64>, String> {
    let mut latencies = Vec::with_capacity(count);
    for sample in 0..count {
        wait_idle(bench, mode)?;
        let id = format!("{prefix}-{sample}");
        let pushed = now_us();
        client
            .push(
                "q",
                NewTask::new("test", "{}")
                    .map_err(|e| e.to_string())?
                    .id(&id),
            )
            .map_err(|e| e.to_string())?;
        let started = starts.wait_for(&id)?;
        latencies.push(started.saturating_sub(pushed) as f64);
    }
    Ok(latencies)
}

pub(crate) fn lateness(bench: &Bench) -> Result<Figure, String> {
    pub(crate) const RATE: u64 = 10_000;
    pub(crate) const SECONDS: u64 = 3;
    let record = bench.dir.path().join("lateness.log");
    let (mut p50, mut p99) = (Vec::new(), Vec::new());
    for run in 0..bench.options.runs {
        let _ = std::fs::remove_file(&record);
        let config = bench.config("lateness", "safe", Some(&record))?;
        let client = bench.client(&config)?;
        bench.flush()?;
        let daemon = bench.daemon(&config)?;
        wait_idle(bench, "safe")?;
        let now_ms = broker::redis_now(&mut bench.redis()?).map_err(|e| e.to_string())?;
        // Due times start two seconds ahead, so that the push is over before the first one is due.
        let base_ms = now_ms + 2000;
        let total = RATE * SECONDS;
        let mut due_by_id = HashMap::with_capacity(total as usize);
        let tasks: Vec<NewTask> = (0..total)
            .map(|i| {
                let due = base_ms + (i * 1000 / RATE) as i64;
                let id = format!("l{run}-{i}");
                due_by_id.insert(id.clone(), due);
                NewTask::with_data("test", kmqd::task::data_from_str("{}").expect("JSON"))
                    .id(id)
                    .at(due)
            })
            .collect();
        client.push_batch("q", tasks).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while client.stats("q").map_err(|e| e.to_string())?.done < total {
            if Instant::now() > deadline {
                return Err("the delayed tasks did not all run within 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon.stop();
        let mut starts = HashMap::new();
        read_starts(&record, 0, &mut starts)?;
        let late: Vec<f64> = starts
            .iter()
            .filter_map(|(id, started)| Some(*started as f64 / 1000.0 - *due_by_id.get(id)? as f64))
            .collect();
        p50.push(percentile(&late, 50.0));
        p99.push(percentile(&late, 99.0));
    }
    Ok(figure(
        "lateness",
        "delayed tasks, 10,000 due per second for 3 s: handler start minus due time, p50",
        "ms",
        p50,
        vec![("p99 ms".into(), p99)],
    ))
}

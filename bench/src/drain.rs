//! The drain: tasks pushed first, then drained by daemons, timed from the first progress to empty (the way
//! `../shared/bench/peers` measures the peers), on the bench's Redis or a deployment's.

use super::*;

/// What `runs` drains measured, each made by `drain`: the drain scenarios' figure (the drain, and what a config
/// costs a drain: limits, groups).
pub(crate) struct Drains {
    pub(crate) rates: Vec<f64>,
    pub(crate) daemon_cpu: Vec<f64>,
    pub(crate) redis_cpu: Vec<f64>,
    pub(crate) rss_mb: Vec<f64>,
}

impl Drains {
    pub(crate) fn run(
        runs: usize,
        mut drain: impl FnMut() -> Result<DrainRun, String>,
    ) -> Result<Drains, String> {
        let mut drains = Drains {
            rates: Vec::new(),
            daemon_cpu: Vec::new(),
            redis_cpu: Vec::new(),
            rss_mb: Vec::new(),
        };
        for _ in 0..runs {
            let run = drain()?;
            drains.rates.push(run.rate);
            drains.daemon_cpu.push(run.daemon_cpu);
            drains.redis_cpu.push(run.redis_cpu);
            drains.rss_mb.push(run.rss_mb);
        }
        Ok(drains)
    }

    /// The drains `runs` measured (run in turns with another config's, as the results scenario does).
    pub(crate) fn of(runs: &[DrainRun]) -> Drains {
        Drains {
            rates: runs.iter().map(|run| run.rate).collect(),
            daemon_cpu: runs.iter().map(|run| run.daemon_cpu).collect(),
            redis_cpu: runs.iter().map(|run| run.redis_cpu).collect(),
            rss_mb: runs.iter().map(|run| run.rss_mb).collect(),
        }
    }

    /// The rates, with the daemon's and Redis's CPU a task, and with `rss` the daemons' peak RSS.
    pub(crate) fn figure(self, scenario: &str, name: String, rss: bool) -> Figure {
        let mut extra = vec![
            ("daemon CPU µs/task".into(), self.daemon_cpu),
            ("redis CPU µs/task".into(), self.redis_cpu),
        ];
        if rss {
            extra.push(("peak daemon RSS MB".into(), self.rss_mb));
        }
        figure(scenario, name, "tasks/s", self.rates, extra)
    }
}

/// How often a drain looks how many tasks are left: as the peers' driver (`POLL_S` in
/// ../shared/bench/peers/driver.py).
pub(crate) const DRAIN_POLL: Duration = Duration::from_millis(10);

/// What a drain reads to see how many tasks are left: the queue's counters of pushed, done and dead-lettered
/// tasks, one `HMGET` on a connection of its own (made again after a failure, three tries, as the `kill`
/// scenario disconnects it). `Client::stats` (a dozen commands in three round trips) polled every 5 ms took a
/// share of the two cores from the daemon and the Redis it measured: in the spin scenario, about 2 points of its
/// limit (docs/PERFORMANCE.md, "The drain's poll").
pub(crate) struct Progress<'a> {
    pub(crate) server: &'a RedisServer,
    pub(crate) connection: Option<redis::Connection>,
    pub(crate) stats_key: String,
}

impl<'a> Progress<'a> {
    pub(crate) fn new(config: &Path, server: &'a RedisServer) -> Result<Progress<'a>, String> {
        let config = Config::load(config).map_err(|e| e.to_string())?;
        let queue = config
            .queues
            .iter()
            .find(|queue| queue.name == "q")
            .ok_or("the bench's queue is q")?;
        let keys = kmqd::broker::QueueKeys::for_queue(&config.redis.key_prefix, queue);
        Ok(Progress {
            server,
            connection: None,
            stats_key: keys.stats,
        })
    }

    /// Tasks pushed and not yet done or dead-lettered.
    pub(crate) fn left(&mut self) -> Result<u64, String> {
        let (pushed, done, dead) = self.counters()?;
        Ok(pushed.saturating_sub(done + dead))
    }

    /// Tasks done and dead-lettered (a flow's released tasks are done without being pushed).
    pub(crate) fn ended(&mut self) -> Result<(u64, u64), String> {
        let (_, done, dead) = self.counters()?;
        Ok((done, dead))
    }

    /// The queue's counters: pushed, done, dead-lettered.
    fn counters(&mut self) -> Result<(u64, u64, u64), String> {
        let mut tries = 0;
        loop {
            tries += 1;
            match self.read() {
                Ok(counters) => return Ok(counters),
                Err(error) if tries == 3 => return Err(format!("redis: {error}")),
                Err(_) => self.connection = None,
            }
        }
    }

    pub(crate) fn read(&mut self) -> redis::RedisResult<(u64, u64, u64)> {
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => self.connection.insert(self.server.connection()?),
        };
        let (pushed, done, dead): (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(&self.stats_key)
            .arg("pushed")
            .arg("done")
            .arg("dead_lettered")
            .query(connection)?;
        Ok((pushed.unwrap_or(0), done.unwrap_or(0), dead.unwrap_or(0)))
    }
}

pub(crate) fn drain(bench: &Bench, mode: &str, daemons: usize) -> Result<Figure, String> {
    drain_with(bench, &bench.own(), mode, daemons, None)
}

/// Where a drain runs: the bench's own Redis, or a deployment the `deployments` scenario started.
pub(crate) struct Target<'a> {
    /// What the figure calls it (`None`: the bench's own Redis, in the `drain` and `kill` scenarios).
    pub(crate) label: Option<String>,
    /// The `[redis]` keys of the daemons' config.
    pub(crate) section: String,
    /// Every master, flushed before each run.
    pub(crate) masters: Vec<&'a RedisServer>,
    /// The master that holds the queue: its CPU is Redis's.
    pub(crate) holder: &'a RedisServer,
}

impl Target<'_> {
    pub(crate) fn flush(&self) -> Result<(), String> {
        for master in &self.masters {
            let mut connection = master.connection().map_err(|e| format!("redis: {e}"))?;
            redis::cmd("FLUSHALL")
                .exec(&mut connection)
                .map_err(|e| format!("FLUSHALL: {e}"))?;
        }
        Ok(())
    }
}

/// What one drain measured.
pub(crate) struct DrainRun {
    /// Tasks left at the first poll that saw progress ÷ the time from that poll until none was left.
    pub(crate) rate: f64,
    /// Daemon and Redis CPU over that window, µs per task.
    pub(crate) daemon_cpu: f64,
    pub(crate) redis_cpu: f64,
    /// Peak RSS of all the daemons, MB.
    pub(crate) rss_mb: f64,
}

/// One drain of `tasks.0` tasks with data `tasks.1` by `daemons` daemons started with `config`, once they are all
/// pushed; with `kill_every`, every client of Redis is disconnected that often meanwhile.
pub(crate) fn drain_once(
    bench: &Bench,
    target: &Target<'_>,
    config: &Path,
    daemons: usize,
    (n, data): (usize, &str),
    kill_every: Option<Duration>,
) -> Result<DrainRun, String> {
    let fill = |client: &Client| bench.fill_with(client, n, data);
    drain_filled(bench, target, config, daemons, (n, &fill), kill_every)
}

/// Pushes a drain's tasks into the bench's queue.
pub(crate) type Fill<'a> = &'a dyn Fn(&Client) -> Result<(), String>;

/// [`drain_once`] of the `n` tasks that `fill` pushes (after the flush, before the daemons start).
pub(crate) fn drain_filled(
    bench: &Bench,
    target: &Target<'_>,
    config: &Path,
    daemons: usize,
    (n, fill): (usize, Fill<'_>),
    kill_every: Option<Duration>,
) -> Result<DrainRun, String> {
    drain_then(
        bench,
        target,
        config,
        daemons,
        (n, fill, &mut |_| Ok(())),
        kill_every,
    )
}

/// What a drain does once its `n` tasks are done, before its daemons stop: given the time the drain saw none
/// left (the `fanin` scenario waits there for the task that waited for them all).
pub(crate) type Then<'a> = &'a mut dyn FnMut(Instant) -> Result<(), String>;

/// [`drain_filled`], then `then` while the daemons still run.
pub(crate) fn drain_then(
    bench: &Bench,
    target: &Target<'_>,
    config: &Path,
    daemons: usize,
    (n, fill, then): (usize, Fill<'_>, Then<'_>),
    kill_every: Option<Duration>,
) -> Result<DrainRun, String> {
    let client = bench.client(config)?;
    target.flush()?;
    fill(&client)?;
    let mut progress = Progress::new(config, target.holder)?;
    let mut processes: Vec<Daemon> = (0..daemons)
        .map(|_| bench.daemon(config))
        .collect::<Result<_, _>>()?;
    let pids: Vec<u32> = processes.iter().map(Daemon::pid).collect();
    let cpu = |pids: &[u32]| pids.iter().map(|pid| tree_cpu_us(*pid)).sum::<u64>();
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut first: Option<(Instant, u64, u64, u64)> = None;
    let mut peak_rss = 0;
    let mut killer = target
        .holder
        .connection()
        .map_err(|e| format!("redis: {e}"))?;
    let mut last_kill = Instant::now();
    let end = loop {
        if let Some(every) = kill_every {
            if last_kill.elapsed() >= every {
                last_kill = Instant::now();
                let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                    .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"][..])
                    .query(&mut killer);
            }
        }
        let left = progress.left()?;
        peak_rss = peak_rss.max(pids.iter().map(|pid| rss_kb(*pid)).sum::<u64>());
        if first.is_none() && left < n as u64 {
            first = Some((
                Instant::now(),
                left,
                cpu(&pids),
                cpu_us(target.holder.pid()),
            ));
        }
        if left == 0 {
            break (Instant::now(), cpu(&pids), cpu_us(target.holder.pid()));
        }
        if Instant::now() > deadline {
            return Err(format!("drain did not finish within 300 s ({left} left)"));
        }
        if let Some(status) = processes.iter_mut().find_map(Daemon::exited) {
            return Err(format!(
                "a daemon exited ({status}) with {left} tasks left; its log: {}",
                bench.log().display()
            ));
        }
        std::thread::sleep(DRAIN_POLL);
    };
    then(end.0)?;
    for daemon in processes {
        daemon.stop();
    }
    let (t0, left0, daemon0, redis0) = first.expect("progress was seen before the end");
    let seconds = end.0.duration_since(t0).as_secs_f64().max(1e-6);
    Ok(DrainRun {
        rate: left0 as f64 / seconds,
        daemon_cpu: (end.1 - daemon0) as f64 / left0 as f64,
        redis_cpu: (end.2 - redis0) as f64 / left0 as f64,
        rss_mb: peak_rss as f64 / 1024.0,
    })
}

/// A drain; with `kill_every`, every client of Redis is disconnected that often meanwhile, which a daemon must
/// take as a blip (reconnect at once), not as an outage.
pub(crate) fn drain_with(
    bench: &Bench,
    target: &Target<'_>,
    mode: &str,
    daemons: usize,
    kill_every: Option<Duration>,
) -> Result<Figure, String> {
    let config = bench.config_on(
        &target.section,
        &format!("drain-{mode}"),
        mode,
        None,
        bench.shape(),
    )?;
    let drains = Drains::run(bench.options.runs, || {
        drain_once(
            bench,
            target,
            &config,
            daemons,
            (bench.options.tasks, "1"),
            kill_every,
        )
    })?;
    let name = match (&target.label, kill_every) {
        (_, Some(every)) => {
            format!("{mode} mode, {daemons} daemon(s), CLIENT KILL every {every:?}")
        }
        (Some(label), None) => format!("{label}: {mode} mode, {daemons} daemon(s)"),
        (None, None) => format!("{mode} mode, {daemons} daemon(s)"),
    };
    let scenario = match (&target.label, kill_every) {
        (_, Some(_)) => "kill",
        (Some(_), None) => "deployments",
        (None, None) => "drain",
    };
    Ok(drains.figure(scenario, name, true))
}

//! What the daemon holds in memory with a backlog in Redis and a deep prefetch.

use super::*;

pub(crate) fn memory(bench: &Bench) -> Result<Vec<Figure>, String> {
    let config = bench.config("memory", "safe", None)?;
    let client = bench.client(&config)?;
    let mut figures = Vec::new();

    bench.flush()?;
    let daemon = bench.daemon(&config)?;
    wait_idle(bench, "safe")?;
    std::thread::sleep(Duration::from_millis(500));
    let idle = rss_kb(daemon.pid()) as f64 / 1024.0;
    daemon.stop();
    figures.push(figure(
        "memory",
        "daemon RSS, idle (one queue)",
        "MB",
        vec![idle],
        vec![],
    ));

    // Redis memory per queued task with 100 bytes of data.
    bench.flush()?;
    let used = |bench: &Bench| -> Result<f64, String> {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query(&mut bench.redis()?)
            .map_err(|e| e.to_string())?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0))
    };
    let before = used(bench)?;
    let data = format!("{{\"payload\":\"{}\"}}", "x".repeat(100 - 14));
    let n = 100_000;
    let data = kmqd::task::data_from_str(&data).expect("JSON");
    for _ in 0..n / 10_000 {
        client
            .push_batch(
                "q",
                (0..10_000).map(|_| NewTask::with_data("test", data.clone())),
            )
            .map_err(|e| e.to_string())?;
    }
    let per_task = (used(bench)? - before) / n as f64;
    figures.push(figure(
        "memory",
        "redis memory per queued task with 100 bytes of data",
        "bytes",
        vec![per_task],
        vec![],
    ));

    // Daemon RSS while it drains a large backlog.
    bench.flush()?;
    bench.fill(&client, bench.options.backlog)?;
    let daemon = bench.daemon(&config)?;
    let mut progress = Progress::new(&config, &bench.server)?;
    let mut peak = 0;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        peak = peak.max(rss_kb(daemon.pid()));
        let left = progress.left()?;
        if left == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    daemon.stop();
    figures.push(figure(
        "memory",
        format!(
            "daemon peak RSS draining a backlog of {}",
            bench.options.backlog
        ),
        "MB",
        vec![peak as f64 / 1024.0],
        vec![],
    ));
    Ok(figures)
}

//! The `fanin` scenario (issue 36's scale target): a flow of `--tasks` no-op tasks into one task that waits for
//! them all, pushed with `Client::push_flow` (as `kmqd flow push` does: the waiting task in one call, the parts in
//! batches) and drained by one daemon, against a plain drain of as many no-op tasks, in turns. Three figures:
//! the push of the flow, the drain of its parts against the plain drain (target: at least 0.7x), and the time from
//! the last part's settle to the waiting task's (target: at most 1 s).
//!
//! The last figure is read from the queue's counters by the drain's 10 ms poll, as every drain is: from the poll
//! that saw every part done to the one that saw the waiting task done too. It includes the mover's turns left at
//! the last part's settle, the release, the claim of the waiting task (its envelope carries every part's
//! outcome), its run and its settle: an upper bound of "end of the last dependency to start of the waiter", within
//! a poll.

use std::cell::RefCell;

use super::{
    Bench, Client, DRAIN_POLL, DrainRun, Drains, Figure, Instant, Progress, drain_once, drain_then,
    figure,
};

/// The waiting task's id (the parts are `p0`, `p1`, ...).
const ROOT: &str = "fanin-root";

/// The most the bench waits for the waiting task once every part is done.
const ROOT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// The flow's JSON: `n` no-op parts of queue `q`, and one no-op task of `q` that waits for them all.
fn flow(n: usize) -> String {
    let mut text = format!(r#"{{"queue":"q","type":"test","id":"{ROOT}","data":1,"after":["#);
    for part in 0..n {
        if part > 0 {
            text.push(',');
        }
        text.push_str(&format!(
            r#"{{"queue":"q","type":"test","id":"p{part}","data":1}}"#
        ));
    }
    text.push_str("]}");
    text
}

pub(super) fn fanin(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let n = o.tasks;
    let config = bench.config("fanin", "safe", None)?;
    let text = flow(n);
    let pushes = RefCell::new(Vec::new());
    let (mut plain, mut fanin, mut waits) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..o.runs {
        plain.push(drain_once(bench, &bench.own(), &config, 1, (n, "1"), None)?);
        let fill = |client: &Client| {
            let start = Instant::now();
            let pushed = client.push_flow(&text).map_err(|e| e.to_string())?;
            pushes.borrow_mut().push(start.elapsed().as_secs_f64());
            if pushed.tasks.len() != n + 1 || !pushed.kept.is_empty() {
                return Err(format!(
                    "the fan-in pushed {} tasks ({} kept), not {}",
                    pushed.tasks.len(),
                    pushed.kept.len(),
                    n + 1
                ));
            }
            Ok(())
        };
        let mut wait = None;
        let mut then = |parts_done: Instant| {
            wait = Some(root_done(bench, &config, n, parts_done)?);
            Ok(())
        };
        let run: DrainRun =
            drain_then(bench, &bench.own(), &config, 1, (n, &fill, &mut then), None)?;
        fanin.push(run);
        waits.push(wait.expect("then ran"));
    }
    let ratio: Vec<f64> = plain
        .iter()
        .zip(&fanin)
        .map(|(plain, fanin)| fanin.rate / plain.rate)
        .collect();
    let pushes = pushes.into_inner();
    Ok(vec![
        figure(
            "fanin",
            format!("Client::push_flow of a fan-in of {n} tasks into one (as kmqd flow push)"),
            "s",
            pushes,
            vec![],
        ),
        Drains::of(&plain).figure(
            "fanin",
            format!("plain no-op safe drain, {n} tasks, 1 daemon"),
            false,
        ),
        Drains::of(&fanin).figure(
            "fanin",
            format!("the fan-in's {n} parts drained, 1 daemon"),
            false,
        ),
        figure(
            "fanin",
            "the fan-in's drain ÷ the plain drain (target ≥ 0.7)",
            "x",
            ratio,
            vec![],
        ),
        figure(
            "fanin",
            "last part done -> the waiting task done (target ≤ 1 s)",
            "ms",
            waits,
            vec![],
        ),
    ])
}

/// Polls the queue's counters until the waiting task is done too (`n + 1` done); returns the ms since
/// `parts_done`, when the drain saw every part done.
fn root_done(
    bench: &Bench,
    config: &std::path::Path,
    n: usize,
    parts_done: Instant,
) -> Result<f64, String> {
    let mut progress = Progress::new(config, &bench.server)?;
    loop {
        let (done, dead) = progress.ended()?;
        if dead > 0 {
            return Err(format!(
                "{dead} tasks of the fan-in were dead-lettered; the daemons' log: {}",
                bench.log().display()
            ));
        }
        if done > n as u64 {
            return Ok(parts_done.elapsed().as_secs_f64() * 1000.0);
        }
        if parts_done.elapsed() > ROOT_DEADLINE {
            return Err(format!(
                "the fan-in's waiting task did not run within {ROOT_DEADLINE:?} of its parts ({done} done); the \
                 daemons' log: {}",
                bench.log().display()
            ));
        }
        std::thread::sleep(DRAIN_POLL);
    }
}

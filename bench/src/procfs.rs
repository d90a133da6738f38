//! A process's CPU time and resident memory, from /proc: what the daemons and Redis spent on a run.

use super::*;

pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// CPU time (user + system) of a process and of every process under it (live, or ended and reaped), µs: a
/// daemon's includes the handler processes its exec plugin runs.
pub(crate) fn tree_cpu_us(pid: u32) -> u64 {
    let children: Vec<u32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| stat_field(*child, 1) == Some(u64::from(pid)))
        .collect();
    // Fields 13 and 14 after the name: the CPU of the children it reaped.
    let reaped = (stat_field(pid, 13).unwrap_or(0) + stat_field(pid, 14).unwrap_or(0)) * 10_000;
    cpu_us(pid) + reaped + children.into_iter().map(tree_cpu_us).sum::<u64>()
}

/// Field `index` of /proc/PID/stat, counted from the one after the command name (0: the state).
pub(crate) fn stat_field(pid: u32, index: usize) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name, which is in parentheses and may contain spaces.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(index)?.parse().ok()
}

/// CPU time (user + system) of a process, µs.
pub(crate) fn cpu_us(pid: u32) -> u64 {
    // Linux reports 100 ticks per second (USER_HZ) on every platform kmqd runs on.
    (stat_field(pid, 11).unwrap_or(0) + stat_field(pid, 12).unwrap_or(0)) * 10_000
}

/// Resident memory of a process, kB.
pub(crate) fn rss_kb(pid: u32) -> u64 {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return 0;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

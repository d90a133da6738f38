//! The process calls std lacks; the only unsafe code of this plugin.
#![expect(
    unsafe_code,
    reason = "the plugin's one opt-in: the process calls std lacks"
)]
// Every unsafe block says why it is sound; the lint keeps it so.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::io;

/// Whether the child `pid` has exited, without reaping it (`WNOWAIT`). Until the child is reaped, neither its
/// process id nor its process group id can be reused, so killing the group after this said "exited" cannot hit
/// an unrelated process. `std::process::Child::wait` reaps it afterwards as usual.
pub fn has_exited(pid: u32) -> io::Result<bool> {
    // SAFETY: siginfo_t is plain old data, for which all zeroes is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let options = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
    // SAFETY: `info` is a valid, writable siginfo_t; waitid with WNOHANG does not block and with WNOWAIT leaves
    // the child waitable.
    let result = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, options) };
    if result == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after a successful waitid the kernel has filled the SIGCHLD fields, si_pid among them; it leaves
    // si_pid zero when the child has not changed state (WNOHANG).
    Ok(unsafe { info.si_pid() } != 0)
}

/// Sends SIGKILL to every process in the process group `group`. An empty group (ESRCH) is not an error: there is
/// nothing left to kill.
pub fn kill_group(group: u32) {
    signal_group(group, libc::SIGKILL);
}

/// Sends SIGTERM to every process in the process group `group`: the polite request to stop before a SIGKILL.
pub fn terminate_group(group: u32) {
    signal_group(group, libc::SIGTERM);
}

fn signal_group(group: u32, signal: libc::c_int) {
    let Ok(group) = libc::pid_t::try_from(group) else {
        return;
    };
    // SAFETY: kill takes no pointers; a negative pid addresses the process group. The group id is a child of
    // ours that has not been reaped yet (see `has_exited`), so it names our child's group and no other.
    let _ = unsafe { libc::kill(-group, signal) };
}

/// Makes the command's process get SIGKILL when the thread that starts it ends (`PR_SET_PDEATHSIG`), so that no
/// handler process outlives kmqd, not even when kmqd is killed with SIGKILL or by the OOM killer (review L4).
///
/// Linux sends the signal when the *thread* that forked the process ends, not the whole process, so the thread
/// must outlive its process: a per-task command is started by the worker thread that runs its task, which reaps
/// it before `handle` returns (on a panic too: `Running`'s drop); a persistent child by the `kmq-exec-pool`
/// thread, which lives as long as the plugin. A kmqd that dies between the fork and the `prctl` would leave the
/// process without the signal: it then sees a parent other than the one that forked it and does not start.
pub fn die_with_parent(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe calls are
    // allowed: prctl and getppid are plain system calls, and the closure allocates nothing (the error is made from
    // a number, without a message).
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(io::Error::last_os_error());
            }
            if u32::try_from(libc::getppid()) != Ok(parent) {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Blocks until `fd` has something to read, or its other end closed (or an error: the caller's read says which).
pub fn wait_readable(fd: std::os::fd::RawFd) {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `poll` is one valid, writable pollfd, and the count says one; -1 waits without a timeout.
        let result = unsafe { libc::poll(&mut poll, 1, -1) };
        if result >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Blocks until `fd` can take more bytes, or its other end closed (the caller's write says which).
pub fn wait_writable(fd: std::os::fd::RawFd) {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    loop {
        // SAFETY: `poll` is one valid, writable pollfd, and the count says one; -1 waits without a timeout.
        let result = unsafe { libc::poll(&mut poll, 1, -1) };
        if result >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Makes writes to `fd` return `WouldBlock` instead of waiting when it is full (O_NONBLOCK on its open file
/// description: for a pipe kmqd made, the write end, which only kmqd holds).
pub fn set_nonblocking(fd: std::os::fd::RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL and F_SETFL take and return plain integers; a bad descriptor is an error, not UB.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags == -1 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == -1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// How many bytes wait unread in the pipe `fd` (FIONREAD); 0 when it cannot say.
pub fn unread_bytes(fd: std::os::fd::RawFd) -> usize {
    let mut count: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `count`.
    let result = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut count) };
    if result == -1 {
        0
    } else {
        usize::try_from(count).unwrap_or(0)
    }
}

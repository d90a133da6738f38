//! Signals: SIGTERM and SIGINT ask the daemon to stop gracefully (a second one exits at once); SIGHUP asks it to
//! re-read its config (`daemon::reload`; several SIGHUPs before the reload ran are one reload).

use crossbeam_channel::Sender;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Starts the `kmqd-signals` thread. The first SIGTERM or SIGINT is forwarded to `stop`; a second one exits the
/// process immediately with 128 + its number (safe-mode tasks in flight are recovered when their leases expire).
///
/// Every SIGHUP is forwarded to `reload` (a bounded channel: one waiting reload covers the SIGHUPs after it).
///
/// The thread blocks in the signal iterator for the life of the process and is never joined: nothing waits for
/// it, and the process exits from `main` when the daemon has stopped.
pub fn forward(stop: Sender<()>, reload: Sender<()>) -> std::io::Result<()> {
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    std::thread::Builder::new()
        .name("kmqd-signals".to_string())
        .spawn(move || {
            let mut seen = 0;
            for signal in signals.forever() {
                if signal == SIGHUP {
                    // Full: a reload is already waiting, and it reads the file as it is by then.
                    let _ = reload.try_send(());
                    continue;
                }
                seen += 1;
                if seen == 1 {
                    tracing::info!(signal, "signal received; shutting down gracefully (send it again to exit at once)");
                    let _ = stop.send(());
                } else {
                    tracing::warn!(signal, "second signal: exiting now; in-flight safe-mode tasks return when their leases expire");
                    std::process::exit(128 + signal);
                }
            }
        })?;
    Ok(())
}

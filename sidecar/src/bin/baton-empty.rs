//! `baton-empty`: the standby slot's idle process.
//!
//! The standby container of an injected pod runs this until a hot upgrade
//! patches its image to the new sidecar release. It must cost next to nothing
//! (no threads, no allocation, no sockets) and must still exit promptly on
//! SIGTERM: as PID 1 of its container, a signal left at its default
//! disposition would be ignored by the kernel and pod deletion would wait for
//! the full grace period. So the signals are blocked and waited for
//! synchronously with `sigwait`.

use nix::sys::signal::{SigSet, Signal};

fn main() {
    let mut set = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGQUIT] {
        set.add(signal);
    }
    if let Err(error) = set.thread_block() {
        eprintln!("baton-empty: cannot block signals: {error}");
        std::process::exit(1);
    }
    match set.wait() {
        Ok(signal) => eprintln!("baton-empty: {signal}, exiting"),
        Err(error) => {
            eprintln!("baton-empty: sigwait failed: {error}");
            std::process::exit(1);
        }
    }
}

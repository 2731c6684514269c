//! `baton-empty`: the standby slot's idle process.
//!
//! The standby container of an injected pod runs this until a hot upgrade
//! patches its image to the new sidecar release. It must cost next to nothing
//! (no threads, no allocation, no sockets) and must still exit promptly on
//! SIGTERM: as PID 1 of its container, a signal left at its default
//! disposition would be ignored by the kernel and pod deletion would wait for
//! the full grace period. So the signals are blocked and waited for
//! synchronously with `sigwait`.
//!
//! At start it removes its slot's retired marker (see
//! `baton_sidecar::lifecycle::Retirement`).

use nix::sys::signal::{SigSet, Signal};

fn main() {
    // The injected postStart hook (`baton-sidecar wait-ready`) stays on a
    // slot's container when the rollout swaps its image back to this one
    // (only the image of a running container can change), and the idle
    // image carries this binary under the sidecar's name too: an idle slot
    // is ready at once, so the hook returns at once instead of failing and
    // putting the slot into CrashLoopBackOff.
    if std::env::args().nth(1).as_deref() == Some(baton_contract::commands::WAIT_READY) {
        return;
    }
    // This slot is idle again: it may host the next upgrade, so the marker a
    // handed-off sidecar left here (`lifecycle::Retirement`) goes.
    if let Err(error) = baton_sidecar::lifecycle::Retirement::from_env().clear() {
        eprintln!("baton-empty: cannot remove the retired marker: {error}");
    }
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

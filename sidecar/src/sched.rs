//! Scheduling priority for work that must not compete with the event loop.
//!
//! - **Crypto threads.** Offload moves signatures off the event loop, but on
//!   a sidecar's small CPU budget both still share cores. A crypto thread
//!   running flat out at the same priority gets the same share as the event
//!   loop and delays it by whole scheduler slices. Giving crypto threads a
//!   higher nice value lets the event loop preempt them whenever it has
//!   work: plaintext and established-TLS traffic stays responsive and
//!   handshakes absorb the contention, which is the point of offloading them.
//! - **A process that handed off.** Once it holds nothing, its exit (the
//!   kernel tearing down its memory: ~190 MB after 10,000 connections) runs
//!   at the lowest priority, so it does not take the CPU from its successor,
//!   which is serving those connections now.
#![allow(unsafe_code)]

/// Lowers the calling thread's priority to nice `nice` (Linux: `PRIO_PROCESS`
/// with `who = 0` addresses the calling thread, not the whole process).
/// Never raises it: a sidecar started under a higher nice value keeps that.
pub fn set_current_thread_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: errno is thread-local; getpriority reads only its integer
    // arguments. -1 is a valid nice value, so errno tells errors apart.
    let current = unsafe {
        *libc::__errno_location() = 0;
        let p = libc::getpriority(libc::PRIO_PROCESS, 0);
        if p == -1 && *libc::__errno_location() != 0 {
            return Err(std::io::Error::last_os_error());
        }
        p
    };
    if current >= nice {
        return Ok(());
    }
    // SAFETY: setpriority only reads its integer arguments; it does not touch
    // memory owned by this program.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_thread_can_lower_its_own_priority_without_touching_others() {
        let main_before = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let nice_field = |stat: &str| -> i64 {
            // Field 19 (nice) counted after the ")" that ends the command name.
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            rest.split(' ').nth(16).unwrap().parse().unwrap()
        };
        let before = nice_field(&main_before);
        let child = std::thread::spawn(move || {
            super::set_current_thread_nice(10).unwrap();
            nice_field(&std::fs::read_to_string("/proc/thread-self/stat").unwrap())
        })
        .join()
        .unwrap();
        // At least 10; a test run under `nice` starts higher and keeps it.
        assert_eq!(child, before.max(10));
        let after = nice_field(&std::fs::read_to_string("/proc/thread-self/stat").unwrap());
        assert_eq!(after, before);
    }
}

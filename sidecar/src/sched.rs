//! Scheduling priority for work that must not compete with the event loop.
//!
//! - **Crypto threads.** Offload moves signatures off the event loop, but on
//!   a sidecar's small CPU budget both still share cores. A crypto thread
//!   running flat out at the same priority gets the same share as the event
//!   loop and delays it by whole scheduler slices. Giving crypto threads a
//!   higher nice value lets the event loop preempt them whenever it has
//!   work: plaintext and established-TLS traffic stays responsive and
//!   handshakes absorb the contention, which is the point of offloading them.
//! - **A handoff in progress** runs on a thread of its own at nice 10
//!   (`baton_handoff::sched`, which also holds [`set_current_thread_nice`],
//!   re-exported here).
//! - **A process that handed off.** Once it holds nothing, its exit (the
//!   kernel tearing down its memory: ~190 MB after 10,000 connections) runs
//!   at the lowest priority, so it does not take the CPU from its successor,
//!   which is serving those connections now.
#![allow(unsafe_code)]

pub use baton_handoff::sched::set_current_thread_nice;

/// Descriptor slots reserved at start (see [`presize_fd_table`]).
pub const FD_TABLE_SLOTS: u64 = 16_384;

/// Grows the process's descriptor table to `slots` entries (capped by
/// `RLIMIT_NOFILE`) while the process is still single-threaded.
///
/// Why: the kernel grows the table by doubling, and in a process whose
/// table is shared by several threads every growth waits for an RCU grace
/// period (`expand_fdtable` → `synchronize_rcu`), blocking the thread that
/// asked for the descriptor — here the event loop, in `accept` or in the
/// `recvmsg` that receives a connection during a handoff. A sidecar started
/// with a small table took 54–68 ms instead of 20–29 to adopt 1,000
/// connections (`bench/handoff-bench.sh`, docs/performance.md).
/// Growing it once now, before any thread exists, costs no grace period and
/// ~8 bytes of kernel memory per slot; the table never shrinks.
pub fn presize_fd_table(slots: u64) -> std::io::Result<u64> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which we own.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    };
    let slots = slots.min(limit);
    if slots < 2 {
        return Ok(0);
    }
    let null = std::fs::File::open("/dev/null")?;
    // F_DUPFD_CLOEXEC: the lowest free descriptor >= slots - 1, which makes the
    // kernel grow the table to hold it; closed again right away.
    // SAFETY: fcntl only reads its integer arguments.
    let dup = unsafe {
        libc::fcntl(
            null.as_raw_fd(),
            libc::F_DUPFD_CLOEXEC,
            (slots - 1) as libc::c_int,
        )
    };
    if dup < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `dup` is a descriptor fcntl just created and nothing else owns.
    drop(unsafe { OwnedFd::from_raw_fd(dup) });
    Ok(slots)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_descriptor_table_is_grown_once_and_nothing_stays_open() {
        let slots = super::presize_fd_table(4096).unwrap();
        assert!((2..=4096).contains(&slots), "{slots}");
        // The descriptor that grew the table is closed again (other tests
        // open and close descriptors concurrently, so ask about that one).
        // SAFETY: F_GETFD only reads its integer arguments.
        let r = unsafe { libc::fcntl((slots - 1) as libc::c_int, libc::F_GETFD) };
        assert_eq!(r, -1, "descriptor {} is still open", slots - 1);
        // The table now holds `slots` entries: /proc reports its size.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let fd_size: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("FDSize:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(fd_size >= slots, "FDSize {fd_size} < {slots}");
    }
}

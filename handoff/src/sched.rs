//! The handoff's own thread and its scheduling priority.
//!
//! - **A handoff in progress** runs on a thread of its own at nice 10
//!   ([`on_own_thread`]), so serving preempts moving, and offers the CPU
//!   between batches of connections ([`yield_cpu`]).
//! - [`set_current_thread_nice`] is what lowers it; the sidecar uses it for
//!   its crypto threads and for a handed-off process's exit too.
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

/// Offers the CPU to any other runnable thread on this core; returns at
/// once if there is none (one syscall, well under a microsecond).
///
/// Why: a handoff keeps both sidecar processes busy for up to a few hundred
/// milliseconds, and a busy thread often keeps its core until the next
/// scheduler tick (4 ms at `HZ=250`; a woken thread does not always preempt
/// it). A woken request thread (the client's, the app's, or the other
/// sidecar's event loop) sat runnable behind it for whole ticks. Both sides
/// call this between two batches of connections (`bench/handoff-bench.sh`,
/// 10,000 connections: probe p99 during the handoff a median 2.4 ms over 20
/// runs instead of 3.6 ms over 10; docs/performance.md). `yield_now` alone
/// only lets other tasks of the same runtime run. It works among threads
/// that share a CPU controller group (in a pod, each container's own).
pub fn yield_cpu() {
    // SAFETY: sched_yield takes no arguments and touches no memory.
    unsafe {
        libc::sched_yield();
    }
}

/// Runs `fut` to completion on a thread of its own, at nice `nice`, with a
/// current-thread runtime of its own; the result comes back to the caller's
/// task. The caller's runtime keeps running meanwhile.
///
/// Why: a handoff is bulk work (frames, `sendmsg`/`recvmsg` with
/// descriptors, epoll registration) done while the same process serves
/// requests. On the event loop it competes with them, and a woken request
/// waits behind whole batches. On a lower-priority thread the scheduler
/// preempts it whenever the event loop (or the application) has work, and
/// a second thread can use an idle core.
///
/// What `fut` spawns with `tokio::spawn` lives on the thread's runtime and
/// ends with it; work that must outlive it (serving connections) has to be
/// spawned on the caller's runtime through its `Handle`.
pub async fn on_own_thread<F>(name: &str, nice: i32, fut: F) -> std::io::Result<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if let Err(e) = set_current_thread_nice(nice) {
                tracing::debug!(error = %e, "cannot lower the thread's priority");
            }
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    drop(fut);
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            // `block_on` drops the future (and what it borrowed or owned)
            // before it returns, so the caller gets the result only once
            // nothing of it is left on this thread.
            let out = rt.block_on(fut);
            let _ = tx.send(Ok(out));
        })?;
    rx.await
        .map_err(|_| std::io::Error::other("the thread ended without a result (it panicked)"))?
}

#[cfg(test)]
mod tests {

    /// Field 19 (nice) of a `/proc/.../stat`, counted after the ")" that
    /// ends the command name.
    fn nice_field(stat: &str) -> i64 {
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        rest.split(' ').nth(16).unwrap().parse().unwrap()
    }

    fn own_nice() -> i64 {
        nice_field(&std::fs::read_to_string("/proc/thread-self/stat").unwrap())
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_future_runs_on_its_own_lower_priority_thread_while_the_caller_serves() {
        let caller = std::thread::current().id();
        let caller_nice = own_nice();
        let serving = tokio::runtime::Handle::current();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (thread, name, value, nice) = super::on_own_thread("test-own", 10, async move {
            // Finishes only if the caller's (current-thread) runtime runs a
            // task meanwhile: the caller is not blocked.
            serving.spawn(async move { tx.send(7).unwrap() });
            let value = rx.await.unwrap();
            let me = std::thread::current();
            (me.id(), me.name().map(str::to_owned), value, own_nice())
        })
        .await
        .unwrap();
        assert_ne!(thread, caller);
        assert_eq!(name.as_deref(), Some("test-own"));
        assert_eq!(value, 7);
        assert_eq!(nice, caller_nice.max(10));
        assert_eq!(
            own_nice(),
            caller_nice,
            "the caller's priority is unchanged"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_future_that_panics_on_its_own_thread_is_an_error_not_a_hang() {
        let r = super::on_own_thread("test-panic", 10, async {
            panic!("deliberate panic in a test");
        })
        .await;
        let e = r.expect_err("a panic is reported");
        assert!(e.to_string().contains("panicked"), "{e}");
    }

    #[test]
    fn a_thread_can_lower_its_own_priority_without_touching_others() {
        let main_before = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
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

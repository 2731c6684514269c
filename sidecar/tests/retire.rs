//! In a pod, the old process of a handoff must not exit: the kubelet would
//! restart it, and the restarted sidecar would take every connection back
//! from its successor (then the successor's slot would do the same). With
//! `BATON_IDLE_AFTER_HANDOFF=1` (what the webhook sets) it idles instead,
//! says so with a marker the successor reports on `GET /handoff`, and a
//! process started again in the retired slot idles too. Real processes on
//! loopback, as in `handoff.rs`.

use crate::handoff_support;

use std::time::{Duration, Instant};

use handoff_support::{Load, LoadShape, World, admin_get};

const BATON_EMPTY: &str = env!("CARGO_BIN_EXE_baton-empty");

async fn handoff_doc(world: &World) -> serde_json::Value {
    let (code, body) = admin_get(world.admin, "/handoff").await.expect("/handoff");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Waits until `/handoff` satisfies `pred` (bounded), returning it.
async fn wait_handoff(
    world: &World,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + within;
    loop {
        if let Ok((200, body)) = admin_get(world.admin, "/handoff").await
            && let Ok(doc) = serde_json::from_str::<serde_json::Value>(&body)
            && pred(&doc)
        {
            return doc;
        }
        assert!(
            Instant::now() < deadline,
            "condition not reached within {within:?}\n{}",
            world.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_off_sidecar_idles_in_its_slot_and_a_restart_there_takes_nothing_back() {
    let world = World::new().await;
    let idle = ("BATON_IDLE_AFTER_HANDOFF", "1");
    let mut old = world.spawn(&[idle, ("BATON_SLOT", "a")]);
    world.wait_ready(Duration::from_secs(20)).await;
    let before = handoff_doc(&world).await;
    assert_eq!(before["slot"], "a");
    assert_eq!(before["complete"], false);
    assert_eq!(before["retired"], serde_json::json!([]));

    let load = Load::start(
        &world,
        LoadShape {
            keepalive: 2,
            new_conns: 1,
            echo: 2,
            ..LoadShape::default()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let new = world.spawn(&[idle, ("BATON_SLOT", "b")]);
    world
        .wait_complete(new.pid(), Duration::from_secs(30))
        .await;
    // The successor serves, and reports the old slot idle once the old
    // process has drained and left its marker.
    let doc = wait_handoff(&world, Duration::from_secs(20), |d| {
        d["retired"] == serde_json::json!(["a"])
    })
    .await;
    assert_eq!(doc["slot"], "b");
    assert_eq!(doc["phase"], "serving");
    assert_eq!(doc["complete"], true);
    assert_eq!(doc["pid"], new.pid());
    assert!(world.dir.path().join("retired-a").exists());
    // Idle, not exited: a kubelet would see nothing to restart.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(old.alive(), "the old process exited:\n{}", old.log_tail());

    // The kubelet restarts slot a anyway (its idle process was killed):
    // the new process there must idle, not take the connections back.
    old.kill();
    let mut restarted = world.spawn(&[idle, ("BATON_SLOT", "a")]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(restarted.alive(), "{}", restarted.log_tail());
    let doc = handoff_doc(&world).await;
    assert_eq!(
        (doc["slot"].as_str(), doc["pid"].as_u64()),
        (Some("b"), Some(u64::from(new.pid())))
    );
    assert!(
        restarted.log_all().contains("handed off already"),
        "{}",
        restarted.log_tail()
    );

    // The operator swaps slot a back to the idle image: SIGTERM ends the
    // idle process at once, and baton-empty clears the marker.
    restarted.signal(nix::sys::signal::Signal::SIGTERM);
    let exit = restarted.wait_exit(Duration::from_secs(10));
    assert!(
        exit.is_some_and(|s| s.success()),
        "{exit:?}: {}",
        restarted.log_tail()
    );
    let mut empty = std::process::Command::new(BATON_EMPTY)
        .env("BATON_SLOT", "a")
        .env("BATON_HANDOFF_SOCKET", &world.socket)
        .spawn()
        .expect("spawn baton-empty");
    let deadline = Instant::now() + Duration::from_secs(10);
    while world.dir.path().join("retired-a").exists() {
        assert!(Instant::now() < deadline, "baton-empty left the marker");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(empty.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = empty.wait();
    assert_eq!(handoff_doc(&world).await["retired"], serde_json::json!([]));

    // The next upgrade goes into slot a again: it takes over normally.
    let next = world.spawn(&[idle, ("BATON_SLOT", "a")]);
    world
        .wait_complete(next.pid(), Duration::from_secs(30))
        .await;
    let doc = wait_handoff(&world, Duration::from_secs(20), |d| {
        d["retired"] == serde_json::json!(["b"])
    })
    .await;
    assert_eq!(doc["slot"], "a");

    let stats = load.finish().await;
    let failures = stats.failures.lock().unwrap().clone();
    assert!(failures.is_empty(), "{failures:#?}\n{}", world.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_webhook_s_setting_the_old_process_still_exits() {
    let world = World::new().await;
    let mut old = world.spawn(&[("BATON_SLOT", "a")]);
    world.wait_ready(Duration::from_secs(20)).await;
    let new = world.spawn(&[("BATON_SLOT", "b")]);
    world
        .wait_complete(new.pid(), Duration::from_secs(30))
        .await;
    let exit = old.wait_exit(Duration::from_secs(20));
    assert!(
        exit.is_some_and(|s| s.success()),
        "{exit:?}: {}",
        old.log_tail()
    );
    assert!(!world.dir.path().join("retired-a").exists());
}

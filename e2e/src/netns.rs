//! A network namespace the test creates to stand in for "outside the
//! machine": it is joined to the host by a veth pair on a private /30, so the
//! host can reach it, and a pod could reach it only by being *forwarded* off
//! the bridge, which the harness's `BATON-E2E-FWD` guard forbids. Tests send
//! to it instead of any real external address.
//!
//! The fixture listens inside the namespace with a socket created from a
//! thread that entered the namespace (`setns`), counts accepted connections,
//! and removes the namespace and the veth pair on drop.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sched::{CloneFlags, setns};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Port the fixture listens on inside the namespace.
pub const OUTSIDE_PORT: u16 = 7777;

/// Errors setting up the namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("`{cmd}` failed: {stderr}")]
    Command { cmd: String, stderr: String },
    #[error("{0}: {1}")]
    Io(&'static str, std::io::Error),
    #[error("setns: {0}")]
    Setns(nix::Error),
}

/// The "outside" namespace; deleted on drop.
#[derive(Debug)]
pub struct OutsideNetns {
    name: String,
    host_veth: String,
    /// Address of the listener inside the namespace.
    pub addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    accept_task: Option<JoinHandle<()>>,
}

fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| NetnsError::Io("running ip", e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetnsError::Command {
            cmd: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

impl OutsideNetns {
    /// Creates namespace `bte-<id>` with `10.250.<id>.2/30` inside and
    /// `10.250.<id>.1/30` on the host end. `id` keeps parallel tests apart.
    pub async fn create(id: u8) -> Result<Self, NetnsError> {
        let name = format!("bte-outside-{id}");
        let host_veth = format!("bte-h{id}");
        let ns_veth = format!("bte-n{id}");
        let host_ip = format!("10.250.{id}.1");
        let ns_ip = Ipv4Addr::new(10, 250, id, 2);
        // Leftovers of a crashed earlier run would make `add` fail.
        let _ = ip(&["netns", "delete", &name]);
        let _ = ip(&["link", "delete", &host_veth]);
        let mut me = Self {
            name: name.clone(),
            host_veth: host_veth.clone(),
            addr: SocketAddr::V4(SocketAddrV4::new(ns_ip, OUTSIDE_PORT)),
            accepted: Arc::new(AtomicU64::new(0)),
            accept_task: None,
        };
        ip(&["netns", "add", &name])?;
        ip(&[
            "link", "add", &host_veth, "type", "veth", "peer", "name", &ns_veth,
        ])?;
        ip(&["link", "set", &ns_veth, "netns", &name])?;
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_veth])?;
        ip(&["link", "set", &host_veth, "up"])?;
        ip(&[
            "-n",
            &name,
            "addr",
            "add",
            &format!("{ns_ip}/30"),
            "dev",
            &ns_veth,
        ])?;
        ip(&["-n", &name, "link", "set", &ns_veth, "up"])?;
        ip(&["-n", &name, "link", "set", "lo", "up"])?;
        // Replies to pods (10.88/16) would need a route back; the guard must
        // stop the SYN before that matters, but give the namespace a route
        // so a missing guard would show up as a successful connection.
        ip(&["-n", &name, "route", "add", "default", "via", &host_ip])?;

        let listener = Self::listen_inside(&name, me.addr)?;
        let accepted = me.accepted.clone();
        me.accept_task = Some(tokio::spawn(async move {
            while let Ok((mut stream, peer)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                tracing::info!(%peer, "outside namespace accepted a connection");
                let _ = tokio::io::AsyncWriteExt::write_all(&mut stream, b"outside\n").await;
            }
        }));
        Ok(me)
    }

    /// Binds a listener inside the namespace: a short-lived thread enters it
    /// and creates the socket, which stays in that namespace for its life.
    fn listen_inside(name: &str, addr: SocketAddr) -> Result<TcpListener, NetnsError> {
        let path = format!("/run/netns/{name}");
        let handle = std::thread::spawn(move || -> Result<std::net::TcpListener, NetnsError> {
            let file =
                std::fs::File::open(&path).map_err(|e| NetnsError::Io("opening the netns", e))?;
            setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(NetnsError::Setns)?;
            let listener =
                std::net::TcpListener::bind(addr).map_err(|e| NetnsError::Io("binding", e))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| NetnsError::Io("set_nonblocking", e))?;
            Ok(listener)
        });
        let listener = handle.join().expect("the setns thread does not panic")?;
        TcpListener::from_std(listener).map_err(|e| NetnsError::Io("registering the listener", e))
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for OutsideNetns {
    fn drop(&mut self) {
        if let Some(task) = self.accept_task.take() {
            task.abort();
        }
        // Deleting the namespace deletes the veth end inside it and with it
        // the pair; the explicit host-side delete covers a half-created pair.
        let _ = ip(&["netns", "delete", &self.name]);
        let _ = ip(&["link", "delete", &self.host_veth]);
    }
}

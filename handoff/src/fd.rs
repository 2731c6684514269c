//! File-descriptor passing over a Unix stream socket (`SCM_RIGHTS`).
//!
//! The handoff moves listening and connected sockets between two processes.
//! The kernel does that with `SCM_RIGHTS` ancillary data attached to bytes of a
//! Unix stream: the receiver gets *new* descriptors for the same open files
//! (same socket, same kernel queues), so nothing buffered in the kernel moves
//! or is lost.
//!
//! Rules this module encodes so callers cannot get them wrong:
//! - the kernel accepts at most `SCM_MAX_FD` (253) descriptors per `sendmsg`,
//!   so a larger batch is split, each part attached to its own byte of the
//!   payload (which therefore must be at least as long as the number of parts);
//! - on a stream socket the descriptors are delivered with the byte they were
//!   attached to, so a receiver that has read a whole frame holds every
//!   descriptor of that frame (see [`FdStream::recv`]);
//! - received descriptors are `CLOEXEC` (`MSG_CMSG_CLOEXEC`) so they never leak
//!   into a child process, and are owned ([`OwnedFd`]) so none is ever leaked;
//! - a truncated control message (`MSG_CTRUNC`: the kernel dropped
//!   descriptors) is an error, never silent loss.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// Kernel limit of descriptors in one `SCM_RIGHTS` message (`SCM_MAX_FD`).
pub const SCM_MAX_FD: usize = 253;

/// A Unix stream that carries bytes and file descriptors.
#[derive(Debug)]
pub struct FdStream {
    inner: UnixStream,
    /// Control-message space for `recvmsg`, kept between calls: allocating
    /// it per call (about 1 KiB, zeroed) cost the old process of a 10,000
    /// connection handoff a tenth of its CPU in the allocator, whose heap is
    /// fragmented by then by the connections it has let go.
    cmsg: std::sync::Mutex<Vec<u8>>,
}

impl FdStream {
    pub fn new(inner: UnixStream) -> Self {
        Self {
            inner,
            cmsg: std::sync::Mutex::new(nix::cmsg_space!([RawFd; SCM_MAX_FD])),
        }
    }

    pub fn get_ref(&self) -> &UnixStream {
        &self.inner
    }

    /// Sends all of `data`, attaching `fds` to its first bytes.
    ///
    /// Descriptors are split into batches of at most [`SCM_MAX_FD`]; batch `i`
    /// rides on byte `i`, so `data` must be at least as long as the number of
    /// batches. The caller keeps ownership of `fds`: the kernel duplicates them
    /// into the message, so closing them after this returns is safe.
    pub async fn send(&self, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let batches: Vec<&[RawFd]> = fds.chunks(SCM_MAX_FD).collect();
        if batches.len() > data.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} descriptors need {} payload bytes, got {}",
                    fds.len(),
                    batches.len(),
                    data.len()
                ),
            ));
        }
        let mut offset = 0;
        for (i, batch) in batches.iter().enumerate() {
            // All but the last batch ride on exactly one byte each.
            let end = if i + 1 < batches.len() {
                i + 1
            } else {
                data.len()
            };
            let n = self.send_some(&data[offset..end], batch).await?;
            offset += n;
        }
        while offset < data.len() {
            offset += self.send_some(&data[offset..], &[]).await?;
        }
        Ok(())
    }

    /// One successful `sendmsg` (waiting for writability). A partial write still
    /// delivered the descriptors: they are attached to the first byte sent.
    async fn send_some(&self, data: &[u8], fds: &[RawFd]) -> io::Result<usize> {
        let raw = self.inner.as_raw_fd();
        self.inner
            .async_io(Interest::WRITABLE, || {
                let iov = [IoSlice::new(data)];
                let cmsg = [ControlMessage::ScmRights(fds)];
                let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
                sendmsg::<()>(raw, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(io::Error::from)
            })
            .await
    }

    /// Receives some bytes into `buf` and appends any descriptors that came
    /// with them to `fds`, in the order they were sent. Returns 0 at EOF.
    pub async fn recv(&self, buf: &mut [u8], fds: &mut VecDeque<OwnedFd>) -> io::Result<usize> {
        let raw = self.inner.as_raw_fd();
        self.inner
            .async_io(Interest::READABLE, || {
                // Only the receiving half reads: never contended.
                let mut cmsg = self.cmsg.lock().unwrap_or_else(|e| e.into_inner());
                recv_once(raw, buf, &mut cmsg, fds)
            })
            .await
    }
}

fn recv_once(
    raw: RawFd,
    buf: &mut [u8],
    cmsg_space: &mut [u8],
    fds: &mut VecDeque<OwnedFd>,
) -> io::Result<usize> {
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(raw, &mut iov, Some(cmsg_space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut received = Vec::new();
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw_fds) = cmsg {
            for fd in raw_fds {
                // SAFETY: the kernel just installed `fd` in our descriptor
                // table for this message; nothing else refers to it, so this
                // OwnedFd is its only owner and closes it exactly once.
                received.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        // `received` is dropped here, closing whatever did arrive.
        return Err(io::Error::other(
            "control message truncated: the kernel dropped passed descriptors",
        ));
    }
    let n = msg.bytes;
    fds.extend(received);
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn recv_exact(s: &FdStream, len: usize, fds: &mut VecDeque<OwnedFd>) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let mut got = 0;
        while got < len {
            let n = s.recv(&mut out[got..], fds).await.unwrap();
            assert!(n > 0, "unexpected EOF");
            got += n;
        }
        out
    }

    fn is_cloexec(fd: &OwnedFd) -> bool {
        let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD).unwrap();
        nix::fcntl::FdFlag::from_bits_truncate(flags).contains(nix::fcntl::FdFlag::FD_CLOEXEC)
    }

    #[tokio::test]
    async fn passed_listener_and_connection_keep_working_in_the_receiver() {
        let (a, b) = UnixStream::pair().unwrap();
        let (a, b) = (FdStream::new(a), FdStream::new(b));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server_side, _) = listener.accept().await.unwrap();
        // Bytes the client sent before the move sit in the kernel queue and
        // must be readable through the passed descriptor.
        client.write_all(b"before-move").await.unwrap();

        a.send(b"hello", &[listener.as_raw_fd(), server_side.as_raw_fd()])
            .await
            .unwrap();
        drop(listener);
        drop(server_side);

        let mut fds = VecDeque::new();
        assert_eq!(recv_exact(&b, 5, &mut fds).await, b"hello");
        assert_eq!(fds.len(), 2);
        assert!(fds.iter().all(is_cloexec));

        let passed_listener = std::net::TcpListener::from(fds.pop_front().unwrap());
        passed_listener.set_nonblocking(true).unwrap();
        let passed_listener = tokio::net::TcpListener::from_std(passed_listener).unwrap();
        let passed_conn = std::net::TcpStream::from(fds.pop_front().unwrap());
        passed_conn.set_nonblocking(true).unwrap();
        let mut passed_conn = tokio::net::TcpStream::from_std(passed_conn).unwrap();

        let mut buf = [0u8; 11];
        passed_conn.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"before-move");
        passed_conn.write_all(b"after-move").await.unwrap();
        let mut buf = [0u8; 10];
        client.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"after-move");

        // The passed listener still owns the bound port and accepts.
        let _c2 = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = passed_listener.accept().await.unwrap();
        assert_eq!(accepted.local_addr().unwrap(), addr);
    }

    #[tokio::test]
    async fn more_descriptors_than_scm_max_fd_arrive_complete_and_in_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let (a, b) = (FdStream::new(a), FdStream::new(b));
        // 600 descriptors: three kernel messages. Each is a pipe write end
        // tagged by what we later write through it, to check order.
        let mut pipes = Vec::new();
        for _ in 0..600 {
            pipes.push(nix::unistd::pipe().unwrap());
        }
        let raws: Vec<RawFd> = pipes.iter().map(|(_, w)| w.as_raw_fd()).collect();
        let payload = vec![7u8; 64];
        let send = a.send(&payload, &raws);
        let mut fds = VecDeque::new();
        let recv = recv_exact(&b, payload.len(), &mut fds);
        let (sent, got) = tokio::join!(send, recv);
        sent.unwrap();
        assert_eq!(got, payload);
        assert_eq!(fds.len(), 600);
        for (i, fd) in fds.iter().enumerate() {
            let tag = (i as u32).to_be_bytes();
            nix::unistd::write(fd.as_fd(), &tag).unwrap();
            let mut back = [0u8; 4];
            nix::unistd::read(&pipes[i].0, &mut back).unwrap();
            assert_eq!(back, tag, "descriptor {i} out of order");
        }
    }

    #[tokio::test]
    async fn too_short_a_payload_for_the_descriptor_batches_is_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let a = FdStream::new(a);
        let raws = vec![a.get_ref().as_raw_fd(); SCM_MAX_FD + 1];
        let err = a.send(b"x", &raws).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[tokio::test]
    async fn large_payloads_survive_partial_writes_and_reads() {
        let (a, b) = UnixStream::pair().unwrap();
        let (a, b) = (FdStream::new(a), FdStream::new(b));
        let payload: Vec<u8> = (0..4_000_000u32).map(|i| (i % 251) as u8).collect();
        let (r, w) = nix::unistd::pipe().unwrap();
        let raws = [r.as_raw_fd(), w.as_raw_fd()];
        let send = a.send(&payload, &raws);
        let mut fds = VecDeque::new();
        let recv = recv_exact(&b, payload.len(), &mut fds);
        let (sent, got) = tokio::join!(send, recv);
        sent.unwrap();
        assert!(got == payload);
        assert_eq!(fds.len(), 2);
    }
}

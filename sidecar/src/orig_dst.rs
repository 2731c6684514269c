//! The original destination of a connection iptables REDIRECTed to us.
//!
//! `SO_ORIGINAL_DST` (IPv4) / `IP6T_SO_ORIGINAL_DST` (IPv6) via nix's typed
//! socket options, so no `unsafe` is needed here.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsFd;

use nix::sys::socket::{getsockopt, sockopt};

/// The destination the client originally connected to, or `None` when the
/// socket was not redirected (the kernel reports the local address then, or
/// an error when conntrack has no entry).
pub fn original_dst<S: AsFd>(sock: &S, local: SocketAddr) -> Option<SocketAddr> {
    let dst = match local {
        SocketAddr::V4(_) => {
            let sin = getsockopt(sock, sockopt::OriginalDst).ok()?;
            SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            ))
        }
        SocketAddr::V6(_) => {
            let sin6 = getsockopt(sock, sockopt::Ip6tOriginalDst).ok()?;
            SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                0,
                0,
            ))
        }
    };
    (dst != local).then_some(dst)
}

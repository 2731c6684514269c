//! Taking this layer's TLS sessions apart for a handoff
//! ([`SessionDetach`], implemented by [`MeshTls`]).
//!
//! A parked connection's boxed end is one of the streams this layer made —
//! an inbound session ([`MeshServerStream`]), an originated mesh-mTLS
//! session ([`MeshClientStream`]) — or a session an earlier handoff already
//! continued on the userspace record layer ([`TlsRecordStream`]). Only this
//! layer knows those types, so it recognizes them here and hands the handoff
//! a socket plus record-layer state ([`Detached::Moved`]); the handoff only
//! sees [`BoxIo`] and this trait.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::net::TcpStream;

use super::MeshTls;
use super::glue::{MeshClientStream, MeshServerStream};
use super::stream::TlsStream;
use crate::conn::{BoxIo, Detached, SessionDetach};
use crate::tls_record::{
    RecordAlignedIo, TlsRecordStream, TlsWireState, secret_capture, wire_state_from_rustls,
};

/// How long a session may take to flush what it still has to send (a
/// session ticket, a KeyUpdate answer) before it is taken apart.
const FLUSH_WITHIN: Duration = Duration::from_secs(1);

impl SessionDetach for MeshTls {
    fn detach(&self, io: BoxIo, conn: u64) -> Pin<Box<dyn Future<Output = Detached> + Send>> {
        Box::pin(detach(io, conn))
    }
}

/// [`MeshTls`]'s [`SessionDetach::detach`]: by the stream's concrete type.
pub async fn detach(io: BoxIo, conn: u64) -> Detached {
    // Look before taking: a failed `downcast` would consume the box as
    // `dyn Any`, and an end that cannot move must be given back as `BoxIo`.
    let any: &dyn std::any::Any = &*io;
    if any.is::<MeshServerStream>() {
        let s = downcast::<MeshServerStream>(io);
        return match extract_rustls(s, conn, true).await {
            Err(s) => Detached::Stays(s),
            Ok(None) => Detached::Broken,
            Ok(Some((prefixed, pending, state, plaintext))) => {
                // Bytes detection had read ahead come first on the wire.
                let (prefix, tcp) = prefixed.into_parts();
                let mut ciphertext = prefix.to_vec();
                ciphertext.extend_from_slice(&pending);
                moved(tcp, state, ciphertext, plaintext)
            }
        };
    }
    if any.is::<MeshClientStream>() {
        let s = downcast::<MeshClientStream>(io);
        return match extract_rustls(s, conn, false).await {
            Err(s) => Detached::Stays(s),
            Ok(None) => Detached::Broken,
            Ok(Some((tcp, pending, state, plaintext))) => moved(tcp, state, pending, plaintext),
        };
    }
    if any.is::<TlsRecordStream<TcpStream>>() {
        let mut s = downcast::<TlsRecordStream<TcpStream>>(io);
        let _ = tokio::time::timeout(FLUSH_WITHIN, tokio::io::AsyncWriteExt::flush(&mut *s)).await;
        return match s.export() {
            Ok((tcp, state, ciphertext, plaintext)) => moved(tcp, state, ciphertext, plaintext),
            Err(s) => Detached::Stays(Box::new(s)),
        };
    }
    tracing::error!(
        conn,
        "parked connection of a stream type the TLS layer did not make; it finishes here"
    );
    Detached::Stays(io)
}

fn downcast<T: 'static>(io: BoxIo) -> Box<T> {
    let any: Box<dyn std::any::Any + Send> = io;
    any.downcast::<T>().expect("type checked by the caller")
}

fn moved(tcp: TcpStream, state: TlsWireState, ciphertext: Vec<u8>, plaintext: Vec<u8>) -> Detached {
    Detached::Moved {
        tcp,
        state: Box::new(state),
        ciphertext,
        plaintext,
    }
}

/// The rustls half of [`detach`], for either role: flush what rustls still
/// has to send (a session ticket), check the record alignment, process what
/// rustls holds, take the decrypted-but-unread plaintext and the
/// record-layer secrets. Returns the transport under the record-aligned
/// reader, the partial record it kept, the state and the plaintext; `Err`
/// gives the session back when it is not at a record boundary, `Ok(None)`
/// means it is broken.
#[allow(clippy::type_complexity)]
async fn extract_rustls<IO, C, S>(
    mut s: Box<TlsStream<RecordAlignedIo<IO>, C>>,
    conn: u64,
    server: bool,
) -> Result<Option<(IO, Vec<u8>, TlsWireState, Vec<u8>)>, Box<TlsStream<RecordAlignedIo<IO>, C>>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<S>> + Into<rustls::Connection> + Unpin,
    S: rustls::SideData,
{
    let _ = tokio::time::timeout(FLUSH_WITHIN, tokio::io::AsyncWriteExt::flush(&mut *s)).await;
    if !s.get_ref().0.is_aligned() || s.get_ref().1.wants_write() {
        return Err(s);
    }
    let (aligned, conn_state) = s.into_parts();
    let mut tls: rustls::Connection = conn_state.into();
    if tls.process_new_packets().is_err() {
        return Ok(None);
    }
    let mut plain = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match std::io::Read::read(&mut tls.reader(), &mut chunk) {
            Ok(0) => break,
            Ok(n) => plain.extend_from_slice(&chunk[..n]),
            Err(_) => break, // WouldBlock: nothing more buffered
        }
    }
    let Some(version) = tls.protocol_version() else {
        return Ok(None);
    };
    let secrets = match tls.dangerous_extract_secrets() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(conn, error = %e, "cannot extract TLS secrets; connection closed");
            return Ok(None);
        }
    };
    let Ok(state) = wire_state_from_rustls(version, secrets, Some(&secret_capture()), server)
    else {
        return Ok(None);
    };
    let (io, pending) = aligned.into_parts();
    Ok(Some((io, pending, state, plain)))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_stream_the_tls_layer_did_not_make_stays_whole_and_working() {
        // Nothing is lost: an end this layer cannot take apart comes back
        // as the same stream, and the process that holds it keeps serving it.
        let (ours, mut peer) = tokio::io::duplex(64);
        let Detached::Stays(mut io) = detach(Box::new(ours), 7).await else {
            panic!("a stream of another type must stay")
        };
        io.write_all(b"still here").await.unwrap();
        let mut got = [0u8; 10];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"still here");
        peer.write_all(b"back").await.unwrap();
        let mut back = [0u8; 4];
        io.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"back");
    }
}

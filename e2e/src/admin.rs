//! `GET` on an admin port (a sidecar's or the webhook's): status and body,
//! every step bounded so a silent port fails the poll instead of hanging it.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Connect, write the request, read the whole answer: each within this.
const STEP: Duration = Duration::from_secs(3);

/// Status code and body of `GET path` on `addr` (`Connection: close`).
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut s = tokio::time::timeout(STEP, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| format!("connect to {addr} timed out"))?
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    tokio::time::timeout(STEP, s.read_to_end(&mut buf))
        .await
        .map_err(|_| format!("reading GET {path} from {addr} timed out"))?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad response: {text}"))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((code, body.to_owned()))
}

/// The body of `GET path` when the answer is 200, else the answer.
pub async fn get_ok(addr: SocketAddr, path: &str) -> Result<String, String> {
    match get(addr, path).await? {
        (200, body) => Ok(body),
        (code, body) => Err(format!("GET {path}: {code} {body}")),
    }
}

//! `demo-http-echo`: HTTP/1.1 + HTTP/2 (h2c) echo server for e2e pods.
//! `POST` echoes the body; responses name the listener port, the protocol
//! and, after an iptables REDIRECT, the original destination.

use clap::Parser;

#[derive(Parser)]
#[command(about = "HTTP/1.1 + HTTP/2 echo server")]
struct Args {
    /// Addresses to listen on (repeatable).
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: Vec<std::net::SocketAddr>,
    /// Serve TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args = Args::parse();
    let name = baton_e2e::demo::host_name();
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(baton_e2e::demo::tls_acceptor_from_pem(cert, key)?),
        _ => None,
    };
    let mut servers = tokio::task::JoinSet::new();
    for addr in args.listen {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tracing::info!(%addr, "demo-http-echo listening");
        servers.spawn(baton_e2e::demo::serve_http_echo_tls(
            listener,
            name.clone(),
            tls.clone(),
        ));
    }
    tokio::select! {
        Some(result) = servers.join_next() => result??,
        _ = tokio::signal::ctrl_c() => {}
        _ = sigterm() => {}
    }
    Ok(())
}

async fn sigterm() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

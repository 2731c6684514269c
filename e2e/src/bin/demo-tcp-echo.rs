//! `demo-tcp-echo`: echoes every byte back, for byte-checked TCP streams.

use clap::Parser;

#[derive(Parser)]
#[command(about = "TCP echo server")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:9000")]
    listen: std::net::SocketAddr,
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
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(baton_e2e::demo::tls_acceptor_from_pem(cert, key)?),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(addr = %args.listen, "demo-tcp-echo listening");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = baton_e2e::demo::serve_tcp_echo_tls(listener, tls) => result?,
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

//! `demo-fetch`: the in-Pod request driver of the Route e2e tests
//! (`baton_e2e::fetch`): `POST /fetch` with a JSON spec sends that many
//! HTTP/1.1 requests through the Pod's sidecar and answers with the counts.

use clap::Parser;

#[derive(Parser)]
#[command(about = "In-Pod HTTP request driver for e2e tests")]
struct Args {
    #[arg(long, default_value_t = std::net::SocketAddr::from(([0, 0, 0, 0], baton_e2e::fetch::PORT)))]
    listen: std::net::SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(addr = %args.listen, "demo-fetch listening");
    tokio::select! {
        result = baton_e2e::fetch::serve(listener) => result?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

use clap::Parser;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = baton_operator::Args::parse();
    baton_operator::init_tracing(&args.log);
    baton_operator::run(args).await
}

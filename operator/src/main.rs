use clap::Parser;

fn main() -> anyhow::Result<()> {
    let args = baton_operator::Args::parse();
    baton_operator::init_tracing(&args.log);
    baton_operator::run_blocking(args)
}

//! `crdgen`: renders Baton's CRDs from the Rust types.
//!
//! `crdgen` prints every CRD to stdout as a multi-document YAML stream;
//! `crdgen --out DIR` writes one `<plural>.baton.dev.yaml` per CRD into DIR
//! (what `manifests/crds/` holds and `scripts/crd-drift.sh` diffs).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser)]
#[command(about = "Render Baton's CustomResourceDefinitions as YAML")]
struct Args {
    /// Directory to write one YAML file per CRD into (created if missing).
    /// Without it, all CRDs go to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let docs = baton_crds::schema::render()?;
    match args.out {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for (name, doc) in docs {
                let path = dir.join(name);
                std::fs::write(&path, doc)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        None => print!("{}", baton_crds::schema::stream(&docs)),
    }
    Ok(())
}

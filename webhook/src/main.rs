//! `baton-webhook` binary: parse flags, run the library.
fn main() -> anyhow::Result<()> {
    Ok(())
}

//! `flotilla-olm --out DIR [--registry REGISTRY]`: writes the bundles and the catalog
//! of `deploy/olm/` with images in another registry, e.g. a test's registry on loopback.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "flotilla-olm",
    version,
    about = "Writes Flotilla's OLM bundles and file-based catalog, generated from deploy/"
)]
struct Cli {
    /// Directory to write into (created; files in it are replaced).
    #[arg(long)]
    out: PathBuf,
    /// Registry (and path) of the agent's, the bundles' and the catalog's images.
    #[arg(long, default_value = flotilla_olm::REGISTRY)]
    registry: String,
    /// The repository whose deploy/ the bundles come from.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/.."))]
    repo: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let tree = flotilla_olm::generate(&cli.repo, &cli.registry)?;
    for (path, text) in &tree {
        let path = cli.out.join(path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{} files in {}", tree.len(), cli.out.display());
    Ok(())
}

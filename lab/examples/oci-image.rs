//! An OCI image archive from local files, with the lab's OCI builder (`realnode::oci`, the
//! one that makes the real nodes' images): no Docker. `e2e/scripts/olm-e2e.sh --real-nodes`
//! makes OLM's bundle, catalog, opm and OLM images with it and pushes them to a loopback
//! registry (`skopeo copy oci-archive:OUT docker://...`).
//!
//! ```sh
//! cargo run -q -p flotilla-lab --example oci-image -- --name 127.0.0.1:5000/x/bundle:v0.1.0 \
//!   --out bundle.tar --add DIR/manifests:/manifests --add DIR/metadata:/metadata \
//!   --label operators.operatorframework.io.bundle.mediatype.v1=registry+v1
//! ```
//!
//! `--add SRC:DEST` is a Dockerfile's `COPY SRC DEST` (a file or a directory, owned by root,
//! modes kept), `--add SRC:DEST:UID:GID` its `COPY --chown`; `--entrypoint` is repeated once per argument; `--user` defaults to
//! `65532:65532` (distroless's nonroot), and `/tmp` (1777) is always there.

use anyhow::{Context, Result, bail};
use clap::Parser;
use flotilla_lab::provider::realnode::oci::{self, Contents, Entry, ImageSpec};
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

#[derive(Parser)]
struct Args {
    /// The image's reference, as the index names it.
    #[arg(long)]
    name: String,
    /// The OCI archive to write.
    #[arg(long)]
    out: PathBuf,
    /// SRC:DEST or SRC:DEST:UID:GID, a file or directory copied to DEST in the image.
    #[arg(long)]
    add: Vec<String>,
    /// KEY=VALUE, a label of the image config.
    #[arg(long)]
    label: Vec<String>,
    /// One argument of the entrypoint (repeat for each).
    #[arg(long, allow_hyphen_values = true)]
    entrypoint: Vec<String>,
    /// NAME=VALUE, an environment variable of the image config.
    #[arg(long)]
    env: Vec<String>,
    #[arg(long, default_value = "65532:65532")]
    user: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut entries = vec![Entry::dir("/tmp", 0o1777)];
    // A directory made twice (`/bin` of two files) keeps its first entry: `/tmp` stays 1777.
    let mut dirs = HashSet::from(["/tmp".to_string()]);
    for add in &args.add {
        let parts: Vec<&str> = add.split(':').collect();
        let (src, dest, owner) = match parts[..] {
            [src, dest] => (src, dest, None),
            [src, dest, uid, gid] => (src, dest, Some((uid.parse()?, gid.parse()?))),
            _ => bail!("--add {add}: not SRC:DEST or SRC:DEST:UID:GID"),
        };
        let dest = format!("/{}", dest.trim_matches('/'));
        for entry in oci::tree(&PathBuf::from(src), &dest)? {
            let is_dir = matches!(entry.contents, Contents::Dir);
            if is_dir && !dirs.insert(entry.path.clone()) {
                continue;
            }
            // The owner is the tree's, not its parents' (made by `tree`, as root's).
            let ours = entry.path == dest || entry.path.starts_with(&format!("{dest}/"));
            entries.push(match owner {
                Some((uid, gid)) if ours => entry.owned_by(uid, gid),
                _ => entry,
            });
        }
    }
    let labels = args
        .label
        .iter()
        .map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("--label {l}: not KEY=VALUE"))
        })
        .collect::<Result<BTreeMap<_, _>>>()?;
    let spec = ImageSpec {
        name: args.name,
        entries,
        entrypoint: args.entrypoint,
        user: args.user,
        exposed_ports: Vec::new(),
        env: args.env,
        labels,
    };
    let digest = oci::write_archive(&spec, &args.out)?;
    println!("{digest}");
    Ok(())
}

//! OCI images built from local files, with no registry and no Docker: one uncompressed
//! layer, an image config, a manifest and an `index.json` (typed, from `oci-spec`),
//! written as an OCI image layout in a tar archive that `ctr images import` takes.
//!
//! The archive is deterministic (every header has mtime 0, owner 0:0 unless a file says
//! otherwise, entries in the order given; JSON with its keys sorted): the same binary gives
//! the same digests, so a second import into a node's containerd changes nothing.
//!
//! [`flotilla_image`] makes the `flotilla-hub` and `flotilla-agent` images with the layout
//! `deploy/Dockerfile` gives them: the static binary at `/usr/local/bin/flotilla-<component>`,
//! entrypoint that binary, user `65532:65532`, on the few files of distroless/static that
//! matter here (`/etc/passwd` and `/etc/group` naming `nonroot`, `/tmp`, `/home/nonroot`,
//! the CA bundle). [`pause_image`] makes the pod sandbox image from the Kubernetes
//! source's `pause.c`.

use anyhow::{Context, Result};
use oci_spec::image::{
    Arch, ConfigBuilder, Descriptor, DescriptorBuilder, Digest, HistoryBuilder, ImageConfiguration,
    ImageConfigurationBuilder, ImageIndexBuilder, ImageManifestBuilder, MediaType,
    OciLayoutBuilder, Os, PlatformBuilder, RootFsBuilder, SCHEMA_VERSION, Sha256Digest,
};
use serde::Serialize;
use sha2::{Digest as _, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// What one entry of the layer holds.
#[derive(Clone, Debug)]
pub enum Contents {
    /// A regular file copied from this path on the machine.
    File(PathBuf),
    /// A regular file with these bytes.
    Bytes(Vec<u8>),
    /// A directory.
    Dir,
}

/// One entry of the image's only layer.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Absolute path in the image (`/usr/local/bin/flotilla-hub`).
    pub path: String,
    pub contents: Contents,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
}

impl Entry {
    pub fn file(path: &str, source: &Path, mode: u32) -> Entry {
        Entry::new(path, Contents::File(source.to_path_buf()), mode)
    }
    pub fn bytes(path: &str, bytes: impl Into<Vec<u8>>, mode: u32) -> Entry {
        Entry::new(path, Contents::Bytes(bytes.into()), mode)
    }
    pub fn dir(path: &str, mode: u32) -> Entry {
        Entry::new(path, Contents::Dir, mode)
    }
    fn new(path: &str, contents: Contents, mode: u32) -> Entry {
        Entry {
            path: path.to_string(),
            contents,
            mode,
            uid: 0,
            gid: 0,
        }
    }
    pub fn owned_by(mut self, uid: u64, gid: u64) -> Entry {
        self.uid = uid;
        self.gid = gid;
        self
    }
}

/// An image: its full reference, the files of its layer and its runtime config.
#[derive(Clone, Debug)]
pub struct ImageSpec {
    /// Fully qualified, as containerd stores it: `docker.io/library/flotilla-hub:0.1.0`.
    /// (The kubelet normalises the manifests' `flotilla-hub:0.1.0` to this.)
    pub name: String,
    pub entries: Vec<Entry>,
    pub entrypoint: Vec<String>,
    pub user: String,
    pub exposed_ports: Vec<u16>,
    pub env: Vec<String>,
    /// The image config's labels (an OLM bundle image's annotations, for one).
    pub labels: BTreeMap<String, String>,
}

/// The numeric user of both images (distroless's `nonroot`): a number, so that the
/// kubelet can check `runAsNonRoot: true` against it.
pub const NONROOT: u64 = 65532;

/// The `flotilla-<component>` image (`hub` or `agent`) around a static `binary`,
/// laid out as `deploy/Dockerfile` lays it out.
pub fn flotilla_image(component: &str, binary: &Path, tag: &str) -> ImageSpec {
    let exe = format!("/usr/local/bin/flotilla-{component}");
    let ports = match component {
        "hub" => vec![7443, 8080],
        _ => vec![8080, 9443],
    };
    let mut entries = distroless_base();
    entries.extend([
        Entry::dir("/usr", 0o755),
        Entry::dir("/usr/local", 0o755),
        Entry::dir("/usr/local/bin", 0o755),
        Entry::file(&exe, binary, 0o755),
    ]);
    ImageSpec {
        name: format!("docker.io/library/flotilla-{component}:{tag}"),
        entries,
        entrypoint: vec![exe],
        user: format!("{NONROOT}:{NONROOT}"),
        exposed_ports: ports,
        env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
        labels: BTreeMap::new(),
    }
}

/// The pod sandbox image: the static `pause` binary built from the Kubernetes source.
pub fn pause_image(pause: &Path, name: &str) -> ImageSpec {
    ImageSpec {
        name: name.to_string(),
        entries: vec![Entry::file("/pause", pause, 0o755)],
        entrypoint: vec!["/pause".into()],
        user: "65535:65535".into(),
        exposed_ports: Vec::new(),
        env: Vec::new(),
        labels: BTreeMap::new(),
    }
}

/// The entries that put the tree at `src` (a file or a directory) at `dest` in the image:
/// its parent directories first (mode 0755), then every directory and regular file under
/// it, sorted by path, with their modes (what a Dockerfile's `COPY src dest` gives, owned
/// by root). Symbolic links are refused: nothing here needs them.
pub fn tree(src: &Path, dest: &str) -> Result<Vec<Entry>> {
    let dest = format!("/{}", dest.trim_matches('/'));
    // Every ancestor but `dest` itself and `/`, outermost first.
    let parents: Vec<&Path> = Path::new(&dest)
        .ancestors()
        .skip(1)
        .filter(|p| p.parent().is_some())
        .collect();
    let mut entries: Vec<Entry> = parents
        .iter()
        .rev()
        .map(|p| Entry::dir(&p.to_string_lossy(), 0o755))
        .collect();
    add_tree(src, &dest, &mut entries)?;
    Ok(entries)
}

fn add_tree(src: &Path, dest: &str, entries: &mut Vec<Entry>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let meta =
        std::fs::symlink_metadata(src).with_context(|| format!("reading {}", src.display()))?;
    let mode = meta.permissions().mode() & 0o7777;
    if meta.is_file() {
        entries.push(Entry::file(dest, src, mode));
    } else if meta.is_dir() {
        entries.push(Entry::dir(dest, mode));
        let mut children: Vec<_> = std::fs::read_dir(src)?.collect::<std::io::Result<_>>()?;
        children.sort_by_key(std::fs::DirEntry::file_name);
        for child in children {
            let name = child.file_name();
            let name = name
                .to_str()
                .with_context(|| format!("{:?}: not UTF-8", child.path()))?;
            add_tree(&child.path(), &format!("{dest}/{name}"), entries)?;
        }
    } else {
        anyhow::bail!("{}: neither a file nor a directory", src.display());
    }
    Ok(())
}

/// The files of distroless/static that the binaries or the kubelet look at.
fn distroless_base() -> Vec<Entry> {
    let passwd = "root:x:0:0:root:/root:/sbin/nologin\n\
                  nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
                  nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";
    let group = "root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n";
    let mut entries = vec![
        Entry::dir("/etc", 0o755),
        Entry::bytes("/etc/passwd", passwd, 0o644),
        Entry::bytes("/etc/group", group, 0o644),
        Entry::dir("/home", 0o755),
        Entry::dir("/home/nonroot", 0o700).owned_by(NONROOT, NONROOT),
        Entry::dir("/tmp", 0o1777),
    ];
    let bundle = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if bundle.is_file() {
        entries.extend([
            Entry::dir("/etc/ssl", 0o755),
            Entry::dir("/etc/ssl/certs", 0o755),
            Entry::file("/etc/ssl/certs/ca-certificates.crt", bundle, 0o644),
        ]);
    }
    entries
}

/// The digest (`sha256:<hex>`) of `data`.
fn digest(data: &[u8]) -> Digest {
    let hex = hex::encode(Sha256::digest(data));
    hex.parse::<Sha256Digest>()
        .expect("64 lowercase hex digits are a SHA-256 digest")
        .into()
}

/// `value` as JSON with its keys sorted (serde_json's `Value` keeps a sorted map): oci-spec
/// keeps annotations and exposed ports in `HashMap`s, whose order changes from run to run.
fn canonical(value: &impl Serialize) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(&serde_json::to_value(value)?)?)
}

/// The layer as an uncompressed tar.
fn layer(entries: &[Entry]) -> Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    b.mode(tar::HeaderMode::Deterministic);
    for e in entries {
        let path = e.path.trim_start_matches('/');
        let mut h = tar::Header::new_ustar();
        h.set_mtime(0);
        h.set_uid(e.uid);
        h.set_gid(e.gid);
        h.set_mode(e.mode);
        match &e.contents {
            Contents::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                b.append_data(&mut h, format!("{path}/"), std::io::empty())?;
            }
            Contents::Bytes(bytes) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(bytes.len() as u64);
                b.append_data(&mut h, path, bytes.as_slice())?;
            }
            Contents::File(src) => {
                let data =
                    std::fs::read(src).with_context(|| format!("reading {}", src.display()))?;
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, data.as_slice())?;
            }
        }
    }
    Ok(b.into_inner()?)
}

/// The image config: how to run it, and the digest of its one (uncompressed) layer.
fn image_config(spec: &ImageSpec, layer: &Digest) -> Result<ImageConfiguration> {
    let ports = spec.exposed_ports.iter().map(|p| format!("{p}/tcp"));
    let mut config = ConfigBuilder::default()
        .user(spec.user.clone())
        .entrypoint(spec.entrypoint.clone())
        .env(spec.env.clone())
        .exposed_ports(ports.collect::<Vec<_>>());
    // Only when there are some: the hub's and the agent's configs stay as they were.
    if !spec.labels.is_empty() {
        config = config.labels(spec.labels.clone().into_iter().collect::<HashMap<_, _>>());
    }
    let config = config.build()?;
    let rootfs = RootFsBuilder::default()
        .typ("layers")
        .diff_ids(vec![layer.to_string()])
        .build()?;
    let history = HistoryBuilder::default()
        .created_by("flotilla-e2e oci builder")
        .build()?;
    Ok(ImageConfigurationBuilder::default()
        .architecture(Arch::Amd64)
        .os(Os::Linux)
        .config(config)
        .rootfs(rootfs)
        .history(vec![history])
        .build()?)
}

/// The index: the one manifest (`digest`, `size` bytes), named as containerd stores the image.
fn index_of(spec: &ImageSpec, digest: Digest, size: usize) -> Result<Vec<u8>> {
    let tag = spec.name.rsplit_once(':').map_or("latest", |(_, t)| t);
    let platform = PlatformBuilder::default()
        .architecture(Arch::Amd64)
        .os(Os::Linux)
        .build()?;
    let manifest = DescriptorBuilder::default()
        .media_type(MediaType::ImageManifest)
        .digest(digest)
        .size(size as u64)
        .platform(platform)
        .annotations(HashMap::from([
            ("io.containerd.image.name".to_string(), spec.name.clone()),
            (
                "org.opencontainers.image.ref.name".to_string(),
                tag.to_string(),
            ),
        ]))
        .build()?;
    canonical(
        &ImageIndexBuilder::default()
            .schema_version(SCHEMA_VERSION)
            .media_type(MediaType::ImageIndex)
            .manifests(vec![manifest])
            .build()?,
    )
}

/// Writes `spec` as an OCI image layout tar archive to `out`; returns the manifest digest.
pub fn write_archive(spec: &ImageSpec, out: &Path) -> Result<String> {
    let layer = layer(&spec.entries)?;
    let layer_digest = digest(&layer);
    let config = canonical(&image_config(spec, &layer_digest)?)?;
    let config_digest = digest(&config);
    let manifest = canonical(
        &ImageManifestBuilder::default()
            .schema_version(SCHEMA_VERSION)
            .media_type(MediaType::ImageManifest)
            .config(Descriptor::new(
                MediaType::ImageConfig,
                config.len() as u64,
                config_digest.clone(),
            ))
            .layers(vec![Descriptor::new(
                MediaType::ImageLayer,
                layer.len() as u64,
                layer_digest.clone(),
            )])
            .build()?,
    )?;
    let manifest_digest = digest(&manifest);
    let index = index_of(spec, manifest_digest.clone(), manifest.len())?;
    let layout = canonical(
        &OciLayoutBuilder::default()
            .image_layout_version("1.0.0")
            .build()?,
    )?;
    let tmp = out.with_extension("tmp");
    let file =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(file));
    let mut add = |name: &str, data: &[u8]| -> Result<()> {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(0);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, data)?;
        Ok(())
    };
    add("oci-layout", &layout)?;
    add("index.json", &index)?;
    for (d, data) in [
        (&layer_digest, &layer),
        (&config_digest, &config),
        (&manifest_digest, &manifest),
    ] {
        add(&format!("blobs/sha256/{}", d.digest()), data)?;
    }
    b.into_inner()?.into_inner()?.sync_all()?;
    std::fs::rename(&tmp, out)?;
    Ok(manifest_digest.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_archive(path: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
        let mut a = tar::Archive::new(std::fs::File::open(path).unwrap());
        a.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let name = e.path().unwrap().to_string_lossy().into_owned();
                let mut data = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut data).unwrap();
                (name, data)
            })
            .collect()
    }

    #[test]
    fn hub_image_has_the_dockerfile_layout_and_is_deterministic() {
        let dir = std::env::temp_dir().join(format!("flotilla-oci-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("flotilla-hub");
        std::fs::write(&bin, b"\x7fELF not really").unwrap();
        let spec = flotilla_image("hub", &bin, "0.1.0");
        let a = write_archive(&spec, &dir.join("a.tar")).unwrap();
        let b = write_archive(&spec, &dir.join("b.tar")).unwrap();
        assert_eq!(a, b, "same input, same manifest digest");

        let files = read_archive(&dir.join("a.tar"));
        let index: serde_json::Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let m = &index["manifests"][0];
        assert_eq!(
            m["annotations"]["io.containerd.image.name"],
            "docker.io/library/flotilla-hub:0.1.0"
        );
        let manifest: serde_json::Value = serde_json::from_slice(
            &files[&format!(
                "blobs/sha256/{}",
                m["digest"].as_str().unwrap().trim_start_matches("sha256:")
            )],
        )
        .unwrap();
        let blob = |d: &serde_json::Value| {
            files[&format!(
                "blobs/sha256/{}",
                d.as_str().unwrap().trim_start_matches("sha256:")
            )]
                .clone()
        };
        let config: serde_json::Value =
            serde_json::from_slice(&blob(&manifest["config"]["digest"])).unwrap();
        assert_eq!(config["config"]["User"], "65532:65532");
        assert_eq!(
            config["config"]["Entrypoint"],
            serde_json::json!(["/usr/local/bin/flotilla-hub"])
        );
        let layer = blob(&manifest["layers"][0]["digest"]);
        assert_eq!(
            config["rootfs"]["diff_ids"][0].as_str().unwrap(),
            digest(&layer).to_string()
        );
        let mut l = tar::Archive::new(layer.as_slice());
        let mut found = None;
        for e in l.entries().unwrap() {
            let e = e.unwrap();
            if e.path().unwrap() == Path::new("usr/local/bin/flotilla-hub") {
                found = Some(e.header().mode().unwrap());
            }
        }
        assert_eq!(found, Some(0o755));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_nested_destination_gets_its_parents_outermost_first() {
        let dir = std::env::temp_dir().join(format!("flotilla-oci-parents-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tool");
        std::fs::write(&file, b"#!").unwrap();
        let paths = |dest: &str| -> Vec<String> {
            tree(&file, dest)
                .unwrap()
                .into_iter()
                .map(|e| e.path)
                .collect()
        };
        assert_eq!(
            paths("/a/b/c/tool"),
            ["/a", "/a/b", "/a/b/c", "/a/b/c/tool"]
        );
        assert_eq!(paths("a/b/tool/"), ["/a", "/a/b", "/a/b/tool"]);
        assert_eq!(paths("/tool"), ["/tool"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_tree_is_copied_with_its_parents_and_the_labels_reach_the_config() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("flotilla-oci-tree-{}", std::process::id()));
        let src = dir.join("0.1.0");
        std::fs::create_dir_all(src.join("manifests")).unwrap();
        std::fs::write(
            src.join("manifests/csv.yaml"),
            b"kind: ClusterServiceVersion\n",
        )
        .unwrap();
        std::fs::write(src.join("tool"), b"#!").unwrap();
        std::fs::set_permissions(src.join("tool"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let entries = tree(&src, "/opt/bundle").unwrap();
        let paths: Vec<(&str, u32)> = entries.iter().map(|e| (e.path.as_str(), e.mode)).collect();
        assert_eq!(paths[0], ("/opt", 0o755));
        assert_eq!(paths[1].0, "/opt/bundle");
        assert_eq!(paths[2].0, "/opt/bundle/manifests");
        assert_eq!(paths[3].0, "/opt/bundle/manifests/csv.yaml");
        assert_eq!(paths[4], ("/opt/bundle/tool", 0o755));
        assert_eq!(
            tree(&src.join("tool"), "bin/tool").unwrap()[1].path,
            "/bin/tool"
        );

        let mut spec = pause_image(&src.join("tool"), "127.0.0.1:5000/x/bundle:v0.1.0");
        spec.entries = entries;
        spec.labels = BTreeMap::from([(
            "operators.operatorframework.io.bundle.package.v1".to_string(),
            "flotilla-myapp-api".to_string(),
        )]);
        write_archive(&spec, &dir.join("bundle.tar")).unwrap();
        let files = read_archive(&dir.join("bundle.tar"));
        let config = files
            .values()
            .filter_map(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
            .find(|v| v.get("rootfs").is_some())
            .unwrap();
        assert_eq!(
            config["config"]["Labels"]["operators.operatorframework.io.bundle.package.v1"],
            "flotilla-myapp-api"
        );
        // Without labels, the config has none (the hub's and agent's digests stay).
        let plain =
            canonical(&image_config(&pause_image(&src.join("tool"), "p:1"), &digest(b"")).unwrap())
                .unwrap();
        assert!(!String::from_utf8(plain).unwrap().contains("Labels"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! The member side of Flotilla as OLM (Operator Lifecycle Manager) packages, generated
//! from the kustomizations under `deploy/` so that the two installs never drift: for each
//! package and version a `registry+v1` bundle (ClusterServiceVersion, the MyApp CRD, the
//! Service, `metadata/annotations.yaml`), and a file-based catalog of them all.
//! `deploy/olm/` holds the output; `UPDATE_EXPECT=1 cargo test -p flotilla-olm`
//! rewrites it. Pure: reads files, contacts nothing.
//!
//! Data flow: [`kustomize`] builds a kustomization's objects, [`install`] sorts them into
//! what a CSV holds and adapts them to OLM, [`csv`] (with [`descriptors`]) writes the CSV,
//! [`catalog`] the bundle metadata and the catalog.

pub mod catalog;
pub mod csv;
pub mod descriptors;
pub mod install;
pub mod kustomize;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Where the published images live (`deploy/overlays/production` pulls the agent from
/// there too); another registry is an argument of [`generate`].
pub const REGISTRY: &str = "ghcr.io/flotilla";
/// The versions in the catalog, oldest first; each replaces the one before it.
pub const VERSIONS: [&str; 2] = ["0.1.0", "0.2.0"];
/// The one channel, also the default.
pub const CHANNEL: &str = "stable";
/// The `opm` the catalog image is built on; `lab/scripts/olm-prereqs.sh` builds the same
/// version from source.
pub const OPM_IMAGE: &str = "quay.io/operator-framework/opm:v1.73.0";

/// What a package runs of the install it is generated from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// All of it: the agent owns the MyApp CRD and serves its conversion webhook beside
    /// its work. `AllNamespaces` only (a conversion webhook serves the whole cluster).
    Whole,
    /// The MyApp CRD and its conversion webhook alone (`flotilla-agent webhook`), no
    /// rights at all. `AllNamespaces` only.
    Api,
    /// The operator alone: requires the MyApp API (OLM installs the [`Part::Api`]
    /// package with it), installs in every mode and watches the OperatorGroup's target
    /// namespaces, its rights on them namespaced.
    Operator,
}

/// One OLM package: an install under `deploy/`.
#[derive(Debug)]
pub struct Package {
    pub name: &'static str,
    pub part: Part,
    /// The kustomization it is generated from, relative to the repository.
    pub kustomization: &'static str,
    pub display_name: &'static str,
    /// One line, for lists.
    pub summary: &'static str,
    /// The CSV's description (Markdown).
    pub description: &'static str,
    /// How to create what the install needs from the user, after the list of it.
    pub setup: &'static str,
}

pub const PACKAGES: [Package; 3] = [
    Package {
        name: "flotilla-myapp-api",
        part: Part::Api,
        kustomization: "deploy/base",
        display_name: "Flotilla MyApp API",
        summary: "The MyApp CRD and its conversion webhook (flotilla-agent webhook), for the MyApp operator to require.",
        description: "The MyApp API of one cluster: the CRD `myapps.app.example.com` and its \
conversion webhook between MyApp `v1alpha1`, `v1beta1` and the stored `v1` \
(`flotilla-agent webhook`, with the certificate OLM issues). It reconciles nothing and \
needs no rights. The Flotilla MyApp operator requires this API, so OLM installs this \
package with it. A conversion webhook serves the whole cluster: `AllNamespaces` only.",
        setup: "",
    },
    Package {
        name: "flotilla-myapp-operator",
        part: Part::Operator,
        kustomization: "deploy/base",
        display_name: "Flotilla MyApp operator",
        summary: "The MyApp operator for one cluster without a hub (flotilla-agent operator), in the OperatorGroup's target namespaces.",
        description: "Runs MyApps in one cluster without a Flotilla hub (`flotilla-agent operator`). \
Each MyApp becomes a ConfigMap and a Deployment, rolled on every change of either; its \
status says `ready`, `readyReplicas` and the conditions `Available`, `Progressing` and \
`Degraded`. A MyApp without an image gets no Deployment and `Degraded=True/ImageMissing`. \
It watches the OperatorGroup's target namespaces only (every install mode is supported) \
and holds its rights on MyApps, ConfigMaps, Deployments and Events there alone. It \
requires the MyApp API (`myapps.app.example.com` `v1`): OLM installs the package \
`flotilla-myapp-api` (the CRD and its conversion webhook) with it.",
        setup: "",
    },
    Package {
        name: "flotilla-agent",
        part: Part::Whole,
        kustomization: "deploy/overlays/member",
        display_name: "Flotilla agent",
        summary: "The agent of one member cluster of a Flotilla federation (flotilla-agent run): MyApps from the hub, their status back, the MyApp operator beside.",
        description: "The agent of one member cluster of a Flotilla federation \
(`flotilla-agent run`). It dials the hub over one authenticated gRPC stream, applies the \
MyApps the hub places on this cluster, reports their status back, and runs the MyApp \
operator and its conversion webhook beside. Install it in at most one namespace per \
cluster, and not beside the Flotilla MyApp API (both own the MyApp CRD).",
        setup: "
On the hub, `flotilla-hub join NAME --token-file NAME.token` registers the cluster and \
issues its token. Then, in this cluster:

```sh
kubectl -n NAMESPACE create configmap flotilla-agent-hub \\
  --from-literal=FLOTILLA_HUB=https://hub.example.com:7443 --from-literal=FLOTILLA_CLUSTER=NAME
kubectl -n NAMESPACE create secret generic flotilla-hub-credentials \\
  --from-file=token=NAME.token --from-file=ca.crt=hub-tls/ca.crt
```
",
    },
];

/// One bundle: a package at a version, its images in a registry.
#[derive(Clone, Copy, Debug)]
pub struct Bundle<'a> {
    pub package: &'a Package,
    pub version: &'a str,
    pub registry: &'a str,
}

impl Bundle<'_> {
    pub fn csv_name(&self) -> String {
        format!("{}.v{}", self.package.name, self.version)
    }

    pub fn operator_image(&self) -> String {
        format!("{}/flotilla-agent:{}", self.registry, self.version)
    }

    pub fn bundle_image(&self) -> String {
        format!(
            "{}/{}-bundle:v{}",
            self.registry, self.package.name, self.version
        )
    }

    fn position(&self) -> usize {
        VERSIONS
            .iter()
            .position(|v| *v == self.version)
            .unwrap_or(0)
    }

    /// The CSV this one upgrades: the version before it.
    pub fn replaces(&self) -> Option<String> {
        let i = self.position();
        (i > 0).then(|| format!("{}.v{}", self.package.name, VERSIONS[i - 1]))
    }

    /// Every earlier version upgrades straight to this one.
    pub fn skip_range(&self) -> Option<String> {
        (self.position() > 0).then(|| format!(">={} <{}", VERSIONS[0], self.version))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct Error {
    pub path: PathBuf,
    pub message: String,
}

impl Error {
    pub fn at(path: &Path, message: impl Into<String>) -> Self {
        Self {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// Generated files by path relative to `deploy/olm/`.
pub type Tree = BTreeMap<PathBuf, String>;

const HEADER: &str =
    "# Generated from deploy/ by `UPDATE_EXPECT=1 cargo test -p flotilla-olm`; do not edit.\n";

/// Every bundle and the catalog, from the repository at `repo`, with images in `registry`.
pub fn generate(repo: &Path, registry: &str) -> Result<Tree, Error> {
    let min_kube_version = chart_kube_version(repo)?;
    let mut tree = Tree::new();
    for package in &PACKAGES {
        let from = repo.join(package.kustomization);
        let mut install = install::sort(
            kustomize::build(&from)?,
            Path::new(package.kustomization),
            min_kube_version.clone(),
        )?;
        install::take(&mut install, package.part)
            .map_err(|e| Error::at(Path::new(package.kustomization), e))?;
        let root = Path::new("bundles").join(package.name);
        tree.insert(
            root.join("bundle.Dockerfile"),
            HEADER.to_string() + &catalog::bundle_dockerfile(package),
        );
        let mut bundles = Vec::new();
        for version in VERSIONS {
            let bundle = Bundle {
                package,
                version,
                registry,
            };
            let csv = csv::csv(&bundle, &install);
            let dir = root.join(version);
            let manifests = dir.join("manifests");
            let file = format!("{}.clusterserviceversion.yaml", package.name);
            tree.insert(manifests.join(file), yaml(&[&csv]));
            if package.part != Part::Operator {
                tree.insert(
                    manifests.join(crd_file(&install.crd)),
                    yaml(&[&install.crd]),
                );
            }
            for service in &install.services {
                tree.insert(manifests.join(object_file(service)), yaml(&[service]));
            }
            let annotations = catalog::annotations_yaml(package);
            tree.insert(dir.join("metadata/annotations.yaml"), yaml(&[&annotations]));
            bundles.push((bundle, csv));
        }
        let documents = catalog::package_catalog(package, &bundles);
        let path = Path::new("catalog").join(package.name).join("catalog.yaml");
        tree.insert(path, yaml(&documents.iter().collect::<Vec<_>>()));
    }
    tree.insert(
        PathBuf::from("catalog.Dockerfile"),
        HEADER.to_string() + &catalog::catalog_dockerfile(),
    );
    Ok(tree)
}

const CHART: &str = "charts/flotilla/Chart.yaml";

/// `1.29.0` from the chart's `kubeVersion: ">=1.29.0-0"`.
fn chart_kube_version(repo: &Path) -> Result<String, Error> {
    let chart = kustomize::read_documents(&repo.join(CHART))?;
    let range = chart
        .first()
        .and_then(|c| c["kubeVersion"].as_str())
        .unwrap_or_default();
    let version = range.strip_prefix(">=").map(|v| v.trim_end_matches("-0"));
    match version {
        Some(v) if v.split('.').count() == 3 && v.split('.').all(|n| n.parse::<u32>().is_ok()) => {
            Ok(v.to_string())
        }
        _ => Err(Error::at(
            Path::new(CHART),
            format!("kubeVersion {range:?}: expected a lower bound like \">=1.29.0-0\""),
        )),
    }
}

/// `app.example.com_myapps.yaml`, as operator-sdk names CRDs in a bundle.
fn crd_file(crd: &Value) -> String {
    let spec = &crd["spec"];
    format!(
        "{}_{}.yaml",
        spec["group"].as_str().unwrap_or_default(),
        spec["names"]["plural"].as_str().unwrap_or_default()
    )
}

/// `flotilla-agent_v1_service.yaml`, as operator-sdk names other objects.
fn object_file(object: &Value) -> String {
    let version = object["apiVersion"].as_str().unwrap_or_default();
    format!(
        "{}_{}_{}.yaml",
        object["metadata"]["name"].as_str().unwrap_or_default(),
        version.rsplit('/').next().unwrap_or_default(),
        object["kind"].as_str().unwrap_or_default().to_lowercase()
    )
}

fn yaml(documents: &[&Value]) -> String {
    let mut out = HEADER.to_string();
    for (i, document) in documents.iter().enumerate() {
        if i > 0 {
            out.push_str("---\n");
        }
        out.push_str(&serde_yaml::to_string(document).expect("JSON values serialize to YAML"));
    }
    out
}

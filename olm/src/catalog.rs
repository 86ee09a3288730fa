//! The bundle's metadata and the file-based catalog (FBC): one `olm.package`, one
//! `olm.channel` whose entries form the upgrade path, one `olm.bundle` per version with
//! the properties `opm render` derives from the bundle (checked against the real `opm`
//! by `deploy/verify.sh` when `lab/scripts/olm-prereqs.sh` has built it).

use serde_json::{Map, Value, json};

use crate::{Bundle, CHANNEL, OPM_IMAGE, Package};

/// `metadata/annotations.yaml`'s annotations, also the bundle image's labels.
pub fn bundle_annotations(package: &Package) -> Vec<(&'static str, String)> {
    vec![
        (
            "operators.operatorframework.io.bundle.mediatype.v1",
            "registry+v1".into(),
        ),
        (
            "operators.operatorframework.io.bundle.manifests.v1",
            "manifests/".into(),
        ),
        (
            "operators.operatorframework.io.bundle.metadata.v1",
            "metadata/".into(),
        ),
        (
            "operators.operatorframework.io.bundle.package.v1",
            package.name.into(),
        ),
        (
            "operators.operatorframework.io.bundle.channels.v1",
            CHANNEL.into(),
        ),
        (
            "operators.operatorframework.io.bundle.channel.default.v1",
            CHANNEL.into(),
        ),
    ]
}

pub fn annotations_yaml(package: &Package) -> Value {
    let annotations: Map<String, Value> = bundle_annotations(package)
        .into_iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    json!({ "annotations": annotations })
}

/// The bundle image: `FROM scratch`, the manifests and metadata, the annotations as
/// labels. Built from the version's directory.
pub fn bundle_dockerfile(package: &Package) -> String {
    let mut out = String::from("FROM scratch\n\n");
    for (key, value) in bundle_annotations(package) {
        out.push_str(&format!("LABEL {key}={value}\n"));
    }
    out.push_str("\nCOPY manifests /manifests/\nCOPY metadata /metadata/\n");
    out
}

/// What `opm generate dockerfile catalog --base-image OPM_IMAGE` writes: a catalog image
/// that serves `/configs` with `opm serve`.
pub fn catalog_dockerfile() -> String {
    format!(
        r#"# The builder image is expected to contain
# /bin/opm (with serve subcommand)
FROM {OPM_IMAGE} as builder

# Copy FBC root into image at /configs and pre-populate serve cache
ADD catalog /configs
RUN ["/bin/opm", "serve", "/configs", "--cache-dir=/tmp/cache", "--cache-only"]

FROM {OPM_IMAGE}
# The base image is expected to contain
# /bin/opm (with serve subcommand) and /bin/grpc_health_probe

# Configure the entrypoint and command
ENTRYPOINT ["/bin/opm"]
CMD ["serve", "/configs", "--cache-dir=/tmp/cache"]

COPY --from=builder /configs /configs
COPY --from=builder /tmp/cache /tmp/cache

# Set FBC-specific label for the location of the FBC root directory
# in the image
LABEL operators.operatorframework.io.index.configs.v1=/configs
"#
    )
}

/// The package's catalog: the package, its channel, then its bundles oldest first, each
/// with its CSV.
pub fn package_catalog(package: &Package, bundles: &[(Bundle, Value)]) -> Vec<Value> {
    let mut out = vec![
        json!({
            "schema": "olm.package",
            "name": package.name,
            "defaultChannel": CHANNEL,
        }),
        json!({
            "schema": "olm.channel",
            "package": package.name,
            "name": CHANNEL,
            "entries": bundles.iter().map(|(b, _)| channel_entry(b)).collect::<Vec<_>>(),
        }),
    ];
    out.extend(bundles.iter().map(|(b, csv)| olm_bundle(b, csv)));
    out
}

fn channel_entry(bundle: &Bundle) -> Value {
    let mut entry = json!({"name": bundle.csv_name()});
    if let Some(previous) = bundle.replaces() {
        entry["replaces"] = json!(previous);
    }
    if let Some(range) = bundle.skip_range() {
        entry["skipRange"] = json!(range);
    }
    entry
}

/// The `olm.bundle` blob as `opm render` makes it from the bundle directory, with its
/// objects migrated to `olm.csv.metadata` (OLM reads the manifests from the image).
fn olm_bundle(bundle: &Bundle, csv: &Value) -> Value {
    // Owned APIs are `olm.gvk`, required ones `olm.gvk.required` (what OLM resolves).
    let crds = &csv["spec"]["customresourcedefinitions"];
    let mut properties: Vec<Value> = [("owned", "olm.gvk"), ("required", "olm.gvk.required")]
        .into_iter()
        .flat_map(|(field, kind)| {
            crds[field].as_array().into_iter().flatten().map(move |crd| {
                let group = crd["name"].as_str().unwrap_or_default().split_once('.').map(|(_, g)| g);
                json!({"type": kind, "value": {"group": group, "kind": crd["kind"], "version": crd["version"]}})
            })
        })
        .collect();
    properties.push(json!({"type": "olm.package", "value": {
        "packageName": bundle.package.name, "version": bundle.version}}));
    // opm's order: by type, then by the value's JSON text.
    properties.sort_by_key(|p| (p["type"].to_string(), p["value"].to_string()));
    properties.push(json!({"type": "olm.csv.metadata", "value": csv_metadata(csv)}));
    let mut related = vec![
        json!({"name": "", "image": bundle.bundle_image()}),
        json!({"name": "flotilla-agent", "image": bundle.operator_image()}),
    ];
    related.sort_by_key(|r| r["image"].to_string());
    json!({
        "schema": "olm.bundle",
        "name": bundle.csv_name(),
        "package": bundle.package.name,
        "image": bundle.bundle_image(),
        "properties": properties,
        "relatedImages": related,
    })
}

/// The CSV's fields `olm.csv.metadata` carries.
fn csv_metadata(csv: &Value) -> Value {
    let spec = &csv["spec"];
    let mut out = json!({
        "annotations": csv["metadata"]["annotations"],
        "apiServiceDefinitions": {},
        "crdDescriptions": spec["customresourcedefinitions"],
        "labels": csv["metadata"]["labels"],
    });
    for key in [
        "description",
        "displayName",
        "installModes",
        "keywords",
        "maturity",
        "minKubeVersion",
        "provider",
    ] {
        out[key] = spec[key].clone();
    }
    out
}

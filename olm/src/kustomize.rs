//! The objects of a kustomization under `deploy/`, read the way `kubectl kustomize` builds
//! them, for the few features those kustomizations use: `resources` (files and
//! directories), inline JSON 6902 `patches` with a kind/name target, and
//! `configMapGenerator`. Anything else is refused by name, so that a new feature in
//! `deploy/` stops the generator instead of being skipped.

use std::path::Path;

use serde_json::Value;

use crate::Error;

/// What a kustomization builds.
#[derive(Debug, Default)]
pub struct Build {
    /// The objects, in resource order, patched.
    pub objects: Vec<Value>,
    /// The ConfigMaps `configMapGenerator` makes: the install's own settings, which an
    /// OLM install expects the user to create (kustomize would append a hash to the name).
    pub generated_config_maps: Vec<String>,
}

const KNOWN_KEYS: [&str; 5] = [
    "apiVersion",
    "kind",
    "resources",
    "patches",
    "configMapGenerator",
];

/// Builds the kustomization in `dir`.
pub fn build(dir: &Path) -> Result<Build, Error> {
    let file = dir.join("kustomization.yaml");
    let kustomization = read_yaml(&file)?;
    let fields = kustomization
        .as_object()
        .ok_or_else(|| Error::at(&file, "not a mapping"))?;
    if let Some(key) = fields.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
        return Err(Error::at(
            &file,
            format!(
                "`{key}` is not supported by the OLM generator (it reads resources, patches and configMapGenerator)"
            ),
        ));
    }
    let mut out = Build::default();
    for resource in strings(&kustomization["resources"], &file, "resources")? {
        let path = dir.join(resource);
        if path.is_dir() {
            let inner = build(&path)?;
            out.objects.extend(inner.objects);
            out.generated_config_maps
                .extend(inner.generated_config_maps);
        } else {
            out.objects.extend(read_documents(&path)?);
        }
    }
    for generator in list(&kustomization["configMapGenerator"]) {
        let name = generator["name"]
            .as_str()
            .ok_or_else(|| Error::at(&file, "configMapGenerator: an entry without a name"))?;
        out.generated_config_maps.push(name.to_string());
    }
    for (i, patch) in list(&kustomization["patches"]).iter().enumerate() {
        apply_patch(&mut out.objects, patch, &file, i)?;
    }
    Ok(out)
}

fn apply_patch(objects: &mut [Value], patch: &Value, file: &Path, i: usize) -> Result<(), Error> {
    let here = |what: String| Error::at(file, format!("patches[{i}]: {what}"));
    let target = &patch["target"];
    let (Some(kind), Some(name)) = (target["kind"].as_str(), target["name"].as_str()) else {
        return Err(here("needs a target with kind and name".into()));
    };
    let text = patch["patch"]
        .as_str()
        .ok_or_else(|| here("only inline JSON 6902 patches (`patch: |-`) are supported".into()))?;
    let ops: json_patch::Patch = serde_yaml::from_str(text).map_err(|e| here(e.to_string()))?;
    let mut matched = false;
    for object in objects
        .iter_mut()
        .filter(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    {
        json_patch::patch(object, &ops).map_err(|e| here(format!("{kind}/{name}: {e}")))?;
        matched = true;
    }
    if !matched {
        return Err(here(format!("no {kind} named {name} to patch")));
    }
    Ok(())
}

fn list(value: &Value) -> Vec<Value> {
    value.as_array().cloned().unwrap_or_default()
}

fn strings(value: &Value, file: &Path, key: &str) -> Result<Vec<String>, Error> {
    list(value)
        .into_iter()
        .map(|v| match v {
            Value::String(s) => Ok(s),
            _ => Err(Error::at(file, format!("{key}: expected a list of paths"))),
        })
        .collect()
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|e| Error::at(path, e.to_string()))
}

fn read_yaml(path: &Path) -> Result<Value, Error> {
    serde_yaml::from_str(&read(path)?).map_err(|e| Error::at(path, e.to_string()))
}

/// Every non-empty document of a YAML stream.
pub fn read_documents(path: &Path) -> Result<Vec<Value>, Error> {
    let text = read(path)?;
    let mut out = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(document)
            .map_err(|e: serde_yaml::Error| Error::at(path, e.to_string()))?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn dir_with(files: &[(&str, &str)]) -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "flotilla-olm-kustomize-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    const DEPLOYMENT: &str = "kind: Deployment\nmetadata: {name: a}\nspec: {x: [1]}\n---\nkind: Service\nmetadata: {name: a}\n";

    #[test]
    fn reads_resources_patches_and_generator_names() {
        let dir = dir_with(&[
            ("base/kustomization.yaml", "resources: [d.yaml]\n"),
            ("base/d.yaml", DEPLOYMENT),
            (
                "over/kustomization.yaml",
                "resources: [../base]\nconfigMapGenerator: [{name: settings, literals: [A=1]}]\n\
                 patches:\n- target: {kind: Deployment, name: a}\n  patch: |-\n    - op: add\n      path: /spec/x/-\n      value: 2\n",
            ),
        ]);
        let built = build(&dir.join("over")).unwrap();
        assert_eq!(built.objects.len(), 2);
        assert_eq!(built.objects[0]["spec"]["x"], serde_json::json!([1, 2]));
        assert_eq!(built.generated_config_maps, ["settings"]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn refuses_what_it_would_silently_skip() {
        for (kustomization, expected) in [
            (
                "resources: [d.yaml]\nimages: [{name: x}]\n",
                "`images` is not supported",
            ),
            (
                "resources: [d.yaml]\npatches: [{path: p.yaml}]\n",
                "needs a target with kind and name",
            ),
            (
                "resources: [d.yaml]\npatches: [{target: {kind: Deployment, name: b}, patch: '[]'}]\n",
                "no Deployment named b to patch",
            ),
            (
                "resources: [d.yaml]\npatches: [{target: {kind: Deployment, name: a}, patch: '[{op: remove, path: /nope}]'}]\n",
                "Deployment/a",
            ),
        ] {
            let dir = dir_with(&[
                ("kustomization.yaml", kustomization),
                ("d.yaml", DEPLOYMENT),
            ]);
            let err = build(&dir).unwrap_err().to_string();
            assert!(err.contains(expected), "{kustomization}: {err}");
            assert!(err.contains("kustomization.yaml"), "names the file: {err}");
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}

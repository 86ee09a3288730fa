//! `deploy/olm/` must be what the generator makes of `deploy/` today: every generated file
//! equal, none missing, none left over (`README.md` is written by hand).
//! `UPDATE_EXPECT=1 cargo test -p flotilla-olm --test generated` rewrites it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const HAND_WRITTEN: [&str; 1] = ["README.md"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn files_under(root: &Path, dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
        let path = entry.path();
        if path.is_dir() {
            files_under(root, &path, out);
        } else {
            out.insert(path.strip_prefix(root).unwrap().to_path_buf());
        }
    }
}

#[test]
fn deploy_olm_is_current() {
    let tree = flotilla_olm::generate(&repo(), flotilla_olm::REGISTRY).unwrap();
    let root = repo().join("deploy/olm");
    let mut on_disk = BTreeSet::new();
    if root.exists() {
        files_under(&root, &root, &mut on_disk);
    }
    on_disk.retain(|p| !HAND_WRITTEN.iter().any(|h| p == Path::new(h)));
    let update = std::env::var_os("UPDATE_EXPECT").is_some();
    let mut stale = Vec::new();
    for path in on_disk.iter().filter(|p| !tree.contains_key(*p)) {
        if update {
            std::fs::remove_file(root.join(path)).unwrap();
        } else {
            stale.push(path.display().to_string());
        }
    }
    for (path, text) in &tree {
        let file = root.join(path);
        let current = std::fs::read_to_string(&file).unwrap_or_default();
        if current == *text {
            continue;
        }
        if update {
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(&file, text).unwrap();
        } else {
            stale.push(format!(
                "{} ({})",
                path.display(),
                first_difference(&current, text)
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "deploy/olm/ is not what deploy/ generates; rewrite it with \
         `UPDATE_EXPECT=1 cargo test -p flotilla-olm --test generated`:\n  {}",
        stale.join("\n  ")
    );
}

fn first_difference(current: &str, generated: &str) -> String {
    if current.is_empty() {
        return "missing".into();
    }
    let line = current
        .lines()
        .zip(generated.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| current.lines().count().min(generated.lines().count()));
    format!(
        "line {}: {:?} where the generator writes {:?}",
        line + 1,
        current.lines().nth(line).unwrap_or(""),
        generated.lines().nth(line).unwrap_or("")
    )
}

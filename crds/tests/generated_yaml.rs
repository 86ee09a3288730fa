//! The CRD YAML checked in under `crds/` must be what the types generate.

use std::path::Path;

const CHECKED_IN: &str = "flotilla-crds.yaml";

#[test]
fn checked_in_crds_are_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(CHECKED_IN);
    let generated = flotilla_crds::crds_yaml();
    if std::env::var_os("FLOTILLA_UPDATE_CRDS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "{} is stale: run `FLOTILLA_UPDATE_CRDS=1 cargo test -p flotilla-crds` and commit it",
        path.display()
    );
}

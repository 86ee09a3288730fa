//! The CRD YAML checked in under `crds/` must be what the types generate.
//! `UPDATE_EXPECT=1 cargo test -p flotilla-crds` rewrites it.

#[test]
fn checked_in_crds_are_current() {
    expect_test::expect_file!["../flotilla-crds.yaml"].assert_eq(&flotilla_crds::crds_yaml());
}

#[test]
fn checked_in_inventory_crds_are_current() {
    expect_test::expect_file!["../cluster-inventory-crds.yaml"]
        .assert_eq(&flotilla_crds::inventory_crds_yaml());
}

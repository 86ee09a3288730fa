//! The wire form of [`AppKey`] (the key type itself lives with the API types in
//! `flotilla-crds`).

use flotilla_crds::AppKey;

use crate::v1;

/// Reading and writing the `ObjectKey` a message carries.
pub trait WireKey: Sized {
    /// The key a message carries; `None` when absent or with an empty part, which no
    /// Kubernetes object has.
    fn from_wire(key: Option<v1::ObjectKey>) -> Option<Self>;
    fn to_wire(&self) -> v1::ObjectKey;
}

impl WireKey for AppKey {
    fn from_wire(key: Option<v1::ObjectKey>) -> Option<Self> {
        key.filter(|k| !k.namespace.is_empty() && !k.name.is_empty())
            .map(|k| Self::new(k.namespace, k.name))
    }

    fn to_wire(&self) -> v1::ObjectKey {
        v1::ObjectKey {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_empty_parts() {
        let k = AppKey::new("ns", "a");
        assert_eq!(AppKey::from_wire(Some(k.to_wire())), Some(k.clone()));
        assert_eq!(k.to_string(), "ns/a");
        assert_eq!(AppKey::from_wire(None), None);
        for (namespace, name) in [("", "a"), ("ns", ""), ("", "")] {
            let wire = v1::ObjectKey {
                namespace: namespace.into(),
                name: name.into(),
            };
            assert_eq!(
                AppKey::from_wire(Some(wire)),
                None,
                "{namespace:?}/{name:?}"
            );
        }
    }
}

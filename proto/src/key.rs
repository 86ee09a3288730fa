//! The key of a MyApp: its namespace and name, the same on the host (its FederatedMyApp)
//! and in every member.

use std::fmt;

use crate::v1;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AppKey {
    pub namespace: String,
    pub name: String,
}

impl AppKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key a message carries; `None` when absent or with an empty part, which no
    /// Kubernetes object has.
    pub fn from_wire(key: Option<v1::ObjectKey>) -> Option<Self> {
        key.filter(|k| !k.namespace.is_empty() && !k.name.is_empty())
            .map(|k| Self::new(k.namespace, k.name))
    }

    pub fn to_wire(&self) -> v1::ObjectKey {
        v1::ObjectKey {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

impl fmt::Display for AppKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
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

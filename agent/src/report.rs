//! Report: the status of managed MyApps, as the hub wants it.

use flotilla_crds::MyApp;
use flotilla_proto::WireKey;
use flotilla_proto::v1 as pb;

use crate::sync::{Key, applied_hash, is_managed};

/// The report for a MyApp as it stands, or for one that is gone (or no longer managed).
pub fn status_report(key: &Key, app: Option<&MyApp>) -> pb::StatusReport {
    let Some(app) = app.filter(|a| is_managed(a)) else {
        return pb::StatusReport {
            key: Some(key.to_wire()),
            exists: false,
            ..Default::default()
        };
    };
    let status = app.status.clone().unwrap_or_default();
    pb::StatusReport {
        key: Some(key.to_wire()),
        hash: applied_hash(app),
        exists: true,
        ready: status.ready,
        ready_replicas: status.ready_replicas,
        observed_generation: status.observed_generation.unwrap_or_default(),
        generation: app.metadata.generation.unwrap_or_default(),
        conditions: status
            .conditions
            .iter()
            .map(|c| pb::Condition {
                r#type: c.type_.clone(),
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
            })
            .collect(),
        apply_error: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::MyAppStatus;

    fn key() -> Key {
        Key::new("ns", "a")
    }

    fn managed(labels: &str) -> MyApp {
        serde_json::from_str(&format!(
            r#"{{"apiVersion":"app.example.com/v1","kind":"MyApp","metadata":{{"name":"a","namespace":"ns","generation":3,
               "labels":{labels},"annotations":{{"flotilla.io/content-hash":"abc"}}}},"spec":{{}}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn managed_app_reports_its_hash_and_status() {
        let mut app = managed(r#"{"app.kubernetes.io/managed-by":"flotilla"}"#);
        app.status = Some(MyAppStatus {
            ready: true,
            ready_replicas: 3,
            observed_generation: Some(3),
            conditions: vec![],
        });
        let r = status_report(&key(), Some(&app));
        assert!(r.exists && r.ready);
        assert_eq!(
            (
                r.hash.as_str(),
                r.ready_replicas,
                r.observed_generation,
                r.generation
            ),
            ("abc", 3, 3, 3)
        );
    }

    #[test]
    fn missing_or_unmanaged_apps_report_as_gone() {
        assert!(!status_report(&key(), None).exists);
        let app = managed(r#"{"app.kubernetes.io/managed-by":"someone-else"}"#);
        let r = status_report(&key(), Some(&app));
        assert!(!r.exists);
        assert!(
            r.hash.is_empty(),
            "nothing of an unmanaged MyApp is reported"
        );
    }
}

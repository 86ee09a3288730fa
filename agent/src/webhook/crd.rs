//! Where the apiserver finds the conversion webhook: the MyApp CRD's `spec.conversion`.
//! The agent publishes it at start (when told its endpoint), with the CA bundle of the
//! certificate it serves, so the local environment needs no manual step and a cluster
//! install needs no cert-manager.

use axum::http::Uri;
use k8s_openapi::ByteString;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceConversion, CustomResourceDefinition, ServiceReference, WebhookClientConfig,
    WebhookConversion,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};

pub const CRD_NAME: &str = "myapps.app.example.com";
pub const PATH: &str = "/convert";
pub const FIELD_MANAGER: &str = "flotilla-agent-webhook";

/// How the apiserver reaches the webhook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// An `https://` URL ending in `/convert`, e.g. on 127.0.0.1 in the local environment.
    Url(String),
    /// A Service in the cluster; the apiserver calls `https://NAME.NAMESPACE.svc:PORT/convert`.
    Service {
        namespace: String,
        name: String,
        port: i32,
    },
}

impl Endpoint {
    pub fn parse_url(s: &str) -> Result<Self, String> {
        let uri: Uri = s.parse().map_err(|e| format!("not a URL: {e}"))?;
        if uri.scheme_str() != Some("https") || uri.host().is_none() {
            return Err("the apiserver only calls https:// URLs with a host".into());
        }
        Ok(Endpoint::Url(s.to_string()))
    }

    /// `NAMESPACE/NAME` or `NAMESPACE/NAME:PORT` (port 443 by default).
    pub fn parse_service(s: &str) -> Result<Self, String> {
        let (namespace, rest) = s.split_once('/').ok_or("expected NAMESPACE/NAME[:PORT]")?;
        let (name, port) = match rest.split_once(':') {
            Some((name, port)) => (
                name,
                port.parse().map_err(|_| format!("bad port {port:?}"))?,
            ),
            None => (rest, 443),
        };
        if namespace.is_empty() || name.is_empty() {
            return Err("expected NAMESPACE/NAME[:PORT]".into());
        }
        Ok(Endpoint::Service {
            namespace: namespace.into(),
            name: name.into(),
            port,
        })
    }

    /// The names a serving certificate for this endpoint must be valid for.
    pub fn hosts(&self) -> Vec<String> {
        match self {
            Endpoint::Url(url) => {
                let host = url
                    .parse::<Uri>()
                    .ok()
                    .and_then(|u| u.host().map(str::to_string))
                    .unwrap_or_default();
                vec![
                    host.trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_string(),
                ]
            }
            Endpoint::Service {
                namespace, name, ..
            } => vec![
                format!("{name}.{namespace}.svc"),
                format!("{name}.{namespace}.svc.cluster.local"),
            ],
        }
    }
}

/// The CRD's `spec.conversion` for `endpoint`; `ca_pem` becomes the `caBundle`.
pub fn conversion(endpoint: &Endpoint, ca_pem: Option<&str>) -> CustomResourceConversion {
    let (url, service) = match endpoint {
        Endpoint::Url(url) => (Some(url.clone()), None),
        Endpoint::Service {
            namespace,
            name,
            port,
        } => (
            None,
            Some(ServiceReference {
                namespace: namespace.clone(),
                name: name.clone(),
                path: Some(PATH.into()),
                port: Some(*port),
            }),
        ),
    };
    CustomResourceConversion {
        strategy: "Webhook".into(),
        webhook: Some(WebhookConversion {
            conversion_review_versions: vec!["v1".into()],
            client_config: Some(WebhookClientConfig {
                ca_bundle: ca_pem.map(|pem| ByteString(pem.as_bytes().to_vec())),
                service,
                url,
            }),
        }),
    }
}

/// A JSON merge patch setting `spec.conversion`: the unused one of `url` and `service` is
/// removed (the apiserver refuses both), and an absent `caBundle` keeps the current one
/// (e.g. injected by cert-manager).
pub fn merge_patch(conversion: &CustomResourceConversion) -> Value {
    let mut value = serde_json::to_value(conversion).expect("a CRD conversion serializes");
    if let Some(config) = value
        .pointer_mut("/webhook/clientConfig")
        .and_then(Value::as_object_mut)
    {
        for key in ["url", "service"] {
            config.entry(key).or_insert(Value::Null);
        }
    }
    json!({ "spec": { "conversion": value } })
}

/// Whether applying the merge patch `patch` to `value` would change nothing: every
/// member it sets is there with that value, every one it removes (null) is absent.
pub fn changes_nothing(value: &Value, patch: &Value) -> bool {
    match (value, patch) {
        (_, Value::Object(patch)) => patch.iter().all(|(key, p)| {
            let v = value.get(key);
            match p {
                Value::Null => v.is_none_or(Value::is_null),
                Value::Object(_) => v.is_some_and(|v| v.is_object() && changes_nothing(v, p)),
                p => v == Some(p),
            }
        }),
        (value, patch) => value == patch,
    }
}

/// Points the MyApp CRD at the webhook, unless it points there already with that CA (a
/// restart or another replica of the same CA writes nothing). `Ok(false)`: it did.
pub async fn publish(
    client: Client,
    conversion: &CustomResourceConversion,
) -> Result<bool, kube::Error> {
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    let patch = merge_patch(conversion);
    let current = crds.get(CRD_NAME).await?;
    let current = serde_json::to_value(&current).expect("a CRD serializes");
    if changes_nothing(&current, &patch) {
        return Ok(false);
    }
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    crds.patch(CRD_NAME, &params, &Patch::Merge(patch)).await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_endpoints_parse_with_a_default_port() {
        let svc = Endpoint::parse_service("flotilla-system/flotilla-agent").unwrap();
        assert_eq!(
            svc,
            Endpoint::Service {
                namespace: "flotilla-system".into(),
                name: "flotilla-agent".into(),
                port: 443
            }
        );
        assert_eq!(
            svc.hosts(),
            [
                "flotilla-agent.flotilla-system.svc",
                "flotilla-agent.flotilla-system.svc.cluster.local"
            ]
        );
        let with_port = Endpoint::parse_service("ns/hook:9443").unwrap();
        assert!(matches!(with_port, Endpoint::Service { port: 9443, .. }));
        for bad in ["hook", "/hook", "ns/", "ns/hook:http"] {
            assert!(Endpoint::parse_service(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn url_endpoints_must_be_https() {
        let url = Endpoint::parse_url("https://127.0.0.1:9443/convert").unwrap();
        assert_eq!(url.hosts(), ["127.0.0.1"]);
        assert_eq!(
            Endpoint::parse_url("https://[::1]:9443/convert")
                .unwrap()
                .hosts(),
            ["::1"]
        );
        assert!(Endpoint::parse_url("http://127.0.0.1:9443/convert").is_err());
        assert!(Endpoint::parse_url("not a url").is_err());
    }

    #[test]
    fn conversion_names_the_endpoint_and_review_version() {
        let c = conversion(
            &Endpoint::parse_url("https://127.0.0.1:9443/convert").unwrap(),
            Some("PEM"),
        );
        assert_eq!(c.strategy, "Webhook");
        let webhook = c.webhook.unwrap();
        assert_eq!(webhook.conversion_review_versions, ["v1"]);
        let config = webhook.client_config.unwrap();
        assert_eq!(
            config.url.as_deref(),
            Some("https://127.0.0.1:9443/convert")
        );
        assert_eq!(config.ca_bundle, Some(ByteString(b"PEM".to_vec())));
    }

    #[test]
    fn merge_patch_clears_the_other_client_kind() {
        let url = merge_patch(&conversion(
            &Endpoint::Url("https://h/convert".into()),
            Some("PEM"),
        ));
        let config = &url["spec"]["conversion"]["webhook"]["clientConfig"];
        assert_eq!(config["service"], Value::Null);
        assert!(
            config.get("service").is_some(),
            "an explicit null removes a previous service"
        );
        assert_eq!(config["caBundle"], json!("UEVN"), "base64 of PEM");

        let svc = merge_patch(&conversion(
            &Endpoint::parse_service("system/webhook-service").unwrap(),
            None,
        ));
        let config = &svc["spec"]["conversion"]["webhook"]["clientConfig"];
        assert!(config.get("url").is_some_and(Value::is_null));
        assert!(
            config.get("caBundle").is_none(),
            "an unknown CA keeps the published one"
        );
        assert_eq!(config["service"]["path"], "/convert");
    }

    /// The CRD as the apiserver has it after the patch is what the patch changes nothing
    /// in; a different CA, endpoint or a leftover `service` is a change.
    #[test]
    fn a_patch_already_applied_changes_nothing() {
        let url = Endpoint::Url("https://h/convert".into());
        let patch = merge_patch(&conversion(&url, Some("PEM")));
        let mut crd = json!({"metadata": {"name": CRD_NAME}, "spec": {"group": "app.example.com",
            "conversion": {"strategy": "Webhook", "webhook": {"conversionReviewVersions": ["v1"],
                "clientConfig": {"url": "https://h/convert", "caBundle": "UEVN"}}}}});
        assert!(changes_nothing(&crd, &patch));
        let other_ca = merge_patch(&conversion(&url, Some("OTHER")));
        assert!(!changes_nothing(&crd, &other_ca));
        let other_url = merge_patch(&conversion(
            &Endpoint::Url("https://g/convert".into()),
            Some("PEM"),
        ));
        assert!(!changes_nothing(&crd, &other_url));
        // No caBundle in the patch (cert-manager injects it): whatever is there stays.
        assert!(changes_nothing(&crd, &merge_patch(&conversion(&url, None))));
        crd["spec"]["conversion"]["webhook"]["clientConfig"]["service"] =
            json!({"namespace": "ns", "name": "old"});
        assert!(!changes_nothing(&crd, &patch), "a service to remove");
        assert!(
            !changes_nothing(&json!({"spec": {}}), &patch),
            "no conversion yet"
        );
        assert!(!changes_nothing(
            &json!({"spec": {"conversion": "None"}}),
            &patch
        ));
    }
}

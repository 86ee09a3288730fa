//! Dialling the hub: TLS only (the bearer token must never travel in clear), the token on
//! every request, HTTP/2 keepalive so that a dead or silent hub is noticed, and Hello as
//! the first message of the session.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::v1::federation_client::FederationClient;
use crate::v1::{self as pb, agent_message};

/// Where the hub is and how to trust and authenticate to it.
#[derive(Clone, Debug)]
pub struct Dial {
    /// `https://host:port` of the hub's gRPC endpoint.
    pub hub: String,
    /// PEM of the CA that signed the hub's certificate.
    pub ca_pem: Vec<u8>,
    /// The name to verify the hub's certificate against, if not the URL's host.
    pub server_name: Option<String>,
    /// `<cluster>.<secret>`, as `flotilla-hub join` issued it; `Debug` prints it redacted.
    pub token: SecretString,
    /// A ping is sent after this long without traffic; the connection is dropped when
    /// it is not answered within `keepalive_timeout`.
    pub keepalive: Duration,
    pub keepalive_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("hub address {hub:?}: {reason}")]
    Address { hub: String, reason: String },
    #[error("the token is not a valid header value (it must be <cluster>.<secret>)")]
    Token,
    #[error("connecting to the hub at {hub}: {source}")]
    Connect {
        hub: String,
        source: tonic::transport::Error,
    },
    #[error("the hub refused the session: {0}")]
    Refused(tonic::Status),
}

/// Adds `authorization: Bearer <token>` to every request.
#[derive(Clone)]
pub struct Bearer(MetadataValue<Ascii>);

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

/// The `authorization` value for `token`, marked sensitive: tonic's and hyper's `Debug`
/// of the request's headers leave it out.
fn bearer(token: &SecretString) -> Result<MetadataValue<Ascii>, DialError> {
    let mut value: MetadataValue<Ascii> = format!("Bearer {}", token.expose_secret())
        .parse()
        .map_err(|_| DialError::Token)?;
    value.set_sensitive(true);
    Ok(value)
}

pub type HubClient = FederationClient<InterceptedService<Channel, Bearer>>;

/// Connects to the hub over TLS; refuses anything but `https://`.
pub async fn connect(dial: &Dial) -> Result<HubClient, DialError> {
    let address = |reason: String| DialError::Address {
        hub: dial.hub.clone(),
        reason,
    };
    if !dial.hub.starts_with("https://") {
        return Err(address(
            "must start with https:// (the token is never sent in clear)".into(),
        ));
    }
    let connect = |source| DialError::Connect {
        hub: dial.hub.clone(),
        source,
    };
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&dial.ca_pem));
    if let Some(name) = &dial.server_name {
        tls = tls.domain_name(name.clone());
    }
    let bearer = bearer(&dial.token)?;
    let channel = Endpoint::from_shared(dial.hub.clone())
        .map_err(|e| address(e.to_string()))?
        .tls_config(tls)
        .map_err(connect)?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(dial.keepalive)
        .keep_alive_timeout(dial.keepalive_timeout)
        .keep_alive_while_idle(true)
        .connect()
        .await
        .map_err(connect)?;
    Ok(FederationClient::with_interceptor(channel, Bearer(bearer))
        .max_decoding_message_size(MAX_MESSAGE))
}

/// The largest hub → agent message: a rendered MyApp is far smaller, and a SyncComplete
/// listing 100,000 keys fits.
pub const MAX_MESSAGE: usize = 16 << 20;

/// The largest agent → hub message the hub reads. Reports, heartbeats and capacity are
/// a few hundred bytes; Hello lists every MyApp the agent manages, one `Managed` each of
/// at most 63 (namespace) + 253 (name) + 64 (hex SHA-256) bytes of text + 13 of protobuf
/// framing (three tags and length prefixes each) = 393 bytes. 4 MiB = 4,194,304 bytes
/// holds 10,672 of them with the longest legal names, ten times the 1,000 MyApps an agent
/// is sized for (about 31,000 with a namespace and a name of 30 characters each).
pub const MAX_AGENT_MESSAGE: usize = 4 << 20;

/// Opens a session: `hello` goes first; the sender carries what follows it.
pub async fn open_session(
    client: &mut HubClient,
    hello: pb::Hello,
    buffer: usize,
) -> Result<
    (
        mpsc::Sender<pb::AgentMessage>,
        tonic::Streaming<pb::HubMessage>,
    ),
    DialError,
> {
    let (tx, rx) = mpsc::channel(buffer.max(1));
    tx.try_send(pb::AgentMessage {
        kind: Some(agent_message::Kind::Hello(hello)),
    })
    .expect("a fresh channel has room for Hello");
    let inbound = client
        .session(ReceiverStream::new(rx))
        .await
        .map_err(DialError::Refused)?
        .into_inner();
    Ok((tx, inbound))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dial(hub: &str) -> Dial {
        Dial {
            hub: hub.into(),
            ca_pem: Vec::new(),
            server_name: None,
            token: "c1.secret".into(),
            keepalive: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn plain_http_is_refused_before_anything_is_sent() {
        let err = connect(&dial("http://127.0.0.1:1")).await.err().unwrap();
        assert_eq!(
            err.to_string(),
            "hub address \"http://127.0.0.1:1\": must start with https:// (the token is never sent in clear)"
        );
    }

    #[tokio::test]
    async fn a_token_that_is_no_header_value_is_refused() {
        let mut d = dial("https://127.0.0.1:1");
        d.token = "c1.se\ncret".into();
        assert!(matches!(connect(&d).await, Err(DialError::Token)));
    }

    #[test]
    fn debug_output_never_shows_the_token() {
        let mut d = dial("https://127.0.0.1:1");
        d.token = "c1.s3cr3t-t0ken".into();
        let shown = format!("{d:?}");
        assert!(!shown.contains("s3cr3t-t0ken"), "{shown}");
        assert!(
            shown.contains("https://127.0.0.1:1"),
            "the rest still shows: {shown}"
        );
    }

    #[test]
    fn the_authorization_header_is_marked_sensitive() {
        let value = bearer(&"c1.s3cr3t-t0ken".into()).unwrap();
        assert!(value.is_sensitive());
        assert!(!format!("{value:?}").contains("s3cr3t-t0ken"));
    }
}

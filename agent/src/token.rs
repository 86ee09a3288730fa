//! Token: where the agent's hub token lives, and how a renewed one is stored.
//!
//! The token is read before every dial, from the Secret named by `--token-secret` when
//! there is one (the source of truth: a mounted copy lags by a minute), else from
//! `--token-file`; a `join --rotate` written there is picked up without a restart. A
//! token the hub renews over the session is stored in the same place (the Secret's
//! `token` key, or the file, replaced atomically) before the agent acknowledges it, so a
//! restart at any point finds a token the hub accepts: the old one until the hub has
//! seen the acknowledgement or a session opened with the new one, the new one after.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};

/// The key of the token in the credentials Secret (as `flotilla-hub join` writes it).
pub const SECRET_KEY: &str = "token";
const FIELD_MANAGER: &str = "flotilla-agent";

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("reading the token file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the token file {path}: {source}")]
    WriteFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("reading Secret {namespace}/{name}: {source}")]
    ReadSecret {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("writing key {SECRET_KEY} of Secret {namespace}/{name}: {source}")]
    WriteSecret {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("Secret {namespace}/{name} has no key {SECRET_KEY:?}, or it is not UTF-8")]
    NoKey { namespace: String, name: String },
    #[error("the token is empty or not one line of text")]
    Malformed,
}

/// Where the token is read from and a renewed one written to.
pub enum TokenStore {
    File(PathBuf),
    /// The `token` key of a Secret in the agent's cluster.
    Secret {
        namespace: String,
        name: String,
    },
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenStore::File(path) => write!(f, "file {}", path.display()),
            TokenStore::Secret { namespace, name } => write!(f, "Secret {namespace}/{name}"),
        }
    }
}

/// The hex SHA-256 of a token: what the agent answers a renewal with, what the hub
/// stores.
pub fn sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A token as stored: one line of text, surrounding whitespace ignored.
fn parse(text: &str) -> Result<SecretString, TokenError> {
    let token = text.trim();
    if token.is_empty() || token.contains(char::is_whitespace) {
        return Err(TokenError::Malformed);
    }
    Ok(token.into())
}

impl TokenStore {
    /// The token as stored now (`client`: the agent's cluster, for a Secret).
    pub async fn read(&self, client: &Client) -> Result<SecretString, TokenError> {
        match self {
            TokenStore::File(path) => {
                let text = tokio::fs::read_to_string(path).await.map_err(|source| {
                    TokenError::ReadFile {
                        path: path.clone(),
                        source,
                    }
                })?;
                parse(&text)
            }
            TokenStore::Secret { namespace, name } => {
                let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
                let secret = api
                    .get(name)
                    .await
                    .map_err(|source| TokenError::ReadSecret {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        source,
                    })?;
                let text = (secret.data.as_ref())
                    .and_then(|d| d.get(SECRET_KEY))
                    .and_then(|b| String::from_utf8(b.0.clone()).ok())
                    .ok_or_else(|| TokenError::NoKey {
                        namespace: namespace.clone(),
                        name: name.clone(),
                    })?;
                parse(&text)
            }
        }
    }

    /// Stores `token` in place of the current one; done when this returns Ok.
    pub async fn write(&self, client: &Client, token: &SecretString) -> Result<(), TokenError> {
        parse(token.expose_secret())?;
        match self {
            TokenStore::File(path) => {
                write_file(path, token.expose_secret())
                    .await
                    .map_err(|source| TokenError::WriteFile {
                        path: path.clone(),
                        source,
                    })
            }
            TokenStore::Secret { namespace, name } => {
                let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
                // Only the token key: the CA beside it stays as it is.
                let patch = serde_json::json!({"stringData": {SECRET_KEY: token.expose_secret()}});
                let params = PatchParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..Default::default()
                };
                api.patch(name, &params, &Patch::Merge(&patch))
                    .await
                    .map(drop)
                    .map_err(|source| TokenError::WriteSecret {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        source,
                    })
            }
        }
    }
}

/// Replaces `path` by a file holding `contents` (mode 0600), atomically: a crash leaves
/// the old token or the new one, never a part of either. Synced before and after the
/// rename, so that the new token is on disk before the agent acknowledges it.
async fn write_file(path: &Path, contents: &str) -> std::io::Result<()> {
    let path = path.to_owned();
    let contents = contents.to_owned();
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let temp = dir.join(format!(".{}.renewed", name.unwrap_or_default()));
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&temp)?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&temp, &path)?;
        std::fs::File::open(&dir)?.sync_all()
    })
    .await
    .map_err(std::io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client of no cluster: a file store never uses it.
    fn nowhere() -> Client {
        Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap()
    }

    #[test]
    fn a_token_is_one_line_and_never_shown() {
        assert_eq!(
            parse("  paris.abc \n").unwrap().expose_secret(),
            "paris.abc"
        );
        for bad in ["", "  \n", "paris.a bc", "paris.a\nparis.b"] {
            assert!(matches!(parse(bad), Err(TokenError::Malformed)), "{bad:?}");
        }
        let store = TokenStore::File("/run/hub/token".into());
        assert_eq!(format!("{store:?}"), "file /run/hub/token");
    }

    #[tokio::test]
    async fn a_renewed_token_replaces_the_file_whole_and_private() {
        let dir = std::env::temp_dir().join(format!(
            "flotilla-token-test-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("paris.token");
        std::fs::write(&path, "paris.old\n").unwrap();
        let store = TokenStore::File(path.clone());
        let client = nowhere();
        assert_eq!(
            store.read(&client).await.unwrap().expose_secret(),
            "paris.old"
        );
        store.write(&client, &"paris.new".into()).await.unwrap();
        assert_eq!(
            store.read(&client).await.unwrap().expose_secret(),
            "paris.new"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // Nothing left beside it.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["paris.token"]);
        // A malformed token is never written over a good one.
        assert!(store.write(&client, &"two words".into()).await.is_err());
        assert_eq!(
            store.read(&client).await.unwrap().expose_secret(),
            "paris.new"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_file_that_cannot_be_written_keeps_the_old_token_and_says_where() {
        let store = TokenStore::File("/nonexistent-dir/paris.token".into());
        let client = nowhere();
        let e = store.write(&client, &"paris.new".into()).await.unwrap_err();
        assert!(
            e.to_string().contains("/nonexistent-dir/paris.token"),
            "{e}"
        );
    }

    #[test]
    fn the_hash_is_what_the_hub_stores() {
        // FIPS 180-2's example: lower-case hex, as `flotilla-hub` writes tokenSha256.
        assert_eq!(
            sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}

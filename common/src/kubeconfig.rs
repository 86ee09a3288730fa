//! `--kubeconfig` and `--context` for every command that talks to a cluster: without them,
//! kube's usual order applies (`$KUBECONFIG`, `~/.kube/config`, then the in-cluster
//! ServiceAccount).

use std::path::PathBuf;

use kube::config::{Config, KubeConfigOptions, Kubeconfig};

#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeArgs {
    /// Kubeconfig file of the cluster to talk to.
    #[arg(long, global = true, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the kubeconfig to use instead of its current context.
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("reading kubeconfig {path}: {source}")]
    Read {
        path: String,
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {path}, context {context}: {source}")]
    Context {
        path: String,
        context: String,
        source: kube::config::KubeconfigError,
    },
    #[error("no cluster configuration (kubeconfig or in-cluster): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("building the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

impl KubeArgs {
    pub async fn client(&self) -> Result<kube::Client, KubeconfigError> {
        Ok(kube::Client::try_from(self.config().await?)?)
    }

    /// The configuration for the chosen kubeconfig and context.
    pub async fn config(&self) -> Result<Config, KubeconfigError> {
        let options = KubeConfigOptions {
            context: self.context.clone(),
            ..Default::default()
        };
        let context_error = |path: String| {
            let context = self.context.clone().unwrap_or_else(|| "(current)".into());
            move |source| KubeconfigError::Context {
                path,
                context,
                source,
            }
        };
        Ok(match (&self.kubeconfig, &self.context) {
            (None, None) => Config::infer().await?,
            (Some(path), _) => {
                let kubeconfig =
                    Kubeconfig::read_from(path).map_err(|source| KubeconfigError::Read {
                        path: path.display().to_string(),
                        source,
                    })?;
                Config::from_custom_kubeconfig(kubeconfig, &options)
                    .await
                    .map_err(context_error(path.display().to_string()))?
            }
            (None, Some(_)) => Config::from_kubeconfig(&options)
                .await
                .map_err(context_error("$KUBECONFIG or ~/.kube/config".into()))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECONFIG: &str = r#"
apiVersion: v1
kind: Config
current-context: a
clusters:
- name: a
  cluster: {server: "https://127.0.0.1:6443"}
- name: b
  cluster: {server: "https://127.0.0.2:7443"}
users:
- name: u
  user: {token: t}
contexts:
- name: a
  context: {cluster: a, user: u}
- name: b
  context: {cluster: b, user: u}
"#;

    /// A kubeconfig file unique to `name` (tests run in parallel), removed on drop.
    fn write(name: &str, contents: &str) -> (PathBuf, impl Drop) {
        struct Remove(PathBuf);
        impl Drop for Remove {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        let path = std::env::temp_dir().join(format!(
            "flotilla-kubeconfig-test-{}-{name}",
            std::process::id()
        ));
        std::fs::write(&path, contents).unwrap();
        (path.clone(), Remove(path))
    }

    #[tokio::test]
    async fn the_named_context_picks_its_cluster() {
        let (path, _rm) = write("contexts", KUBECONFIG);
        let url = |context: Option<&str>| {
            let args = KubeArgs {
                kubeconfig: Some(path.clone()),
                context: context.map(str::to_string),
            };
            async move { args.config().await.unwrap().cluster_url.to_string() }
        };
        assert_eq!(url(None).await, "https://127.0.0.1:6443/");
        assert_eq!(url(Some("b")).await, "https://127.0.0.2:7443/");
    }

    #[tokio::test]
    async fn errors_name_the_file_and_the_context() {
        let (path, _rm) = write("errors", KUBECONFIG);
        let unknown = KubeArgs {
            kubeconfig: Some(path.clone()),
            context: Some("nope".into()),
        };
        let e = unknown.config().await.unwrap_err().to_string();
        assert!(
            e.contains("nope") && e.contains(&path.display().to_string()),
            "{e}"
        );
        let missing = KubeArgs {
            kubeconfig: Some("/nonexistent/kubeconfig".into()),
            context: None,
        };
        let e = missing.config().await.unwrap_err().to_string();
        assert!(e.contains("/nonexistent/kubeconfig"), "{e}");
        let (garbage, _rm2) = write("garbage", "{not: [yaml");
        let e = KubeArgs {
            kubeconfig: Some(garbage.clone()),
            context: None,
        }
        .config()
        .await
        .unwrap_err()
        .to_string();
        assert!(e.contains(&garbage.display().to_string()), "{e}");
    }
}

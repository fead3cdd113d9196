//! How agentk finds its API server and credentials: kube's configuration, in the cluster
//! (its service account) or from a kubeconfig. (The simulation hands [`Upstream::over`] a
//! client of its own API server instead.)

use super::{BoxError, Upstream};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use std::path::Path;

impl Upstream {
    /// The API server of the cluster this runs in (in-cluster service account), or else of
    /// the current kubeconfig context.
    pub async fn infer() -> Result<Upstream, String> {
        let config = kube::Config::infer().await.map_err(|e| {
            format!("no Kubernetes API configuration (in-cluster or kubeconfig): {e}")
        })?;
        Self::new(config)
    }

    /// The API server of the current context of the kubeconfig at `path`.
    pub async fn from_kubeconfig(path: &Path) -> Result<Upstream, String> {
        let kubeconfig = kube::config::Kubeconfig::read_from(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Self::new(config)
    }

    /// The API server `config` describes, with its credentials (token, refreshed tokens
    /// or client certificate) and TLS settings.
    pub fn new(config: kube::Config) -> Result<Upstream, String> {
        use kube::client::ConfigExt;
        let connector = config
            .rustls_https_connector()
            .map_err(|e| format!("Kubernetes API TLS configuration: {e}"))?;
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build::<_, UnsyncBoxBody<Bytes, BoxError>>(connector);
        let auth = config
            .auth_layer()
            .map_err(|e| format!("Kubernetes API credentials: {e}"))?;
        let extra = config
            .extra_headers_layer()
            .map_err(|e| format!("Kubernetes API headers: {e}"))?;
        let service = tower::ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(auth)
            .layer(extra)
            .map_err(BoxError::from)
            .service(client);
        Ok(Upstream::over(service))
    }
}

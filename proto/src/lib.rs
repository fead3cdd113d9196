//! Protocol types of kas: the frame envelope, registry records, and the public, private,
//! agent and Pods APIs.
//!
//! Built with the `grpc` feature (the default) each module also holds its tonic client and
//! server, real or simulated (`--cfg madsim`) depending on the build. Without it the crate
//! holds plain prost messages only, which is how `kas-core` uses it.
#![allow(missing_docs, clippy::all)]

/// Includes one generated package: through `tonic::include_proto!` when gRPC code is built
/// (it picks madsim's simulated code under `--cfg madsim`), as plain prost output otherwise.
macro_rules! package {
    ($name:literal) => {
        #[cfg(feature = "grpc")]
        tonic::include_proto!($name);
        #[cfg(not(feature = "grpc"))]
        include!(concat!(env!("OUT_DIR"), "/", $name, ".rs"));
    };
}

#[cfg(all(feature = "grpc", not(madsim)))]
pub mod codec;

/// The envelope that carries a routed call on every hop.
pub mod frame {
    package!("kas.frame");

    /// The `RequestStart.metadata` key (and the caller's header) that carries a call's
    /// correlation id on every hop, GitLab's name for it.
    pub const CORRELATION_ID: &str = "x-gitlab-correlation-id";

    impl RequestStart {
        /// The call's correlation id, for its log lines: empty when it carries none (a
        /// call from a kas that sent none).
        pub fn correlation_id(&self) -> &str {
            self.metadata
                .get(CORRELATION_ID)
                .and_then(|v| v.values.first())
                .map_or("", String::as_str)
        }
    }
}

/// Records kept in the registry store (Redis).
pub mod registry {
    package!("kas.registry");

    /// The longest value of each `KubernetesVersion` field kas accepts: agentk cuts what
    /// its API server says to this, kas refuses a connection that sends more.
    pub const KUBERNETES_VERSION_FIELD_MAX: usize = 64;
}

/// GitLab -> kas.
pub mod public_api {
    package!("kas.public_api");

    pub use crate::pod_list::GetPodsResponse;
}

/// kas -> kas (a service only, so it exists with the `grpc` feature).
#[cfg(feature = "grpc")]
pub mod private_api {
    package!("kas.private_api");
}

/// agentk -> kas.
pub mod agent_api {
    package!("kas.agent_api");
}

pub mod pod_list;

/// The agent-side Pods module.
pub mod pods {
    package!("kas.pods");

    /// The full gRPC name of `Pods.List`, as routed through tunnels.
    pub const LIST_METHOD: &str = "/kas.pods.Pods/List";
    /// The full gRPC name of `Pods.Logs`, as routed through tunnels.
    pub const LOGS_METHOD: &str = "/kas.pods.Pods/Logs";
}

/// A generic HTTP exchange through the tunnel, and the modules that carry one.
pub mod http {
    package!("kas.http");

    /// The full gRPC name of the agent's Kubernetes API proxy: a streaming call whose
    /// messages are [`HttpRequest`]s one way and [`HttpResponse`]s the other.
    pub const KUBERNETES_API_METHOD: &str = "/kas.kubernetes_api.KubernetesApi/MakeRequest";
}

pub use prost;
pub use prost_types;

//! The controller's top-level error: one variant per subsystem that can fail to start or
//! fail while running, each wrapping that subsystem's own error.

use crate::{grpc, k8s, observability, peering};

/// Why the controller stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Logging could not be set up.
    #[error("cannot set up logging")]
    Logging(#[from] observability::logging::Error),
    /// The API client could not be built.
    #[error("cannot connect to Kubernetes")]
    Client(#[from] k8s::client::Error),
    /// The gRPC server failed.
    #[error("the handler gRPC server failed")]
    Grpc(#[from] grpc::server::Error),
    /// The admin endpoint failed.
    #[error("the admin endpoint failed")]
    Admin(#[from] observability::admin::Error),
    /// Peering or leader election could not start.
    #[error("cannot start peering")]
    Peering(#[from] peering::Error),
    /// Sharding could not start.
    #[error("cannot join the sharding ring")]
    Sharding(#[from] crate::sharding::Error),
    /// An operator activity stopped the controller (a startup handler failed for good).
    #[error("an operator activity failed")]
    Activity(#[from] crate::engine::activities::Error),
    /// The node-local storage cannot be used.
    #[error("cannot open the node-local storage")]
    NodeStore(#[from] crate::persistence::node_store::Error),
    /// The admission webhooks could not start.
    #[error("cannot start the admission webhooks")]
    Webhooks(#[from] crate::webhooks::Error),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers")]
    Signal(#[source] std::io::Error),
}

/// The controller's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! The gRPC side of the controller: the `capstan.v1.RuntimeService` that handler processes
//! dial, and the hub that dispatches work to them.
//!
//! This layer knows the wire protocol and nothing about Kubernetes: resources are resolved
//! through the [`connection::Resolver`] the app supplies, and work arrives as `model::Work`.

pub mod connection;
pub mod control;
pub mod convert;
pub mod frames;
pub mod hub;
pub mod server;

pub use connection::Resolver;
pub use control::Control;
pub use hub::Hub;
pub use server::{Listen, Server};

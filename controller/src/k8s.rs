//! The only layer that talks to the Kubernetes API server.
//!
//! Everything above it (the app, the engine) asks for what it needs in domain terms —
//! "resolve this selector", "watch this resource", "patch this object" — and this layer turns
//! that into API calls with kube-rs.

pub mod admission;
pub mod client;
pub mod crds;
pub mod discovery;
pub mod events;
pub mod handler_identity;
pub mod lease;
pub mod listing;
pub mod members;
pub mod objects;
pub mod peering;
pub mod quarantine;
pub mod reachability;
pub mod shared_secret;
pub mod switch;
pub mod transport;
pub mod watch;

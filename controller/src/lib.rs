//! The Capstan controller.
//!
//! Capstan runs Kubernetes operators whose handlers are written in any language. This crate is
//! the controller: it watches the cluster with kopf's semantics and streams handler
//! invocations to the handler processes that connect to it over gRPC (`capstan.v1`).
//!
//! # Layers
//!
//! Imports point downward only:
//!
//! ```text
//! app ──► engine (registry, queue, processing, causes, matching, execution, essence, diff)
//!  │      peering (gate, keepalive, freeze, election, commands)
//!  │        │
//!  │        ├──► grpc (server, connection, hub, convert)   ── the wire protocol, no Kubernetes
//!  │        ├──► k8s  (client, discovery, objects, watch,  ── the only layer that calls the API
//!  │        │          peering, lease)
//!  │        └──► persistence (keys, progress, diffbase)    ── names and formats of stored state
//!  └──────────► observability (logging, health, admin), config, model, diagnostic
//! ```
//!
//! `error` aggregates the subsystems' errors for `main`; nothing below `app` imports it.
//! `diagnostic` (an error with its causes on one line) imports nothing of the crate.
//!
//! `engine` and `peering` are siblings: the peering gate pauses dispatch in the hub, and the
//! engine (like daemons later) can follow the gate's `paused` receiver without importing the
//! reasons behind it.
//!
//! `check` (the `capstan check` command) stands apart: it speaks HTTP to a running
//! controller's admin endpoint and imports nothing of the crate.
//!
//! `inspection` (the `capstan status` command) reads objects through `k8s` and decodes
//! their stored state through `persistence`; `steering` (`capstan retry`) builds on it and
//! writes the retry request that `engine` consumes. Nothing else imports either.
//!
//! `grpc` never imports `k8s`: resources are resolved through the [`grpc::Resolver`] that the
//! app supplies, and work crosses as [`model::Work`] and [`model::Outcome`].

pub mod app;
pub mod check;
pub mod cli;
pub mod config;
pub mod diagnostic;
pub mod engine;
pub mod error;
pub mod grpc;
pub mod inspection;
pub mod k8s;
pub mod model;
pub mod observability;
pub mod peering;
pub mod persistence;
pub mod sharding;
pub mod signal;
pub mod steering;
pub mod webhooks;

pub use error::{Error, Result};

//! Write [Capstan](https://github.com/capstan-dev/capstan) handlers in Rust.
//!
//! Capstan's controller watches Kubernetes with kopf's semantics and calls your handlers over
//! one gRPC stream; this crate is the handler side. Register handlers kopf-style in a
//! [`Registry`], hand it to an [`Operator`], and drive [`Operator::run`] from your `main`:
//!
//! ```no_run
//! use capstan_sdk::{Context, HandlerResult, Operator, Registry};
//! use serde_json::json;
//!
//! async fn create_fn(ctx: Context) -> HandlerResult {
//!     ctx.info(format!("creating {}", ctx.name()));
//!     ctx.patch().label("demo.capstan.dev/handled", "yes");
//!     Ok(Some(json!({"message": format!("hello {}", ctx.name())})))
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), capstan_sdk::Error> {
//!     let mut registry = Registry::new();
//!     registry.on_create("examples.demo.capstan.dev", "create_fn", create_fn).retries(5);
//!     Operator::new(registry)
//!         .endpoint("unix:///run/capstan/capstan.sock")
//!         .run(async { tokio::signal::ctrl_c().await.ok(); })
//!         .await
//! }
//! ```
//!
//! Handlers fail with [`HandlerError`] (temporary with a delay, permanent, or anything else via
//! `?`), read the invocation through [`Context`], change their object through [`Patch`], and
//! are unit-tested without a cluster with [`testing::TestKit`].
//!
//! # Modules and layering
//!
//! `runner` (the [`Operator`]) → `connection` (one stream) → `dispatch` (one invocation, shared
//! with `testing`) → `registry`, `context`, `patch`, `filters`, `handler`, `selector` →
//! `snapshot`, `control`, `outbox`, `convert`, `error`, [`pb`].
//!
//! # Feature flags
//!
//! - `testing` (default): the [`testing`] module, an in-process fake runtime for unit-testing
//!   handlers without a cluster or a socket.

mod connection;
mod context;
mod control;
mod convert;
mod dispatch;
mod error;
mod filters;
mod handler;
mod index;
mod memo;
mod outbox;
mod patch;
pub mod pb;
mod registry;
mod runner;
mod selector;
mod snapshot;
#[cfg(feature = "testing")]
pub mod testing;

pub use context::{Context, DiffItem, DiffOp, Reason};
pub use error::{Error, HandlerError, Result};
pub use filters::{MetaFilter, Presence, ValueFilter};
pub use handler::{Handler, HandlerOutput, HandlerResult, IntoOutcome};
pub use index::{Index, IndexKey, Store};
pub use memo::Memo;
pub use patch::Patch;
pub use pb::{CancelReason, EventType, LogLevel};
pub use registry::{ErrorsMode, HandlerOptions, Registry};
pub use runner::{DEFAULT_ENDPOINT, Operator};
pub use selector::Selector;
pub use snapshot::Snapshot;

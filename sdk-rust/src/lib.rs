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
//!         .run(capstan_sdk::shutdown_signal())
//!         .await
//! }
//! ```
//!
//! Handlers fail with [`HandlerError`] (temporary with a delay, permanent, or anything else via
//! `?`), read the invocation through [`Context`], change their object through [`Patch`], and
//! are unit-tested without a cluster with [`testing::TestKit`]. Change handlers declare
//! sub-handlers with [`Context::subhandler`] (nested, and with their own options via
//! [`Context::subhandler_with`] and [`SubhandlerOptions`]), and make the objects they create
//! children of theirs with [`Context::adopt`] and the rest of kopf's helpers in
//! [`hierarchies`].
//!
//! # Indexes and memos
//!
//! An index handler ([`Registry::index`]) is called for every object of its resource; its
//! results form an [`Index`] that every handler of this process reads with
//! [`Context::index`], with kopf's rules: a JSON object result gives keys and values, any other
//! value goes under the `None` key, no result changes nothing, a failure drops the object's
//! entries (except an unclassified error under the default IGNORED errors mode). No other
//! handler of the process runs before every index is built from its initial listing, also
//! after a reconnect. [`Context::memo`] is the object's [`Memo`] (runtime values kept between
//! its calls, dropped when the controller says the object is gone); [`Registry::memo`] is the
//! operator-wide one each object's memo starts from.
//!
//! # What the controller runs
//!
//! The controller answers `Hello` with a status per handler. A handler whose kind the connected
//! controller does not run (rejected with `UNSUPPORTED_HANDLER_KIND`; see the protocol notes in
//! `proto/README.md`, "What the controller runs") makes [`Operator::run`] stop with
//! [`Error::Unsupported`] naming it, so an operator never runs without some of its handlers.
//! Other rejections are logged and the accepted handlers run.
//!
//! # Modules and layering
//!
//! `runner` (the [`Operator`]) → `connection` (one stream) → `dispatch` (one invocation, shared
//! with `testing`) → `subhandling` → `registry`, `context`, `patch`, `filters`, `handler`,
//! `selector`, `hierarchies`, `classify`, `index`, `memo` →
//! `snapshot`, `control`, `outbox`, `convert`, `error`, `pb`. The public types the protocol
//! carries ([`ResourceRef`], [`EventType`], [`Activity`], [`AdmissionRequest`],
//! [`Operation`], [`Diagnostic`], [`Credentials`], [`LogLevel`], [`CancelReason`]) are the
//! SDK's own, one module each with its conversions: the generated `capstan.v1` types
//! (`pb`, from the `capstan-proto` crate) never appear in the SDK's API.
//!
//! # Feature flags
//!
//! - `testing` (default): the [`testing`] module, an in-process fake runtime for unit-testing
//!   handlers without a cluster or a socket.

mod activity;
mod admission;
mod cancel;
mod classify;
mod connection;
mod context;
mod control;
mod convert;
mod credentials;
mod diagnostic;
mod dispatch;
mod error;
mod event_type;
mod filters;
mod handler;
pub mod hierarchies;
mod index;
mod log_level;
mod memo;
mod outbox;
mod patch;
mod pb;
mod registry;
mod resource;
mod runner;
mod selector;
mod signal;
mod snapshot;
pub mod subhandling;
#[cfg(feature = "testing")]
pub mod testing;

pub use activity::Activity;
pub use admission::{AdmissionRequest, Operation};
pub use cancel::CancelReason;
pub use context::{Context, DiffItem, DiffOp, Reason};
pub use credentials::Credentials;
pub use diagnostic::Diagnostic;
pub use error::{Error, HandlerError, Result};
pub use event_type::EventType;
pub use filters::{MetaFilter, Presence, ValueFilter};
pub use handler::{Handler, HandlerOutput, HandlerResult, IntoOutcome};
pub use index::{Index, IndexKey, Store};
pub use log_level::LogLevel;
pub use memo::Memo;
pub use patch::Patch;
pub use registry::{ErrorsMode, HandlerOptions, Registry};
pub use resource::ResourceRef;
pub use runner::{DEFAULT_ENDPOINT, Operator};
pub use selector::Selector;
pub use signal::shutdown_signal;
pub use snapshot::Snapshot;
pub use subhandling::SubhandlerOptions;

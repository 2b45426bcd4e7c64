//! Plain domain types shared by every layer: handler registrations, the work sent to handlers
//! and the outcomes that come back, diagnostics and object references.
//!
//! These types are the language in which the layers talk to each other. `grpc` converts the
//! wire messages into them and never sees the engine; the engine and `k8s` never see protobuf.
//! Keeping them free of I/O keeps the layering honest (see the crate docs).

pub mod diagnostic;
pub mod field_path;
pub mod handler;
pub mod invocation;
pub mod operator_settings;
pub mod posting;
pub mod resource;
pub mod selector;
pub mod trace;

pub use diagnostic::{Diagnostic, Severity};
pub use handler::{
    AdmissionOptions, DaemonOptions, ErrorsMode, Filters, HandlerId, HandlerKind, KindOptions, MetaMatch,
    Registration, TimerOptions, ValueMatch,
};
pub use invocation::{
    Activity, AdmissionVerdict, CancelReason, ChangeReason, Credentials, DiffItem, DiffOperation, EventType,
    KindResult, Outcome, Patch, PatchTarget, PatchType, Payload, SubhandlerOutcome, SubhandlerState, Work,
};
pub use posting::{Level, Policy, Posting};
pub use resource::{ResolvedResource, ResourceRef, ResourceSelector};
pub use selector::{ObjectSelector, SelectorError};
pub use trace::TraceContext;

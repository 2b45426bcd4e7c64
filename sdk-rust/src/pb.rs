//! The generated `capstan.v1` protocol types, for the SDK's internals only.
//!
//! The raw prost messages (from the `capstan-proto` crate, never edited by hand) stay inside
//! the crate: the public API exposes the SDK's own types ([`crate::ResourceRef`],
//! [`crate::Credentials`], …), converted at the edges, so that handler code does not depend on
//! the generated code's shape.

pub(crate) use capstan_proto::pb::*;

//! The generated `capstan.v1` protocol types, for advanced users.
//!
//! The SDK's own types cover what a handler author needs; this module exposes the raw prost
//! messages (from the `capstan-proto` crate, never edited by hand) for the rare cases that need
//! them: posting an Event on an arbitrary [`ResourceRef`], returning login [`Credentials`],
//! inspecting a raw [`Invocation`] or building one for the test kit.

pub use capstan_proto::pb::*;

//! Generated Rust types and gRPC stubs for the `capstan.v1` protocol.
//!
//! The protocol itself is documented in `proto/README.md` and in the comments of the `.proto`
//! files; this crate only compiles them. Both the controller (server side) and the Rust SDK
//! (client side) depend on it, so the two can never disagree about the wire format.

/// The `capstan.v1` package: messages, enums, the `RuntimeService` server and client.
#[allow(missing_docs, clippy::all, clippy::pedantic, rust_2018_idioms)]
#[rustfmt::skip]
pub mod pb {
    tonic::include_proto!("capstan.v1");

    /// The encoded `FileDescriptorSet` of `capstan.v1`, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("capstan_v1_descriptor");
}

/// The protocol's major version, as carried in the package name.
pub const PROTOCOL_VERSION: &str = "capstan.v1";

/// The largest message either side sends or accepts: 16 MiB.
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

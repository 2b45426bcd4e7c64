//! Support code for Capstan's integration and end-to-end tests.
//!
//! `grpc` starts the controller's real gRPC server in-process on a real Unix socket, with a
//! test resolver instead of API discovery, and gives tests a raw protocol client that can send
//! anything (including what a well-behaved SDK never would).

pub mod grpc;

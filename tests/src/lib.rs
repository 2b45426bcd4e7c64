//! Support code for Capstan's integration and end-to-end tests.
//!
//! `testenv` starts a real kube-apiserver per test; `process` runs the real `capstan` binary
//! and handler processes against it. `grpc` starts the controller's real gRPC server in-process on a real Unix socket, with a
//! test resolver instead of API discovery, and gives tests a raw protocol client that can send
//! anything (including what a well-behaved SDK never would).

pub mod conformance;
pub mod faults;
pub mod grpc;
pub mod helm;
pub mod indexes;
pub mod kopf;
pub mod operator;
pub mod process;
pub mod proxy;
pub mod scenario;
pub mod side_by_side;
pub mod testenv;
pub mod webhook_tls;

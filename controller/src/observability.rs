//! Logs, health and the admin HTTP endpoint.
//!
//! Everything an operator's operator looks at: structured logs (human or JSON), and the admin
//! listener with `/healthz` (liveness) and `/readyz` (readiness) that the kubelet probes.

pub mod admin;
pub mod health;
pub mod logging;
pub mod metrics;
pub mod workqueue;

//! Formatting of errors for log lines and messages.
//!
//! Every subsystem reports its failures with their causes, and `error.rs` aggregates the
//! subsystems' errors into the controller's own. The formatting helper lives here, in a module
//! that imports nothing of the crate, so that using it ties no subsystem to the aggregate (and
//! through it to every other subsystem).

/// Formats an error with its chain of causes on one line (`outer: inner: root`).
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn the_causes_follow_the_error_on_one_line() {
        let e = Outer(std::io::Error::other("root"));
        assert_eq!(chain(&e), "outer: root");
    }
}

//! W3C trace context (`traceparent`) for handler invocations.
//!
//! Every processing cycle of an object starts a trace; each invocation in it is a span of that
//! trace, and its `traceparent` travels to the handler process in the invocation's
//! `trace_context` map (`capstan.v1`), so the handler's logs and spans continue the same
//! trace, and the records it logs back are logged with the same trace id. Work started
//! outside a cycle (daemons, timers, activities, event handlers) gets a trace of its own.
//!
//! Ids need to be unique, not secret: they come from the standard library's randomly seeded
//! hasher over a process-wide counter and the clock, which avoids a random-number crate.

use std::{
    hash::{BuildHasher, Hasher},
    sync::atomic::{AtomicU64, Ordering},
    time::SystemTime,
};

/// The trace and span of one invocation (or of a cycle, as the parent of its invocations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace id (never zero).
    pub trace_id: u128,
    /// This span's id (never zero).
    pub span_id: u64,
    /// W3C trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceContext {
    /// A new trace, sampled.
    pub fn root() -> Self {
        let high = u128::from(nonzero());
        let low = u128::from(nonzero());
        Self {
            trace_id: (high << 64) | low,
            span_id: nonzero(),
            flags: 1,
        }
    }

    /// A new span of the same trace.
    #[must_use]
    pub fn child(&self) -> Self {
        Self {
            span_id: nonzero(),
            ..*self
        }
    }

    /// The `traceparent` header value (version 00).
    pub fn traceparent(&self) -> String {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }

    /// The trace id as 32 lowercase hex digits, as logged.
    pub fn trace_id(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// Parses a `traceparent` value; `None` when it is not a valid version-00 one.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some()
            || version != "00"
            || trace.len() != 32
            || span.len() != 16
            || flags.len() != 2
        {
            return None;
        }
        let hex = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if !(hex(trace) && hex(span) && hex(flags)) {
            return None;
        }
        let context = Self {
            trace_id: u128::from_str_radix(trace, 16).ok()?,
            span_id: u64::from_str_radix(span, 16).ok()?,
            flags: u8::from_str_radix(flags, 16).ok()?,
        };
        (context.trace_id != 0 && context.span_id != 0).then_some(context)
    }
}

/// A non-zero pseudo-random id.
fn nonzero() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.finish().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_round_trip_and_children_share_the_trace() {
        let root = TraceContext::root();
        let child = root.child();
        assert_eq!(child.trace_id, root.trace_id);
        assert_ne!(child.span_id, root.span_id);
        let text = child.traceparent();
        assert_eq!(text.len(), 55);
        assert_eq!(TraceContext::parse(&text), Some(child));
        assert_eq!(child.trace_id().len(), 32);
        assert_ne!(TraceContext::root().trace_id, root.trace_id);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
    }
}

//! What a handler is: an async function of a [`Context`] whose output converts into an outcome.
//!
//! Handlers are stored type-erased in the registry as `Arc<dyn Handler>`, so any
//! `Fn(Context) -> impl Future` closure or `async fn` works, and its return type only has to
//! implement [`IntoOutcome`]: `()`, or `Result<T, E>` where `T` converts into a
//! [`HandlerOutput`] (nothing, a JSON value, an admission verdict, credentials) and `E` into a
//! [`HandlerError`]. The dispatch module calls handlers; the registry stores them.

use std::future::Future;

use futures::future::BoxFuture;
use serde_json::Value;

use crate::{Context, Credentials, HandlerError};

/// The canonical result of a handler: `Ok(Some(value))` stores `value` at `status.<handler id>`.
pub type HandlerResult<T = Option<Value>> = Result<T, HandlerError>;

/// What a successful handler returns.
///
/// For change, event, daemon and timer handlers a non-null value is stored at
/// `status.<handler id>`; for index handlers it is the index value, for probe handlers the probe
/// value. Login handlers return [`Credentials`].
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct HandlerOutput {
    /// The returned value, if any.
    pub value: Option<Value>,
    /// Credentials returned by a login handler.
    pub credentials: Option<Credentials>,
    /// Why [`HandlerOutput::serialize`] could not turn the value into JSON: the invocation
    /// fails permanently with a message naming the handler.
    pub invalid: Option<String>,
}

impl HandlerOutput {
    /// Nothing to report.
    pub fn none() -> Self {
        Self::default()
    }

    /// A JSON result value.
    pub fn value(value: impl Into<Value>) -> Self {
        Self {
            value: Some(value.into()),
            ..Self::default()
        }
    }

    /// A result value of any serialisable type (an index value, a status). A value that
    /// cannot be expressed in JSON (e.g. a map whose keys are not strings) fails the invocation
    /// permanently, with an error that names the handler; an index handler's object then
    /// leaves the index.
    pub fn serialize<T: serde::Serialize + ?Sized>(value: &T) -> Self {
        match serde_json::to_value(value) {
            Ok(value) => Self::from(value),
            Err(error) => Self {
                invalid: Some(error.to_string()),
                ..Self::default()
            },
        }
    }
}

impl From<()> for HandlerOutput {
    fn from((): ()) -> Self {
        Self::none()
    }
}

impl From<Value> for HandlerOutput {
    fn from(value: Value) -> Self {
        if value.is_null() {
            Self::none()
        } else {
            Self::value(value)
        }
    }
}

impl From<Option<Value>> for HandlerOutput {
    fn from(value: Option<Value>) -> Self {
        value.map_or_else(Self::none, Self::from)
    }
}

impl From<Credentials> for HandlerOutput {
    fn from(credentials: Credentials) -> Self {
        Self {
            credentials: Some(credentials),
            ..Self::default()
        }
    }
}

/// Anything a handler may return.
pub trait IntoOutcome: Send + 'static {
    /// Converts the handler's return value into its outcome.
    fn into_outcome(self) -> Result<HandlerOutput, HandlerError>;
}

impl IntoOutcome for () {
    fn into_outcome(self) -> Result<HandlerOutput, HandlerError> {
        Ok(HandlerOutput::none())
    }
}

impl<T, E> IntoOutcome for Result<T, E>
where
    T: Into<HandlerOutput> + Send + 'static,
    E: Into<HandlerError> + Send + 'static,
{
    fn into_outcome(self) -> Result<HandlerOutput, HandlerError> {
        self.map(Into::into).map_err(Into::into)
    }
}

/// A handler: called once per invocation with the invocation's [`Context`].
///
/// Implemented for every `Fn(Context) -> impl Future<Output = impl IntoOutcome>` that is
/// `Send + Sync + 'static`, which covers `async fn`s and closures returning `async move` blocks.
pub trait Handler: Send + Sync + 'static {
    /// Runs the handler.
    fn call(&self, ctx: Context) -> BoxFuture<'static, Result<HandlerOutput, HandlerError>>;
}

impl<F, Fut, R> Handler for F
where
    F: Fn(Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoOutcome,
{
    fn call(&self, ctx: Context) -> BoxFuture<'static, Result<HandlerOutput, HandlerError>> {
        let future = self(ctx);
        Box::pin(async move { future.await.into_outcome() })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn return_values_convert() {
        assert_eq!(().into_outcome().unwrap(), HandlerOutput::none());
        let ok: Result<Value, HandlerError> = Ok(json!({"a": 1}));
        assert_eq!(ok.into_outcome().unwrap().value, Some(json!({"a": 1})));
        let null: Result<Value, HandlerError> = Ok(Value::Null);
        assert_eq!(null.into_outcome().unwrap().value, None);
        let io: Result<(), std::io::Error> = Err(std::io::Error::other("disk"));
        match io.into_outcome() {
            Err(HandlerError::Unclassified { error_type, .. }) => assert!(error_type.contains("io")),
            other => panic!("unexpected {other:?}"),
        }
    }
}

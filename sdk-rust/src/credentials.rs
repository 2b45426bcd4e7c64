//! [`Credentials`]: what a login handler returns (kopf's `ConnectionInfo`).
//!
//! The SDK's own type for the wire `Credentials` (named as in the Go and TypeScript SDKs), so a
//! login handler never builds a generated protocol type; [`Credentials::to_pb`] encodes it for
//! the invocation's result.

use std::time::SystemTime;

use crate::{convert, pb};

/// API credentials for the controller, returned by a login handler
/// ([`crate::Registry::on_login`]). Unset fields are empty.
///
/// ```
/// use capstan_sdk::Credentials;
///
/// let credentials = Credentials {
///     server: "https://kubernetes.example:6443".to_owned(),
///     token: "secret".to_owned(),
///     ..Credentials::default()
/// };
/// # let _ = credentials;
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    /// The API server's URL.
    pub server: String,
    /// PEM-encoded CA certificates to trust.
    pub certificate_authority: Vec<u8>,
    /// Skip TLS verification.
    pub insecure: bool,
    /// The user name, for basic auth.
    pub username: String,
    /// The password, for basic auth.
    pub password: String,
    /// A bearer token.
    pub token: String,
    /// A PEM-encoded client certificate.
    pub client_certificate: Vec<u8>,
    /// The PEM-encoded key of the client certificate.
    pub client_key: Vec<u8>,
    /// The namespace used when none is given.
    pub default_namespace: String,
    /// When the credentials expire (`None`: never); the login handler is called again before.
    pub expiration: Option<SystemTime>,
    /// Orders the credentials of several login handlers (higher first).
    pub priority: i32,
}

/// Shows which secrets are set, never what they are (credentials end up in logged outputs).
impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = |set: bool| if set { "<redacted>" } else { "" };
        f.debug_struct("Credentials")
            .field("server", &self.server)
            .field("certificate_authority", &self.certificate_authority.len())
            .field("insecure", &self.insecure)
            .field("username", &self.username)
            .field("password", &secret(!self.password.is_empty()))
            .field("token", &secret(!self.token.is_empty()))
            .field("client_certificate", &self.client_certificate.len())
            .field("client_key", &secret(!self.client_key.is_empty()))
            .field("default_namespace", &self.default_namespace)
            .field("expiration", &self.expiration)
            .field("priority", &self.priority)
            .finish()
    }
}

impl Credentials {
    /// Encodes the credentials for the invocation's result.
    pub(crate) fn to_pb(&self) -> pb::Credentials {
        pb::Credentials {
            server: self.server.clone(),
            certificate_authority: self.certificate_authority.clone(),
            insecure: self.insecure,
            username: self.username.clone(),
            password: self.password.clone(),
            token: self.token.clone(),
            client_certificate: self.client_certificate.clone(),
            client_key: self.client_key.clone(),
            default_namespace: self.default_namespace.clone(),
            expiration_time: self.expiration.map(convert::timestamp_to_pb),
            priority: self.priority,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_hides_the_secrets() {
        let credentials = Credentials {
            username: "robot".to_owned(),
            password: "hunter2".to_owned(),
            token: "t0ken".to_owned(),
            client_key: b"-----BEGIN KEY-----".to_vec(),
            ..Credentials::default()
        };
        let shown = format!("{credentials:?}");
        assert!(shown.contains("robot") && shown.contains("<redacted>"), "{shown}");
        for secret in ["hunter2", "t0ken", "BEGIN KEY"] {
            assert!(!shown.contains(secret), "{secret} shown: {shown}");
        }
    }

    #[test]
    fn encodes_every_field() {
        let credentials = Credentials {
            server: "https://s".into(),
            certificate_authority: b"ca".to_vec(),
            insecure: true,
            username: "u".into(),
            password: "p".into(),
            token: "t".into(),
            client_certificate: b"cert".to_vec(),
            client_key: b"key".to_vec(),
            default_namespace: "ns".into(),
            expiration: Some(SystemTime::UNIX_EPOCH),
            priority: 3,
        };
        let wire = credentials.to_pb();
        assert_eq!(
            (
                wire.server.as_str(),
                wire.token.as_str(),
                wire.default_namespace.as_str()
            ),
            ("https://s", "t", "ns")
        );
        assert_eq!(
            (
                wire.certificate_authority,
                wire.client_key,
                wire.insecure,
                wire.priority
            ),
            (b"ca".to_vec(), b"key".to_vec(), true, 3)
        );
        assert_eq!(wire.expiration_time.map(|t| t.seconds), Some(0));
        assert_eq!(Credentials::default().to_pb(), pb::Credentials::default());
    }
}

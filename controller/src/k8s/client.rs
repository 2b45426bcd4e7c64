//! Builds the API client: from the kubeconfig (`KUBECONFIG`, `~/.kube/config`) or the
//! in-cluster service account, whichever kube-rs finds first.

use kube::Client;

/// Why the API client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No kubeconfig and no in-cluster configuration were usable.
    #[error("no usable Kubernetes configuration (set KUBECONFIG or run in a cluster)")]
    Config(#[source] kube::Error),
}

/// The user agent of every API request, so audit logs show which writes are Capstan's.
pub const USER_AGENT: &str = concat!("capstan/", env!("CARGO_PKG_VERSION"));

/// The longest identity a user agent carries (pod names reach 253 characters).
const IDENTITY_IN_AGENT: usize = 128;

/// The user agent of the controller named `identity`: `capstan/<version> (<identity>)`, so an
/// audit log tells apart the writes of replicas (sharding members, peers, a leader and its
/// successor). The identity is cut at 128 characters; anything but visible ASCII, and the
/// parentheses and the backslash, become `_`; an empty identity gives the plain
/// [`USER_AGENT`].
pub fn user_agent(identity: &str) -> http::HeaderValue {
    let identity: String = identity
        .chars()
        .take(IDENTITY_IN_AGENT)
        .map(|c| {
            if c.is_ascii_graphic() && !matches!(c, '(' | ')' | '\\') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if identity.is_empty() {
        return http::HeaderValue::from_static(USER_AGENT);
    }
    http::HeaderValue::from_str(&format!("{USER_AGENT} ({identity})"))
        .unwrap_or_else(|_| http::HeaderValue::from_static(USER_AGENT))
}

/// Builds a client with Capstan's user agent for terminal commands (`capstan freeze`): they
/// make no watches, so every read is bounded by kube-rs's read timeout (the controller's
/// clients are bounded per request instead, see [`crate::k8s::switch`]).
///
/// # Errors
/// [`Error::Config`] when neither a kubeconfig nor an in-cluster configuration works.
pub async fn connect() -> Result<Client, Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|e| Error::Config(kube::Error::InferConfig(e)))?;
    config.read_timeout = Some(super::switch::DEFAULT_REQUEST_TIMEOUT);
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(USER_AGENT),
    ));
    Client::try_from(config).map_err(Error::Config)
}

/// The user the API server authenticates `client` as (a `SelfSubjectReview`); `None` when it
/// cannot tell.
pub async fn username(client: &kube::Client) -> Option<String> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let api: kube::Api<SelfSubjectReview> = kube::Api::all(client.clone());
    api.create(&kube::api::PostParams::default(), &SelfSubjectReview::default())
        .await
        .ok()
        .and_then(|r| r.status?.user_info?.username)
        .filter(|u| !u.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_agent_names_the_replica_in_header_safe_characters() {
        let plain = http::HeaderValue::from_static(USER_AGENT);
        assert_eq!(user_agent(""), plain);
        assert_eq!(
            user_agent("operator-7d9f-x2"),
            format!("{USER_AGENT} (operator-7d9f-x2)").as_str()
        );
        assert_eq!(
            user_agent("a b(c)\nd\u{e9}"),
            format!("{USER_AGENT} (a_b_c__d_)").as_str()
        );
        let long = user_agent(&"x".repeat(300));
        assert_eq!(long.len(), USER_AGENT.len() + 3 + IDENTITY_IN_AGENT);
    }
}

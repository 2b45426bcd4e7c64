//! Who may call the webhooks: with `--webhook-client-ca`, only peers presenting a client
//! certificate signed by a CA in that file complete the TLS handshake (rustls's
//! `WebPkiClientVerifier`). Without it any peer that reaches the port can send reviews with a
//! forged `userInfo` and `dryRun: false`, so that side-effect handlers act; the API server
//! presents a client certificate when its `--admission-control-config-file` gives it a
//! kubeconfig for the webhook's address.
//!
//! The file is looked at like the serving certificate and reloaded when it changes (a mounted
//! Secret or ConfigMap); a file that cannot be read keeps the previous CA.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use parking_lot::RwLock;
use rustls_pki_types::{CertificateDer, UnixTime, pem::PemObject as _};
use tokio_rustls::rustls::{
    self, DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme,
    client::danger::HandshakeSignatureValid,
    server::{
        WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::certs::MIN_POLL;

/// Why the client CA could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("cannot read the webhook client CA {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file holds no usable CA certificate.
    #[error("the webhook client CA {path}: {what}")]
    Unusable {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
}

/// The client certificate verifier, following the file. Cheap to clone.
#[derive(Clone)]
pub struct ClientCa {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    current: RwLock<Arc<dyn ClientCertVerifier>>,
}

impl fmt::Debug for ClientCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientCa")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl ClientCa {
    /// Reads the CA bundle at `path`.
    ///
    /// # Errors
    /// When the file cannot be read or holds no usable CA certificate.
    pub fn load(path: &Path) -> Result<Self, Error> {
        Ok(Self {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                current: RwLock::new(verifier(path)?),
            }),
        })
    }

    /// Looks at the file every `poll` and reloads it when it changes, until `stop`.
    pub async fn watch(self, poll: Duration, stop: CancellationToken) {
        let path = self.inner.path.clone();
        let stamp = |p: &Path| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        };
        let mut seen: Option<(SystemTime, u64)> = stamp(&path);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(poll.max(MIN_POLL)) => {}
            }
            let now = stamp(&path);
            if now == seen {
                continue;
            }
            match verifier(&path) {
                Ok(v) => {
                    *self.inner.current.write() = v;
                    seen = now;
                    info!(path = %path.display(), "webhook client CA reloaded");
                }
                Err(e) => warn!(error = %e, "webhook client CA not reloaded; the previous one is still used"),
            }
        }
    }

    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        self.inner.current.read().clone()
    }
}

fn verifier(path: &Path) -> Result<Arc<dyn ClientCertVerifier>, Error> {
    let unusable = |what: String| Error::Unusable {
        path: path.to_owned(),
        what,
    };
    let pem = std::fs::read(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| unusable(format!("not PEM certificates: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| unusable(format!("not a CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(unusable("no certificate in the file".into()));
    }
    WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .map_err(|e| unusable(e.to_string()))
}

impl ClientCertVerifier for ClientCa {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    // No hints: the CA may change between handshakes, and a client with one certificate
    // presents it regardless.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current().verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current().supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_a_ca_is_refused_and_a_ca_is_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ca.crt");
        std::fs::write(&path, "not pem").expect("write");
        assert!(ClientCa::load(&path).is_err());
        let generated = super::super::certs::generate_client_pem("caller").expect("generated");
        std::fs::write(&path, &generated.ca).expect("write");
        let ca = ClientCa::load(&path).expect("read");
        assert!(ca.client_auth_mandatory());
    }
}

//! The webhook server's certificates: generated at start (a CA and a serving certificate
//! signed by it) or read from files (a mounted Secret, e.g. issued by cert-manager) and
//! reloaded when the files change, without a restart and without dropping a connection.
//!
//! The TLS acceptor asks [`Certificates`] for the current certificate at every handshake, so a
//! reload takes effect for the next connection. Files are polled (their modification time and
//! size) rather than watched: a mounted Secret is updated through a symlink swap that not every
//! notification mechanism reports, and one `stat` per file every few seconds costs nothing. A
//! reload that fails (a half-written pair, a key that does not match) keeps the certificate
//! that works and says why in the log; the key itself is never logged, and never leaves the
//! process except as the TLS handshake's signatures.
//!
//! The CA bundle that the API server must trust is published beside the certificate: the
//! generated CA, or `ca.crt` from the directory (cert-manager writes it), or else the serving
//! chain itself.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use parking_lot::RwLock;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
use tokio::sync::watch;
use tokio_rustls::rustls::{
    self,
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{client_ca::ClientCa, shared_ca::Ca};

/// The serving certificate file in a certificate directory (the `kubernetes.io/tls` Secret key).
pub const CERT_FILE: &str = "tls.crt";
/// The private key file in a certificate directory.
pub const KEY_FILE: &str = "tls.key";
/// The optional CA bundle file in a certificate directory (cert-manager's `ca.crt`).
pub const CA_FILE: &str = "ca.crt";

/// The shortest interval between two looks at the certificate files.
pub const MIN_POLL: Duration = Duration::from_millis(200);

/// Where the serving certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Generated at start for these DNS names and IP addresses.
    SelfSigned {
        /// The subject alternative names.
        names: Vec<String>,
        /// The CA that signs it (shared by the replicas); `None`: one made for it.
        ca: Option<Ca>,
    },
    /// `tls.crt` and `tls.key` (and optionally `ca.crt`) in a directory, looked at every `poll`.
    Files {
        /// The directory (a mounted Secret).
        dir: PathBuf,
        /// How often the files are looked at.
        poll: Duration,
    },
}

/// Why certificates could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Generating the CA or the serving certificate failed.
    #[error("cannot generate a self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable PEM data.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong (never the key material).
        what: String,
    },
    /// rustls refused the certificate or key.
    #[error("the certificate or key is not usable: {0}")]
    Tls(#[from] rustls::Error),
}

/// The current serving certificate and CA bundle. Cheap to clone.
#[derive(Clone)]
pub struct Certificates {
    inner: Arc<Inner>,
}

struct Inner {
    current: RwLock<Arc<CertifiedKey>>,
    ca_bundle: watch::Sender<Vec<u8>>,
    source: Source,
}

impl fmt::Debug for Certificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Certificates")
            .field("source", &self.inner.source)
            .finish_non_exhaustive()
    }
}

impl Certificates {
    /// Makes or loads the first certificate.
    ///
    /// # Errors
    /// When generation fails or the files are missing or unusable.
    pub fn new(source: Source) -> Result<Self, Error> {
        let (key, bundle) = match &source {
            Source::SelfSigned { names, ca } => generate(names, ca.as_ref())?,
            Source::Files { dir, .. } => load(dir)?,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                current: RwLock::new(Arc::new(key)),
                ca_bundle: watch::channel(bundle).0,
                source,
            }),
        })
    }

    /// The PEM CA bundle the API server must trust, updated on every reload.
    pub fn ca_bundle(&self) -> watch::Receiver<Vec<u8>> {
        self.inner.ca_bundle.subscribe()
    }

    /// The certificate chain served now (DER), for tests and logs.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.inner.current.read().cert.clone()
    }

    /// A TLS server configuration that asks for the current certificate at every handshake,
    /// and with `clients` for a client certificate signed by its current CA.
    ///
    /// # Errors
    /// When the crypto provider does not support the default protocol versions.
    pub fn server_config(&self, clients: Option<&ClientCa>) -> Result<rustls::ServerConfig, Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder =
            rustls::ServerConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?;
        let builder = match clients {
            Some(ca) => builder.with_client_cert_verifier(Arc::new(ca.clone())),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(Arc::new(self.clone()));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }

    /// Looks at the files every poll interval and reloads them when they change, until `stop`.
    /// Returns at once for a generated certificate.
    pub async fn watch_files(self, stop: CancellationToken) {
        let Source::Files { dir, poll } = self.inner.source.clone() else {
            return;
        };
        let poll = poll.max(MIN_POLL);
        let mut seen = stamp(&dir);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(poll) => {}
            }
            let now = stamp(&dir);
            if now == seen {
                continue;
            }
            match load(&dir) {
                Ok((key, bundle)) => {
                    *self.inner.current.write() = Arc::new(key);
                    self.inner.ca_bundle.send_if_modified(|b| {
                        let changed = *b != bundle;
                        *b = bundle;
                        changed
                    });
                    seen = now;
                    info!(dir = %dir.display(), "webhook certificate reloaded");
                }
                // Possibly caught between the writes of the pair: looked at again next time.
                Err(e) => {
                    warn!(dir = %dir.display(), error = %e, "webhook certificate not reloaded; the previous one is still served")
                }
            }
        }
    }
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("certificates")
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.inner.current.read().clone())
    }
}

/// What identifies a version of the files: modification times and sizes.
type Stamp = Vec<Option<(SystemTime, u64)>>;

fn stamp(dir: &Path) -> Stamp {
    [CERT_FILE, KEY_FILE, CA_FILE]
        .iter()
        .map(|f| {
            std::fs::metadata(dir.join(f))
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

/// A generated CA and serving certificate, as PEM text.
pub struct Generated {
    /// The CA certificate.
    pub ca: String,
    /// The serving certificate followed by the CA certificate.
    pub chain: String,
    /// The serving certificate's private key (PKCS#8).
    pub key: String,
}

impl fmt::Debug for Generated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Generated")
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

/// Generates a CA and a serving certificate for `names` signed by it, as PEM files would hold
/// them (for `--webhook-cert-dir` in development and tests).
///
/// # Errors
/// When generation fails.
pub fn generate_pem(names: &[String]) -> Result<Generated, Error> {
    let (ca, cert, key) = issue(names, rcgen::ExtendedKeyUsagePurpose::ServerAuth)?;
    Ok(Generated {
        chain: format!("{}{}", cert.pem(), ca.pem()),
        ca: ca.pem(),
        key: key.serialize_pem(),
    })
}

/// Generates a CA and a client certificate for `name` signed by it, as the files of
/// `--webhook-client-ca` (the CA) and of the API server's kubeconfig for the webhook (the
/// certificate and key) would hold them; for development and tests.
///
/// # Errors
/// When generation fails.
pub fn generate_client_pem(name: &str) -> Result<Generated, Error> {
    let (ca, cert, key) = issue(&[name.to_owned()], rcgen::ExtendedKeyUsagePurpose::ClientAuth)?;
    Ok(Generated {
        chain: format!("{}{}", cert.pem(), ca.pem()),
        ca: ca.pem(),
        key: key.serialize_pem(),
    })
}

/// Generates a CA, as a shared CA is kept (`--webhook-ca-secret`).
///
/// # Errors
/// When generation fails.
pub fn generate_ca() -> Result<Ca, Error> {
    let ca = new_ca()?;
    Ok(Ca {
        cert: ca.pem(),
        key: ca.key().serialize_pem(),
    })
}

/// A serving certificate for `names` signed by `ca`, or by a CA made for it; the CA's PEM is
/// the bundle.
fn generate(names: &[String], ca: Option<&Ca>) -> Result<(CertifiedKey, Vec<u8>), Error> {
    let (ca_pem, cert, key) = match ca {
        Some(ca) => {
            let unusable = |what: &str| Error::Pem {
                path: PathBuf::from("the shared webhook CA"),
                what: what.to_owned(),
            };
            let ca_key = rcgen::KeyPair::from_pem(&ca.key).map_err(|_| unusable("no usable private key"))?;
            // The stored certificate is not parsed: the same subject and key make the same
            // issuer of the certificates it signs.
            let issuer = rcgen::Issuer::new(ca_params()?, ca_key);
            let (cert, key) = leaf(names, rcgen::ExtendedKeyUsagePurpose::ServerAuth, &issuer)?;
            (ca.cert.clone(), cert, key)
        }
        None => {
            let (ca, cert, key) = issue(names, rcgen::ExtendedKeyUsagePurpose::ServerAuth)?;
            (ca.pem(), cert, key)
        }
    };
    let ca_der = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| Error::Pem {
        path: PathBuf::from("the webhook CA"),
        what: format!("not a PEM certificate: {e}"),
    })?;
    let der_key = PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let certified = certified(vec![cert.der().clone(), ca_der], &der_key)?;
    Ok((certified, ca_pem.into_bytes()))
}

type Issued = (
    rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    rcgen::Certificate,
    rcgen::KeyPair,
);

fn issue(names: &[String], usage: rcgen::ExtendedKeyUsagePurpose) -> Result<Issued, Error> {
    let ca = new_ca()?;
    let (cert, key) = leaf(names, usage, &ca)?;
    Ok((ca, cert, key))
}

fn new_ca() -> Result<rcgen::CertifiedIssuer<'static, rcgen::KeyPair>, Error> {
    let ca_key = rcgen::KeyPair::generate()?;
    Ok(rcgen::CertifiedIssuer::self_signed(ca_params()?, ca_key)?)
}

/// What every webhook CA is: its subject and uses.
fn ca_params() -> Result<rcgen::CertificateParams, Error> {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "capstan webhook CA");
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ok(ca_params)
}

fn leaf(
    names: &[String],
    usage: rcgen::ExtendedKeyUsagePurpose,
    issuer: &rcgen::Issuer<'_, rcgen::KeyPair>,
) -> Result<(rcgen::Certificate, rcgen::KeyPair), Error> {
    let mut params = rcgen::CertificateParams::new(names.to_vec())?;
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        names.first().map_or("capstan-webhook", String::as_str),
    );
    params.extended_key_usages = vec![usage];
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::DigitalSignature,
        rcgen::KeyUsagePurpose::KeyEncipherment,
    ];
    let key = rcgen::KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert, key))
}

/// Reads `tls.crt`, `tls.key` and, when present, `ca.crt` from `dir`.
fn load(dir: &Path) -> Result<(CertifiedKey, Vec<u8>), Error> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|source| Error::Read { path, source })
    };
    let cert_pem = read(CERT_FILE)?;
    let key_pem = read(KEY_FILE)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Pem {
            path: dir.join(CERT_FILE),
            what: format!("not PEM certificates: {e}"),
        })?;
    if chain.is_empty() {
        return Err(Error::Pem {
            path: dir.join(CERT_FILE),
            what: "no certificate in the file".into(),
        });
    }
    // The error of a key parser may quote what it read: only say that it failed.
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| Error::Pem {
        path: dir.join(KEY_FILE),
        what: "no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file".into(),
    })?;
    let certified = certified(chain, &key)?;
    let bundle = match std::fs::read(dir.join(CA_FILE)) {
        Ok(ca) if !ca.is_empty() => ca,
        _ => cert_pem,
    };
    Ok((certified, bundle))
}

fn certified(chain: Vec<CertificateDer<'static>>, key: &PrivateKeyDer<'_>) -> Result<CertifiedKey, Error> {
    let provider = rustls::crypto::ring::default_provider();
    let certified = CertifiedKey::from_der(chain, key.clone_key(), &provider)?;
    Ok(certified)
}

/// The names a generated certificate is made for: the Service's DNS names (when the webhook
/// is reached through a Service), `localhost`, `127.0.0.1`, `::1` and any `extra`.
pub fn names(service: Option<(&str, &str)>, extra: &[String]) -> Vec<String> {
    let mut names = Vec::new();
    if let Some((namespace, name)) = service {
        names.push(format!("{name}.{namespace}.svc"));
        names.push(format!("{name}.{namespace}.svc.cluster.local"));
        names.push(format!("{name}.{namespace}"));
        names.push(name.to_owned());
    }
    for n in extra
        .iter()
        .chain(&["localhost".to_owned(), "127.0.0.1".to_owned(), "::1".to_owned()])
    {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_certificates_name_the_service_and_loopback() {
        let names = names(Some(("ops", "capstan-webhook")), &["example.test".into()]);
        assert_eq!(names[0], "capstan-webhook.ops.svc");
        assert!(names.contains(&"127.0.0.1".to_owned()));
        assert!(names.contains(&"example.test".to_owned()));
        let certs = Certificates::new(Source::SelfSigned { names, ca: None }).expect("generated");
        assert_eq!(certs.chain().len(), 2);
        let bundle = certs.ca_bundle().borrow().clone();
        assert!(String::from_utf8_lossy(&bundle).starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(certs.server_config(None).is_ok());
    }

    #[test]
    fn replicas_with_a_shared_ca_serve_certificates_it_signed() {
        use rustls::client::danger::ServerCertVerifier as _;
        let ca = generate_ca().expect("a CA");
        let names = names(Some(("ops", "capstan-webhook")), &[]);
        let a = Certificates::new(Source::SelfSigned {
            names: names.clone(),
            ca: Some(ca.clone()),
        })
        .expect("first replica");
        let b = Certificates::new(Source::SelfSigned {
            names,
            ca: Some(ca.clone()),
        })
        .expect("second replica");
        assert_ne!(a.chain()[0], b.chain()[0], "each replica has its own key");
        assert_eq!(a.chain()[1], b.chain()[1], "one CA");
        assert_eq!(a.ca_bundle().borrow().as_slice(), ca.cert.as_bytes());
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert.as_bytes()).expect("pem"))
            .expect("root");
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .expect("verifier");
        for certs in [&a, &b] {
            let chain = certs.chain();
            verifier
                .verify_server_cert(
                    &chain[0],
                    &chain[1..],
                    &rustls_pki_types::ServerName::try_from("capstan-webhook.ops.svc").expect("name"),
                    &[],
                    rustls_pki_types::UnixTime::now(),
                )
                .expect("trusted through the shared CA");
        }
    }

    #[test]
    fn files_are_loaded_and_bad_ones_are_refused_without_quoting_the_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        std::fs::write(dir.path().join(CERT_FILE), cert.pem()).expect("write");
        std::fs::write(
            dir.path().join(KEY_FILE),
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        let err = Certificates::new(Source::Files {
            dir: dir.path().into(),
            poll: MIN_POLL,
        })
        .expect_err("a bad key is refused");
        assert!(!err.to_string().contains("c2VjcmV0"), "{err}");
        std::fs::write(dir.path().join(KEY_FILE), key.serialize_pem()).expect("write");
        let certs = Certificates::new(Source::Files {
            dir: dir.path().into(),
            poll: MIN_POLL,
        })
        .expect("loaded");
        assert_eq!(certs.chain().len(), 1);
        assert_eq!(certs.ca_bundle().borrow().as_slice(), cert.pem().as_bytes());
    }

    #[tokio::test]
    async fn replaced_files_are_served_without_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |cn: &str| {
            let key = rcgen::KeyPair::generate().expect("key");
            let cert = rcgen::CertificateParams::new(vec![cn.to_owned()])
                .expect("params")
                .self_signed(&key)
                .expect("cert");
            std::fs::write(dir.path().join(CERT_FILE), cert.pem()).expect("write");
            std::fs::write(dir.path().join(KEY_FILE), key.serialize_pem()).expect("write");
            cert.der().clone()
        };
        let first = write("one.test");
        let certs = Certificates::new(Source::Files {
            dir: dir.path().into(),
            poll: MIN_POLL,
        })
        .expect("loaded");
        assert_eq!(certs.chain()[0], first);
        let stop = CancellationToken::new();
        let task = tokio::spawn(certs.clone().watch_files(stop.clone()));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let second = write("a-longer-name.test");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while certs.chain()[0] != second {
            assert!(tokio::time::Instant::now() < deadline, "not reloaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.cancel();
        let _ = task.await;
    }
}

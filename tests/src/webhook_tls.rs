//! TLS clients of the controller's webhook server: trusting a CA bundle, and presenting a
//! client certificate when one is given.

use std::sync::Arc;

use anyhow::Result;
use capstan::webhooks::certs::Generated;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
use tokio_rustls::{TlsConnector, rustls};

/// A TLS connector trusting the PEM bundle `ca_pem` and presenting `client` (its chain and
/// key) when given.
///
/// # Errors
/// When the PEM data is not usable.
pub fn connector(ca_pem: &[u8], client: Option<&Generated>) -> Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(cert?)?;
    }
    let builder =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
    let config = match client {
        Some(c) => {
            let chain = CertificateDer::pem_slice_iter(c.chain.as_bytes()).collect::<Result<Vec<_>, _>>()?;
            let key = PrivateKeyDer::from_pem_slice(c.key.as_bytes())?;
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(TlsConnector::from(Arc::new(config)))
}

//! TLS material: certificates and keys read from PEM files, and the rustls configurations built
//! from them (ring as the crypto provider: no OpenSSL). Read when the config is validated, so
//! that `check-config` catches an unreadable file or a key that does not match its certificate;
//! a running gateway reads them again for a reload, or when they change on disk, and puts the
//! listener's in force through [`LiveCert`].

use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use x509_cert::der::Decode;

use crate::metrics::{registered, Families};

/// The protocols a listener offers by ALPN, in order of preference.
pub(crate) const SERVER_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file (at least one).
pub(crate) fn certs(path: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{path}: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{path}: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{path}: no PEM certificate in it"));
    }
    Ok(certs)
}

/// The private key of a PEM file. Its errors name the file, never show the key.
pub(crate) fn key(path: &str) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => format!("{path}: no PEM private key in it"),
        rustls::pki_types::pem::Error::Io(e) => format!("{path}: {e}"),
        _ => format!("{path}: not a readable PEM private key"),
    })
}

/// Why a certificate and a key cannot go together.
fn pairing(e: rustls::Error) -> String {
    match e {
        rustls::Error::InconsistentKeys(_) => "the key does not match the certificate".into(),
        other => format!("the certificate and key are not usable together: {other}"),
    }
}

/// The configuration of a TLS client: the roots of `ca_file` (the system's when `None`), a
/// client certificate when `client` gives one (`(cert_file, key_file)`), and `alpn`. Errors say
/// which of the three is at fault: `("ca_file" | "client_cert_file" | "client_key_file", why)`.
pub(crate) fn client_config(
    ca_file: Option<&str>,
    client: Option<(&str, &str)>,
    alpn: &[&[u8]],
) -> Result<ClientConfig, (&'static str, String)> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in certs(path).map_err(|e| ("ca_file", e))? {
                roots
                    .add(cert)
                    .map_err(|e| ("ca_file", format!("{path}: {e}")))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err((
                    "ca_file",
                    "no CA certificate found on the system (install ca-certificates, or set ca_file)"
                        .into(),
                ));
            }
        }
    }
    let mut config = match client {
        Some(client) => presenting(roots, client)?,
        None => client_builder(roots).with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// Check that `cert_file` (a chain, PEM) and `key_file` (its key) are readable and go together,
/// for a client that presents them through another TLS stack than this module's (Redis's).
/// Errors say which file is at fault, as [`client_config`]'s do.
pub(crate) fn check_client_pair(
    cert_file: &str,
    key_file: &str,
) -> Result<(), (&'static str, String)> {
    presenting(RootCertStore::empty(), (cert_file, key_file)).map(drop)
}

/// `builder` speaking TLS 1.2 and 1.3 (rustls's safe defaults).
#[expect(
    clippy::expect_used,
    reason = "the ring provider supports both of rustls's default protocol versions"
)]
fn versions<S: rustls::ConfigSide>(
    builder: rustls::ConfigBuilder<S, rustls::WantsVersions>,
) -> rustls::ConfigBuilder<S, rustls::WantsVerifier> {
    builder
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
}

/// A client trusting `roots`, before its client certificate is decided.
fn client_builder(
    roots: RootCertStore,
) -> rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert> {
    versions(ClientConfig::builder_with_provider(provider())).with_root_certificates(roots)
}

/// A client trusting `roots` and presenting `(cert_file, key_file)`: `("client_cert_file" |
/// "client_key_file", why)` when a file cannot be read or the two do not go together.
fn presenting(
    roots: RootCertStore,
    (cert_file, key_file): (&str, &str),
) -> Result<ClientConfig, (&'static str, String)> {
    let chain = certs(cert_file).map_err(|e| ("client_cert_file", e))?;
    let key = key(key_file).map_err(|e| ("client_key_file", e))?;
    client_builder(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| ("client_key_file", pairing(e)))
}

/// The listener's certificate chain (`cert_file`) and key (`key_file`), checked to go together.
/// Errors say which file is at fault: `("cert_file" | "key_file", why)`.
pub(crate) fn certified_key(
    cert_file: &str,
    key_file: &str,
) -> Result<Arc<CertifiedKey>, (&'static str, String)> {
    let chain = certs(cert_file).map_err(|e| ("cert_file", e))?;
    let key = key(key_file).map_err(|e| ("key_file", e))?;
    CertifiedKey::from_der(chain, key, &provider())
        .map(Arc::new)
        .map_err(|e| ("key_file", pairing(e)))
}

/// The certificate and key a listener presents: the pair in force, which a reload replaces;
/// a handshake takes the pair in force when it starts.
#[derive(Debug)]
pub(crate) struct LiveCert(ArcSwap<CertifiedKey>);

impl LiveCert {
    pub(crate) fn new(certified: Arc<CertifiedKey>) -> Arc<Self> {
        Arc::new(LiveCert(ArcSwap::new(certified)))
    }

    /// Present `certified` from the next handshake on.
    pub(crate) fn replace(&self, certified: Arc<CertifiedKey>) {
        self.0.store(certified);
    }
}

impl ResolvesServerCert for LiveCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

/// The configuration of a TLS listener presenting what `cert` holds, offering HTTP/2 and
/// HTTP/1.1 by ALPN.
pub(crate) fn server_config(cert: Arc<LiveCert>) -> ServerConfig {
    let mut config = versions(ServerConfig::builder_with_provider(provider()))
        .with_no_client_auth()
        .with_cert_resolver(cert);
    config.alpn_protocols = SERVER_ALPN.iter().map(|p| p.to_vec()).collect();
    config
}

/// The not-after of the first certificate of a PEM file (the one presented), in seconds since
/// the Unix epoch; `None` when the file or its certificate cannot be read.
pub(crate) fn not_after(path: &str) -> Option<u64> {
    let first = certs(path).ok()?.into_iter().next()?;
    let cert = x509_cert::Certificate::from_der(first.as_ref()).ok()?;
    Some(
        cert.tbs_certificate
            .validity
            .not_after
            .to_unix_duration()
            .as_secs(),
    )
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct NameLabels {
    name: String,
}

/// `idemgate_tls_certificate_expiry_timestamp_seconds{name}`: when each certificate the gateway
/// presents stops being valid.
#[derive(Debug)]
pub(crate) struct CertificateMetrics {
    expiry: Family<NameLabels, Gauge>,
}

impl Families for CertificateMetrics {
    fn register(registry: &mut Registry) -> Self {
        CertificateMetrics {
            expiry: registered(
                registry,
                "idemgate_tls_certificate_expiry_timestamp_seconds",
                "The not-after of each certificate the gateway presents, in seconds since the Unix epoch (name: listener, upstream:NAME, store, collector)",
                Family::default(),
            ),
        }
    }
}

impl CertificateMetrics {
    /// Show the not-after of the certificate in `path` as `name`'s.
    pub(crate) fn record(&self, name: &str, path: &str) {
        if let Some(secs) = not_after(path) {
            let labels = NameLabels {
                name: name.to_string(),
            };
            self.expiry
                .get_or_create(&labels)
                .set(i64::try_from(secs).unwrap_or(i64::MAX));
        }
    }
}

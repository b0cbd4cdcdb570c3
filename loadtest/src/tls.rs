//! TLS for the https scenarios: a private CA made with rcgen, a certificate for the upstream
//! (named `upstream.test`), and a client certificate, written as PEM files that nginx and the
//! gateway read alike. The upstream requires the client certificate (mutual TLS), so that a
//! handshake per request would show in the connection counts.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};

/// The name in the upstream's certificate.
pub const UPSTREAM_NAME: &str = "upstream.test";

/// The PEM files of one run.
pub struct Files {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Files {
    /// Where [`write()`] puts them in `dir`.
    pub fn in_dir(dir: &Path) -> Self {
        Files {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        }
    }
}

/// Make the CA and both certificates, and write them to `dir`.
pub fn write(dir: &Path) -> Files {
    std::fs::create_dir_all(dir).unwrap();
    let files = Files::in_dir(dir);
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name
        .push(DnType::CommonName, "idemgate loadtest CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    std::fs::write(&files.ca, ca_cert.pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    for (name, purpose, cert, key) in [
        (
            UPSTREAM_NAME,
            ExtendedKeyUsagePurpose::ServerAuth,
            &files.server_cert,
            &files.server_key,
        ),
        (
            "gateway.test",
            ExtendedKeyUsagePurpose::ClientAuth,
            &files.client_cert,
            &files.client_key,
        ),
    ] {
        let k = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
        params.extended_key_usages = vec![purpose];
        let c = params.signed_by(&k, &issuer).unwrap();
        std::fs::write(cert, c.pem()).unwrap();
        std::fs::write(key, k.serialize_pem()).unwrap();
    }
    files
}

/// The upstream's server configuration: its certificate, and a client certificate from the CA
/// required (HTTP/1.1 by ALPN).
pub fn server_config(files: &Files) -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&files.ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()
            .unwrap();
    let chain = CertificateDer::pem_file_iter(&files.server_cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&files.server_key).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

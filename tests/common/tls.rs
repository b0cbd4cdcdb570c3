//! TLS for tests: a private CA made with rcgen, the certificates it issues (for a server, for a
//! client, expired, for another name), written to PEM files a gateway config can name.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::ConnectInfo;
use tokio::net::TcpListener;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A private certificate authority and the files it writes.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate (PEM): what a gateway's `ca_file` names to trust it.
    pub ca_file: PathBuf,
    ca_der: CertificateDer<'static>,
    dir: tempfile::TempDir,
}

/// A certificate and its key, as PEM files and as rustls values.
#[derive(Clone)]
pub struct Issued {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub chain: Vec<CertificateDer<'static>>,
    key_der: Vec<u8>,
}

impl Issued {
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }

    pub fn cert(&self) -> &str {
        self.cert_file.to_str().unwrap()
    }

    pub fn key_path(&self) -> &str {
        self.key_file.to_str().unwrap()
    }
}

/// What kind of certificate to issue.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    Now,
    Expired,
    /// Valid now, until January 1st of the year.
    Until(i32),
}

impl TestCa {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "idemgate test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, cert.pem()).unwrap();
        TestCa {
            issuer: Issuer::new(params, key),
            ca_file,
            ca_der: cert.der().clone(),
            dir,
        }
    }

    pub fn ca(&self) -> &str {
        self.ca_file.to_str().unwrap()
    }

    /// The CA certificate, for a rustls root store.
    pub fn root(&self) -> CertificateDer<'static> {
        self.ca_der.clone()
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn server(&self, file: &str, names: &[&str], validity: Validity) -> Issued {
        self.issue(file, names, validity, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate, for mutual TLS.
    pub fn client(&self, file: &str) -> Issued {
        self.issue(
            file,
            &["gateway.test"],
            Validity::Now,
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// A client certificate valid until January 1st of `year` (an expiry a metric can tell
    /// from another one's).
    pub fn client_until(&self, file: &str, year: i32) -> Issued {
        self.issue(
            file,
            &["gateway.test"],
            Validity::Until(year),
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    fn issue(
        &self,
        file: &str,
        names: &[&str],
        validity: Validity,
        purpose: ExtendedKeyUsagePurpose,
    ) -> Issued {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.extended_key_usages = vec![purpose];
        match validity {
            Validity::Now => {}
            Validity::Expired => {
                params.not_before = rcgen::date_time_ymd(2020, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            Validity::Until(year) => params.not_after = rcgen::date_time_ymd(year, 1, 1),
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let cert_file = self.dir.path().join(format!("{file}.pem"));
        let key_file = self.dir.path().join(format!("{file}.key"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        Issued {
            cert_file,
            key_file,
            chain: vec![cert.der().clone()],
            key_der: key.serialize_der(),
        }
    }

    /// A rustls server configuration presenting `cert`, offering HTTP/2 and HTTP/1.1 by ALPN,
    /// and requiring a client certificate issued by this CA when `require_client` says so.
    pub fn server_config(&self, cert: &Issued, require_client: bool) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = if require_client {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(self.root()).unwrap();
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .unwrap();
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut config = builder
            .with_single_cert(cert.chain.clone(), cert.key())
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }

    /// A reqwest client that trusts this CA (HTTP/2 by ALPN where the server offers it).
    pub fn client_trusting(&self) -> reqwest::Client {
        let pem = std::fs::read(&self.ca_file).unwrap();
        reqwest::Client::builder()
            .no_proxy()
            .use_rustls_tls()
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
            .build()
            .unwrap()
    }
}

/// The certificate a TLS client presented on the connection a request came on (none: it
/// presented none), as [`serve_tls`] puts it in the request's extensions.
#[derive(Clone)]
pub struct PeerCertificate(pub Option<CertificateDer<'static>>);

/// Serve `app` on `listener` over TLS with `config` (HTTP/2 or HTTP/1.1, as ALPN agrees), each
/// request carrying its peer's address (`ConnectInfo`) and certificate ([`PeerCertificate`]). A client whose handshake fails (an
/// untrusted certificate, a missing client certificate) gets no request through.
pub fn serve_tls(listener: TcpListener, config: Arc<rustls::ServerConfig>, app: axum::Router) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        while let Ok((stream, peer)) = listener.accept().await {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let presented = stream.get_ref().1.peer_certificates();
                let presented = PeerCertificate(presented.and_then(|c| c.first()).cloned());
                let app = tower::ServiceBuilder::new()
                    .map_request(move |mut req: http::Request<hyper::body::Incoming>| {
                        req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
                        req.extensions_mut().insert(presented.clone());
                        req
                    })
                    .service(app);
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(
                    hyper_util::rt::TokioIo::new(stream),
                    hyper_util::service::TowerToHyperService::new(app),
                )
                .await;
            });
        }
    });
}

//! One upstream's settings, as the configuration reads them and the proxy uses them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use rustls::pki_types::ServerName;

/// How long opening a connection to an upstream may take, when not given.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The most connections a worker opens to one upstream, when not given.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// One upstream, validated, its TLS material read.
#[derive(Clone)]
pub struct UpstreamConfig {
    /// Its name (`default` for the top-level `upstream`), as logs and metrics give it.
    pub name: String,
    /// `http://` or `https://`, with authority, and an optional path prefix.
    pub url: Uri,
    /// Speak HTTP/2 to it: by ALPN over TLS, with prior knowledge over plain TCP.
    pub http2: bool,
    /// A PEM file of the CA(s) to trust instead of the system's (https only).
    pub ca_file: Option<String>,
    /// The certificate presented for mutual TLS (https only).
    pub client_cert_file: Option<String>,
    /// Its key (the path only: the key itself is never printed).
    pub client_key_file: Option<String>,
    /// The name sent as SNI and checked in the upstream's certificate, if not the URL's host.
    pub server_name: Option<String>,
    /// How long opening a connection (TCP and TLS) may take.
    pub connect_timeout: Duration,
    /// The most connections one worker opens to it; more requests wait for one.
    pub max_connections: usize,
    /// For https: the client configuration built from the fields above, and the name the
    /// upstream's certificate must carry (`server_name`, else the URL's host).
    pub(crate) tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
}

impl fmt::Debug for UpstreamConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("url", &self.url.to_string())
            .field("http2", &self.http2)
            .field("ca_file", &self.ca_file)
            .field("client_cert_file", &self.client_cert_file)
            .field("client_key_file", &self.client_key_file)
            .field("server_name", &self.server_name)
            .field(
                "connect_timeout",
                &format_args!("{}", humantime::format_duration(self.connect_timeout)),
            )
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl UpstreamConfig {
    /// Whether the connection to it is TLS.
    pub fn is_https(&self) -> bool {
        self.tls.is_some()
    }
}

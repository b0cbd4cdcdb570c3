//! Opening a connection to an upstream: TCP, then TLS for `https://` (with ALPN), each bounded
//! by the upstream's `connect_timeout`; and reading a failure as "not sent" or not.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::Authority;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// A connection to an upstream, plain or TLS.
pub(crate) enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// How to reach one upstream.
pub(crate) struct Connector {
    // Host (an IPv6 literal without its URL brackets) and port.
    host: String,
    port: u16,
    // For https: the client configuration and the name the certificate must carry.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    timeout: Duration,
    // Whether the connection must speak HTTP/2 (ALPN must agree over TLS).
    http2: bool,
}

/// Why a connection could not be opened: nothing was sent either way.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    /// TCP: refused, unreachable, or slower than `connect_timeout`.
    #[error("cannot connect: {0}")]
    Tcp(io::Error),
    /// The TLS handshake failed: the certificate was refused (unknown CA, wrong name, expired),
    /// ours was, or the protocols did not agree.
    #[error("TLS handshake failed: {0}")]
    Tls(io::Error),
}

/// The host of `authority` as a connection names it: an IPv6 literal without its brackets.
fn host(authority: &Authority) -> &str {
    authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
}

/// The name an https upstream's certificate must carry: `server_name` when given, else the
/// host of `authority`; `None` when that is neither a DNS name nor an IP address.
pub(crate) fn tls_name(
    authority: &Authority,
    server_name: Option<&str>,
) -> Option<ServerName<'static>> {
    let name = server_name.unwrap_or(host(authority)).to_string();
    ServerName::try_from(name).ok()
}

impl Connector {
    pub(crate) fn new(
        authority: &Authority,
        tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
        timeout: Duration,
        http2: bool,
    ) -> Self {
        let https = tls.is_some();
        Connector {
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            host: host(authority).to_string(),
            tls: tls.map(|(config, name)| (TlsConnector::from(config), name)),
            timeout,
            http2,
        }
    }

    /// Open a connection: TCP, then TLS when the upstream is https, within the timeout.
    pub(crate) async fn connect(&self) -> Result<Stream, ConnectError> {
        let started = tokio::time::Instant::now();
        let tcp = match tokio::time::timeout(
            self.timeout,
            TcpStream::connect((self.host.as_str(), self.port)),
        )
        .await
        {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(ConnectError::Tcp(e)),
            Err(_) => return Err(ConnectError::Tcp(timed_out())),
        };
        let _ = tcp.set_nodelay(true);
        let Some((connector, name)) = &self.tls else {
            return Ok(Stream::Plain(tcp));
        };
        let left = self.timeout.saturating_sub(started.elapsed());
        let tls = match tokio::time::timeout(left, connector.connect(name.clone(), tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => return Err(ConnectError::Tls(e)),
            Err(_) => return Err(ConnectError::Tls(timed_out())),
        };
        if self.http2 && tls.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Err(ConnectError::Tls(io::Error::other(
                "the upstream did not agree to HTTP/2 (ALPN h2)",
            )));
        }
        Ok(Stream::Tls(Box::new(tls)))
    }
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "connect_timeout passed")
}

/// Whether `e` was caused by a TLS alert of the handshake: with TLS 1.3 a server refuses our
/// certificate (or its absence) with an alert that can arrive after the request was written,
/// but before it read any of it as a request. On a connection opened for this request, that
/// means the request was not processed.
pub(crate) fn is_handshake_alert(e: &(dyn std::error::Error + 'static)) -> bool {
    use rustls::AlertDescription as A;
    let mut cause = Some(e);
    while let Some(e) = cause {
        if let Some(rustls::Error::AlertReceived(alert)) = e.downcast_ref::<rustls::Error>() {
            return matches!(
                alert,
                A::CertificateRequired
                    | A::BadCertificate
                    | A::UnsupportedCertificate
                    | A::CertificateRevoked
                    | A::CertificateExpired
                    | A::CertificateUnknown
                    | A::UnknownCA
                    | A::AccessDenied
                    | A::HandshakeFailure
                    | A::DecryptError
                    | A::ProtocolVersion
                    | A::InsufficientSecurity
            );
        }
        // io::Error hides its inner error from source(): look inside it too.
        if let Some(io) = e.downcast_ref::<io::Error>() {
            if let Some(inner) = io.get_ref() {
                cause = Some(inner as &(dyn std::error::Error + 'static));
                continue;
            }
        }
        cause = e.source();
    }
    false
}

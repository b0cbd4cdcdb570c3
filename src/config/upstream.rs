//! Where requests go: the `[upstreams.NAME]` tables (the top-level `upstream` is shorthand for
//! `[upstreams.default] url`), and the listener's own `[tls]`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use http::Uri;
use serde::Deserialize;

use super::checked::{rules, AtLeastOne, Checked, NonZero};
use super::{invalid, paired, ConfigError};

pub use crate::idempotency::DEFAULT_UPSTREAM;
pub use crate::proxy::{UpstreamConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS};

/// An `[upstreams.NAME]` table as written.
#[derive(Debug, Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    url: Option<String>,
    http2: Option<bool>,
    ca_file: Option<String>,
    client_cert_file: Option<String>,
    client_key_file: Option<String>,
    server_name: Option<Checked<ServerName>>,
    connect_timeout: Option<Checked<NonZero>>,
    max_connections: Option<Checked<AtLeastOne>>,
}

rules! {
    /// The name sent as SNI: a DNS name or an IP address.
    ServerName: String => String = |sni: String| {
        match rustls::pki_types::ServerName::try_from(sni.as_str()) {
            Ok(_) => Ok(sni),
            Err(_) => Err(format!("{sni:?} is not a DNS name or IP address")),
        }
    };
}

/// The `[tls]` table as written.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    cert_file: Option<String>,
    key_file: Option<String>,
    reload_interval: Option<super::HumanDuration>,
}

/// How often the certificate files in force (the listener's, the upstreams') are looked at for
/// a change, when not given (and without `[tls]`).
pub const DEFAULT_TLS_RELOAD_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// The listener's TLS, validated and read.
#[derive(Clone)]
pub struct ListenerTls {
    /// The certificate chain's PEM file.
    pub cert_file: String,
    /// The private key's PEM file (the path only).
    pub key_file: String,
    /// How often the two files, and the upstreams' TLS files, are looked at for a change (zero:
    /// only a reload reads them).
    pub reload_interval: std::time::Duration,
    // The pair read from them, checked to go together.
    pub(crate) certified: Arc<rustls::sign::CertifiedKey>,
}

impl fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenerTls")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("reload_interval", &self.reload_interval)
            .finish()
    }
}

/// Validate the upstream tables, with the top-level `upstream` as the default's URL.
pub(super) fn upstreams(
    shorthand: Option<String>,
    raw: BTreeMap<String, RawUpstream>,
) -> Result<BTreeMap<String, Arc<UpstreamConfig>>, ConfigError> {
    let mut raw = raw;
    if let Some(url) = shorthand {
        let default = raw.entry(DEFAULT_UPSTREAM.to_string()).or_default();
        match &default.url {
            Some(other) if *other != url => {
                return Err(invalid(
                    "upstreams.default.url",
                    "differs from the top-level `upstream`, which is its shorthand: give one",
                ))
            }
            _ => default.url = Some(url),
        }
    }
    raw.into_iter()
        .map(|(name, r)| {
            let at = if name == DEFAULT_UPSTREAM && r.url.is_some() {
                // Errors about the default's URL name the field users most often write.
                "upstreams.default".to_string()
            } else {
                format!("upstreams.{name}")
            };
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(invalid(
                    at,
                    "an upstream's name is letters, digits, '-' and '_'",
                ));
            }
            upstream(name, r, &at).map(|(name, u)| (name, Arc::new(u)))
        })
        .collect()
}

fn upstream(
    name: String,
    r: RawUpstream,
    at: &str,
) -> Result<(String, UpstreamConfig), ConfigError> {
    let field = |f: &str| {
        if name == DEFAULT_UPSTREAM && f == "url" {
            "upstream".to_string()
        } else {
            format!("{at}.{f}")
        }
    };
    let url = r.url.ok_or_else(|| invalid(field("url"), "is required"))?;
    let url = parse_url(&url).map_err(|reason| invalid(field("url"), reason))?;
    let https = url.scheme_str() == Some("https");
    if !https && r.server_name.is_some() {
        return Err(invalid(
            format!("{at}.server_name"),
            "needs an https:// url",
        ));
    }
    let http2 = r.http2.unwrap_or(false);
    let files = TlsFiles {
        ca_file: r.ca_file.as_deref(),
        client_cert_file: r.client_cert_file.as_deref(),
        client_key_file: r.client_key_file.as_deref(),
    };
    let server_name = r.server_name.map(Checked::into_inner);
    let tls = match client_tls(at, https, files, alpn(http2))? {
        Some(config) => Some((
            config,
            tls_name(&url, server_name.as_deref(), &field("url"))?,
        )),
        None => None,
    };
    let connect_timeout = r
        .connect_timeout
        .map_or(DEFAULT_CONNECT_TIMEOUT, Checked::into_inner);
    let max_connections = r
        .max_connections
        .map_or(DEFAULT_MAX_CONNECTIONS, Checked::into_inner);
    Ok((
        name.clone(),
        UpstreamConfig {
            name,
            url,
            http2,
            ca_file: r.ca_file,
            client_cert_file: r.client_cert_file,
            client_key_file: r.client_key_file,
            server_name,
            connect_timeout,
            max_connections,
            tls,
        },
    ))
}

/// What a client of an upstream offers by ALPN: `h2` alone when it must speak HTTP/2.
fn alpn(http2: bool) -> &'static [&'static [u8]] {
    if http2 {
        &[b"h2"]
    } else {
        &[b"http/1.1"]
    }
}

/// `upstream` with its TLS files (`ca_file`, `client_cert_file`, `client_key_file`) read
/// again, for when they changed on disk; refused as loading the config refuses them, the error
/// naming the field (`upstreams.NAME.client_key_file`).
pub(crate) fn tls_read_again(upstream: &UpstreamConfig) -> Result<UpstreamConfig, ConfigError> {
    let files = TlsFiles {
        ca_file: upstream.ca_file.as_deref(),
        client_cert_file: upstream.client_cert_file.as_deref(),
        client_key_file: upstream.client_key_file.as_deref(),
    };
    let at = format!("upstreams.{}", upstream.name);
    let config = client_tls(&at, upstream.is_https(), files, alpn(upstream.http2))?;
    let tls = config.zip(upstream.tls.as_ref().map(|(_, name)| name.clone()));
    Ok(UpstreamConfig {
        tls,
        ..upstream.clone()
    })
}

/// The name an https upstream's certificate must carry (`server_name`, else the host of `url`),
/// or an error at `url_field` when the host cannot be one.
fn tls_name(
    url: &Uri,
    server_name: Option<&str>,
    url_field: &str,
) -> Result<rustls::pki_types::ServerName<'static>, ConfigError> {
    url.authority()
        .and_then(|authority| crate::proxy::tls_name(authority, server_name))
        .ok_or_else(|| {
            invalid(
                url_field,
                "its host is neither a DNS name nor an IP address, which a certificate names: give server_name",
            )
        })
}

/// The TLS files of a client, as written: the CAs it trusts (the system's when `None`), and the
/// certificate and key it presents.
pub(super) struct TlsFiles<'a> {
    pub(super) ca_file: Option<&'a str>,
    pub(super) client_cert_file: Option<&'a str>,
    pub(super) client_key_file: Option<&'a str>,
}

/// The TLS configuration of a client whose URL is `https` (`None` over plain HTTP), from the
/// `files` of its table `at`, offering `alpn`. The files need an https:// URL, and a client
/// certificate needs its key (and the other way round); errors name the field.
pub(super) fn client_tls(
    at: &str,
    https: bool,
    files: TlsFiles<'_>,
    alpn: &[&[u8]],
) -> Result<Option<Arc<rustls::ClientConfig>>, ConfigError> {
    let TlsFiles {
        ca_file,
        client_cert_file,
        client_key_file,
    } = files;
    if !https {
        for (f, set) in [
            ("ca_file", ca_file.is_some()),
            ("client_cert_file", client_cert_file.is_some()),
            ("client_key_file", client_key_file.is_some()),
        ] {
            if set {
                return Err(invalid(format!("{at}.{f}"), "needs an https:// url"));
            }
        }
        return Ok(None);
    }
    let at_field = |(f, reason): (&str, String)| invalid(format!("{at}.{f}"), reason);
    let client = paired(
        ("client_cert_file", client_cert_file),
        ("client_key_file", client_key_file),
    )
    .map_err(at_field)?;
    let config = crate::tls::client_config(ca_file, client, alpn).map_err(at_field)?;
    Ok(Some(Arc::new(config)))
}

/// An upstream URL: `http://` or `https://`, with a host, no query string.
fn parse_url(s: &str) -> Result<Uri, String> {
    let uri: Uri = s
        .parse()
        .map_err(|_| format!("{s:?} is not a URL like \"https://10.0.0.5:8443\""))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err("must be an http:// or https:// URL".into());
    }
    if uri.authority().is_none() {
        return Err("must name a host, like \"http://127.0.0.1:9000\"".into());
    }
    if uri.query().is_some() {
        return Err("must not carry a query string".into());
    }
    Ok(uri)
}

/// Validate `[tls]`, reading its files.
pub(super) fn listener_tls(raw: Option<RawTls>) -> Result<Option<ListenerTls>, ConfigError> {
    let Some(raw) = raw else { return Ok(None) };
    let cert_file = raw
        .cert_file
        .ok_or_else(|| invalid("tls.cert_file", "is required in [tls]"))?;
    let key_file = raw
        .key_file
        .ok_or_else(|| invalid("tls.key_file", "is required in [tls]"))?;
    let certified = listener_pair(&cert_file, &key_file)?;
    Ok(Some(ListenerTls {
        cert_file,
        key_file,
        reload_interval: raw
            .reload_interval
            .map_or(DEFAULT_TLS_RELOAD_INTERVAL, |d| d.0),
        certified,
    }))
}

/// The listener's certificate and key read from `cert_file` and `key_file`, checked to go
/// together; the error names the field at fault (`tls.key_file`).
pub(crate) fn listener_pair(
    cert_file: &str,
    key_file: &str,
) -> Result<Arc<rustls::sign::CertifiedKey>, ConfigError> {
    crate::tls::certified_key(cert_file, key_file)
        .map_err(|(f, reason)| invalid(format!("tls.{f}"), reason))
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use crate::idempotency::{IdempotencyLayer, Routes};
    use crate::metrics::Metrics;
    use crate::MemoryStore;

    #[test]
    fn an_https_host_a_certificate_cannot_name_needs_server_name() {
        for host in ["-bad-", "a..b"] {
            let refused = Config::from_toml(&format!("upstream = \"https://{host}:8443\""));
            let refused = refused.unwrap_err().to_string();
            assert!(
                refused.contains("upstream") && refused.contains("server_name"),
                "{refused}"
            );
            let named = format!(
                "[upstreams.default]\nurl = \"https://{host}:8443\"\nserver_name = \"api.example\""
            );
            let c = Config::from_toml(&named).unwrap();
            crate::proxy::Proxy::new(c.upstreams.values(), &Metrics::new());
        }
        for url in ["https://[::1]:8443", "https://10.0.0.5", "http://-bad-:80"] {
            let c = Config::from_toml(&format!("upstream = \"{url}\"")).unwrap();
            crate::proxy::Proxy::new(c.upstreams.values(), &Metrics::new());
        }
    }

    #[test]
    fn the_largest_counts_are_taken() {
        let max = i64::MAX;
        let c = Config::from_toml(&format!(
            "max_client_connections = {max}\n[upstreams.default]\nurl = \"http://127.0.0.1:1\"\n\
             max_connections = {max}\n[defaults]\nmax_waiters = {max}\n"
        ))
        .unwrap();
        let metrics = Metrics::new();
        crate::listener::ConnectionCap::new(c.max_client_connections, &metrics);
        crate::proxy::Proxy::new(c.upstreams.values(), &metrics);
        let routes = Routes::from_config(&c.defaults, c.route_policies());
        IdempotencyLayer::with_routes(MemoryStore::new(), routes).with_metrics(metrics);
    }
}

//! The `[telemetry]` table: OpenTelemetry traces exported over OTLP/HTTP (protobuf). Without the
//! table nothing is exported and no exporter runs.

use std::fmt;
use std::sync::Arc;

use http::Uri;
use serde::Deserialize;

use super::checked::{rules, Checked};
use super::upstream::{client_tls, TlsFiles};
use super::{invalid, ConfigError};

/// The service name spans are exported under (`service.name`), when not given.
pub const DEFAULT_SERVICE_NAME: &str = "idemgate";

/// The share of traces started at the gateway that are recorded, when not given: every one.
pub const DEFAULT_SAMPLE_RATIO: f64 = 1.0;

/// Where a collector takes traces, under its base URL (as `OTEL_EXPORTER_OTLP_ENDPOINT`).
const TRACES_PATH: &str = "/v1/traces";

/// The `[telemetry]` table as written.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    otlp_endpoint: Option<Checked<OtlpEndpoint>>,
    service_name: Option<Checked<ServiceName>>,
    sample_ratio: Option<Checked<Ratio>>,
    ca_file: Option<String>,
    client_cert_file: Option<String>,
    client_key_file: Option<String>,
}

rules! {
    /// A collector's OTLP/HTTP URL: `http://` or `https://`, with a host; its traces path is
    /// added unless it ends with it already.
    OtlpEndpoint: String => Uri = |s: String| traces_url(&s);
    /// A name that is not empty.
    ServiceName: String => String = |s: String| match s.trim().is_empty() {
        true => Err("must not be empty".to_string()),
        false => Ok(s),
    };
    /// A share between 0 and 1.
    Ratio: f64 => f64 = |r: f64| match (0.0..=1.0).contains(&r) {
        true => Ok(r),
        false => Err(format!("{r} is not between 0.0 and 1.0")),
    };
}

/// `[telemetry]`, validated: traces are exported.
#[derive(Clone)]
pub struct TelemetryConfig {
    /// The URL spans are posted to: the collector's `otlp_endpoint` with `/v1/traces`.
    pub traces_url: Uri,
    /// The `service.name` of the exported spans. Default [`DEFAULT_SERVICE_NAME`].
    pub service_name: String,
    /// The share of requests without a sampled `traceparent` whose trace is recorded (a
    /// client's `traceparent` decides for its request). Default [`DEFAULT_SAMPLE_RATIO`].
    pub sample_ratio: f64,
    /// A PEM file of the CA(s) to trust instead of the system's (https only).
    pub ca_file: Option<String>,
    /// The certificate presented for mutual TLS (https only).
    pub client_cert_file: Option<String>,
    /// Its key (the path only: the key itself is never printed).
    pub client_key_file: Option<String>,
    /// For https: the client configuration built from the fields above.
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
}

impl fmt::Debug for TelemetryConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TelemetryConfig")
            .field("traces_url", &format_args!("{}", self.traces_url))
            .field("service_name", &self.service_name)
            .field("sample_ratio", &self.sample_ratio)
            .field("ca_file", &self.ca_file)
            .field("client_cert_file", &self.client_cert_file)
            .field("client_key_file", &self.client_key_file)
            .finish()
    }
}

/// Validate `[telemetry]`: present, it needs `otlp_endpoint`.
pub(super) fn telemetry(raw: Option<RawTelemetry>) -> Result<Option<TelemetryConfig>, ConfigError> {
    let Some(raw) = raw else { return Ok(None) };
    let traces_url = raw.otlp_endpoint.ok_or_else(|| {
        invalid(
            "telemetry.otlp_endpoint",
            "is required in [telemetry] (the collector's OTLP/HTTP URL, like \"http://collector:4318\")",
        )
    })?;
    let traces_url = traces_url.into_inner();
    let files = TlsFiles {
        ca_file: raw.ca_file.as_deref(),
        client_cert_file: raw.client_cert_file.as_deref(),
        client_key_file: raw.client_key_file.as_deref(),
    };
    let https = traces_url.scheme_str() == Some("https");
    // No ALPN here: the exporter's connector offers HTTP/1.1 itself.
    let tls = client_tls("telemetry", https, files, &[])?;
    Ok(Some(TelemetryConfig {
        traces_url,
        service_name: raw
            .service_name
            .map_or_else(|| DEFAULT_SERVICE_NAME.to_string(), Checked::into_inner),
        sample_ratio: raw
            .sample_ratio
            .map_or(DEFAULT_SAMPLE_RATIO, Checked::into_inner),
        ca_file: raw.ca_file,
        client_cert_file: raw.client_cert_file,
        client_key_file: raw.client_key_file,
        tls,
    }))
}

/// The traces URL of a collector's OTLP/HTTP endpoint `s`.
fn traces_url(s: &str) -> Result<Uri, String> {
    let uri: Uri = s
        .parse()
        .map_err(|_| format!("{s:?} is not a URL like \"http://collector:4318\""))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err("must be an http:// or https:// URL".into());
    }
    if uri.authority().is_none() {
        return Err("must name a host, like \"http://collector:4318\"".into());
    }
    if uri.query().is_some() {
        return Err("must not carry a query string".into());
    }
    // The URL parser drops a fragment, which would end up where the traces path is added.
    if s.contains('#') {
        return Err("must not carry a fragment (#...)".into());
    }
    let path = uri.path().trim_end_matches('/');
    if path.ends_with(TRACES_PATH) {
        return Ok(uri);
    }
    format!("{s}{TRACES_PATH}", s = s.trim_end_matches('/'))
        .parse()
        .map_err(|_| format!("{s:?} is not a URL like \"http://collector:4318\""))
}

#[cfg(test)]
// figment's Jail returns figment's own (large) error type.
#[allow(clippy::result_large_err)]
mod tests {
    use super::super::Config;
    use super::*;

    const BASE: &str = "upstream = \"http://127.0.0.1:9000\"\n";

    fn telemetry(table: &str) -> Result<Option<TelemetryConfig>, String> {
        Config::from_toml(&format!("{BASE}{table}"))
            .map(|c| c.telemetry)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn off_without_the_table_and_defaults_with_it() {
        assert!(telemetry("").unwrap().is_none());
        let t = telemetry("[telemetry]\notlp_endpoint = \"http://collector:4318\"")
            .unwrap()
            .unwrap();
        assert_eq!(t.traces_url, "http://collector:4318/v1/traces");
        assert_eq!(t.service_name, DEFAULT_SERVICE_NAME);
        assert_eq!(t.sample_ratio, DEFAULT_SAMPLE_RATIO);
    }

    #[test]
    fn the_traces_path_is_added_once() {
        for (given, url) in [
            ("http://c:4318/", "http://c:4318/v1/traces"),
            ("http://c:4318/otlp", "http://c:4318/otlp/v1/traces"),
            ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
        ] {
            let t = telemetry(&format!("[telemetry]\notlp_endpoint = \"{given}\""));
            assert_eq!(t.unwrap().unwrap().traces_url, url, "{given}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        for (table, field) in [
            (
                "[telemetry]\nservice_name = \"gw\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "[telemetry]\notlp_endpoint = \"ftp://c:4318\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "[telemetry]\notlp_endpoint = \"http://c:4318\"\nca_file = \"ca.pem\"",
                "telemetry.ca_file",
            ),
            (
                "[telemetry]\notlp_endpoint = \"https://c:4318\"\nca_file = \"/nonexistent/ca.pem\"",
                "telemetry.ca_file",
            ),
            (
                "[telemetry]\notlp_endpoint = \"https://c:4318\"\nclient_cert_file = \"c.pem\"",
                "telemetry.client_key_file",
            ),
            (
                "[telemetry]\notlp_endpoint = \"http://c:4318/x#y\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "[telemetry]\notlp_endpoint = \"c:4318\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "[telemetry]\notlp_endpoint = \"http://c:4318\"\nsample_ratio = 1.5",
                "telemetry.sample_ratio",
            ),
            (
                "[telemetry]\notlp_endpoint = \"http://c:4318\"\nsample_ratio = -0.1",
                "telemetry.sample_ratio",
            ),
            (
                "[telemetry]\notlp_endpoint = \"http://c:4318\"\nservice_name = \" \"",
                "telemetry.service_name",
            ),
            (
                "[telemetry]\notlp_endpoint = \"http://c:4318\"\nsample_rate = 1.0",
                "sample_rate",
            ),
        ] {
            let e = telemetry(table).unwrap_err();
            assert!(e.contains(field), "{table}: {e}");
        }
    }

    #[test]
    fn the_environment_turns_it_on() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("idemgate.toml", BASE)?;
            jail.set_env("IDEMGATE_TELEMETRY__OTLP_ENDPOINT", "http://127.0.0.1:4318");
            jail.set_env("IDEMGATE_TELEMETRY__SAMPLE_RATIO", "0.01");
            let c = Config::load(Some("idemgate.toml")).unwrap();
            let t = c.telemetry.unwrap();
            assert_eq!(t.traces_url, "http://127.0.0.1:4318/v1/traces");
            assert_eq!(t.sample_ratio, 0.01);
            Ok(())
        });
    }
}

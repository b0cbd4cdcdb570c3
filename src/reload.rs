//! A reload (`SIGHUP`): a new configuration, read and validated as at start, checked against
//! the running one and put in force whole, or refused whole.
//!
//! What a reload changes: the routes and their policies (the engine's route table), the
//! upstreams (the proxy's set), the listener's certificate and key, the admin token, the client
//! timeouts and limits, and `sample_ratio`; each is swapped whole, so that the next request (or connection) takes the new
//! one while one in flight finishes under what it started with. Everything else is the running
//! process's: a reload that changes it is refused, naming the field.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use arc_swap::ArcSwap;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::{info, warn};

use crate::config::{upstream, Config};
use crate::error::ConfigError;
use crate::idempotency::{IdempotencyLayer, Routes};
use crate::listener::{ConnectionCap, MinBodyRate, Timeouts};
use crate::metrics::{registered, Families, Metrics};
use crate::proxy::UpstreamSet;
use crate::store::AnyStore;
use crate::telemetry::SampleRatio;
use crate::tls::CertificateMetrics;
use crate::tls::LiveCert;

/// What a reload replaces in a running gateway, shared with its workers and admin listener.
#[derive(Clone)]
pub(crate) struct Live {
    // The layer whose route table a reload replaces (every worker's layer shares it).
    pub(crate) layer: IdempotencyLayer<AnyStore>,
    // The upstream set every worker's proxy follows.
    pub(crate) upstreams: UpstreamSet,
    // Read for each new client connection.
    pub(crate) timeouts: Arc<ArcSwap<Timeouts>>,
    pub(crate) cap: Arc<ConnectionCap>,
    // Read for each key API request.
    pub(crate) admin_token: Arc<ArcSwap<Option<String>>>,
    pub(crate) sample_ratio: SampleRatio,
    // The listener's certificate and key, with `[tls]`.
    pub(crate) cert: Option<Arc<LiveCert>>,
}

impl Live {
    /// What `config` puts in force, over `layer`.
    pub(crate) fn new(config: &Config, layer: IdempotencyLayer<AnyStore>) -> Self {
        let live = Live {
            upstreams: UpstreamSet::new(config.upstreams.values()),
            timeouts: Arc::new(ArcSwap::from_pointee(client_timeouts(config))),
            cap: ConnectionCap::new(config.max_client_connections, layer.metrics()),
            admin_token: Arc::default(),
            sample_ratio: SampleRatio::default(),
            cert: config
                .tls
                .as_ref()
                .map(|t| LiveCert::new(t.certified.clone())),
            layer,
        };
        live.admin_token
            .store(Arc::new(config.admin.admin_token.clone()));
        if let Some(t) = &config.telemetry {
            live.sample_ratio.set(t.sample_ratio);
        }
        live
    }

    /// Put what `config` says in force for the requests and connections that come next.
    fn put_in_force(&self, config: &Config) {
        let routes = Routes::from_config(&config.defaults, config.route_policies());
        self.layer.set_routes(routes);
        self.upstreams.replace(config.upstreams.values());
        self.timeouts.store(Arc::new(client_timeouts(config)));
        self.cap.resize(config.max_client_connections);
        self.admin_token
            .store(Arc::new(config.admin.admin_token.clone()));
        if let Some(t) = &config.telemetry {
            self.sample_ratio.set(t.sample_ratio);
        }
        if let (Some(cert), Some(tls)) = (&self.cert, &config.tls) {
            cert.replace(tls.certified.clone());
        }
    }

    /// The acceptor of a TLS listener presenting the certificate in force; none without `[tls]`.
    pub(crate) fn tls_acceptor(&self) -> Option<tokio_rustls::TlsAcceptor> {
        let cert = self.cert.clone()?;
        Some(Arc::new(crate::tls::server_config(cert)).into())
    }
}

/// The client timeouts `config` sets.
pub(crate) fn client_timeouts(config: &Config) -> Timeouts {
    Timeouts {
        header: config.client_header_timeout,
        idle: config.client_idle_timeout,
        body_rate: config
            .client_min_body_rate
            .map(|bytes_per_second| MinBodyRate {
                bytes_per_second,
                grace: config.client_min_body_rate_grace,
            }),
    }
}

/// Why a reload was refused (the running configuration keeps serving).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The new configuration does not read or validate.
    #[error("{0}")]
    Invalid(#[from] ConfigError),
    /// It changes a field that only a restart can change.
    #[error("{field}: changed, and only a restart can change it")]
    NeedsRestart {
        /// The field, as `check-config` names it.
        field: &'static str,
    },
}

/// Puts a new configuration in force in a running gateway. Cheap to clone.
#[derive(Clone)]
pub struct Reloader {
    inner: Arc<Inner>,
}

struct Inner {
    // The configuration in force, which a new one is compared with. A std Mutex: held for a
    // comparison and two swaps, never across an await.
    running: Mutex<Arc<Config>>,
    live: Live,
    metrics: Arc<ReloadMetrics>,
    // The not-after of each certificate in force.
    certificates: Arc<CertificateMetrics>,
}

impl Reloader {
    /// A reloader for the gateway running `config` with `live`; the last successful load is
    /// now.
    pub(crate) fn new(config: Arc<Config>, live: Live, registry: &Metrics) -> Self {
        let metrics = registry.families::<ReloadMetrics>();
        metrics.loaded_now();
        Reloader {
            inner: Arc::new(Inner {
                running: Mutex::new(config),
                live,
                certificates: registry.families(),
                metrics,
            }),
        }
    }

    /// Put `loaded` in force if it read and validated, and changes nothing that needs a
    /// restart; otherwise keep the running configuration. Logged and counted either way.
    pub fn reload(&self, loaded: Result<Config, ConfigError>) -> Result<(), ReloadError> {
        let result = loaded
            .map_err(ReloadError::from)
            .and_then(|config| self.apply(config));
        match &result {
            Ok(()) => {
                self.inner.metrics.successes.inc();
                self.inner.metrics.loaded_now();
                info!("configuration reloaded");
            }
            Err(e) => {
                self.inner.metrics.failures.inc();
                warn!(error = %e, "reload refused: the running configuration keeps serving");
            }
        }
        result
    }

    /// Every `[tls] reload_interval` (its default without `[tls]`), look at the certificate
    /// files in force (the listener's pair, each upstream's TLS files), and put a changed set
    /// in force when it is valid; a half-written or mismatched one is refused (counted as a
    /// failed reload) and the one in force kept, until the files change again. Runs until
    /// dropped; returns when the interval is zero.
    pub async fn watch_certificate(self) {
        let mut seen = HashMap::new();
        loop {
            let running = self.running();
            let interval = running.certificate_reload_interval();
            if interval.is_zero() {
                return;
            }
            seen = watched(&running)
                .into_iter()
                .map(|w| {
                    let stamps = self.look(&w, seen.get(&w));
                    (w, stamps)
                })
                .collect();
            tokio::time::sleep(interval).await;
        }
    }

    /// The modification times of `watched`'s files now; when they differ from `before` (the
    /// last look at the same files), the files are read again and put in force if usable.
    fn look(&self, watched: &Watched, before: Option<&Stamps>) -> Stamps {
        let now: Stamps = watched
            .files
            .iter()
            .map(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
            .collect();
        if before.is_some_and(|before| *before != now) {
            let name = watched.source.name();
            match self.read_again(&watched.source) {
                Ok(()) => info!(files = %name, "certificate files changed on disk: in force"),
                Err(e) => {
                    self.inner.metrics.failures.inc();
                    warn!(files = %name, error = %e, "certificate files changed on disk but are not usable: those in force are kept");
                }
            }
        }
        now
    }

    /// Read `source`'s files again and put them in force, or say which field is at fault.
    fn read_again(&self, source: &Source) -> Result<(), ConfigError> {
        let inner = &self.inner;
        // Held so that a reload does not interleave: the rebuilt set is the running one's.
        let mut running = inner.running.lock().unwrap_or_else(PoisonError::into_inner);
        match source {
            Source::Listener => {
                let (Some(cert), Some(tls)) = (&inner.live.cert, &running.tls) else {
                    return Ok(());
                };
                cert.replace(upstream::listener_pair(&tls.cert_file, &tls.key_file)?);
                inner.certificates.record(&source.name(), &tls.cert_file);
            }
            Source::Upstream(name) => {
                let Some(old) = running.upstreams.get(name) else {
                    return Ok(());
                };
                let fresh = Arc::new(upstream::tls_read_again(old)?);
                if let Some(cert) = &fresh.client_cert_file {
                    inner.certificates.record(&source.name(), cert);
                }
                let mut config = Config::clone(&running);
                config.upstreams.insert(name.clone(), fresh);
                inner.live.upstreams.replace(config.upstreams.values());
                *running = Arc::new(config);
            }
        }
        Ok(())
    }

    fn running(&self) -> Arc<Config> {
        let running = self.inner.running.lock();
        running.unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn apply(&self, config: Config) -> Result<(), ReloadError> {
        let inner = &self.inner;
        let mut running = inner.running.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(field) = needs_restart(&running, &config) {
            return Err(ReloadError::NeedsRestart { field });
        }
        inner.live.put_in_force(&config);
        for (name, file) in config.presented_certificates() {
            inner.certificates.record(&name, &file);
        }
        info!(
            upstream = %config.upstream,
            routes = config.routes.len(),
            "new requests take the reloaded configuration"
        );
        *running = Arc::new(config);
        Ok(())
    }
}

/// Whose certificate files a [`Watched`] set is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Source {
    Listener,
    Upstream(String),
}

impl Source {
    /// As the expiry metric names it: `listener`, `upstream:NAME`.
    fn name(&self) -> String {
        match self {
            Source::Listener => "listener".to_string(),
            Source::Upstream(name) => format!("upstream:{name}"),
        }
    }
}

/// A set of certificate files looked at for a change on disk, and whose they are.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Watched {
    source: Source,
    files: Vec<String>,
}

/// The modification times of a [`Watched`] set's files (`None`: not readable).
type Stamps = Vec<Option<SystemTime>>;

/// Every set of certificate files `config` reads: the listener's pair, and the TLS files of
/// each upstream that names some.
fn watched(config: &Config) -> Vec<Watched> {
    let listener = config.tls.iter().map(|t| Watched {
        source: Source::Listener,
        files: vec![t.cert_file.clone(), t.key_file.clone()],
    });
    let upstreams = config.upstreams.iter().map(|(name, u)| Watched {
        source: Source::Upstream(name.clone()),
        files: [&u.ca_file, &u.client_cert_file, &u.client_key_file]
            .into_iter()
            .flatten()
            .cloned()
            .collect(),
    });
    listener
        .chain(upstreams.filter(|w| !w.files.is_empty()))
        .collect()
}

/// The first field `new` changes that a reload cannot, named as `check-config` names it.
fn needs_restart(old: &Config, new: &Config) -> Option<&'static str> {
    let debug = |v: &dyn std::fmt::Debug| format!("{v:?}");
    // `[telemetry]` but its `sample_ratio`, which a reload changes.
    let telemetry = |c: &Config| {
        let mut t = c.telemetry.clone();
        if let Some(t) = &mut t {
            t.sample_ratio = 1.0;
        }
        debug(&t)
    };
    let fields: [(&'static str, bool); 7] = [
        ("listen", old.listen == new.listen),
        ("admin.listen", old.admin.listen == new.admin.listen),
        ("workers", old.workers == new.workers),
        ("store", old.store == new.store),
        ("tls", old.tls.is_some() == new.tls.is_some()),
        ("shutdown_grace", old.shutdown_grace == new.shutdown_grace),
        ("telemetry", telemetry(old) == telemetry(new)),
    ];
    fields
        .into_iter()
        .find(|(_, same)| !same)
        .map(|(field, _)| field)
}

// === impl ReloadMetrics ===

/// A reload's result, as `idemgate_config_reloads_total{result}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum ReloadResult {
    success,
    failure,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: ReloadResult,
}

/// The reload's families: reloads by result, and when the configuration in force was loaded.
#[derive(Debug)]
pub(crate) struct ReloadMetrics {
    successes: Counter,
    failures: Counter,
    last_success: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl ReloadMetrics {
    /// The configuration in force was loaded now.
    fn loaded_now(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.last_success.set(now);
    }
}

impl Families for ReloadMetrics {
    fn register(registry: &mut Registry) -> Self {
        let reloads = registered(
            registry,
            "idemgate_config_reloads",
            "Configuration reloads (SIGHUP), by result: success (in force) or failure (refused: invalid, or changing what needs a restart)",
            Family::<ResultLabels, Counter>::default(),
        );
        let count = |result| reloads.get_or_create(&ResultLabels { result }).clone();
        let last_success = registered(
            registry,
            "idemgate_config_last_reload_success_timestamp_seconds",
            "When the configuration in force was loaded (at start, or by the last successful reload), in seconds since the Unix epoch",
            Gauge::default(),
        );
        ReloadMetrics {
            successes: count(ReloadResult::success),
            failures: count(ReloadResult::failure),
            last_success,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::upstream::DEFAULT_TLS_RELOAD_INTERVAL;

    #[test]
    fn upstream_files_are_watched_without_listener_tls() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let issued = rcgen::generate_simple_self_signed(vec!["ca.test".to_string()]).unwrap();
        std::fs::write(&ca, issued.cert.pem()).unwrap();
        let ca = ca.to_str().unwrap().to_string();
        let config = Config::from_toml(&format!(
            "upstream = \"https://127.0.0.1:8443\"\n[upstreams.default]\nca_file = {ca:?}\n\
             [upstreams.plain]\nurl = \"http://127.0.0.1:9\"\n"
        ))
        .unwrap();
        assert_eq!(
            config.certificate_reload_interval(),
            DEFAULT_TLS_RELOAD_INTERVAL
        );
        let only = Watched {
            source: Source::Upstream("default".into()),
            files: vec![ca],
        };
        assert_eq!(watched(&config), [only]);
    }
}

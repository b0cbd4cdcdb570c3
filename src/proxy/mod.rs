//! The proxy: the gateway's inner service, forwarding each request to the upstream its route
//! names, over pooled keep-alive connections (HTTP/1.1, or HTTP/2 when the upstream is set to
//! it), plain or TLS.
//!
//! [`Proxy`] is a tower `Service`; the idempotency layer wraps it like any other service. Its
//! errors say whether the request was sent ([`ProxyError`]): a connection that could not be made
//! or a TLS handshake that was refused carries [`NotSent`], which the layer reads to release a
//! claim.
//!
//! - `upstream.rs`: one upstream of one worker: its connections and how a request is sent.
//! - `connect.rs`: TCP and TLS connections, and which failures mean "not sent".
//! - `set.rs`: the upstreams in force ([`UpstreamSet`], replaced by a reload), and each
//!   worker's pools built for them.

mod connect;
mod metrics;
pub(crate) use connect::tls_name;
mod set;
mod settings;
mod upstream;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::{Request, Response};
use http_body_util::BodyExt;

use crate::error::GatewayError;
use crate::headers::content_length;
use crate::idempotency::{with_trailers, Deadline, NotSent, Policy, DEFAULT_UPSTREAM};
use crate::metrics::Metrics;
pub use metrics::{ProxyMetrics, UpstreamCounters, UpstreamResult};
pub use set::UpstreamSet;
use set::Upstreams;
pub use settings::{UpstreamConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS};

/// A boxed error, for messages.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a forward failed. What the difference means for a claim is read by the idempotency layer
/// from the error's `source()` chain: only [`NotSent`] lets it release the key.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// No connection could be made, the connection closed before it took the request, or the
    /// TLS handshake was refused: the request was certainly not processed.
    #[error("upstream {upstream}: {cause}")]
    NotSent {
        /// The upstream's name.
        upstream: Arc<str>,
        /// Whether TLS was at fault (the handshake failed or was refused).
        tls: bool,
        /// What happened.
        #[source]
        cause: NotSent,
    },
    /// Failed after the request may have been sent (reset, malformed response, ...).
    #[error("upstream {upstream}: request failed: {cause}")]
    Failed {
        /// The upstream's name.
        upstream: Arc<str>,
        /// What happened.
        #[source]
        cause: BoxError,
    },
    /// The answer is no final response (a `101` nobody asked for, a status past 599): the
    /// request was sent and may have been processed.
    #[error("upstream {upstream}: answered with status {status}, which is not a final response")]
    InvalidResponse {
        /// The upstream's name.
        upstream: Arc<str>,
        /// The status it answered with.
        status: u16,
    },
    /// No response head within the route's `upstream_timeout`.
    #[error("upstream {upstream}: no answer within upstream_timeout")]
    Timeout {
        /// The upstream's name.
        upstream: Arc<str>,
    },
    /// All `max_connections` stayed busy until the deadline: the request was not sent.
    #[error("upstream {upstream}: {cause}")]
    Busy {
        /// The upstream's name.
        upstream: Arc<str>,
        /// Says that nothing was sent.
        #[source]
        cause: NotSent,
    },
}

impl ProxyError {
    fn not_sent(upstream: Arc<str>, tls: bool, cause: impl Into<BoxError>) -> Self {
        ProxyError::NotSent {
            upstream,
            tls,
            cause: NotSent::new(cause),
        }
    }

    fn result(&self) -> UpstreamResult {
        match self {
            ProxyError::NotSent { tls: true, .. } => UpstreamResult::tls_failed,
            ProxyError::NotSent { .. } => UpstreamResult::not_sent,
            ProxyError::Failed { .. } | ProxyError::InvalidResponse { .. } => {
                UpstreamResult::failed
            }
            ProxyError::Timeout { .. } | ProxyError::Busy { .. } => UpstreamResult::timeout,
        }
    }
}

impl From<&ProxyError> for GatewayError {
    fn from(e: &ProxyError) -> Self {
        match e {
            ProxyError::NotSent { tls: true, .. } => GatewayError::UpstreamTls,
            ProxyError::NotSent { .. } | ProxyError::Failed { .. } => GatewayError::Upstream,
            ProxyError::Timeout { .. } => GatewayError::UpstreamTimeout,
            ProxyError::Busy { .. } => GatewayError::UpstreamBusy,
            ProxyError::InvalidResponse { status, .. } => {
                GatewayError::UpstreamInvalidResponse(*status)
            }
        }
    }
}

/// Responses up to this size with a known length are read whole and sent in one write, as
/// nginx's proxy buffering does; anything else streams through.
const SEND_WHOLE_UP_TO: u64 = 16 * 1024;

/// The upstreams as a tower `Service`: the inner service of the gateway's idempotency layer.
/// Cheap to clone (clones share the pools). A request goes to the upstream named by the
/// [`Policy`] the layer hands down as a request extension (`default` without one), and its
/// response head must arrive within that policy's `upstream_timeout`.
#[derive(Clone, Debug)]
pub struct Proxy {
    // Behind one reference count: the proxy is cloned for every request. A few upstreams at
    // most: found by comparing names, cheaper than hashing one.
    upstreams: Arc<Upstreams>,
}

impl Proxy {
    /// A proxy to `upstreams`, with connection pools of its own, counting into `metrics`.
    pub fn new<'a>(
        upstreams: impl IntoIterator<Item = &'a Arc<UpstreamConfig>>,
        metrics: &Metrics,
    ) -> Self {
        Self::following(&UpstreamSet::new(upstreams), metrics)
    }

    /// A proxy to the upstreams `set` holds at each request, with connection pools of its own
    /// (opened anew when the set is replaced), counting into `metrics`.
    pub fn following(set: &UpstreamSet, metrics: &Metrics) -> Self {
        Proxy {
            upstreams: Arc::new(Upstreams::new(set.clone(), metrics.families())),
        }
    }

    async fn call(self, req: Request<Body>) -> Result<Response<Body>, ProxyError> {
        let (name, timeout) = match req.extensions().get::<Arc<Policy>>() {
            Some(p) => (p.upstream.as_str(), p.upstream_timeout),
            None => (DEFAULT_UPSTREAM, Policy::DEFAULT_UPSTREAM_TIMEOUT),
        };
        let deadline = match req.extensions().get::<Deadline>() {
            Some(d) => d.0,
            None => crate::time::after(tokio::time::Instant::now(), timeout),
        };
        // The config checks that routes name upstreams that exist; a policy made in code may not.
        let upstreams = self.upstreams.current();
        let Some(upstream) = upstreams.upstreams.iter().find(|u| &**u.name() == name) else {
            return Err(ProxyError::not_sent(
                name.into(),
                false,
                format!("no upstream named {name:?}"),
            ));
        };
        let result = match tokio::time::timeout_at(deadline, upstream.forward(req, deadline)).await
        {
            Ok(result) => result,
            Err(_) => Err(ProxyError::Timeout {
                upstream: upstream.name().clone(),
            }),
        };
        let resp = match result {
            Ok(resp) => {
                upstream.count(UpstreamResult::response);
                resp
            }
            Err(e) => {
                upstream.count(e.result());
                return Err(e);
            }
        };
        let (head, body) = resp.into_parts();
        if content_length(&head.headers).is_some_and(|n| n <= SEND_WHOLE_UP_TO) {
            let whole = body.collect().await.map_err(|e| ProxyError::Failed {
                upstream: upstream.name().clone(),
                cause: e.into(),
            })?;
            // Its trailers (a gRPC answer's status) go on after it.
            let trailers = whole.trailers().cloned();
            let body = with_trailers(whole.to_bytes(), trailers);
            return Ok(Response::from_parts(head, body));
        }
        Ok(Response::from_parts(head, Body::new(body)))
    }
}

impl tower::Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        Box::pin(self.clone().call(req))
    }
}

#[cfg(test)]
mod tests {
    use tower::ServiceExt;

    use super::*;

    #[tokio::test]
    async fn a_policy_naming_no_upstream_is_refused_as_not_sent() {
        let proxy = Proxy::new(std::iter::empty(), &Metrics::new());
        let err = proxy
            .oneshot(Request::new(Body::empty()))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ProxyError::NotSent { tls: false, .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("no upstream named \"default\""),
            "{err}"
        );
    }
}

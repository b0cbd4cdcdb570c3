//! What the client sees when the gateway itself answers: RFC 9457 `application/problem+json`
//! with a stable `type` per kind (or Stripe's error object, or a gRPC status to a gRPC call).
//! Internal details go to the log, not to the client.

use std::time::Duration;

use axum::body::Body;
use http::{header, HeaderValue, Response, StatusCode};

use crate::grpc_status::{self, Code};

/// The shape of the answers the gateway gives itself (its refusals and failures; never a replay
/// or an upstream's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ErrorFormat {
    /// RFC 9457 `application/problem+json`.
    #[default]
    Problem,
    /// Stripe's error object, `{"error": {"type", "message", "code"}}`, which Stripe's SDKs
    /// read (a reused key raises their `IdempotencyError`).
    Stripe,
    /// A gRPC status (trailers-only, HTTP 200): what every gRPC call gets, whatever its route's
    /// format (`idempotency/grpc.rs`); not a configuration value.
    #[serde(skip)]
    Grpc,
    /// A JSON-RPC error response (`application/json`), its code from [`GatewayError::jsonrpc_code`]
    /// and the problem details in `data`: what every call on a JSON-RPC route gets
    /// (`idempotency/jsonrpc/`); not a configuration value.
    #[serde(skip)]
    JsonRpc,
}

/// An answer produced by the gateway instead of the upstream. Each variant's doc names its status.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// 400: the `Idempotency-Key` header is malformed, empty, too long or repeated.
    #[error("{0}")]
    InvalidKey(String),
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    #[error("this endpoint requires an Idempotency-Key header")]
    MissingKey,
    /// 400: the request body could not be read.
    #[error("the request body could not be read")]
    InvalidBody,
    /// 400: a JSON-typed body the route must read (for its key or a canonical fingerprint) does
    /// not parse, repeats a key in an object, or nests too deep; nothing was claimed.
    #[error("the JSON body, which this endpoint reads for its idempotency key or fingerprint, is invalid: {0}; nothing was processed")]
    InvalidJson(String),
    /// 400: the request's framing is invalid (`Transfer-Encoding: chunked` applied twice).
    #[error("{0}")]
    InvalidFraming(&'static str),
    /// 400: the request's authority is ambiguous or carries credentials: userinfo in
    /// `:authority`, `Host` or the target, two `Host` headers, or a `Host` that names another
    /// authority than `:authority`. Nothing was forwarded.
    #[error("{0}")]
    InvalidAuthority(&'static str),
    /// 400: a `Repeatability-Request-ID` without exactly one `Repeatability-First-Sent`, or one
    /// that is no HTTP-date.
    #[error("{0}")]
    InvalidRepeatability(&'static str),
    /// 400: a delivery on a webhook route whose signature is missing, malformed or wrong
    /// (`webhook-signature`), or whose signed timestamp is outside `webhook_tolerance`
    /// (`webhook-timestamp`); nothing was forwarded or claimed.
    #[error("{0}")]
    Webhook(WebhookRejection),
    /// 412 with `Repeatability-Result: rejected`: a repeatable request first sent longer ago
    /// than the route's `ttl`, or more than a minute in the future; never forwarded.
    #[error("{0}")]
    RepeatabilityRejected(&'static str),
    /// 408: the request body arrived slower than `client_min_body_rate` once its grace had
    /// passed; it was not forwarded whole.
    #[error("the request body arrived slower than {0} bytes a second, the least the gateway accepts once a body has had its grace; it was not forwarded whole")]
    BodyTooSlow(u64),
    /// 501: the request uses a transfer coding other than `chunked`, which the gateway does not
    /// decode (it never forwards a body relabelled).
    #[error("the only transfer coding accepted is chunked, applied once")]
    UnsupportedTransferCoding,
    /// 501: a method the gateway does not proxy (`CONNECT`: it is no tunnel).
    #[error("{0} is not supported: idemgate is a reverse proxy, not a tunnel")]
    UnsupportedMethod(http::Method),
    /// 413: a keyed request's body is larger than the route's `max_body`.
    #[error("the request body is larger than {limit} bytes, the limit for idempotent requests")]
    BodyTooLarge {
        /// The route's `max_body`.
        limit: u64,
    },
    /// 409 or 422 (`mismatch_status`): the key was used before for a different request.
    #[error("this Idempotency-Key was already used with a different request (method, path, query, content-type or body)")]
    Mismatch {
        /// The route's `mismatch_status`.
        status: StatusCode,
    },
    /// 409 with `Retry-After`: a request with this key is still being processed.
    #[error("a request with this Idempotency-Key is still being processed; retry later")]
    InFlight {
        /// What `Retry-After` says.
        retry_after: Duration,
    },
    /// 410: the key's record expired and the route refuses a retry after expiry
    /// (`after_expiry = "refuse"`): the request is never run again.
    #[error("the request with this Idempotency-Key was recorded on {} with status {}; its record expired on {}, and this endpoint does not run an expired key again: use a new key for a new request", http_date(.recorded_ms), status_text(.status), http_date(.expired_ms))]
    KeyExpired {
        /// The recorded response's status (`None`: it was too large to keep).
        status: Option<StatusCode>,
        /// When the record was written, in ms since the Unix epoch.
        recorded_ms: u64,
        /// When it expired.
        expired_ms: u64,
    },
    /// 409: the first response was too large to store; it was delivered once and is not replayed.
    #[error("the request with this Idempotency-Key completed, but its response was too large to be stored for replay")]
    NotReplayable,
    /// 502: the upstream could not be reached (nothing was sent), or it failed mid-response.
    #[error("the upstream could not be reached or failed")]
    Upstream,
    /// 502: the upstream's answer is no final response (an informational status such as a `101`
    /// nobody asked for, or a status past 599). The request may have been processed, so its key
    /// stays claimed until the lease ends.
    #[error("the upstream answered with status {0}, which is not a final response; the request may have been processed")]
    UpstreamInvalidResponse(u16),
    /// 502: the TLS handshake with the upstream failed or was refused (its certificate, ours, or
    /// the protocols); nothing was processed.
    #[error("the TLS handshake with the upstream failed (a certificate or the protocol was refused); the request was not processed")]
    UpstreamTls,
    /// 504: every connection to the upstream (`max_connections`) stayed busy past
    /// `upstream_timeout`; the request was not sent.
    #[error(
        "no connection to the upstream came free within upstream_timeout; the request was not sent"
    )]
    UpstreamBusy,
    /// 504: the upstream did not answer within `upstream_timeout`.
    #[error("the upstream did not answer in time")]
    UpstreamTimeout,
    /// 500: the stored record of this key is damaged (its body disagrees with its declared
    /// length, or it cannot be decoded). Refused rather than sent; the request is not run again.
    #[error("the stored response for this Idempotency-Key is damaged and cannot be replayed; the request was not run again")]
    CorruptRecord,
    /// 500: the stored record of this key does not open (sealed records: changed in the store,
    /// copied from another key, sealed with a key the gateway does not hold, or in clear where
    /// `seal = "required"`). Never replayed; the request is not run again.
    #[error("the stored response for this Idempotency-Key cannot be opened (it was changed in the store, or sealed with a key this gateway does not hold); it is not replayed, and the request was not run again")]
    RecordUnreadable,
    /// 503 with `Retry-After`: the idempotency store is unavailable; nothing was forwarded.
    #[error("the idempotency store is unavailable; nothing was forwarded, retry later")]
    StoreUnavailable,
    /// 400: a JSON-RPC batch holds a call of a keyed method; keyed calls go one per request.
    /// Nothing was forwarded.
    #[error(
        "this batch holds a keyed call: send keyed calls one per request; nothing was processed"
    )]
    KeyedCallInBatch,
    /// 400: an MCP request's routing header (`Mcp-Method`, `Mcp-Name`) disagrees with its body.
    /// Nothing was forwarded.
    #[error("the {0} header disagrees with the request body; nothing was processed")]
    HeaderMismatch(&'static str),
    /// 409: the call's recorded answer has no faithful form in the protocol version of this
    /// retry (MCP); it is neither replayed nor run again.
    #[error("the call with this idempotency key was recorded under another MCP protocol version, and its result ({0}) cannot be given in this request's version; it was not run again: retry under the version it was made with")]
    ReplayUntranslatable(&'static str),
    /// 500: the gateway itself failed while handling the request (a defect, logged with its
    /// cause). A claimed key is left to its lease, never answered twice.
    #[error(
        "the gateway failed while handling this request; retry it with the same Idempotency-Key"
    )]
    Internal,
}

impl GatewayError {
    /// The HTTP status of this answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidKey(_)
            | Self::MissingKey
            | Self::InvalidBody
            | Self::InvalidJson(_)
            | Self::InvalidFraming(_)
            | Self::InvalidAuthority(_)
            | Self::InvalidRepeatability(_)
            | Self::Webhook(_)
            | Self::KeyedCallInBatch
            | Self::HeaderMismatch(_) => StatusCode::BAD_REQUEST,
            Self::RepeatabilityRejected(_) => StatusCode::PRECONDITION_FAILED,
            Self::UnsupportedTransferCoding | Self::UnsupportedMethod(_) => {
                StatusCode::NOT_IMPLEMENTED
            }
            Self::CorruptRecord | Self::RecordUnreadable | Self::Internal => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTooSlow(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Mismatch { status } => *status,
            Self::InFlight { .. } | Self::NotReplayable | Self::ReplayUntranslatable(_) => {
                StatusCode::CONFLICT
            }
            Self::KeyExpired { .. } => StatusCode::GONE,
            Self::Upstream | Self::UpstreamTls | Self::UpstreamInvalidResponse(_) => {
                StatusCode::BAD_GATEWAY
            }
            Self::UpstreamTimeout | Self::UpstreamBusy => StatusCode::GATEWAY_TIMEOUT,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The stable problem type (the last part of the `type` URI), also the metrics outcome label
    /// and the start of a gRPC refusal's message.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidKey(_) => "invalid-key",
            Self::MissingKey => "missing-key",
            Self::InvalidBody => "invalid-body",
            Self::InvalidJson(_) => "invalid-json",
            Self::InvalidFraming(_) => "invalid-framing",
            Self::InvalidAuthority(_) => "invalid-authority",
            Self::InvalidRepeatability(_) => "invalid-repeatability",
            Self::RepeatabilityRejected(_) => "repeatability-rejected",
            Self::Webhook(r) if r.is_timestamp() => "webhook-timestamp",
            Self::Webhook(_) => "webhook-signature",
            Self::UnsupportedTransferCoding => "unsupported-transfer-coding",
            Self::UnsupportedMethod(_) => "unsupported-method",
            Self::CorruptRecord => "corrupt-record",
            Self::RecordUnreadable => "record-unreadable",
            Self::BodyTooLarge { .. } => "body-too-large",
            Self::BodyTooSlow(_) => "body-too-slow",
            Self::Mismatch { .. } => "mismatch",
            Self::InFlight { .. } => "in-flight",
            Self::NotReplayable => "not-replayable",
            Self::KeyExpired { .. } => "key-expired",
            Self::Upstream | Self::UpstreamTls => "upstream-unavailable",
            Self::UpstreamInvalidResponse(_) => "upstream-invalid-response",
            Self::UpstreamTimeout | Self::UpstreamBusy => "upstream-timeout",
            Self::StoreUnavailable => "store-unavailable",
            Self::KeyedCallInBatch => "keyed-call-in-batch",
            Self::HeaderMismatch(_) => "header-mismatch",
            Self::ReplayUntranslatable(_) => "replay-untranslatable",
            Self::Internal => "internal",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::InvalidKey(_) => "Invalid Idempotency-Key",
            Self::MissingKey => "Idempotency-Key required",
            Self::InvalidBody => "Unreadable request body",
            Self::InvalidJson(_) => "Invalid JSON body",
            Self::InvalidFraming(_) => "Invalid message framing",
            Self::InvalidAuthority(_) => "Invalid Host or :authority",
            Self::InvalidRepeatability(_) => "Invalid Repeatability headers",
            Self::RepeatabilityRejected(_) => "Request cannot be repeated",
            Self::Webhook(r) if r.is_timestamp() => "Webhook timestamp outside the tolerance",
            Self::Webhook(_) => "Webhook signature invalid",
            Self::UnsupportedTransferCoding => "Transfer coding not supported",
            Self::UnsupportedMethod(_) => "Method not supported",
            Self::CorruptRecord => "Stored response damaged",
            Self::RecordUnreadable => "Stored response unreadable",
            Self::BodyTooLarge { .. } => "Request body too large",
            Self::BodyTooSlow(_) => "Request body too slow",
            Self::Mismatch { .. } => "Idempotency-Key reused with a different request",
            Self::InFlight { .. } => "Request in flight",
            Self::NotReplayable => "Response not replayable",
            Self::KeyExpired { .. } => "Idempotency-Key expired",
            Self::Upstream | Self::UpstreamTls | Self::UpstreamInvalidResponse(_) => "Bad gateway",
            Self::UpstreamTimeout | Self::UpstreamBusy => "Gateway timeout",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::KeyedCallInBatch => "Keyed call in a batch",
            Self::HeaderMismatch(_) => "Header mismatch",
            Self::ReplayUntranslatable(_) => "Replay not possible in this protocol version",
            Self::Internal => "Internal error",
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InFlight { retry_after } => Some(*retry_after),
            Self::StoreUnavailable => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The problem+json response.
    pub fn into_response(self) -> Response<Body> {
        self.respond(ErrorFormat::Problem)
    }

    /// The response in `format`.
    pub fn respond(self, format: ErrorFormat) -> Response<Body> {
        match format {
            ErrorFormat::Problem => Problem {
                status: self.status(),
                kind: self.kind(),
                title: self.title(),
                detail: self.to_string(),
                retry_after: self.retry_after(),
            }
            .into_response(),
            ErrorFormat::Stripe => self.stripe(),
            ErrorFormat::Grpc => {
                let instance = occurrence(self.kind(), self.status());
                let message = format!("{}: {self} (instance {instance})", self.kind());
                grpc_status::trailers_only(self.grpc_code(), &message, self.retry_after())
            }
            ErrorFormat::JsonRpc => self.jsonrpc(),
        }
    }

    /// The JSON-RPC error code of each of the gateway's own answers to a JSON-RPC call: outside
    /// the range JSON-RPC reserves (-32768..-32000), one per refusal, except the two the
    /// protocols name (a keyed call in a batch is an invalid request, -32600; MCP's
    /// HeaderMismatch, -32020). docs/behaviour.md lists them.
    pub fn jsonrpc_code(&self) -> i64 {
        use GatewayError as E;
        match self {
            E::InFlight { .. } => -31001,
            E::Mismatch { .. } => -31002,
            E::InvalidKey(_) => -31003,
            E::MissingKey => -31004,
            E::KeyExpired { .. } => -31005,
            E::NotReplayable => -31006,
            E::ReplayUntranslatable(_) => -31007,
            E::BodyTooLarge { .. } => -31008,
            E::StoreUnavailable => -31009,
            E::CorruptRecord | E::RecordUnreadable => -31010,
            E::Upstream
            | E::UpstreamTls
            | E::UpstreamInvalidResponse(_)
            | E::UpstreamBusy
            | E::UpstreamTimeout => -31011,
            E::InvalidBody
            | E::InvalidJson(_)
            | E::InvalidFraming(_)
            | E::InvalidAuthority(_)
            | E::InvalidRepeatability(_)
            | E::RepeatabilityRejected(_)
            | E::BodyTooSlow(_)
            | E::UnsupportedTransferCoding
            | E::UnsupportedMethod(_)
            | E::Webhook(_) => -31012,
            E::Internal => -31013,
            E::KeyedCallInBatch => -32600,
            E::HeaderMismatch(_) => -32020,
        }
    }

    /// The JSON-RPC error response (`id` null until the call's own is put in,
    /// `idempotency/jsonrpc/reply.rs`): the code, the message, and the problem details in
    /// `data`; `application/json`, which MCP's SDKs read at any status, with this answer's
    /// status. The error object rides along as a [`JsonRpcError`] extension.
    fn jsonrpc(self) -> Response<Body> {
        let status = self.status();
        let error = serde_json::json!({
            "code": self.jsonrpc_code(),
            "message": self.to_string(),
            "data": {
                "type": format!("{PROBLEM_TYPE_BASE}{}", self.kind()),
                "title": self.title(),
                "status": status.as_u16(),
                "detail": self.to_string(),
                "instance": occurrence(self.kind(), status),
            },
        });
        let body = serde_json::json!({ "jsonrpc": "2.0", "id": null, "error": &error });
        let mut resp = answer(status, "application/json", &body, self.retry_after());
        resp.extensions_mut().insert(JsonRpcError(error));
        resp
    }

    /// The gRPC status of each of the gateway's own answers: the key's refusals say what the
    /// client must change (`FAILED_PRECONDITION`: another request under a used key; `ABORTED`:
    /// the same one still running, retry), a request it cannot take is `INVALID_ARGUMENT`, and
    /// failures of the store or the upstream are `UNAVAILABLE` (`DEADLINE_EXCEEDED` for a timeout).
    fn grpc_code(&self) -> Code {
        use GatewayError as E;
        match self {
            E::InvalidKey(_)
            | E::MissingKey
            | E::InvalidBody
            | E::InvalidJson(_)
            | E::InvalidFraming(_)
            | E::InvalidAuthority(_)
            | E::InvalidRepeatability(_)
            | E::Webhook(_)
            | E::KeyedCallInBatch
            | E::HeaderMismatch(_) => Code::InvalidArgument,
            E::Mismatch { .. }
            | E::NotReplayable
            | E::ReplayUntranslatable(_)
            | E::KeyExpired { .. }
            | E::RepeatabilityRejected(_) => Code::FailedPrecondition,
            E::InFlight { .. } => Code::Aborted,
            E::BodyTooLarge { .. } => Code::ResourceExhausted,
            E::UnsupportedTransferCoding | E::UnsupportedMethod(_) => Code::Unimplemented,
            E::CorruptRecord | E::RecordUnreadable => Code::DataLoss,
            E::Internal => Code::Internal,
            E::UpstreamTimeout | E::BodyTooSlow(_) => Code::DeadlineExceeded,
            E::Upstream
            | E::UpstreamTls
            | E::UpstreamInvalidResponse(_)
            | E::UpstreamBusy
            | E::StoreUnavailable => Code::Unavailable,
        }
    }

    /// Stripe's error type and HTTP status for this answer: `idempotency_error` for the key's
    /// own refusals (a key reused with another request is 400, as Stripe answers it),
    /// `invalid_request_error` for a request the gateway cannot take, `api_error` for the
    /// gateway's, the upstream's and the store's failures.
    fn stripe_type(&self) -> (&'static str, StatusCode) {
        match self {
            Self::Mismatch { .. } => ("idempotency_error", StatusCode::BAD_REQUEST),
            Self::InFlight { .. }
            | Self::NotReplayable
            | Self::KeyExpired { .. }
            | Self::ReplayUntranslatable(_) => ("idempotency_error", self.status()),
            Self::InvalidKey(_)
            | Self::MissingKey
            | Self::InvalidBody
            | Self::InvalidJson(_)
            | Self::InvalidFraming(_)
            | Self::InvalidAuthority(_)
            | Self::InvalidRepeatability(_)
            | Self::Webhook(_)
            | Self::RepeatabilityRejected(_)
            | Self::UnsupportedTransferCoding
            | Self::UnsupportedMethod(_)
            | Self::BodyTooLarge { .. }
            | Self::BodyTooSlow(_)
            | Self::KeyedCallInBatch
            | Self::HeaderMismatch(_) => ("invalid_request_error", self.status()),
            Self::CorruptRecord
            | Self::RecordUnreadable
            | Self::Upstream
            | Self::UpstreamInvalidResponse(_)
            | Self::UpstreamTls
            | Self::UpstreamBusy
            | Self::UpstreamTimeout
            | Self::StoreUnavailable
            | Self::Internal => ("api_error", self.status()),
        }
    }

    /// Stripe's error object: `{"error": {"type", "message", "code"}}`, the code being the
    /// problem kind in Stripe's spelling (`in-flight`: Stripe's own `idempotency_key_in_use`).
    fn stripe(self) -> Response<Body> {
        let (kind, status) = self.stripe_type();
        let code = match self {
            Self::InFlight { .. } => "idempotency_key_in_use".to_string(),
            _ => self.kind().replace('-', "_"),
        };
        let instance = occurrence(self.kind(), status);
        let body = serde_json::json!({
            "error": {
                "type": kind,
                "message": self.to_string(),
                "code": code,
                "instance": instance,
            },
        });
        answer(status, "application/json", &body, self.retry_after())
    }
}

/// Why a delivery was refused: the `reason` label of `idemgate_webhook_rejected_total`, and its
/// problem type (`webhook-signature` or `webhook-timestamp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WebhookRejection {
    /// A header the scheme needs is absent (or repeated).
    Missing(&'static str),
    /// A header is there but does not read as the scheme writes it.
    Malformed(&'static str),
    /// No signature matches any secret.
    Mismatch,
    /// The signed timestamp is older than `webhook_tolerance`.
    Stale,
    /// The signed timestamp is further in the future than `webhook_tolerance`.
    Future,
}

impl WebhookRejection {
    /// Every reason label, for the metric's series.
    pub const REASONS: [&'static str; 5] = ["missing", "malformed", "mismatch", "stale", "future"];

    /// The metric's `reason` label.
    pub fn reason(self) -> &'static str {
        match self {
            WebhookRejection::Missing(_) => "missing",
            WebhookRejection::Malformed(_) => "malformed",
            WebhookRejection::Mismatch => "mismatch",
            WebhookRejection::Stale => "stale",
            WebhookRejection::Future => "future",
        }
    }

    /// Whether it is the timestamp that is refused (`webhook-timestamp`), not the signature.
    pub fn is_timestamp(self) -> bool {
        matches!(self, WebhookRejection::Stale | WebhookRejection::Future)
    }
}

impl std::fmt::Display for WebhookRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WebhookRejection::Missing(what) => write!(f, "the webhook delivery lacks {what}"),
            WebhookRejection::Malformed(what) => write!(f, "the webhook delivery's {what} is malformed"),
            WebhookRejection::Mismatch => f.write_str(
                "no signature of the webhook delivery matches its body and a secret of this endpoint",
            ),
            WebhookRejection::Stale => f.write_str(
                "the webhook delivery's signed timestamp is older than this endpoint's tolerance",
            ),
            WebhookRejection::Future => f.write_str(
                "the webhook delivery's signed timestamp is further in the future than this endpoint's tolerance",
            ),
        }?;
        f.write_str("; nothing was forwarded")
    }
}

/// The error object of the gateway's own JSON-RPC error response, for the call's id to be put in.
#[derive(Debug, Clone)]
pub(crate) struct JsonRpcError(pub(crate) serde_json::Value);

/// An RFC 9457 problem: every answer the gateway and its admin listener give themselves is built
/// here, so they all have the same shape.
#[derive(Debug, Clone)]
pub struct Problem {
    /// The HTTP status.
    pub status: StatusCode,
    /// The stable kind, appended to [`PROBLEM_TYPE_BASE`] to make the `type` URI.
    pub kind: &'static str,
    /// A short summary of the kind.
    pub title: &'static str,
    /// What happened to this request (no internal details).
    pub detail: String,
    /// When set, the `Retry-After` header (rounded up to whole seconds, at least 1).
    pub retry_after: Option<Duration>,
}

impl Problem {
    /// A problem of `kind` with `status`, titled with the status's reason phrase.
    pub fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Problem {
            status,
            kind,
            title: status.canonical_reason().unwrap_or("Error"),
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// The `application/problem+json` response, with an `instance` of its own.
    pub fn into_response(self) -> Response<Body> {
        let body = serde_json::json!({
            "type": format!("{PROBLEM_TYPE_BASE}{}", self.kind),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "instance": occurrence(self.kind, self.status),
        });
        answer(
            self.status,
            "application/problem+json",
            &body,
            self.retry_after,
        )
    }
}

/// A new occurrence of a problem of `kind`: its RFC 9457 `instance`, a `urn:uuid:` unique to it,
/// logged with the problem and recorded on the current span (the request's), so that a client
/// quoting it leads to what happened.
pub fn occurrence(kind: &str, status: StatusCode) -> String {
    let instance = format!("urn:uuid:{}", uuid::Uuid::new_v4());
    tracing::Span::current().record("instance", instance.as_str());
    tracing::info!(%instance, problem = kind, status = status.as_u16(), "answered with a problem");
    instance
}

/// An answer the gateway gives itself: `body` as `content_type` with `status`, and when set, a
/// `Retry-After` of whole seconds (rounded up, at least 1).
fn answer(
    status: StatusCode,
    content_type: &'static str,
    body: &serde_json::Value,
    retry_after: Option<Duration>,
) -> Response<Body> {
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(d) = retry_after {
        let secs = d.as_secs_f64().ceil().max(1.0) as u64;
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

/// A time in ms since the Unix epoch as an HTTP-date.
fn http_date(ms: &u64) -> String {
    crate::time::http_date_ms(*ms).unwrap_or_else(|| "a date after the year 9999".to_string())
}

/// A recorded status, or what stood for it.
fn status_text(status: &Option<StatusCode>) -> String {
    match status {
        Some(s) => s.as_u16().to_string(),
        None => "unknown (the response was too large to keep)".to_string(),
    }
}

impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        Problem::into_response(self)
    }
}

/// The prefix of every problem `type`: `urn:idemgate:problem:mismatch`, `...:in-flight`, etc.
pub const PROBLEM_TYPE_BASE: &str = "urn:idemgate:problem:";

/// A configuration error. Its message always names the field (`routes[1].ttl: ...`).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The path given on the command line.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The TOML did not parse, or a field has the wrong type or an unknown name.
    #[error("invalid config: {0}")]
    Parse(String),
    /// A field parsed but its value is not allowed.
    #[error("invalid config: {field}: {reason}")]
    Invalid {
        /// The dotted path of the field, e.g. `routes[0].ttl`.
        field: String,
        /// Why the value is refused.
        reason: String,
    },
}

impl ConfigError {
    /// A value refused: `field` names it (`routes[1].ttl`), `reason` says why.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// What a panic carried, for the log.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

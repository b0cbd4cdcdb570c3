//! Webhook ingress: on a route with `webhook = "standard" | "stripe" | "github"`, a delivery's
//! signature is checked on its raw body first, as its sender specifies it, and the event's id
//! is its key. A refused delivery is a `400` (`webhook-signature` or `webhook-timestamp`),
//! counted in `idemgate_webhook_rejected_total{route,reason}`: nothing forwarded, no key
//! claimed. Signatures are compared in constant time (`hmac`'s `verify_slice`); every secret
//! of the route is tried, against every signature the delivery carries.

use std::time::{Duration, SystemTime};

use hmac::{Hmac, KeyInit, Mac};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use sha2::Sha256;

use crate::error::{GatewayError, WebhookRejection};
use crate::metrics::Families;
use crate::record::json::{self, Pointer};
use crate::record::key::IdempotencyKey;
use crate::record::policy::Policy;
use crate::record::webhook::{Sender, WebhookSecrets};

/// The header the gateway adds to a verified delivery it forwards (its value: the sender), for
/// the receiver to trust; removed from every request a client sends first.
pub const WEBHOOK_VERIFIED: HeaderName = HeaderName::from_static("idemgate-webhook-verified");

const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
const SVIX_ID: HeaderName = HeaderName::from_static("svix-id");
const SVIX_TIMESTAMP: HeaderName = HeaderName::from_static("svix-timestamp");
const SVIX_SIGNATURE: HeaderName = HeaderName::from_static("svix-signature");
const STRIPE_SIGNATURE: HeaderName = HeaderName::from_static("stripe-signature");
const GITHUB_SIGNATURE: HeaderName = HeaderName::from_static("x-hub-signature-256");
const GITHUB_DELIVERY: HeaderName = HeaderName::from_static("x-github-delivery");

/// The key of a delivery on a webhook route, once its signature is checked (and the header
/// [`WEBHOOK_VERIFIED`] added to it); `Ok(None)` on any other route. A refused delivery is
/// counted on the route.
pub(super) fn event_key(
    metrics: &WebhookMetrics,
    policy: &Policy,
    parts: &mut Parts,
    body: &[u8],
) -> Result<Option<IdempotencyKey>, GatewayError> {
    let (Some(sender), Some(secrets)) = (policy.webhook, &policy.webhook_secrets) else {
        return Ok(None);
    };
    let checked = Delivery {
        headers: &parts.headers,
        body,
    }
    .verify(sender, secrets, policy.webhook_tolerance, SystemTime::now());
    if let Err(rejection) = checked {
        metrics.rejected(&policy.route, rejection);
        return Err(GatewayError::Webhook(rejection));
    }
    let key = event_id(sender, &parts.headers, body, policy.key_max_len)?;
    let verified = HeaderValue::from_static(sender.as_str());
    parts.headers.insert(WEBHOOK_VERIFIED, verified);
    Ok(Some(key))
}

/// The event's id, the key of its deliveries: `webhook-id` (or `svix-id`), a Stripe event's
/// `id`, `X-GitHub-Delivery`.
fn event_id(
    sender: Sender,
    headers: &HeaderMap,
    body: &[u8],
    max_len: usize,
) -> Result<IdempotencyKey, GatewayError> {
    let missing = |what: &str| {
        GatewayError::InvalidKey(format!("the webhook delivery has no {what}, its event id"))
    };
    let names = match sender {
        Sender::Standard => vec![WEBHOOK_ID, SVIX_ID],
        Sender::Github => vec![GITHUB_DELIVERY],
        Sender::Stripe => {
            let doc = json::parse(body).map_err(|e| GatewayError::InvalidJson(e.0))?;
            let id = Pointer::parse("/id").map_err(|_| GatewayError::Internal)?;
            return IdempotencyKey::from_json(&doc, &id, max_len)?
                .ok_or_else(|| missing("\"id\" in its body"));
        }
    };
    IdempotencyKey::from_headers(headers, &names, max_len)?
        .ok_or_else(|| missing(names.first().map_or("", HeaderName::as_str)))
}

/// A delivery as its signature covers it.
struct Delivery<'a> {
    headers: &'a HeaderMap,
    body: &'a [u8],
}

type HmacSha256 = Hmac<Sha256>;

impl Delivery<'_> {
    /// Check the delivery's signature as `sender` writes it, with any of `secrets`, then its
    /// signed timestamp against `now` within `tolerance` either way.
    fn verify(
        &self,
        sender: Sender,
        secrets: &WebhookSecrets,
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<(), WebhookRejection> {
        let timestamp = match sender {
            Sender::Standard => self.standard(secrets)?,
            Sender::Stripe => self.stripe(secrets)?,
            Sender::Github => return self.github(secrets),
        };
        within(timestamp, tolerance, now)
    }

    /// Standard Webhooks: `v1,<base64>` signatures, space-separated, of `id.timestamp.body`.
    fn standard(&self, secrets: &WebhookSecrets) -> Result<u64, WebhookRejection> {
        let (id, ts, sig) = match self.headers.contains_key(WEBHOOK_ID) {
            true => (WEBHOOK_ID, WEBHOOK_TIMESTAMP, WEBHOOK_SIGNATURE),
            false => (SVIX_ID, SVIX_TIMESTAMP, SVIX_SIGNATURE),
        };
        let id = self.one(&id, "a webhook-id header")?;
        let timestamp = self.one(&ts, "a webhook-timestamp header")?;
        let timestamp =
            digits(timestamp).ok_or(WebhookRejection::Malformed("webhook-timestamp"))?;
        let signatures = self.one(&sig, "a webhook-signature header")?;
        let decoded: Vec<Vec<u8>> = signatures
            .split(' ')
            .filter_map(|entry| entry.strip_prefix("v1,"))
            .filter_map(|b64| {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD.decode(b64).ok()
            })
            .collect();
        if decoded.is_empty() {
            return Err(WebhookRejection::Malformed(
                "webhook-signature (no v1 signature)",
            ));
        }
        let prefix = format!("{id}.{timestamp}.");
        matches(secrets, &[prefix.as_bytes(), self.body], &decoded)?;
        Ok(timestamp)
    }

    /// Stripe: `t=<timestamp>` and `v1=<hex>` signatures of `t.body`, read as stripe-python
    /// reads them (items split on `,`, each on its first `=`; the first `t`; every `v1`), but a
    /// timestamp only as plain digits.
    fn stripe(&self, secrets: &WebhookSecrets) -> Result<u64, WebhookRejection> {
        let header = self.one(&STRIPE_SIGNATURE, "a Stripe-Signature header")?;
        let mut timestamp = None;
        let mut decoded = Vec::new();
        for item in header.split(',') {
            let mut parts = item.splitn(3, '=');
            let (key, value) = (parts.next().unwrap_or_default(), parts.next());
            match (key, value) {
                ("t", Some(t)) if timestamp.is_none() => timestamp = Some(t),
                ("v1", Some(hex)) => decoded.extend(hex_lower(hex)),
                ("t" | "v1", None) => {
                    return Err(WebhookRejection::Malformed(
                        "Stripe-Signature (an item without =)",
                    ))
                }
                _ => {}
            }
        }
        let timestamp = timestamp.ok_or(WebhookRejection::Malformed("Stripe-Signature (no t=)"))?;
        let timestamp =
            digits(timestamp).ok_or(WebhookRejection::Malformed("Stripe-Signature (t)"))?;
        if !header.split(',').any(|i| i.starts_with("v1=")) {
            return Err(WebhookRejection::Missing(
                "a v1 signature in Stripe-Signature",
            ));
        }
        let prefix = format!("{timestamp}.");
        matches(secrets, &[prefix.as_bytes(), self.body], &decoded)?;
        Ok(timestamp)
    }

    /// GitHub: `sha256=<hex>` of the body.
    fn github(&self, secrets: &WebhookSecrets) -> Result<(), WebhookRejection> {
        let header = self.one(&GITHUB_SIGNATURE, "an X-Hub-Signature-256 header")?;
        let hex = header
            .strip_prefix("sha256=")
            .ok_or(WebhookRejection::Malformed("X-Hub-Signature-256"))?;
        let decoded: Vec<Vec<u8>> = hex_lower(hex).into_iter().collect();
        matches(secrets, &[self.body], &decoded)
    }

    /// The one value of header `name`, as text.
    fn one(&self, name: &HeaderName, what: &'static str) -> Result<&str, WebhookRejection> {
        let mut values = self.headers.get_all(name).iter();
        match (values.next(), values.next()) {
            (Some(v), None) => v.to_str().map_err(|_| WebhookRejection::Malformed(what)),
            (None, _) => Err(WebhookRejection::Missing(what)),
            (Some(_), Some(_)) => Err(WebhookRejection::Malformed(what)),
        }
    }
}

/// Whether one of `signatures` is the HMAC-SHA256 of the concatenated `parts` under one of
/// `secrets`, each compared in constant time.
fn matches(
    secrets: &WebhookSecrets,
    parts: &[&[u8]],
    signatures: &[Vec<u8>],
) -> Result<(), WebhookRejection> {
    let mut found = false;
    for key in secrets.keys() {
        // HMAC takes a key of any length (RFC 2104: a long one is hashed first).
        let Ok(mut mac) = HmacSha256::new_from_slice(key) else {
            continue;
        };
        for part in parts {
            mac.update(part);
        }
        for signature in signatures {
            // Every pair is compared, so the time taken says nothing of which matched.
            found |= mac.clone().verify_slice(signature).is_ok();
        }
    }
    match found {
        true => Ok(()),
        false => Err(WebhookRejection::Mismatch),
    }
}

/// A timestamp in seconds written as ASCII digits only (no sign, space or `_`).
fn digits(text: &str) -> Option<u64> {
    match !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        true => text.parse().ok(),
        false => None,
    }
}

/// Lower-case hex as bytes (a signature as Stripe and GitHub write it); `None` otherwise.
fn hex_lower(text: &str) -> Option<Vec<u8>> {
    let nibble = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    };
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks_exact(2)
        .map(|pair| match pair {
            [hi, lo] => Some(nibble(*hi)? << 4 | nibble(*lo)?),
            _ => None,
        })
        .collect()
}

/// Whether the signed `timestamp` (seconds) is within `tolerance` of `now`, either way (in
/// milliseconds, so a timestamp exactly `tolerance` old is still accepted, as Stripe's
/// libraries accept it).
fn within(timestamp: u64, tolerance: Duration, now: SystemTime) -> Result<(), WebhookRejection> {
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let at = u128::from(timestamp) * 1000;
    let tolerance = tolerance.as_millis();
    if at + tolerance < now {
        Err(WebhookRejection::Stale)
    } else if at > now + tolerance {
        Err(WebhookRejection::Future)
    } else {
        Ok(())
    }
}

// === impl WebhookMetrics ===

/// The webhook routes' metric family: `idemgate_webhook_rejected_total{route,reason}`.
#[derive(Debug)]
pub(crate) struct WebhookMetrics {
    rejected: Family<RejectedLabels, Counter>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RejectedLabels {
    route: String,
    reason: &'static str,
}

impl Families for WebhookMetrics {
    fn register(registry: &mut Registry) -> Self {
        let rejected = Family::<RejectedLabels, Counter>::default();
        registry.register(
            "idemgate_webhook_rejected",
            "Webhook deliveries refused with 400 before anything was claimed or forwarded, by route and reason (missing, malformed, mismatch: the signature; stale, future: the signed timestamp)",
            rejected.clone(),
        );
        WebhookMetrics { rejected }
    }
}

impl WebhookMetrics {
    /// Count a delivery on `route` refused for `rejection`.
    fn rejected(&self, route: &str, rejection: WebhookRejection) {
        let labels = RejectedLabels {
            route: route.to_string(),
            reason: rejection.reason(),
        };
        self.rejected.get_or_create(&labels).inc();
    }

    /// Start the series of a webhook `route` at zero.
    pub(crate) fn route(&self, route: &str) {
        for reason in WebhookRejection::REASONS {
            let route = route.to_string();
            drop(
                self.rejected
                    .get_or_create(&RejectedLabels { route, reason }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secrets(sender: Sender, text: &str) -> WebhookSecrets {
        WebhookSecrets::parse(sender, text).unwrap()
    }

    fn hmac_hex(key: &[u8], parts: &[&[u8]]) -> String {
        let mut mac = HmacSha256::new_from_slice(key).unwrap();
        for p in parts {
            mac.update(p);
        }
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn check(
        sender: Sender,
        s: &WebhookSecrets,
        headers: &[(&str, &str)],
        body: &[u8],
        now: u64,
    ) -> Result<(), WebhookRejection> {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        Delivery {
            headers: &map,
            body,
        }
        .verify(sender, s, Duration::from_secs(300), at(now))
    }

    #[test]
    fn stripe_signatures_as_stripe_python_reads_them() {
        let s = secrets(Sender::Stripe, "whsec_old whsec_new");
        let sig = hmac_hex(b"whsec_new", &[b"1000.", b"{}"]);
        let ok = format!("t=1000,v1={sig}");
        assert_eq!(
            check(
                Sender::Stripe,
                &s,
                &[("stripe-signature", &ok)],
                b"{}",
                1000
            ),
            Ok(())
        );
        // Several v1, one good; a v0 beside it; leading zeros in t sign the number.
        let many = format!("t=01000,v1={},v1={sig},v0=ab", "0".repeat(64));
        assert_eq!(
            check(
                Sender::Stripe,
                &s,
                &[("stripe-signature", &many)],
                b"{}",
                1100
            ),
            Ok(())
        );
        assert_eq!(
            check(
                Sender::Stripe,
                &s,
                &[("stripe-signature", &ok)],
                b"{ }",
                1000
            ),
            Err(WebhookRejection::Mismatch)
        );
        assert_eq!(
            check(
                Sender::Stripe,
                &s,
                &[("stripe-signature", &ok)],
                b"{}",
                1301
            ),
            Err(WebhookRejection::Stale)
        );
        assert_eq!(
            check(
                Sender::Stripe,
                &s,
                &[("stripe-signature", &ok)],
                b"{}",
                1300
            ),
            Ok(())
        );
        assert_eq!(
            check(Sender::Stripe, &s, &[("stripe-signature", &ok)], b"{}", 699),
            Err(WebhookRejection::Future)
        );
        let upper = format!("t=1000,v1={}", sig.to_uppercase());
        assert_eq!(
            check(
                Sender::Stripe,
                &s,
                &[("stripe-signature", &upper)],
                b"{}",
                1000
            ),
            Err(WebhookRejection::Mismatch)
        );
        for bad in [
            format!("t= 1000,v1={sig}"),
            format!("t=+1000,v1={sig}"),
            format!("v1={sig}"),
            "t=1000,v1".to_string(),
        ] {
            assert!(
                matches!(
                    check(
                        Sender::Stripe,
                        &s,
                        &[("stripe-signature", &bad)],
                        b"{}",
                        1000
                    ),
                    Err(WebhookRejection::Malformed(_))
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            check(Sender::Stripe, &s, &[], b"{}", 1000),
            Err(WebhookRejection::Missing(_))
        ));
        assert!(matches!(
            check(
                Sender::Stripe,
                &s,
                &[("stripe-signature", "t=1000")],
                b"{}",
                1000
            ),
            Err(WebhookRejection::Missing(_))
        ));
    }

    #[test]
    fn standard_signatures_with_svix_headers_too() {
        let key = b"0123456789abcdef0123456789abcdef";
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let s = secrets(Sender::Standard, &format!("whsec_{}", b64.encode(key)));
        let mut mac = HmacSha256::new_from_slice(key).unwrap();
        mac.update(b"msg_1.1000.{}");
        let sig = b64.encode(mac.finalize().into_bytes());
        let sigs = format!("v1,{} v1a,xyz v1,{sig}", b64.encode([0u8; 32]));
        for (id, ts, signature) in [
            ("webhook-id", "webhook-timestamp", "webhook-signature"),
            ("svix-id", "svix-timestamp", "svix-signature"),
        ] {
            let headers = [(id, "msg_1"), (ts, "1000"), (signature, sigs.as_str())];
            assert_eq!(check(Sender::Standard, &s, &headers, b"{}", 1000), Ok(()));
            assert_eq!(
                check(Sender::Standard, &s, &headers, b"{} ", 1000),
                Err(WebhookRejection::Mismatch)
            );
            assert!(matches!(
                check(Sender::Standard, &s, &headers[..2], b"{}", 1000),
                Err(WebhookRejection::Missing(_))
            ));
        }
        assert!(WebhookSecrets::parse(Sender::Standard, "whsec_!!!").is_err());
        assert!(WebhookSecrets::parse(Sender::Stripe, " , ").is_err());
        assert_eq!(format!("{s:?}"), "<1 redacted>");
    }

    #[test]
    fn github_signature_of_the_body() {
        let s = secrets(Sender::Github, "its-a-secret");
        let sig = format!("sha256={}", hmac_hex(b"its-a-secret", &[b"payload"]));
        assert_eq!(
            check(
                Sender::Github,
                &s,
                &[("x-hub-signature-256", &sig)],
                b"payload",
                0
            ),
            Ok(())
        );
        assert_eq!(
            check(
                Sender::Github,
                &s,
                &[("x-hub-signature-256", &sig)],
                b"payloaD",
                0
            ),
            Err(WebhookRejection::Mismatch)
        );
        assert!(matches!(
            check(
                Sender::Github,
                &s,
                &[("x-hub-signature-256", "sha1=ab")],
                b"payload",
                0
            ),
            Err(WebhookRejection::Malformed(_))
        ));
    }

    /// A library user's policy: the builder's `webhook`, the layer over a `service_fn`.
    #[tokio::test]
    async fn the_layer_verifies_a_delivery_then_runs_its_event_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;

        use axum::body::Body;
        use http::{Request, Response, StatusCode};
        use tower::{Layer, ServiceExt};

        use crate::record::policy::Ttl;
        use crate::record::webhook::WEBHOOK_TTL;

        let secrets = secrets(Sender::Github, "its-a-secret");
        let policy = Policy::builder()
            .webhook(Sender::Github, secrets)
            .build()
            .unwrap();
        assert_eq!(policy.ttl, Ttl::For(WEBHOOK_TTL));
        let layer = super::super::IdempotencyLayer::new(crate::MemoryStore::new(), policy);
        let calls = Arc::new(AtomicUsize::new(0));
        let inner = {
            let calls = calls.clone();
            tower::service_fn(move |req: Request<Body>| {
                let calls = calls.clone();
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let mark = req.headers().get(WEBHOOK_VERIFIED).cloned();
                    assert_eq!(mark.unwrap(), "github");
                    Ok::<_, std::convert::Infallible>(Response::new(Body::from("ok")))
                }
            })
        };
        let service = layer.layer(inner);
        let delivery = |signature: &str| {
            Request::post("/hooks")
                .header("x-hub-signature-256", signature)
                .header("x-github-delivery", "d-1")
                .header(WEBHOOK_VERIFIED, "github")
                .body(Body::from("payload"))
                .unwrap()
        };
        let good = format!("sha256={}", hmac_hex(b"its-a-secret", &[b"payload"]));
        let first = service.clone().oneshot(delivery(&good)).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let again = service.clone().oneshot(delivery(&good)).await.unwrap();
        assert!(again
            .headers()
            .contains_key(super::super::IDEMPOTENT_REPLAYED));
        let forged = format!("sha256={}", hmac_hex(b"not-it", &[b"payload"]));
        let refused = service.clone().oneshot(delivery(&forged)).await.unwrap();
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn timestamps_far_out_do_not_overflow() {
        assert_eq!(within(u64::MAX, Duration::MAX, at(0)), Ok(()));
        assert_eq!(
            within(u64::MAX, Duration::from_secs(1), at(0)),
            Err(WebhookRejection::Future)
        );
        assert_eq!(
            within(0, Duration::from_secs(1), at(10)),
            Err(WebhookRejection::Stale)
        );
    }
}

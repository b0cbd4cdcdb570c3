//! The words of a webhook route: who signs its deliveries ([`Sender`]), the secrets they are
//! signed with ([`WebhookSecrets`], never printed), and why a delivery is refused
//! (`WebhookRejection`, in `error.rs`, as the gateway's own answers name it). The engine checks a delivery with them (`idempotency/webhook.rs`).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde::Deserialize;

/// How long a webhook route keeps an event's record at least, unless the route sets its own
/// `ttl`: past the longest retry horizon of the senders (Stripe retries for 3 days, Standard
/// Webhooks' schedule ends after 75 h 35 min).
pub const WEBHOOK_TTL: Duration = Duration::from_secs(76 * 3600);

/// The sender whose signature scheme a webhook route checks (`webhook = "..."`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Sender {
    /// Standard Webhooks (and Svix): `webhook-id`, `webhook-timestamp`, `webhook-signature`
    /// (or their `svix-` twins), HMAC-SHA256 with the base64 secret after `whsec_`.
    Standard,
    /// Stripe: `Stripe-Signature: t=..,v1=..`, HMAC-SHA256 over `t.body` with the whole secret.
    Stripe,
    /// GitHub: `X-Hub-Signature-256: sha256=<hex>` over the body; no timestamp.
    Github,
}

impl Sender {
    /// The name as written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Sender::Standard => "standard",
            Sender::Stripe => "stripe",
            Sender::Github => "github",
        }
    }
}

/// The secrets a webhook route's deliveries may be signed with (several during a rotation), as
/// the sender's scheme keys its HMAC: never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecrets(Arc<[Vec<u8>]>);

impl WebhookSecrets {
    /// The secrets in `text` (separated by spaces or commas) as `sender` uses them: a Standard
    /// Webhooks secret is the base64 after an optional `whsec_`; Stripe's and GitHub's are
    /// their bytes as written. The reason never repeats a secret.
    pub fn parse(sender: Sender, text: &str) -> Result<Self, String> {
        let words: Vec<&str> = text
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|w| !w.is_empty())
            .collect();
        if words.is_empty() {
            return Err("holds no secret".into());
        }
        let keys = words
            .iter()
            .enumerate()
            .map(|(i, word)| match sender {
                Sender::Standard => {
                    let b64 = word.strip_prefix("whsec_").unwrap_or(word);
                    match base64::engine::general_purpose::STANDARD.decode(b64) {
                        Ok(key) if !key.is_empty() => Ok(key),
                        _ => Err(format!(
                            "holds a secret ({} of {}) that is not base64 (a Standard Webhooks secret is whsec_ and the base64 of the key)",
                            i + 1,
                            words.len()
                        )),
                    }
                }
                Sender::Stripe | Sender::Github => Ok(word.as_bytes().to_vec()),
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(WebhookSecrets(keys.into()))
    }

    /// The HMAC keys, one per secret.
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.0.iter().map(Vec::as_slice)
    }

    /// How many secrets there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is none (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for WebhookSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<{} redacted>", self.0.len())
    }
}

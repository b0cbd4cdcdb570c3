//! Webhook ingress with the senders' own libraries signing the deliveries (standardwebhooks,
//! svix and stripe-python, installed from PyPI into a venv of the tests' own; GitHub's scheme
//! as its documentation computes it): a verified delivery runs once and its re-signed duplicate
//! is replayed, a refused one reaches nothing and claims nothing, a failed one runs again,
//! secrets rotate, and the gateway accepts exactly the Stripe deliveries stripe-python's
//! `WebhookSignature.verify_header` accepts (but for timestamps in the future). On every backend.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::{send, Backend, GatewayConfig, Seen, TestEnv};
use serde_json::{json, Value};
use testkit::PythonEnv;
use toml::toml;

/// The senders' libraries, pinned.
const PACKAGES: &[&str] = &["standardwebhooks==1.1.0", "svix==2.9.1", "stripe==16.1.0"];

/// Standard Webhooks secrets: `whsec_` and the base64 of the key.
const STANDARD_A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const STANDARD_B: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const STANDARD_C: &str = "whsec_dGhpcyBrZXkgaXMgbm90IHRoZSBnYXRld2F5J3M=";
const STRIPE_OLD: &str = "whsec_stripe_old_0123456789";
const STRIPE_NEW: &str = "whsec_stripe_new_9876543210";
const GITHUB: &str = "its-a-secret-to-everybody";

/// Signs deliveries as each sender's library does: argv[1] is a JSON list of
/// `{sender, secrets, id, body, ts}`; prints the headers of each.
const SIGN: &str = r#"
import hashlib, hmac, json, sys
from datetime import datetime, timezone
import stripe
import standardwebhooks.webhooks as standard
import svix.webhooks as svix

out = []
for s in json.loads(sys.argv[1]):
    kind, body, ts, msg_id = s["sender"], s["body"], s["ts"], s["id"]
    when = datetime.fromtimestamp(ts, tz=timezone.utc)
    if kind in ("standard", "svix"):
        lib = standard if kind == "standard" else svix
        sigs = " ".join(lib.Webhook(secret).sign(msg_id, when, body) for secret in s["secrets"])
        prefix = "webhook" if kind == "standard" else "svix"
        h = {prefix + "-id": msg_id, prefix + "-timestamp": str(ts), prefix + "-signature": sigs}
    elif kind == "stripe":
        sigs = ",".join("v1=" + stripe.WebhookSignature._compute_signature("%d.%s" % (ts, body), secret)
                        for secret in s["secrets"])
        h = {"stripe-signature": "t=%d,%s" % (ts, sigs)}
    else:
        sig = hmac.new(s["secrets"][0].encode(), body.encode(), hashlib.sha256).hexdigest()
        h = {"x-hub-signature-256": "sha256=" + sig, "x-github-delivery": msg_id}
    out.append(h)
print(json.dumps(out))
"#;

/// The webhook routes, their secrets in the gateway's environment, and a plain route beside.
fn config() -> GatewayConfig {
    GatewayConfig::new()
        .admin()
        .route(
            "/hooks/stripe",
            toml! { webhook = "stripe" webhook_secret_env = "WH_STRIPE" },
        )
        .route(
            "/hooks/standard",
            toml! { webhook = "standard" webhook_secret_env = "WH_STANDARD" },
        )
        .route(
            "/hooks/github",
            toml! { webhook = "github" webhook_secret_env = "WH_GITHUB" },
        )
        .env("WH_STRIPE", &format!("{STRIPE_OLD}, {STRIPE_NEW}"))
        .env("WH_STANDARD", &format!("{STANDARD_A} {STANDARD_B}"))
        .env("WH_GITHUB", GITHUB)
}

/// The venv with the senders' libraries (made once per target directory).
async fn senders() -> Arc<PythonEnv> {
    let root = env!("CARGO_TARGET_TMPDIR");
    let env = tokio::task::spawn_blocking(move || {
        PythonEnv::with_packages(root.as_ref(), "webhook-senders", PACKAGES)
    });
    Arc::new(env.await.unwrap())
}

/// Run `script` with `args` in the venv; its stdout read as JSON.
async fn python(env: &Arc<PythonEnv>, script: &'static str, args: Vec<String>) -> Value {
    let env = env.clone();
    let out = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        env.run(script, &args)
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// One delivery to sign: `sender` (`standard`, `svix`, `stripe`, `github`), the secrets it
/// signs with, the event id, the body, the timestamp.
fn spec(sender: &str, secrets: &[&str], id: &str, body: &str, ts: i64) -> Value {
    json!({ "sender": sender, "secrets": secrets, "id": id, "body": body, "ts": ts })
}

/// A signed delivery, ready to send.
#[derive(Clone, Debug)]
struct Delivery {
    headers: Vec<(String, String)>,
    body: String,
}

impl Delivery {
    /// The same delivery with another body (its signature left as it was).
    fn tampered(mut self, body: &str) -> Self {
        self.body = body.to_string();
        self
    }

    /// The same delivery without header `name`.
    fn without(mut self, name: &str) -> Self {
        self.headers.retain(|(n, _)| n != name);
        self
    }

    /// Send it to `path` through the gateway of `env`.
    async fn to(&self, env: &TestEnv, path: &str) -> Seen {
        let mut req = env
            .post(path)
            .header("content-type", "application/json")
            .body(self.body.clone());
        for (name, value) in &self.headers {
            req = req.header(name.as_str(), value.as_str());
        }
        send(req).await
    }
}

/// Sign `specs` with the senders' libraries.
async fn sign(env: &Arc<PythonEnv>, specs: Vec<Value>) -> Vec<Delivery> {
    let bodies: Vec<String> = specs
        .iter()
        .map(|s| s["body"].as_str().unwrap().to_string())
        .collect();
    let signed = python(env, SIGN, vec![Value::from(specs).to_string()]).await;
    signed
        .as_array()
        .unwrap()
        .iter()
        .zip(bodies)
        .map(|(headers, body)| Delivery {
            headers: headers
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect(),
            body,
        })
        .collect()
}

/// An event's body, with its id (Stripe's deliveries are keyed by it).
fn event(id: &str) -> String {
    json!({ "id": id, "object": "event", "type": "invoice.paid", "data": { "amount": 4200 } })
        .to_string()
}

/// A refusal of the gateway's own: 400 problem+json of `kind`.
fn refused(seen: &Seen, kind: &str) {
    assert_eq!(seen.status, 400, "{seen:?}");
    assert_eq!(
        seen.problem_type(),
        format!("urn:idemgate:problem:{kind}"),
        "{seen:?}"
    );
}

async fn rejected(env: &TestEnv, route: &str, reason: &str) -> f64 {
    let series =
        format!("idemgate_webhook_rejected_total{{route=\"{route}\",reason=\"{reason}\"}}");
    env.gateway.metric(&series).await
}

on_both_backends!(
    each_senders_delivery_runs_once_and_its_resigned_duplicate_is_replayed,
    a_refused_delivery_is_400_reaches_nothing_and_claims_nothing,
    a_failed_delivery_runs_again_and_concurrent_duplicates_run_once,
    rotated_secrets_and_several_signatures_are_accepted,
);

/// Per sender, a delivery and its duplicate signed again a second later: the receiver gets
/// the first, with its headers unchanged and the gateway's mark of verification; the duplicate
/// gets the recorded answer, replayed. Svix's headers key the same event as Standard Webhooks'.
async fn each_senders_delivery_runs_once_and_its_resigned_duplicate_is_replayed(b: Backend) {
    let py = senders().await;
    let env = TestEnv::start(b, config()).await;
    let t = now();
    let cases = [
        ("stripe", STRIPE_NEW, "/hooks/stripe", "evt_1"),
        ("standard", STANDARD_A, "/hooks/standard", "msg_1"),
        ("svix", STANDARD_B, "/hooks/standard", "msg_2"),
        (
            "github",
            GITHUB,
            "/hooks/github",
            "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        ),
    ];
    let mut specs = Vec::new();
    for (sender, secret, _, id) in cases {
        specs.push(spec(sender, &[secret], id, &event(id), t));
        specs.push(spec(sender, &[secret], id, &event(id), t + 1));
    }
    let signed = sign(&py, specs).await;
    for (i, (sender, _, path, _)) in cases.iter().enumerate() {
        let (first, again) = (&signed[2 * i], &signed[2 * i + 1]);
        let seen = first.to(&env, path).await;
        assert_eq!(seen.status, 201, "{sender}: {seen:?}");
        assert!(!seen.replayed());
        assert_eq!(env.upstream.calls(), i + 1, "{sender}");
        let forwarded = env.upstream.last_headers();
        let verified = if *sender == "svix" {
            "standard"
        } else {
            sender
        };
        assert_eq!(forwarded["idemgate-webhook-verified"], verified);
        for (name, value) in &first.headers {
            assert_eq!(forwarded[name.as_str()], value.as_str(), "{sender}: {name}");
        }
        let replay = again.to(&env, path).await;
        assert!(replay.replayed(), "{sender}: {replay:?}");
        assert_eq!(replay.body, seen.body);
        assert_eq!(
            env.upstream.calls(),
            i + 1,
            "{sender}: the duplicate ran nothing"
        );
    }
    // The same event through Svix's headers is a duplicate of the Standard Webhooks one.
    let svix = sign(
        &py,
        vec![spec("svix", &[STANDARD_A], "msg_1", &event("msg_1"), t + 2)],
    );
    assert!(svix.await[0].to(&env, "/hooks/standard").await.replayed());
    assert_eq!(env.upstream.calls(), cases.len());
}

/// A tampered body, a wrong secret, missing headers, a stale or a future timestamp: `400`
/// problem+json, nothing forwarded, counted by reason; the event's key stays free, so its
/// genuine delivery then runs.
async fn a_refused_delivery_is_400_reaches_nothing_and_claims_nothing(b: Backend) {
    let py = senders().await;
    let env = TestEnv::start(b, config()).await;
    let t = now();
    let routes = [
        (
            "stripe",
            STRIPE_OLD,
            "whsec_not_the_secret",
            "/hooks/stripe",
        ),
        ("standard", STANDARD_A, STANDARD_C, "/hooks/standard"),
        ("github", GITHUB, "not-the-secret", "/hooks/github"),
    ];
    for (sender, secret, wrong, path) in routes {
        let runs = env.upstream.calls();
        let id = format!("evt_refused_{sender}");
        let body = event(&id);
        let signed = sign(
            &py,
            vec![
                spec(sender, &[secret], &id, &body, t),
                spec(sender, &[wrong], &id, &body, t),
                spec(sender, &[secret], &id, &body, t - 600),
                spec(sender, &[secret], &id, &body, t + 600),
            ],
        )
        .await;
        let genuine = signed[0].clone();
        let tampered = genuine.clone().tampered(&body.replace("4200", "4201"));
        refused(&tampered.to(&env, path).await, "webhook-signature");
        refused(&signed[1].to(&env, path).await, "webhook-signature");
        for (name, _) in &genuine.headers {
            if name == "x-github-delivery" {
                continue;
            }
            let without = genuine.clone().without(name);
            refused(&without.to(&env, path).await, "webhook-signature");
        }
        if sender != "github" {
            refused(&signed[2].to(&env, path).await, "webhook-timestamp");
            refused(&signed[3].to(&env, path).await, "webhook-timestamp");
            assert_eq!(rejected(&env, path, "stale").await, 1.0, "{sender}");
            assert_eq!(rejected(&env, path, "future").await, 1.0, "{sender}");
        }
        assert_eq!(env.upstream.calls(), runs, "{sender}: nothing forwarded");
        assert!(rejected(&env, path, "mismatch").await >= 1.0, "{sender}");
        assert!(rejected(&env, path, "missing").await >= 1.0, "{sender}");
        // No key was claimed: the genuine delivery runs.
        let seen = genuine.to(&env, path).await;
        assert_eq!(seen.status, 201, "{sender}: {seen:?}");
        assert!(!seen.replayed());
        assert!(genuine.to(&env, path).await.replayed());
        assert_eq!(env.upstream.calls(), runs + 1, "{sender}");
    }
    // GitHub's delivery without its event id is authentic but cannot be keyed: refused.
    let body = event("no-id");
    let signed = sign(&py, vec![spec("github", &[GITHUB], "x", &body, t)]).await;
    let no_id = signed[0].clone().without("x-github-delivery");
    let seen = no_id.to(&env, "/hooks/github").await;
    assert_eq!(seen.status, 400, "{seen:?}");
    assert_eq!(env.upstream.calls(), routes.len());
}

/// Only a 2xx is recorded: after the receiver's 500, and its 400, the sender's retry runs
/// again; a duplicate while the first is in flight gets a non-2xx with `Retry-After`, so the
/// sender retries later, and the event runs once.
async fn a_failed_delivery_runs_again_and_concurrent_duplicates_run_once(b: Backend) {
    let py = senders().await;
    let env = TestEnv::start(b, config()).await;
    let t = now();
    let specs = (0..4)
        .map(|i| {
            spec(
                "stripe",
                &[STRIPE_NEW],
                "evt_fail",
                &event("evt_fail"),
                t + i,
            )
        })
        .collect();
    let signed = sign(&py, specs).await;
    let failed = signed[0].to(&env, "/hooks/stripe?status=500").await;
    assert_eq!(failed.status, 500);
    let refused_by_receiver = signed[1].to(&env, "/hooks/stripe?status=400").await;
    assert_eq!(refused_by_receiver.status, 400);
    let ran = signed[2].to(&env, "/hooks/stripe").await;
    assert_eq!(ran.status, 201, "{ran:?}");
    assert_eq!(env.upstream.calls(), 3, "each retry after a non-2xx ran");
    assert!(signed[3].to(&env, "/hooks/stripe").await.replayed());
    assert_eq!(env.upstream.calls(), 3);

    let specs = (0..3)
        .map(|i| {
            spec(
                "standard",
                &[STANDARD_B],
                "msg_slow",
                &event("msg_slow"),
                t + i,
            )
        })
        .collect();
    let signed = sign(&py, specs).await;
    let path = "/hooks/standard?delay_ms=1000";
    let first = tokio::spawn({
        let (d, env_url) = (signed[0].clone(), env.url(path));
        async move {
            let mut req = common::client()
                .post(env_url)
                .header("content-type", "application/json")
                .body(d.body.clone());
            for (n, v) in &d.headers {
                req = req.header(n.as_str(), v.as_str());
            }
            send(req).await
        }
    });
    env.upstream.wait_for_calls(4).await;
    let duplicate = signed[1].to(&env, path).await;
    assert!(!(200..300).contains(&duplicate.status), "{duplicate:?}");
    assert!(duplicate.header("retry-after").is_some(), "{duplicate:?}");
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert!(signed[2].to(&env, path).await.replayed());
    assert_eq!(env.upstream.calls(), 4, "the event ran once");
}

/// Two secrets during a rotation are both accepted, a third is not; a delivery signed with
/// several secrets (Standard Webhooks' space-separated signatures, Stripe's several `v1`) is
/// accepted when one of them is the route's.
async fn rotated_secrets_and_several_signatures_are_accepted(b: Backend) {
    let py = senders().await;
    let env = TestEnv::start(b, config()).await;
    let t = now();
    let cases: [(&str, &[&str], &str, bool); 8] = [
        ("standard", &[STANDARD_A], "/hooks/standard", true),
        ("standard", &[STANDARD_B], "/hooks/standard", true),
        ("standard", &[STANDARD_C], "/hooks/standard", false),
        (
            "standard",
            &[STANDARD_C, STANDARD_B],
            "/hooks/standard",
            true,
        ),
        ("stripe", &[STRIPE_OLD], "/hooks/stripe", true),
        ("stripe", &[STRIPE_NEW], "/hooks/stripe", true),
        ("stripe", &["whsec_stripe_next"], "/hooks/stripe", false),
        (
            "stripe",
            &["whsec_stripe_next", STRIPE_OLD],
            "/hooks/stripe",
            true,
        ),
    ];
    let specs = cases
        .iter()
        .enumerate()
        .map(|(i, (sender, secrets, _, _))| {
            let id = format!("evt_rot_{i}");
            spec(sender, secrets, &id, &event(&id), t)
        })
        .collect();
    let signed = sign(&py, specs).await;
    let mut runs = 0;
    for ((sender, secrets, path, accepted), delivery) in cases.iter().zip(&signed) {
        let seen = delivery.to(&env, path).await;
        if *accepted {
            runs += 1;
            assert_eq!(seen.status, 201, "{sender} {secrets:?}: {seen:?}");
        } else {
            refused(&seen, "webhook-signature");
        }
        assert_eq!(env.upstream.calls(), runs, "{sender} {secrets:?}");
    }
}

/// Generates Stripe deliveries, valid and tampered in the ways a header can be, and says of
/// each whether stripe-python's `WebhookSignature.verify_header` accepts it (tolerance 300 s,
/// the gateway's default `webhook_tolerance`). argv: seed, count, secret.
const STRIPE_DIFFERENTIAL: &str = r#"
import json, random, sys, time
import stripe

rng = random.Random(int(sys.argv[1]))
n, secret = int(sys.argv[2]), sys.argv[3]
now = int(time.time())
sign = lambda ts, body, key=secret: stripe.WebhookSignature._compute_signature("%d.%s" % (ts, body), key)
out = []
for i in range(n):
    body = json.dumps({"id": "evt_diff_%d" % i, "object": "event",
                       "data": {"amount": rng.randint(1, 10**6), "note": rng.choice(["", "é", "a,b=c"])}})
    ts = now + rng.choice([0, -60, -200, 60, 200])
    sig = sign(ts, body)
    case = rng.randrange(18)
    header, sent, future = "t=%d,v1=%s" % (ts, sig), body, False
    if case == 1: sent = body.replace("amount", "amounT")
    elif case == 2: header = "t=%d,v1=%s" % (ts, sign(ts, body, secret + "x"))
    elif case == 3: header = "t=%d,v1=%s" % (ts, sig.upper())
    elif case == 4: header = "t=%d,v1=%s" % (ts, sig[:-2])
    elif case == 5: header = "t=%d,v1=%s,v1=%s" % (ts, "0" * 64, sig)
    elif case == 6: header = "t=%d,v0=%s" % (ts, sig)
    elif case == 7: header = "v1=%s" % sig
    elif case == 8: header = "t=%d,t=%d,v1=%s" % (ts + 1, ts, sig)
    elif case == 9:
        old = now - 1000
        header = "t=%d,v1=%s" % (old, sign(old, body))
    elif case == 10: header = "t=%d, v1=%s" % (ts, sig)
    elif case == 11: header = "t=0%d,v1=%s" % (ts, sig)
    elif case == 12: header = "t=%d,v1=%s=extra" % (ts, sig)
    elif case == 13: header = "t=%d,v1=%s,v1" % (ts, sig)
    elif case == 14: header = ""
    elif case == 15: header = "t=%d,v1=%s,t=%d" % (ts, sig, ts + 5)
    elif case == 16:
        later = now + 1000
        header, future = "t=%d,v1=%s" % (later, sign(later, body)), True
    elif case == 17: header = "v1=%s,t=%d,v1=%s" % ("ab" * 32, ts, sig)
    try:
        accepted = bool(stripe.WebhookSignature.verify_header(sent, header, secret, tolerance=300))
    except Exception:
        accepted = False
    out.append({"body": sent, "header": header, "accepted": accepted, "future": future, "case": case})
print(json.dumps(out))
"#;

/// The gateway accepts exactly the Stripe deliveries stripe-python accepts, over a few hundred
/// generated ones, except a timestamp further in the future than the tolerance, which it
/// refuses and stripe-python does not check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_deliveries_are_accepted_exactly_as_stripe_python_accepts_them() {
    let py = senders().await;
    let config = GatewayConfig::new()
        .route(
            "/hooks/stripe",
            toml! { webhook = "stripe" webhook_secret_env = "WH_STRIPE" },
        )
        .env("WH_STRIPE", STRIPE_NEW);
    let env = TestEnv::start(Backend::Memory, config).await;
    let args = vec!["34".to_string(), "300".to_string(), STRIPE_NEW.to_string()];
    let generated = python(&py, STRIPE_DIFFERENTIAL, args).await;
    let generated = generated.as_array().unwrap();
    let (mut accepted, mut refused_count) = (0, 0);
    for d in generated {
        let header = d["header"].as_str().unwrap();
        let body = d["body"].as_str().unwrap().to_string();
        let seen = send(
            env.post("/hooks/stripe")
                .header("stripe-signature", header)
                .body(body),
        )
        .await;
        let python_accepts = d["accepted"].as_bool().unwrap();
        let expected = python_accepts && !d["future"].as_bool().unwrap();
        let gateway_accepts = seen.status == 201;
        if !gateway_accepts {
            assert_eq!(seen.status, 400, "{d}: {seen:?}");
            assert!(seen.problem_type().contains("webhook-"), "{d}: {seen:?}");
        }
        assert_eq!(
            gateway_accepts, expected,
            "case {}: {d}\n{seen:?}",
            d["case"]
        );
        if expected {
            accepted += 1;
        } else {
            refused_count += 1;
        }
    }
    assert!(
        accepted > 50 && refused_count > 100,
        "{accepted} accepted, {refused_count} refused"
    );
    assert_eq!(env.upstream.calls(), accepted);
}

/// A route without `webhook` beside the webhook routes is untouched, and the gateway's mark of
/// a verified delivery, sent by a client, never reaches a receiver: on a plain route as on a
/// webhook route, where the mark says what the gateway checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_without_webhook_is_unaffected_and_the_mark_is_the_gateways_own() {
    let env = TestEnv::start(Backend::Memory, config()).await;
    let post = || {
        env.post_keyed("/v1/p", "k1")
            .header("idemgate-webhook-verified", "stripe")
            .body("x")
    };
    let first = send(post()).await;
    assert_eq!(first.status, 201);
    let forwarded = env.upstream.last_headers();
    assert!(forwarded.get("idemgate-webhook-verified").is_none());
    assert!(send(post()).await.replayed());
    // Unkeyed and without a signature: a plain route passes it on.
    let plain = send(env.post("/v1/other").body("x")).await;
    assert_eq!(plain.status, 201);
    // A forged mark on a webhook route gets no further than the signature check.
    let forged = send(
        env.post("/hooks/github")
            .header("idemgate-webhook-verified", "github")
            .header("x-github-delivery", "d1")
            .body("x"),
    )
    .await;
    refused(&forged, "webhook-signature");
    assert_eq!(env.upstream.calls(), 2);
}

/// A webhook route's configuration: the secret's variable unset or empty, or not named, is an
/// error naming the field, whose text never holds the secret; the `ttl` defaults to the
/// senders' retry horizon; `check-config` shows the secrets redacted.
#[test]
fn config_errors_name_the_field_and_never_show_the_secret() {
    use idemgate::config::{Config, Secrets};
    let text = |route: &str| {
        format!("upstream = \"http://127.0.0.1:9\"\n[[routes]]\npath = \"/hooks\"\n{route}\n")
    };
    let load = |route: &str, vars: &[(String, String)]| {
        let mut secrets = Secrets::default();
        secrets.vars = Some(vars);
        Config::from_toml_with_secrets(&text(route), secrets)
    };
    let var = |v: &str| vec![("HOOK_SECRET".to_string(), v.to_string())];
    let stripe = "webhook = \"stripe\"\nwebhook_secret_env = \"HOOK_SECRET\"";
    type Vars = Vec<(String, String)>;
    let cases: [(&str, Vars, &str); 6] = [
        (stripe, vec![], "routes[0].webhook_secret_env"),
        (stripe, var("  "), "routes[0].webhook_secret_env"),
        (
            "webhook = \"stripe\"",
            var("whsec_x"),
            "routes[0].webhook_secret_env",
        ),
        ("webhook = \"paypal\"", var("whsec_x"), "routes[0].webhook"),
        (
            "webhook_secret_env = \"HOOK_SECRET\"",
            var("whsec_x"),
            "routes[0].webhook_secret_env",
        ),
        (
            "webhook = \"standard\"\nwebhook_secret_env = \"HOOK_SECRET\"",
            var("whsec_!!not-base64-secret!!"),
            "routes[0].webhook_secret_env",
        ),
    ];
    for (route, vars, field) in cases {
        let e = load(route, &vars).unwrap_err().to_string();
        assert!(e.contains(field), "{route}: {e}");
        assert!(!e.contains("not-base64-secret"), "{e}");
    }
    let zero = format!("{stripe}\nwebhook_tolerance = \"0s\"");
    assert!(load(&zero, &var("whsec_x"))
        .unwrap_err()
        .to_string()
        .contains("webhook_tolerance"));

    let config = load(stripe, &var("whsec_a whsec_b")).unwrap();
    let policy = &config.routes[0].policy;
    assert_eq!(
        policy.ttl,
        idemgate::record::policy::Ttl::For(Duration::from_secs(76 * 3600))
    );
    assert_eq!(policy.webhook_secrets.as_ref().unwrap().len(), 2);
    assert!(!format!("{config:?}").contains("whsec_a"));
    let own = load(&format!("{stripe}\nttl = \"1h\""), &var("whsec_a")).unwrap();
    assert_eq!(
        own.routes[0].policy.ttl,
        idemgate::record::policy::Ttl::For(Duration::from_secs(3600))
    );

    // The binary reads the variable from its environment, and never prints it.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text(stripe)).unwrap();
    let run = |value: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
        cmd.arg("check-config")
            .arg(file.path())
            .env("RUST_LOG", "off");
        match value {
            Some(v) => cmd.env("HOOK_SECRET", v),
            None => cmd.env_remove("HOOK_SECRET"),
        };
        cmd.output().unwrap()
    };
    let out = run(Some("whsec_secret_one,whsec_secret_two"));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        shown.contains("\nwebhook_secret_env = \"HOOK_SECRET\"  # file\n"),
        "the variable shown by name: {shown}"
    );
    assert!(!shown.contains("whsec_secret"), "{shown}");
    let out = run(None);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routes[0].webhook_secret_env"), "{err}");
}

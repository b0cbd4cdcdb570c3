//! What a case is made of: the routes' policies, the requests with their arrival times, and
//! the script of what the inner service answers each of them; how they are generated, and how
//! they become a `Routes` table and `http` requests.
//!
//! A case is plain data that prints as JSON (`serde`), so that a shrunk failure pastes into
//! `REGRESSIONS` as it is.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use idemgate::idempotency::key::{IdempotencyKey, ScopedKey};
use idemgate::{AfterExpiry, FingerprintMode, OnInFlight, Policy, Routes, Ttl};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

/// The header that tells the scripted inner service which request of the case it serves: not
/// part of the fingerprint or the scope, so retries of one request differ only there.
pub(super) const REQUEST_ID: &str = "x-fuzz-request";

/// One case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Case {
    /// `routes[0]` is the defaults (the path `/other`); `routes[i]` the route `/r{i}`.
    pub(super) routes: Vec<Route>,
    pub(super) requests: Vec<Req>,
    /// A reload of the routes while the requests run, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) reload: Option<Reload>,
}

/// A reload: at `at` ms, `routes` (as many as the case's, on the same paths) replace the
/// case's routes for the requests that reach the layer from then on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Reload {
    pub(super) at: u64,
    pub(super) routes: Vec<Route>,
}

/// A route's policy, as the builder takes it (durations in ms).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Route {
    pub(super) lock_ttl: u64,
    pub(super) upstream_timeout: u64,
    pub(super) ttl: Life,
    pub(super) failure_ttl: Life,
    /// `None`: the built-in bound (or forever, with a forever ttl).
    pub(super) max_ttl: Option<Life>,
    /// `Some(tombstone_ttl)`: `after_expiry = "refuse"`.
    pub(super) refuse_after: Option<u64>,
    pub(super) stream: bool,
    pub(super) max_body: u64,
    pub(super) json: bool,
    /// `Some((wait_timeout, max_waiters))`: `on_in_flight = "wait"`.
    pub(super) wait: Option<(u64, usize)>,
    pub(super) cache_server_errors: bool,
    pub(super) mismatch_422: bool,
    pub(super) expiry_header: bool,
    /// `replay_drop_headers`: the default (`set-cookie`), none, or `x-private`.
    pub(super) drop: Drop,
    /// `methods`: POST and PATCH (the default), or POST and PUT.
    pub(super) put: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) enum Life {
    Ms(u64),
    Forever,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) enum Drop {
    Default,
    Nothing,
    Private,
}

/// A client's request: when it is sent, where, with which key, scope and body; what the inner
/// service answers if the request reaches it; and how the client reads its answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Req {
    pub(super) at: u64,
    /// Taken modulo the number of routes.
    pub(super) route: u8,
    pub(super) method: Verb,
    pub(super) key: Key,
    /// The `Authorization` header (which scopes the key): none, or one caller's.
    pub(super) auth: u8,
    /// Which of two workers serves it: layers that share their routes and live answers over
    /// one store, each with its own background tasks, as the binary's worker threads.
    #[serde(default)]
    pub(super) worker: u8,
    /// An index into [`BODIES`].
    pub(super) body: u8,
    pub(super) answer: Answer,
    pub(super) client: Client,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) enum Verb {
    Post,
    Patch,
    Put,
    Get,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) enum Key {
    None,
    /// `k0`, `k1`, `k2`.
    Valid(u8),
    /// The same keys as a structured-field string (`"k0"`): the same key.
    Quoted(u8),
    /// A key the layer refuses (a space, a bare comma, too long).
    Bad(u8),
}

/// What the inner service does when a request reaches it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) enum Answer {
    /// After this many ms, an error; `not_sent`: one that carries `NotSent`.
    Fails {
        after: u64,
        not_sent: bool,
    },
    /// After this many ms, a panic (a defect in the inner service).
    Panics {
        after: u64,
    },
    Responds(Resp),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Resp {
    pub(super) head_after: u64,
    pub(super) status: u16,
    pub(super) headers: Vec<Field>,
    pub(super) body: RespBody,
}

/// A response header the script adds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) enum Field {
    /// `Idempotency-Control` with this value.
    Control(String),
    /// `Content-Length`: the body's length plus this (0: right).
    Length(i8),
    /// A hop-by-hop header, one of [`HOPS`].
    Hop(u8),
    SetCookie,
    /// `x-private: 1` (dropped from replays where the route says so).
    Private,
    /// `x-custom: N`, possibly repeated.
    Custom(u8),
}

/// A response body: one buffer (whose size the layer knows before reading it), or chunks, each
/// after a delay, then an end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) enum RespBody {
    Full(String),
    Chunks(Vec<(u64, String)>, End),
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) enum End {
    Whole,
    /// Whole, with trailers after the last chunk.
    Trailers,
    /// An error instead of the end.
    Fails,
    /// A panic instead of the end.
    Panics,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) enum Client {
    Stays,
    /// Drops the request (and its answer) this many ms after sending it.
    GivesUp(u64),
    /// Waits this many ms before reading each frame of the answer.
    ReadsSlowly(u64),
}

/// Request bodies: content type, body, and what the body is under a JSON fingerprint.
pub(super) const BODIES: &[(&str, &str, Json)] = &[
    ("application/json", r#"{"a":1,"b":[1,2]}"#, Json::Doc(0)),
    (
        "application/json",
        r#"{ "b" : [1, 2], "a" : 1.0 }"#,
        Json::Doc(0),
    ),
    ("application/json", r#"{"a":2}"#, Json::Doc(1)),
    ("application/json", r#"{"a":1,"a":2}"#, Json::Invalid),
    ("text/plain", "hello", Json::Text),
    ("", "", Json::Text),
    (
        "text/plain",
        "a body of more than sixty-four bytes, larger than most routes' max_body",
        Json::Text,
    ),
];

/// A body under a `json` fingerprint: a document (equal documents share a number), a body
/// the layer refuses as invalid JSON, or no JSON at all (its bytes count).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Json {
    Doc(u8),
    Invalid,
    Text,
}

/// Hop-by-hop headers an inner service may send: never recorded nor replayed.
pub(super) const HOPS: &[(&str, &str)] = &[
    ("connection", "close"),
    ("keep-alive", "timeout=5"),
    ("transfer-encoding", "chunked"),
    ("upgrade", "h2c"),
    ("connection", "x-hop"),
    ("proxy-connection", "keep-alive"),
];

/// The scripted panic's message: a panic with any other message is the layer's.
pub(super) const SCRIPTED_PANIC: &str = "scripted panic of the inner service";

// === impl Case ===

impl Case {
    /// The route a request takes, with its path.
    pub(super) fn route_of(&self, req: &Req) -> usize {
        usize::from(req.route) % self.routes.len()
    }

    /// The routes table, and each route's policy as built (the checker reads the effective
    /// values, defaults and bounds applied).
    pub(super) fn build_routes(&self) -> (Routes, Vec<Policy>) {
        build_routes(&self.routes)
    }

    /// The table the reload puts in force, and its policies, if the case has a reload.
    pub(super) fn build_reloaded(&self) -> Option<(Routes, Vec<Policy>)> {
        self.reload.as_ref().map(|r| build_routes(&r.routes))
    }
}

/// The routes table of `routes`, and each route's policy as the table holds it.
fn build_routes(routes: &[Route]) -> (Routes, Vec<Policy>) {
    let policies: Vec<Policy> = routes.iter().map(Route::policy).collect();
    let mut table = Routes::new(policies[0].clone());
    for (i, policy) in policies.iter().enumerate().skip(1) {
        table = table.route(&path(i), policy.clone()).unwrap();
    }
    // Read back as the table holds them (named after their path).
    let built = (0..policies.len())
        .map(|i| (**table.policy_for(&path(i))).clone())
        .collect();
    (table, built)
}

/// The path of route `i` (`/other` matches no route: the defaults).
pub(super) fn path(i: usize) -> String {
    match i {
        0 => "/other".to_string(),
        i => format!("/r{i}"),
    }
}

impl Life {
    fn ttl(self) -> Ttl {
        match self {
            Life::Ms(ms) => Ttl::For(Duration::from_millis(ms)),
            Life::Forever => Ttl::Forever,
        }
    }
}

impl Route {
    /// The policy: a `max_ttl` the lifetimes do not fit in is left out (the builder refuses
    /// it, as the configuration would).
    fn policy(&self) -> Policy {
        let ms = Duration::from_millis;
        let mut b = Policy::builder()
            .lock_ttl(ms(self.lock_ttl))
            .upstream_timeout(ms(self.upstream_timeout))
            .ttl(self.ttl.ttl())
            .failure_ttl(self.failure_ttl.ttl())
            .stream(self.stream)
            .max_body(self.max_body)
            .cache_server_errors(self.cache_server_errors);
        if self.json {
            b = b.fingerprint(FingerprintMode::Json);
        }
        if let Some(tombstone) = self.refuse_after {
            b = b
                .after_expiry(AfterExpiry::Refuse)
                .tombstone_ttl(ms(tombstone));
        }
        if let Some((timeout, waiters)) = self.wait {
            b = b
                .on_in_flight(OnInFlight::Wait)
                .wait_timeout(ms(timeout))
                .max_waiters(waiters);
        }
        if self.mismatch_422 {
            b = b.mismatch_status(StatusCode::UNPROCESSABLE_ENTITY);
        }
        if self.expiry_header {
            b = b.expiry_header("idempotency-expires");
        }
        b = match self.drop {
            Drop::Default => b,
            Drop::Nothing => b.replay_drop_headers([]),
            Drop::Private => b.replay_drop_headers(["x-private"]),
        };
        if self.put {
            b = b.methods([Method::POST, Method::PUT]);
        }
        match self.max_ttl {
            Some(max) => match b.clone().max_ttl(max.ttl()).build() {
                Ok(policy) => policy,
                Err(_) => b.build().unwrap(),
            },
            None => b.build().unwrap(),
        }
    }
}

impl Verb {
    pub(super) fn method(self) -> Method {
        match self {
            Verb::Post => Method::POST,
            Verb::Patch => Method::PATCH,
            Verb::Put => Method::PUT,
            Verb::Get => Method::GET,
        }
    }
}

impl Key {
    /// The `Idempotency-Key` header's value, if the request has one.
    fn header(self) -> Option<String> {
        match self {
            Key::None => None,
            Key::Valid(k) => Some(format!("k{k}")),
            Key::Quoted(k) => Some(format!("\"k{k}\"")),
            Key::Bad(0) => Some("a key".to_string()),
            Key::Bad(1) => Some("k0,k1".to_string()),
            Key::Bad(_) => Some("k".repeat(300)),
        }
    }

    /// The key's number, when the layer accepts it.
    pub(super) fn number(self) -> Option<u8> {
        match self {
            Key::Valid(k) | Key::Quoted(k) => Some(k),
            _ => None,
        }
    }
}

impl Req {
    pub(super) fn content_type(&self) -> &'static str {
        BODIES[usize::from(self.body)].0
    }

    pub(super) fn body(&self) -> &'static str {
        BODIES[usize::from(self.body)].1
    }

    pub(super) fn json(&self) -> Json {
        BODIES[usize::from(self.body)].2
    }

    fn auth(&self) -> Option<String> {
        (self.auth > 0).then(|| format!("Bearer caller-{}", self.auth))
    }

    /// The request `n` of the case, to `path`.
    pub(super) fn request(&self, n: usize, path: &str) -> Request<axum::body::Body> {
        let mut req = Request::builder()
            .method(self.method.method())
            .uri(path)
            .header(REQUEST_ID, n);
        if let Some(key) = self.key.header() {
            req = req.header("idempotency-key", key);
        }
        if let Some(auth) = self.auth() {
            req = req.header("authorization", auth);
        }
        if !self.content_type().is_empty() {
            req = req.header("content-type", self.content_type());
        }
        req.body(axum::body::Body::from(self.body())).unwrap()
    }

    /// The store address of this request's key, if the layer accepts it (as the layer
    /// computes it: the key scoped by `Authorization`).
    pub(super) fn scoped_key(&self) -> Option<ScopedKey> {
        let key = self.key.number()?;
        let key = IdempotencyKey::parse(format!("k{key}").as_bytes(), 255).unwrap();
        let mut headers = HeaderMap::new();
        if let Some(auth) = self.auth() {
            headers.insert("authorization", HeaderValue::from_str(&auth).unwrap());
        }
        Some(key.scoped(&headers, &[http::header::AUTHORIZATION], &[]))
    }
}

impl Resp {
    /// The whole body the script sends, when it sends one to its end.
    pub(super) fn full_body(&self) -> Bytes {
        match &self.body {
            RespBody::Full(b) => Bytes::from(b.clone()),
            RespBody::Chunks(chunks, _) => chunks
                .iter()
                .flat_map(|(_, c)| c.bytes())
                .collect::<Vec<u8>>()
                .into(),
        }
    }

    /// The head the inner service answers with: status and headers, in the script's order.
    pub(super) fn head(&self) -> (StatusCode, HeaderMap) {
        let mut headers = HeaderMap::new();
        let len = self.full_body().len() as i64;
        for field in &self.headers {
            let (name, value) = match field {
                Field::Control(v) => ("idempotency-control", v.clone()),
                Field::Length(d) => ("content-length", (len + i64::from(*d)).max(0).to_string()),
                Field::Hop(h) => {
                    let (n, v) = HOPS[usize::from(*h) % HOPS.len()];
                    if v == "x-hop" {
                        headers.append("x-hop", HeaderValue::from_static("1"));
                    }
                    (n, v.to_string())
                }
                Field::SetCookie => ("set-cookie", "session=first".to_string()),
                Field::Private => ("x-private", "1".to_string()),
                Field::Custom(n) => ("x-custom", n.to_string()),
            };
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_str(&value).unwrap(),
            );
        }
        (StatusCode::from_u16(self.status).unwrap(), headers)
    }

    /// The trailers the script sends after the body, if any.
    pub(super) fn trailers(&self) -> Option<HeaderMap> {
        match &self.body {
            RespBody::Chunks(_, End::Trailers) => {
                let mut t = HeaderMap::new();
                t.insert("x-checksum", HeaderValue::from_static("c0ffee"));
                Some(t)
            }
            _ => None,
        }
    }
}

// === generation ===

/// Delays, in ms: around the leases' renewals (a third of 30 ms, of 45 ms), the timeouts, and
/// long ones.
fn delay() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => Just(0u64),
        6 => prop::sample::select(vec![1u64, 5, 9, 10, 11, 15, 19, 20, 21, 29, 30, 31, 40]),
        3 => prop::sample::select(vec![45u64, 59, 60, 61, 99, 100, 150, 250, 300, 301]),
        1 => prop::sample::select(vec![700u64, 1000, 1500, 3000]),
    ]
}

fn life() -> impl Strategy<Value = Life> {
    prop_oneof![
        4 => prop::sample::select(vec![1u64, 2, 20, 50, 100, 300]).prop_map(Life::Ms),
        6 => prop::sample::select(vec![1000u64, 2500, 3_600_000]).prop_map(Life::Ms),
        1 => Just(Life::Forever),
    ]
}

fn route() -> impl Strategy<Value = Route> {
    let times = (
        prop::sample::select(vec![30u64, 31, 33, 45, 60, 100, 300, 1000]),
        prop::sample::select(vec![10u64, 30, 50, 100, 300, 1000, 5000, 5000]),
        life(),
        life(),
        prop::option::weighted(0.3, life()),
        prop::option::weighted(0.3, prop::sample::select(vec![1u64, 100, 1000, 3_600_000])),
    );
    let shape = (
        any::<bool>(),
        prop::sample::select(vec![28u64, 40, 64, 1024, 1024]),
        any::<bool>(),
        prop::option::weighted(
            0.4,
            (
                prop::sample::select(vec![1u64, 20, 100, 500, 5000]),
                prop::sample::select(vec![1usize, 2, 1024]),
            ),
        ),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec![Drop::Default, Drop::Nothing, Drop::Private]),
        any::<bool>(),
    );
    (times, shape).prop_map(
        |(
            (lock_ttl, upstream_timeout, ttl, failure_ttl, max_ttl, refuse_after),
            (
                stream,
                max_body,
                json,
                wait,
                cache_server_errors,
                mismatch_422,
                expiry_header,
                drop,
                put,
            ),
        )| Route {
            lock_ttl,
            upstream_timeout,
            ttl,
            failure_ttl,
            max_ttl,
            refuse_after,
            stream,
            max_body,
            json,
            wait,
            cache_server_errors,
            mismatch_422,
            expiry_header,
            drop,
            put,
        },
    )
}

fn control() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "no-store",
        "max-age=0",
        "max-age=1",
        "max-age=2",
        "MAX-AGE=\"1\"",
        "max-age=3600",
        "max-age=18446744073709551615",
        "max-age=18446744073709551616",
        "max-age=abc",
        "no-store, max-age=1",
        "max-age=1, max-age=2",
        "private",
    ])
    .prop_map(str::to_string)
}

fn field() -> impl Strategy<Value = Field> {
    prop_oneof![
        3 => control().prop_map(Field::Control),
        2 => prop::sample::select(vec![0i8, 0, 0, -1, 1, 5]).prop_map(Field::Length),
        2 => (0..HOPS.len() as u8).prop_map(Field::Hop),
        1 => Just(Field::SetCookie),
        1 => Just(Field::Private),
        2 => (0u8..3).prop_map(Field::Custom),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => Just(String::new()),
        6 => "[a-z]{1,8}",
        2 => "[a-z]{20,70}",
    ]
}

fn resp_body() -> impl Strategy<Value = RespBody> {
    let end = prop_oneof![
        10 => Just(End::Whole),
        3 => Just(End::Trailers),
        2 => Just(End::Fails),
        1 => Just(End::Panics),
    ];
    prop_oneof![
        2 => text().prop_map(RespBody::Full),
        3 => (prop::collection::vec((delay(), text()), 0..5), end)
            .prop_map(|(chunks, end)| RespBody::Chunks(chunks, end)),
    ]
}

fn answer() -> impl Strategy<Value = Answer> {
    let status = prop_oneof![
        8 => prop::sample::select(vec![200u16, 201, 201, 204, 301]),
        4 => prop::sample::select(vec![400u16, 404, 409, 422]),
        4 => prop::sample::select(vec![408u16, 429, 500, 502, 503]),
        1 => prop::sample::select(vec![101u16, 103, 600]),
    ];
    let resp = (
        delay(),
        status,
        prop::collection::vec(field(), 0..4),
        resp_body(),
    )
        .prop_map(|(head_after, status, headers, body)| {
            Answer::Responds(Resp {
                head_after,
                status,
                headers,
                body,
            })
        });
    prop_oneof![
        16 => resp,
        2 => (delay(), any::<bool>()).prop_map(|(after, not_sent)| Answer::Fails { after, not_sent }),
        1 => delay().prop_map(|after| Answer::Panics { after }),
    ]
}

fn request() -> impl Strategy<Value = Req> {
    let key = prop_oneof![
        2 => Just(Key::None),
        10 => (0u8..3).prop_map(Key::Valid),
        2 => (0u8..3).prop_map(Key::Quoted),
        1 => (0u8..3).prop_map(Key::Bad),
    ];
    let method = prop_oneof![
        8 => Just(Verb::Post),
        1 => Just(Verb::Patch),
        1 => Just(Verb::Put),
        1 => Just(Verb::Get),
    ];
    let at = prop_oneof![
        3 => prop::sample::select(vec![0u64, 0, 1, 10, 20, 30]),
        3 => 0u64..200,
        2 => 0u64..3000,
    ];
    let client = prop_oneof![
        8 => Just(Client::Stays),
        1 => delay().prop_map(Client::GivesUp),
        1 => prop::sample::select(vec![1u64, 10, 50]).prop_map(Client::ReadsSlowly),
    ];
    let body = prop_oneof![
        6 => 0u8..3,
        1 => Just(3u8),
        3 => 4u8..BODIES.len() as u8,
    ];
    let who = (0u8..3, 0u8..2);
    (at, 0u8..4, method, key, who, body, answer(), client).prop_map(
        |(at, route, method, key, (auth, worker), body, answer, client)| Req {
            at,
            route,
            method,
            key,
            auth: if auth == 2 { 0 } else { auth },
            worker,
            body,
            answer,
            client,
        },
    )
}

/// A reload's time: mostly among the requests' (those before it take the old routes, those
/// after the new ones).
fn reload_at() -> impl Strategy<Value = u64> {
    prop_oneof![
        2 => prop::sample::select(vec![0u64, 1, 10, 20, 30, 50, 100]),
        4 => 0u64..200,
        1 => 0u64..3000,
    ]
}

/// A reload as drawn, before it meets the case: at `at`, or `after` a request's time (while
/// its call runs, often); with routes of its own, or the case's with some fields (a bit of
/// `masks[i]` each) taken from `drawn[i]`.
#[derive(Debug, Clone)]
struct DrawnReload {
    at: u64,
    after: Option<(u8, u64)>,
    drawn: Vec<Route>,
    masks: Vec<u16>,
    changed: bool,
}

fn drawn_reload() -> impl Strategy<Value = DrawnReload> {
    // Two masks ANDed: each field changes with odds of a quarter.
    let masks = prop::collection::vec((any::<u16>(), any::<u16>()).prop_map(|(a, b)| a & b), 3);
    let routes = prop::collection::vec(route(), 3);
    let after = prop::option::weighted(0.7, (any::<u8>(), delay()));
    let when = (reload_at(), after);
    (when, routes, masks, prop::bool::weighted(0.7)).prop_map(
        |((at, after), drawn, masks, changed)| DrawnReload {
            at,
            after,
            drawn,
            masks,
            changed,
        },
    )
}

impl DrawnReload {
    /// The reload of a case with `routes` (at most three) and `requests`.
    fn over(self, routes: &[Route], requests: &[Req]) -> Reload {
        let new = routes
            .iter()
            .zip(self.drawn.iter().zip(&self.masks))
            .map(|(old, (drawn, &mask))| match self.changed {
                true => old.mixed(drawn, mask),
                false => drawn.clone(),
            })
            .collect();
        let at = match self.after {
            Some((n, delay)) => requests[usize::from(n) % requests.len()].at + delay,
            None => self.at,
        };
        Reload { at, routes: new }
    }
}

impl Route {
    /// This route with the fields `mask` picks (a bit each) taken from `other`.
    fn mixed(&self, other: &Route, mask: u16) -> Route {
        let mut new = self.clone();
        macro_rules! take {
            ($($bit:literal $field:ident),*) => {$(
                if mask & (1 << $bit) != 0 {
                    new.$field = other.$field.clone();
                }
            )*};
        }
        take!(0 ttl, 1 failure_ttl, 2 max_ttl, 3 lock_ttl, 4 wait, 5 mismatch_422,
            6 refuse_after, 7 expiry_header, 8 upstream_timeout, 9 stream, 10 max_body,
            11 json, 12 cache_server_errors, 13 drop, 14 put);
        new
    }
}

/// Cases of one to three routes besides the defaults and up to 24 requests, most of them
/// retries of an earlier one (the same route, method, key, caller and body; their own time,
/// answer and client); half of them with a reload of the routes, most often a small change
/// of them.
pub(super) fn cases() -> impl Strategy<Value = Case> {
    let requests =
        prop::collection::vec((request(), prop::option::weighted(0.7, any::<u8>())), 1..24);
    let reload = prop::option::weighted(0.5, drawn_reload());
    (prop::collection::vec(route(), 1..4), requests, reload).prop_map(|(routes, drawn, reload)| {
        let mut requests: Vec<Req> = Vec::with_capacity(drawn.len());
        for (mut req, retry_of) in drawn {
            if let (Some(of), false) = (retry_of, requests.is_empty()) {
                let of = &requests[usize::from(of) % requests.len()];
                (req.route, req.method, req.key, req.auth, req.body) =
                    (of.route, of.method, of.key, of.auth, of.body);
            }
            requests.push(req);
        }
        let reload = reload.map(|r| r.over(&routes, &requests));
        Case {
            routes,
            requests,
            reload,
        }
    })
}

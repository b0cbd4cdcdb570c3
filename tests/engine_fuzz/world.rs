//! One case run: a current-thread runtime on paused time, the layer over a memory store that
//! logs every operation, a scripted inner service that logs every step of every call, and a
//! client per request that logs what it got. Everything lands in one [`Log`], in the order it
//! happened, with its virtual time.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::record::{EntryState, Token};
use idemgate::store::{Claim, ClaimTerms, Claimant, Keep, MemoryStore, Store, StoreError};
use idemgate::{IdempotencyLayer, NotSent, Routes, IDEMPOTENT_REPLAYED};
use tokio::time::Instant;
use tower::{Layer, ServiceExt};

use super::case::{path, Answer, Case, Client, End, Req, RespBody, REQUEST_ID, SCRIPTED_PANIC};

/// Longer than any case can take unless something hangs (virtual time: it costs nothing).
pub(super) const HANG: Duration = Duration::from_secs(3600);

/// What happened, at what virtual time since the case began.
pub(super) type Log = Arc<Mutex<Vec<(Duration, Ev)>>>;

#[derive(Debug, Clone)]
pub(super) enum Ev {
    /// A store operation and its answer.
    Claim {
        key: ScopedKey,
        token: Token,
        answer: &'static str,
    },
    Renew {
        token: Token,
        ok: bool,
    },
    Complete {
        token: Token,
        replayable: bool,
        keep: Keep,
        ok: bool,
    },
    Release {
        token: Token,
        ok: bool,
    },
    /// The inner service was called for request `req`, with this body.
    Called {
        req: usize,
        body: Bytes,
    },
    /// Its answer's head (or its error) was given.
    Head {
        req: usize,
    },
    /// A chunk of its body was given.
    Chunk {
        req: usize,
    },
    /// Its body (or its call) ended: whole, failed, or panicked.
    Ended {
        req: usize,
    },
    /// Its call or body was dropped before its end.
    Dropped {
        req: usize,
    },
    /// Request `req` reached the layer, which took its route from the table in force.
    Sent {
        req: usize,
    },
    /// The case's reload put its routes in force.
    Reloaded,
    /// A client got its answer's head.
    Responded {
        req: usize,
    },
    /// A client finished.
    Answered {
        req: usize,
        seen: Seen,
    },
}

/// What a client got.
#[derive(Debug, Clone)]
pub(super) enum Seen {
    /// A response, read to its end (or to an error).
    Response(Box<Answered>),
    /// The inner service's error, passed on; `not_sent`: it carries `NotSent`.
    Error { not_sent: bool },
    /// The client gave up first.
    GaveUp,
    /// The request's task panicked, with this message.
    Panicked(String),
    /// No answer within [`HANG`].
    Hung,
}

#[derive(Debug, Clone)]
pub(super) struct Answered {
    /// When the head came.
    pub(super) at: Duration,
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    pub(super) body: Bytes,
    pub(super) trailers: Option<HeaderMap>,
    /// Whether the body ended with an error instead of its end.
    pub(super) broken: bool,
}

impl Answered {
    pub(super) fn replayed(&self) -> bool {
        self.headers.get(IDEMPOTENT_REPLAYED).is_some()
    }

    pub(super) fn is_problem(&self) -> bool {
        self.headers
            .get("content-type")
            .is_some_and(|v| v == "application/problem+json")
    }
}

/// Append to the log, with the time since `base`.
#[derive(Clone)]
pub(super) struct Logger {
    log: Log,
    base: Instant,
}

impl Logger {
    pub(super) fn push(&self, ev: Ev) {
        let at = Instant::now() - self.base;
        self.log.lock().unwrap().push((at, ev));
    }
}

// === the store ===

/// The memory store, logging every operation the layer makes on it.
#[derive(Clone)]
pub(super) struct Observed {
    pub(super) inner: MemoryStore,
    logger: Logger,
}

fn claim_kind(claim: &Result<Claim, StoreError>) -> &'static str {
    match claim {
        Ok(Claim::Claimed) => "claimed",
        Ok(Claim::Replay(_)) => "replay",
        Ok(Claim::InFlight) => "in flight",
        Ok(Claim::NotReplayable) => "not replayable",
        Ok(Claim::Mismatch) => "mismatch",
        Ok(Claim::Expired { .. }) => "expired",
        Err(_) => "error",
    }
}

impl Store for Observed {
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(who, terms).await;
        self.logger.push(Ev::Claim {
            key: who.key,
            token: who.token,
            answer: claim_kind(&claim),
        });
        claim
    }

    async fn complete(
        &self,
        who: &Claimant,
        state: &EntryState,
        keep: Keep,
    ) -> Result<bool, StoreError> {
        let ok = self.inner.complete(who, state, keep).await;
        self.logger.push(Ev::Complete {
            token: who.token,
            replayable: matches!(state, EntryState::Completed(_)),
            keep,
            ok: matches!(ok, Ok(true)),
        });
        ok
    }

    async fn release(&self, who: &Claimant) -> Result<bool, StoreError> {
        let ok = self.inner.release(who).await;
        self.logger.push(Ev::Release {
            token: who.token,
            ok: matches!(ok, Ok(true)),
        });
        ok
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> Result<bool, StoreError> {
        let ok = self.inner.renew(who, lease).await;
        self.logger.push(Ev::Renew {
            token: who.token,
            ok: matches!(ok, Ok(true)),
        });
        ok
    }
}

// === the inner service ===

/// The inner service's error.
#[derive(Debug, thiserror::Error)]
pub(super) enum InnerError {
    #[error("connection refused")]
    NotSent(#[source] NotSent),
    #[error("connection reset after the request was written")]
    Reset,
}

/// Logs `Dropped` for a request unless disarmed: the call or the body went away unfinished.
struct Unfinished {
    logger: Logger,
    req: usize,
    armed: bool,
}

impl Unfinished {
    fn end(&mut self) {
        self.armed = false;
        self.logger.push(Ev::Ended { req: self.req });
    }
}

impl std::ops::Drop for Unfinished {
    fn drop(&mut self) {
        if self.armed {
            self.logger.push(Ev::Dropped { req: self.req });
        }
    }
}

fn scripted_panic() -> ! {
    std::panic::panic_any(SCRIPTED_PANIC)
}

/// Answer request `req` as the case's script says.
async fn serve(
    case: Arc<Case>,
    logger: Logger,
    req: Request<Body>,
) -> Result<Response<Body>, InnerError> {
    let n: usize = req.headers()[REQUEST_ID].to_str().unwrap().parse().unwrap();
    let body = req.into_body().collect().await.unwrap().to_bytes();
    logger.push(Ev::Called { req: n, body });
    let mut unfinished = Unfinished {
        logger: logger.clone(),
        req: n,
        armed: true,
    };
    let resp = match &case.requests[n].answer {
        Answer::Fails { after, not_sent } => {
            tokio::time::sleep(Duration::from_millis(*after)).await;
            unfinished.end();
            return Err(match not_sent {
                true => InnerError::NotSent(NotSent::new("connection refused")),
                false => InnerError::Reset,
            });
        }
        Answer::Panics { after } => {
            tokio::time::sleep(Duration::from_millis(*after)).await;
            unfinished.end();
            scripted_panic()
        }
        Answer::Responds(resp) => resp,
    };
    tokio::time::sleep(Duration::from_millis(resp.head_after)).await;
    logger.push(Ev::Head { req: n });
    let (status, headers) = resp.head();
    let body = match &resp.body {
        RespBody::Full(b) => {
            unfinished.end();
            Body::from(b.clone())
        }
        RespBody::Chunks(chunks, end) => chunked(chunks, *end, resp.trailers(), unfinished),
    };
    let mut answer = Response::new(body);
    *answer.status_mut() = status;
    *answer.headers_mut() = headers;
    Ok(answer)
}

/// A body of `chunks`, each after its delay, then `end`.
fn chunked(
    chunks: &[(u64, String)],
    end: End,
    trailers: Option<HeaderMap>,
    unfinished: Unfinished,
) -> Body {
    struct State {
        chunks: VecDeque<(u64, String)>,
        end: Option<End>,
        trailers: Option<HeaderMap>,
        unfinished: Unfinished,
    }
    let state = State {
        chunks: chunks.iter().cloned().collect(),
        end: Some(end),
        trailers,
        unfinished,
    };
    let frames = futures_util::stream::unfold(state, |mut st| async move {
        if let Some((delay, data)) = st.chunks.pop_front() {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let u = &st.unfinished;
            u.logger.push(Ev::Chunk { req: u.req });
            return Some((Ok(Frame::data(Bytes::from(data))), st));
        }
        let end = st.end.take()?;
        st.unfinished.end();
        match end {
            End::Whole => None,
            End::Trailers => {
                let trailers = st.trailers.take().unwrap();
                Some((Ok(Frame::trailers(trailers)), st))
            }
            End::Fails => Some((Err(std::io::Error::other("upstream reset mid-body")), st)),
            End::Panics => scripted_panic(),
        }
    });
    Body::new(StreamBody::new(frames))
}

// === the clients ===

/// Send request `n` at its time, read its answer as its client does, and log what it got.
async fn client<S>(mut service: S, case: Arc<Case>, n: usize, logger: Logger)
where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = InnerError>,
{
    let spec: &Req = &case.requests[n];
    tokio::time::sleep_until(logger.base + Duration::from_millis(spec.at)).await;
    let req = spec.request(n, &path(case.route_of(spec)));
    let read = async {
        // `call` takes the route before it returns: `Sent` is logged on the table it took.
        let answer = match service.ready().await {
            Ok(ready) => {
                logger.push(Ev::Sent { req: n });
                ready.call(req).await
            }
            Err(e) => Err(e),
        };
        match answer {
            Ok(resp) => {
                logger.push(Ev::Responded { req: n });
                Seen::Response(Box::new(read(resp, spec.client, &logger).await))
            }
            Err(InnerError::NotSent(_)) => Seen::Error { not_sent: true },
            Err(InnerError::Reset) => Seen::Error { not_sent: false },
        }
    };
    let seen = match spec.client {
        Client::GivesUp(after) => {
            let after = Duration::from_millis(after);
            tokio::time::timeout(after, read)
                .await
                .unwrap_or(Seen::GaveUp)
        }
        _ => tokio::time::timeout(HANG, read).await.unwrap_or(Seen::Hung),
    };
    logger.push(Ev::Answered { req: n, seen });
}

async fn read(resp: Response<Body>, client: Client, logger: &Logger) -> Answered {
    let at = Instant::now() - logger.base;
    let (head, mut body) = resp.into_parts();
    let (mut data, mut trailers, mut broken) = (Vec::new(), None, false);
    loop {
        if let Client::ReadsSlowly(ms) = client {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        match body.frame().await {
            None => break,
            Some(Err(_)) => {
                broken = true;
                break;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) => data.extend_from_slice(&d),
                Err(frame) => trailers = frame.into_trailers().ok(),
            },
        }
    }
    Answered {
        at,
        status: head.status,
        headers: head.headers,
        body: data.into(),
        trailers,
        broken,
    }
}

/// What a run left: the log, and the store's live entries after every lease has run out.
pub(super) struct Run {
    pub(super) log: Vec<(Duration, Ev)>,
    /// Keys still claimed once every task is done and the longest lease has passed twice.
    pub(super) stuck: Vec<ScopedKey>,
    /// The layer's background tasks did not finish within [`HANG`].
    pub(super) tasks_hung: bool,
}

/// Run `case` on a runtime of its own, on paused time.
pub(super) fn run(case: &Case) -> Run {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(world(Arc::new(case.clone())))
}

/// The run of `case`: its clients, its reload, then the layer's background tasks to their end
/// and every lease past.
async fn world(case: Arc<Case>) -> Run {
    let logger = Logger {
        log: Log::default(),
        base: Instant::now(),
    };
    let store = Observed {
        inner: MemoryStore::new(),
        logger: logger.clone(),
    };
    let (routes, mut policies) = case.build_routes();
    let layer = IdempotencyLayer::with_routes(store.clone(), routes);
    let reload = case.build_reloaded().map(|(routes, reloaded)| {
        policies.extend(reloaded);
        let at = logger.base + Duration::from_millis(case.reload.as_ref().unwrap().at);
        tokio::spawn(reload_at(layer.clone(), routes, at, logger.clone()))
    });
    let workers = [layer.clone(), layer.with_store(store.clone())];
    clients(&case, &workers, &logger).await;
    if let Some(reload) = reload {
        reload.await.unwrap();
    }
    let mut tasks_hung = false;
    for worker in &workers {
        let tasks = worker.tasks();
        tasks.close();
        tasks_hung |= tokio::time::timeout(HANG, tasks.wait()).await.is_err();
    }
    let longest = policies.iter().map(|p| p.lock_ttl).max().unwrap();
    tokio::time::sleep(longest * 2 + Duration::from_millis(10)).await;
    let log = logger.log.lock().unwrap().clone();
    let stuck = stuck(&log, &store);
    Run {
        log,
        stuck,
        tasks_hung,
    }
}

/// Send each request of `case` through its worker, and wait for every client to finish (one
/// whose task panicked is logged as having got the panic).
async fn clients(case: &Arc<Case>, workers: &[IdempotencyLayer<Observed>; 2], logger: &Logger) {
    let inner = {
        let (case, logger) = (case.clone(), logger.clone());
        tower::service_fn(move |req| serve(case.clone(), logger.clone(), req))
    };
    let services = workers.clone().map(|worker| worker.layer(inner.clone()));
    let clients: Vec<_> = (0..case.requests.len())
        .map(|n| {
            let service = services[usize::from(case.requests[n].worker) % 2].clone();
            let client = client(service, case.clone(), n, logger.clone());
            (n, tokio::spawn(client))
        })
        .collect();
    for (n, task) in clients {
        if let Err(e) = task.await {
            let message = match e.try_into_panic() {
                Ok(panic) => panic_message(&*panic),
                Err(e) => format!("{e}"),
            };
            logger.push(Ev::Answered {
                req: n,
                seen: Seen::Panicked(message),
            });
        }
    }
}

/// The keys the log shows claimed that the store still holds claimed.
fn stuck(log: &[(Duration, Ev)], store: &Observed) -> Vec<ScopedKey> {
    let mut stuck: Vec<ScopedKey> = log
        .iter()
        .filter_map(|(_, ev)| match ev {
            Ev::Claim { key, .. } => Some(*key),
            _ => None,
        })
        .filter(|key| {
            store
                .inner
                .get(key)
                .is_some_and(|(entry, _)| matches!(entry.state, EntryState::InFlight))
        })
        .collect();
    stuck.dedup();
    stuck
}

/// At `at`, put `routes` in force in `layer` (and so in every worker's).
async fn reload_at(layer: IdempotencyLayer<Observed>, routes: Routes, at: Instant, logger: Logger) {
    tokio::time::sleep_until(at).await;
    layer.set_routes(routes);
    logger.push(Ev::Reloaded);
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}

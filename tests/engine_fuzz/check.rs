//! The invariants, checked on a run's log against what the documentation promises
//! (docs/behaviour.md, docs/failure-semantics.md):
//!
//! - no panic but the inner service's own (and only in the request whose call panicked and
//!   whose answer was passed on), no request without an answer, no background task left
//!   running, no key left claimed once every lease has run out;
//! - the inner service is called for a keyed request only under a claim of its key, and at
//!   most once per key while the key's record or claim lives: after a call, the key is free
//!   again only once it was released (an answer that says "try again", or not sent), once the
//!   record's ttl (and tombstone) ran out, or, for a call whose outcome nobody knows, a lease
//!   after the layer gave up on it (less one renewal period, the most the last renewal can
//!   precede that); and the layer releases, records (for how long) or keeps exactly what the
//!   rules say it does for the answer the script gave;
//! - every replay is the recorded answer of the call that holds the key, byte for byte
//!   (status, headers but those a replay drops, body, trailers), to a request with the same
//!   fingerprint; the first answer of a recorded call is the same as its replays (but for the
//!   replay mark and the dropped headers); an answer the client got from no call of its own is
//!   a replay or the layer's own problem.
//!
//! Across a reload, each request is judged under its route's policy in the table in force when
//! it reached the layer, and a record (its ttl, tombstone, first answer) under the policy of
//! the request that wrote it; a replay drops and adds the headers its own request's policy
//! names.

use std::collections::HashMap;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::record::Token;
use idemgate::store::Keep;
use idemgate::{AfterExpiry, FingerprintMode, Policy, Ttl, IDEMPOTENT_REPLAYED};

use super::case::{Answer, Case, End, Json, Key, Req, Resp, RespBody, SCRIPTED_PANIC};
use super::world::{Answered, Ev, Run, Seen};

/// What became of a claimed call's key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Fate {
    Released,
    Recorded {
        replayable: bool,
        keep: Keep,
    },
    /// Left claimed until its lease ends: nobody knows whether the call ran.
    Kept,
}

/// One call of the inner service, as the log shows it.
#[derive(Debug)]
struct Call {
    req: usize,
    at: Duration,
    /// The step of the log at which its key was claimed (its call's, when it has none).
    step: usize,
    /// The last thing the call did (its end, its error, or being dropped).
    last: Duration,
    key: Option<ScopedKey>,
    /// What the store was told of its key, when, and at which step of the log.
    fate: Option<(Duration, Fate)>,
    settled: usize,
}

/// How often each kind of thing happened over a run's cases: that the cases reach every
/// branch shows here.
pub(super) type Tally = std::sync::Mutex<std::collections::BTreeMap<&'static str, u32>>;

/// Check a run of `case`, counting into `tally`; the first broken invariant, said in a
/// sentence.
pub(super) fn check(case: &Case, run: &Run, tally: &Tally) -> Result<(), String> {
    let count = |what: &'static str| *tally.lock().unwrap().entry(what).or_default() += 1;
    let (_, old) = case.build_routes();
    let new = case.build_reloaded().map(|(_, new)| new);
    let (policies, reloaded) = admitted(case, run, &old, new.as_deref());
    let policy = |n: usize| policies[n];
    if run.tasks_hung {
        return Err("the layer's background tasks did not finish within an hour".into());
    }
    if let Some(key) = run.stuck.first() {
        return Err(format!(
            "key {} still claimed after every lease ran out twice",
            key.store_name()
        ));
    }
    let mut calls: Vec<Call> = Vec::new();
    // Per request, its call (an index into `calls`), and its answer.
    let mut call_of: HashMap<usize, usize> = HashMap::new();
    let mut seen: HashMap<usize, Seen> = HashMap::new();
    // Per request, the step of the log at which its client got its answer's head.
    let mut responded: HashMap<usize, usize> = HashMap::new();
    // Claims granted and not yet tied to a call, by key.
    let mut granted: HashMap<ScopedKey, Vec<(Duration, Token, usize)>> = HashMap::new();
    let mut by_token: HashMap<Token, usize> = HashMap::new();
    for (step, (at, ev)) in run.log.iter().enumerate() {
        let at = *at;
        match ev {
            Ev::Claim { key, token, answer } => {
                if *answer == "claimed" {
                    granted.entry(*key).or_default().push((at, *token, step));
                }
            }
            Ev::Called { req, body } => {
                let spec = &case.requests[*req];
                if body != spec.body().as_bytes() {
                    return Err(format!("request {req}: the inner service got another body"));
                }
                if call_of.contains_key(req) {
                    return Err(format!("request {req}: the inner service was called twice"));
                }
                let key = keyed(spec, policy(*req)).then(|| spec.scoped_key().unwrap());
                let claimed = match key {
                    Some(key) => {
                        let claims = granted.entry(key).or_default();
                        let Some((_, token, claimed)) = claims.pop() else {
                            return Err(format!(
                                "request {req}: the inner service was called without a claim of its key"
                            ));
                        };
                        if let Some((when, _, _)) = claims.first() {
                            return Err(format!(
                                "a claim of request {req}'s key granted at {when:?} was never called"
                            ));
                        }
                        by_token.insert(token, calls.len());
                        claimed
                    }
                    None => step,
                };
                call_of.insert(*req, calls.len());
                calls.push(Call {
                    req: *req,
                    at,
                    step: claimed,
                    last: at,
                    key,
                    fate: None,
                    settled: usize::MAX,
                });
            }
            Ev::Head { req } | Ev::Chunk { req } | Ev::Ended { req } | Ev::Dropped { req } => {
                if let Some(&c) = call_of.get(req) {
                    calls[c].last = at;
                }
            }
            Ev::Renew { token, ok, .. } => {
                if !ok {
                    let req = by_token.get(token).map(|&c| calls[c].req);
                    return Err(format!(
                        "the lease of request {req:?} was lost at {at:?} while it was held"
                    ));
                }
            }
            Ev::Release { token, ok, .. } | Ev::Complete { token, ok, .. } => {
                let Some(&c) = by_token.get(token) else {
                    return Err(format!("a store write at {at:?} by a claim with no call"));
                };
                let req = calls[c].req;
                if !ok {
                    return Err(format!(
                        "request {req}: its answer was not recorded or released (a newer claim took the key?)"
                    ));
                }
                if calls[c].fate.is_some() {
                    return Err(format!("request {req}: its key was settled twice"));
                }
                let fate = match ev {
                    Ev::Complete {
                        replayable, keep, ..
                    } => Fate::Recorded {
                        replayable: *replayable,
                        keep: *keep,
                    },
                    _ => Fate::Released,
                };
                calls[c].fate = Some((at, fate));
                calls[c].settled = step;
            }
            Ev::Responded { req } => {
                responded.insert(*req, step);
            }
            Ev::Answered { req, seen: s } => {
                seen.insert(*req, s.clone());
            }
            Ev::Sent { .. } | Ev::Reloaded => {}
        }
    }
    if let Some((key, claims)) = granted.iter().find(|(_, c)| !c.is_empty()) {
        return Err(format!(
            "key {} was claimed at {:?} and never called",
            key.store_name(),
            claims[0].0
        ));
    }
    for call in &calls {
        let Some(_) = call.key else { continue };
        let spec = &case.requests[call.req];
        let fate = call.fate.map_or(Fate::Kept, |(_, f)| f);
        let expected = fates(spec, policy(call.req));
        if !expected.contains(&fate) {
            return Err(format!(
                "request {}: its key was {fate:?}, but its answer says {expected:?}",
                call.req
            ));
        }
    }
    for call in &calls {
        count(match (call.key, call.fate) {
            (None, _) => "call passed through",
            (_, None) => "call kept claimed",
            (_, Some((_, Fate::Released))) => "call released",
            (
                _,
                Some((
                    _,
                    Fate::Recorded {
                        replayable: true, ..
                    },
                )),
            ) => "call recorded",
            (_, Some((_, Fate::Recorded { .. }))) => "call recorded not replayable",
            (_, Some((_, Fate::Kept))) => unreachable!("never written"),
        });
    }
    for s in seen.values() {
        count(match s {
            Seen::Response(a) if a.replayed() && a.broken => "answer replayed, broken",
            Seen::Response(a) if a.replayed() => "answer replayed",
            Seen::Response(a) if a.is_problem() => match problem_kind(a).as_str() {
                "in-flight" => "answer in-flight",
                "mismatch" => "answer mismatch",
                "not-replayable" => "answer not-replayable",
                "key-expired" => "answer key-expired",
                "internal" => "answer internal",
                "upstream-timeout" => "answer upstream-timeout",
                "upstream-unavailable" => "answer upstream-unavailable",
                "upstream-invalid-response" => "answer upstream-invalid-response",
                _ => "answer refused before the claim",
            },
            Seen::Response(_) => "answer from its call",
            Seen::Error { .. } => "answer error",
            Seen::GaveUp => "client gave up",
            Seen::Panicked(_) => "client got the inner panic",
            Seen::Hung => "client hung",
        });
    }
    tally_reload((case, run, &calls, &reloaded), (&seen, &responded), &count);
    once_per_key(&policies, &calls, &count)?;
    for n in 0..case.requests.len() {
        let Some(s) = seen.get(&n) else {
            return Err(format!("request {n}: its client never finished"));
        };
        answer(
            case,
            &policies,
            &calls,
            &call_of,
            (n, responded.get(&n).copied()),
            s,
        )?;
    }
    Ok(())
}

/// The policy each request was admitted under: its route's in the table in force when it
/// reached the layer (the reload's from the first request logged after it); and whether that
/// table was the reload's.
fn admitted<'a>(
    case: &Case,
    run: &Run,
    old: &'a [Policy],
    new: Option<&'a [Policy]>,
) -> (Vec<&'a Policy>, Vec<bool>) {
    let (mut table, mut reloaded) = (old, false);
    let mut took = vec![(old, false); case.requests.len()];
    for (_, ev) in &run.log {
        match ev {
            Ev::Reloaded => (table, reloaded) = (new.expect("a reload the case has not"), true),
            Ev::Sent { req } => took[*req] = (table, reloaded),
            _ => {}
        }
    }
    let policies = (case.requests.iter().zip(&took))
        .map(|(req, (table, _))| &table[case.route_of(req)])
        .collect();
    (policies, took.iter().map(|(_, r)| *r).collect())
}

/// Count the cases whose reload came between their requests, the calls it came during, the
/// keys run again across it (under one table, then the other), and the replays across it.
fn tally_reload(
    (case, run, calls, reloaded): (&Case, &Run, &[Call], &[bool]),
    (seen, responded): (&HashMap<usize, Seen>, &HashMap<usize, usize>),
    count: &impl Fn(&'static str),
) {
    let Some(at) = run
        .log
        .iter()
        .position(|(_, ev)| matches!(ev, Ev::Reloaded))
    else {
        return;
    };
    count("case with a reload");
    if reloaded.contains(&true) && reloaded.contains(&false) {
        count("case with requests on both sides of its reload");
    }
    let mut last: HashMap<ScopedKey, bool> = HashMap::new();
    for call in calls {
        let Some(key) = call.key else { continue };
        if last.insert(key, reloaded[call.req]) == Some(!reloaded[call.req]) {
            count("key run again across the reload");
        }
        if !reloaded[call.req] && call.fate.is_some() && call.settled > at {
            count("call admitted before the reload, settled after it");
        }
    }
    for (&n, s) in seen {
        let (Seen::Response(a), Some(&step)) = (s, responded.get(&n)) else {
            continue;
        };
        let key = case.requests[n].scoped_key();
        let holder = calls
            .iter()
            .rfind(|c| c.key.is_some() && c.key == key && c.step < step);
        if a.replayed() && holder.is_some_and(|h| reloaded[h.req] != reloaded[n]) {
            count("answer replayed across the reload");
        }
    }
}

/// Whether request `req` takes the keyed path to a claim (otherwise it passes through, or is
/// refused before any claim).
pub(super) fn keyed(req: &Req, policy: &Policy) -> bool {
    policy.applies_to(&req.method.method())
        && req.key.number().is_some()
        && req.body().len() as u64 <= policy.max_body
        && !(policy.fingerprint == FingerprintMode::Json && req.json() == Json::Invalid)
}

/// What "the same request" is: its method, route, content type and body (as a JSON document
/// under a `json` fingerprint).
fn fingerprint(case: &Case, policies: &[&Policy], n: usize) -> (String, usize, String) {
    let req = &case.requests[n];
    let route = case.route_of(req);
    let body = match (policies[n].fingerprint, req.json()) {
        (FingerprintMode::Json, Json::Doc(d)) => format!("doc {d}"),
        _ => format!("bytes {}", req.body()),
    };
    (
        format!("{} {}", req.method.method(), req.content_type()),
        route,
        body,
    )
}

/// Calls on one key: each after the previous one's key was free again.
fn once_per_key(
    policies: &[&Policy],
    calls: &[Call],
    count: &impl Fn(&'static str),
) -> Result<(), String> {
    let mut last: HashMap<ScopedKey, &Call> = HashMap::new();
    for call in calls {
        let Some(key) = call.key else { continue };
        if let Some(before) = last.get(&key) {
            let route = policies[call.req];
            let (free, why) = free_at(before, policies[before.req], route);
            count(match before.fate {
                None => "key run again after a lease",
                Some((_, Fate::Released)) => "key run again after a release",
                Some(_) => "key run again after its record",
            });
            if call.at < free {
                return Err(format!(
                    "request {} ran at {:?}, but the key of request {} (run at {:?}) was not free before {free:?} ({why})",
                    call.req, call.at, before.req, before.at
                ));
            }
        }
        last.insert(key, call);
    }
    Ok(())
}

/// When the key of `call` (on a route with `policy`) is free again for a request on `route`.
fn free_at(call: &Call, policy: &Policy, route: &Policy) -> (Duration, &'static str) {
    match call.fate {
        Some((at, Fate::Released)) => (at, "released"),
        Some((at, Fate::Recorded { keep, .. })) => match keep.ttl {
            Ttl::Forever => (Duration::MAX, "recorded forever"),
            Ttl::For(ttl) => {
                let lives = ms(ttl);
                let tomb = match (keep.tombstone, route.after_expiry) {
                    (Some(t), AfterExpiry::Refuse) => ms(t),
                    _ => Duration::ZERO,
                };
                (at + lives + tomb, "recorded")
            }
        },
        Some((_, Fate::Kept)) | None => {
            // The last renewal came at most a renewal period (whole ms, as timers fire) before
            // the layer gave up on the call.
            let every = (policy.lock_ttl / 3).max(Duration::from_millis(10));
            let every = Duration::from_millis(every.as_nanos().div_ceil(1_000_000) as u64);
            let free = (call.last + policy.lock_ttl)
                .saturating_sub(every)
                .saturating_sub(Duration::from_millis(1));
            (free, "kept claimed until its lease ends")
        }
    }
}

/// A duration in whole ms, as the stores reckon one (at least 1 ms).
fn ms(d: Duration) -> Duration {
    Duration::from_millis(idemgate::time::millis(d))
}

// === the model of what an answer does to its key ===

/// The fates the rules allow for the call of `req` (more than one where a delay falls exactly
/// on a deadline).
pub(super) fn fates(req: &Req, policy: &Policy) -> Vec<Fate> {
    let deadline = policy.upstream_timeout;
    let ms = Duration::from_millis;
    let mut fates = Vec::new();
    // The call's (or a chunk's) time against the deadline: past it, the call timed out; on
    // it, either may win.
    let timed = |t: u64, fates: &mut Vec<Fate>| -> bool {
        if ms(t) >= deadline {
            fates.push(Fate::Kept);
        }
        ms(t) > deadline
    };
    match &req.answer {
        Answer::Fails { after, not_sent } => {
            if !timed(*after, &mut fates) {
                fates.push(if *not_sent {
                    Fate::Released
                } else {
                    Fate::Kept
                });
            }
        }
        Answer::Panics { .. } => fates.push(Fate::Kept),
        Answer::Responds(resp) => {
            if !timed(resp.head_after, &mut fates) {
                headed(resp, policy, &timed, &mut fates);
            }
        }
    }
    fates
}

/// The fates of an answer whose head came in time.
fn headed(
    resp: &Resp,
    policy: &Policy,
    timed: &impl Fn(u64, &mut Vec<Fate>) -> bool,
    fates: &mut Vec<Fate>,
) {
    let status = resp.status;
    if !(200..=599).contains(&status) {
        return fates.push(Fate::Kept);
    }
    let Some(keep) = keep(resp, policy) else {
        return fates.push(Fate::Released);
    };
    let total = resp.full_body().len() as u64;
    let recorded = |replayable| Fate::Recorded { replayable, keep };
    let whole = |fates: &mut Vec<Fate>| match framed(resp) {
        true => fates.push(recorded(true)),
        false => fates.push(Fate::Kept),
    };
    match (&resp.body, policy.stream) {
        (RespBody::Full(_), _) if total > policy.max_body => fates.push(recorded(false)),
        (RespBody::Full(_), _) => whole(fates),
        // Streamed: each wait for a frame bounded by the deadline; recorded at the end.
        (RespBody::Chunks(chunks, end), true) => {
            for (delay, _) in chunks {
                if timed(*delay, fates) {
                    return;
                }
            }
            match end {
                End::Fails | End::Panics => fates.push(Fate::Kept),
                _ if total > policy.max_body => fates.push(recorded(false)),
                _ => whole(fates),
            }
        }
        // Buffered: the whole body within the deadline, or found too large first.
        (RespBody::Chunks(chunks, end), false) => {
            let (mut t, mut read) = (resp.head_after, 0u64);
            for (delay, chunk) in chunks {
                t += delay;
                if timed(t, fates) {
                    return;
                }
                read += chunk.len() as u64;
                if read > policy.max_body {
                    return fates.push(recorded(false));
                }
            }
            match end {
                End::Fails | End::Panics => fates.push(Fate::Kept),
                _ => whole(fates),
            }
        }
    }
}

/// How an answer is recorded (docs/behaviour.md, "What is stored" and "How long a record
/// lives"), or `None` when its key is released.
fn keep(resp: &Resp, policy: &Policy) -> Option<Keep> {
    let status = resp.status;
    let storable = match status {
        408 | 429 => false,
        200..=499 => true,
        500..=599 => policy.cache_server_errors,
        _ => false,
    };
    let failure = status >= 400;
    let (mut no_store, mut max_age) = (false, None);
    let (_, headers) = resp.head();
    for value in headers.get_all("idempotency-control") {
        for directive in value.to_str().unwrap().split(',').map(str::trim) {
            let (name, arg) = directive.split_once('=').unwrap_or((directive, ""));
            if name.eq_ignore_ascii_case("no-store") {
                no_store = true;
            } else if name.eq_ignore_ascii_case("max-age") {
                match arg.trim().trim_matches('"').parse::<u64>() {
                    Ok(0) => no_store = true,
                    Ok(secs) => max_age = Some(Ttl::secs(secs)),
                    Err(_) => {}
                }
            }
        }
    }
    if !storable || no_store {
        return None;
    }
    let ttl = match max_age {
        Some(age) => age.min(policy.max_ttl),
        None if failure => policy.failure_ttl,
        None => policy.ttl,
    };
    let refuses = policy.after_expiry == AfterExpiry::Refuse && !failure;
    Some(Keep {
        ttl,
        tombstone: refuses.then_some(policy.tombstone_ttl),
    })
}

/// Whether the answer's `Content-Length` values (if any) are its body's length, or it has no
/// content by its status.
fn framed(resp: &Resp) -> bool {
    if matches!(resp.status, 100..=199 | 204 | 304) {
        return true;
    }
    let len = resp.full_body().len().to_string();
    let (_, headers) = resp.head();
    headers
        .get_all("content-length")
        .iter()
        .all(|v| v.to_str().unwrap() == len)
}

/// The headers a recorded answer is sent with: the script's, without `Idempotency-Control`
/// and hop-by-hop headers; a replay (`replay`) also without the route's dropped headers, and
/// marked. The expiry header aside.
fn recorded_headers(resp: &Resp, policy: &Policy, replay: bool) -> HeaderMap {
    let (_, mut headers) = resp.head();
    headers.remove("idempotency-control");
    let named: Vec<HeaderName> = headers
        .get_all("connection")
        .iter()
        .flat_map(|v| v.to_str().unwrap().split(','))
        .map(|n| HeaderName::from_bytes(n.trim().as_bytes()).unwrap())
        .collect();
    for name in named {
        headers.remove(name);
    }
    let hops = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "transfer-encoding",
        "upgrade",
    ];
    for name in hops {
        headers.remove(name);
    }
    if replay {
        for name in &policy.replay_drop_headers {
            headers.remove(name);
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    headers
}

// === what each client got ===

/// Check the answer request `n`'s client got.
fn answer(
    case: &Case,
    policies: &[&Policy],
    calls: &[Call],
    call_of: &HashMap<usize, usize>,
    (n, responded): (usize, Option<usize>),
    seen: &Seen,
) -> Result<(), String> {
    let spec = &case.requests[n];
    let policy = policies[n];
    let own = call_of.get(&n).map(|&c| &calls[c]);
    // `None`: no call of its own, or one that passed through without a claim.
    let fate = own
        .filter(|c| c.key.is_some())
        .map(|c| c.fate.map_or(Fate::Kept, |(_, f)| f));
    match seen {
        Seen::Hung => Err(format!("request {n}: no answer within an hour")),
        Seen::GaveUp => Ok(()),
        Seen::Panicked(message) => {
            // The inner service's panic reaches only the client that reads the inner
            // service's own future or body: never a claimed call's (its task catches it).
            let passed_on = matches!(fate, None | Some(Fate::Released))
                || matches!(fate, Some(Fate::Recorded { replayable: false, .. }));
            if message == SCRIPTED_PANIC && own.is_some() && passed_on {
                Ok(())
            } else {
                Err(format!("request {n} panicked: {message} (its key: {fate:?})"))
            }
        }
        Seen::Error { not_sent } => match (&spec.answer, own) {
            (Answer::Fails { not_sent: s, .. }, Some(_)) if s == not_sent => Ok(()),
            _ => Err(format!("request {n}: an error its inner call did not give")),
        },
        Seen::Response(a) if a.replayed() => {
            replay(case, policies, calls, (n, responded.unwrap_or(usize::MAX)), a)
        }
        // The inner service never answers problem+json: such an answer is the layer's own.
        Seen::Response(a) if a.is_problem() => {
            let held = (calls, responded.unwrap_or(usize::MAX));
            problem(case, policies, held, n, a, fate)
        }
        Seen::Response(a) => match (own, &spec.answer) {
            (None, _) => Err(format!(
                "request {n}: a {} answer that is neither a replay, the layer's own, nor from a call of its own",
                a.status
            )),
            (Some(_), Answer::Responds(resp)) if a.status == resp.status => {
                if !a.broken && a.body != resp.full_body() {
                    return Err(format!("request {n}: its body is not the inner service's"));
                }
                match fate {
                    Some(Fate::Recorded {
                        replayable: true,
                        keep,
                    }) if !a.broken => first(n, resp, policy, keep, a),
                    _ => Ok(()),
                }
            }
            _ => Err(format!(
                "request {n}: a {} answer its call did not give",
                a.status
            )),
        },
    }
}

/// The layer's own answer to request `n`: what its key held when the answer was made (the
/// calls before step `responded` of the log), or what the request itself is.
fn problem(
    case: &Case,
    policies: &[&Policy],
    (calls, responded): (&[Call], usize),
    n: usize,
    a: &Answered,
    fate: Option<Fate>,
) -> Result<(), String> {
    let spec = &case.requests[n];
    let policy = policies[n];
    let kind = problem_kind(a);
    let kind = kind.as_str();
    let applies = policy.applies_to(&spec.method.method());
    let sized = spec.body().len() as u64 <= policy.max_body;
    let json_refused = policy.fingerprint == FingerprintMode::Json && spec.json() == Json::Invalid;
    let right = match kind {
        "internal" | "upstream-timeout" | "upstream-unavailable" | "upstream-invalid-response" => {
            fate == Some(Fate::Kept)
        }
        "invalid-key" => applies && matches!(spec.key, Key::Bad(_)),
        "body-too-large" => applies && spec.key.number().is_some() && !sized,
        "invalid-json" => applies && spec.key.number().is_some() && sized && json_refused,
        "in-flight" | "mismatch" | "not-replayable" | "key-expired" if keyed(spec, policy) => {
            let key = spec.scoped_key();
            let before: Vec<&Call> = calls
                .iter()
                .filter(|c| c.key == key && c.step < responded)
                .collect();
            let same =
                |c: &Call| fingerprint(case, policies, n) == fingerprint(case, policies, c.req);
            let (holds, tombstone) = match before.last() {
                Some(h) => (
                    holds_at(h, policies[h.req], responded, a.at),
                    // A tombstone outlives its record, and the records after it.
                    before.iter().rev().find_map(|c| {
                        let p = policies[c.req];
                        tombstone_at(c, p, policy, responded, a.at).then(|| same(c))
                    }),
                ),
                None => (Holds::Nothing, None),
            };
            let same_holder = before.last().is_some_and(|h| same(h));
            let claimed = matches!(holds, Holds::Claim | Holds::Lapsing);
            let unclaimed = matches!(holds, Holds::Nothing | Holds::Lapsing);
            match kind {
                "in-flight" => claimed && same_holder,
                "mismatch" => (holds != Holds::Nothing && !same_holder) || tombstone == Some(false),
                "not-replayable" => holds == Holds::Record { replayable: false } && same_holder,
                _ => unclaimed && tombstone == Some(true),
            }
        }
        _ => false,
    };
    match right {
        true => Ok(()),
        false => Err(format!(
            "request {n}: the layer answered {kind} ({}) at {:?}, which its key and request do not explain (its call: {fate:?})",
            a.status, a.at
        )),
    }
}

/// The kind of a problem+json answer (`in-flight`).
fn problem_kind(a: &Answered) -> String {
    let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    let kind = doc["type"].as_str().unwrap();
    kind.trim_start_matches("urn:idemgate:problem:").to_string()
}

/// What a key holds.
#[derive(Debug, PartialEq)]
enum Holds {
    Nothing,
    Claim,
    /// A claim whose lease may have run out or not: it was last renewed at most a renewal
    /// period before the layer gave up on its call.
    Lapsing,
    Record {
        replayable: bool,
    },
}

/// What the key of `call` (on a route with `policy`) holds at step `step` of the log, at `at`:
/// the call's claim until it was settled (or, kept, until its lease surely ended), then its
/// record until its ttl ended.
fn holds_at(call: &Call, policy: &Policy, step: usize, at: Duration) -> Holds {
    match call.fate {
        _ if step < call.settled => {
            let (lapsing, _) = free_at(call, policy, policy);
            let over = call.last + policy.lock_ttl + Duration::from_millis(1);
            match call.fate {
                None if at > over => Holds::Nothing,
                None if at >= lapsing => Holds::Lapsing,
                _ => Holds::Claim,
            }
        }
        Some((_, Fate::Released)) | Some((_, Fate::Kept)) | None => Holds::Nothing,
        Some((done, Fate::Recorded { replayable, keep })) => match keep.ttl {
            Ttl::Forever => Holds::Record { replayable },
            Ttl::For(ttl) if at < done + ms(ttl) => Holds::Record { replayable },
            Ttl::For(_) => Holds::Nothing,
        },
    }
}

/// Whether the tombstone of `call`'s record refuses a request on `route` at `at` (its record
/// expired, the tombstone not yet).
fn tombstone_at(call: &Call, policy: &Policy, route: &Policy, step: usize, at: Duration) -> bool {
    let Some((done, Fate::Recorded { keep, .. })) = call.fate else {
        return false;
    };
    let (Ttl::For(ttl), Some(tomb)) = (keep.ttl, keep.tombstone) else {
        return false;
    };
    let _ = policy;
    step > call.settled
        && route.after_expiry == AfterExpiry::Refuse
        && at >= done + ms(ttl)
        && at < done + ms(ttl) + ms(tomb)
}

/// The first answer of a recorded call: what its replays send, but for the replay mark and
/// the dropped headers.
fn first(n: usize, resp: &Resp, policy: &Policy, keep: Keep, a: &Answered) -> Result<(), String> {
    let (headers, expiry) = without_expiry(&a.headers, policy);
    let expected = recorded_headers(resp, policy, false);
    if headers != expected {
        return Err(format!(
            "request {n}: its first answer's headers {headers:?} are not the recorded {expected:?}"
        ));
    }
    if a.trailers != resp.trailers() {
        return Err(format!("request {n}: its first answer's trailers differ"));
    }
    let expires = policy.expiry_header.is_some() && keep.ttl != Ttl::Forever;
    if expiry != expires {
        return Err(format!(
            "request {n}: its first answer has an expiry header: {expiry}, expected {expires}"
        ));
    }
    Ok(())
}

/// A replay to request `n`: the recorded answer of the call that held its key when the replay
/// was made (or, attached to a live answer, that answer as it was streamed).
fn replay(
    case: &Case,
    policies: &[&Policy],
    calls: &[Call],
    (n, responded): (usize, usize),
    a: &Answered,
) -> Result<(), String> {
    let spec = &case.requests[n];
    let policy = policies[n];
    let Some(key) = spec.scoped_key().filter(|_| keyed(spec, policy)) else {
        return Err(format!("request {n}: a replay to a request without a key"));
    };
    let Some(holder) = calls
        .iter()
        .rfind(|c| c.key == Some(key) && c.step < responded)
    else {
        return Err(format!("request {n}: a replay, but its key was never run"));
    };
    let h = holder.req;
    if fingerprint(case, policies, n) != fingerprint(case, policies, h) {
        return Err(format!(
            "request {n}: the replay of request {h}, a different request"
        ));
    }
    let Answer::Responds(resp) = &case.requests[h].answer else {
        return Err(format!(
            "request {n}: a replay of request {h}, which answered no response"
        ));
    };
    let holder_policy = policies[h];
    let fate = holder.fate.map_or(Fate::Kept, |(_, f)| f);
    // Attached to the live answer (a streamed one, before it was settled): a live copy of
    // what the call sends, which a reader that attached before the answer passed `max_body`
    // reads to its end too.
    let attached = holder_policy.stream && responded < holder.settled;
    match (fate, attached) {
        (
            Fate::Recorded {
                replayable: true,
                keep,
            },
            false,
        ) => {
            let (free, _) = free_at(holder, holder_policy, policy);
            let lapsed = match keep.ttl {
                Ttl::Forever => false,
                Ttl::For(_) => a.at >= free,
            };
            if lapsed {
                return Err(format!(
                    "request {n}: a replay at {:?} of request {h}'s record, expired at {free:?}",
                    a.at
                ));
            }
        }
        (Fate::Recorded { .. }, true) if !a.broken => {}
        (Fate::Kept, true) if a.broken => {}
        _ => {
            return Err(format!(
                "request {n}: a replay (attached: {attached}, broken: {}) of request {h}, whose key was {fate:?}",
                a.broken
            ))
        }
    }
    if a.status.as_u16() != resp.status {
        return Err(format!(
            "request {n}: replayed {} for {}",
            a.status, resp.status
        ));
    }
    let (headers, expiry) = without_expiry(&a.headers, policy);
    if let Fate::Recorded { keep, .. } = fate {
        let expires = policy.expiry_header.is_some() && keep.ttl != Ttl::Forever;
        if expiry != expires {
            return Err(format!(
                "request {n}: its replay has an expiry header: {expiry}, expected {expires}"
            ));
        }
    }
    let expected = recorded_headers(resp, policy, true);
    if headers != expected {
        return Err(format!(
            "request {n}: replayed headers {headers:?}, recorded {expected:?}"
        ));
    }
    let body = resp.full_body();
    match a.broken {
        false if a.body != body || a.trailers != resp.trailers() => Err(format!(
            "request {n}: replayed body {:?} (trailers {:?}) for {body:?} ({:?})",
            a.body,
            a.trailers,
            resp.trailers()
        )),
        true if !body.starts_with(&a.body) => Err(format!(
            "request {n}: a broken replay {:?} of {body:?}",
            a.body
        )),
        _ => Ok(()),
    }
}

/// The headers without the route's expiry header, and whether it was there.
fn without_expiry(headers: &HeaderMap, policy: &Policy) -> (HeaderMap, bool) {
    let mut headers = headers.clone();
    let had = match &policy.expiry_header {
        Some(name) => headers.remove(name).is_some(),
        None => false,
    };
    (headers, had)
}

//! The operations a case is made of, what they mean to a store, and how they are generated.
//!
//! Their `Debug` form is Rust: a shrunk sequence printed by a failing run pastes into a
//! regression case as it is (`use super::ops::*` brings every name it uses).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::record::{EntryState, StoredResponse, Token};
use idemgate::store::{ClaimTerms, Claimant, Keep};
use idemgate::time::{Ttl, MAX_DURATION};
use idemgate::AfterExpiry;
use proptest::prelude::*;

pub(super) use self::Body::*;
pub(super) use self::Life::*;
pub(super) use self::Op::*;
pub(super) use self::Outcome::*;
pub(super) use self::Span::*;

/// Keys a case uses: few, so that claimants meet on them.
pub(super) const KEYS: u8 = 4;
/// Fingerprints: the same request, or another.
const FINGERPRINTS: u8 = 2;
/// Claim tokens: a claimant retrying its own claim, or a newer one.
const TOKENS: u8 = 3;

/// The size of a large body: past Redis's staging threshold (16 KiB), and so much larger than
/// everything else an entry holds that a bounded store's byte count is a count of large bodies.
pub(super) const LARGE: usize = 20 * 1024;

/// Who acts: the key, the request's fingerprint and the claim's token, by number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Who {
    pub(super) key: u8,
    pub(super) fp: u8,
    pub(super) token: u8,
}

/// A duration as a lease, a ttl or a tombstone's life, drawn across its whole range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Span {
    /// This many hours: never over during a case.
    Hours(u8),
    /// This many milliseconds (1 to 5): surely over after the wait that precedes any
    /// operation whose answer depends on it.
    Ms(u8),
    /// `Duration::ZERO`: the config forbids it, the trait takes it; as brief as 1 ms.
    Zero,
    /// Exactly [`MAX_DURATION`].
    MaxDuration,
    /// `u64::MAX` milliseconds.
    U64MaxMs,
    /// `Duration::MAX`.
    DurationMax,
}

/// How long a record is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Life {
    /// For a span.
    For(Span),
    /// `Ttl::Forever`.
    Forever,
}

/// A response body: small, or [`LARGE`] (even: compressible; odd: not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Body {
    Small(u8),
    Large(u8),
}

/// What a completion records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Response { status: u16, body: Body },
    NotReplayable,
}

/// One call on the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    Claim {
        who: Who,
        lease: Span,
        refuse: bool,
    },
    Complete {
        who: Who,
        outcome: Outcome,
        ttl: Life,
        tombstone: Option<Span>,
    },
    Renew {
        who: Who,
        lease: Span,
    },
    Release {
        who: Who,
    },
    Evict {
        key: u8,
    },
    Inspect {
        key: u8,
    },
}

impl Op {
    /// The key the operation is on.
    pub(super) fn key(&self) -> u8 {
        match *self {
            Claim { who, .. } | Complete { who, .. } | Renew { who, .. } | Release { who } => {
                who.key
            }
            Evict { key } | Inspect { key } => key,
        }
    }
}

impl Span {
    pub(super) fn duration(self) -> Duration {
        match self {
            Hours(h) => Duration::from_secs(3600 * u64::from(h)),
            Ms(ms) => Duration::from_millis(u64::from(ms)),
            Zero => Duration::ZERO,
            MaxDuration => MAX_DURATION,
            U64MaxMs => Duration::from_millis(u64::MAX),
            DurationMax => Duration::MAX,
        }
    }

    /// Whether it ends during a case (the harness waits for its end before anything looks at
    /// what it kept); the others never do.
    pub(super) fn brief(self) -> bool {
        matches!(self, Ms(_) | Zero)
    }
}

impl Life {
    pub(super) fn ttl(self) -> Ttl {
        match self {
            For(span) => Ttl::For(span.duration()),
            Forever => Ttl::Forever,
        }
    }
}

impl Outcome {
    /// The entry state a completion writes.
    pub(super) fn state(self) -> EntryState {
        match self {
            Response { status, body } => EntryState::Completed(Arc::new(response(status, body))),
            NotReplayable => EntryState::NotReplayable,
        }
    }

    /// The status its tombstone remembers (`None`: not replayable).
    pub(super) fn status(self) -> Option<StatusCode> {
        match self {
            Response { status, .. } => Some(StatusCode::from_u16(status).unwrap()),
            NotReplayable => None,
        }
    }

    /// Whether its body is [`LARGE`].
    pub(super) fn large(self) -> bool {
        matches!(self, Response { body: Large(_), .. })
    }
}

/// The response a completion of `status` with `body` records, rebuilt the same for comparing.
pub(super) fn response(status: u16, body: Body) -> StoredResponse {
    let body = match body {
        Small(n) => Bytes::from(format!("{{\"payment\":{n}}}")),
        // Even: one byte repeated, which Redis's LZ4 shrinks under the staging threshold; odd:
        // noise it keeps as it is, written through a staging key.
        Large(n) if n % 2 == 0 => Bytes::from(vec![b'a' + n; LARGE]),
        Large(n) => {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(n);
            let noise = (0..LARGE).map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            });
            Bytes::from(noise.collect::<Vec<u8>>())
        }
    };
    StoredResponse {
        status: StatusCode::from_u16(status).unwrap(),
        headers: vec![(
            HeaderName::from_static("content-type"),
            HeaderValue::from_static("application/json"),
        )],
        body,
        trailers: Vec::new(),
        traceparent: None,
        key_source: None,
    }
}

impl Who {
    pub(super) fn claimant(self) -> Claimant {
        Claimant::new(
            key(self.key),
            Fingerprint([self.fp + 1; 32]),
            Token([self.token + 1; 16]),
        )
    }
}

/// The scoped key numbered `n`.
pub(super) fn key(n: u8) -> ScopedKey {
    ScopedKey([n + 1; 32])
}

/// The terms of a claim.
pub(super) fn terms(lease: Span, refuse: bool) -> ClaimTerms {
    let after = match refuse {
        true => AfterExpiry::Refuse,
        false => AfterExpiry::Run,
    };
    ClaimTerms::lease(lease.duration()).after_expiry(after)
}

/// How a completion keeps its record.
pub(super) fn keep(ttl: Life, tombstone: Option<Span>) -> Keep {
    Keep {
        ttl: ttl.ttl(),
        tombstone: tombstone.map(Span::duration),
    }
}

// === generation ===

fn who() -> impl Strategy<Value = Who> {
    (0..KEYS, 0..FINGERPRINTS, 0..TOKENS).prop_map(|(key, fp, token)| Who { key, fp, token })
}

/// Spans shrink towards hours, the plainest case; the edges are drawn as often as brief ones.
fn span() -> impl Strategy<Value = Span> {
    prop_oneof![
        4 => (1..=24u8).prop_map(Hours),
        3 => (1..=5u8).prop_map(Ms),
        1 => Just(Zero),
        1 => Just(MaxDuration),
        1 => Just(U64MaxMs),
        1 => Just(DurationMax),
    ]
}

fn life() -> impl Strategy<Value = Life> {
    prop_oneof![6 => span().prop_map(For), 1 => Just(Forever)]
}

fn outcome() -> impl Strategy<Value = Outcome> {
    let status = prop::sample::select(vec![200u16, 201, 402, 500]);
    let body = prop_oneof![5 => (0..4u8).prop_map(Small), 1 => (0..4u8).prop_map(Large)];
    prop_oneof![
        5 => (status, body).prop_map(|(status, body)| Response { status, body }),
        1 => Just(NotReplayable),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        7 => (who(), span(), any::<bool>())
            .prop_map(|(who, lease, refuse)| Claim { who, lease, refuse }),
        5 => (who(), outcome(), life(), prop::option::of(span())).prop_map(
            |(who, outcome, ttl, tombstone)| Complete { who, outcome, ttl, tombstone }
        ),
        2 => (who(), span()).prop_map(|(who, lease)| Renew { who, lease }),
        2 => who().prop_map(|who| Release { who }),
        1 => (0..KEYS).prop_map(|key| Evict { key }),
        3 => (0..KEYS).prop_map(|key| Inspect { key }),
    ]
}

/// A case: up to 40 operations.
pub(super) fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..40)
}

//! The reference model of the store contract: a map from each key to its live record (a claim
//! or a completed record) and its live tombstone, each with when it was written and how long it
//! lives, and the operations of `Store` and `Inspect` on it, written from their documentation.
//!
//! Time is the real clock, read around each call (a [`Window`]): a backend's clock (Redis's,
//! PostgreSQL's) cannot be stopped. So the model is tolerant in three stated ways, and exact
//! everywhere else:
//! - a remaining time (`expires_in`) is checked to lie between what it was at the latest and at
//!   the earliest moment the two calls could have run, within [`SLACK`] for the stores'
//!   millisecond rounding; behind a local cache, which reckons a record's expiry from when it
//!   asked the store for it, it may also be short by as much as the longest call took;
//! - an entry written for a brief span (0 to 5 ms) is never looked at while it might still live:
//!   the harness first waits until it has surely ended ([`Model::brief_until`]);
//! - when a bounded store must evict for room and two candidates could be the closest to expiry
//!   (written within the same milliseconds), the model follows each choice, and drops the ones
//!   the store's later answers contradict ([`Possible`]).

use std::time::Duration;

use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::record::{EntryState, StoredResponse};
use idemgate::store::{self, Inspected, StoreError};
use idemgate::time::MAX_DURATION;
use tokio::time::Instant;

use super::ops::*;

/// How far a store's remaining time may stray from the model's window: millisecond rounding
/// (Redis's `PTTL`, PostgreSQL's `extract`, the embedded store's ms expiries) and the wall clock
/// the stores read against the monotonic one the harness reads.
const SLACK: Duration = Duration::from_millis(5);

/// How long after a brief entry's end the harness waits before anything looks at it.
const MARGIN: Duration = Duration::from_millis(20);

/// Most possible states followed at once; past it a case is too ambiguous to judge.
const MAX_STATES: usize = 256;

/// What sets a backend apart in the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Profile {
    /// The bounds of an in-process store (`max_entries`, `max_bytes`); none for the shared
    /// stores, which never evict for room.
    pub(super) bounds: Option<Bounds>,
    /// How it keeps a record asked to be kept forever.
    pub(super) forever: Forever,
    /// Whether a local cache answers replays.
    pub(super) cached: bool,
}

/// A bounded store's limits, in the model's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bounds {
    /// `max_entries`: claims, records and tombstones each count one.
    pub(super) max_entries: usize,
    /// `max_bytes`, as a number of large bodies: the store is configured with room for this
    /// many and a half, and everything else a case writes weighs less than the half.
    pub(super) max_large: usize,
}

/// How a store keeps a record asked to be kept forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Forever {
    /// Until an eviction: no expiry (the durable stores, and memory for as long as it lives).
    NoExpiry,
    /// For [`MAX_DURATION`] (`Ttl::Forever`'s rule for a store that cannot keep it: Redis).
    ForMaxDuration,
}

/// When one call ran: between two instants of the monotonic clock, and two readings of the
/// wall clock in ms since the epoch (what records' `written_ms` are).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Window {
    /// Its place in the case (calls of one step share their clock readings in a store).
    pub(super) step: usize,
    pub(super) start: Instant,
    pub(super) end: Instant,
    pub(super) wall: (u64, u64),
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (from, to) = self.wall;
        write!(f, "step {} ({from}..={to} ms)", self.step)
    }
}

/// How long an entry lives from the window it was written (or renewed) in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lives {
    /// A brief span: surely over by the instant.
    Briefly(Duration, Instant),
    /// This long (bounded by [`MAX_DURATION`]).
    For(Duration),
    /// Until evicted.
    Forever,
}

impl Lives {
    fn of(span: Span, since: Window) -> Self {
        Self::spanning(span.duration(), span.brief(), since)
    }

    fn spanning(d: Duration, brief: bool, since: Window) -> Self {
        match brief {
            true => Lives::Briefly(d, since.end + d.max(Duration::from_millis(1)) + MARGIN),
            false => Lives::For(d.min(MAX_DURATION)),
        }
    }
}

/// A key's live claim or completed record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    fp: u8,
    token: u8,
    held: Held,
    written: Window,
    lives: Lives,
    // When its life began: its writing, or the renewal of a claim.
    since: Window,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Held {
    Claim,
    Done(Outcome),
}

/// A key's live tombstone.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tomb {
    fp: u8,
    outcome: Outcome,
    // The record's ttl in ms: the tombstone says it expired this long after it was written.
    ttl_ms: u64,
    written: Window,
    lives: Lives,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Slot {
    record: Option<Record>,
    tomb: Option<Tomb>,
}

/// One state the store may be in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Model {
    slots: Vec<Slot>,
    profile: Profile,
    // The longest any call of the case took so far.
    longest_call: Duration,
}

/// How much longer an entry should say it lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Left {
    /// Between these.
    Between(Duration, Duration),
    /// No expiry (`None`).
    Never,
}

/// What a claim should answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Expected {
    Claimed,
    Replay(Outcome, Left),
    InFlight,
    NotReplayable,
    Mismatch,
    Expired {
        outcome: Outcome,
        ttl_ms: u64,
        written: Window,
    },
    Full,
}

/// What an inspection should show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Seen {
    Record {
        fp: u8,
        held: Held,
        written: Window,
        left: Left,
    },
    Tomb {
        fp: u8,
        outcome: Outcome,
        ttl_ms: u64,
        written: Window,
        left: Left,
    },
}

/// What a call should answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Expect {
    Claim(Expected),
    Yes(bool),
    Inspect(Option<Seen>),
}

/// What a call answered.
#[derive(Debug)]
pub(super) enum Answer {
    Claim(Result<store::Claim, StoreError>),
    Yes(Result<bool, StoreError>),
    Inspect(Result<Option<Inspected>, StoreError>),
}

/// Which entry a bounded store evicts for room.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Record(usize),
    Tomb(usize),
}

impl Model {
    pub(super) fn new(profile: Profile) -> Self {
        Model {
            slots: vec![Slot::default(); KEYS as usize],
            profile,
            longest_call: Duration::ZERO,
        }
    }

    /// Until when the harness must wait before `op`, so that no entry its answer depends on
    /// is still within a brief span: the key's entries, and on a bounded store every entry when
    /// `op` may have to make room.
    pub(super) fn brief_until(&self, op: &Op) -> Option<Instant> {
        let everywhere =
            self.profile.bounds.is_some() && matches!(op, Claim { .. } | Complete { .. });
        let slots: Vec<&Slot> = match everywhere {
            true => self.slots.iter().collect(),
            false => vec![&self.slots[op.key() as usize]],
        };
        let lives = slots.iter().flat_map(|s| {
            let record = s.record.as_ref().map(|r| r.lives);
            record.into_iter().chain(s.tomb.as_ref().map(|t| t.lives))
        });
        lives
            .filter_map(|l| match l {
                Lives::Briefly(_, by) => Some(by),
                _ => None,
            })
            .max()
    }

    /// Forget every brief entry that has surely ended by `now`.
    pub(super) fn lapse(&mut self, now: Instant) {
        let over = |l: &Lives| matches!(*l, Lives::Briefly(_, by) if by <= now);
        for slot in &mut self.slots {
            if slot.record.as_ref().is_some_and(|r| over(&r.lives)) {
                slot.record = None;
            }
            if slot.tomb.as_ref().is_some_and(|t| over(&t.lives)) {
                slot.tomb = None;
            }
        }
    }

    /// Every answer the contract allows to `op` run in `now`, each with the state it leaves.
    pub(super) fn step(&self, op: &Op, now: Window) -> Vec<(Expect, Model)> {
        let k = op.key() as usize;
        let slot = &self.slots[k];
        let same = |e: Expect| vec![(e, self.clone())];
        match *op {
            Claim { who, lease, refuse } => {
                if let Some(r) = &slot.record {
                    return same(Expect::Claim(self.decide(r, who, now)));
                }
                if let (true, Some(t)) = (refuse, &slot.tomb) {
                    return same(Expect::Claim(match t.fp == who.fp {
                        true => Expected::Expired {
                            outcome: t.outcome,
                            ttl_ms: t.ttl_ms,
                            written: t.written,
                        },
                        false => Expected::Mismatch,
                    }));
                }
                let claim = Record {
                    fp: who.fp,
                    token: who.token,
                    held: Held::Claim,
                    written: now,
                    lives: Lives::of(lease, now),
                    since: now,
                };
                let made = self.clone().make_room(true);
                let answer = |(mut m, full): (Model, bool)| match full {
                    true => (Expect::Claim(Expected::Full), m),
                    false => {
                        m.slots[k].record = Some(claim.clone());
                        (Expect::Claim(Expected::Claimed), m)
                    }
                };
                made.into_iter().map(answer).collect()
            }
            Complete {
                who,
                outcome,
                ttl,
                tombstone,
            } => {
                match &slot.record {
                    Some(r) if r.token != who.token => return same(Expect::Yes(false)),
                    // Its own completion, already there.
                    Some(r) if r.held != Held::Claim => return same(Expect::Yes(true)),
                    Some(_) => {}
                    // Nothing live: written unless, on a route that keeps tombstones, one says
                    // another record was there.
                    None if tombstone.is_some() && slot.tomb.is_some() => {
                        return same(Expect::Yes(false))
                    }
                    None => {}
                }
                let mut next = self.clone();
                let lives = match ttl {
                    For(span) => Lives::of(span, now),
                    Forever => Lives::Forever,
                };
                next.slots[k].record = Some(Record {
                    fp: who.fp,
                    token: who.token,
                    held: Held::Done(outcome),
                    written: now,
                    lives,
                    since: now,
                });
                if let (For(ttl), Some(after)) = (ttl, tombstone) {
                    let d = ttl.duration().min(MAX_DURATION);
                    let whole = d.saturating_add(after.duration());
                    next.slots[k].tomb = Some(Tomb {
                        fp: who.fp,
                        outcome,
                        ttl_ms: (d.as_millis() as u64).max(1),
                        written: now,
                        lives: Lives::spanning(whole, ttl.brief() && after.brief(), now),
                    });
                }
                let made = next.make_room(false);
                made.into_iter()
                    .map(|(m, _)| (Expect::Yes(true), m))
                    .collect()
            }
            Renew { who, lease } => {
                let mut next = self.clone();
                let ours = match &mut next.slots[k].record {
                    Some(r) if r.held == Held::Claim && r.token == who.token => {
                        r.lives = Lives::of(lease, now);
                        r.since = now;
                        true
                    }
                    _ => false,
                };
                vec![(Expect::Yes(ours), next)]
            }
            Release { who } => {
                let mut next = self.clone();
                let ours = matches!(&slot.record, Some(r) if r.held == Held::Claim && r.token == who.token);
                if ours {
                    next.slots[k].record = None;
                }
                vec![(Expect::Yes(ours), next)]
            }
            Evict { .. } => {
                let mut next = self.clone();
                let existed = slot.record.is_some() || slot.tomb.is_some();
                next.slots[k] = Slot::default();
                vec![(Expect::Yes(existed), next)]
            }
            Inspect { .. } => same(Expect::Inspect(self.seen(slot, now))),
        }
    }

    /// `Claim::decide`, from the contract's words: our own claim, another request's entry,
    /// then what the entry holds.
    fn decide(&self, r: &Record, who: Who, now: Window) -> Expected {
        match r.held {
            Held::Claim if r.token == who.token => Expected::Claimed,
            _ if r.fp != who.fp => Expected::Mismatch,
            Held::Claim => Expected::InFlight,
            Held::Done(NotReplayable) => Expected::NotReplayable,
            Held::Done(outcome) => Expected::Replay(outcome, self.left(r.lives, r.since, now)),
        }
    }

    /// What an inspection of `slot` shows: its record, or else its tombstone.
    fn seen(&self, slot: &Slot, now: Window) -> Option<Seen> {
        if let Some(r) = &slot.record {
            return Some(Seen::Record {
                fp: r.fp,
                held: r.held,
                written: r.written,
                left: self.left(r.lives, r.since, now),
            });
        }
        slot.tomb.as_ref().map(|t| Seen::Tomb {
            fp: t.fp,
            outcome: t.outcome,
            ttl_ms: t.ttl_ms,
            written: t.written,
            left: self.left(t.lives, t.written, now),
        })
    }

    /// How much longer an entry living `lives` from `since` has, seen in `now`.
    fn left(&self, lives: Lives, since: Window, now: Window) -> Left {
        let d = match lives {
            Lives::For(d) => d,
            Lives::Forever if self.profile.forever == Forever::NoExpiry => return Left::Never,
            Lives::Forever => MAX_DURATION,
            // Never looked at while it may live (see `brief_until`); whatever is left of it.
            Lives::Briefly(_, by) => {
                return Left::Between(
                    Duration::ZERO,
                    by.saturating_duration_since(now.start) + SLACK,
                )
            }
        };
        let most = now.start.saturating_duration_since(since.end);
        let least = now.end.saturating_duration_since(since.start);
        let short = match self.profile.cached {
            true => SLACK + self.longest_call,
            false => SLACK,
        };
        Left::Between(
            d.saturating_sub(least).saturating_sub(short),
            d.saturating_sub(most) + SLACK,
        )
    }

    // === bounds ===

    /// Room for one more entry (`adding`, a claim) or under the bounds after a completion: the
    /// records closest to expiry evicted, each with its tombstone; a claim refused as full when
    /// only claims and records kept forever are left. Every way the store may have chosen, and
    /// whether the claim was refused.
    fn make_room(self, adding: bool) -> Vec<(Model, bool)> {
        let mut made = Vec::new();
        self.evict_until_under(adding, &mut made);
        made
    }

    fn evict_until_under(self, adding: bool, made: &mut Vec<(Model, bool)>) {
        let Some(bounds) = self.profile.bounds else {
            made.push((self, false));
            return;
        };
        let entries: usize = self
            .slots
            .iter()
            .map(|s| usize::from(s.record.is_some()) + usize::from(s.tomb.is_some()))
            .sum();
        let large = self
            .slots
            .iter()
            .filter(
                |s| matches!(&s.record, Some(r) if matches!(r.held, Held::Done(o) if o.large())),
            )
            .count();
        let over = entries + usize::from(adding) > bounds.max_entries || large > bounds.max_large;
        if !over {
            made.push((self, false));
            return;
        }
        let first = self.closest_to_expiry();
        if first.is_empty() {
            made.push((self, adding));
            return;
        }
        for victim in first {
            let mut next = self.clone();
            match victim {
                // A record takes its tombstone along: its key did not expire.
                Victim::Record(k) => next.slots[k] = Slot::default(),
                Victim::Tomb(k) => next.slots[k].tomb = None,
            }
            next.evict_until_under(adding, made);
        }
    }

    /// The evictable entries (completed records not kept forever, tombstones) that may be the
    /// closest to expiry: those no other is surely closer than.
    fn closest_to_expiry(&self) -> Vec<Victim> {
        // (victim, step written, duration, earliest and latest expiry)
        let mut candidates = Vec::new();
        let lasting = |lives: Lives| match lives {
            Lives::For(d) | Lives::Briefly(d, _) => Some(d),
            Lives::Forever => None,
        };
        for (k, slot) in self.slots.iter().enumerate() {
            if let Some(r) = slot.record.as_ref().filter(|r| r.held != Held::Claim) {
                if let Some(d) = lasting(r.lives) {
                    candidates.push((Victim::Record(k), r.since, d));
                }
            }
            if let Some(t) = &slot.tomb {
                if let Some(d) = lasting(t.lives) {
                    candidates.push((Victim::Tomb(k), t.written, d));
                }
            }
        }
        // Written in one step, two entries share the store's clock reading: their durations
        // order them. Otherwise only expiries further apart than the rounding do.
        let before = |(_, wa, da): &(Victim, Window, Duration),
                      (_, wb, db): &(Victim, Window, Duration)| {
            match wa.step == wb.step {
                true => da < db,
                false => wa.end + *da + SLACK < wb.start + *db,
            }
        };
        candidates
            .iter()
            .filter(|c| !candidates.iter().any(|other| before(other, c)))
            .map(|c| c.0)
            .collect()
    }
}

/// Every state the store may be in after the calls so far: one, but for evictions for room
/// between entries equally close to expiry.
pub(super) struct Possible {
    states: Vec<Model>,
}

impl Possible {
    pub(super) fn new(profile: Profile) -> Self {
        Possible {
            states: vec![Model::new(profile)],
        }
    }

    /// See [`Model::brief_until`], in every possible state.
    pub(super) fn brief_until(&self, op: &Op) -> Option<Instant> {
        self.states.iter().filter_map(|m| m.brief_until(op)).max()
    }

    /// See [`Model::lapse`].
    pub(super) fn lapse(&mut self, now: Instant) {
        for m in &mut self.states {
            m.lapse(now);
        }
    }

    /// Take in the store's answer to `op`: the states whose expectation it meets go on; none
    /// is a disagreement, described.
    pub(super) fn observe(&mut self, op: &Op, now: Window, answer: &Answer) -> Result<(), String> {
        let mut next: Vec<Model> = Vec::new();
        let mut expected: Vec<String> = Vec::new();
        for state in &mut self.states {
            let took = now.end.saturating_duration_since(now.start);
            state.longest_call = state.longest_call.max(took);
        }
        for state in &self.states {
            for (expect, m) in state.step(op, now) {
                match expect.check(answer) {
                    Ok(()) if !next.contains(&m) => next.push(m),
                    Ok(()) => {}
                    Err(why) if !expected.contains(&why) => expected.push(why),
                    Err(_) => {}
                }
            }
        }
        if next.is_empty() {
            return Err(format!(
                "the store answered {}; the model expected {}",
                describe(answer),
                expected.join(", or ")
            ));
        }
        if next.len() > MAX_STATES {
            return Err(format!("{} possible states: too ambiguous", next.len()));
        }
        self.states = next;
        Ok(())
    }
}

// === comparing ===

impl Expect {
    /// Whether `answer` is this; if not, this expectation, described.
    fn check(&self, answer: &Answer) -> Result<(), String> {
        let met = match (self, answer) {
            (Expect::Claim(e), Answer::Claim(a)) => claim_meets(e, a),
            (Expect::Yes(e), Answer::Yes(Ok(a))) => e == a,
            (Expect::Inspect(e), Answer::Inspect(Ok(a))) => inspected_meets(e.as_ref(), a.as_ref()),
            _ => false,
        };
        match met {
            true => Ok(()),
            false => Err(format!("{self:?}")),
        }
    }
}

fn claim_meets(e: &Expected, a: &Result<store::Claim, StoreError>) -> bool {
    match (e, a) {
        (Expected::Full, Err(StoreError::Full)) => true,
        (_, Err(_)) => false,
        (Expected::Claimed, Ok(store::Claim::Claimed))
        | (Expected::InFlight, Ok(store::Claim::InFlight))
        | (Expected::NotReplayable, Ok(store::Claim::NotReplayable))
        | (Expected::Mismatch, Ok(store::Claim::Mismatch)) => true,
        (Expected::Replay(outcome, left), Ok(store::Claim::Replay(replay))) => {
            same_response(*outcome, &replay.response) && meets(*left, replay.expires_in)
        }
        (
            Expected::Expired {
                outcome,
                ttl_ms,
                written,
            },
            Ok(store::Claim::Expired {
                tombstone,
                recorded_ms,
            }),
        ) => {
            tombstone.status == outcome.status()
                && Some(tombstone.expired_ms) == recorded_ms.checked_add(*ttl_ms)
                && within(*recorded_ms, *written)
        }
        _ => false,
    }
}

fn inspected_meets(e: Option<&Seen>, a: Option<&Inspected>) -> bool {
    let (e, a) = match (e, a) {
        (None, None) => return true,
        (Some(e), Some(a)) => (e, a),
        _ => return false,
    };
    let entry = &a.entry;
    match (e, &entry.state) {
        (
            Seen::Record {
                fp,
                held,
                written,
                left,
            },
            state,
        ) => {
            let state_met = match (held, state) {
                (Held::Claim, EntryState::InFlight) => true,
                (Held::Done(NotReplayable), EntryState::NotReplayable) => true,
                (Held::Done(outcome), EntryState::Completed(r)) => same_response(*outcome, r),
                _ => false,
            };
            state_met
                && entry.fingerprint == fingerprint(*fp)
                && within(entry.written_ms, *written)
                && meets(*left, a.expires_in)
        }
        (
            Seen::Tomb {
                fp,
                outcome,
                ttl_ms,
                written,
                left,
            },
            EntryState::Expired(tombstone),
        ) => {
            entry.fingerprint == fingerprint(*fp)
                && tombstone.status == outcome.status()
                && Some(tombstone.expired_ms) == entry.written_ms.checked_add(*ttl_ms)
                && within(entry.written_ms, *written)
                && meets(*left, a.expires_in)
        }
        _ => false,
    }
}

fn fingerprint(fp: u8) -> Fingerprint {
    Fingerprint([fp + 1; 32])
}

fn same_response(outcome: Outcome, r: &StoredResponse) -> bool {
    match outcome {
        Response { status, body } => *r == response(status, body),
        NotReplayable => false,
    }
}

fn meets(left: Left, expires_in: Option<Duration>) -> bool {
    match (left, expires_in) {
        (Left::Never, None) => true,
        (Left::Between(least, most), Some(d)) => least <= d && d <= most,
        _ => false,
    }
}

/// Whether a written-at time in ms lies in the window's wall-clock readings (to the ms).
fn within(ms: u64, w: Window) -> bool {
    w.wall.0.saturating_sub(1) <= ms && ms <= w.wall.1 + 1
}

/// An answer in a line (a body by its length and first byte, not its 20 KiB).
pub(super) fn describe(answer: &Answer) -> String {
    let replay = |r: &StoredResponse| {
        let first = r.body.first().map(|&b| b as char).unwrap_or(' ');
        format!(
            "{} with {} bytes of body ({first:?}...)",
            r.status.as_u16(),
            r.body.len()
        )
    };
    match answer {
        Answer::Claim(Ok(store::Claim::Replay(r))) => format!(
            "Replay({}, expires_in {:?})",
            replay(&r.response),
            r.expires_in
        ),
        Answer::Claim(Ok(c)) => format!("{c:?}"),
        Answer::Claim(Err(e)) | Answer::Yes(Err(e)) | Answer::Inspect(Err(e)) => {
            format!("the error {e}")
        }
        Answer::Yes(Ok(b)) => format!("{b}"),
        Answer::Inspect(Ok(None)) => "nothing".into(),
        Answer::Inspect(Ok(Some(i))) => {
            let state = match &i.entry.state {
                EntryState::Completed(r) => format!("Completed({})", replay(r)),
                other => format!("{other:?}"),
            };
            format!(
                "{state} of fingerprint {}, written at {} ms, expires_in {:?}",
                i.entry.fingerprint.0[0].wrapping_sub(1),
                i.entry.written_ms,
                i.expires_in
            )
        }
    }
}

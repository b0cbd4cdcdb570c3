//! Streamed answers (`stream = true`). The claimed call's task reads the upstream's body onto a
//! [`Tape`]; the client, and any duplicate that attaches while the answer is live, read the tape
//! at their own pace; when the body ends, the tape is the record.
//!
//! Bounded memory: within `max_body` the tape keeps every chunk (they are the record); past it
//! the answer is recorded as not replayable and the tape keeps only what its slowest reader has
//! not read yet, waiting for readers before it holds more than `max_body`. A reader that goes
//! away (a client that disconnects) never holds the upstream call back.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::{Notify, OwnedSemaphorePermit};

use super::body::{joined, BoxError};
use super::metrics::Unsettled;
use super::sse;
use crate::record::fingerprint::Fingerprint;
use crate::record::key::ScopedKey;
use crate::record::StoredResponse;

/// The live answer of one claimed key.
pub(super) struct Tape {
    /// The answer's status and end-to-end headers (no body).
    pub(super) head: Arc<StoredResponse>,
    /// The fingerprint of the request that claimed the key: only its duplicates attach.
    fingerprint: Fingerprint,
    /// How long the record will live (`None`: forever), for the expiry header of attachers.
    pub(super) lives: Option<Duration>,
    cap: u64,
    state: Mutex<TapeState>,
    // Woken when a chunk is added or the tape ends.
    grown: Notify,
    // Woken when a reader advances or leaves.
    read: Notify,
}

struct TapeState {
    // The index (in the whole answer) of `chunks[0]`.
    base: usize,
    chunks: VecDeque<Bytes>,
    // Bytes in `chunks`, and bytes ever written.
    held: u64,
    total: u64,
    // Set once the body has ended: whether it ended whole.
    ended: Option<bool>,
    // The trailers that came after the body, if any.
    trailers: Option<HeaderMap>,
    // Each reader's next chunk index; `None` once it is gone.
    readers: Vec<Option<usize>>,
}

impl TapeState {
    /// The answer so far, in one buffer: within `max_body` the tape holds all of it.
    fn whole(&self) -> Bytes {
        debug_assert_eq!(self.base, 0, "nothing is let go of within the cap");
        joined(self.chunks.iter().cloned().collect(), self.held)
    }

    /// Let go of the chunks every reader has read.
    fn trim(&mut self) {
        let end = self.base + self.chunks.len();
        let slowest = self.readers.iter().flatten().min().copied().unwrap_or(end);
        while self.base < slowest {
            let Some(chunk) = self.chunks.pop_front() else {
                break;
            };
            self.held -= chunk.len() as u64;
            self.base += 1;
        }
    }

    /// The next chunk for the reader in `slot`, moving it past that chunk; `None` when it has
    /// read all the tape holds so far.
    fn advance(&mut self, slot: usize) -> Option<Bytes> {
        let at = self.readers.get_mut(slot)?.as_mut()?;
        let chunk = self.chunks.get(at.checked_sub(self.base)?)?.clone();
        *at += 1;
        Some(chunk)
    }
}

/// A live answer's body broke off midway (the upstream failed or went silent).
#[derive(Debug)]
pub(super) struct BrokenOff;

impl std::fmt::Display for BrokenOff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the upstream's answer broke off midway")
    }
}

impl std::error::Error for BrokenOff {}

/// Why the upstream's body did not reach its end.
#[derive(Debug)]
pub(super) enum Cut {
    /// No data for this long (the route's `upstream_timeout`).
    Silent(Duration),
    /// The body failed.
    Failed(BoxError),
}

impl Cut {
    /// How the call is counted in `idemgate_calls_unsettled_total`.
    pub(super) fn reason(&self) -> Unsettled {
        match self {
            Cut::Silent(_) => Unsettled::timeout,
            Cut::Failed(_) => Unsettled::failed,
        }
    }
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cut::Silent(idle) => {
                write!(
                    f,
                    "no data from the upstream for {idle:?} (upstream_timeout)"
                )
            }
            Cut::Failed(e) => e.fmt(f),
        }
    }
}

impl Tape {
    pub(super) fn new(
        head: Arc<StoredResponse>,
        fingerprint: Fingerprint,
        lives: Option<Duration>,
        cap: u64,
    ) -> Arc<Self> {
        Arc::new(Tape {
            head,
            fingerprint,
            lives,
            cap,
            state: Mutex::new(TapeState {
                base: 0,
                chunks: VecDeque::new(),
                held: 0,
                total: 0,
                ended: None,
                trailers: None,
                readers: Vec::new(),
            }),
            grown: Notify::new(),
            read: Notify::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, TapeState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Append a chunk of the answer. Past `max_body`, wait until the readers leave the tape
    /// holding at most `max_body`.
    pub(super) async fn push(&self, chunk: Bytes) {
        {
            let mut st = self.state();
            st.total += chunk.len() as u64;
            st.held += chunk.len() as u64;
            st.chunks.push_back(chunk);
        }
        self.grown.notify_waiters();
        loop {
            let mut read = pin!(self.read.notified());
            read.as_mut().enable();
            {
                let mut st = self.state();
                if st.total <= self.cap {
                    return;
                }
                st.trim();
                if st.held <= self.cap {
                    return;
                }
            }
            read.await;
        }
    }

    /// Copy `body` onto the tape until it ends, its trailers included; an error when it fails,
    /// or when it stays silent for `idle` (the route's `upstream_timeout`).
    pub(super) async fn record_from(&self, mut body: Body, idle: Duration) -> Result<(), Cut> {
        loop {
            let frame = tokio::time::timeout(idle, body.frame())
                .await
                .map_err(|_| Cut::Silent(idle))?;
            let Some(frame) = frame else { return Ok(()) };
            match frame.map_err(|e| Cut::Failed(e.into()))?.into_data() {
                Ok(data) => self.push(data).await,
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        self.state().trailers = Some(trailers);
                    }
                }
            }
        }
    }

    /// The body has ended, whole or not: readers get the rest, then the end or an error.
    pub(super) fn finish(&self, whole: bool) {
        self.state().ended = Some(whole);
        self.grown.notify_waiters();
    }

    /// End the tape with an error unless it has ended: its recording went away first.
    fn abandon(&self) {
        let mut st = self.state();
        if st.ended.is_none() {
            st.ended = Some(false);
            drop(st);
            self.grown.notify_waiters();
        }
    }

    /// The whole answer and its trailers when it fits in `max_body` (it is then replayable).
    pub(super) fn recorded(&self) -> Option<(Bytes, Option<HeaderMap>)> {
        let st = self.state();
        if st.total > self.cap {
            return None;
        }
        Some((st.whole(), st.trailers.clone()))
    }

    /// A reader from the first byte, or (`last_event_id`) from after the event with that id
    /// when the answer is an event stream that has it. `None` once the tape no longer holds
    /// the whole answer (past `max_body`).
    fn reader(self: &Arc<Self>, last_event_id: Option<&[u8]>) -> Option<Reader> {
        let mut st = self.state();
        if st.total > self.cap {
            return None;
        }
        let skip = match last_event_id {
            Some(_) => sse::resume_at(&self.head, &st.whole(), last_event_id),
            None => 0,
        };
        Some(self.place(&mut st, skip))
    }

    /// A reader from where the tape starts, skipping `skip` bytes.
    fn place(self: &Arc<Self>, st: &mut TapeState, skip: usize) -> Reader {
        st.readers.push(Some(st.base));
        Reader {
            tape: self.clone(),
            slot: st.readers.len() - 1,
            skip,
            trailed: false,
            _permit: None,
        }
    }

    /// The reader of the client whose request is being answered, from the first byte (a new
    /// tape holds the whole answer).
    pub(super) fn first_reader(self: &Arc<Self>) -> Reader {
        self.place(&mut self.state(), 0)
    }
}

/// One client's place on a tape.
pub(super) struct Reader {
    tape: Arc<Tape>,
    slot: usize,
    // Bytes still to skip from where it stands (a resumed event stream).
    skip: usize,
    // Whether it has passed on the trailers.
    trailed: bool,
    // An attached duplicate holds one of its route's waiter permits until it is done.
    _permit: Option<OwnedSemaphorePermit>,
}

impl Reader {
    /// The next chunk, then the trailers if any; `None` at the end of a whole answer.
    async fn next(&mut self) -> Option<Result<Frame<Bytes>, BrokenOff>> {
        loop {
            let mut grown = pin!(self.tape.grown.notified());
            grown.as_mut().enable();
            {
                let mut st = self.tape.state();
                if let Some(mut chunk) = st.advance(self.slot) {
                    drop(st);
                    self.tape.read.notify_waiters();
                    if self.skip > 0 {
                        let skipped = self.skip.min(chunk.len());
                        chunk = chunk.slice(skipped..);
                        self.skip -= skipped;
                    }
                    if chunk.is_empty() {
                        continue;
                    }
                    return Some(Ok(Frame::data(chunk)));
                }
                match st.ended {
                    Some(true) => {
                        let trailers = (!self.trailed).then(|| st.trailers.clone()).flatten();
                        self.trailed = true;
                        return trailers.map(|t| Ok(Frame::trailers(t)));
                    }
                    Some(false) => return Some(Err(BrokenOff)),
                    None => {}
                }
            }
            grown.await;
        }
    }

    /// Whether this reader skips the start of the answer (a resumed event stream).
    pub(super) fn resumes(&self) -> bool {
        self.skip > 0
    }

    /// The reader as a response body.
    pub(super) fn into_body(self) -> Body {
        let frames = futures_util::stream::unfold(self, |mut reader| async move {
            let frame = reader.next().await?;
            Some((frame, reader))
        });
        Body::new(StreamBody::new(frames))
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Some(place) = self.tape.state().readers.get_mut(self.slot) {
            *place = None;
        }
        self.tape.read.notify_waiters();
    }
}

/// The live answers of this process, by key, for duplicates to attach to.
#[derive(Default)]
pub(crate) struct LiveAnswers {
    tapes: Mutex<Offers>,
    // Woken when a tape is offered, so that a waiting duplicate attaches at once.
    opened: Notify,
}

/// The tapes on offer, each with the serial number of its offer.
#[derive(Default)]
struct Offers {
    last: u64,
    by_key: HashMap<ScopedKey, (u64, Arc<Tape>)>,
}

impl LiveAnswers {
    fn map(&self) -> MutexGuard<'_, Offers> {
        self.tapes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Offer `tape` to duplicates of `key` until the returned guard is dropped.
    pub(super) fn open(self: &Arc<Self>, key: ScopedKey, tape: &Arc<Tape>) -> OnAir {
        {
            let mut offers = self.map();
            offers.last += 1;
            let serial = offers.last;
            offers.by_key.insert(key, (serial, tape.clone()));
        }
        self.opened.notify_waiters();
        OnAir {
            answers: self.clone(),
            key,
            tape: tape.clone(),
        }
    }

    /// A reader on the live answer of `key` for a duplicate of the request that claimed it,
    /// holding the waiter permit `permit` gives (asked for only once there is a reader) until
    /// it is done; `None` when no such answer is live here, it is already past `max_body`, or
    /// no permit is given.
    pub(super) fn attach(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        last_event_id: Option<&[u8]>,
        permit: impl FnOnce() -> Option<OwnedSemaphorePermit>,
    ) -> Option<(Arc<Tape>, Reader)> {
        let tape = self.map().by_key.get(key)?.1.clone();
        if tape.fingerprint != *fingerprint {
            return None;
        }
        let mut reader = tape.reader(last_event_id)?;
        reader._permit = Some(permit()?);
        Some((tape, reader))
    }

    /// A future that ends when a live answer of `key` is offered here after this call (other
    /// than the one offered now, if any): made before a duplicate tries to attach, it wakes the
    /// duplicate for an answer offered after that try.
    pub(super) fn offered<'a>(&'a self, key: &'a ScopedKey) -> impl Future<Output = ()> + 'a {
        // Made now: `notify_waiters` wakes a `Notified` from its creation on.
        let first = self.opened.notified();
        let now = self.tape_of(key);
        async move {
            let mut opened = pin!(first);
            loop {
                opened.as_mut().await;
                opened.set(self.opened.notified());
                if self.tape_of(key).is_some_and(|tape| Some(tape) != now) {
                    return;
                }
            }
        }
    }

    /// The serial number of the offer of `key`'s tape, if any.
    fn tape_of(&self, key: &ScopedKey) -> Option<u64> {
        self.map().by_key.get(key).map(|(serial, _)| *serial)
    }
}

/// A tape offered to duplicates; withdrawn when dropped, and ended with an error if its
/// recording went away before its end (its task panicked, or was dropped at shutdown), so that
/// no reader waits for a chunk that will never come.
pub(super) struct OnAir {
    answers: Arc<LiveAnswers>,
    key: ScopedKey,
    tape: Arc<Tape>,
}

impl Drop for OnAir {
    fn drop(&mut self) {
        let mut offers = self.answers.map();
        // A newer claim of the same key may have put a tape of its own there.
        if offers
            .by_key
            .get(&self.key)
            .is_some_and(|(_, t)| Arc::ptr_eq(t, &self.tape))
        {
            offers.by_key.remove(&self.key);
        }
        drop(offers);
        self.tape.abandon();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tape(cap: u64) -> Arc<Tape> {
        let head = StoredResponse {
            status: http::StatusCode::OK,
            headers: vec![(
                http::header::CONTENT_TYPE,
                "text/event-stream".parse().unwrap(),
            )],
            body: Bytes::new(),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        };
        let fingerprint = Fingerprint([7; 32]);
        Tape::new(Arc::new(head), fingerprint, None, cap)
    }

    /// A reader's next frame, as data.
    fn data(frame: Option<Result<Frame<Bytes>, BrokenOff>>) -> Bytes {
        frame.unwrap().unwrap().into_data().unwrap()
    }

    #[tokio::test]
    async fn a_waiting_duplicate_is_woken_by_a_new_answer_of_its_key_only() {
        let poll = |f: &mut std::pin::Pin<&mut dyn Future<Output = ()>>| {
            let waker = std::task::Waker::noop();
            f.as_mut()
                .poll(&mut std::task::Context::from_waker(waker))
                .is_ready()
        };
        let live = Arc::new(LiveAnswers::default());
        let (key, other) = (ScopedKey([1; 32]), ScopedKey([2; 32]));
        // Made before the answer is offered, it ends on that offer, not on another key's.
        let mut offered: std::pin::Pin<&mut dyn Future<Output = ()>> = pin!(live.offered(&key));
        assert!(!poll(&mut offered));
        let _elsewhere = live.open(other, &tape(100));
        assert!(!poll(&mut offered), "another key's answer");
        let first = live.open(key, &tape(100));
        assert!(poll(&mut offered), "its key's answer");
        // Made while an answer is offered, it waits for another one.
        let mut next: std::pin::Pin<&mut dyn Future<Output = ()>> = pin!(live.offered(&key));
        assert!(!poll(&mut next));
        drop(first);
        let _second = live.open(key, &tape(100));
        assert!(poll(&mut next), "a newer answer of its key");
    }

    #[tokio::test]
    async fn readers_get_every_chunk_and_the_tape_is_the_record() {
        let tape = tape(100);
        let first = tape.first_reader().into_body();
        tape.push(Bytes::from_static(b"id: 1\ndata: a\n\n")).await;
        let late = tape.reader(None).unwrap().into_body();
        let resumed = tape.reader(Some(b"1")).unwrap();
        assert!(resumed.resumes());
        tape.push(Bytes::from_static(b"id: 2\ndata: b\n\n")).await;
        tape.finish(true);
        let all = b"id: 1\ndata: a\n\nid: 2\ndata: b\n\n";
        assert_eq!(first.collect().await.unwrap().to_bytes(), &all[..]);
        assert_eq!(late.collect().await.unwrap().to_bytes(), &all[..]);
        let rest = resumed.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(rest, "id: 2\ndata: b\n\n");
        assert_eq!(tape.recorded().unwrap(), (Bytes::from_static(all), None));
    }

    #[tokio::test]
    async fn trailers_follow_the_body_for_every_reader_and_in_the_record() {
        let tape = tape(100);
        let first = tape.first_reader().into_body();
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", http::HeaderValue::from_static("ab12"));
        let body = crate::idempotency::body::with_trailers(
            Bytes::from_static(b"id: 1\ndata: a\n\n"),
            Some(trailers.clone()),
        );
        let resumed = tape.reader(Some(b"1")).unwrap().into_body();
        tape.record_from(body, Duration::from_secs(1))
            .await
            .unwrap();
        let late = tape.reader(None).unwrap().into_body();
        tape.finish(true);
        for reader in [first, late, resumed] {
            assert_eq!(reader.collect().await.unwrap().trailers(), Some(&trailers));
        }
        assert_eq!(tape.recorded().unwrap().1, Some(trailers));
    }

    #[tokio::test]
    async fn past_the_cap_it_holds_no_more_than_the_slowest_reader_needs() {
        let tape = tape(4);
        let mut slow = tape.first_reader();
        tape.push(Bytes::from_static(b"abc")).await;
        // Past the cap, the writer waits while the slow reader has not read what it holds.
        let mut writer = std::pin::pin!(tape.push(Bytes::from_static(b"de")));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), writer.as_mut())
                .await
                .is_err(),
            "held back by the reader"
        );
        assert!(tape.recorded().is_none(), "past the cap: not replayable");
        assert!(tape.reader(None).is_none(), "no attaching past the cap");
        assert_eq!(data(slow.next().await), "abc");
        writer.await;
        assert!(tape.state().held <= 4);
        assert_eq!(data(slow.next().await), "de");
        drop(slow);
        // Nobody reads: nothing is held, nothing waits.
        tape.push(Bytes::from(vec![0; 64])).await;
        assert_eq!(tape.state().held, 0);
    }

    #[tokio::test]
    async fn a_tape_whose_recording_went_away_ends_its_readers_with_an_error() {
        let live = Arc::new(LiveAnswers::default());
        let tape = tape(100);
        let on_air = live.open(ScopedKey([1; 32]), &tape);
        let mut reader = tape.first_reader();
        tape.push(Bytes::from_static(b"ab")).await;
        // The recording task panicked (or was dropped) before the body ended.
        drop(on_air);
        assert_eq!(data(reader.next().await), "ab");
        assert!(reader.next().await.unwrap().is_err());
        // A tape that ended whole stays whole.
        let whole = self::tape(100);
        let on_air = live.open(ScopedKey([2; 32]), &whole);
        let mut reader = whole.first_reader();
        whole.finish(true);
        drop(on_air);
        assert!(reader.next().await.is_none());
    }

    #[tokio::test]
    async fn a_broken_answer_ends_readers_with_an_error() {
        let tape = tape(100);
        let mut reader = tape.first_reader();
        tape.push(Bytes::from_static(b"ab")).await;
        tape.finish(false);
        assert_eq!(data(reader.next().await), "ab");
        assert!(reader.next().await.unwrap().is_err());
    }
}

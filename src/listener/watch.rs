//! The watchdog of one client connection: what it reads (requests in progress, a request head
//! arriving, bytes moving) and when it closes the connection.
//!
//! - `client_header_timeout`: a request head must be complete this long after its first byte,
//!   and a new connection's first request (TLS handshake, protocol detection, the HTTP/2 preface
//!   and SETTINGS included) this long after the accept.
//! - `client_idle_timeout`: a connection with no request in progress is closed after this; one
//!   whose client takes no answer bytes (window 0, a full socket buffer) or sends none of the
//!   body it announced is closed once nothing has moved for this long, counted from the last
//!   move (or from when something began to wait on the client, if later).
//!
//! Every other task only updates atomics, and wakes the watchdog when it sleeps with no stall
//! to watch and something begins to wait on the client; the watchdog runs in the connection's
//! own task.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::rate::MinBodyRate;

/// The client timeouts of a listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    pub(crate) header: Duration,
    pub(crate) idle: Duration,
    // `client_min_body_rate` and its grace; none: off.
    pub(crate) body_rate: Option<MinBodyRate>,
}

/// Why the watchdog ended a connection, as `idemgate_client_connections_closed_total{reason}`
/// labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    /// A request head (or a new connection's first one) took longer than `client_header_timeout`.
    Header,
    /// No request in progress for `client_idle_timeout`.
    Idle,
    /// The client took none of its answer, or sent none of its body, for `client_idle_timeout`.
    Stalled,
}

/// `0` in a time field: not set.
const UNSET: u64 = 0;

/// What a connection's parts report to its watchdog. Times are milliseconds since the accept,
/// plus one (so that `0` stays "not set").
#[derive(Debug)]
pub(crate) struct ConnState {
    accepted: Instant,
    // Requests received whose response has not been sent whole (or dropped).
    open: AtomicU32,
    // When the head of the next request began to arrive while none was in progress; at the
    // accept for the first request.
    head_since: AtomicU64,
    // When the last request in progress ended.
    idle_since: AtomicU64,
    // When something last moved (a request started or got its answer, the client took part of
    // an answer or sent part of a body) or began to wait on the client: a stall is
    // `client_idle_timeout` past it with something still waiting on the client.
    progress: AtomicU64,
    // Bodies waiting on the client: an answer it has not taken, a request body it has not sent.
    waiting: AtomicU32,
    // The last write to the client's socket could not proceed.
    write_blocked: AtomicBool,
    // The watchdog sleeps without a stall deadline (requests in progress, nothing waiting on
    // the client): whatever starts one, or ends the last request, wakes it through `waker`.
    parked: AtomicBool,
    waker: AtomicWaker,
    // The connection's own task is polling the connection: the watchdog looks right after, in
    // the same task, so a change made meanwhile needs no wake-up.
    polling: AtomicBool,
}

impl ConnState {
    /// The state of a connection accepted now.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(ConnState {
            accepted: Instant::now(),
            open: AtomicU32::new(0),
            head_since: AtomicU64::new(1),
            idle_since: AtomicU64::new(1),
            progress: AtomicU64::new(1),
            waiting: AtomicU32::new(0),
            write_blocked: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            waker: AtomicWaker::new(),
            polling: AtomicBool::new(false),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.accepted.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn at(&self, ms: u64) -> Instant {
        let after = Duration::from_millis(ms.saturating_sub(1));
        // Past what the clock can say: as good as never (tokio caps its timers anyway).
        self.accepted
            .checked_add(after)
            .unwrap_or_else(|| Instant::now() + FAR)
    }

    /// A request reached the service: its head is complete. It is in progress until the
    /// returned guard (or the response body it goes into) is dropped.
    pub(crate) fn request_started(self: &Arc<Self>) -> InProgress {
        self.open.fetch_add(1, SeqCst);
        self.head_since.store(UNSET, Relaxed);
        self.moved();
        InProgress(self.clone())
    }

    /// A request's response was sent whole, or given up.
    fn request_ended(&self) {
        if self.open.fetch_sub(1, SeqCst) == 1 {
            self.idle_since.store(self.now(), Relaxed);
            self.unpark();
        }
    }

    /// Bytes of a request head arrived while no request was in progress.
    fn head_arriving(&self) {
        if self.open.load(Relaxed) == 0 && self.head_since.load(Relaxed) == UNSET {
            self.head_since.store(self.now(), Relaxed);
        }
    }

    /// An HTTP/2 header block opened: it must complete within the header timeout, whatever
    /// else is in progress (nothing else moves on the connection until it does).
    fn head_arriving_h2(&self) {
        if self.head_since.load(Relaxed) == UNSET {
            self.head_since.store(self.now(), Relaxed);
        }
    }

    fn head_complete(&self) {
        self.head_since.store(UNSET, Relaxed);
    }

    /// Something moved. Only the last move while something waits on the client counts (the
    /// watchdog reads `progress` only then, and whatever begins to wait stamps it anew): any
    /// other move is not stamped, which spares a read of the clock.
    fn moved(&self) {
        if self.waiting.load(SeqCst) > 0 || self.write_blocked.load(SeqCst) {
            self.stamp();
        }
    }

    fn stamp(&self) {
        self.progress.fetch_max(self.now(), Relaxed);
    }

    /// Something began to wait on the client: its stall is counted from now, and a parked
    /// watchdog must look.
    fn began_waiting(&self) {
        self.stamp();
        self.unpark();
    }

    fn unpark(&self) {
        // Seen polling: the change was made before the poll ends, and the look that follows it
        // reads it. A wake-up would poll the whole connection again for nothing.
        if self.polling.load(SeqCst) {
            return;
        }
        if self.parked.swap(false, SeqCst) {
            self.waker.wake();
        }
    }

    /// A request body, which waits on the client whenever it has nothing to give.
    pub(crate) fn request_body<B>(self: &Arc<Self>, body: B) -> Watched<B> {
        Watched {
            body,
            conn: self.clone(),
            side: Side::Request,
            waiting: false,
            _in_progress: None,
        }
    }
}

/// The connection's future as its own task polls it: marked as polling meanwhile (see
/// `ConnState::polling`). Poll the watchdog after it, in the same task.
pub(crate) struct Serving<'a, F: ?Sized> {
    conn: &'a ConnState,
    serving: Pin<&'a mut F>,
}

impl<'a, F: Future + ?Sized> Serving<'a, F> {
    pub(crate) fn new(conn: &'a ConnState, serving: Pin<&'a mut F>) -> Self {
        Serving { conn, serving }
    }
}

impl<F: Future + ?Sized> Future for Serving<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.conn.polling.store(true, SeqCst);
        let polled = self.serving.as_mut().poll(cx);
        self.conn.polling.store(false, SeqCst);
        polled
    }
}

/// A deadline past any the watchdog could have (a century).
const FAR: Duration = Duration::from_secs(100 * 365 * 86_400);

/// A request in progress on its connection: ends when dropped.
pub(crate) struct InProgress(Arc<ConnState>);

impl InProgress {
    /// The response's body, which keeps the request in progress until it is sent whole or
    /// dropped, and waits on the client from the moment it has something to give.
    pub(crate) fn response_body<B>(self, body: B) -> Watched<B> {
        // Something now waits on the client: the stall clock starts from here.
        self.0.waiting.fetch_add(1, SeqCst);
        self.0.began_waiting();
        Watched {
            body,
            conn: self.0.clone(),
            side: Side::Response,
            waiting: true,
            _in_progress: Some(self),
        }
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// The watchdog: resolves when the connection has outlived one of its timeouts. Poll it after
/// the connection in the same task, so that it sees what the connection's last poll changed.
pub(crate) struct Watchdog {
    conn: Arc<ConnState>,
    // `client_header_timeout` and `client_idle_timeout`, in ms.
    header: u64,
    idle: u64,
    sleep: Pin<Box<Sleep>>,
}

impl Watchdog {
    pub(crate) fn new(conn: Arc<ConnState>, timeouts: Timeouts) -> Self {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Watchdog {
            sleep: Box::pin(tokio::time::sleep_until(conn.at(1))),
            conn,
            header: ms(timeouts.header),
            idle: ms(timeouts.idle),
        }
    }

    /// Whether the connection has outlived a timeout at `now`; if not, when to look again
    /// (none: when woken).
    fn look(&self, now: u64) -> Result<Option<u64>, Expired> {
        let conn = &self.conn;
        // Parked until found otherwise, before anything is read: a change made after a read
        // below then finds it parked, and wakes it.
        conn.parked.store(true, SeqCst);
        let mut next = None;
        let head = conn.head_since.load(Relaxed);
        if head != UNSET {
            let at = head.saturating_add(self.header);
            if at <= now {
                return Err(Expired::Header);
            }
            next = Some(at);
        }
        let (open, blocked) = (conn.open.load(SeqCst), conn.write_blocked.load(SeqCst));
        if open == 0 && !blocked {
            // Nothing in progress: the idle timeout (unless a head is arriving), which only
            // the connection's own task can change.
            conn.parked.store(false, Relaxed);
            if head != UNSET {
                return Ok(next);
            }
            let at = conn.idle_since.load(Relaxed).saturating_add(self.idle);
            return if at <= now {
                Err(Expired::Idle)
            } else {
                Ok(Some(at))
            };
        }
        if !blocked && conn.waiting.load(SeqCst) == 0 {
            // Requests in progress, waiting on the gateway (the upstream) only: parked.
            return Ok(next);
        }
        conn.parked.store(false, Relaxed);
        let at = conn.progress.load(Relaxed).saturating_add(self.idle);
        if at <= now {
            return Err(Expired::Stalled);
        }
        Ok(Some(next.map_or(at, |n| n.min(at))))
    }
}

impl Future for Watchdog {
    type Output = Expired;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Expired> {
        self.conn.waker.register(cx.waker());
        loop {
            // The next deadline as things stand (a look at time 0 finds none past); the clock
            // is read only once the sleep until it ends.
            let next = match self.look(0) {
                Err(expired) => return Poll::Ready(expired),
                Ok(None) => return Poll::Pending,
                Ok(Some(next)) => self.conn.at(next),
            };
            if self.sleep.deadline() != next {
                self.sleep.as_mut().reset(next);
            }
            if self.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if let Err(expired) = self.look(self.conn.now()) {
                return Poll::Ready(expired);
            }
        }
    }
}

/// Which way a [`Watched`] body flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Request,
    Response,
}

/// A request or response body that tells its connection's watchdog when it waits on the client;
/// a response's ends its request when dropped.
pub(crate) struct Watched<B> {
    body: B,
    conn: Arc<ConnState>,
    side: Side,
    // Counted in the connection's `waiting`.
    waiting: bool,
    _in_progress: Option<InProgress>,
}

impl<B> Watched<B> {
    fn set_waiting(&mut self, waiting: bool) {
        if self.waiting != waiting {
            self.waiting = waiting;
            if waiting {
                self.conn.waiting.fetch_add(1, SeqCst);
                self.conn.began_waiting();
            } else {
                self.conn.waiting.fetch_sub(1, SeqCst);
            }
        }
    }
}

impl<B> Drop for Watched<B> {
    fn drop(&mut self) {
        self.set_waiting(false);
    }
}

impl<B> Body for Watched<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        let waiting = match (self.side, &polled) {
            (Side::Response, Poll::Ready(Some(Ok(_)))) => true,
            (Side::Response, _) => false,
            (Side::Request, Poll::Pending) => true,
            (Side::Request, Poll::Ready(_)) => false,
        };
        // Counted first: a body that stops waiting on the client moves nothing that counts,
        // unless something else on the connection still waits.
        self.set_waiting(waiting);
        // A response body is polled when the client has taken what came before; a request
        // body's frame is what the client sent.
        if self.side == Side::Response || polled.is_ready() {
            self.conn.moved();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The HTTP/2 connection preface a client sends first.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Where a connection's byte stream stands, as far as the watchdog needs: which protocol, and
/// for HTTP/2, whether the last byte of a header block (HEADERS or PUSH_PROMISE and its
/// CONTINUATIONs, payloads included) is still to come.
#[derive(Debug)]
enum Stream {
    /// The first bytes, matched against the HTTP/2 preface so far.
    Detecting(usize),
    Http1,
    /// HTTP/2 frames: the frame header read so far, the payload bytes left to skip, and
    /// whether the frame being skipped ends a header block (END_HEADERS): the block is whole
    /// once that payload has arrived.
    Http2 {
        head: [u8; 9],
        have: usize,
        skip: usize,
        ends_block: bool,
    },
}

/// The HTTP/2 frame types and flag that open and end a header block.
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

impl Stream {
    /// Read `bytes`, telling `conn` when a request head starts arriving and when an HTTP/2
    /// header block completes.
    fn feed(&mut self, mut bytes: &[u8], conn: &ConnState) {
        while !bytes.is_empty() {
            match self {
                Stream::Detecting(matched) => {
                    // The bytes agree with the rest of the preface when one starts the other.
                    let rest = H2_PREFACE.get(*matched..).unwrap_or_default();
                    if !(rest.starts_with(bytes) || bytes.starts_with(rest)) {
                        *self = Stream::Http1;
                        continue;
                    }
                    let n = rest.len().min(bytes.len());
                    *matched += n;
                    bytes = bytes.get(n..).unwrap_or_default();
                    if *matched >= H2_PREFACE.len() {
                        *self = Stream::Http2 {
                            head: [0; 9],
                            have: 0,
                            skip: 0,
                            ends_block: false,
                        };
                    }
                }
                Stream::Http1 => {
                    conn.head_arriving();
                    return;
                }
                Stream::Http2 {
                    head,
                    have,
                    skip,
                    ends_block,
                } => {
                    if *skip > 0 {
                        let n = (*skip).min(bytes.len());
                        *skip -= n;
                        bytes = bytes.get(n..).unwrap_or_default();
                        if *skip == 0 && std::mem::take(ends_block) {
                            conn.head_complete();
                        }
                        continue;
                    }
                    let n = head.len().saturating_sub(*have).min(bytes.len());
                    for (slot, &b) in head.iter_mut().skip(*have).zip(bytes) {
                        *slot = b;
                    }
                    *have += n;
                    bytes = bytes.get(n..).unwrap_or_default();
                    // A header block's clock starts with its frame's type, not its last byte.
                    if *have > 3 && matches!(head[3], HEADERS | PUSH_PROMISE) {
                        conn.head_arriving_h2();
                    }
                    if *have < 9 {
                        continue;
                    }
                    *have = 0;
                    *skip = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    let ends = matches!(head[3], HEADERS | PUSH_PROMISE | CONTINUATION)
                        && head[4] & END_HEADERS != 0;
                    match (ends, *skip) {
                        (true, 0) => conn.head_complete(),
                        (ends, _) => *ends_block = ends,
                    }
                }
            }
        }
    }
}

/// A client connection's socket (after TLS), reporting to its watchdog: bytes read (a request
/// head arriving), bytes written, and writes that cannot proceed.
pub(crate) struct WatchedIo<T> {
    io: T,
    conn: Arc<ConnState>,
    stream: Stream,
}

impl<T> WatchedIo<T> {
    pub(crate) fn new(io: T, conn: Arc<ConnState>) -> Self {
        WatchedIo {
            io,
            conn,
            stream: Stream::Detecting(0),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WatchedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let fresh = buf.filled().get(before..).unwrap_or_default();
        if !fresh.is_empty() {
            let this = &mut *self;
            this.stream.feed(fresh, &this.conn);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> WatchedIo<T> {
    /// A write: bytes the socket took are progress (over HTTP/1.1, whose writes are answers;
    /// HTTP/2 also writes control frames, a PING's answer, which say nothing of whether the
    /// client takes its answers).
    fn wrote(&self, polled: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        self.blocked(polled.is_pending());
        if let Poll::Ready(Ok(1..)) = polled {
            if !matches!(self.stream, Stream::Http2 { .. }) {
                self.conn.moved();
            }
        }
        polled
    }

    /// Whether the socket could not take what was written or flushed. A flush that finds
    /// nothing to send is no progress: the connection flushes whenever it is polled, the
    /// watchdog's own wake-up included.
    fn blocked(&self, pending: bool) {
        if pending {
            if !self.conn.write_blocked.swap(true, SeqCst) {
                self.conn.began_waiting();
            }
        } else if self.conn.write_blocked.load(Relaxed) {
            self.conn.write_blocked.store(false, Relaxed);
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WatchedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.wrote(polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.wrote(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.blocked(polled.is_pending());
        polled
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, len: usize) -> Vec<u8> {
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            1,
        ];
        f.resize(9 + len, 0);
        f
    }

    const TIMEOUTS: Timeouts = Timeouts {
        header: Duration::from_secs(1),
        idle: Duration::from_secs(3),
        body_rate: None,
    };

    /// When the watchdog of `conn` fires, and why, counted from now (time paused).
    async fn fires(conn: &Arc<ConnState>) -> (Expired, Duration) {
        let started = Instant::now();
        let expired = Watchdog::new(conn.clone(), TIMEOUTS).await;
        (expired, started.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_gets_the_header_timeout_an_idle_one_the_idle_timeout() {
        let conn = ConnState::new();
        assert_eq!(fires(&conn).await, (Expired::Header, TIMEOUTS.header));
        let conn = ConnState::new();
        drop(conn.request_started());
        assert_eq!(fires(&conn).await, (Expired::Idle, TIMEOUTS.idle));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_is_one_idle_timeout_after_the_last_move() {
        let conn = ConnState::new();
        let mut watchdog = Watchdog::new(conn.clone(), TIMEOUTS);
        let request = conn.request_started();
        // The answer comes late, and the client takes a part of it now and then, then stops.
        tokio::time::sleep(TIMEOUTS.idle - Duration::from_millis(100)).await;
        let answer = request.response_body(http_body_util::Full::new(Bytes::from("x")));
        for _ in 0..4 {
            let wait = tokio::time::timeout(TIMEOUTS.idle * 9 / 10, &mut watchdog).await;
            assert!(wait.is_err(), "closed while the client took its answer");
            answer.conn.moved();
        }
        let waited = Instant::now();
        assert_eq!((&mut watchdog).await, Expired::Stalled);
        assert_eq!(waited.elapsed(), TIMEOUTS.idle);
        drop(answer);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_upstream_is_no_stall() {
        let conn = ConnState::new();
        let request = conn.request_started();
        // The upstream takes ten idle timeouts to answer: nothing waits on the client meanwhile.
        let slow = tokio::time::timeout(TIMEOUTS.idle * 10, fires(&conn)).await;
        assert!(slow.is_err(), "closed while the upstream worked: {slow:?}");
        drop(request);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_begun_in_another_task_wakes_the_watchdog() {
        let conn = ConnState::new();
        let request = conn.request_started();
        let late = TIMEOUTS.idle * 10;
        // After a slow upstream, the answer is handed over in another task (an HTTP/2 stream's),
        // and the client never takes it: the stall counts from then.
        let answering = tokio::spawn(async move {
            tokio::time::sleep(late).await;
            let answer = request.response_body(http_body_util::Empty::<Bytes>::new());
            tokio::time::sleep(late).await;
            drop(answer);
        });
        assert_eq!(fires(&conn).await, (Expired::Stalled, late + TIMEOUTS.idle));
        // A request body the client stops sending, read in the proxy's task.
        let conn = ConnState::new();
        let request = conn.request_started();
        let reading = tokio::spawn({
            let conn = conn.clone();
            async move {
                tokio::time::sleep(late).await;
                let never = futures_util::stream::pending::<Result<Frame<Bytes>, io::Error>>();
                let mut body = conn.request_body(http_body_util::StreamBody::new(never));
                let _ = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
                drop(request);
            }
        });
        assert_eq!(fires(&conn).await, (Expired::Stalled, late + TIMEOUTS.idle));
        // The last request ending in another task starts the idle timeout.
        let conn = ConnState::new();
        let request = conn.request_started();
        tokio::spawn(async move {
            tokio::time::sleep(late).await;
            drop(request);
        });
        assert_eq!(fires(&conn).await, (Expired::Idle, late + TIMEOUTS.idle));
        answering.abort();
        reading.abort();
    }

    #[test]
    fn a_stream_is_read_alike_however_its_reads_are_cut() {
        let mut h2 = H2_PREFACE.to_vec();
        h2.extend(frame(0x4, 0, 6)); // SETTINGS
        h2.extend(frame(0x1, 0, 10)); // HEADERS without END_HEADERS
        let mut h1 = H2_PREFACE[..10].to_vec();
        h1.extend(b"X / HTTP/1.1\r\n");
        for cut in 0..=h2.len() {
            let conn = ConnState::new();
            let _request = conn.request_started();
            let mut stream = Stream::Detecting(0);
            stream.feed(&h2[..cut], &conn);
            stream.feed(&h2[cut..], &conn);
            assert!(matches!(stream, Stream::Http2 { .. }), "cut at {cut}");
            assert_ne!(
                conn.head_since.load(Relaxed),
                UNSET,
                "a block is open, cut at {cut}"
            );
        }
        for cut in 0..=h1.len() {
            let mut stream = Stream::Detecting(0);
            let conn = ConnState::new();
            stream.feed(&h1[..cut], &conn);
            stream.feed(&h1[cut..], &conn);
            assert!(matches!(stream, Stream::Http1), "cut at {cut}");
        }
    }

    #[test]
    fn http2_header_blocks_are_followed_across_reads() {
        let conn = ConnState::new();
        let _request = conn.request_started();
        let mut stream = Stream::Detecting(0);
        let mut bytes = H2_PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 6)); // SETTINGS
        bytes.extend(frame(0x1, 0, 10)); // HEADERS without END_HEADERS
                                         // Fed a byte at a time, as the slowest client would send it.
        for b in &bytes {
            stream.feed(std::slice::from_ref(b), &conn);
        }
        assert_ne!(conn.head_since.load(Relaxed), UNSET, "a block is open");
        stream.feed(&frame(0x9, 0x4, 3), &conn); // CONTINUATION with END_HEADERS
        assert_eq!(conn.head_since.load(Relaxed), UNSET, "the block completed");
        stream.feed(&frame(0x0, 0x1, 100), &conn); // DATA: no head
        assert_eq!(conn.head_since.load(Relaxed), UNSET);
    }

    #[test]
    fn an_http2_header_block_is_whole_with_its_last_payload_byte() {
        let conn = ConnState::new();
        let _request = conn.request_started();
        let mut stream = Stream::Detecting(0);
        let mut hello = H2_PREFACE.to_vec();
        hello.extend(frame(0x4, 0, 0)); // SETTINGS
        stream.feed(&hello, &conn);
        // HEADERS with END_HEADERS, its payload trickled: open until its last byte.
        let headers = frame(0x1, 0x4, 10);
        for (i, b) in headers.iter().enumerate() {
            stream.feed(std::slice::from_ref(b), &conn);
            let open = conn.head_since.load(Relaxed) != UNSET;
            assert_eq!(open, (3..headers.len() - 1).contains(&i), "after byte {i}");
        }
        // An empty one is whole with its frame header.
        stream.feed(&frame(0x1, 0x5, 0), &conn);
        assert_eq!(conn.head_since.load(Relaxed), UNSET);
        // A CONTINUATION with END_HEADERS, trickled likewise.
        stream.feed(&frame(0x1, 0, 2), &conn);
        let continuation = frame(0x9, 0x4, 4);
        stream.feed(&continuation[..continuation.len() - 1], &conn);
        assert_ne!(conn.head_since.load(Relaxed), UNSET);
        stream.feed(&continuation[continuation.len() - 1..], &conn);
        assert_eq!(conn.head_since.load(Relaxed), UNSET);
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_written_are_progress_a_flush_alone_is_not() {
        use tokio::io::AsyncWriteExt;
        let conn = ConnState::new();
        let (socket, _client) = tokio::io::duplex(64);
        let mut io = WatchedIo::new(socket, conn.clone());
        io.stream = Stream::Http1;
        // An answer waits on the client: its progress counts.
        let answer = conn
            .request_started()
            .response_body(http_body_util::Empty::<Bytes>::new());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = conn.progress.load(Relaxed);
        io.flush().await.unwrap();
        assert_eq!(conn.progress.load(Relaxed), before);
        io.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap();
        assert!(conn.progress.load(Relaxed) > before);
        drop(answer);
    }

    #[tokio::test(start_paused = true)]
    async fn what_the_connection_changes_while_polled_is_seen_without_a_wake_up() {
        let conn = ConnState::new();
        let mut watchdog = Watchdog::new(conn.clone(), TIMEOUTS);
        let request = conn.request_started();
        // The connection itself hands over a late answer (over HTTP/1.1, its own task polls the
        // service), which the client never takes: the watchdog, parked until then, sees it.
        let answering = async {
            tokio::time::sleep(TIMEOUTS.idle * 2).await;
            let _answer = request.response_body(http_body_util::Empty::<Bytes>::new());
            std::future::pending::<()>().await
        };
        let mut answering = std::pin::pin!(answering);
        let started = Instant::now();
        let expired = tokio::select! {
            biased;
            () = Serving::new(&conn, answering.as_mut()) => None,
            expired = &mut watchdog => Some(expired),
        };
        assert_eq!(expired, Some(Expired::Stalled));
        assert_eq!(started.elapsed(), TIMEOUTS.idle * 3);
        assert!(!conn.polling.load(SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_counts_from_when_waiting_began_whatever_moved_before() {
        let conn = ConnState::new();
        let mut watchdog = Watchdog::new(conn.clone(), TIMEOUTS);
        let request = conn.request_started();
        let mut body = conn.request_body(http_body_util::Full::new(Bytes::from("x")));
        // The body arrives whole while nothing waits on the client: no stamp needed.
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        assert!(frame.is_some());
        let quiet = tokio::time::timeout(TIMEOUTS.idle * 2, &mut watchdog).await;
        assert!(quiet.is_err(), "closed while the upstream worked");
        // The answer then waits on the client, which never takes it: one idle timeout from here.
        let answer = request.response_body(http_body_util::Empty::<Bytes>::new());
        let waited = Instant::now();
        assert_eq!((&mut watchdog).await, Expired::Stalled);
        assert_eq!(waited.elapsed(), TIMEOUTS.idle);
        drop(answer);
    }

    #[test]
    fn http1_bytes_while_idle_start_a_head() {
        let conn = ConnState::new();
        drop(conn.request_started());
        let mut stream = Stream::Detecting(0);
        stream.feed(b"POST / HTTP/1.1\r\n", &conn);
        assert!(matches!(stream, Stream::Http1));
        assert_ne!(conn.head_since.load(Relaxed), UNSET);
    }
}

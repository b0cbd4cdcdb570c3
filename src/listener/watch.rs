//! The watchdog of one client connection: what it reads (requests in progress, a request head
//! arriving, bytes moving) and when it closes the connection.
//!
//! - `client_header_timeout`: a request head must be complete this long after its first byte,
//!   and a new connection's first request (TLS handshake, protocol detection, the HTTP/2 preface
//!   and SETTINGS included) this long after the accept.
//! - `client_idle_timeout`: a connection with no request in progress is closed after this; one
//!   whose client takes no answer bytes (window 0, a full socket buffer) or sends none of the
//!   body it announced is closed once nothing has moved for this long.
//!
//! Every other task only updates atomics; the watchdog runs in the connection's own task.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The two timeouts of client connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    pub(crate) header: Duration,
    pub(crate) idle: Duration,
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
    // Bumped whenever a request starts or gets its answer, and whenever the client takes part
    // of an answer or sends part of a body: a stall is a whole check interval without a bump.
    progress: AtomicU64,
    // Bodies waiting on the client: an answer it has not taken, a request body it has not sent.
    waiting: AtomicU32,
    // The last write to the client's socket could not proceed.
    write_blocked: AtomicBool,
}

impl ConnState {
    /// The state of a connection accepted now.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(ConnState {
            accepted: Instant::now(),
            open: AtomicU32::new(0),
            head_since: AtomicU64::new(1),
            idle_since: AtomicU64::new(1),
            progress: AtomicU64::new(0),
            waiting: AtomicU32::new(0),
            write_blocked: AtomicBool::new(false),
        })
    }

    fn now(&self) -> u64 {
        self.accepted.elapsed().as_millis() as u64 + 1
    }

    fn at(&self, ms: u64) -> Instant {
        self.accepted + Duration::from_millis(ms.saturating_sub(1))
    }

    /// A request reached the service: its head is complete. It is in progress until the
    /// returned guard (or the response body it goes into) is dropped.
    pub(crate) fn request_started(self: &Arc<Self>) -> InProgress {
        self.open.fetch_add(1, Relaxed);
        self.head_since.store(UNSET, Relaxed);
        self.moved();
        InProgress(self.clone())
    }

    /// A request's response was sent whole, or given up.
    fn request_ended(&self) {
        if self.open.fetch_sub(1, Relaxed) == 1 {
            self.idle_since.store(self.now(), Relaxed);
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

    fn moved(&self) {
        self.progress.fetch_add(1, Relaxed);
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

/// A request in progress on its connection: ends when dropped.
pub(crate) struct InProgress(Arc<ConnState>);

impl InProgress {
    /// The response's body, which keeps the request in progress until it is sent whole or
    /// dropped, and waits on the client from the moment it has something to give.
    pub(crate) fn response_body<B>(self, body: B) -> Watched<B> {
        // Something now waits on the client: the stall clock starts from here.
        self.0.moved();
        self.0.waiting.fetch_add(1, Relaxed);
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
    timeouts: Timeouts,
    sleep: Pin<Box<Sleep>>,
    // When to look again whether bytes still move while a request is in progress.
    check_at: u64,
    // The progress count seen at the last look.
    seen: u64,
}

impl Watchdog {
    pub(crate) fn new(conn: Arc<ConnState>, timeouts: Timeouts) -> Self {
        let check_at = conn.now() + timeouts.idle.as_millis() as u64;
        Watchdog {
            sleep: Box::pin(tokio::time::sleep_until(conn.at(check_at))),
            conn,
            timeouts,
            check_at,
            seen: 0,
        }
    }

    /// The earliest moment a timeout could end the connection, as things stand.
    fn next(&self) -> u64 {
        let conn = &self.conn;
        let head = conn.head_since.load(Relaxed);
        let open = conn.open.load(Relaxed);
        if head != UNSET {
            let header = head + self.timeouts.header.as_millis() as u64;
            return if open > 0 {
                header.min(self.check_at)
            } else {
                header
            };
        }
        if open == 0 && !conn.write_blocked.load(Relaxed) {
            return conn.idle_since.load(Relaxed) + self.timeouts.idle.as_millis() as u64;
        }
        self.check_at
    }

    /// Whether the connection has outlived a timeout at `now`; otherwise the next look at
    /// whether bytes still move is scheduled.
    fn expired(&mut self, now: u64) -> Option<Expired> {
        let conn = &self.conn;
        let head = conn.head_since.load(Relaxed);
        if head != UNSET && head + self.timeouts.header.as_millis() as u64 <= now {
            return Some(Expired::Header);
        }
        let (open, blocked) = (conn.open.load(Relaxed), conn.write_blocked.load(Relaxed));
        if head == UNSET
            && open == 0
            && !blocked
            && conn.idle_since.load(Relaxed) + self.timeouts.idle.as_millis() as u64 <= now
        {
            return Some(Expired::Idle);
        }
        if self.check_at <= now {
            let progress = conn.progress.load(Relaxed);
            let stalled = blocked || conn.waiting.load(Relaxed) > 0;
            if stalled && progress == self.seen {
                return Some(Expired::Stalled);
            }
            self.seen = progress;
            self.check_at = now + self.timeouts.idle.as_millis() as u64;
        }
        None
    }
}

impl Future for Watchdog {
    type Output = Expired;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Expired> {
        loop {
            let next = self.conn.at(self.next());
            if self.sleep.deadline() != next {
                self.sleep.as_mut().reset(next);
            }
            if self.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = self.conn.now();
            if let Some(expired) = self.expired(now) {
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
                self.conn.waiting.fetch_add(1, Relaxed);
            } else {
                self.conn.waiting.fetch_sub(1, Relaxed);
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
        // A response body is polled when the client has taken what came before; a request
        // body's frame is what the client sent.
        if self.side == Side::Response || polled.is_ready() {
            self.conn.moved();
        }
        let waiting = match (self.side, &polled) {
            (Side::Response, Poll::Ready(Some(Ok(_)))) => true,
            (Side::Response, _) => false,
            (Side::Request, Poll::Pending) => true,
            (Side::Request, Poll::Ready(_)) => false,
        };
        self.set_waiting(waiting);
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
/// for HTTP/2, whether a header block (HEADERS or PUSH_PROMISE and its CONTINUATIONs) is open.
#[derive(Debug)]
enum Stream {
    /// The first bytes, matched against the HTTP/2 preface so far.
    Detecting(usize),
    Http1,
    /// HTTP/2 frames: the frame header read so far, the payload bytes left to skip, and
    /// whether a header block awaits its END_HEADERS.
    Http2 {
        head: [u8; 9],
        have: usize,
        skip: usize,
        block_open: bool,
    },
}

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
                            block_open: false,
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
                    block_open,
                } => {
                    if *skip > 0 {
                        let n = (*skip).min(bytes.len());
                        *skip -= n;
                        bytes = bytes.get(n..).unwrap_or_default();
                        continue;
                    }
                    let n = head.len().saturating_sub(*have).min(bytes.len());
                    for (slot, &b) in head.iter_mut().skip(*have).zip(bytes) {
                        *slot = b;
                    }
                    *have += n;
                    bytes = bytes.get(n..).unwrap_or_default();
                    if *have < 9 {
                        continue;
                    }
                    *have = 0;
                    *skip = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    const HEADERS: u8 = 0x1;
                    const PUSH_PROMISE: u8 = 0x5;
                    const CONTINUATION: u8 = 0x9;
                    const END_HEADERS: u8 = 0x4;
                    let (kind, end) = (head[3], head[4] & END_HEADERS != 0);
                    match kind {
                        HEADERS | PUSH_PROMISE | CONTINUATION if end => {
                            *block_open = false;
                            conn.head_complete();
                        }
                        HEADERS | PUSH_PROMISE => {
                            *block_open = true;
                            conn.head_arriving_h2();
                        }
                        _ => {}
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
    fn wrote<R>(&self, polled: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match &polled {
            Poll::Pending => self.conn.write_blocked.store(true, Relaxed),
            Poll::Ready(_) => {
                if self.conn.write_blocked.load(Relaxed) {
                    self.conn.write_blocked.store(false, Relaxed);
                }
                // HTTP/1.1 writes only answers; HTTP/2 also writes control frames (a PING's
                // answer), which say nothing of whether the client takes its answers.
                if !matches!(self.stream, Stream::Http2 { .. }) {
                    self.conn.moved();
                }
            }
        }
        polled
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
        self.wrote(polled)
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
    async fn a_stall_is_a_whole_idle_timeout_without_progress() {
        let conn = ConnState::new();
        let mut watchdog = Watchdog::new(conn.clone(), TIMEOUTS);
        let request = conn.request_started();
        // The answer comes just before the first look, and the client never takes it.
        tokio::time::sleep(TIMEOUTS.idle - Duration::from_millis(100)).await;
        let answer = request.response_body(http_body_util::Empty::<Bytes>::new());
        let waited = Instant::now();
        let expired = (&mut watchdog).await;
        assert_eq!(expired, Expired::Stalled);
        let stalled_for = waited.elapsed();
        assert!(
            stalled_for >= TIMEOUTS.idle && stalled_for <= TIMEOUTS.idle * 2,
            "{stalled_for:?}"
        );
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
            assert!(
                matches!(
                    stream,
                    Stream::Http2 {
                        block_open: true,
                        ..
                    }
                ),
                "cut at {cut}"
            );
            assert_ne!(conn.head_since.load(Relaxed), UNSET, "cut at {cut}");
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
    fn http1_bytes_while_idle_start_a_head() {
        let conn = ConnState::new();
        drop(conn.request_started());
        let mut stream = Stream::Detecting(0);
        stream.feed(b"POST / HTTP/1.1\r\n", &conn);
        assert!(matches!(stream, Stream::Http1));
        assert_ne!(conn.head_since.load(Relaxed), UNSET);
    }
}

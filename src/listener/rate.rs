//! `client_min_body_rate`: a request body must arrive at least this fast once its grace has
//! passed, as Kestrel's `MinRequestBodyDataRate`: on average over the time the gateway waits on
//! the client for it. Time the gateway spends elsewhere (an upstream that reads slowly, the
//! engine at work) is not counted: the clock runs only while the body's reader waits for bytes.
//! A body that falls behind fails with [`BodyTooSlow`] and sets its request's [`Cut`], so that
//! the request is answered `408` at once.

use std::error::Error;
use std::future::Future;
use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// The least rate of a request body, and the waiting time it is granted before the rate counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MinBodyRate {
    pub(crate) bytes_per_second: NonZeroU64,
    pub(crate) grace: Duration,
}

impl MinBodyRate {
    /// How long the gateway may have waited on a body that has sent `bytes`: its grace, or as
    /// long as `bytes` take at the rate, whichever is longer.
    fn allowed(&self, bytes: u64) -> Duration {
        let ms = u128::from(bytes) * 1000 / u128::from(self.bytes_per_second.get());
        Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)).max(self.grace)
    }
}

/// A request body cut for arriving slower than `client_min_body_rate`.
#[derive(Debug, thiserror::Error)]
#[error("the request body arrived slower than client_min_body_rate")]
pub(crate) struct BodyTooSlow;

/// Set when a request's body is cut for its rate, and awaited by whoever answers the request.
/// One setter and one waiter: a flag and a waker (a `CancellationToken` locks a mutex to make,
/// clone, check and drop one, on every request with a body).
#[derive(Debug, Default)]
pub(crate) struct Cut {
    cut: AtomicBool,
    waker: AtomicWaker,
}

impl Cut {
    /// Cut the body: the waiter wakes.
    fn cut(&self) {
        self.cut.store(true, Ordering::Release);
        self.waker.wake();
    }

    pub(crate) fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Acquire)
    }

    /// Ready once the body is cut; until then `cx` is woken when it is.
    pub(crate) fn poll_cut(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_cut() {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // Cut between the look and the registration: seen here.
        match self.is_cut() {
            true => Poll::Ready(()),
            false => Poll::Pending,
        }
    }
}

/// A request body held to a [`MinBodyRate`].
pub(crate) struct Paced<B> {
    body: B,
    rate: MinBodyRate,
    // What the client has sent so far.
    bytes: u64,
    // The time the reader has waited on the client, up to the current wait.
    waited: Duration,
    // Since when the reader waits (its last poll found nothing), if it does.
    since: Option<Instant>,
    // Set to when the current wait runs out, made at the first wait.
    timer: Option<Pin<Box<Sleep>>>,
    // Set when the body is cut: the request's answer is then a 408.
    cut: Arc<Cut>,
}

impl<B> Paced<B> {
    pub(crate) fn new(body: B, rate: MinBodyRate, cut: Arc<Cut>) -> Self {
        Paced {
            body,
            rate,
            bytes: 0,
            waited: Duration::ZERO,
            since: None,
            timer: None,
            cut,
        }
    }

    /// The reader waits on the client: whether it has now waited longer than the bytes so far
    /// allow (then the body is cut); otherwise the timer wakes it when it will have.
    fn waits(&mut self, cx: &mut Context<'_>) -> bool {
        let since = *self.since.get_or_insert_with(Instant::now);
        let left = self.rate.allowed(self.bytes).saturating_sub(self.waited);
        // A deadline past what the clock can say never comes.
        let Some(deadline) = since.checked_add(left) else {
            return false;
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        if timer.as_mut().poll(cx).is_pending() {
            return false;
        }
        self.cut.cut();
        true
    }
}

impl<B> Body for Paced<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.cut.is_cut() {
            return Poll::Ready(Some(Err(BodyTooSlow.into())));
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Pending if this.waits(cx) => Poll::Ready(Some(Err(BodyTooSlow.into()))),
            Poll::Pending => Poll::Pending,
            Poll::Ready(frame) => {
                if let Some(since) = this.since.take() {
                    this.waited = this.waited.saturating_add(since.elapsed());
                }
                if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
                    let len = data.map_or(0, Bytes::len);
                    this.bytes = this.bytes.saturating_add(len as u64);
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::sync::mpsc;

    fn rate(bytes_per_second: u64, grace: Duration) -> MinBodyRate {
        MinBodyRate {
            bytes_per_second: NonZeroU64::new(bytes_per_second).unwrap(),
            grace,
        }
    }

    /// A body the test sends by hand, paced at `r`: its sender, the body, and its `cut`.
    fn paced(
        r: MinBodyRate,
    ) -> (
        mpsc::Sender<Bytes>,
        Paced<impl Body<Data = Bytes, Error = std::io::Error> + Unpin>,
        Arc<Cut>,
    ) {
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let frames = futures_util::stream::unfold(rx, |mut rx| async move {
            let data = rx.recv().await?;
            Some((Ok(Frame::data(data)), rx))
        });
        let body = http_body_util::StreamBody::new(Box::pin(frames));
        let cut = Arc::new(Cut::default());
        (tx, Paced::new(body, r, cut.clone()), cut)
    }

    #[test]
    fn the_allowed_wait_is_the_grace_or_the_bytes_at_the_rate() {
        let r = rate(240, Duration::from_secs(5));
        assert_eq!(r.allowed(0), Duration::from_secs(5));
        assert_eq!(r.allowed(1200), Duration::from_secs(5));
        assert_eq!(r.allowed(2400), Duration::from_secs(10));
        // 1 B/s, the slowest rate, and the most bytes: no overflow.
        assert_eq!(rate(1, Duration::ZERO).allowed(3), Duration::from_secs(3));
        assert_eq!(
            rate(1, Duration::ZERO).allowed(u64::MAX),
            Duration::from_millis(u64::MAX)
        );
        // The fastest rate: only the grace counts.
        let fastest = rate(u64::MAX, Duration::from_secs(1));
        assert_eq!(fastest.allowed(u64::MAX), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_is_cut_when_its_average_falls_below_the_rate() {
        let (tx, mut body, cut) = paced(rate(100, Duration::from_secs(2)));
        let started = Instant::now();
        // 10 bytes every 1.5 s: below the rate, cut when the grace is over.
        let trickle = tokio::spawn(async move {
            loop {
                if tx.send(Bytes::from_static(&[b'x'; 10])).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
        });
        let mut read = 0;
        let e = loop {
            match body.frame().await.unwrap() {
                Ok(f) => read += f.into_data().unwrap().len(),
                Err(e) => break e,
            }
        };
        assert!(e.is::<BodyTooSlow>(), "{e}");
        assert!(cut.is_cut());
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert_eq!(read, 20);
        trickle.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_rate_is_never_cut_and_time_not_reading_is_not_counted() {
        let (tx, mut body, cut) = paced(rate(100, Duration::from_secs(1)));
        // 100 bytes every 900 ms, for a minute: above the rate.
        let sending = tokio::spawn(async move {
            for _ in 0..66 {
                tx.send(Bytes::from_static(&[b'x'; 100])).await.unwrap();
                tokio::time::sleep(Duration::from_millis(900)).await;
            }
        });
        let mut read = 0;
        while let Some(frame) = body.frame().await {
            read += frame.unwrap().into_data().unwrap().len();
            if read == 1000 {
                // The reader stops for ten seconds (the upstream does not read): not counted.
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
        }
        assert_eq!(read, 6600);
        assert!(!cut.is_cut());
        sending.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_ahead_of_the_rate_may_pause_until_its_average_falls_to_it() {
        let (tx, mut body, _cut) = paced(rate(100, Duration::from_secs(1)));
        tx.send(Bytes::from_static(&[b'x'; 500])).await.unwrap();
        assert_eq!(
            body.frame()
                .await
                .unwrap()
                .unwrap()
                .into_data()
                .unwrap()
                .len(),
            500
        );
        // 500 bytes allow five seconds of waiting.
        let started = Instant::now();
        let e = body.frame().await.unwrap().unwrap_err();
        assert!(e.is::<BodyTooSlow>());
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        drop(tx);
    }
}

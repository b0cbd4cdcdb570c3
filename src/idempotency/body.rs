//! One capped collector for both directions: a keyed request's body (to fingerprint and forward)
//! and a response (to record). Bounded buffering: a body that proves larger than the cap is never
//! read further.

use std::error::Error as StdError;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body as _, Frame};
use http_body_util::{BodyExt, BodyStream, StreamBody};

/// An error of any kind, boxed: what a body's error becomes in an axum [`Body`].
pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// The bounds a request's or the inner service's body needs to become an axum [`Body`]: bytes,
/// sendable, owned, with an error that boxes.
pub(crate) trait ByteBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> ByteBody for B
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
}

/// A body read whole, or found larger than the cap.
pub(crate) enum Collected {
    /// Every byte, in one buffer, and the trailers after them (a gRPC answer's status).
    Whole(Bytes, Option<HeaderMap>),
    /// More than the cap: the chunks read so far, and the rest, unread.
    TooLarge { read: Vec<Bytes>, rest: Body },
}

/// Read `body` to its end, or until it proves larger than `cap` bytes: by its size hint (a
/// declared `Content-Length`) before a byte is read, or while reading.
pub(crate) async fn collect_capped(mut body: Body, cap: u64) -> Result<Collected, axum::Error> {
    if body.size_hint().lower() > cap {
        return Ok(Collected::TooLarge {
            read: Vec::new(),
            rest: body,
        });
    }
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total = 0u64;
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        // Trailers are not fingerprinted; a response's are recorded.
        match frame?.into_data() {
            Ok(data) => {
                total += data.len() as u64;
                chunks.push(data);
                if total > cap {
                    return Ok(Collected::TooLarge {
                        read: chunks,
                        rest: body,
                    });
                }
            }
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    Ok(Collected::Whole(joined(chunks, total), trailers))
}

/// `chunks`, `total` bytes in all, in one buffer (copied only when there are several).
pub(crate) fn joined(chunks: Vec<Bytes>, total: u64) -> Bytes {
    match chunks.as_slice() {
        [] => Bytes::new(),
        [one] => one.clone(),
        _ => {
            let mut buf = BytesMut::with_capacity(total as usize);
            chunks.iter().for_each(|c| buf.extend_from_slice(c));
            buf.freeze()
        }
    }
}

/// The chunks already read, then the rest, its trailers included: a body found too large (or
/// a streaming call's), streamed on once.
pub(crate) fn replay_then_rest(read: Vec<Bytes>, rest: Body) -> Body {
    use futures_util::StreamExt;
    let read = futures_util::stream::iter(read.into_iter().map(|b| Ok(Frame::data(b))));
    Body::new(StreamBody::new(read.chain(BodyStream::new(rest))))
}

/// A whole body, then its trailers when it has some.
pub(crate) fn with_trailers(body: Bytes, trailers: Option<HeaderMap>) -> Body {
    let Some(trailers) = trailers else {
        return Body::from(body);
    };
    let frames = [Frame::data(body), Frame::trailers(trailers)];
    Body::new(StreamBody::new(futures_util::stream::iter(
        frames.into_iter().map(Ok::<_, axum::Error>),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(parts: &[&'static str]) -> Body {
        let stream = futures_util::stream::iter(
            parts
                .iter()
                .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p.as_bytes())))
                .collect::<Vec<_>>(),
        );
        Body::from_stream(stream)
    }

    async fn whole(c: Collected) -> Bytes {
        match c {
            Collected::Whole(b, _) => b,
            Collected::TooLarge { read, rest } => {
                panic!("too large after {} chunks: {rest:?}", read.len())
            }
        }
    }

    #[tokio::test]
    async fn reads_up_to_the_cap() {
        let b = collect_capped(chunked(&["ab", "cd"]), 4).await.unwrap();
        assert_eq!(whole(b).await, "abcd");
        let b = collect_capped(Body::from("abcd"), 4).await.unwrap();
        assert_eq!(whole(b).await, "abcd");
        let b = collect_capped(Body::empty(), 0).await.unwrap();
        assert_eq!(whole(b).await, "");
    }

    #[tokio::test]
    async fn trailers_are_kept_whole_or_streamed_on() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let body = || with_trailers(Bytes::from_static(b"abcd"), Some(trailers.clone()));
        match collect_capped(body(), 4).await.unwrap() {
            Collected::Whole(b, t) => {
                assert_eq!((b, t), (Bytes::from("abcd"), Some(trailers.clone())))
            }
            _ => panic!("within the cap"),
        }
        match collect_capped(body(), 2).await.unwrap() {
            Collected::TooLarge { read, rest } => {
                let all = replay_then_rest(read, rest).collect().await.unwrap();
                assert_eq!(all.trailers(), Some(&trailers));
                assert_eq!(all.to_bytes(), "abcd");
            }
            _ => panic!("over the cap"),
        }
    }

    #[tokio::test]
    async fn a_declared_length_over_the_cap_is_refused_unread() {
        match collect_capped(Body::from("abcde"), 4).await.unwrap() {
            Collected::TooLarge { read, rest } => {
                assert!(read.is_empty());
                let all = replay_then_rest(read, rest).collect().await.unwrap();
                assert_eq!(all.to_bytes(), "abcde");
            }
            _ => panic!("over the cap"),
        }
    }

    #[tokio::test]
    async fn a_stream_over_the_cap_stops_reading_and_keeps_every_byte() {
        match collect_capped(chunked(&["ab", "cd", "ef", "gh"]), 3)
            .await
            .unwrap()
        {
            Collected::TooLarge { read, rest } => {
                assert_eq!(read.len(), 2, "stopped at the chunk that crossed the cap");
                let all = replay_then_rest(read, rest).collect().await.unwrap();
                assert_eq!(all.to_bytes(), "abcdefgh");
            }
            _ => panic!("over the cap"),
        }
    }
}

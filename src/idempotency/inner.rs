//! What the layer and its inner service tell each other about one keyed request: the
//! [`Deadline`] the layer hands in, and the [`NotSent`] the inner service may answer with.

use std::error::Error as StdError;

use axum::body::Body;
use http::{Request, Response};
use tokio::time::Instant;

/// The bounds the engine needs of its inner service, written once: a tower service of
/// requests with an axum [`Body`], answering with `RB` bodies, that can be cloned and moved
/// into the task of a claimed call, with errors that say what they are.
pub(crate) trait Inner<RB>:
    tower::Service<
        Request<Body>,
        Response = Response<RB>,
        Future: Send,
        Error: StdError + Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, RB> Inner<RB> for S
where
    S: tower::Service<Request<Body>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: StdError + Send + 'static,
{
}

/// When the layer wants a keyed request's answer (head and body): handed to the inner service
/// as a request extension, so that it can bound its own waits by the same instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline(pub Instant);

/// Marks an inner service's error as "the request was certainly not processed" (a connection
/// that could not be made, say): the layer then releases the key, so that a retry runs at once.
///
/// The layer looks for it along the error's `source()` chain, so an inner service expresses it
/// by returning an error that is, or wraps, a `NotSent`. Every other error keeps the key claimed
/// until its lease ends, since the request may have been processed.
#[derive(Debug, thiserror::Error)]
#[error("the request was not sent: {cause}")]
pub struct NotSent {
    #[source]
    cause: Box<dyn StdError + Send + Sync>,
}

impl NotSent {
    /// Say that the request was not sent, because of `cause`.
    pub fn new(cause: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        NotSent {
            cause: cause.into(),
        }
    }
}

/// Whether `e`, or an error it was caused by, is a [`NotSent`].
pub(super) fn is_not_sent(e: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.is::<NotSent>() {
            return true;
        }
        cause = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_sent_is_found_along_the_source_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] NotSent);
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(is_not_sent(&NotSent::new(io)));
        assert!(is_not_sent(&Outer(NotSent::new("refused"))));
        let other = std::io::Error::other("reset");
        assert!(!is_not_sent(&other));
    }
}

//! Resuming a recorded server-sent-events answer (`text/event-stream`): a retry carrying
//! `Last-Event-ID: X` gets only the events after the one whose `id` field is X.

use http::header::{HeaderMap, HeaderName};

use crate::headers::media_type;
use crate::record::StoredResponse;

/// The header an SSE client sends when it reconnects: the id of the last event it saw.
pub(super) const LAST_EVENT_ID: HeaderName = HeaderName::from_static("last-event-id");

/// The `Last-Event-ID` a request carries, when it carries one.
pub(super) fn last_event_id(headers: &HeaderMap) -> Option<&[u8]> {
    headers.get(LAST_EVENT_ID).map(|v| v.as_bytes())
}

/// Whether a recorded answer is an event stream (its `Content-Type` is `text/event-stream`).
pub(super) fn is_event_stream(head: &StoredResponse) -> bool {
    head.headers.iter().any(|(n, v)| {
        n == http::header::CONTENT_TYPE
            && media_type(v.as_bytes()).is_some_and(|t| t.eq_ignore_ascii_case("text/event-stream"))
    })
}

/// Where an answer with head `head` and body `body` resumes for a retry carrying
/// `last_event_id`: after that event when the answer is an event stream that has it, otherwise
/// at the start.
pub(super) fn resume_at(head: &StoredResponse, body: &[u8], last_event_id: Option<&[u8]>) -> usize {
    match last_event_id {
        Some(id) if is_event_stream(head) => after_event(body, id).unwrap_or(0),
        _ => 0,
    }
}

/// Where the events after the first complete event whose `id` field is `id` begin in `body`;
/// `None` when no complete event carries that id (the whole stream is then sent).
pub(super) fn after_event(body: &[u8], id: &[u8]) -> Option<usize> {
    let mut at = 0;
    // The id field of the event being read, if it has one so far.
    let mut event_id: Option<&[u8]> = None;
    while at < body.len() {
        let (line, next) = line_at(body, at)?;
        if line.is_empty() {
            // A blank line ends (dispatches) the event.
            if event_id == Some(id) {
                return Some(next);
            }
            event_id = None;
        } else {
            let mut halves = line.splitn(2, |&b| b == b':');
            let field = halves.next().unwrap_or(line);
            let value = halves
                .next()
                .map_or(&b""[..], |v| v.strip_prefix(b" ").unwrap_or(v));
            if field == b"id" {
                event_id = Some(value);
            }
        }
        at = next;
    }
    None
}

/// The line starting at `at` (without its end: CRLF, LF or CR) and where the next one starts;
/// `None` for a last line with no end yet.
fn line_at(body: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let rest = body.get(at..)?;
    let end = rest.iter().position(|&b| b == b'\n' || b == b'\r')?;
    let (line, ending) = rest.split_at_checked(end)?;
    let next = match ending {
        [b'\r', b'\n', ..] => end + 2,
        // A CR at the very end may be the first half of a CRLF not read yet.
        [b'\r'] => return None,
        _ => end + 1,
    };
    Some((line, at + next))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &[u8] = b": comment\n\nid: 1\ndata: a\n\nid:2\r\ndata: b\r\n\r\ndata: no id\n\nid: 3\rdata: c\r\rid: 4\ndata: cut";

    #[test]
    fn resumes_after_the_event_with_the_id() {
        let after = |id: &str| after_event(STREAM, id.as_bytes()).map(|at| &STREAM[at..]);
        assert!(after("1").unwrap().starts_with(b"id:2\r\n"));
        assert!(after("2").unwrap().starts_with(b"data: no id\n"));
        assert!(after("3").unwrap().starts_with(b"id: 4\n"));
    }

    #[test]
    fn an_unknown_or_unfinished_event_resumes_nothing() {
        assert_eq!(after_event(STREAM, b"9"), None);
        assert_eq!(after_event(STREAM, b"4"), None, "event 4 is not complete");
        assert_eq!(after_event(STREAM, b""), None);
        assert_eq!(
            after_event(b"id: 1\ndata: x\n\r", b"1"),
            None,
            "CR at the end"
        );
        assert_eq!(after_event(b"id: 1\ndata: x\n\r\n", b"1"), Some(16));
    }

    #[test]
    fn lines_of_any_shape_are_read_without_fault() {
        assert_eq!(after_event(b"", b"1"), None);
        assert_eq!(after_event(b"\r", b""), None, "a lone CR may start a CRLF");
        assert_eq!(after_event(b"\n", b""), None, "an event without an id");
        assert_eq!(
            after_event(b"id\n\n", b""),
            Some(4),
            "a field without a colon"
        );
        assert_eq!(after_event(b"id:\r\n\r\n", b""), Some(7));
        assert_eq!(after_event(b":\n\n", b""), None, "a comment is no id field");
        assert_eq!(
            after_event(b"id:  x\n\n", b" x"),
            Some(8),
            "only one space goes"
        );
    }

    #[test]
    fn event_streams_are_told_by_their_type() {
        let with = |ct: &'static str| StoredResponse {
            status: http::StatusCode::OK,
            headers: vec![(http::header::CONTENT_TYPE, ct.parse().unwrap())],
            body: bytes::Bytes::new(),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        };
        assert!(is_event_stream(&with("text/event-stream")));
        assert!(is_event_stream(&with("Text/Event-Stream; charset=utf-8")));
        assert!(!is_event_stream(&with("application/json")));
    }
}

//! W3C trace context and the engine's spans as OpenTelemetry sees them. The spans are plain
//! `tracing` spans; when a `tracing-opentelemetry` layer records them (the gateway's
//! `[telemetry]`, or a library user's own layer), the engine also asks for their OTel context:
//! to record the request's own `traceparent` with its response, to send the upstream call's as
//! the upstream's parent, and to link a replay to the execution it replays. A span nobody
//! records is disabled, and then none of this runs.

use http::{HeaderMap, HeaderValue};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::response::TRACEPARENT;

/// The name of the span of one keyed request.
pub(crate) const REQUEST_SPAN: &str = "idempotent_request";

/// The span context a `traceparent` value carries (W3C Trace Context, level 1: version `00`,
/// or a later version read as `00`); none when it is malformed or all zeros.
pub(crate) fn parse(value: &[u8]) -> Option<SpanContext> {
    // ASCII, so that the slices below fall on character boundaries.
    let v = std::str::from_utf8(value).ok().filter(|v| v.is_ascii())?;
    let version = v.get(0..2)?;
    let valid_length = match version {
        "00" => v.len() == 55,
        "ff" => false,
        _ => v.len() == 55 || v.as_bytes().get(55) == Some(&b'-'),
    };
    let lower_hex = |s: &str| s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !valid_length || !lower_hex(version) || &v[2..3] != "-" || &v[35..36] != "-" {
        return None;
    }
    let (trace_id, span_id, flags) = (&v[3..35], &v[36..52], &v[53..55]);
    if &v[52..53] != "-" || ![trace_id, span_id, flags].iter().all(|s| lower_hex(s)) {
        return None;
    }
    let context = SpanContext::new(
        TraceId::from_hex(trace_id).ok()?,
        SpanId::from_hex(span_id).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    context.is_valid().then_some(context)
}

/// `context` as a `traceparent` value.
fn format(context: &SpanContext) -> Option<HeaderValue> {
    let value = format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8()
    );
    HeaderValue::from_str(&value).ok()
}

/// The OTel span context of `span`, when something records it as an OTel span.
fn context_of(span: &Span) -> Option<SpanContext> {
    if span.is_disabled() {
        return None;
    }
    let context = span.context().span().span_context().clone();
    context.is_valid().then_some(context)
}

/// `span`'s own `traceparent`, when it is recorded as an OTel span.
pub(super) fn traceparent_of(span: &Span) -> Option<HeaderValue> {
    context_of(span).and_then(|c| format(&c))
}

/// Make `span` the parent of what the request in `headers` starts downstream: its
/// `traceparent` replaces the client's, when it is recorded as an OTel span.
pub(super) fn inject(span: &Span, headers: &mut HeaderMap) {
    if let Some(value) = traceparent_of(span) {
        headers.insert(TRACEPARENT, value);
    }
}

/// Link `span` to the execution whose stored `traceparent` is `original` (a replay's span to the
/// miss it replays).
pub(super) fn link(span: &Span, original: &HeaderValue) {
    if span.is_disabled() {
        return;
    }
    if let Some(context) = parse(original.as_bytes()) {
        span.add_link(context);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_reads_and_writes_back() {
        let context = parse(VALID.as_bytes()).unwrap();
        assert!(context.is_sampled());
        assert_eq!(
            context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(context.span_id().to_string(), "00f067aa0ba902b7");
        assert_eq!(format(&context).unwrap(), VALID);
        let unsampled = parse(VALID.replace("-01", "-00").as_bytes()).unwrap();
        assert!(!unsampled.is_sampled());
        // A later version may append fields; its first four are read as version 00's.
        let later = format!("01{}-extra", &VALID[2..]);
        assert_eq!(parse(later.as_bytes()), Some(context));
    }

    #[test]
    fn malformed_traceparents_are_none() {
        for bad in [
            "",
            "00",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-\u{e9}",
        ] {
            assert_eq!(parse(bad.as_bytes()), None, "{bad:?}");
        }
    }

    #[test]
    fn a_span_nobody_records_has_no_traceparent() {
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, HeaderValue::from_static(VALID));
        let span = Span::none();
        inject(&span, &mut headers);
        assert_eq!(headers[TRACEPARENT], VALID);
        assert_eq!(traceparent_of(&span), None);
        link(&span, &HeaderValue::from_static(VALID));
    }
}

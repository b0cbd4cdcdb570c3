//! The stored record: an entry's compact binary encoding, written and read by the embedded,
//! Redis and PostgreSQL stores (the memory store keeps entries as they are).
//!
//! Layout of an encoded entry (all integers big-endian), version 3 (still read: version 2, without
//! the key source byte, and version 1, without the written-at time and the traceparent):
//!
//! ```text
//! [0]      format version (3)
//! [1]      state: b'P' in flight, b'C' completed (response follows), b'Z' the same with an
//!          LZ4-compressed body, b'N' completed, not replayable, b'X' a tombstone
//! [2..34]  request fingerprint (SHA-256)
//! [34..50] claim token (fences completion and release against a newer holder)
//! [50..58] when this entry was written, in ms since the Unix epoch
//! -- only for b'C':
//! u16      status
//! u16      header count, then per header: u16 name length, name, u32 value length, value
//! u8       length of the original request's W3C traceparent (0: none), then its bytes
//! u8       where the key came from: 0 unknown, 1 a header, 2 the body, 3 derived; plus
//!          TRAILERS_FOLLOW (0x80) when the response has trailers, which come next:
//! u16      trailer count, then per trailer as per header (only with TRAILERS_FOLLOW)
//! rest     body bytes; for b'Z' a u32 little-endian uncompressed length, then one LZ4 block
//! -- only for b'X' (the token is zeros; written-at is when the record was written):
//! u16      the record's status (0: not replayable)
//! u64      when the record expired, in ms since the Unix epoch
//! ```
//!
//! Trailers (a gRPC answer's status) came in without a new version: a record without them is
//! byte for byte what it was, and a build from before them refuses a record with them as one it
//! cannot decode (a bad key source) rather than replay it without its status.
//!
//! The Redis Lua scripts (`redis/lua/`) read the state byte and the token directly; the offsets and
//! state bytes are defined once here, and filled into the scripts when they load. A later version
//! keeps byte 0 as the version so that old records stay readable.

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, StatusCode};

use crate::record::fingerprint::Fingerprint;
use crate::record::key::KeySource;
use crate::record::key::ScopedKey;
use crate::record::{now_ms, Entry, EntryState, StoredResponse, Token, Tombstone};
use crate::store::seal::{Seal, Unreadable};
use crate::store::{DecodeError, StoreError};

/// The encoding version written by this build.
pub(crate) const FORMAT_VERSION: u8 = 3;
/// Offset of the state byte.
pub(crate) const STATE_AT: usize = 1;
/// Offset of the token.
pub(crate) const TOKEN_AT: usize = 34;
/// Offset of the written-at time.
pub(crate) const WRITTEN_AT: usize = 50;
/// Length of the fixed header before the response.
pub(crate) const HEADER_LEN: usize = 58;
/// State byte: claimed, in flight.
pub(crate) const IN_FLIGHT: u8 = b'P';
/// State byte: completed, the response follows.
pub(crate) const COMPLETED: u8 = b'C';
/// State byte: completed, the response follows with an LZ4-compressed body.
pub(crate) const COMPRESSED: u8 = b'Z';
/// State byte: completed, not replayable.
pub(crate) const NOT_REPLAYABLE: u8 = b'N';
/// State byte: a tombstone of an expired record.
pub(crate) const EXPIRED: u8 = b'X';

/// Set in the key-source byte when the response's trailers follow it.
const TRAILERS_FOLLOW: u8 = 0x80;

/// Bodies from this size on are worth trying to compress.
pub(crate) const COMPRESS_FROM: usize = 1024;

/// The most a compressed body may claim to expand to (a corrupt length must not allocate more).
const MAX_EXPANDED: usize = 1 << 30;

/// How one store writes and reads its entries: whether it compresses bodies, and how it seals
/// what it writes and opens what it reads. Claims are never compressed or sealed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Codec {
    compress: bool,
    seal: Seal,
}

impl Codec {
    pub(crate) fn new(compress: bool, seal: Seal) -> Self {
        Codec { compress, seal }
    }

    /// An in-flight claim.
    pub(crate) fn claim(&self, fingerprint: &Fingerprint, token: &Token) -> Bytes {
        encode(fingerprint, token, &EntryState::InFlight)
    }

    /// The entry `key` holds once completed with `state`, sealed when the store seals.
    pub(crate) fn record<'a>(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        state: &'a EntryState,
    ) -> Encoded<'a> {
        let parts = encode_parts(fingerprint, token, state, self.compress);
        match self.seal.seal(key, HEADER_LEN, &[&parts.head, &parts.body]) {
            Some(head) => Encoded {
                head,
                body: std::borrow::Cow::Borrowed(&[]),
            },
            None => parts,
        }
    }

    /// The tombstone `key`'s record leaves ([`encode_tombstone`]), sealed when the store seals.
    pub(crate) fn tombstone(
        &self,
        key: &ScopedKey,
        keep: crate::store::Keep,
        fingerprint: &Fingerprint,
        state: &EntryState,
    ) -> Option<(Bytes, std::time::Duration)> {
        let (clear, lives) = encode_tombstone(keep, fingerprint, state)?;
        let sealed = self
            .seal
            .seal(key, HEADER_LEN, &[&clear])
            .map(BytesMut::freeze);
        Some((sealed.unwrap_or(clear), lives))
    }

    /// The entry and claim token in `raw`, read from `key`'s record (or its tombstone),
    /// opened first when it is sealed.
    pub(crate) fn decode(&self, key: &ScopedKey, raw: Bytes) -> Result<(Entry, Token), StoreError> {
        if Seal::is_sealed(&raw, HEADER_LEN) {
            let clear = self.seal.open(key, (HEADER_LEN, FORMAT_VERSION), raw)?;
            return Ok(decode(clear)?);
        }
        // A claim holds no response: clear whatever the mode.
        let claim = raw.get(STATE_AT) == Some(&IN_FLIGHT);
        if self.seal.required() && !claim && !raw.is_empty() {
            return Err(Unreadable::Clear.into());
        }
        Ok(decode(raw)?)
    }
}
/// The most an LZ4 block expands: each byte of a match's length adds at most 255 bytes. A
/// compressed body that claims more is corrupt, and its length is never allocated.
const LZ4_MAX_RATIO: usize = 255;

/// The fewest bytes a stored header takes: its two lengths.
const MIN_HEADER_BYTES: usize = 6;

/// The encoded tombstone a record of `fingerprint` in `state`, kept as `keep` says, leaves, with
/// how long from now it lives; `None` when it leaves none.
pub(crate) fn encode_tombstone(
    keep: crate::store::Keep,
    fingerprint: &Fingerprint,
    state: &EntryState,
) -> Option<(Bytes, std::time::Duration)> {
    let (entry, lives) = keep.tombstone_of(fingerprint, state)?;
    // Written when its expiry was reckoned: the two say the record's ttl exactly.
    let encoded = encode_written(
        fingerprint,
        &Token([0; 16]),
        &entry.state,
        false,
        entry.written_ms,
    );
    Some((encoded.into_bytes(), lives))
}

/// Encode an entry (with its token) for the store, bodies as they are.
pub(crate) fn encode(fingerprint: &Fingerprint, token: &Token, state: &EntryState) -> Bytes {
    encode_with(fingerprint, token, state, false)
}

/// Encode an entry; with `compress`, a body of [`COMPRESS_FROM`] bytes or more that the
/// upstream did not encode itself (no `Content-Encoding`) is stored LZ4-compressed when that
/// saves at least an eighth of it.
pub(crate) fn encode_with(
    fingerprint: &Fingerprint,
    token: &Token,
    state: &EntryState,
    compress: bool,
) -> Bytes {
    encode_parts(fingerprint, token, state, compress).into_bytes()
}

/// An encoded entry in two parts, everything before the body and the body as stored, so that
/// a large body can be written where it goes (a Redis command) without being copied first.
pub(crate) struct Encoded<'a> {
    /// The fixed fields, status, headers and traceparent.
    pub(crate) head: BytesMut,
    /// The body as stored: the response's own bytes, or compressed.
    pub(crate) body: std::borrow::Cow<'a, [u8]>,
}

impl Encoded<'_> {
    /// The length of the whole encoding.
    pub(crate) fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }

    /// The whole encoding in one buffer.
    pub(crate) fn into_bytes(self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.len());
        out.put_slice(&self.head);
        out.put_slice(&self.body);
        out.freeze()
    }
}

/// [`encode_with`], in two parts.
pub(crate) fn encode_parts<'a>(
    fingerprint: &Fingerprint,
    token: &Token,
    state: &'a EntryState,
    compress: bool,
) -> Encoded<'a> {
    encode_written(fingerprint, token, state, compress, now_ms())
}

/// [`encode_parts`] of an entry written at `written_ms`.
fn encode_written<'a>(
    fingerprint: &Fingerprint,
    token: &Token,
    state: &'a EntryState,
    compress: bool,
    written_ms: u64,
) -> Encoded<'a> {
    let (tag, resp, body) = stored_body(state, compress);
    let size = HEADER_LEN
        + resp.map_or(0, |r| {
            4 + fields_len(&r.headers)
                + if r.trailers.is_empty() {
                    0
                } else {
                    2 + fields_len(&r.trailers)
                }
                + 1
                + r.traceparent.as_ref().map_or(0, |t| t.len().min(255))
                + 1
        });
    let mut out = BytesMut::with_capacity(size + 10);
    out.put_u8(FORMAT_VERSION);
    out.put_u8(tag);
    out.put_slice(&fingerprint.0);
    out.put_slice(&token.0);
    out.put_u64(written_ms);
    if let Some(r) = resp {
        put_response_head(&mut out, r);
    }
    if let EntryState::Expired(t) = state {
        out.put_u16(t.status.map_or(0, |s| s.as_u16()));
        out.put_u64(t.expired_ms);
    }
    Encoded { head: out, body }
}

/// The state byte of `state`, its response (when completed), and the body as stored: with
/// `compress`, a body of [`COMPRESS_FROM`] bytes or more that the upstream did not encode
/// itself, LZ4-compressed when that saves at least an eighth of it.
fn stored_body(
    state: &EntryState,
    compress: bool,
) -> (u8, Option<&StoredResponse>, std::borrow::Cow<'_, [u8]>) {
    use std::borrow::Cow;
    let compressed = match state {
        EntryState::Completed(r)
            if compress
                && r.body.len() >= COMPRESS_FROM
                && !r
                    .headers
                    .iter()
                    .any(|(n, _)| n == http::header::CONTENT_ENCODING) =>
        {
            let packed = lz4_flex::block::compress_prepend_size(&r.body);
            (packed.len() <= r.body.len() - r.body.len() / 8).then_some(packed)
        }
        _ => None,
    };
    let (tag, resp) = match state {
        EntryState::InFlight => (IN_FLIGHT, None),
        EntryState::Completed(r) if compressed.is_some() => (COMPRESSED, Some(&**r)),
        EntryState::Completed(r) => (COMPLETED, Some(&**r)),
        EntryState::NotReplayable => (NOT_REPLAYABLE, None),
        EntryState::Expired(_) => (EXPIRED, None),
    };
    let body = match (compressed, resp) {
        (Some(packed), _) => Cow::Owned(packed),
        (None, Some(r)) => Cow::Borrowed(&r.body[..]),
        (None, None) => Cow::Borrowed(&[][..]),
    };
    (tag, resp, body)
}

/// A completed response's fields before its body: status, headers, traceparent, key source
/// and, when it has any, its trailers.
fn put_response_head(out: &mut BytesMut, r: &StoredResponse) {
    out.put_u16(r.status.as_u16());
    put_fields(out, &r.headers);
    // A traceparent is 55 bytes; anything longer than a length byte allows is not one.
    match r.traceparent.as_ref().filter(|t| t.len() <= 255) {
        Some(t) => {
            out.put_u8(t.len() as u8);
            out.put_slice(t.as_bytes());
        }
        None => out.put_u8(0),
    }
    let source = match r.key_source {
        None => 0,
        Some(KeySource::Header) => 1,
        Some(KeySource::Body) => 2,
        Some(KeySource::Derived) => 3,
    };
    if r.trailers.is_empty() {
        out.put_u8(source);
    } else {
        out.put_u8(source | TRAILERS_FOLLOW);
        put_fields(out, &r.trailers);
    }
}

/// The bytes `fields` take in a record.
fn fields_len(fields: &[(HeaderName, HeaderValue)]) -> usize {
    fields
        .iter()
        .map(|(n, v)| 6 + n.as_str().len() + v.len())
        .sum()
}

/// A u16 count, then per field: u16 name length, name, u32 value length, value. A header name
/// is at most 65535 bytes (the `http` crate's bound); past 65535 fields, far more than an HTTP
/// client takes (hyper: 100), only the first 65535 are kept, so that the count stays true.
fn put_fields(out: &mut BytesMut, fields: &[(HeaderName, HeaderValue)]) {
    let count = u16::try_from(fields.len()).unwrap_or(u16::MAX);
    out.put_u16(count);
    for (n, v) in fields.iter().take(usize::from(count)) {
        out.put_u16(n.as_str().len() as u16);
        out.put_slice(n.as_str().as_bytes());
        out.put_u32(v.len() as u32);
        out.put_slice(v.as_bytes());
    }
}

/// Fields as [`put_fields`] writes them.
fn get_fields(buf: &mut Bytes) -> Result<Vec<(HeaderName, HeaderValue)>, DecodeError> {
    need(buf, 2)?;
    let count = buf.get_u16() as usize;
    let mut fields = Vec::with_capacity(count.min(buf.remaining() / MIN_HEADER_BYTES));
    for _ in 0..count {
        need(buf, 2)?;
        let n = buf.get_u16() as usize;
        need(buf, n + 4)?;
        let name =
            HeaderName::from_bytes(&buf.split_to(n)).map_err(|_| DecodeError("bad header name"))?;
        let v = buf.get_u32() as usize;
        need(buf, v)?;
        let value = HeaderValue::from_maybe_shared(buf.split_to(v))
            .map_err(|_| DecodeError("bad header value"))?;
        fields.push((name, value));
    }
    Ok(fields)
}

/// At least `n` bytes are left in `buf`.
fn need(buf: &Bytes, n: usize) -> Result<(), DecodeError> {
    if buf.remaining() < n {
        Err(DecodeError("truncated"))
    } else {
        Ok(())
    }
}

/// The `N` bytes of `raw` from `at` on.
fn fixed<const N: usize>(raw: &[u8], at: usize) -> Result<[u8; N], DecodeError> {
    raw.get(at..)
        .and_then(<[u8]>::first_chunk::<N>)
        .copied()
        .ok_or(DecodeError("too short"))
}

/// Decode bytes read from the store. The body is a zero-copy slice of `raw`.
pub(crate) fn decode(raw: Bytes) -> Result<(Entry, Token), DecodeError> {
    // Version 1 (the first release) is still read: no written-at time, no traceparent.
    let (version, header_len, v1) = match raw.first() {
        Some(&v @ 1) => (v, WRITTEN_AT, true),
        Some(&v @ (2 | 3)) => (v, HEADER_LEN, false),
        Some(_) => return Err(DecodeError("unknown version")),
        None => return Err(DecodeError("too short")),
    };
    if raw.len() < header_len {
        return Err(DecodeError("too short"));
    }
    let fingerprint = Fingerprint(fixed(&raw, 2)?);
    let token = Token(fixed(&raw, TOKEN_AT)?);
    let written_ms = if v1 {
        0
    } else {
        u64::from_be_bytes(fixed(&raw, WRITTEN_AT)?)
    };
    let [state] = fixed(&raw, STATE_AT)?;
    let state = match state {
        IN_FLIGHT => EntryState::InFlight,
        NOT_REPLAYABLE => EntryState::NotReplayable,
        COMPLETED => {
            EntryState::Completed(Arc::new(decode_response(raw.slice(header_len..), version)?))
        }
        COMPRESSED if !v1 => {
            let mut r = decode_response(raw.slice(header_len..), version)?;
            let (expanded, block) = lz4_flex::block::uncompressed_size(&r.body)
                .map_err(|_| DecodeError("truncated compressed body"))?;
            if expanded > MAX_EXPANDED || expanded > block.len().saturating_mul(LZ4_MAX_RATIO) {
                return Err(DecodeError("implausible compressed body length"));
            }
            r.body = lz4_flex::block::decompress_size_prepended(&r.body)
                .map_err(|_| DecodeError("corrupt compressed body"))?
                .into();
            EntryState::Completed(Arc::new(r))
        }
        EXPIRED if raw.len() >= HEADER_LEN + 10 && !v1 => {
            let mut rest = raw.slice(HEADER_LEN..);
            let status = match rest.get_u16() {
                0 => None,
                s => Some(StatusCode::from_u16(s).map_err(|_| DecodeError("bad status"))?),
            };
            EntryState::Expired(Tombstone {
                status,
                expired_ms: rest.get_u64(),
            })
        }
        _ => return Err(DecodeError("unknown state")),
    };
    Ok((
        Entry {
            fingerprint,
            state,
            expires_in: None,
            written_ms,
        },
        token,
    ))
}

fn decode_response(mut buf: Bytes, version: u8) -> Result<StoredResponse, DecodeError> {
    let with_trace = version >= 2;
    need(&buf, 2)?;
    let status = StatusCode::from_u16(buf.get_u16()).map_err(|_| DecodeError("bad status"))?;
    let headers = get_fields(&mut buf)?;
    let t = if with_trace {
        need(&buf, 1)?;
        buf.get_u8() as usize
    } else {
        0
    };
    need(&buf, t)?;
    let traceparent = match t {
        0 => None,
        _ => Some(
            HeaderValue::from_maybe_shared(buf.split_to(t))
                .map_err(|_| DecodeError("bad traceparent"))?,
        ),
    };
    let source = if version >= 3 {
        need(&buf, 1)?;
        buf.get_u8()
    } else {
        0
    };
    let key_source = match source & !TRAILERS_FOLLOW {
        0 => None,
        1 => Some(KeySource::Header),
        2 => Some(KeySource::Body),
        3 => Some(KeySource::Derived),
        _ => return Err(DecodeError("bad key source")),
    };
    let trailers = if source & TRAILERS_FOLLOW != 0 {
        get_fields(&mut buf)?
    } else {
        Vec::new()
    };
    Ok(StoredResponse {
        status,
        headers,
        body: buf,
        trailers,
        traceparent,
        key_source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_binary_bodies_and_headers() {
        let body: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let resp = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/octet-stream"),
                ),
                (
                    HeaderName::from_static("set-cookie"),
                    HeaderValue::from_static("a=1"),
                ),
                (
                    HeaderName::from_static("set-cookie"),
                    HeaderValue::from_static("b=2"),
                ),
            ],
            body: Bytes::from(body),
            trailers: Vec::new(),
            traceparent: Some(HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )),
            key_source: Some(KeySource::Body),
        };
        let fp = Fingerprint([7; 32]);
        let tok = Token::random();
        let raw = encode(&fp, &tok, &EntryState::Completed(Arc::new(resp.clone())));
        // 58 fixed + 4 (status, count) + 3 headers (6 bytes of lengths each + name + value)
        // + traceparent (1 + 55) + key source (1) + body.
        assert_eq!(
            raw.len(),
            HEADER_LEN + 4 + (6 + 12 + 24) + 2 * (6 + 10 + 3) + 56 + 1 + 1000
        );
        let before = now_ms();
        let (entry, tok2) = decode(raw).unwrap();
        assert_eq!(tok2, tok);
        assert_eq!(entry.fingerprint, fp);
        assert!(entry.written_ms <= before && entry.written_ms + 60_000 > before);
        match entry.state {
            EntryState::Completed(r) => assert_eq!(*r, resp),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn trailers_round_trip_and_a_record_without_them_is_unchanged() {
        let field = |n: &'static str, v: &'static str| {
            (HeaderName::from_static(n), HeaderValue::from_static(v))
        };
        let mut resp = StoredResponse {
            status: StatusCode::OK,
            headers: vec![field("content-type", "application/grpc")],
            body: Bytes::from_static(b"\0\0\0\0\x01x"),
            trailers: vec![field("grpc-status", "0"), field("x-trail", "a")],
            traceparent: None,
            key_source: Some(KeySource::Header),
        };
        let (fp, tok) = (Fingerprint([7; 32]), Token([1; 16]));
        let raw = encode(&fp, &tok, &EntryState::Completed(Arc::new(resp.clone())));
        match decode(raw.clone()).unwrap().0.state {
            EntryState::Completed(r) => assert_eq!(*r, resp),
            other => panic!("unexpected {other:?}"),
        }
        // Cut inside the trailers: refused, never read as a response without its status.
        assert!(decode(raw.slice(..raw.len() - 12)).is_err());
        let with = raw.len();
        resp.trailers.clear();
        let without = encode(&fp, &tok, &EntryState::Completed(Arc::new(resp)));
        assert_eq!(with - without.len(), 2 + (6 + 11 + 1) + (6 + 7 + 1));
        assert_eq!(without[without.len() - 7], 1, "the key source alone");
    }

    #[test]
    fn a_response_with_more_fields_than_a_count_holds_keeps_the_first_65535() {
        let field = (HeaderName::from_static("x"), HeaderValue::from_static("y"));
        let resp = StoredResponse {
            status: StatusCode::OK,
            headers: vec![field; usize::from(u16::MAX) + 1],
            body: Bytes::from_static(b"body"),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        };
        let (fp, tok) = (Fingerprint([7; 32]), Token([1; 16]));
        let raw = encode(&fp, &tok, &EntryState::Completed(Arc::new(resp)));
        match decode(raw).unwrap().0.state {
            EntryState::Completed(r) => {
                assert_eq!(r.headers.len(), usize::from(u16::MAX));
                assert_eq!(r.body, "body");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn in_flight_and_truncated() {
        let raw = encode(
            &Fingerprint([1; 32]),
            &Token([2; 16]),
            &EntryState::InFlight,
        );
        assert_eq!(raw.len(), HEADER_LEN);
        assert!(matches!(
            decode(raw.clone()).unwrap().0.state,
            EntryState::InFlight
        ));
        assert!(decode(raw.slice(..10)).is_err());
        let mut c = encode(
            &Fingerprint([1; 32]),
            &Token([2; 16]),
            &EntryState::Completed(Arc::new(StoredResponse {
                status: StatusCode::OK,
                headers: vec![(HeaderName::from_static("x"), HeaderValue::from_static("y"))],
                body: Bytes::new(),
                trailers: Vec::new(),
                traceparent: None,
                key_source: None,
            })),
        )
        .to_vec();
        c.truncate(c.len() - 1);
        assert!(decode(Bytes::from(c)).is_err());
    }

    #[test]
    fn version_1_records_stay_readable() {
        // A completed v1 record: no written-at time, no traceparent byte.
        let mut v1 = vec![1u8, b'C'];
        v1.extend_from_slice(&[7; 32]);
        v1.extend_from_slice(&[3; 16]);
        v1.extend_from_slice(&201u16.to_be_bytes());
        v1.extend_from_slice(&1u16.to_be_bytes());
        v1.extend_from_slice(&1u16.to_be_bytes());
        v1.extend_from_slice(b"x");
        v1.extend_from_slice(&1u32.to_be_bytes());
        v1.extend_from_slice(b"y");
        v1.extend_from_slice(b"old body");
        let (entry, token) = decode(Bytes::from(v1)).unwrap();
        assert_eq!(token, Token([3; 16]));
        assert_eq!(entry.written_ms, 0);
        match entry.state {
            EntryState::Completed(r) => {
                assert_eq!(r.status, StatusCode::CREATED);
                assert_eq!(r.body.as_ref(), b"old body");
                assert!(r.traceparent.is_none());
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            decode(Bytes::from_static(&[9, b'P'])).is_err(),
            "unknown versions are refused"
        );
    }

    fn completed(body: Vec<u8>, encoding: Option<&'static str>) -> EntryState {
        let mut headers = vec![(
            HeaderName::from_static("content-type"),
            HeaderValue::from_static("application/json"),
        )];
        if let Some(e) = encoding {
            headers.push((
                HeaderName::from_static("content-encoding"),
                HeaderValue::from_static(e),
            ));
        }
        EntryState::Completed(Arc::new(StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::from(body),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        }))
    }

    fn body_of(raw: Bytes) -> Bytes {
        match decode(raw).unwrap().0.state {
            EntryState::Completed(r) => r.body.clone(),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn compressible_bodies_are_stored_compressed_and_read_back_whole() {
        let json: Vec<u8> = (0..2000)
            .flat_map(|i| {
                format!("{{\"id\":\"pi_{i:08}\",\"status\":\"succeeded\"}},").into_bytes()
            })
            .collect();
        let (fp, tok) = (Fingerprint([1; 32]), Token::random());
        let state = completed(json.clone(), None);
        let plain = encode(&fp, &tok, &state);
        let packed = encode_with(&fp, &tok, &state, true);
        assert_eq!(plain[STATE_AT], b'C');
        assert_eq!(packed[STATE_AT], b'Z');
        assert!(
            packed.len() * 3 < plain.len(),
            "{} vs {}",
            packed.len(),
            plain.len()
        );
        assert_eq!(body_of(packed.clone()), json);
        // The fixed fields the Lua scripts read are where they always are.
        assert_eq!(&packed[TOKEN_AT..WRITTEN_AT], &tok.0);
        // A corrupt compressed body is an error, not a wrong replay.
        let mut bad = packed.to_vec();
        let n = bad.len();
        bad[n - 20..].fill(0xff);
        assert!(decode(Bytes::from(bad)).is_err());
    }

    #[test]
    fn a_compressed_length_past_what_lz4_can_expand_is_refused() {
        let (fp, tok) = (Fingerprint([1; 32]), Token::random());
        let packed = encode_with(&fp, &tok, &completed(vec![b'a'; 4096], None), true);
        assert_eq!(packed[STATE_AT], COMPRESSED);
        // The block of 4096 'a's is a few bytes: 4096 is within 255 times it, 1 GiB is not.
        let at = packed.len() - lz4_flex::block::compress(&[b'a'; 4096]).len() - 4;
        let mut huge = packed.to_vec();
        huge[at..at + 4].copy_from_slice(&((1u32 << 30) - 1).to_le_bytes());
        let err = decode(Bytes::from(huge)).unwrap_err();
        assert_eq!(err.0, "implausible compressed body length");
        assert_eq!(body_of(packed), vec![b'a'; 4096]);
    }

    #[test]
    fn bodies_that_do_not_shrink_are_stored_as_they_are() {
        let (fp, tok) = (Fingerprint([1; 32]), Token::random());
        // Already encoded by the upstream, too small, or incompressible: stored as is.
        let gz = completed(vec![b'a'; 10_000], Some("gzip"));
        assert_eq!(encode_with(&fp, &tok, &gz, true)[STATE_AT], b'C');
        let small = completed(vec![b'a'; COMPRESS_FROM - 1], None);
        assert_eq!(encode_with(&fp, &tok, &small, true)[STATE_AT], b'C');
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let noise: Vec<u8> = (0..10_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let random = completed(noise.clone(), None);
        let raw = encode_with(&fp, &tok, &random, true);
        assert_eq!(raw[STATE_AT], b'C');
        assert_eq!(body_of(raw), noise);
    }
}

#[cfg(test)]
mod sealed {
    use std::sync::Arc;

    use bytes::Bytes;

    use crate::record::fingerprint::Fingerprint;
    use crate::record::key::ScopedKey;
    use crate::record::{EntryState, StoredResponse, Token};
    use crate::store::codec::{self, Codec};
    use crate::store::seal::{Seal, SealKeys, SealMode, Unreadable, SEALED_VERSION, SEAL_KEYS_VAR};
    use http::{HeaderName, HeaderValue, StatusCode};

    const K1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const K2: &str = "k2:HxwdHhobGBkWFxQVEhMQEQ4PDA0KCwgJBgcEBQIDAAE=";

    fn seal(mode: SealMode, keys: &str) -> Seal {
        Seal::new(mode, Some(SealKeys::parse(keys).unwrap())).unwrap()
    }

    fn completed(body: &str) -> EntryState {
        EntryState::Completed(Arc::new(StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            )],
            body: Bytes::from(body.to_string()),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        }))
    }

    fn body(state: &EntryState) -> &[u8] {
        match state {
            EntryState::Completed(r) => &r.body,
            other => panic!("unexpected {other:?}"),
        }
    }

    const MARKER: &str = "card 4242-MARKER-4242 of Ada Lovelace";

    #[test]
    fn a_sealed_record_cut_anywhere_is_unreadable_when_opened() {
        let key = ScopedKey([1; 32]);
        let keys = seal(SealMode::On, K1);
        let (fp, tok) = (Fingerprint([3; 32]), Token([4; 16]));
        let raw = Codec::new(false, keys.clone())
            .record(&key, &fp, &tok, &completed("{}"))
            .into_bytes();
        let open = |raw: Bytes| keys.open(&key, (codec::HEADER_LEN, codec::FORMAT_VERSION), raw);
        assert!(open(raw.clone()).is_ok());
        // Opened directly, without the length check of Seal::is_sealed first.
        for len in 0..raw.len() {
            assert!(open(raw.slice(..len)).is_err(), "cut at {len}");
        }
        // A key id length past the end.
        let mut long_id = raw.to_vec();
        long_id[codec::HEADER_LEN] = u8::MAX;
        long_id.truncate(codec::HEADER_LEN + 40);
        assert!(open(Bytes::from(long_id)).is_err());
    }

    #[test]
    fn a_sealed_record_holds_no_clear_response_and_opens_for_its_key_only() {
        let (key, other) = (ScopedKey([1; 32]), ScopedKey([2; 32]));
        let (fp, tok) = (Fingerprint([3; 32]), Token::random());
        let c = Codec::new(true, seal(SealMode::On, K1));
        let state = completed(&MARKER.repeat(100));
        let raw = c.record(&key, &fp, &tok, &state).into_bytes();
        assert_eq!(raw[0], SEALED_VERSION);
        let marker = MARKER.as_bytes();
        assert!(!raw.windows(marker.len()).any(|w| w == marker));
        // The clear header the Redis scripts read is where it always is.
        assert_eq!(raw[codec::STATE_AT], codec::COMPRESSED);
        assert_eq!(&raw[codec::TOKEN_AT..codec::WRITTEN_AT], &tok.0);
        let (entry, token) = c.decode(&key, raw.clone()).unwrap();
        assert_eq!(token, tok);
        assert_eq!(entry.fingerprint, fp);
        assert_eq!(body(&entry.state), MARKER.repeat(100).as_bytes());
        // Copied to another key: does not open.
        let e = c.decode(&other, raw.clone()).unwrap_err();
        assert!(
            matches!(
                e,
                crate::store::StoreError::Unreadable(Unreadable::Tampered { .. })
            ),
            "{e}"
        );
    }

    #[test]
    fn any_changed_byte_or_a_cut_makes_it_unreadable() {
        let key = ScopedKey([1; 32]);
        let c = Codec::new(false, seal(SealMode::On, K1));
        let raw = c
            .record(
                &key,
                &Fingerprint([3; 32]),
                &Token([4; 16]),
                &completed("{}"),
            )
            .into_bytes();
        for at in 0..raw.len() {
            let mut bad = raw.to_vec();
            bad[at] ^= 0x01;
            assert!(
                c.decode(&key, Bytes::from(bad)).is_err(),
                "byte {at} flipped"
            );
        }
        for len in 0..raw.len() {
            assert!(c.decode(&key, raw.slice(..len)).is_err(), "cut at {len}");
        }
    }

    #[test]
    fn older_listed_keys_open_and_unlisted_ones_do_not() {
        let key = ScopedKey([1; 32]);
        let (fp, tok) = (Fingerprint([3; 32]), Token([4; 16]));
        let old = Codec::new(false, seal(SealMode::On, K1));
        let raw = old.record(&key, &fp, &tok, &completed("x")).into_bytes();
        let rotated = Codec::new(false, seal(SealMode::On, &format!("{K2},{K1}")));
        assert_eq!(
            body(&rotated.decode(&key, raw.clone()).unwrap().0.state),
            b"x"
        );
        // New records are sealed with the first key.
        let new = rotated
            .record(&key, &fp, &tok, &completed("y"))
            .into_bytes();
        assert_eq!(&new[codec::HEADER_LEN..codec::HEADER_LEN + 3], b"\x02k2");
        let dropped = Codec::new(false, seal(SealMode::On, K2));
        let e = dropped.decode(&key, raw).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the record is sealed with key k1, which IDEMGATE_SEAL_KEYS does not list"
        );
        // The same id with another key: the tag does not verify.
        let impostor = Codec::new(false, seal(SealMode::On, &K2.replace("k2", "k1")));
        let raw = old.record(&key, &fp, &tok, &completed("x")).into_bytes();
        assert!(matches!(
            impostor.decode(&key, raw),
            Err(crate::store::StoreError::Unreadable(
                Unreadable::Tampered { .. }
            ))
        ));
    }

    #[test]
    fn clear_records_open_unless_sealing_is_required_and_claims_always() {
        let key = ScopedKey([1; 32]);
        let (fp, tok) = (Fingerprint([3; 32]), Token([4; 16]));
        let clear = Codec::default()
            .record(&key, &fp, &tok, &completed("old"))
            .into_bytes();
        let on = Codec::new(false, seal(SealMode::On, K1));
        assert_eq!(
            body(&on.decode(&key, clear.clone()).unwrap().0.state),
            b"old"
        );
        let required = Codec::new(false, seal(SealMode::Required, K1));
        assert!(matches!(
            required.decode(&key, clear),
            Err(crate::store::StoreError::Unreadable(Unreadable::Clear))
        ));
        let claim = required.claim(&fp, &tok);
        assert!(matches!(
            required.decode(&key, claim).unwrap().0.state,
            EntryState::InFlight
        ));
        // Sealing off still opens what was sealed while it was on.
        let sealed = on.record(&key, &fp, &tok, &completed("new")).into_bytes();
        let off = Codec::new(false, seal(SealMode::Off, K1));
        assert_eq!(
            body(&off.decode(&key, sealed.clone()).unwrap().0.state),
            b"new"
        );
        assert_eq!(
            off.record(&key, &fp, &tok, &completed("z")).into_bytes()[0],
            codec::FORMAT_VERSION
        );
        assert!(matches!(
            Codec::default().decode(&key, sealed),
            Err(crate::store::StoreError::Unreadable(
                Unreadable::UnknownKey { .. }
            ))
        ));
    }

    #[test]
    fn tombstones_are_sealed_too() {
        let key = ScopedKey([1; 32]);
        let (fp, tok) = (Fingerprint([3; 32]), Token([4; 16]));
        let c = Codec::new(false, seal(SealMode::Required, K1));
        let keep = crate::store::Keep {
            ttl: crate::record::policy::Ttl::For(std::time::Duration::from_secs(60)),
            tombstone: Some(std::time::Duration::from_secs(600)),
        };
        let (raw, _) = c.tombstone(&key, keep, &fp, &completed("x")).unwrap();
        assert_eq!(raw[0], SEALED_VERSION);
        let _ = tok;
        match c.decode(&key, raw.clone()).unwrap().0.state {
            EntryState::Expired(t) => assert_eq!(t.status, Some(StatusCode::CREATED)),
            other => panic!("unexpected {other:?}"),
        }
        assert!(c.decode(&key.tombstone(), raw).is_err());
    }

    #[test]
    fn bad_key_lists_are_refused_without_quoting_a_key() {
        for (keys, reason) in [
            ("", "key 1 is not id:<base64 of 32 bytes>"),
            ("k1", "key 1 is not id:<base64 of 32 bytes>"),
            (
                "k1:AAEC",
                "key \"k1\" is 3 bytes; a key is 32 random bytes in base64",
            ),
            ("k1:not base64!", "key \"k1\" is not base64"),
            (&format!("{K1},{K1}"), "key id \"k1\" is listed twice"),
            (&K1.replace("k1", "k 1"), "key 1: its id must be"),
        ] {
            let e = SealKeys::parse(keys)
                .err()
                .unwrap_or_else(|| panic!("{keys:?} accepted"));
            assert!(e.starts_with(reason), "{keys:?}: {e}");
            assert!(!e.contains("AAEC") && !e.contains("AAECAwQF"), "{e}");
        }
        let many: Vec<String> = (0..17)
            .map(|i| K1.replace("k1", &format!("k{i}")))
            .collect();
        assert!(SealKeys::parse(&many.join(","))
            .unwrap_err()
            .contains("at most 16"));
        assert!(Seal::new(SealMode::On, None)
            .unwrap_err()
            .contains(SEAL_KEYS_VAR));
        let s = seal(SealMode::Required, &format!("{K2},{K1}"));
        assert_eq!(
            s.describe(),
            "required (seals with k2; opens with k2, k1 (from IDEMGATE_SEAL_KEYS))"
        );
        assert!(!format!("{s:?}").contains("AAEC"));
    }
}

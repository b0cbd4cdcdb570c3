//! Records sealed at rest: a completed record's response (and a tombstone's contents) encrypted
//! and authenticated with AES-256-GCM before it leaves the process for a store.
//!
//! A sealed entry keeps the clear header the stores and the Redis scripts read (version, state,
//! fingerprint, token, written-at: [`codec`](super::codec)), followed by the id of the key that
//! sealed it, a fresh random nonce, and the rest of the clear encoding encrypted, with its tag:
//!
//! ```text
//! [0..58]  the clear header, version byte SEALED_VERSION
//! u8       key id length, then the key id
//! [12]     nonce
//! rest     the encoding's bytes after the header, encrypted, then the 16-byte tag
//! ```
//!
//! The associated data is the record's scoped key (the full SHA-256 of the key and its scope)
//! followed by everything before the nonce: a record copied or renamed to another key, one whose
//! header (state, fingerprint, token, times) or key id was edited, or one cut short fails to
//! open. Claims (in flight) carry no response and are never sealed; their token and fingerprint
//! are bound when the completed record replaces them.

use std::fmt;
use std::sync::Arc;

use base64::Engine;
use bytes::{BufMut, Bytes, BytesMut};
use rand::RngCore;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

use crate::idempotency::key::ScopedKey;

/// The environment variable the sealing keys come from (never a file: they are secrets).
pub const SEAL_KEYS_VAR: &str = "IDEMGATE_SEAL_KEYS";

/// The version byte of a sealed entry (the clear encoding's is below it).
pub(crate) const SEALED_VERSION: u8 = 4;

/// Bytes of a key.
const KEY_LEN: usize = 32;
/// Bytes of the authentication tag.
const TAG_LEN: usize = 16;
/// The longest key id.
const MAX_ID_LEN: usize = 32;
/// The most keys listed at once.
const MAX_KEYS: usize = 16;

/// Whether new records are sealed, and whether clear ones are still read (`[store] seal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SealMode {
    /// Records are written in clear (sealed ones still open when their key is listed).
    #[default]
    Off,
    /// New records are sealed; clear ones written before still replay.
    On,
    /// New records are sealed, and a clear completed record is unreadable.
    Required,
}

/// One sealing key and its id.
struct SealKey {
    id: String,
    key: LessSafeKey,
    // For comparing configurations only.
    secret: [u8; KEY_LEN],
}

/// The keys of `IDEMGATE_SEAL_KEYS`: the first seals, every one opens.
pub struct SealKeys(Vec<SealKey>);

impl SealKeys {
    /// Read `id:<base64 of 32 bytes>,id:...`; the reason it is refused never quotes a key.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut keys: Vec<SealKey> = Vec::new();
        for (n, item) in text.split(',').map(str::trim).enumerate() {
            let at = n + 1;
            let Some((id, encoded)) = item.split_once(':') else {
                return Err(format!(
                    "key {at} is not id:<base64 of {KEY_LEN} bytes> (e.g. k1:$(openssl rand -base64 32))"
                ));
            };
            let id = id.trim();
            if id.is_empty()
                || id.len() > MAX_ID_LEN
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return Err(format!(
                    "key {at}: its id must be 1 to {MAX_ID_LEN} letters, digits, '-', '_' or '.'"
                ));
            }
            if keys.iter().any(|k| k.id == id) {
                return Err(format!("key id {id:?} is listed twice"));
            }
            let secret = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .map_err(|_| format!("key {id:?} is not base64"))?;
            let secret: [u8; KEY_LEN] = secret.as_slice().try_into().map_err(|_| {
                format!(
                    "key {id:?} is {} bytes; a key is {KEY_LEN} random bytes in base64",
                    secret.len()
                )
            })?;
            let key = UnboundKey::new(&AES_256_GCM, &secret).expect("a 32-byte key");
            keys.push(SealKey {
                id: id.to_string(),
                key: LessSafeKey::new(key),
                secret,
            });
        }
        if keys.len() > MAX_KEYS {
            return Err(format!(
                "{} keys listed; at most {MAX_KEYS} (drop keys older than the longest ttl)",
                keys.len()
            ));
        }
        Ok(SealKeys(keys))
    }

    /// The keys' ids, the sealing one first.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|k| k.id.as_str())
    }

    fn find(&self, id: &[u8]) -> Option<&SealKey> {
        self.0.iter().find(|k| k.id.as_bytes() == id)
    }
}

/// How a store seals what it writes and opens what it reads: a mode and, unless sealing is off
/// and no record needs opening, the keys. Printed, it shows the key ids only.
#[derive(Clone, Default)]
pub struct Seal {
    mode: SealMode,
    keys: Option<Arc<SealKeys>>,
}

impl Seal {
    /// Seal as `mode` says with `keys` (needed unless the mode is off).
    pub fn new(mode: SealMode, keys: Option<SealKeys>) -> Result<Self, String> {
        if mode != SealMode::Off && keys.is_none() {
            return Err(format!("store.seal = \"{}\" needs the keys in {SEAL_KEYS_VAR} (id:<base64 of {KEY_LEN} random bytes>, the first seals)", mode.name()));
        }
        Ok(Seal {
            mode,
            keys: keys.map(Arc::new),
        })
    }

    /// `mode` before its keys are read: checked by [`new`](Self::new) once they are.
    pub(crate) fn unkeyed(mode: SealMode) -> Self {
        Seal { mode, keys: None }
    }

    /// The mode and the key ids, as `check-config` shows them (never a key).
    pub fn describe(&self) -> String {
        let ids: Vec<&str> = self.keys.iter().flat_map(|k| k.ids()).collect();
        let opens = match ids.as_slice() {
            [] => format!("{SEAL_KEYS_VAR} not set"),
            ids => format!("opens with {} (from {SEAL_KEYS_VAR})", ids.join(", ")),
        };
        match self.sealing_key() {
            Some(k) => format!("{} (seals with {}; {opens})", self.mode.name(), k.id),
            None => format!("{} ({opens})", self.mode.name()),
        }
    }

    /// The mode.
    pub fn mode(&self) -> SealMode {
        self.mode
    }

    /// The key new records are sealed with, when they are sealed.
    fn sealing_key(&self) -> Option<&SealKey> {
        match self.mode {
            SealMode::Off => None,
            SealMode::On | SealMode::Required => self.keys.as_ref().and_then(|k| k.0.first()),
        }
    }

    /// The sealed form of `clear` (the parts of a clear encoding of a completed entry or a
    /// tombstone, its header first) for the record of `key`; `None` when sealing is off.
    pub(crate) fn seal(&self, key: &ScopedKey, clear: &[&[u8]]) -> Option<BytesMut> {
        let k = self.sealing_key()?;
        let header = &clear[0][..HEADER_LEN];
        let plain_len: usize = clear.iter().map(|p| p.len()).sum::<usize>() - HEADER_LEN;
        let id = k.id.as_bytes();
        let at = HEADER_LEN + 1 + id.len();
        let mut out = BytesMut::with_capacity(at + NONCE_LEN + plain_len + TAG_LEN);
        out.put_u8(SEALED_VERSION);
        out.put_slice(&header[1..]);
        out.put_u8(id.len() as u8);
        out.put_slice(id);
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        out.put_slice(&nonce);
        out.put_slice(&clear[0][HEADER_LEN..]);
        for part in &clear[1..] {
            out.put_slice(part);
        }
        let aad = associated(key, &out[..at]);
        let (_, plain) = out.split_at_mut(at + NONCE_LEN);
        let tag = k
            .key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&aad[..]),
                plain,
            )
            .expect("a record is far below AES-GCM's length limit");
        out.put_slice(tag.as_ref());
        Some(out)
    }

    /// The clear encoding of the entry `raw` read for `key`: opened when it is sealed, as it is
    /// when it is clear and may be (a claim, or any entry unless sealing is required).
    pub(crate) fn open(&self, key: &ScopedKey, raw: Bytes) -> Result<Bytes, Unreadable> {
        if raw.len() <= HEADER_LEN || raw[0] != SEALED_VERSION {
            let claim = raw.get(super::codec::STATE_AT) == Some(&super::codec::IN_FLIGHT);
            if self.mode == SealMode::Required && !claim && !raw.is_empty() {
                return Err(Unreadable::Clear);
            }
            return Ok(raw);
        }
        let id_len = raw[HEADER_LEN] as usize;
        let at = HEADER_LEN + 1 + id_len;
        if raw.len() < at + NONCE_LEN + TAG_LEN {
            return Err(Unreadable::Tampered { key_id: None });
        }
        let mut id = [0u8; u8::MAX as usize];
        id[..id_len].copy_from_slice(&raw[HEADER_LEN + 1..at]);
        let id = &id[..id_len];
        let key_id = || Some(String::from_utf8_lossy(id).into_owned());
        let Some(k) = self.keys.as_ref().and_then(|keys| keys.find(id)) else {
            return Err(Unreadable::UnknownKey { key_id: key_id() });
        };
        let aad = associated(key, &raw[..at]);
        let nonce: [u8; NONCE_LEN] = raw[at..at + NONCE_LEN].try_into().expect("nonce");
        let mut clear = Vec::from(raw);
        let skip = at + NONCE_LEN - HEADER_LEN;
        let opened = k.key.open_within(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&aad[..]),
            &mut clear[HEADER_LEN..],
            skip..,
        );
        let Ok(plain) = opened else {
            return Err(Unreadable::Tampered { key_id: key_id() });
        };
        let len = HEADER_LEN + plain.len();
        clear.truncate(len);
        clear[0] = super::codec::FORMAT_VERSION;
        Ok(Bytes::from(clear))
    }
}

use super::codec::HEADER_LEN;

/// The associated data of a sealed entry: the scoped key, then everything before the nonce.
fn associated(key: &ScopedKey, before_nonce: &[u8]) -> Vec<u8> {
    let mut aad = Vec::with_capacity(32 + before_nonce.len());
    aad.extend_from_slice(&key.0);
    aad.extend_from_slice(before_nonce);
    aad
}

impl SealMode {
    /// The mode as `seal` is written.
    pub fn name(self) -> &'static str {
        match self {
            SealMode::Off => "off",
            SealMode::On => "on",
            SealMode::Required => "required",
        }
    }
}

impl fmt::Debug for Seal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Key ids only, never a key.
        let ids: Vec<&str> = self.keys.iter().flat_map(|k| k.ids()).collect();
        f.debug_struct("Seal")
            .field("mode", &self.mode)
            .field("key_ids", &ids)
            .field("sealing_key", &self.sealing_key().map(|k| k.id.as_str()))
            .finish()
    }
}

impl fmt::Debug for SealKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Ids only, never a key.
        f.debug_list().entries(self.ids()).finish()
    }
}

impl PartialEq for Seal {
    fn eq(&self, other: &Self) -> bool {
        let keys = |s: &Seal| -> Vec<(String, [u8; KEY_LEN])> {
            s.keys
                .iter()
                .flat_map(|k| k.0.iter().map(|k| (k.id.clone(), k.secret)))
                .collect()
        };
        self.mode == other.mode && keys(self) == keys(other)
    }
}

impl Eq for Seal {}

/// Why a record read from the store cannot be opened. It is never replayed and never run again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// The tag does not verify: the record was edited, cut short, copied from another key, or
    /// sealed with another key under the same id.
    #[error("the sealed record does not open with key {}: it was changed, cut short or written for another key", key_id.as_deref().unwrap_or("?"))]
    Tampered {
        /// The key id the record names, if it names one.
        key_id: Option<String>,
    },
    /// The record was sealed with a key that `IDEMGATE_SEAL_KEYS` does not list.
    #[error("the record is sealed with key {}, which {SEAL_KEYS_VAR} does not list", key_id.as_deref().unwrap_or("?"))]
    UnknownKey {
        /// The key id the record names.
        key_id: Option<String>,
    },
    /// A completed record in clear where `seal = "required"`.
    #[error("the record is in clear and store.seal = \"required\"")]
    Clear,
}

impl Unreadable {
    /// Every [`reason`](Self::reason).
    pub const REASONS: [&'static str; 3] = ["tampered", "unknown_key", "clear"];

    /// The metric label: `tampered`, `unknown_key` or `clear`.
    pub fn reason(&self) -> &'static str {
        match self {
            Unreadable::Tampered { .. } => "tampered",
            Unreadable::UnknownKey { .. } => "unknown_key",
            Unreadable::Clear => "clear",
        }
    }

    /// The id of the key the record names, when it names one.
    pub fn key_id(&self) -> Option<&str> {
        match self {
            Unreadable::Tampered { key_id } | Unreadable::UnknownKey { key_id } => {
                key_id.as_deref()
            }
            Unreadable::Clear => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::fingerprint::Fingerprint;
    use crate::idempotency::record::{EntryState, StoredResponse, Token};
    use crate::store::codec::{self, Codec};
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
            ttl: crate::idempotency::policy::Ttl::For(std::time::Duration::from_secs(60)),
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

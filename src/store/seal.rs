//! Records sealed at rest: a completed record's response (and a tombstone's contents) encrypted
//! and authenticated with AES-256-GCM before it leaves the process for a store.
//!
//! A sealed entry keeps the clear header the stores and the Redis scripts read (version, state,
//! fingerprint, token, written-at: `store/codec.rs`), followed by the id of the key that
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

use crate::record::key::ScopedKey;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
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
            let key = UnboundKey::new(&AES_256_GCM, &secret)
                .map_err(|_| format!("key {id:?} is not an AES-256 key"))?;
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
    /// tombstone, its header of `header_len` bytes first) for the record of `key`; `None` when
    /// sealing is off.
    #[expect(
        clippy::indexing_slicing,
        clippy::expect_used,
        reason = "the parts are this build's own encoding, its first part the whole header at \
                  least; a record (bounded by max_body) is far below AES-GCM's 64 GiB"
    )]
    pub(crate) fn seal(
        &self,
        key: &ScopedKey,
        header_len: usize,
        clear: &[&[u8]],
    ) -> Option<BytesMut> {
        let k = self.sealing_key()?;
        let header = &clear[0][..header_len];
        let plain_len: usize = clear.iter().map(|p| p.len()).sum::<usize>() - header_len;
        let id = k.id.as_bytes();
        let at = header_len + 1 + id.len();
        let mut out = BytesMut::with_capacity(at + NONCE_LEN + plain_len + TAG_LEN);
        out.put_u8(SEALED_VERSION);
        out.put_slice(&header[1..]);
        out.put_u8(id.len() as u8);
        out.put_slice(id);
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        out.put_slice(&nonce);
        out.put_slice(&clear[0][header_len..]);
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

    /// Whether clear completed records are refused (`required`).
    pub(crate) fn required(&self) -> bool {
        self.mode == SealMode::Required
    }

    /// Whether `raw` is a sealed entry (its header being `header_len` bytes).
    pub(crate) fn is_sealed(raw: &[u8], header_len: usize) -> bool {
        raw.len() > header_len && raw.first() == Some(&SEALED_VERSION)
    }

    /// The clear encoding (version byte `clear_version`) of the sealed entry `raw` read for
    /// `key`, whose clear header is `header_len` bytes.
    pub(crate) fn open(
        &self,
        key: &ScopedKey,
        (header_len, clear_version): (usize, u8),
        raw: Bytes,
    ) -> Result<Bytes, Unreadable> {
        let cut = Unreadable::Tampered { key_id: None };
        let Some(&id_len) = raw.get(header_len) else {
            return Err(cut);
        };
        let at = header_len + 1 + usize::from(id_len);
        if raw.len() < at + NONCE_LEN + TAG_LEN {
            return Err(cut);
        }
        let (Some(before_nonce), Some(id), Some(nonce)) = (
            raw.get(..at),
            raw.get(header_len + 1..at),
            raw.get(at..).and_then(<[u8]>::first_chunk::<NONCE_LEN>),
        ) else {
            return Err(cut);
        };
        let (id, nonce) = (id.to_vec(), *nonce);
        let key_id = || Some(String::from_utf8_lossy(&id).into_owned());
        let Some(k) = self.keys.as_ref().and_then(|keys| keys.find(&id)) else {
            return Err(Unreadable::UnknownKey { key_id: key_id() });
        };
        let aad = associated(key, before_nonce);
        let mut clear = Vec::from(raw);
        let skip = at + NONCE_LEN - header_len;
        let opened = match clear.get_mut(header_len..) {
            Some(sealed) => k.key.open_within(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&aad[..]),
                sealed,
                skip..,
            ),
            None => return Err(cut),
        };
        let Ok(plain) = opened else {
            return Err(Unreadable::Tampered { key_id: key_id() });
        };
        let len = header_len + plain.len();
        clear.truncate(len);
        if let Some(version) = clear.first_mut() {
            *version = clear_version;
        }
        Ok(Bytes::from(clear))
    }
}

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
    /// Every reason a record does not open, as labelled in `idemgate_records_unreadable_total`
    /// (the tag did not verify, the key id is not listed, a clear record where sealing is
    /// required).
    pub const REASONS: [&'static str; 3] = ["tampered", "unknown_key", "clear"];

    /// The metric label: `tampered`, `unknown_key` or `clear`.
    pub fn reason(&self) -> &'static str {
        let [tampered, unknown_key, clear] = Self::REASONS;
        match self {
            Unreadable::Tampered { .. } => tampered,
            Unreadable::UnknownKey { .. } => unknown_key,
            Unreadable::Clear => clear,
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

//! Values checked as they are read. A [`Checked<R>`] reads `R::Raw` and keeps what the rule `R`
//! makes of it; a value the rule refuses fails the deserialisation there, and the error is
//! turned into [`ConfigError::Invalid`] naming the field as written (`routes[1].ttl`), whether the
//! value came from the file or the environment.

use std::marker::PhantomData;

use serde::de::{self, DeserializeOwned, Deserializer};
use serde::Deserialize;

use super::ConfigError;

/// A rule for one kind of value: what is read, what it becomes, and why it may be refused.
pub(super) trait Rule {
    /// The value as written.
    type Raw: DeserializeOwned;
    /// The value as the engine or the store holds it.
    type Value: Clone;
    /// `raw` as a value, or the reason it is refused.
    fn check(raw: Self::Raw) -> Result<Self::Value, String>;
}

/// A value that passed its rule.
pub(super) struct Checked<R: Rule>(R::Value);

impl<R: Rule> Checked<R> {
    /// The checked value.
    pub(super) fn get(&self) -> &R::Value {
        &self.0
    }

    /// The checked value, owned.
    pub(super) fn into_inner(self) -> R::Value {
        self.0
    }
}

impl<R: Rule> std::fmt::Debug for Checked<R>
where
    R::Value: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<'de, R: Rule> Deserialize<'de> for Checked<R> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = R::Raw::deserialize(d)?;
        R::check(raw)
            .map(Checked)
            .map_err(|reason| de::Error::custom(format!("{REFUSED}{reason}")))
    }
}

/// Any value of `T`, as written.
pub(super) struct Any<T>(PhantomData<T>);

impl<T: DeserializeOwned + Clone> Rule for Any<T> {
    type Raw = T;
    type Value = T;
    fn check(raw: T) -> Result<T, String> {
        Ok(raw)
    }
}

/// Defines rules as `Name: Raw => Value = check_fn;`, each a unit type.
macro_rules! rules {
    ($($(#[$doc:meta])* $name:ident: $raw:ty => $value:ty = $check:expr;)*) => {
        $(
            $(#[$doc])*
            pub(super) struct $name;

            impl $crate::config::checked::Rule for $name {
                type Raw = $raw;
                type Value = $value;
                fn check(raw: $raw) -> Result<$value, String> {
                    ($check)(raw)
                }
            }
        )*
    };
}
pub(super) use rules;

/// Begins the message of a deserialisation error that is a rule's refusal (never shown: the
/// error becomes [`ConfigError::Invalid`]).
const REFUSED: &str = "\u{1}refused: ";

/// The error of reading TOML text: a refusal names the field; any other error is toml's, with
/// its line and column.
pub(super) fn from_toml(e: serde_path_to_error::Error<toml::de::Error>) -> ConfigError {
    match e.inner().message().strip_prefix(REFUSED) {
        Some(reason) => ConfigError::invalid(e.path().to_string(), reason),
        None => ConfigError::Parse(e.into_inner().to_string()),
    }
}

/// The error of reading the file and the environment together: a refusal names the field; any
/// other error is figment's, saying where the value came from. A key of the file is named as
/// written (`routes[0].ttl`, not figment's `default.routes.0.ttl`, whose `default.` is its
/// profile); one of the environment as figment names it (`DEFAULTS.TTL`).
pub(super) fn from_figment(e: figment::Error) -> ConfigError {
    if let figment::error::Kind::Message(m) = &e.kind {
        if let Some(reason) = m.strip_prefix(REFUSED) {
            return ConfigError::invalid(field_name(&e.path), reason);
        }
    }
    let errors = e.into_iter().map(|mut e| {
        e.metadata = e.metadata.map(|md| match md.name.starts_with("TOML") {
            true => md.interpolater(|_: &figment::Profile, keys: &[&str]| field_name(keys)),
            false => md,
        });
        e.to_string()
    });
    ConfigError::Parse(errors.collect::<Vec<_>>().join("\n"))
}

/// A path of keys as a user writes it: `routes[0].ttl`.
fn field_name(keys: &[impl AsRef<str>]) -> String {
    let mut name = String::new();
    for key in keys.iter().map(AsRef::as_ref) {
        if key.parse::<usize>().is_ok() && !name.is_empty() {
            name.push_str(&format!("[{key}]"));
        } else {
            if !name.is_empty() {
                name.push('.');
            }
            name.push_str(key);
        }
    }
    name
}

//! Values checked as they are read. A [`Checked<R>`] reads `R::Raw` and keeps what the rule `R`
//! makes of it; a value the rule refuses fails the deserialisation there, and the error is
//! turned into [`ConfigError::Invalid`] naming the field as written (`routes[1].ttl`), whether the
//! value came from the file or the environment.

use serde::de::{self, DeserializeOwned, Deserializer};
use serde::Deserialize;

pub(super) use super::human::refused;
use super::human::{HumanDuration, HumanSize, HumanTtl, REFUSED};
use super::written::Written;
use super::ConfigError;
use crate::record::policy::check;
// The record's rules the other tables use too, read as `written!` says.
pub(super) use crate::record::policy::check::{AtLeastOne, NonZero, NonZeroSize};

/// A rule for one kind of value: what is read, what it becomes, and why it may be refused.
pub(super) trait Rule {
    /// The value as written.
    type Raw: DeserializeOwned;
    /// The value as the engine or the store holds it, and as `check-config` writes it back.
    type Value: Clone + Written;
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

impl<R: Rule> Clone for Checked<R> {
    fn clone(&self) -> Self {
        Checked(self.0.clone())
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
            .map_err(|reason| refused("", reason))
    }
}

/// The fields a struct with a derived `Deserialize` reads, as the derive declares them.
pub(super) fn fields_of<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Fields<'a>(&'a mut &'static [&'static str]);

    impl<'de> Deserializer<'de> for Fields<'_> {
        type Error = de::value::Error;

        fn deserialize_struct<V: de::Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("only the fields are read"))
        }

        fn deserialize_any<V: de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut fields));
    fields
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

/// The field within the value (`""`: the value itself) and the reason, if `message` is a
/// refusal.
fn refusal(message: &str) -> Option<(&str, &str)> {
    message.strip_prefix(REFUSED)?.split_once('\u{1}')
}

/// `path` and the field within it, joined.
fn join(path: String, within: &str) -> String {
    match (path.as_str(), within) {
        (_, "") => path,
        ("", _) => within.to_string(),
        _ => format!("{path}.{within}"),
    }
}

/// The error of reading TOML text: a refusal names the field; any other error is toml's, with
/// its line and column.
pub(super) fn from_toml(e: serde_path_to_error::Error<toml::de::Error>) -> ConfigError {
    match refusal(e.inner().message()) {
        Some((within, reason)) => ConfigError::invalid(join(e.path().to_string(), within), reason),
        None => ConfigError::Parse(e.into_inner().to_string()),
    }
}

/// A value read from a [`toml::Value`]: a refusal or any other error as `(field, reason)`, the
/// field within the value.
pub(super) fn from_value<T: DeserializeOwned>(value: toml::Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        match refusal(e.inner().message()) {
            Some((within, reason)) => (join(path, within), reason.to_string()),
            None => (path, e.inner().message().to_string()),
        }
    })
}

/// The error of reading the file and the environment together: a refusal names the field; any
/// other error is figment's, saying where the value came from. A key of the file is named as
/// written (`routes[0].ttl`, not figment's `default.routes.0.ttl`, whose `default.` is its
/// profile); one of the environment as figment names it (`DEFAULTS.TTL`).
pub(super) fn from_figment(e: figment::Error) -> ConfigError {
    if let figment::error::Kind::Message(m) = &e.kind {
        if let Some((within, reason)) = refusal(m) {
            return ConfigError::invalid(join(field_name(&e.path), within), reason);
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

/// The record's rules (`record::policy::check`) as the TOML writes what they read: the `human`
/// ones from a human string (`"30s"`, `"forever"`, `"1MiB"`), a newtype whose `.0` the rule
/// checks; the others from the value itself. A new rule there takes its name here.
macro_rules! written {
    (human: $($human:ident($raw:ident)),*; as_is: $($as_is:ident),*;) => {
        $(impl Rule for check::$human {
            type Raw = $raw;
            type Value = <check::$human as check::Rule>::Value;
            fn check(raw: $raw) -> Result<Self::Value, String> {
                <check::$human as check::Rule>::check(raw.0)
            }
        })*
        $(impl Rule for check::$as_is {
            type Raw = <check::$as_is as check::Rule>::Input;
            type Value = <check::$as_is as check::Rule>::Value;
            fn check(raw: Self::Raw) -> Result<Self::Value, String> {
                <check::$as_is as check::Rule>::check(raw)
            }
        })*
    };
}

written! {
    human: NonZero(HumanDuration), LockTtl(HumanDuration), Lifetime(HumanTtl), NonZeroSize(HumanSize);
    as_is: AtLeastOne, KeyMaxLen, MismatchStatus, Methods, HeaderNames, KeyHeaders,
        OptionalHeaderName, Pointers, IgnoredPointers, CookieNames, UpstreamName, MethodNames,
        OptionalSender, OptionalVarName;
}

impl<T: DeserializeOwned + Clone + Written> Rule for check::Any<T> {
    type Raw = T;
    type Value = T;
    fn check(raw: T) -> Result<T, String> {
        Ok(raw)
    }
}

/// One string or a list of them, as `key_from_body` is written (a single pointer, the older
/// form, or pointers tried in order).
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl Rule for check::BodyKeyPointers {
    type Raw = OneOrMany;
    type Value = <check::BodyKeyPointers as check::Rule>::Value;
    fn check(raw: OneOrMany) -> Result<Self::Value, String> {
        let texts = match raw {
            OneOrMany::One(text) => vec![text],
            OneOrMany::Many(texts) => texts,
        };
        <check::BodyKeyPointers as check::Rule>::check(texts)
    }
}

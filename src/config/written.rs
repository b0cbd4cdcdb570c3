//! Values as a configuration file writes them, for the TOML `check-config` prints: each in the
//! form its reader (`checked`, [`human`](super::human)) reads back as the same value.

use http::{HeaderName, Method, StatusCode, Uri};

use crate::record::json::Pointer;

/// A value in the form the configuration reads it from.
pub(crate) trait Written {
    /// The value as TOML writes it.
    fn written(&self) -> toml::Value;
}

/// A string value.
pub(super) fn text(s: impl Into<String>) -> toml::Value {
    toml::Value::String(s.into())
}

impl Written for bool {
    fn written(&self) -> toml::Value {
        toml::Value::Boolean(*self)
    }
}

/// Counts: every one the configuration reads came from a TOML integer, so fits one.
macro_rules! integers {
    ($($ty:ty),*) => {$(
        impl Written for $ty {
            fn written(&self) -> toml::Value {
                toml::Value::Integer(i64::try_from(*self).unwrap_or(i64::MAX))
            }
        }
    )*};
}
integers!(usize, u32, u16);

impl Written for f64 {
    fn written(&self) -> toml::Value {
        toml::Value::Float(*self)
    }
}

impl Written for String {
    fn written(&self) -> toml::Value {
        text(self.as_str())
    }
}

impl Written for Method {
    fn written(&self) -> toml::Value {
        text(self.as_str())
    }
}

impl Written for HeaderName {
    fn written(&self) -> toml::Value {
        text(self.as_str())
    }
}

impl Written for StatusCode {
    fn written(&self) -> toml::Value {
        self.as_u16().written()
    }
}

impl Written for Pointer {
    fn written(&self) -> toml::Value {
        text(self.as_str())
    }
}

impl Written for Uri {
    fn written(&self) -> toml::Value {
        text(self.to_string())
    }
}

impl<T: Written> Written for Vec<T> {
    fn written(&self) -> toml::Value {
        toml::Value::Array(self.iter().map(Written::written).collect())
    }
}

/// None is written as `""`, as the optional fields (`expiry_header`, `webhook`) read it.
impl<T: Written> Written for Option<T> {
    fn written(&self) -> toml::Value {
        self.as_ref().map_or_else(|| text(""), Written::written)
    }
}

/// The enums a field names by their serde name (`"reject"`, `"lz4"`).
macro_rules! named {
    ($($ty:ty),*) => {$(
        impl Written for $ty {
            fn written(&self) -> toml::Value {
                toml::Value::try_from(self).unwrap_or_else(|_| text(format!("{self:?}")))
            }
        }
    )*};
}
named!(
    crate::record::policy::OnInFlight,
    crate::record::policy::OnStoreError,
    crate::record::policy::FingerprintMode,
    crate::record::policy::AfterExpiry,
    crate::record::policy::Protocol,
    crate::record::policy::Sender,
    crate::error::ErrorFormat,
    crate::store::SealMode,
    crate::store::Compression
);

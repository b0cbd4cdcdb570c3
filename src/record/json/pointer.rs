//! JSON pointers (RFC 6901) into a parsed body.

use super::parse::Json;

/// A JSON pointer (RFC 6901), its reference tokens unescaped. In a `fingerprint_ignore`
/// pattern, the token `*` also matches any array index.
#[derive(Clone, PartialEq, Eq)]
pub struct Pointer {
    text: String,
    // The reference tokens, unescaped: the canonical form's walk matches them.
    pub(super) tokens: Vec<String>,
}

impl std::fmt::Debug for Pointer {
    /// As written in the config: `"/items/*/client_ts"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.text, f)
    }
}

impl Pointer {
    /// Parse a pointer: empty (the whole document), or `/`-separated tokens with `~1` for `/`
    /// and `~0` for `~`.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Ok(Pointer {
                text: String::new(),
                tokens: Vec::new(),
            });
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!(
                "{text:?} is not a JSON pointer: it must start with '/'"
            ));
        };
        let tokens = rest
            .split('/')
            .map(|t| {
                let mut out = String::with_capacity(t.len());
                let mut chars = t.chars();
                while let Some(c) = chars.next() {
                    match c {
                        '~' => match chars.next() {
                            Some('0') => out.push('~'),
                            Some('1') => out.push('/'),
                            _ => {
                                return Err(format!(
                                    "{text:?} is not a JSON pointer: '~' must be followed by 0 or 1"
                                ))
                            }
                        },
                        c => out.push(c),
                    }
                }
                Ok(out)
            })
            .collect::<Result<_, _>>()?;
        Ok(Pointer {
            text: text.to_string(),
            tokens,
        })
    }

    /// The pointer as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The value it points to in `doc`.
    pub(crate) fn get<'d, 'a>(&self, doc: &'d Json<'a>) -> Option<&'d Json<'a>> {
        let mut at = doc;
        for token in &self.tokens {
            at = match at {
                Json::Object(members) => members
                    .binary_search_by(|(k, _)| k.as_ref().cmp(token.as_str()))
                    .ok()
                    .and_then(|i| members.get(i))
                    .map(|(_, value)| value)?,
                Json::Array(items) => items.get(array_index(token)?)?,
                _ => return None,
            };
        }
        Some(at)
    }
}

/// An array index token: digits without a leading zero (no sign: `usize`'s parser takes `+1`).
pub(super) fn array_index(token: &str) -> Option<usize> {
    if token.is_empty()
        || (token.len() > 1 && token.starts_with('0'))
        || !token.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    token.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::super::parse::parse;
    use super::*;
    #[test]
    fn pointers_follow_rfc_6901() {
        let doc = parse(br#"{"a/b":{"m~n":[10,{"x":"y"}]},"":1}"#).unwrap();
        let get = |p: &str| Pointer::parse(p).unwrap().get(&doc).cloned();
        assert!(matches!(get("/a~1b/m~0n/1/x"), Some(Json::String(s)) if s.value() == "y"));
        assert!(matches!(
            get("/a~1b/m~0n/0"),
            Some(Json::Number(n)) if n.as_str() == "10"
        ));
        assert!(matches!(get("/"), Some(Json::Number(_))), "the empty key");
        assert!(get("/a~1b/m~0n/01").is_none(), "no leading zeros");
        assert!(get("/a~1b/m~0n/+1").is_none(), "no sign");
        assert!(get("/missing").is_none());
        assert!(Pointer::parse("a").is_err());
        assert!(Pointer::parse("/a~2").is_err());
    }
}

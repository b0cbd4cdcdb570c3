//! `[defaults]` and `[[routes]]`: one table of optional policy fields, each value checked by the
//! policy's rule for it as it is read, so that a route's policy is its table merged over
//! `[defaults]`, merged over the built-in [`Policy::default`]. The table's fields are those of
//! the policy's one list, [`policy_fields!`] (in `record/policy.rs`), that have a rule.

use std::marker::PhantomData;

use serde::Deserialize;

use super::checked::Checked;
// The list names its rules and their types bare; they resolve here.
use crate::record::policy::{check::*, *};
use crate::record::policy::{policy_fields, Policy};

/// Makes, from the rows of [`policy_fields!`], the table with its serde schema, and the merge
/// that sets on a policy the fields the table names.
macro_rules! policy_table {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $ty:ty = $default:expr
        $(, rule $rule:ty $(, set $(<$lt:lifetime>)? ($arg:ident: $arg_ty:ty) $(=> $input:expr)?)?)?;
    )*) => {
        /// `[defaults]` or one `[[routes]]` entry, as written: every field optional, so that a
        /// table overrides only what it names. (`path` is in the same struct rather than beside
        /// a flattened policy, because serde cannot deny unknown fields through a flatten.)
        #[derive(Debug, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(super) struct PolicyTable {
            /// Only in `[[routes]]`: the path pattern.
            pub(super) path: Option<String>,
            $($($field: Option<Checked<$rule>>,)?)*
        }

        impl PolicyTable {
            /// `policy` with every field this table names set to the table's value.
            pub(super) fn merged_over(&self, mut policy: Policy) -> Policy {
                $($(if let Some(value) = &self.$field {
                    policy.$field = Checked::<$rule>::get(value).clone();
                })?)*
                policy
            }

            /// Each field a table can name, with its value in `policy` as written.
            pub(super) fn written(policy: &Policy) -> Vec<(&'static str, toml::Value)> {
                vec![$($((stringify!($field), {
                    let _: PhantomData<$rule> = PhantomData;
                    crate::config::written::Written::written(&policy.$field)
                }),)?)*]
            }

            /// Whether this table names `field`.
            pub(super) fn sets(&self, field: &str) -> bool {
                match field {
                    $($(stringify!($field) => {
                        let _: PhantomData<$rule> = PhantomData;
                        self.$field.is_some()
                    })?)*
                    _ => false,
                }
            }
        }
    };
}

policy_fields!(policy_table);

impl PolicyTable {
    /// Whether this table sets `max_ttl`.
    pub(super) fn sets_max_ttl(&self) -> bool {
        self.max_ttl.is_some()
    }

    /// Whether this table sets `ttl` (a webhook route's default differs).
    pub(super) fn sets_ttl(&self) -> bool {
        self.ttl.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::super::checked::fields_of;
    use super::PolicyTable;

    /// The places a policy field is written besides its row in the list: its row in the
    /// reference's policy table and its line in the example's `[defaults]`, both checked here
    /// against the table the list makes, so that none is forgotten or left behind.
    #[test]
    fn every_policy_field_has_its_docs_row_and_its_example_line() {
        let dir = env!("CARGO_MANIFEST_DIR");
        let fields: Vec<&str> = fields_of::<PolicyTable>()
            .iter()
            .copied()
            .filter(|f| *f != "path")
            .collect();
        assert!(fields.len() > 30, "{fields:?}");

        let docs = std::fs::read_to_string(format!("{dir}/docs/configuration.md")).unwrap();
        let section = docs
            .split("\n### Policy")
            .nth(1)
            .and_then(|rest| rest.split("\n#").next())
            .unwrap();
        let rows: Vec<&str> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            // A route's `path` has its row too, though it is no policy field.
            .filter(|f| *f != "path")
            .collect();
        let mut sorted = fields.clone();
        sorted.sort_unstable();
        let mut documented = rows.clone();
        documented.sort_unstable();
        assert_eq!(
            documented, sorted,
            "the policy rows of docs/configuration.md"
        );

        let example = std::fs::read_to_string(format!("{dir}/config/example.toml")).unwrap();
        let defaults = example
            .split("\n[defaults]\n")
            .nth(1)
            .and_then(|rest| rest.split("\n[[routes]]\n").next())
            .unwrap();
        for field in fields {
            let line = format!("\n{field} = ");
            assert!(
                defaults.contains(&line),
                "example.toml's [defaults] lacks {field}"
            );
        }
    }
}

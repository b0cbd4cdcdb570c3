//! A webhook route's settings, settled once its table is merged: the secrets read from the
//! variable `webhook_secret_env` names (never from the file, never printed), and a `ttl` that
//! covers the senders' retry horizon unless the route sets its own.

use super::{invalid, ConfigError};
use crate::record::policy::{Policy, Ttl};
use crate::record::webhook::{WebhookSecrets, WEBHOOK_TTL};

/// `policy` (the table at `at`, which sets `ttl` itself when `sets_ttl`) with its webhook
/// secrets read from `vars` (`None`: the process's environment); an error naming
/// `{at}.webhook_secret_env` when the variable is missing, unset, empty or unreadable.
pub(super) fn settle(
    mut policy: Policy,
    sets_ttl: bool,
    vars: Option<&[(String, String)]>,
    at: &str,
) -> Result<Policy, ConfigError> {
    let field = format!("{at}.webhook_secret_env");
    let Some(sender) = policy.webhook else {
        if policy.webhook_secret_env.is_some() {
            return Err(invalid(field, "is only read on a route with webhook"));
        }
        return Ok(policy);
    };
    let name = match policy.webhook_secret_env.clone() {
        Some(name) => name,
        None => return Err(invalid(
            field,
            "is required with webhook: the name of the environment variable holding the secret(s)",
        )),
    };
    let value = match vars {
        Some(vars) => vars
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.clone()),
        None => std::env::var_os(&name)
            .map(|v| v.into_string())
            .transpose()
            .map_err(|_| invalid(&field, format!("names {name}, which is not UTF-8")))?,
    };
    let value = match value {
        Some(value) if !value.trim().is_empty() => value,
        Some(_) => return Err(invalid(field, format!("names {name}, which is empty"))),
        None => return Err(invalid(field, format!("names {name}, which is not set"))),
    };
    let secrets = WebhookSecrets::parse(sender, &value)
        .map_err(|reason| invalid(&field, format!("names {name}, which {reason}")))?;
    policy.webhook_secrets = Some(secrets);
    if !sets_ttl {
        policy.ttl = policy.ttl.max(Ttl::For(WEBHOOK_TTL));
    }
    Ok(policy)
}

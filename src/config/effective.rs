//! The configuration in force as TOML, as `check-config` prints it (nginx's `-T`): every field
//! with its value, the built-in defaults filled in, each route merged over `[defaults]`, secrets
//! as [`REDACTED`], and a comment after each value naming where it came from. Read back (with
//! the secrets given again), it is the same configuration.

use std::fmt::Write as _;

use super::policy::PolicyTable;
use super::written::Written;
use super::{Config, Policy, StoreConfig};
use crate::store::{redact_url_as, LocalCacheSettings, TlsFiles, REDACTED};

/// Where the values of a configuration came from: what [`Config::load`] read them from (the
/// file, with the environment over it).
pub struct Sources {
    figment: figment::Figment,
}

impl Sources {
    pub(super) fn new(figment: figment::Figment) -> Self {
        Sources { figment }
    }

    /// Where the value at `path` (`["routes", "0", "ttl"]`) came from, if it was given.
    fn of(&self, path: &[&str]) -> Option<Source> {
        let figment = &self.figment;
        let (first, rest) = path.split_first()?;
        let mut value = figment.find_value(first).ok()?;
        for key in rest {
            value = match value {
                figment::value::Value::Dict(_, mut dict) => dict.remove(*key)?,
                figment::value::Value::Array(_, items) => {
                    items.into_iter().nth(key.parse().ok()?)?
                }
                _ => return None,
            };
        }
        let metadata = figment.get_metadata(value.tag())?;
        Some(match metadata.name.contains("environment") {
            true => Source::Environment,
            false => Source::File,
        })
    }
}

/// Where one value came from, as its comment says.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    File,
    Environment,
    /// The built-in default.
    Default,
    /// Not given, and not the built-in default: set by another field (a route's `protocol` or
    /// `webhook`, a `ttl` of forever).
    Derived,
    /// Not given by the route: its `[defaults]`, from the file or the environment.
    Defaults(bool),
}

impl Source {
    fn says(self) -> &'static str {
        match self {
            Source::File => "file",
            Source::Environment => "environment",
            Source::Default => "default",
            Source::Derived => "default, set by another field",
            Source::Defaults(false) => "[defaults], file",
            Source::Defaults(true) => "[defaults], environment",
        }
    }
}

/// The TOML text being written, with the sources its comments name.
struct Out<'a> {
    text: String,
    sources: &'a Sources,
    // The table being written, as a path of keys (`["upstreams", "refunds"]`).
    at: Vec<String>,
}

impl Out<'_> {
    fn table(&mut self, header: &str, at: &[&str]) {
        let _ = write!(self.text, "\n{header}\n");
        self.at = at.iter().map(|s| s.to_string()).collect();
    }

    /// `key = value`, with where it came from: given at `key` in the current table, or not.
    fn field(&mut self, key: &str, value: impl Written) {
        let source = self.given(key).unwrap_or(Source::Default);
        self.line(key, value.written(), source);
    }

    /// Where the value at `key` in the current table came from, if it was given.
    fn given(&self, key: &str) -> Option<Source> {
        let mut path: Vec<&str> = self.at.iter().map(String::as_str).collect();
        path.push(key);
        self.sources.of(&path)
    }

    /// An optional field: its line when set, a comment saying so when not.
    fn optional(&mut self, key: &str, value: Option<impl Written>, none: &str) {
        match value {
            Some(value) => self.field(key, value),
            None => self.note(&format!("{key}: none ({none})")),
        }
    }

    /// A secret: its line, the value as [`REDACTED`], when set.
    fn secret(&mut self, key: &str, set: bool) {
        match set {
            true => self.field(key, REDACTED.to_string()),
            false => self.note(&format!("{key}: none")),
        }
    }

    fn line(&mut self, key: &str, value: toml::Value, source: Source) {
        let _ = writeln!(self.text, "{key} = {value}  # {}", source.says());
    }

    /// A table not given, and what that means.
    fn absent(&mut self, header: &str, means: &str) {
        let _ = write!(self.text, "\n# {header}: none ({means})\n");
    }

    fn note(&mut self, note: &str) {
        let _ = writeln!(self.text, "# {note}");
    }
}

/// `config` as TOML the gateway reads back as it, each value's source from `sources`; `name` is
/// what it was read from (a file, or the environment).
pub(super) fn effective_toml(config: &Config, sources: &Sources, name: &str) -> String {
    let mut out = Out {
        text: String::new(),
        sources,
        at: Vec::new(),
    };
    out.note(&format!(
        "{name}: valid. The configuration in force, as TOML the gateway reads back."
    ));
    out.note(&format!(
        "After each value, where it came from; secrets show as {REDACTED:?}."
    ));
    secrets(&mut out, config);
    top_level(&mut out, config);
    upstreams(&mut out, config);
    match &config.tls {
        Some(tls) => {
            out.table("[tls]", &["tls"]);
            out.field("cert_file", tls.cert_file.clone());
            out.field("key_file", tls.key_file.clone());
            out.field("reload_interval", tls.reload_interval);
        }
        None => out.absent("[tls]", "plain TCP: HTTP/1.1 and h2c"),
    }
    store(&mut out, &config.store);
    admin(&mut out, config);
    telemetry(&mut out, config);
    policies(&mut out, config);
    out.text
}

/// The secrets the environment gives, which no file holds: whether each is set.
fn secrets(out: &mut Out<'_>, config: &Config) {
    let key_secret = match config.key_secret {
        Some(_) => REDACTED,
        None => "not set",
    };
    out.note(&format!("{}: {key_secret}", super::KEY_SECRET_VAR));
    if let Some(seal) = config.store.seal() {
        out.note(&format!("seal: {}", seal.describe()));
    }
    if let Some(warning) = config.store.durability_warning() {
        out.note(warning);
    }
}

fn top_level(out: &mut Out<'_>, config: &Config) {
    out.text.push('\n');
    out.field("listen", config.listen.to_string());
    out.field("workers", config.workers);
    out.field("shutdown_grace", config.shutdown_grace);
    out.field("client_header_timeout", config.client_header_timeout);
    out.field("client_idle_timeout", config.client_idle_timeout);
    let rate = super::HumanRate(config.client_min_body_rate);
    out.field("client_min_body_rate", rate);
    let grace = config.client_min_body_rate_grace;
    out.field("client_min_body_rate_grace", grace);
    out.field("max_client_connections", config.max_client_connections);
}

fn upstreams(out: &mut Out<'_>, config: &Config) {
    for (name, upstream) in &config.upstreams {
        out.table(&format!("[upstreams.{name}]"), &["upstreams", name]);
        // The default's URL is most often written as the top-level `upstream`.
        let source = out.given("url").or_else(|| match name.as_str() {
            super::DEFAULT_UPSTREAM => out.sources.of(&["upstream"]),
            _ => None,
        });
        out.line(
            "url",
            upstream.url.written(),
            source.unwrap_or(Source::Default),
        );
        out.field("http2", upstream.http2);
        out.optional("ca_file", upstream.ca_file.clone(), "the system's roots");
        let cert = upstream.client_cert_file.clone();
        out.optional("client_cert_file", cert, "no client certificate");
        let key = upstream.client_key_file.clone();
        out.optional("client_key_file", key, "no client certificate");
        let sni = upstream.server_name.clone();
        out.optional("server_name", sni, "the URL's host");
        out.field("connect_timeout", upstream.connect_timeout);
        out.field("max_connections", upstream.max_connections);
    }
}

fn store(out: &mut Out<'_>, store: &StoreConfig) {
    out.table("[store]", &["store"]);
    out.field("backend", store.backend().to_string());
    if let Some(seal) = store.seal() {
        out.field("seal", seal.mode());
    }
    match store {
        StoreConfig::Memory(m) => {
            out.field("max_entries", m.max_entries);
            out.field("max_bytes", m.max_bytes);
        }
        StoreConfig::Embedded(e) => {
            out.field("path", e.path.display().to_string());
            out.field("fsync", e.fsync);
            out.field("max_entries", e.max_entries);
            out.field("max_bytes", e.max_bytes);
            out.field("timeout", e.timeout);
        }
        StoreConfig::Redis(r) => redis(out, r),
        StoreConfig::Postgres(p) => {
            out.field("url", redact_url_as(&p.url, REDACTED));
            out.field("table", p.table.clone());
            out.field("pool_size", p.pool_size);
            out.field("timeout", p.timeout);
            out.field("migration_timeout", p.migration_timeout);
            store_tls(out, &p.tls);
            local_cache(out, &p.local_cache);
        }
    }
}

fn redis(out: &mut Out<'_>, r: &crate::store::RedisSettings) {
    use crate::store::Topology;
    let redacted = |urls: &[String]| -> Vec<String> {
        urls.iter().map(|u| redact_url_as(u, REDACTED)).collect()
    };
    match &r.topology {
        Topology::Single { url } => out.field("url", redact_url_as(url, REDACTED)),
        Topology::Cluster { urls } => out.field("urls", redacted(urls)),
        Topology::Sentinel { urls, master_name } => {
            out.field("urls", redacted(urls));
            out.field("master_name", master_name.clone());
            let auth = r.node_auth.as_ref();
            let user = auth.and_then(|a| a.username.clone());
            out.optional("node_username", user, "the sentinels' user");
            let password = auth.is_some_and(|a| a.password.is_some());
            out.secret("node_password", password);
        }
    }
    out.field("wait_replicas", r.wait_replicas);
    out.field("prefix", r.prefix.clone());
    out.field("timeout", r.timeout);
    local_cache(out, &r.local_cache);
    store_tls(out, &r.tls);
    out.field("compression", r.compression);
}

fn store_tls(out: &mut Out<'_>, tls: &TlsFiles) {
    out.optional("tls_ca_file", tls.ca_file.clone(), "the system's roots");
    let none = "no client certificate";
    out.optional("tls_cert_file", tls.cert_file.clone(), none);
    out.optional("tls_key_file", tls.key_file.clone(), none);
}

fn local_cache(out: &mut Out<'_>, cache: &LocalCacheSettings) {
    out.field("local_cache", cache.bytes);
    out.field("local_cache_ttl", cache.ttl);
}

fn admin(out: &mut Out<'_>, config: &Config) {
    out.table("[admin]", &["admin"]);
    let listen = config.admin.listen.map(|a| a.to_string());
    out.optional("listen", listen, "no admin listener");
    match &config.admin.admin_token {
        Some(_) => out.field("admin_token", REDACTED.to_string()),
        None => out.note("admin_token: none (the key API is off)"),
    }
}

fn telemetry(out: &mut Out<'_>, config: &Config) {
    let Some(t) = &config.telemetry else {
        out.absent("[telemetry]", "no traces exported");
        return;
    };
    out.table("[telemetry]", &["telemetry"]);
    out.field("otlp_endpoint", t.traces_url.clone());
    out.field("service_name", t.service_name.clone());
    out.field("sample_ratio", t.sample_ratio);
    out.optional("ca_file", t.ca_file.clone(), "the system's roots");
    let none = "no client certificate";
    out.optional("client_cert_file", t.client_cert_file.clone(), none);
    out.optional("client_key_file", t.client_key_file.clone(), none);
}

/// `[defaults]` and each route, every field written, each route's merged over `[defaults]`.
fn policies(out: &mut Out<'_>, config: &Config) {
    let builtin = PolicyTable::written(&Policy::default());
    let defaults = PolicyTable::written(&config.defaults);
    out.table("[defaults]", &["defaults"]);
    for ((field, value), (_, default)) in defaults.iter().zip(&builtin) {
        let source = out.given(field).unwrap_or(match value == default {
            true => Source::Default,
            false => Source::Derived,
        });
        out.line(field, value.clone(), source);
    }
    for (i, route) in config.routes.iter().enumerate() {
        let index = i.to_string();
        out.table("[[routes]]", &["routes", &index]);
        out.field("path", route.path.clone());
        let fields = PolicyTable::written(&route.policy);
        for ((field, value), (_, inherited)) in fields.into_iter().zip(&defaults) {
            if field == "keyed_methods"
                && route.policy.keyed_methods_unread()
                && value == *inherited
            {
                // The value is [defaults]' (a string in it may print over several lines).
                let why = "not read where protocol = \"http\"";
                out.note(&format!("{field}: as in [defaults] ({why})"));
                continue;
            }
            let from_defaults = out.sources.of(&["defaults", field]);
            let source = out.given(field).unwrap_or(match from_defaults {
                Some(from) if value == *inherited => Source::Defaults(from == Source::Environment),
                _ if value == *inherited => Source::Default,
                _ => Source::Derived,
            });
            out.line(field, value, source);
        }
    }
}

/// The lines of a printed configuration without their comments, which say where each value came
/// from (the file, once it is read back): what a round trip keeps.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn values(printed: &str) -> Vec<&str> {
    printed
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.rsplit_once("  # ").map_or(l, |(line, _)| line))
        .collect()
}

#[cfg(test)]
// figment's Jail returns figment's own (large) error type.
#[allow(clippy::result_large_err)]
mod tests {
    use figment::providers::{Format, Toml};

    use super::super::Secrets;
    use super::*;

    /// `text` read as the gateway reads a file, printed.
    fn printed(text: &str, secrets: Secrets<'_>) -> (Config, String) {
        let figment = figment::Figment::from(Toml::string(text));
        let (config, sources) = Config::from_figment(figment, secrets).unwrap();
        let shown = config.effective_toml(&sources, "test.toml");
        (config, shown)
    }

    /// The value of `key` in the table whose header line is `table`, and its comment.
    fn line<'a>(shown: &'a str, table: &str, key: &str) -> &'a str {
        let start = shown.find(&format!("\n{table}\n")).expect(table);
        let rest = &shown[start + table.len() + 2..];
        let rest = &rest[..rest.find("\n[").unwrap_or(rest.len())];
        let prefix = format!("{key} = ");
        rest.lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("{key} not in {table}: {rest}"))
    }

    /// Each store backend, a route of each protocol and a webhook route: printed, read back,
    /// the same configuration, printed the same.
    #[test]
    fn printed_configurations_read_back_as_themselves() {
        let stores = [
            "backend = \"memory\"\nmax_entries = 7\nmax_bytes = 1000",
            "backend = \"embedded\"\npath = \"d\"\nfsync = false\ntimeout = \"250ms\"",
            "backend = \"redis\"\nurl = \"redis://h:1/2\"\nprefix = \"p:\"\nlocal_cache = 0\ncompression = \"none\"\nwait_replicas = 1",
            "backend = \"redis-cluster\"\nurls = [\"redis://a:1\", \"redis://b:2\"]",
            "backend = \"redis-sentinel\"\nurls = [\"redis://s:1\"]\nmaster_name = \"m\"\nnode_username = \"u\"",
            "backend = \"postgres\"\nurl = \"postgres://u@h:5432/db?sslmode=disable\"\ntable = \"t\"\npool_size = 3",
        ];
        let routes = r#"
[defaults]
ttl = "forever"
[[routes]]
path = "/mcp"
protocol = "mcp"
[[routes]]
path = "/rpc"
protocol = "jsonrpc"
keyed_methods = ["pay"]
max_ttl = "forever"
[[routes]]
path = "/hooks"
webhook = "stripe"
webhook_secret_env = "HOOK_SECRET"
[[routes]]
path = "/v1/{*rest}"
derived_key = ["/amount"]
expiry_header = "x-expires"
"#;
        let vars = [("HOOK_SECRET".to_string(), "whsec_c2VjcmV0".to_string())];
        let secrets = Secrets {
            key_secret: Some(b"a-key-secret-of-32-bytes-or-more!"),
            vars: Some(&vars),
            ..Secrets::default()
        };
        for store in stores {
            let durable = store.contains("embedded") || store.contains("postgres");
            let routes = if durable { routes } else { "" };
            let text =
                format!("upstream = \"http://h:1\"\nworkers = 3\n{routes}\n[store]\n{store}\n");
            reads_back(&text, secrets);
        }
    }

    /// `text` printed, read back: the same configuration, printed with the same values.
    fn reads_back(text: &str, secrets: Secrets<'_>) {
        let (config, shown) = printed(text, secrets);
        let (again, reprinted) = printed(&shown, secrets);
        assert_eq!(format!("{config:?}"), format!("{again:?}"), "{shown}");
        assert_eq!(values(&shown), values(&reprinted), "{shown}");
    }

    /// Configurations whose printed TOML once did not read back as them.
    #[test]
    fn printed_edge_cases_read_back_as_themselves() {
        let base = "upstream = \"http://h:1\"\n";
        for found in [
            // An "http" route under MCP [defaults] holds their keyed_methods, which it may not
            // name: printed as a note, not a value.
            "[defaults]\nprotocol = \"mcp\"\n[[routes]]\npath = \"/a\"\nprotocol = \"http\"",
            // The same with a method name that prints over several lines.
            "[defaults]\nprotocol = \"jsonrpc\"\nkeyed_methods = [\"a\\nb\"]\n[[routes]]\npath = \"/x\"\nprotocol = \"http\"",
        ] {
            reads_back(&format!("{base}{found}"), Secrets::default());
        }
    }

    /// Each value's comment names where it came from: the file, the environment, the built-in
    /// default, `[defaults]`, or another field.
    #[test]
    fn each_value_says_where_it_came_from() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "idemgate.toml",
                "upstream = \"http://h:1\"\n[defaults]\nrequire_key = true\n[[routes]]\npath = \"/mcp\"\nprotocol = \"mcp\"\nlock_ttl = \"5s\"\n",
            )?;
            jail.set_env("IDEMGATE_DEFAULTS__TTL", "2h");
            jail.set_env("IDEMGATE_ADMIN_TOKEN", "a-token-of-16-chars-or-more");
            let (config, sources) = Config::load_with_sources(Some("idemgate.toml")).unwrap();
            let shown = config.effective_toml(&sources, "idemgate.toml");
            for (table, key, says) in [
                ("[upstreams.default]", "url", "# file"),
                ("[upstreams.default]", "connect_timeout", "# default"),
                ("[defaults]", "ttl", "= \"2h\"  # environment"),
                ("[defaults]", "require_key", "= true  # file"),
                ("[defaults]", "lock_ttl", "# default"),
                ("[[routes]]", "lock_ttl", "= \"5s\"  # file"),
                ("[[routes]]", "ttl", "# [defaults], environment"),
                ("[[routes]]", "require_key", "# [defaults], file"),
                (
                    "[[routes]]",
                    "keyed_methods",
                    "[\"tools/call\"]  # default, set by another field",
                ),
                ("[[routes]]", "max_body", "# default"),
                ("[admin]", "admin_token", "= \"<redacted>\"  # environment"),
            ] {
                let line = line(&shown, table, key);
                assert!(
                    line.ends_with(says),
                    "{table} {line:?} does not end with {says:?}"
                );
            }
            assert!(!shown.contains("a-token-of-16"), "{shown}");
            Ok(())
        });
    }

    /// A secret printed as `<redacted>` and read back is refused, naming its field.
    #[test]
    fn a_redacted_secret_read_back_is_refused_naming_its_field() {
        let base = "upstream = \"http://h:1\"\n";
        for (text, field) in [
            ("[admin]\nadmin_token = \"a-token-of-16-chars-or-more\"", "admin.admin_token"),
            ("[store]\nbackend = \"redis\"\nurl = \"redis://u:pw@h:1\"", "store.url"),
            ("[store]\nbackend = \"redis-cluster\"\nurls = [\"redis://:pw@h:1\"]", "store.urls"),
            (
                "[store]\nbackend = \"redis-sentinel\"\nurls = [\"redis://h:1\"]\nmaster_name = \"m\"\nnode_password = \"pw\"",
                "store.node_password",
            ),
            ("[store]\nbackend = \"postgres\"\nurl = \"postgres://u:pw@h/db\"", "store.url"),
            ("[store]\nbackend = \"postgres\"\nurl = \"postgres://u@h/db?password=pw\"", "store.url"),
            ("[store]\nbackend = \"redis\"\nurl = \"unix:///r.sock?pass=pw\"", "store.url"),
        ] {
            let (_, shown) = printed(&format!("{base}{text}"), Secrets::default());
            assert!(!shown.contains("pw@") && !shown.contains("= \"pw\""), "{shown}");
            assert!(!shown.contains("=pw"), "{shown}");
            assert!(!shown.contains("a-token-of-16"), "{shown}");
            let e = Config::from_toml(&shown).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("<redacted>"), "{field}: {e}");
        }
    }
}

//! The binary as a user runs it: bad config exits non-zero naming the field; check-config works.

use crate::common;

use std::process::{Child, Command};
use std::time::Duration;

use common::{free_port, wait_until, ReservedPort};

/// The binary with `args`, run to its end in a working directory of its own (where the default
/// embedded store would keep its file).
fn idemgate(args: &[&str]) -> std::process::Output {
    idemgate_env(args, &[])
}

fn write(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}

#[test]
fn invalid_config_exits_non_zero_naming_the_field() {
    let cases = [
        (
            "upstream = \"http://127.0.0.1:9\"\n[defaults]\nttl = \"0s\"",
            "defaults.ttl",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[[routes]]\npath = \"/a\"\nlock_ttl = \"soon\"",
            "lock_ttl",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[store]\nbackend = \"redis\"",
            "store.url",
        ),
        (
            "listen = \"nowhere\"\nupstream = \"http://127.0.0.1:9\"",
            "listen",
        ),
        ("[defaults]\nttl = \"1h\"", "upstream"),
        (
            "upstream = \"http://127.0.0.1:9\"\nclient_header_timeout = \"0s\"",
            "client_header_timeout",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\nclient_idle_timeout = \"0ms\"",
            "client_idle_timeout",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\nmax_client_connections = 0",
            "max_client_connections",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\nclient_min_body_rate = \"0.5B/s\"",
            "client_min_body_rate",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\nclient_min_body_rate = \"240B\"",
            "client_min_body_rate",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\nclient_min_body_rate_grace = \"0s\"",
            "client_min_body_rate_grace",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[store]\nbackend = \"memory\"\n[defaults]\nttl = \"forever\"",
            "defaults.ttl",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[[routes]]\npath = \"/a\"\nerror_format = \"xml\"",
            "routes[0].error_format",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[defaults]\nafter_expiry = \"never\"",
            "defaults.after_expiry",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[defaults]\ntombstone_ttl = \"0s\"",
            "defaults.tombstone_ttl",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[defaults]\nrepeatability = \"yes\"",
            "defaults.repeatability",
        ),
    ];
    for (text, field) in cases {
        let file = write(text);
        let out = idemgate(&["--config", file.path().to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text}");
        assert!(stderr.contains(field), "{field} not named in: {stderr}");
    }
    let missing = idemgate(&["--config", "/nonexistent/idemgate.toml"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/idemgate.toml"));
}

#[test]
fn check_config_accepts_the_shipped_example() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml");
    let out = idemgate(&["check-config", example]);
    let shown = succeeded(&out);
    assert!(shown.contains("valid"));
    for line in [
        "\nclient_header_timeout = \"30s\"  # file\n",
        "\nclient_idle_timeout = \"1m\"  # file\n",
        "\nclient_min_body_rate = 240  # file\n",
        "\nclient_min_body_rate_grace = \"5s\"  # file\n",
        "\nmax_client_connections = 10000  # file\n",
    ] {
        assert!(shown.contains(line), "{line:?} not in {shown}");
    }
    for (rate, shown) in [
        ("off", "\"off\""),
        ("0", "\"off\""),
        ("1", "1"),
        ("1MiB/s", "\"1MiB/s\""),
    ] {
        let out = idemgate_env(
            &["check-config"],
            &[
                ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
                ("IDEMGATE_CLIENT_MIN_BODY_RATE", rate),
            ],
        );
        let line = format!("\nclient_min_body_rate = {shown}  # environment\n");
        assert!(succeeded(&out).contains(&line), "{rate}: {line:?}");
    }
}

/// What a command that must succeed printed; its stderr when it failed.
fn succeeded(out: &std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn idemgate_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(args)
        .env("RUST_LOG", "off")
        .current_dir(dir.path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn environment_overrides_beat_the_file_and_secrets_stay_hidden() {
    let file = write("upstream = \"http://127.0.0.1:9\"\n[defaults]\nttl = \"1h\"\n");
    let out = idemgate_env(
        &["check-config", file.path().to_str().unwrap()],
        &[
            ("IDEMGATE_DEFAULTS__TTL", "2h"),
            ("IDEMGATE_STORE__BACKEND", "redis"),
            (
                "IDEMGATE_STORE__URL",
                "redis://app:hunter2-secret@127.0.0.1:6379/0",
            ),
            ("IDEMGATE_ADMIN_TOKEN", "admin-token-very-secret"),
        ],
    );
    let stdout = succeeded(&out);
    assert!(
        stdout.contains("\nttl = \"2h\"  # environment\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\nurl = \"redis://app:<redacted>@127.0.0.1:6379/0\"  # environment\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\nadmin_token = \"<redacted>\"  # environment\n"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("hunter2-secret"),
        "the Redis password is never printed"
    );
    assert!(
        !stdout.contains("admin-token-very-secret"),
        "the admin token is never printed"
    );
}

#[test]
fn check_config_shows_records_kept_forever() {
    let dir = tempfile::tempdir().unwrap();
    let out = idemgate_env(
        &["check-config"],
        &[
            ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
            ("IDEMGATE_STORE__BACKEND", "embedded"),
            ("IDEMGATE_STORE__PATH", dir.path().to_str().unwrap()),
            ("IDEMGATE_DEFAULTS__TTL", "forever"),
        ],
    );
    let stdout = succeeded(&out);
    assert!(
        stdout.contains("\nttl = \"forever\"  # environment\n"),
        "{stdout}"
    );
    let max_ttl = "\nmax_ttl = \"forever\"  # default, set by another field\n";
    assert!(stdout.contains(max_ttl), "{stdout}");
    for shown in [
        "\nerror_format = \"problem\"  # default\n",
        "\nafter_expiry = \"run\"  # default\n",
        "\ntombstone_ttl = \"30days\"  # default\n",
        "\nrepeatability = false  # default\n",
    ] {
        assert!(stdout.contains(shown), "{shown} not in {stdout}");
    }
}

#[test]
fn check_config_shows_streamed_routes_and_refuses_a_bad_stream_value() {
    let routes = r#"[{path = "/v1/completions", stream = true, on_in_flight = "wait"}]"#;
    let env = [
        ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
        ("IDEMGATE_ROUTES", routes),
    ];
    let out = idemgate_env(&["check-config"], &env);
    let stdout = succeeded(&out);
    let at = stdout.find("path = \"/v1/completions\"").expect(&stdout);
    let (defaults, route) = stdout.split_at(at);
    assert!(
        route.contains("\nstream = true  # environment\n"),
        "{route}"
    );
    assert!(
        defaults.contains("\nstream = false  # default\n"),
        "{defaults}"
    );
    let bad = idemgate_env(
        &["check-config"],
        &[
            ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
            ("IDEMGATE_DEFAULTS__STREAM", "sometimes"),
        ],
    );
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.to_lowercase().contains("defaults.stream"),
        "{stderr}"
    );
}

#[test]
fn a_container_needs_no_file() {
    let out = idemgate_env(
        &["check-config"],
        &[("IDEMGATE_UPSTREAM", "http://127.0.0.1:9")],
    );
    succeeded(&out);
    let bad = idemgate_env(
        &["check-config"],
        &[
            ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
            ("IDEMGATE_DEFAULTS__LOCK_TTL", "0s"),
        ],
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("defaults.lock_ttl"));
}

/// The container's runtime stage, without Docker: the same binary with the same config file and
/// the environment the Dockerfile sets (ports moved to free ones), answered by the same
/// HEALTHCHECK command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_entrypoint_and_healthcheck_work_without_docker() {
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    assert!(dockerfile.contains("COPY config/example.toml /etc/idemgate/idemgate.toml"));
    assert!(dockerfile.contains(r#"CMD ["--config", "/etc/idemgate/idemgate.toml"]"#));
    assert!(dockerfile.contains(r#""healthcheck", "--url", "http://127.0.0.1:9090/healthz""#));
    assert!(dockerfile.contains("USER 10001"));
    // The embedded store's directory: owned by that user, and a volume.
    assert!(dockerfile.contains("useradd --system --uid 10001"));
    assert!(dockerfile.contains("install -d -o idemgate -g idemgate -m 0700 /var/lib/idemgate"));
    assert!(dockerfile.contains(r#"VOLUME ["/var/lib/idemgate"]"#));

    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml");
    // The binary binds both ports itself, after `free_port` let go of them: when another process
    // took one in between, the binary exits, and it is started again on new ones.
    let mut started = None;
    // The example's store is the embedded default, in the working directory.
    let dir = tempfile::tempdir().unwrap();
    for _ in 0..3 {
        let (port, admin) = (free_port(), free_port());
        let mut gateway = Running(
            Command::new(env!("CARGO_BIN_EXE_idemgate"))
                .args(["--config", example])
                .current_dir(dir.path())
                .env("RUST_LOG", "off")
                .env("IDEMGATE_LISTEN", format!("127.0.0.1:{port}"))
                .env("IDEMGATE_ADMIN__LISTEN", format!("127.0.0.1:{admin}"))
                .spawn()
                .unwrap(),
        );
        let url = format!("http://127.0.0.1:{admin}/healthz");
        let mut exited = false;
        wait_until(
            Duration::from_secs(5),
            "the healthcheck command passes against the running gateway",
            async || {
                exited = gateway.exited();
                exited || healthcheck(&url).await
            },
        )
        .await;
        if !exited {
            started = Some(gateway);
            break;
        }
    }
    assert!(
        started.is_some(),
        "the gateway did not start on 3 pairs of free ports"
    );
    let closed = ReservedPort::new();
    assert!(
        !healthcheck(&format!("http://{}/healthz", closed.addr)).await,
        "and fail where nothing answers"
    );
}

/// Whether `idemgate healthcheck --url URL` passes.
async fn healthcheck(url: &str) -> bool {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["healthcheck", "--url", url])
        .env("RUST_LOG", "off")
        .output()
        .await
        .unwrap()
        .status
        .success()
}

/// A child process, killed on drop.
struct Running(Child);

impl Running {
    fn exited(&mut self) -> bool {
        self.0.try_wait().unwrap().is_some()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// TLS files are read by `check-config`: a missing file, a key that does not match its
/// certificate, an https-only field on an http upstream and an unknown upstream name each exit 1
/// naming the field; a valid config shows the upstreams and listener TLS by their file names,
/// never a key.
#[test]
fn tls_and_upstream_settings_are_checked_and_keys_never_printed() {
    let ca = common::TestCa::new();
    let server = ca.server("server", &["127.0.0.1"], common::Validity::Now);
    let client = ca.client("client");
    let other = ca.client("other");
    let base = "upstream = \"https://127.0.0.1:8443\"\n";
    let cases = [
        (
            format!("{base}[upstreams.default]\nca_file = \"/nonexistent/ca.pem\"\n"),
            "upstreams.default.ca_file",
        ),
        (
            format!(
                "{base}[upstreams.default]\nca_file = {:?}\nclient_cert_file = {:?}\nclient_key_file = {:?}\n",
                ca.ca(),
                client.cert(),
                other.key_path()
            ),
            "upstreams.default.client_key_file",
        ),
        (
            format!(
                "{base}[upstreams.default]\nca_file = {:?}\nclient_cert_file = {:?}\n",
                ca.ca(),
                client.cert()
            ),
            "upstreams.default.client_key_file",
        ),
        (
            format!(
                "upstream = \"http://127.0.0.1:9\"\n[upstreams.default]\nca_file = {:?}\n",
                ca.ca()
            ),
            "upstreams.default.ca_file",
        ),
        (
            "upstream = \"http://127.0.0.1:9\"\n[[routes]]\npath = \"/r\"\nupstream = \"refunds\"\n"
                .to_string(),
            "routes[0].upstream",
        ),
        (
            format!(
                "upstream = \"http://127.0.0.1:9\"\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
                server.cert(),
                client.key_path()
            ),
            "tls.key_file",
        ),
        (
            format!("upstream = \"http://127.0.0.1:9\"\n[tls]\ncert_file = {:?}\n", server.cert()),
            "tls.key_file",
        ),
    ];
    for (text, field) in cases {
        let file = write(&text);
        let out = idemgate(&["check-config", file.path().to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text}");
        assert!(stderr.contains(field), "{field} not named in: {stderr}");
        assert!(!stderr.contains("PRIVATE KEY"), "{stderr}");
    }
    let valid = write(&format!(
        "upstream = \"https://127.0.0.1:8443\"\n[upstreams.default]\nca_file = {:?}\nclient_cert_file = {:?}\nclient_key_file = {:?}\n[upstreams.refunds]\nurl = \"http://127.0.0.1:9001\"\nhttp2 = true\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n[[routes]]\npath = \"/v1/refunds/{{*rest}}\"\nupstream = \"refunds\"\n",
        ca.ca(),
        client.cert(),
        client.key_path(),
        server.cert(),
        server.key_path()
    ));
    let out = idemgate(&["check-config", valid.path().to_str().unwrap()]);
    let stdout = succeeded(&out);
    assert!(
        stdout.contains("[upstreams.refunds]") && stdout.contains("\nhttp2 = true  # file\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains(client.key_path()),
        "the key file is named: {stdout}"
    );
    assert!(stdout.contains(server.cert()), "{stdout}");
    let key_pem = std::fs::read_to_string(&client.key_file).unwrap();
    let key_line = key_pem.lines().nth(1).unwrap();
    assert!(
        !stdout.contains("PRIVATE KEY") && !stdout.contains(key_line),
        "{stdout}"
    );
}

/// Key and fingerprint settings are checked: JSON pointers (RFC 6901), header names, durations
/// against `max_ttl`, and a secret for `derived_key`; each mistake exits 1 naming the field. The
/// key secret is shown as `<redacted>`, never printed.
#[test]
fn key_and_fingerprint_settings_are_checked_and_the_secret_never_printed() {
    let base = "upstream = \"http://127.0.0.1:9\"\n";
    let secret = "a-derived-key-secret-never-shown";
    let cases = [
        (
            "[defaults]\nkey_from_body = \"payment/reference\"",
            "defaults.key_from_body",
            Some(secret),
        ),
        (
            "[defaults]\nfingerprint_ignore = [\"/a/~2\"]",
            "defaults.fingerprint_ignore",
            None,
        ),
        ("[defaults]\nfingerprint = \"yaml\"", "fingerprint", None),
        (
            "[defaults]\nkey_headers = [\"bad header\"]",
            "defaults.key_headers",
            None,
        ),
        ("[defaults]\nkey_headers = []", "defaults.key_headers", None),
        (
            "[defaults]\nfingerprint_headers = [\"x:y\"]",
            "defaults.fingerprint_headers",
            None,
        ),
        (
            "[defaults]\nexpiry_header = \"bad header\"",
            "defaults.expiry_header",
            None,
        ),
        ("[defaults]\nttl = \"30d\"", "defaults.ttl", None),
        (
            "[[routes]]\npath = \"/r\"\nfailure_ttl = \"8d\"",
            "routes[0].failure_ttl",
            None,
        ),
        (
            "[[routes]]\npath = \"/r\"\nmax_ttl = \"1h\"",
            "routes[0].ttl",
            None,
        ),
        (
            "[[routes]]\npath = \"/r\"\nderived_key = [\"/merchant\"]",
            "routes[0].derived_key",
            None,
        ),
        (
            "[[routes]]\npath = \"/r\"\nderived_key = [\"/merchant\"]",
            "IDEMGATE_KEY_SECRET",
            Some("short"),
        ),
    ];
    for (text, field, key_secret) in cases {
        let file = write(&format!("{base}{text}\n"));
        let mut env = vec![];
        if let Some(s) = key_secret {
            env.push(("IDEMGATE_KEY_SECRET", s));
        }
        let out = idemgate_env(&["check-config", file.path().to_str().unwrap()], &env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{text}: {stderr}");
        assert!(stderr.contains(field), "{field} not named in: {stderr}");
        assert!(
            !stderr.contains(secret) && !stderr.contains("short"),
            "{stderr}"
        );
    }
    let valid = write(&format!(
        "{base}[defaults]\nkey_headers = [\"Idempotency-Key\", \"X-Idempotency-Key\"]\nfingerprint = \"json\"\nfingerprint_ignore = [\"/request_id\", \"/items/*/client_ts\"]\nfailure_ttl = \"5m\"\nexpiry_header = \"idempotency-expires\"\n[[routes]]\npath = \"/v1/orders\"\nderived_key = [\"/merchant\", \"/order\", \"/amount\"]\nscope_cookies = [\"session_id\"]\n"
    ));
    let out = idemgate_env(
        &["check-config", valid.path().to_str().unwrap()],
        &[("IDEMGATE_KEY_SECRET", secret)],
    );
    let stdout = succeeded(&out);
    for shown in [
        "# IDEMGATE_KEY_SECRET: <redacted>\n",
        "\"/items/*/client_ts\"",
        "\"x-idempotency-key\"",
        "\"/amount\"",
        "\nfailure_ttl = \"5m\"  # file\n",
        "\nfingerprint = \"json\"  # file\n",
        "\"session_id\"",
    ] {
        assert!(stdout.contains(shown), "{shown} not in: {stdout}");
    }
    assert!(!stdout.contains(secret), "the key secret is never printed");
}

#[test]
fn sealing_keys_are_checked_and_shown_by_id_only() {
    let dir = tempfile::tempdir().unwrap();
    let k1 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    let base = [
        ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
        ("IDEMGATE_STORE__BACKEND", "embedded"),
        ("IDEMGATE_STORE__PATH", dir.path().to_str().unwrap()),
        ("IDEMGATE_STORE__SEAL", "required"),
    ];
    let keys = format!("k2:{},k1:{k1}", k1.replace('A', "B"));
    let out = idemgate_env(
        &["check-config"],
        &[&base[..], &[("IDEMGATE_SEAL_KEYS", &keys)]].concat(),
    );
    let stdout = succeeded(&out);
    assert!(
        stdout.contains(
            "# seal: required (seals with k2; opens with k2, k1 (from IDEMGATE_SEAL_KEYS))\n"
        ) && stdout.contains("\nseal = \"required\"  # environment\n"),
        "{stdout}"
    );
    assert!(!stdout.contains(k1) && !stdout.contains("AAEC"), "{stdout}");

    let short = format!("k1:{}", &k1[..20]);
    let two = format!("k1:{k1},k1:{k1}");
    for (env, field, says) in [
        (vec![], "IDEMGATE_SEAL_KEYS", "needs the keys"),
        (
            vec![("IDEMGATE_SEAL_KEYS", short.as_str())],
            "IDEMGATE_SEAL_KEYS",
            "is 15 bytes",
        ),
        (
            vec![("IDEMGATE_SEAL_KEYS", two.as_str())],
            "IDEMGATE_SEAL_KEYS",
            "listed twice",
        ),
        (
            vec![("IDEMGATE_SEAL_KEYS", "k1")],
            "IDEMGATE_SEAL_KEYS",
            "is not id:<base64",
        ),
        (
            vec![
                ("IDEMGATE_STORE__BACKEND", "memory"),
                ("IDEMGATE_STORE__PATH", ""),
            ],
            "store",
            "seal",
        ),
        (
            vec![("IDEMGATE_STORE__SEAL", "yes")],
            "store.seal",
            "\"off\", \"on\" or \"required\"",
        ),
    ] {
        let mut all: Vec<(&str, &str)> = base.to_vec();
        all.retain(|(k, _)| !env.iter().any(|(e, _)| e == k));
        all.extend(env.iter().copied());
        all.retain(|(k, v)| !(*k == "IDEMGATE_STORE__PATH" && v.is_empty()));
        let out = idemgate_env(&["check-config"], &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{env:?}: {stderr}");
        assert!(
            stderr.contains(field) && stderr.contains(says),
            "{env:?}: {stderr}"
        );
        assert!(
            !stderr.contains(&k1[..20]),
            "a key is never printed: {stderr}"
        );
    }
}

#[test]
fn store_client_certificates_are_checked_and_shown_by_path() {
    let ca = common::TestCa::new();
    let client = ca.client("gateway");
    let other = ca.client("other");
    let check = |store: &str| {
        let file = write(&format!(
            "upstream = \"http://127.0.0.1:9\"\n[store]\n{store}"
        ));
        idemgate_env(&["check-config", file.path().to_str().unwrap()], &[])
    };
    let redis = "backend = \"redis\"\nurl = \"rediss://127.0.0.1:6380\"";
    let postgres = "backend = \"postgres\"\nurl = \"postgres://u@db/x?sslmode=verify-full\"";
    let pair = |cert: &str, key: &str| format!("tls_cert_file = {cert:?}\ntls_key_file = {key:?}");
    for backend in [redis, postgres] {
        let shown = succeeded(&check(&format!(
            "{backend}\n{}",
            pair(client.cert(), client.key_path())
        )));
        assert!(
            shown.contains(client.cert()) && shown.contains(client.key_path()),
            "{shown}"
        );
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
    }
    let plain_redis = redis.replace("rediss://", "redis://");
    let plain_postgres = postgres.replace("verify-full", "disable");
    for (store, field) in [
        (
            format!("{redis}\ntls_cert_file = {:?}", client.cert()),
            "store.tls_key_file",
        ),
        (
            format!("{plain_redis}\n{}", pair(client.cert(), client.key_path())),
            "store.tls_cert_file",
        ),
        (
            format!(
                "{plain_postgres}\n{}",
                pair(client.cert(), client.key_path())
            ),
            "store.tls_cert_file",
        ),
        (
            format!("{redis}\n{}", pair(client.cert(), other.key_path())),
            "store.tls_key_file",
        ),
        (
            format!("{postgres}\n{}", pair(client.key_path(), client.key_path())),
            "store.tls_cert_file",
        ),
    ] {
        let out = check(&store);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{store}");
        assert!(stderr.contains(field), "{store}: {stderr}");
        assert!(!stderr.contains("PRIVATE KEY"), "{stderr}");
    }
}

#[test]
fn check_config_shows_telemetry_off_or_its_collector() {
    let file = write("upstream = \"http://127.0.0.1:9\"\n");
    let path = file.path().to_str().unwrap();
    let off = idemgate_env(&["check-config", path], &[]);
    let off = String::from_utf8_lossy(&off.stdout);
    assert!(
        off.contains("\n# [telemetry]: none (no traces exported)\n"),
        "{off}"
    );
    let on = idemgate_env(
        &["check-config", path],
        &[
            ("IDEMGATE_TELEMETRY__OTLP_ENDPOINT", "http://collector:4318"),
            ("IDEMGATE_TELEMETRY__SAMPLE_RATIO", "0.25"),
        ],
    );
    let shown = String::from_utf8_lossy(&on.stdout);
    assert!(
        on.status.success(),
        "{}",
        String::from_utf8_lossy(&on.stderr)
    );
    for line in [
        "\notlp_endpoint = \"http://collector:4318/v1/traces\"  # environment\n",
        "\nservice_name = \"idemgate\"  # default\n",
        "\nsample_ratio = 0.25  # environment\n",
    ] {
        assert!(shown.contains(line), "{line:?} not in {shown}");
    }
    let bad = idemgate_env(
        &["check-config", path],
        &[("IDEMGATE_TELEMETRY__SAMPLE_RATIO", "2")],
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("telemetry.sample_ratio"));
    // Over TLS: the CA file is shown; the headers the environment gives the exporter are not.
    let ca = common::TestCa::new();
    let tls = idemgate_env(
        &["check-config", path],
        &[
            (
                "IDEMGATE_TELEMETRY__OTLP_ENDPOINT",
                "https://collector:4318",
            ),
            ("IDEMGATE_TELEMETRY__CA_FILE", ca.ca()),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=collector-secret"),
        ],
    );
    let shown = succeeded(&tls);
    assert!(
        shown.contains(&format!("\nca_file = {:?}  # environment\n", ca.ca())),
        "{shown}"
    );
    assert!(!shown.contains("collector-secret"), "{shown}");
    let bad = idemgate_env(
        &["check-config", path],
        &[
            ("IDEMGATE_TELEMETRY__OTLP_ENDPOINT", "http://collector:4318"),
            ("IDEMGATE_TELEMETRY__CA_FILE", ca.ca()),
        ],
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("telemetry.ca_file"));
}

#[test]
fn check_config_read_in_part_ends_quietly() {
    // Enough routes that the output passes a pipe's buffer, so that the reader's going away
    // meets the write.
    let mut text = String::from("upstream = \"http://127.0.0.1:9\"\n");
    for i in 0..400 {
        text.push_str(&format!("[[routes]]\npath = \"/v1/r{i}\"\n"));
    }
    let file = write(&text);
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["check-config", file.path().to_str().unwrap()])
        .env("RUST_LOG", "off")
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 64];
    let mut stdout = child.stdout.take().unwrap();
    std::io::Read::read_exact(&mut stdout, &mut first).unwrap();
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(String::from_utf8_lossy(&first).contains("valid"));
}

/// What `check-config` prints is a configuration the gateway reads back as the same one: every
/// table (listener TLS, upstreams with mutual TLS, a TLS store, the admin listener, telemetry
/// over TLS, routes), printed, read back and printed again, gives the same values; the admin
/// token, printed as `<redacted>`, is refused when read back until it is given again.
#[test]
fn check_config_prints_toml_it_reads_back_unchanged() {
    let ca = common::TestCa::new();
    let server = ca.server("listener", &["localhost"], common::Validity::Now);
    let client = ca.client("gateway");
    let token = "a-token-of-16-chars-or-more";
    let text = format!(
        "upstream = \"https://127.0.0.1:8443\"\nworkers = 3\nclient_min_body_rate = \"1KiB/s\"\n\
         [upstreams.default]\nca_file = {ca:?}\nclient_cert_file = {cert:?}\nclient_key_file = {key:?}\nserver_name = \"api.test\"\n\
         [upstreams.refunds]\nurl = \"http://127.0.0.1:9001/v2\"\nhttp2 = true\nmax_connections = 8\n\
         [tls]\ncert_file = {scert:?}\nkey_file = {skey:?}\nreload_interval = \"90s\"\n\
         [store]\nbackend = \"postgres\"\nurl = \"postgres://app@db:5432/x?sslmode=verify-full\"\ntls_ca_file = {ca:?}\n\
         [admin]\nlisten = \"127.0.0.1:9090\"\nadmin_token = {token:?}\n\
         [telemetry]\notlp_endpoint = \"https://collector:4318\"\nca_file = {ca:?}\nsample_ratio = 0.5\n\
         [defaults]\nttl = \"forever\"\n\
         [[routes]]\npath = \"/v1/refunds/{{*rest}}\"\nupstream = \"refunds\"\nmismatch_status = 422\n\
         [[routes]]\npath = \"/mcp\"\nprotocol = \"mcp\"\non_in_flight = \"wait\"\n",
        ca = ca.ca(),
        cert = client.cert(),
        key = client.key_path(),
        scert = server.cert(),
        skey = server.key_path(),
    );
    let file = write(&text);
    let printed = succeeded(&idemgate(&["check-config", file.path().to_str().unwrap()]));
    assert!(!printed.contains(token), "{printed}");
    assert!(!printed.contains("PRIVATE KEY"), "{printed}");

    let again = write(&printed);
    let refused = idemgate(&["check-config", again.path().to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("admin.admin_token") && stderr.contains("<redacted>"),
        "{stderr}"
    );

    let given = printed.replace("\"<redacted>\"", &format!("{token:?}"));
    let again = write(&given);
    let reprinted = succeeded(&idemgate(&["check-config", again.path().to_str().unwrap()]));
    // The comments say where each value came from: the file, the second time.
    let values = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.rsplit_once("  # ").map_or(l, |(v, _)| v).to_string())
            .collect()
    };
    assert_eq!(values(&printed), values(&reprinted));
    for line in [
        "\n[upstreams.refunds]\nurl = \"http://127.0.0.1:9001/v2\"  # file\n",
        "\nreload_interval = \"1m 30s\"  # file\n",
        "\nmax_ttl = \"forever\"  # default, set by another field\n",
        "\nkeyed_methods = [\"tools/call\"]  # default, set by another field\n",
        "\nconnect_timeout = \"5s\"  # default\n",
    ] {
        assert!(printed.contains(line), "{line:?} not in {printed}");
    }
}

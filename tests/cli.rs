//! The binary as a user runs it: bad config exits non-zero naming the field; check-config works.

use std::process::Command;

fn idemgate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .unwrap()
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
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid"));
}

fn idemgate_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(args).env("RUST_LOG", "off");
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
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ttl: 7200s"), "{stdout}");
    assert!(
        stdout.contains("redis redis://app:***@127.0.0.1:6379/0"),
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
fn a_container_needs_no_file() {
    let out = idemgate_env(
        &["check-config"],
        &[("IDEMGATE_UPSTREAM", "http://127.0.0.1:9")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
#[test]
fn the_container_entrypoint_and_healthcheck_work_without_docker() {
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    assert!(dockerfile.contains("COPY config/example.toml /etc/idemgate/idemgate.toml"));
    assert!(dockerfile.contains(r#"CMD ["--config", "/etc/idemgate/idemgate.toml"]"#));
    assert!(dockerfile.contains(r#""healthcheck", "--url", "http://127.0.0.1:9090/healthz""#));
    assert!(dockerfile.contains("USER 10001"));

    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (port, admin) = (free(), free());
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml");
    let mut gateway = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["--config", example])
        .env("RUST_LOG", "off")
        .env("IDEMGATE_LISTEN", format!("127.0.0.1:{port}"))
        .env("IDEMGATE_ADMIN__LISTEN", format!("127.0.0.1:{admin}"))
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{admin}/healthz");
    let mut healthy = false;
    for _ in 0..100 {
        if idemgate(&["healthcheck", "--url", &url]).status.success() {
            healthy = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let down = idemgate(&[
        "healthcheck",
        "--url",
        &format!("http://127.0.0.1:{}/healthz", free()),
    ]);
    let _ = gateway.kill();
    let _ = gateway.wait();
    assert!(
        healthy,
        "the healthcheck command must pass against the running gateway"
    );
    assert!(!down.status.success(), "and fail where nothing answers");
}

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

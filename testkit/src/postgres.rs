//! A private PostgreSQL server, never the one a machine may already run on 5432:
//! `let pg = PostgresServer::start().await; pg.stop(); pg.start_again().await;`
//! (also `kill()`, `pause()`, `resume()`, `restart()`, `restart_immediate()`).
//!
//! `initdb` runs once per test process into a template directory that each server copies; the
//! server listens on a free loopback port and on a unix socket in its own directory. Run as root,
//! the server runs as the `postgres` user (PostgreSQL refuses root), its directory chowned to it.
//! The gateway logs in as `idemgate` (password `s3cret`, scram-sha-256 over TCP), owner of the
//! database `idemgate`; [`PostgresServer::psql`] runs SQL as the superuser over the socket.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::process::{children, signal, ChildProcess};
use crate::redis::ATTEMPTS;
use crate::{free_port, wait_until};

/// The role the gateway logs in as, and its password.
pub const USER: &str = "idemgate";
/// The password of [`USER`].
pub const PASSWORD: &str = "s3cret";

/// How long a server may take to come up (recovery after a kill replays its WAL first).
const STARTUP: Duration = Duration::from_secs(30);

/// A PostgreSQL server on a loopback port, in its own temporary directory. Stopped on drop.
pub struct PostgresServer {
    /// Its TCP port on 127.0.0.1.
    pub port: u16,
    dir: tempfile::TempDir,
    child: ChildProcess,
    /// With TLS: the PEM certificate clients must trust (self-signed for 127.0.0.1), or the
    /// certificate it was given.
    pub ca_file: Option<PathBuf>,
    // Asking TCP clients for a certificate this CA issued, on top of their password.
    client_ca: Option<PathBuf>,
    // PostgreSQL's own durability settings rather than the tests' (fsync off).
    durable: bool,
}

impl PostgresServer {
    /// Start a server with the database `idemgate` owned by the role `idemgate`.
    pub async fn start() -> Self {
        Self::start_with(false).await
    }

    /// [`start`](Self::start) with PostgreSQL's own defaults for durability (`fsync = on`,
    /// `full_page_writes = on`, `synchronous_commit = on`): each commit waits for its WAL to
    /// reach the disk. For benchmarks that must pay what production pays.
    pub async fn start_durable() -> Self {
        Self::start_with(true).await
    }

    async fn start_with(durable: bool) -> Self {
        for _ in 0..ATTEMPTS {
            let mut server = Self::new(free_port());
            server.durable = durable;
            if server.spawn().await {
                return server;
            }
        }
        panic!("postgres did not start on any of {ATTEMPTS} free ports");
    }

    /// Start a server that also offers TLS, with a fresh self-signed certificate for 127.0.0.1
    /// ([`PostgresServer::ca_file`]).
    pub async fn start_tls() -> Self {
        for _ in 0..ATTEMPTS {
            let mut server = Self::new(free_port());
            let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
            let (cert_file, key_file) = (
                server.dir.path().join("server.crt"),
                server.dir.path().join("server.key"),
            );
            std::fs::write(&cert_file, cert.cert.pem()).unwrap();
            std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
            std::fs::set_permissions(
                &key_file,
                std::os::unix::fs::PermissionsExt::from_mode(0o600),
            )
            .unwrap();
            if let Some((uid, _)) = server_user() {
                chown(server.dir.path(), uid);
            }
            server.ca_file = Some(cert_file);
            if server.spawn().await {
                return server;
            }
        }
        panic!("postgres with TLS did not start on any of {ATTEMPTS} free ports");
    }

    /// Start a server that offers TLS with `cert_file` and `key_file`, issued by the CA of
    /// `ca_file`, and asks every TCP client for a certificate that CA issued on top of its
    /// password (`clientcert=verify-ca`).
    pub async fn start_requiring_clients(
        cert_file: &Path,
        key_file: &Path,
        ca_file: &Path,
    ) -> Self {
        for _ in 0..ATTEMPTS {
            let mut server = Self::new(free_port());
            let dir = server.dir.path().to_path_buf();
            std::fs::copy(cert_file, dir.join("server.crt")).unwrap();
            std::fs::copy(key_file, dir.join("server.key")).unwrap();
            std::fs::copy(ca_file, dir.join("client-ca.crt")).unwrap();
            std::fs::set_permissions(
                dir.join("server.key"),
                std::os::unix::fs::PermissionsExt::from_mode(0o600),
            )
            .unwrap();
            std::fs::write(
                dir.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256 clientcert=verify-ca\n",
            )
            .unwrap();
            if let Some((uid, _)) = server_user() {
                chown(&dir, uid);
            }
            server.ca_file = Some(dir.join("server.crt"));
            server.client_ca = Some(dir.join("client-ca.crt"));
            if server.spawn().await {
                return server;
            }
        }
        panic!(
            "postgres requiring client certificates did not start on any of {ATTEMPTS} free ports"
        );
    }

    fn new(port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(template())
            .arg(&data)
            .status()
            .unwrap();
        assert!(copied.success(), "copying the initdb template");
        if let Some((uid, _)) = server_user() {
            chown(dir.path(), uid);
        }
        PostgresServer {
            port,
            dir,
            child: ChildProcess::none(),
            ca_file: None,
            client_ca: None,
            durable: false,
        }
    }

    /// The server's main process (the postmaster; its backends are its children), while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.pid()
    }

    /// `postgres://idemgate:s3cret@127.0.0.1:PORT/idemgate?sslmode=disable`
    pub fn url(&self) -> String {
        self.url_with(USER, PASSWORD)
    }

    /// The URL as `user` with `password`.
    pub fn url_with(&self, user: &str, password: &str) -> String {
        format!(
            "postgres://{user}:{password}@127.0.0.1:{}/idemgate?sslmode=disable",
            self.port
        )
    }

    /// Start the process and wait until it answers; `false` when it exited first (its port was
    /// taken).
    async fn spawn(&self) -> bool {
        let mut cmd = Command::new(bin("postgres"));
        cmd.arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(self.dir.path())
            .args(["-c", "listen_addresses=127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if !self.durable {
            // Tests need no durability against power loss: a killed process's writes are in
            // the page cache still.
            cmd.args(["-c", "fsync=off", "-c", "full_page_writes=off"]);
        }
        if let Some(cert) = &self.ca_file {
            cmd.args(["-c", "ssl=on"])
                .arg("-c")
                .arg(format!("ssl_cert_file={}", cert.display()))
                .arg("-c")
                .arg(format!(
                    "ssl_key_file={}",
                    self.dir.path().join("server.key").display()
                ));
        }
        if let Some(ca) = &self.client_ca {
            cmd.arg("-c")
                .arg(format!("ssl_ca_file={}", ca.display()))
                .arg("-c")
                .arg(format!(
                    "hba_file={}",
                    self.dir.path().join("pg_hba.conf").display()
                ));
        }
        as_server_user(&mut cmd);
        self.child
            .hold(cmd.spawn().expect("postgres must be installed"));
        let mut exited = false;
        wait_until(STARTUP, "postgres answers", async || {
            exited = self.child.exit_status().is_some();
            exited || self.try_psql("SELECT 1").is_some()
        })
        .await;
        if exited {
            self.child.forget();
        }
        !exited
    }

    /// Run `sql` as the superuser in the database `idemgate`; its output (`-At`).
    pub fn psql(&self, sql: &str) -> String {
        self.try_psql(sql)
            .unwrap_or_else(|| panic!("psql failed: {sql}"))
    }

    fn try_psql(&self, sql: &str) -> Option<String> {
        let mut cmd = Command::new(bin("psql"));
        cmd.arg("-h")
            .arg(self.dir.path())
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                "idemgate",
            ])
            .args(["-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        as_server_user(&mut cmd);
        let out = cmd.output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// A fast shutdown: connections closed, committed work on disk. The port stays free for
    /// [`PostgresServer::start_again`].
    pub fn stop(&self) {
        self.child.stop_with("-INT");
    }

    /// SIGKILL the server and its backends: no shutdown at all (the next start recovers from
    /// the WAL).
    pub fn kill(&self) {
        let backends = self.child.pid().map(children).unwrap_or_default();
        self.child.kill9();
        for pid in backends {
            signal(pid, "-KILL");
        }
    }

    /// SIGSTOP the server and its backends: connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.signal_all("-STOP");
    }

    /// SIGCONT after [`PostgresServer::pause`].
    pub fn resume(&self) {
        self.signal_all("-CONT");
    }

    fn signal_all(&self, sig: &str) {
        let pid = self.child.pid().expect("running");
        // The postmaster first, and its children listed after: a stopped postmaster forks no
        // backend between the listing and the signal (a pool may be opening a connection).
        signal(pid, sig);
        for child in children(pid) {
            signal(child, sig);
        }
    }

    /// Start again on the same port and data after [`PostgresServer::stop`] or
    /// [`PostgresServer::kill`].
    pub async fn start_again(&self) {
        assert!(
            self.spawn().await,
            "postgres did not come back on port {}",
            self.port
        );
    }

    /// `pg_ctl restart -m immediate`: SIGQUIT to the postmaster, which ends its backends at once,
    /// without a checkpoint (the next start recovers from the WAL), then a start on the same port
    /// and data.
    pub async fn restart_immediate(&self) {
        self.child.stop_with("-QUIT");
        self.start_again().await;
    }

    /// Stop and start again on the same port and data.
    pub async fn restart(&self) {
        self.stop();
        self.start_again().await;
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A PostgreSQL program: from the newest /usr/lib/postgresql/*/bin (Debian's packages), else
/// from the PATH.
fn bin(name: &str) -> PathBuf {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|d| d.join("initdb").exists())
            .collect();
        dirs.sort_by_key(|d| {
            d.parent()
                .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
                .unwrap_or(0)
        });
        dirs.pop()
    });
    dir.as_ref()
        .map_or_else(|| PathBuf::from(name), |d| d.join(name))
}

/// The `postgres` user's uid and gid when this process is root (PostgreSQL will not run as
/// root); `None` otherwise.
fn server_user() -> Option<(u32, u32)> {
    if std::fs::metadata("/proc/self").ok()?.uid() != 0 {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let line = passwd.lines().find(|l| l.starts_with("postgres:"))?;
    let fields: Vec<&str> = line.split(':').collect();
    Some((fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?))
}

fn as_server_user(cmd: &mut Command) {
    if let Some((uid, gid)) = server_user() {
        cmd.uid(uid).gid(gid);
    }
}

fn chown(path: &Path, uid: u32) {
    let ok = Command::new("chown")
        .arg("-R")
        .arg(uid.to_string())
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "chown {}", path.display());
}

/// A data directory made by `initdb`, with the role and database the gateway uses; each
/// server copies it. Kept in the temporary directory for the next test process (one per
/// PostgreSQL version and user), made under another name and renamed into place, so processes
/// starting together never see half of one.
fn template() -> PathBuf {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE
        .get_or_init(|| {
            let version = bin("initdb")
                .parent()
                .and_then(|b| b.parent())
                .and_then(|v| v.file_name())
                .map(|v| v.to_string_lossy().into_owned())
                .unwrap_or_default();
            let owner = server_user().map_or(String::new(), |(uid, _)| uid.to_string());
            let dir = std::env::temp_dir().join(format!("idemgate-pg-template-{version}-{owner}"));
            if dir.join("PG_VERSION").exists() {
                return dir;
            }
            let fresh = tempfile::tempdir().unwrap().keep();
            if let Some((uid, _)) = server_user() {
                chown(&fresh, uid);
            }
            let data = fresh.join("data");
            initdb(&data);
            if std::fs::rename(&data, &dir).is_err() {
                // Another process put its template there first.
                assert!(
                    dir.join("PG_VERSION").exists(),
                    "template at {}",
                    dir.display()
                );
            }
            let _ = std::fs::remove_dir_all(&fresh);
            dir
        })
        .clone()
}

/// `initdb` into `data`, then the role and the database the gateway uses.
fn initdb(data: &Path) {
    let mut initdb = Command::new(bin("initdb"));
    initdb
        .arg("-D")
        .arg(data)
        .args(["-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync"])
        .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    as_server_user(&mut initdb);
    let status = initdb.status();
    assert!(
        status
            .expect("initdb must be installed (scripts/test installs it)")
            .success(),
        "initdb failed"
    );
    let mut single = Command::new(bin("postgres"));
    single
        .args(["--single", "-D"])
        .arg(data)
        .arg("postgres")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    as_server_user(&mut single);
    let mut child = single.spawn().unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'").unwrap();
        writeln!(stdin, "CREATE DATABASE idemgate OWNER {USER}").unwrap();
    }
    assert!(child.wait().unwrap().success(), "setting up the template");
}

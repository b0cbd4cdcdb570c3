//! redis-server child processes, each in its own temporary directory, killed on drop:
//! `let redis = RedisServer::start().await; redis.kill(); redis.restart().await;`.
//!
//! Each server also listens on a unix socket in its directory. That socket answering PING is
//! how a start is known to be this server's: it binds its TCP port first and exits when it
//! cannot, so a port that another process took in the meantime is never mistaken for it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::process::ChildProcess;
use crate::{free_port, wait_until};

/// Which store a behavioural test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The in-process store.
    Memory,
    /// A [`RedisServer`].
    Redis,
    /// A [`PostgresServer`](crate::PostgresServer).
    Postgres,
    /// The durable embedded store, in a temporary directory of the test's own.
    Embedded,
}

/// How many ports a start tries: a port taken between [`free_port`] and the server's bind is a
/// race with another process, not a failure.
pub(crate) const ATTEMPTS: usize = 3;

/// How long a redis-server may take to come up (an AOF restart reloads its file first).
const STARTUP: Duration = Duration::from_secs(10);

/// A redis-server on a loopback port. Its methods take `&self`, so a test can `kill()` it through
/// a shared handle (the tests' `TestEnv`).
pub struct RedisServer {
    /// The process; first, so that it is killed before its directory goes.
    child: ChildProcess,
    /// Its TCP port on 127.0.0.1.
    pub port: u16,
    dir: tempfile::TempDir,
    appendonly: bool,
}

impl RedisServer {
    /// Start a redis-server without persistence.
    pub async fn start() -> Self {
        Self::start_with(false).await
    }

    /// Start a redis-server with AOF persistence (`appendfsync always`) in its directory.
    pub async fn start_durable() -> Self {
        Self::start_with(true).await
    }

    /// A redis-server for the Redis backend; none for the others.
    pub async fn for_backend(backend: Backend) -> Option<Self> {
        match backend {
            Backend::Redis => Some(Self::start().await),
            Backend::Memory | Backend::Postgres | Backend::Embedded => None,
        }
    }

    /// Start a redis-server (no persistence) on `port`, where a gateway already points. Unlike
    /// [`RedisServer::start`] it cannot move to another port: it panics if `port` was taken.
    pub async fn start_on_port(port: u16) -> Self {
        let server = Self::new(port, false);
        assert!(
            server.spawn().await,
            "redis-server could not listen on {port}"
        );
        server
    }

    async fn start_with(appendonly: bool) -> Self {
        for _ in 0..ATTEMPTS {
            let server = Self::new(free_port(), appendonly);
            if server.spawn().await {
                return server;
            }
        }
        panic!("redis-server did not start on any of {ATTEMPTS} free ports");
    }

    fn new(port: u16, appendonly: bool) -> Self {
        RedisServer {
            port,
            dir: tempfile::tempdir().unwrap(),
            appendonly,
            child: ChildProcess::none(),
        }
    }

    /// Start the process and wait until it answers; `false` when it exited first (its port was
    /// taken).
    async fn spawn(&self) -> bool {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--unixsocket")
            .arg(socket_in(self.dir.path()))
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--save", "", "--maxmemory-policy", "noeviction"]);
        if self.appendonly {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        run_server(&mut cmd, &self.child, self.dir.path()).await
    }

    /// `redis://127.0.0.1:PORT/0`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The process id, while it runs (for its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.pid()
    }

    /// SIGKILL the server (no shutdown save).
    pub fn kill(&self) {
        self.child.kill9();
    }

    /// SIGSTOP: the server stalls (connections stay open, nothing is answered).
    pub fn pause(&self) {
        self.child.signal("-STOP");
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub fn resume(&self) {
        self.child.signal("-CONT");
    }

    /// Kill and start again on the same port and directory (AOF, if on, is reloaded).
    pub async fn restart(&self) {
        self.kill();
        assert!(
            self.spawn().await,
            "redis-server did not come back on port {}",
            self.port
        );
    }

    /// A raw connection for assertions.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

/// A redis-server that speaks only TLS on its port, with a fresh self-signed certificate for
/// 127.0.0.1, or certificates it is given (and then asking clients for theirs). Killed on drop.
pub struct TlsRedisServer {
    _child: ChildProcess,
    /// Its TLS port on 127.0.0.1.
    pub port: u16,
    /// The PEM certificate clients must trust.
    pub ca_file: PathBuf,
    _dir: tempfile::TempDir,
}

impl TlsRedisServer {
    /// Start it with a fresh certificate, on a free port.
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cert = rcgen::generate_simple_self_signed(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
        ])
        .unwrap();
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
        Self::spawn(dir, (&cert_file, &key_file), &cert_file, false).await
    }

    /// Start it presenting `cert_file` and `key_file`, issued by the CA of `ca_file`, and asking
    /// every client for a certificate that CA issued (`tls-auth-clients yes`).
    pub async fn start_requiring_clients(
        cert_file: &Path,
        key_file: &Path,
        ca_file: &Path,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self::spawn(dir, (cert_file, key_file), ca_file, true).await
    }

    async fn spawn(
        dir: tempfile::TempDir,
        (cert_file, key_file): (&Path, &Path),
        ca_file: &Path,
        auth_clients: bool,
    ) -> Self {
        let auth = if auth_clients { "yes" } else { "no" };
        for _ in 0..ATTEMPTS {
            let port = free_port();
            let mut cmd = Command::new("redis-server");
            cmd.args(["--port", "0", "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--tls-port", &port.to_string(), "--tls-auth-clients", auth])
                .arg("--tls-cert-file")
                .arg(cert_file)
                .arg("--tls-key-file")
                .arg(key_file)
                .arg("--tls-ca-cert-file")
                .arg(ca_file)
                .arg("--unixsocket")
                .arg(socket_in(dir.path()))
                .arg("--dir")
                .arg(dir.path());
            let child = ChildProcess::none();
            if run_server(&mut cmd, &child, dir.path()).await {
                return TlsRedisServer {
                    _child: child,
                    port,
                    ca_file: ca_file.to_path_buf(),
                    _dir: dir,
                };
            }
        }
        panic!("TLS redis-server did not start on any of {ATTEMPTS} free ports");
    }
}

pub(crate) fn socket_in(dir: &Path) -> PathBuf {
    dir.join("redis.sock")
}

/// Run the redis-server `cmd` (its unix socket in `dir`) as `child`, and wait until it answers
/// PING there (`true`) or exits (`false`, and it is let go of).
pub(crate) async fn run_server(cmd: &mut Command, child: &ChildProcess, dir: &Path) -> bool {
    let started = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (scripts/test installs it)");
    child.hold(started);
    let socket = socket_in(dir);
    let mut exited = false;
    wait_until(STARTUP, "redis-server answers PING", async || {
        exited = child.exit_status().is_some();
        exited || pong(&socket).await
    })
    .await;
    if exited {
        child.forget();
    }
    !exited
}

/// Whether a PING on the unix socket `path` is answered PONG (not, e.g., LOADING).
async fn pong(path: &Path) -> bool {
    let Ok(mut s) = tokio::net::UnixStream::connect(path).await else {
        return false;
    };
    let mut answer = [0; 7];
    s.write_all(b"PING\r\n").await.is_ok()
        && s.read_exact(&mut answer).await.is_ok()
        && &answer == b"+PONG\r\n"
}

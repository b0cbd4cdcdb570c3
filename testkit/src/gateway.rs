//! The `idemgate` binary as child processes, each on ports it keeps across restarts:
//!
//! ```ignore
//! let config = GatewayConfig::new().upstream(&url).redis(&server).admin();
//! let launch = GatewayProcess::binary(path).log_to(&log);
//! let (mut first, second) = (launch.start(&config).await, launch.start(&config).await);
//! let unsettled = first.metric_sum("idemgate_calls_unsettled_total").await;
//! first.kill9(); // a crash: nothing drained, nothing flushed
//! first.start_again(&config.set("upstream", other)).await; // the same addresses
//! ```
//!
//! Its config is a [`GatewayConfig`] written for the [`Ports`] the fixture picked (the listener
//! and the admin listener), so that a restart can change it (another upstream path, say) while
//! clients keep the address they know.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::metrics::{scrape, scrape_blocking, sum_of};
use crate::process::ChildProcess;
use crate::redis::ATTEMPTS;
use crate::{free_addr, wait_until, GatewayConfig};

/// How long a gateway may take to bind its listener.
const STARTUP: Duration = Duration::from_secs(15);

/// The addresses a gateway process listens on, the same for each of its starts.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    /// Its `listen` address.
    pub listen: SocketAddr,
    /// The address of its admin listener, if its config has one ([`GatewayConfig::admin`]).
    pub admin: SocketAddr,
}

impl Ports {
    fn free() -> Self {
        Ports {
            listen: free_addr(),
            admin: free_addr(),
        }
    }
}

/// Where a gateway process's log (standard output and error) goes.
#[derive(Clone)]
enum Log {
    /// Standard output discarded, standard error this process's.
    Stderr,
    /// Both appended to a file.
    File(PathBuf),
    /// Both discarded.
    Discarded,
}

/// How to run the binary: the program, a command that runs it, its environment, its log. One
/// launch starts as many processes as [`Launch::start`] is called.
#[derive(Clone)]
pub struct Launch {
    binary: PathBuf,
    prefix: Vec<String>,
    env: Vec<(String, String)>,
    log: Log,
}

impl Launch {
    /// Run it through the command `prefix` (a program and its arguments), which ends by running
    /// the binary and the arguments given after it: `["nsenter", "-t", PID, "-m", "--"]`.
    pub fn via(mut self, prefix: &[String]) -> Self {
        self.prefix = prefix.to_vec();
        self
    }

    /// Set `name` to `value` in its environment.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Append its log (standard output and error) to `path`, every start's after the last;
    /// without it, standard output is discarded and standard error is this process's.
    pub fn log_to(mut self, path: &Path) -> Self {
        self.log = Log::File(path.to_path_buf());
        self
    }

    /// Discard its log, standard error too.
    pub fn quiet(mut self) -> Self {
        self.log = Log::Discarded;
        self
    }

    /// Start a process on free ports with `config`, and wait until its listener accepts
    /// connections. A port another process took first is a start on new ones.
    pub async fn start(&self, config: &GatewayConfig) -> GatewayProcess {
        let dir = tempfile::tempdir().unwrap();
        let mut gateway = GatewayProcess {
            child: ChildProcess::none(),
            ports: Ports::free(),
            launch: self.clone(),
            config: dir.path().join("idemgate.toml"),
            _dir: dir,
        };
        for _ in 0..ATTEMPTS {
            if gateway.spawn(config).await {
                return gateway;
            }
            gateway.ports = Ports::free();
        }
        panic!(
            "the gateway binary did not start on any of {ATTEMPTS} free ports (its log says why)"
        );
    }
}

/// The gateway binary running as a child process; killed on drop.
pub struct GatewayProcess {
    /// The process; first, so that it is killed before its config's directory goes.
    child: ChildProcess,
    ports: Ports,
    launch: Launch,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

impl GatewayProcess {
    /// The binary at `path`, to be started with [`Launch::start`].
    pub fn binary(path: impl Into<PathBuf>) -> Launch {
        Launch {
            binary: path.into(),
            prefix: Vec::new(),
            env: Vec::new(),
            log: Log::Stderr,
        }
    }

    /// Its listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.ports.listen
    }

    /// Its admin listener's address (answering if its config has one).
    pub fn admin(&self) -> SocketAddr {
        self.ports.admin
    }

    /// `http://ADDR/path`
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.ports.listen, path)
    }

    /// Its process id (that of the prefix's program, which execs the binary), while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.pid()
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child.running()
    }

    /// SIGKILL: no chance to clean up, as in a crash.
    pub fn kill9(&mut self) {
        self.child.kill9();
    }

    /// Send SIGTERM (a graceful shutdown).
    pub fn sigterm(&self) {
        self.child.signal("-TERM");
    }

    /// Rewrite its config file as `config` (for its ports) and send SIGHUP: a reload, which
    /// the process applies or refuses (its metrics say which).
    pub fn reload(&self, config: &GatewayConfig) {
        self.reload_text(&config.to_toml_on(self.ports));
    }

    /// The config file `config` makes for its ports, as [`GatewayProcess::reload`] writes it.
    pub fn toml_for(&self, config: &GatewayConfig) -> String {
        config.to_toml_on(self.ports)
    }

    /// Rewrite its config file as `text`, as it is, and send SIGHUP.
    pub fn reload_text(&self, text: &str) {
        std::fs::write(&self.config, text).unwrap();
        self.child.signal("-HUP");
    }

    /// SIGSTOP: the process stalls, its connections open and unanswered, its clock running.
    pub fn pause(&self) {
        self.child.signal("-STOP");
    }

    /// SIGCONT after [`GatewayProcess::pause`].
    pub fn resume(&self) {
        self.child.signal("-CONT");
    }

    /// Wait for the process to exit (up to `limit`), returning its exit status.
    pub async fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        assert!(self.child.held(), "running");
        let mut status = None;
        wait_until(limit, "the gateway binary exits", async || {
            status = self.child.exit_status();
            status.is_some()
        })
        .await;
        self.child.forget();
        status.unwrap()
    }

    /// Start it again after a kill or an exit, on the same ports, with `config`; panics when
    /// it cannot listen there.
    pub async fn start_again(&mut self, config: &GatewayConfig) {
        assert!(!self.child.held(), "start_again while running");
        assert!(
            self.spawn(config).await,
            "the gateway binary did not start again on {}",
            self.ports.listen
        );
    }

    /// Write `config` for its ports, run the binary with it and wait until it listens; `false`
    /// when it exited first (its port was taken, or its config refused: the log says which).
    /// Its secrets come from `config` only, never from this process's environment.
    async fn spawn(&mut self, config: &GatewayConfig) -> bool {
        std::fs::write(&self.config, config.to_toml_on(self.ports)).unwrap();
        let launch = &self.launch;
        let mut command = match launch.prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&launch.binary);
                c
            }
            None => Command::new(&launch.binary),
        };
        command
            .arg("--config")
            .arg(&self.config)
            .env_remove("IDEMGATE_KEY_SECRET")
            .env_remove("IDEMGATE_SEAL_KEYS")
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .envs(config.environment())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        match &launch.log {
            Log::Stderr => {}
            Log::Discarded => {
                command.stderr(Stdio::null());
            }
            Log::File(log) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap();
                command.stdout(file.try_clone().unwrap()).stderr(file);
            }
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", launch.binary.display()));
        self.child.hold(child);
        let addr = self.ports.listen;
        let mut exited = false;
        wait_until(
            STARTUP,
            "the gateway binary accepts connections",
            async || {
                exited = self.child.exit_status().is_some();
                exited || tokio::net::TcpStream::connect(addr).await.is_ok()
            },
        )
        .await;
        if exited {
            self.child.forget();
        }
        !exited
    }

    /// Its `/metrics`, from the admin listener.
    pub async fn scrape(&self) -> std::io::Result<String> {
        scrape(self.ports.admin).await
    }

    /// Wait until its admin listener answers `/metrics` (it binds once the store is open).
    pub async fn wait_for_admin(&self, limit: Duration) {
        wait_until(limit, "the gateway's admin listener answers", async || {
            self.scrape().await.is_ok()
        })
        .await;
    }

    /// Read the sum of `family` from its `/metrics` and `kill -9` it at once, in one blocking
    /// call with nothing scheduled in between: the last count it made before a crash, and when
    /// the signal was sent. Not killed when the read fails. Blocks the thread (run it in
    /// `block_in_place`).
    pub fn kill9_counting(&mut self, family: &str) -> std::io::Result<(f64, Instant)> {
        let text = scrape_blocking(self.ports.admin)?;
        let killed = Instant::now();
        self.kill9();
        Ok((sum_of(&text, family), killed))
    }

    /// The sum of every series of `family` (`idemgate_calls_unsettled_total`, whatever its
    /// labels) in its `/metrics`.
    pub async fn metric_sum(&self, family: &str) -> std::io::Result<f64> {
        Ok(sum_of(&self.scrape().await?, family))
    }
}

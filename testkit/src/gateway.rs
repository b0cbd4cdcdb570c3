//! The `idemgate` binary as a child process, on ports it keeps across restarts:
//!
//! ```ignore
//! let mut gateway = Gateway::binary(path).log_to(&log).start(|ports| toml(ports)).await;
//! let unsettled = gateway.metric_sum("idemgate_calls_unsettled_total").await;
//! gateway.kill9(); // a crash: nothing drained, nothing flushed
//! gateway.start_again(|ports| toml(ports)).await; // the same addresses, a new config
//! ```
//!
//! The config is written by the caller from the [`Ports`] the fixture picked (the listener and
//! the admin listener), so that a restart can change it (another upstream path, say) while
//! clients keep the address they know.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::redis::ATTEMPTS;
use crate::{free_addr, wait_until};

/// How long a gateway may take to bind its listener.
const STARTUP: Duration = Duration::from_secs(15);

/// The addresses a gateway process listens on, the same for each of its starts.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    /// Its `listen` address.
    pub listen: SocketAddr,
    /// The address for `[admin] listen`, if its config has an admin listener.
    pub admin: SocketAddr,
}

/// How to run the binary: the program, a command that runs it, its environment, its log.
pub struct Launch {
    binary: PathBuf,
    prefix: Vec<String>,
    env: Vec<(String, String)>,
    env_remove: Vec<String>,
    log: Option<PathBuf>,
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

    /// Take `name` out of the environment it inherits.
    pub fn env_remove(mut self, name: &str) -> Self {
        self.env_remove.push(name.into());
        self
    }

    /// Append its log (standard output and error) to `path`, every start's after the last;
    /// without it, standard output is discarded and standard error is this process's.
    pub fn log_to(mut self, path: &Path) -> Self {
        self.log = Some(path.to_path_buf());
        self
    }

    /// Start it on free ports with the config `toml` writes for them, and wait until its
    /// listener accepts connections. A port another process took first is a start on new ones.
    pub async fn start(self, toml: impl Fn(Ports) -> String) -> GatewayProcess {
        let dir = tempfile::tempdir().unwrap();
        let mut gateway = GatewayProcess {
            ports: Ports {
                listen: free_addr(),
                admin: free_addr(),
            },
            launch: self,
            config: dir.path().join("idemgate.toml"),
            _dir: dir,
            child: None,
        };
        for _ in 0..ATTEMPTS {
            if gateway.spawn(&toml(gateway.ports)).await {
                return gateway;
            }
            gateway.ports = Ports {
                listen: free_addr(),
                admin: free_addr(),
            };
        }
        panic!(
            "the gateway binary did not start on any of {ATTEMPTS} free ports (its log says why)"
        );
    }
}

/// The gateway binary running as a child process; killed on drop.
pub struct GatewayProcess {
    ports: Ports,
    launch: Launch,
    config: PathBuf,
    _dir: tempfile::TempDir,
    child: Option<Child>,
}

impl GatewayProcess {
    /// The binary at `path`, to be started with [`Launch::start`].
    pub fn binary(path: impl Into<PathBuf>) -> Launch {
        Launch {
            binary: path.into(),
            prefix: Vec::new(),
            env: Vec::new(),
            env_remove: Vec::new(),
            log: None,
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

    /// Its process id (that of the prefix's program, which execs the binary), while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// SIGKILL: no chance to clean up, as in a crash.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Send SIGTERM (a graceful shutdown).
    pub fn sigterm(&self) {
        self.signal("-TERM");
    }

    /// SIGSTOP: the process stalls, its connections open and unanswered, its clock running.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`GatewayProcess::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.pid().expect("running");
        let ok = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(ok.success(), "kill {sig} {pid}");
    }

    /// Wait for the process to exit (up to `limit`), returning its exit status.
    pub async fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let mut status = None;
        wait_until(limit, "the gateway binary exits", async || {
            status = child.try_wait().unwrap();
            status.is_some()
        })
        .await;
        self.child = None;
        status.unwrap()
    }

    /// Start it again after a kill or an exit, on the same ports, with the config `toml`
    /// writes; panics when it cannot listen there.
    pub async fn start_again(&mut self, toml: impl Fn(Ports) -> String) {
        assert!(self.child.is_none(), "start_again while running");
        let config = toml(self.ports);
        assert!(
            self.spawn(&config).await,
            "the gateway binary did not start again on {}",
            self.ports.listen
        );
    }

    /// Write `config`, run the binary with it and wait until it listens; `false` when it exited
    /// first (its port was taken, or its config refused: the log says which).
    async fn spawn(&mut self, config: &str) -> bool {
        std::fs::write(&self.config, config).unwrap();
        let launch = &self.launch;
        let mut command = match launch.prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&launch.binary);
                c
            }
            None => Command::new(&launch.binary),
        };
        command.arg("--config").arg(&self.config);
        for name in &launch.env_remove {
            command.env_remove(name);
        }
        command
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(log) = &launch.log {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap();
            command.stdout(file.try_clone().unwrap()).stderr(file);
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", launch.binary.display()));
        let addr = self.ports.listen;
        let mut exited = false;
        wait_until(
            STARTUP,
            "the gateway binary accepts connections",
            async || {
                exited = child.try_wait().unwrap().is_some();
                exited || tokio::net::TcpStream::connect(addr).await.is_ok()
            },
        )
        .await;
        if !exited {
            self.child = Some(child);
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
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&self.ports.admin, SCRAPE)?;
        s.set_read_timeout(Some(SCRAPE))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        let body = metrics_body(&text)?;
        let killed = Instant::now();
        self.kill9();
        Ok((sum_of(&body, family), killed))
    }

    /// The sum of every series of `family` (`idemgate_calls_unsettled_total`, whatever its
    /// labels) in its `/metrics`.
    pub async fn metric_sum(&self, family: &str) -> std::io::Result<f64> {
        Ok(sum_of(&self.scrape().await?, family))
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// How long a scrape may take.
const SCRAPE: Duration = Duration::from_secs(10);

/// `GET /metrics` from the admin listener at `admin`, as text (the head cut off).
pub async fn scrape(admin: SocketAddr) -> std::io::Result<String> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(admin).await?;
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await?;
        let mut text = String::new();
        s.read_to_string(&mut text).await?;
        Ok::<_, std::io::Error>(text)
    };
    let text = tokio::time::timeout(SCRAPE, exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no /metrics in 10 s"))??;
    metrics_body(&text)
}

/// The body of a whole `/metrics` answer, if it is a 200.
fn metrics_body(answer: &str) -> std::io::Result<String> {
    match answer.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Ok(body.to_string())
        }
        _ => Err(std::io::Error::other(format!(
            "/metrics answered {:.80}",
            answer
        ))),
    }
}

/// The sum of every series of `family` in the OpenMetrics `text`: its lines `family value` and
/// `family{labels} value`.
pub fn sum_of(text: &str, family: &str) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(family)?;
            let value = match rest.as_bytes().first() {
                Some(b' ') => rest,
                Some(b'{') => &rest[rest.find("} ")? + 1..],
                _ => return None,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_every_series_of_a_family_and_no_other() {
        let text = "# TYPE idemgate_calls_unsettled counter\n\
            idemgate_calls_unsettled_total{route=\"default\",reason=\"timeout\"} 3\n\
            idemgate_calls_unsettled_total{route=\"default\",reason=\"failed\"} 2\n\
            idemgate_calls_unsettled_total_extra 100\n\
            idemgate_calls_unsettled_created{route=\"default\"} 1.7e9\n\
            idemgate_other_total 7\n";
        assert_eq!(sum_of(text, "idemgate_calls_unsettled_total"), 5.0);
        assert_eq!(sum_of(text, "idemgate_other_total"), 7.0);
        assert_eq!(sum_of(text, "idemgate_missing_total"), 0.0);
    }
}

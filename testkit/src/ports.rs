//! Ports for what cannot be handed a bound listener.
//!
//! Fixtures in this process bind port 0 and keep the listener. A child process (redis-server,
//! the gateway binary) binds its own socket, so its port is picked with [`free_port`] before it
//! starts, and the fixture starts it again on a new port if it did not come up on that one.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// A port nobody listens on at this moment, for a child process to bind. Another process may
/// take it before the child does: callers start the child again on a new port when it fails.
pub fn free_port() -> u16 {
    free_addr().port()
}

/// `127.0.0.1:PORT` with a [`free_port`]: below the kernel's ephemeral range, so that no
/// outgoing connection takes it as its local port while a child that listens there is down
/// (a gateway killed and started again on its ports), and no connection to it while it is down
/// can meet itself (a connect from and to the same port succeeds on Linux).
pub fn free_addr() -> SocketAddr {
    let (low, high) = (10_000, ephemeral_start().max(10_001));
    let start = (std::process::id() as u64 ^ nanos()) % (high - low) as u64;
    for i in 0..u64::from(high - low) {
        let port = low + ((start + i * 7919) % u64::from(high - low)) as u16;
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().unwrap();
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The first port of the kernel's ephemeral range (Linux's default when it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn nanos() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |d| u64::from(d.subsec_nanos()))
}

/// A loopback port that is bound but not listened on: connections to it are refused, and no one
/// else can take it, until [`ReservedPort::listen`]. For "the upstream is down, then comes up
/// at the address the gateway already points at".
pub struct ReservedPort {
    socket: TcpSocket,
    /// The address reserved.
    pub addr: SocketAddr,
}

impl Default for ReservedPort {
    fn default() -> Self {
        Self::new()
    }
}

impl ReservedPort {
    /// Bind a free loopback port without listening on it.
    pub fn new() -> Self {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        ReservedPort { socket, addr }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Start listening on the port.
    pub fn listen(self) -> TcpListener {
        self.socket.listen(1024).unwrap()
    }
}

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

/// `127.0.0.1:PORT` with a [`free_port`].
pub fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
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

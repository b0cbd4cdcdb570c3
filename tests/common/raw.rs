//! Raw sockets on both sides, for framing tests: an upstream that answers fixed bytes, and a
//! client that writes bytes as given and reads responses by their own framing, as a front proxy
//! reusing the connection would.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// An upstream on a raw socket: answers every request it reads with the same bytes, and keeps
/// the requests it read (head and body, as received).
#[derive(Clone)]
pub struct RawUpstream {
    pub addr: SocketAddr,
    requests: Arc<Mutex<Vec<RawMessage>>>,
}

impl RawUpstream {
    /// Start on a free port, answering `response` to every request.
    pub async fn answering(response: &'static [u8]) -> Self {
        Self::start(response, false).await
    }

    /// Start on a free port, answering `response` to the first request of each connection and
    /// then closing it (with an empty `response`: closing it unanswered).
    pub async fn answering_then_closing(response: &'static [u8]) -> Self {
        Self::start(response, true).await
    }

    async fn start(response: &'static [u8], close: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let (read, mut write) = stream.into_split();
                    let mut read = BufReader::new(read);
                    while let Some(req) = read_message(&mut read, false).await {
                        seen.lock().unwrap().push(req);
                        if write.write_all(response).await.is_err() || close {
                            return;
                        }
                    }
                });
            }
        });
        RawUpstream { addr, requests }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The requests that reached it, in order.
    pub fn requests(&self) -> Vec<RawMessage> {
        self.requests.lock().unwrap().clone()
    }
}

/// One HTTP/1.1 message as read off the wire.
#[derive(Debug, Clone, Default)]
pub struct RawMessage {
    /// The request or status line.
    pub start: String,
    /// Header fields in order, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body after removing the chunked framing, if any.
    pub body: Vec<u8>,
}

impl RawMessage {
    /// Every value of `name`.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The one value of `name`, if any.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.all(name).first().copied()
    }

    /// The status code of a response.
    pub fn status(&self) -> u16 {
        self.start.split(' ').nth(1).unwrap().parse().unwrap()
    }

    /// Framing that a client can trust: not both `Content-Length` and `Transfer-Encoding`, at
    /// most one `Content-Length`, and a declared length equal to the body read.
    pub fn assert_consistent_framing(&self) {
        let lengths = self.all("content-length");
        let codings = self.all("transfer-encoding");
        assert!(
            lengths.is_empty() || codings.is_empty(),
            "both Content-Length and Transfer-Encoding: {self:?}"
        );
        assert!(lengths.len() <= 1, "several Content-Length: {self:?}");
        if let Some(n) = lengths.first() {
            assert_eq!(
                n.parse::<usize>().unwrap(),
                self.body.len(),
                "Content-Length disagrees with the body: {self:?}"
            );
        }
    }
}

/// Read one message; `None` at a clean end of stream. A response to HEAD or with 1xx/204/304 is
/// not expected here. With `until_close`, a message without framing reads to the end of stream.
async fn read_message<R: AsyncBufRead + Unpin>(r: &mut R, until_close: bool) -> Option<RawMessage> {
    let mut line = String::new();
    if r.read_line(&mut line).await.ok()? == 0 {
        return None;
    }
    let mut msg = RawMessage {
        start: line.trim_end().to_string(),
        ..RawMessage::default()
    };
    loop {
        let mut line = String::new();
        r.read_line(&mut line).await.ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (n, v) = line.split_once(':').expect("a header line");
        msg.headers
            .push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let chunked = msg
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().ends_with("chunked"));
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).await.ok()?;
            let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk).await.ok()?;
            if size == 0 {
                break;
            }
            msg.body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(n) = msg.header("content-length") {
        let mut body = vec![0; n.parse().expect("a length")];
        r.read_exact(&mut body).await.ok()?;
        msg.body = body;
    } else if until_close {
        r.read_to_end(&mut msg.body).await.ok()?;
    }
    Some(msg)
}

/// A client connection on a raw socket.
pub struct RawClient {
    read: BufReader<tokio::net::tcp::OwnedReadHalf>,
    write: tokio::net::tcp::OwnedWriteHalf,
}

impl RawClient {
    pub async fn connect(addr: SocketAddr) -> Self {
        let (read, write) = TcpStream::connect(addr).await.unwrap().into_split();
        RawClient {
            read: BufReader::new(read),
            write,
        }
    }

    /// Write `bytes` as they are.
    pub async fn send(&mut self, bytes: &[u8]) -> &mut Self {
        self.write.write_all(bytes).await.unwrap();
        self
    }

    /// Read the next response by the framing it declares (Content-Length is trusted, as a
    /// client would); `None` when the connection closed first.
    pub async fn response(&mut self) -> Option<RawMessage> {
        tokio::time::timeout(Duration::from_secs(5), read_message(&mut self.read, true))
            .await
            .expect("no response within 5 s")
    }
}

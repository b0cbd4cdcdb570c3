//! The test's HTTP client side: `let seen = send(env.post_keyed("/v1/p", "k").body("x")).await;`
//! then `seen.status`, `seen.replayed()`, `seen.problem_type()`.

use axum::body::Bytes;

/// An HTTP client that never goes through a proxy from the environment.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// Send and read whole.
pub async fn send(req: reqwest::RequestBuilder) -> Seen {
    Seen::of(req.send().await.expect("request failed")).await
}

/// A response read whole, for comparisons.
#[derive(Debug, Clone)]
pub struct Seen {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub async fn of(resp: reqwest::Response) -> Self {
        Seen {
            status: resp.status().as_u16(),
            headers: resp.headers().clone(),
            body: resp.bytes().await.unwrap(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The `type` of a problem+json body (panics when the body is not one).
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        v["type"].as_str().unwrap().to_string()
    }

    /// The headers other than `Idempotent-Replayed`, in order, for replay comparisons.
    pub fn headers_without_marker(&self) -> Vec<(String, Vec<u8>)> {
        self.headers
            .iter()
            .filter(|(n, _)| n.as_str() != "idempotent-replayed")
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect()
    }
}

//! The Redis store's settings (`backend = "redis"`, `"redis-cluster"`, `"redis-sentinel"`):
//! where it finds its nodes and how it writes there.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use crate::store::settings::DEFAULT_TIMEOUT;
use crate::store::{redact_url, LocalCacheSettings, Seal, StoreError, TlsFiles};

/// How the Redis store keeps response bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// LZ4 for bodies of 1 KiB and more without a `Content-Encoding`, kept only when it saves
    /// at least an eighth.
    #[default]
    Lz4,
    /// Bodies as they came.
    None,
}

/// Which Redis deployment holds the records, and how to find it. URLs may carry a password, so
/// they are never logged whole.
#[derive(Clone, PartialEq, Eq)]
pub enum Topology {
    /// `backend = "redis"`: one server at `url` (`redis://`, `rediss://` or `unix://`).
    Single {
        /// The server.
        url: String,
    },
    /// `backend = "redis-cluster"`: seed nodes of a Redis Cluster; the rest are discovered.
    Cluster {
        /// Seed nodes.
        urls: Vec<String>,
    },
    /// `backend = "redis-sentinel"`: the primary that these sentinels name `master_name`. The
    /// data nodes are reached with the sentinels' TLS setting, and their user and password
    /// unless [`RedisSettings::node_auth`] gives the data nodes' own.
    Sentinel {
        /// The sentinels.
        urls: Vec<String>,
        /// The name the sentinels monitor the primary under.
        master_name: String,
    },
}

impl Topology {
    /// The `backend` value that selects this topology.
    pub fn backend(&self) -> &'static str {
        match self {
            Topology::Single { .. } => "redis",
            Topology::Cluster { .. } => "redis-cluster",
            Topology::Sentinel { .. } => "redis-sentinel",
        }
    }

    /// Every URL, for TLS checks and logs.
    pub fn urls(&self) -> Vec<&str> {
        match self {
            Topology::Single { url } => vec![url.as_str()],
            Topology::Cluster { urls } | Topology::Sentinel { urls, .. } => {
                urls.iter().map(String::as_str).collect()
            }
        }
    }
}

impl fmt::Debug for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Passwords in URLs are never printed.
        let redacted = |urls: &[String]| urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>();
        match self {
            Topology::Single { url } => f
                .debug_struct("Single")
                .field("url", &redact_url(url))
                .finish(),
            Topology::Cluster { urls } => f
                .debug_struct("Cluster")
                .field("urls", &redacted(urls))
                .finish(),
            Topology::Sentinel { urls, master_name } => f
                .debug_struct("Sentinel")
                .field("urls", &redacted(urls))
                .field("master_name", master_name)
                .finish(),
        }
    }
}

/// Key prefix used when none is given.
pub const DEFAULT_PREFIX: &str = "idemgate:";

/// How to reach Redis and how to write there (`backend = "redis"`, `"redis-cluster"` or
/// `"redis-sentinel"`): the one way a [`RedisStore`](crate::store::RedisStore) is made.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// Where the records are.
    pub topology: Topology,
    /// Replicas that must acknowledge each claim and completion (`WAIT`); 0: none.
    pub wait_replicas: u32,
    /// Prefix of every key the gateway writes, so one Redis can serve several deployments.
    pub prefix: String,
    /// How long to wait to connect or for one answer before the store counts as down.
    pub timeout: Duration,
    /// The local cache of completed records in front of Redis.
    pub local_cache: LocalCacheSettings,
    /// For `rediss://`: the CA(s) to trust, and the certificate to present to a Redis that asks
    /// for one (`tls-auth-clients`).
    pub tls: TlsFiles,
    /// How stored bodies are compressed (records are read whatever their encoding).
    pub compression: Compression,
    /// How records are sealed at rest.
    pub seal: Seal,
    // The CA(s) given as PEM in code, or read from `tls.ca_file`.
    pub(crate) ca_pem: Option<Vec<u8>>,
    /// `redis-sentinel` only: the user and password of the data nodes, when they are not the
    /// sentinels' (`node_username`, `node_password`).
    pub node_auth: Option<NodeAuth>,
    // The client certificate and key given as PEM in code, or read from their files.
    pub(crate) client_pem: Option<(Vec<u8>, Vec<u8>)>,
}

/// How a Sentinel deployment's data nodes are logged in to, apart from the sentinels: an ACL user
/// (the default user when `None`) and its password. The password is never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeAuth {
    /// The ACL user.
    pub username: Option<String>,
    /// Its password.
    pub password: Option<String>,
}

impl fmt::Debug for NodeAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let password = self.password.as_ref().map(|_| "<redacted>");
        f.debug_struct("NodeAuth")
            .field("username", &self.username)
            .field("password", &password)
            .finish()
    }
}

impl RedisSettings {
    /// Redis at `url` (`redis://[user:password@]host:port/db`, `rediss://` for TLS,
    /// `unix://`), every other setting at its default.
    pub fn new(url: impl Into<String>) -> Self {
        Self::with_topology(Topology::Single { url: url.into() })
    }

    /// Redis found by `topology` (one server, a cluster's seed nodes, or sentinels), every
    /// other setting at its default.
    pub fn with_topology(topology: Topology) -> Self {
        RedisSettings {
            topology,
            wait_replicas: 0,
            prefix: DEFAULT_PREFIX.to_string(),
            timeout: DEFAULT_TIMEOUT,
            local_cache: LocalCacheSettings::default(),
            tls: TlsFiles::default(),
            compression: Compression::default(),
            seal: Seal::default(),
            node_auth: None,
            ca_pem: None,
            client_pem: None,
        }
    }

    /// Have `replicas` replicas acknowledge every claim and completion (`WAIT`) within the
    /// timeout; 0 (the default): no `WAIT`.
    pub fn wait_replicas(mut self, replicas: u32) -> Self {
        self.wait_replicas = replicas;
        self
    }

    /// Prefix every key with `prefix`, so several deployments can share one Redis.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Past `timeout` without a connection or an answer, the store counts as down for that
    /// request.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// For `rediss://`: trust these PEM certificates (a private CA) instead of the system's roots.
    pub fn tls_ca(mut self, pem: Vec<u8>) -> Self {
        self.ca_pem = Some(pem);
        self
    }

    /// For `rediss://`: present this certificate (chain) and key, both PEM, to a Redis that
    /// asks for one (mutual TLS).
    pub fn tls_client(mut self, cert_pem: Vec<u8>, key_pem: Vec<u8>) -> Self {
        self.client_pem = Some((cert_pem, key_pem));
        self
    }

    /// `redis-sentinel`: log in to the data nodes as `auth` says, not as to the sentinels.
    pub fn node_auth(mut self, auth: NodeAuth) -> Self {
        self.node_auth = Some(auth);
        self
    }

    /// Write completed bodies with `compression` (records are read whatever their encoding).
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Seal records as `seal` says.
    pub fn seal(mut self, seal: Seal) -> Self {
        self.seal = seal;
        self
    }

    /// These settings with the PEM of the [`TlsFiles`] read,
    /// when they are given.
    pub(crate) fn with_files_read(&self) -> Result<Self, StoreError> {
        let read = |field: &'static str, path: &str| {
            std::fs::read(path).map_err(|e| {
                StoreError::from(redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    field,
                    format!("{path}: {e}"),
                )))
            })
        };
        let mut settings = self.clone();
        if let (None, Some(path)) = (&self.ca_pem, &self.tls.ca_file) {
            settings.ca_pem = Some(read("cannot read store.tls_ca_file", path)?);
        }
        if let (None, Some((cert, key))) = (&self.client_pem, self.tls.client_pair()) {
            let cert = read("cannot read store.tls_cert_file", cert)?;
            let key = read("cannot read store.tls_key_file", key)?;
            settings.client_pem = Some((cert, key));
        }
        Ok(settings)
    }

    /// What `rediss://` connections trust and present, when anything but the system's roots.
    pub(crate) fn certificates(&self) -> Option<redis::TlsCertificates> {
        if self.ca_pem.is_none() && self.client_pem.is_none() {
            return None;
        }
        let client_tls = self
            .client_pem
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            });
        Some(redis::TlsCertificates {
            client_tls,
            root_cert: self.ca_pem.clone(),
        })
    }
}

impl fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL's password is never printed, nor the CA's PEM, nor the client key.
        let mut d = f.debug_struct("RedisSettings");
        d.field("topology", &self.topology)
            .field("wait_replicas", &self.wait_replicas)
            .field("prefix", &self.prefix)
            .field(
                "timeout",
                &format_args!("{}", humantime::format_duration(self.timeout)),
            );
        self.local_cache.debug_fields(&mut d);
        self.tls.debug_fields(&mut d);
        d.field("node_auth", &self.node_auth)
            .field("compression", &self.compression)
            .field("seal", &self.seal)
            .finish()
    }
}

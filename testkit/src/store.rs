//! The server a behavioural test's store runs on, whichever backend it is:
//! `let server = StoreServer::for_backend(backend).await;` (none for the memory and embedded stores).

use crate::{Backend, PostgresServer, RedisServer};

/// A redis-server or a PostgreSQL server, stopped on drop.
pub enum StoreServer {
    /// For [`Backend::Redis`].
    Redis(RedisServer),
    /// For [`Backend::Postgres`].
    Postgres(PostgresServer),
}

impl StoreServer {
    /// The server `backend` needs; none for the memory and embedded stores.
    pub async fn for_backend(backend: Backend) -> Option<Self> {
        match backend {
            Backend::Memory | Backend::Embedded => None,
            Backend::Redis => Some(StoreServer::Redis(RedisServer::start().await)),
            Backend::Postgres => Some(StoreServer::Postgres(PostgresServer::start().await)),
        }
    }

    /// The redis-server; panics on another backend.
    pub fn redis(&self) -> &RedisServer {
        match self {
            StoreServer::Redis(r) => r,
            StoreServer::Postgres(_) => panic!("a redis-server runs only on the Redis backend"),
        }
    }

    /// Take the server down, killed (Redis) or stopped (PostgreSQL), keeping its data.
    pub fn take_down(&self) {
        match self {
            StoreServer::Redis(r) => r.kill(),
            StoreServer::Postgres(p) => p.stop(),
        }
    }

    /// Start the server taken down again, on the same port and data; when this returns it
    /// accepts connections.
    pub async fn bring_back(&self) {
        match self {
            StoreServer::Redis(r) => r.restart().await,
            StoreServer::Postgres(p) => p.start_again().await,
        }
    }

    /// The PostgreSQL server; panics on another backend.
    pub fn postgres(&self) -> &PostgresServer {
        match self {
            StoreServer::Postgres(p) => p,
            StoreServer::Redis(_) => panic!("PostgreSQL runs only on the Postgres backend"),
        }
    }
}

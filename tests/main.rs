//! The integration tests, in one binary: one module per area, each with a page of its own
//! (`cargo test --test integration streams::` runs one area), sharing the fixtures of
//! [`common`]. One binary links the gateway once, shares one PostgreSQL template and one
//! Python venv per SDK, and lets the test threads run any area's tests side by side.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    clippy::unreachable,
    reason = "test code: a failed unwrap or assertion is how a test fails"
)]

#[macro_use]
mod common;

mod admin;
mod cli;
mod clients;
mod cluster;
mod connections;
mod deploy;
mod docs;
mod edges;
mod embedded;
mod engine_fuzz;
mod faults;
mod framing;
mod gateway;
mod grpc;
mod http2;
mod mcp;
mod policy;
mod postgres;
mod reload;
mod sealing;
mod store;
mod store_model;
mod streams;
mod telemetry;
mod upstreams;
mod webhooks;

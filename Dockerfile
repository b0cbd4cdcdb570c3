# idemgate container image: a multi-stage build, a small non-root runtime.
#   docker build -t idemgate .
#   docker run -p 8080:8080 -p 9090:9090 -e IDEMGATE_UPSTREAM=http://api:9000 idemgate
#   records are durable in the volume /var/lib/idemgate (the embedded store, the default, in the
#   working directory): -v idemgate-data:/var/lib/idemgate
# Every setting can come from IDEMGATE_... variables (see docs/configuration.md); the example
# config baked in below is the starting point.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# The workspace manifest names the loadtest and testkit members, so their manifests and sources
# come along.
COPY Cargo.toml Cargo.lock ./
COPY loadtest/Cargo.toml loadtest/Cargo.toml
COPY loadtest/src loadtest/src
COPY testkit/Cargo.toml testkit/Cargo.toml
COPY testkit/src testkit/src
COPY src src
# The manifest names the example, so its source comes along (it is not built here).
COPY examples examples
RUN cargo build --release --locked --package idemgate

FROM debian:bookworm-slim AS runtime
# ca-certificates: for rediss:// to a Redis with a certificate from a public CA.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin idemgate \
    && install -d -o idemgate -g idemgate -m 0700 /var/lib/idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY config/example.toml /etc/idemgate/idemgate.toml
USER 10001
# The embedded store's home, owned by the user above, and the working directory, so that the
# default store (idemgate-data in the working directory) is in it: a volume, so that records
# outlive the container.
VOLUME ["/var/lib/idemgate"]
WORKDIR /var/lib/idemgate
# Traffic and the admin listener (health, readiness, metrics) on all interfaces in a container.
ENV IDEMGATE_LISTEN=0.0.0.0:8080 \
    IDEMGATE_ADMIN__LISTEN=0.0.0.0:9090
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/idemgate", "healthcheck", "--url", "http://127.0.0.1:9090/healthz"]
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["--config", "/etc/idemgate/idemgate.toml"]

//! The durable embedded store on real files: what survives a `kill -9` of the gateway binary, one
//! process per directory, group commit, bounds and the purge.

use crate::common;

use std::process::{Command, Output};
use std::time::Duration;

use common::{binary, client, send, wait_until, CountingUpstream, GatewayConfig, InProcessGateway};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::policy::Ttl;
use idemgate::idempotency::record::{EntryState, Token};
use idemgate::store::{embedded, Claim, EmbeddedSettings, EmbeddedStore, Inspect, Store};
use idemgate::store::{ClaimTerms, Claimant};
use idemgate::StoreError;
use testkit::Tmpfs;

fn key(i: u32) -> ScopedKey {
    let mut k = [0u8; 32];
    k[..4].copy_from_slice(&i.to_be_bytes());
    ScopedKey(k)
}

const FP: Fingerprint = Fingerprint([7; 32]);

/// The binary run to its exit with `config` (written to a file) through `sh -c "PREFIX exec
/// idemgate --config FILE"`, for a start that is expected to fail.
fn run_binary(config: &GatewayConfig, prefix: &str) -> Output {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), config.to_toml()).unwrap();
    let script = format!(
        "{prefix} exec '{}' --config '{}'",
        env!("CARGO_BIN_EXE_idemgate"),
        file.path().display()
    );
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .env("RUST_LOG", "off")
        .output()
        .unwrap()
}

/// A gateway config on the embedded store in `dir` in front of `upstream`.
fn config(upstream: &CountingUpstream, dir: &std::path::Path) -> GatewayConfig {
    GatewayConfig::new()
        .upstream(&upstream.url())
        .embedded(dir)
        .set("defaults.lock_ttl", "30s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_request_survives_a_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = CountingUpstream::start().await;
    let config = config(&upstream, dir.path());
    let mut gateway = binary().start(&config).await;
    // Claims acknowledged and still running upstream when the process dies: each reached the
    // upstream, which the gateway does only once its claim is on disk.
    let slow: Vec<String> = (0..16).map(|i| format!("slow-{i}")).collect();
    for key in &slow {
        let request = keyed(&gateway.url("/v1/pay?delay_ms=20000"), key);
        tokio::spawn(request.send());
    }
    upstream.wait_for_calls(slow.len()).await;
    // A stream of keyed requests, cut by the kill.
    let mut lanes = Vec::new();
    for lane in 0..8 {
        let url = gateway.url("/v1/pay");
        lanes.push(tokio::spawn(async move {
            let mut completed = Vec::new();
            for i in 0.. {
                let key = format!("k-{lane}-{i}");
                match keyed(&url, &key).send().await {
                    Ok(r) if r.status().is_success() => completed.push(key),
                    other => {
                        eprintln!("lane {lane} ends on {other:?}");
                        return completed;
                    }
                }
            }
            completed
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    gateway.kill9();
    let mut completed = Vec::new();
    for lane in lanes {
        completed.extend(lane.await.unwrap());
    }
    assert!(completed.len() >= 20, "only {} completed", completed.len());
    let calls = upstream.calls();

    let gateway = binary().start(&config).await;
    for key in &completed {
        let seen = send(keyed(&gateway.url("/v1/pay"), key)).await;
        assert!(
            seen.replayed(),
            "{key}: completed before the kill, not replayed: {seen:?}"
        );
    }
    for key in &slow {
        let seen = send(keyed(&gateway.url("/v1/pay?delay_ms=20000"), key)).await;
        assert_eq!(
            seen.status, 409,
            "{key}: in flight at the kill, not refused: {seen:?}"
        );
        assert_eq!(seen.problem_type(), "urn:idemgate:problem:in-flight");
    }
    assert_eq!(
        upstream.calls(),
        calls,
        "a request ran again after the restart"
    );
    eprintln!(
        "kill -9: {} completed records replayed, {} in-flight claims refused",
        completed.len(),
        slow.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fsync_a_kill_9_under_load_loses_at_most_the_last_second() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = CountingUpstream::start().await;
    let config = config(&upstream, dir.path()).set("store.fsync", false);
    let mut gateway = binary().start(&config).await;
    // Requests without a pause, so that the writer is never idle, for 3.5 s; then the kill.
    let start = std::time::Instant::now();
    let mut lanes = Vec::new();
    for lane in 0..4 {
        let url = gateway.url("/v1/pay");
        lanes.push(tokio::spawn(async move {
            let mut early = Vec::new();
            for i in 0.. {
                let key = format!("k-{lane}-{i}");
                match keyed(&url, &key).send().await {
                    Ok(r) if r.status().is_success() => {
                        if start.elapsed() < Duration::from_millis(1500) {
                            early.push(key);
                        }
                    }
                    _ => return early,
                }
            }
            early
        }));
    }
    tokio::time::sleep(Duration::from_millis(3500)).await;
    gateway.kill9();
    let mut early = Vec::new();
    for lane in lanes {
        early.extend(lane.await.unwrap());
    }
    assert!(early.len() >= 20, "only {} early", early.len());
    let gateway = binary().start(&config).await;
    let mut lost = 0;
    for key in &early {
        if !send(keyed(&gateway.url("/v1/pay"), key)).await.replayed() {
            lost += 1;
        }
    }
    assert_eq!(
        lost,
        0,
        "{lost} of {} records acknowledged 2 s before the kill were lost",
        early.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_a_store_error_and_the_store_works_again_once_there_is_room() {
    let disk = Tmpfs::mount("8m").await;
    let upstream = CountingUpstream::start().await;
    let config = config(&upstream, &disk.path().join("store"));
    let mut gateway = binary().via(&disk.enter()).start(&config).await;
    let acknowledged: Vec<String> = (0..10).map(|i| format!("before-{i}")).collect();
    for key in &acknowledged {
        let first = send(keyed(&gateway.url("/v1/pay"), key)).await;
        assert_eq!(first.status, 201, "{first:?}");
    }
    assert!(disk.fill() > 0, "nothing written to the tmpfs");
    // Records of 200 KB need new pages: the first batch that cannot write them fails.
    let big = gateway.url("/big?bytes=200000");
    let mut refused = None;
    let mut answered = Vec::new();
    for i in 0..50 {
        let key = format!("full-{i}");
        let seen = send(keyed(&big, &key)).await;
        if seen.status == 503 {
            refused = Some(seen);
            break;
        }
        assert!((200..300).contains(&seen.status), "{key}: {seen:?}");
        answered.push(key);
    }
    let refused = refused.expect("no store error on a full disk");
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:store-unavailable"
    );
    assert!(gateway.running(), "the gateway died on a full disk");
    eprintln!(
        "full disk: {} requests answered before the first store error",
        answered.len()
    );
    // Unkeyed requests never touch the store, and are not held up while it reopens its file
    // after the failed write (the reopening once held a lock every worker thread waited on).
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        let started = std::time::Instant::now();
        let unkeyed = send(client().post(gateway.url("/v1/pay"))).await;
        assert_eq!(unkeyed.status, 201, "{unkeyed:?}");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "held up {took:?}");
        let _ = send(keyed(&big, "while-full")).await;
    }

    disk.free();
    let mut again = 0;
    wait_until(
        Duration::from_secs(10),
        "a keyed request succeeds once there is room",
        async || {
            again += 1;
            let seen = send(keyed(&gateway.url("/v1/pay"), &format!("after-{again}"))).await;
            seen.status == 201
        },
    )
    .await;
    for key in &acknowledged {
        let seen = send(keyed(&gateway.url("/v1/pay"), key)).await;
        assert!(seen.replayed(), "{key} lost: {seen:?}");
    }
    // Answered while the disk was full: the completions that failed are sent again, and land.
    for key in &answered {
        wait_until(
            Duration::from_secs(10),
            "the record is written",
            async || send(keyed(&big, key)).await.replayed(),
        )
        .await;
    }
    assert!(gateway.running());
}

/// `idemgate_store_commits_total` in a scrape.
fn commits_in(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_store_commits_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no idemgate_store_commits_total in {metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commits_metric_counts_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = CountingUpstream::start().await;
    let config = config(&upstream, dir.path())
        .set("store.fsync", true)
        .set("admin.listen", "127.0.0.1:0");
    let gateway = InProcessGateway::start(&config).await;
    let start = commits_in(&gateway.metrics().await);
    // One after another, a miss is two commits: its claim before the upstream call, its record
    // before the answer.
    for i in 0..10 {
        let seen = send(keyed(&gateway.url("/v1/pay"), &format!("seq-{i}"))).await;
        assert_eq!(seen.status, 201, "{seen:?}");
    }
    let after = commits_in(&gateway.metrics().await);
    assert_eq!(after - start, 20, "10 misses in a row");
    // A replay reads a snapshot: no commit.
    for i in 0..10 {
        assert!(send(keyed(&gateway.url("/v1/pay"), &format!("seq-{i}")))
            .await
            .replayed());
    }
    assert_eq!(
        commits_in(&gateway.metrics().await),
        after,
        "replays committed"
    );
    // Concurrent misses share commits: fewer than one per miss, not two.
    let misses: Vec<_> = (0..64)
        .map(|i| tokio::spawn(keyed(&gateway.url("/v1/pay"), &format!("par-{i}")).send()))
        .collect();
    for m in misses {
        assert_eq!(m.await.unwrap().unwrap().status(), 201);
    }
    let shared = commits_in(&gateway.metrics().await) - after;
    assert!(shared < 64, "{shared} commits for 64 concurrent misses");
}

/// `POST url` with `key` as its Idempotency-Key and its body.
fn keyed(url: &str, key: &str) -> reqwest::RequestBuilder {
    client()
        .post(url)
        .header("idempotency-key", key)
        .body(key.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_the_directory_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = CountingUpstream::start().await;
    let config = config(&upstream, dir.path());
    let _first = binary().start(&config).await;
    let second = run_binary(&config.clone().set("listen", "127.0.0.1:0"), "");
    assert_eq!(second.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&second.stderr);
    let file = dir.path().join(embedded::FILE_NAME);
    assert!(
        stderr.contains(&file.display().to_string()) && stderr.contains("another process"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_share_commits() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&EmbeddedSettings::new(dir.path())).unwrap();
    let before = store.commits();
    let lease = Duration::from_secs(60);
    let claims: Vec<_> = (0..256)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .claim(
                        &Claimant::new(key(i), FP, Token([1; 16])),
                        ClaimTerms::lease(lease),
                    )
                    .await
            })
        })
        .collect();
    for c in claims {
        assert!(matches!(c.await.unwrap().unwrap(), Claim::Claimed));
    }
    let commits = store.commits() - before;
    assert!(commits < 128, "{commits} commits for 256 concurrent claims");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let settings = EmbeddedSettings::new(dir.path());
    let lease = Duration::from_secs(60);
    let store = EmbeddedStore::open(&settings).unwrap();
    store
        .claim(
            &Claimant::new(key(1), FP, Token([1; 16])),
            ClaimTerms::lease(lease),
        )
        .await
        .unwrap();
    store
        .claim(
            &Claimant::new(key(2), FP, Token([2; 16])),
            ClaimTerms::lease(lease),
        )
        .await
        .unwrap();
    assert!(store
        .complete(
            &Claimant::new(key(2), FP, Token([2; 16])),
            &EntryState::NotReplayable,
            lease.into()
        )
        .await
        .unwrap());
    drop(store);
    let mut reopened = None;
    wait_until(Duration::from_secs(5), "the file is let go", async || {
        reopened = EmbeddedStore::open(&settings).ok();
        reopened.is_some()
    })
    .await;
    let store = reopened.unwrap();
    let again = store
        .claim(
            &Claimant::new(key(1), FP, Token([9; 16])),
            ClaimTerms::lease(lease),
        )
        .await
        .unwrap();
    assert!(matches!(again, Claim::InFlight), "{again:?}");
    let again = store
        .claim(
            &Claimant::new(key(2), FP, Token([9; 16])),
            ClaimTerms::lease(lease),
        )
        .await
        .unwrap();
    assert!(matches!(again, Claim::NotReplayable), "{again:?}");
    // The original holder still completes its claim after the restart.
    assert!(store
        .complete(
            &Claimant::new(key(1), FP, Token([1; 16])),
            &EntryState::NotReplayable,
            lease.into()
        )
        .await
        .unwrap());
    assert_eq!(store.evict_all().await.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_like_the_memory_store_and_purged() {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = EmbeddedSettings::new(dir.path());
    settings.max_entries = 10;
    let evictions = idemgate::store::Evictions::default();
    let counter = prometheus_client::metrics::counter::Counter::default();
    let store = EmbeddedStore::open_counted(&settings, counter, evictions.clone()).unwrap();
    let lease = Duration::from_secs(60);
    for i in 0..10 {
        let t = Token([i as u8; 16]);
        store
            .claim(&Claimant::new(key(i), FP, t), ClaimTerms::lease(lease))
            .await
            .unwrap();
        if i >= 5 {
            store
                .complete(
                    &Claimant::new(key(i), FP, t),
                    &EntryState::NotReplayable,
                    lease.into(),
                )
                .await
                .unwrap();
        }
    }
    for i in 10..15 {
        let claimed = store
            .claim(
                &Claimant::new(key(i), FP, Token([i as u8; 16])),
                ClaimTerms::lease(lease),
            )
            .await
            .unwrap();
        assert!(matches!(claimed, Claim::Claimed));
    }
    for i in 0..5 {
        let again = store
            .claim(
                &Claimant::new(key(i), FP, Token([99; 16])),
                ClaimTerms::lease(lease),
            )
            .await
            .unwrap();
        assert!(matches!(again, Claim::InFlight), "claim {i} was evicted");
        assert!(
            store.inspect(&key(i + 5)).await.unwrap().is_none(),
            "record {} kept",
            i + 5
        );
    }
    assert_eq!(evictions.max_entries.get(), 5, "the five records, counted");
    assert_eq!(evictions.max_bytes.get(), 0);
    assert!(matches!(
        store
            .claim(
                &Claimant::new(key(100), FP, Token([1; 16])),
                ClaimTerms::lease(lease)
            )
            .await,
        Err(StoreError::Full)
    ));
    // Short leases run out and the background purge removes them.
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&EmbeddedSettings::new(dir.path())).unwrap();
    for i in 0..3 {
        let short = Duration::from_millis(100);
        store
            .claim(
                &Claimant::new(key(i), FP, Token([1; 16])),
                ClaimTerms::lease(short),
            )
            .await
            .unwrap();
    }
    tokio::time::sleep(embedded::PURGE_EVERY * 2 + Duration::from_millis(500)).await;
    assert_eq!(
        store.evict_all().await.unwrap(),
        0,
        "expired claims not purged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_kept_forever_are_never_evicted_to_make_room() {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = EmbeddedSettings::new(dir.path());
    settings.max_entries = 3;
    let store = EmbeddedStore::open(&settings).unwrap();
    let lease = Duration::from_secs(60);
    for i in 0..3 {
        let (k, t) = (key(i), Token([i as u8; 16]));
        store
            .claim(&Claimant::new(k, FP, t), ClaimTerms::lease(lease))
            .await
            .unwrap();
        let kept = EntryState::NotReplayable;
        assert!(store
            .complete(&Claimant::new(k, FP, t), &kept, Ttl::Forever.into())
            .await
            .unwrap());
    }
    // At the bound, a new key is refused rather than a record kept forever dropped...
    let refused = store
        .claim(
            &Claimant::new(key(3), FP, Token([3; 16])),
            ClaimTerms::lease(lease),
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Full)), "{refused:?}");
    for i in 0..3 {
        let kept = store.inspect(&key(i)).await.unwrap().expect("kept");
        assert_eq!(kept.expires_in, None);
    }
    // ...and an eviction by the operator makes room.
    assert!(store.evict(&key(0)).await.unwrap());
    let claimed = store
        .claim(
            &Claimant::new(key(3), FP, Token([3; 16])),
            ClaimTerms::lease(lease),
        )
        .await;
    assert!(matches!(claimed, Ok(Claim::Claimed)), "{claimed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_kept_forever_replay_after_a_restart_with_no_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = CountingUpstream::start().await;
    let config = config(&upstream, dir.path())
        .set("defaults.ttl", "forever")
        .set("defaults.expiry_header", "idempotency-expires")
        .route("/v1/day", toml::toml! { ttl = "1d" });
    let gateway = binary().start(&config).await;
    let first = send(keyed(&gateway.url("/v1/pay"), "kept")).await;
    assert_eq!(first.status, 201);
    assert_eq!(
        first.header("idempotency-expires"),
        None,
        "forever has no date"
    );
    let day = send(keyed(&gateway.url("/v1/day"), "a-day")).await;
    assert!(day.header("idempotency-expires").is_some(), "{day:?}");
    drop(gateway);

    let gateway = binary().start(&config).await;
    let again = send(keyed(&gateway.url("/v1/pay"), "kept")).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.header("idempotency-expires"), None);
    assert_eq!(upstream.calls(), 2);
}

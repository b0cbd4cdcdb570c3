//! The engine fuzzer: the in-process [`IdempotencyLayer`](idemgate::IdempotencyLayer) over the
//! memory store and a scripted inner service, driven by generated cases on paused time, its
//! every step checked against what the documentation promises.
//!
//! A case (`engine_fuzz/case.rs`) is a few routes with generated policies (leases down to
//! their minimum, ttls from 1 ms to forever, `after_expiry`, `stream`, `max_body`, the
//! fingerprint, waiting duplicates), and up to 24 requests on a few keys and callers, sent at
//! generated times, concurrent duplicates among them, with bad keys, unkeyed and non-idempotent
//! methods, and bodies the same, equal as JSON, different or invalid. Half the cases reload
//! their routes midway (each request is judged under the table in force when it reached the
//! layer, each record under its writer's policy). Each request carries the script of what the
//! inner service answers if it reaches it: an error (sent or not), a panic, or a response (any
//! status, 1xx and 5xx too; `Idempotency-Control` across the u64 range; hop-by-hop headers; a
//! `Content-Length` right or wrong; a body whole or in chunks after delays, with trailers, cut
//! short by an error or a panic). Clients stay, give up midway or read slowly; two workers
//! (layers sharing routes and live answers over one store) serve them.
//!
//! A run (`engine_fuzz/world.rs`) logs, in order and in virtual time, every store operation
//! the layer makes, every step of every inner call, and every answer; `engine_fuzz/check.rs`
//! then checks the invariants of its module docs: no panic, hang or stuck key; the inner
//! service called at most once per key while its record or claim lives, each key settled as
//! the rules say; every replay the recorded answer, byte for byte, and the first answer the
//! same.
//!
//! `ENGINE_FUZZ_CASES` sets the number of generated cases ([`DEFAULT_CASES`] by default: a few
//! seconds), `ENGINE_FUZZ_SEED` the seed (fixed by default; `random` for a new one). The cases
//! a run once found are kept in [`REGRESSIONS`], run first. A failure prints its seed and the
//! shrunk case as JSON, to keep there.

use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

mod case;
mod check;
mod world;

use self::case::{Case, SCRIPTED_PANIC};
use self::check::Tally;

/// Generated cases when `ENGINE_FUZZ_CASES` is not set.
const DEFAULT_CASES: u32 = 300;

/// The seed when `ENGINE_FUZZ_SEED` is not set.
const DEFAULT_SEED: u64 = 20_250_531;

/// Cases that once broke an invariant, as the fuzzer printed them (shrunk), or written from
/// one to show its bug plainly; each with what it found.
const REGRESSIONS: &[(&str, &str)] = &[
    (
        // A streamed answer whose body panics in the claimed call's task: its reader (here
        // the client itself) waited for the next chunk forever.
        "a_streamed_answer_whose_recording_panics",
        r#"{"routes":[{"lock_ttl":30,"upstream_timeout":30,"ttl":{"Ms":1},"failure_ttl":{"Ms":1},"max_ttl":null,"refuse_after":null,"stream":true,"max_body":16,"json":false,"wait":null,"cache_server_errors":false,"mismatch_422":false,"expiry_header":false,"drop":"Default","put":false}],"requests":[{"at":0,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":2,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Chunks":[[],"Panics"]}}},"client":"Stays"}]}"#,
    ),
    (
        // Written from the next one: a streamed answer late in a renewal period (claimed at
        // 0, renewed at 10 and 20, its head at 29) that breaks off at 35, before the body's
        // first renewal; the retry at 51 ran, although the lease must last until at least
        // 54 (the break and a lease, less a renewal period): the head's wait and the body's
        // each began a new renewal period.
        "a_stream_breaking_off_after_its_head",
        r#"{"routes":[{"lock_ttl":30,"upstream_timeout":1000,"ttl":{"Ms":1000},"failure_ttl":{"Ms":1000},"max_ttl":null,"refuse_after":null,"stream":true,"max_body":1024,"json":false,"wait":null,"cache_server_errors":false,"mismatch_422":false,"expiry_header":false,"drop":"Default","put":false}],"requests":[{"at":0,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":2,"answer":{"Responds":{"head_after":29,"status":200,"headers":[],"body":{"Chunks":[[[6,"x"]],"Fails"]}}},"client":"Stays"},{"at":51,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":2,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":"y"}}},"client":"Stays"}]}"#,
    ),
    (
        // The same, found: a streamed answer silent past upstream_timeout 5 ms after its head
        // (ENGINE_FUZZ_SEED=12335017746504492), its duplicate waiting, run 15 ms into what
        // should have been the rest of the lease.
        "a_stream_silent_after_its_head",
        r#"{"routes":[{"lock_ttl":30,"upstream_timeout":10,"ttl":{"Ms":1},"failure_ttl":{"Ms":1},"max_ttl":null,"refuse_after":null,"stream":true,"max_body":1,"json":false,"wait":[100,1],"cache_server_errors":false,"mismatch_422":false,"expiry_header":false,"drop":"Default","put":false}],"requests":[{"at":0,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":5,"answer":{"Responds":{"head_after":11,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":5,"answer":{"Responds":{"head_after":11,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":30,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":5,"answer":{"Responds":{"head_after":11,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":60,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":5,"answer":{"Responds":{"head_after":5,"status":200,"headers":[],"body":{"Chunks":[[[11,""]],"Whole"]}}},"client":"Stays"},{"at":76,"route":0,"method":"Post","key":{"Valid":0},"auth":0,"body":5,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"}]}"#,
    ),
    (
        // Not the engine's: the checker's (ENGINE_FUZZ_SEED=24673737234362787). A tombstone
        // outlives the records written after it on a route that ignores it, and answers 410
        // once the last claim's lease ran out, at the earliest a renewal period after the
        // layer gave up on its call.
        "a_tombstone_answers_when_a_later_lease_lapses",
        r#"{"routes":[{"lock_ttl":30,"upstream_timeout":30,"ttl":{"Ms":1},"failure_ttl":{"Ms":1},"max_ttl":null,"refuse_after":1000,"stream":false,"max_body":28,"json":false,"wait":null,"cache_server_errors":false,"mismatch_422":false,"expiry_header":false,"drop":"Default","put":false},{"lock_ttl":30,"upstream_timeout":10,"ttl":{"Ms":1},"failure_ttl":{"Ms":1},"max_ttl":null,"refuse_after":null,"stream":false,"max_body":28,"json":false,"wait":null,"cache_server_errors":false,"mismatch_422":false,"expiry_header":false,"drop":"Default","put":false},{"lock_ttl":30,"upstream_timeout":10,"ttl":{"Ms":1},"failure_ttl":{"Ms":1},"max_ttl":null,"refuse_after":null,"stream":false,"max_body":28,"json":false,"wait":null,"cache_server_errors":false,"mismatch_422":false,"expiry_header":false,"drop":"Default","put":false}],"requests":[{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":1,"route":1,"method":"Post","key":{"Valid":1},"auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":64,"route":1,"method":"Post","key":{"Valid":1},"auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Chunks":[[[11,""]],"Whole"]}}},"client":"Stays"},{"at":94,"route":3,"method":"Post","key":{"Quoted":1},"auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":3,"method":"Post","key":{"Quoted":1},"auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"},{"at":0,"route":0,"method":"Post","key":"None","auth":0,"body":0,"answer":{"Responds":{"head_after":0,"status":200,"headers":[],"body":{"Full":""}}},"client":"Stays"}]}"#,
    ),
];

#[test]
fn engine_fuzz_regressions() {
    quiet_scripted_panics();
    for (name, json) in REGRESSIONS {
        let case: Case = serde_json::from_str(json).unwrap();
        if let Err(why) = check::check(&case, &world::run(&case), &Tally::default()) {
            panic!("the regression case {name} fails: {why}");
        }
    }
}

#[test]
fn engine_fuzz_generated() {
    quiet_scripted_panics();
    let (cases, seed) = (cases(), seed());
    let began = std::time::Instant::now();
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        // Shrinking replays a case many times; each is milliseconds.
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let tally = Tally::default();
    let result = runner.run(&case::cases(), |case| {
        check::check(&case, &world::run(&case), &tally).map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => {
            let tally = tally.lock().unwrap();
            eprintln!(
                "engine fuzz: {cases} cases kept every invariant ({:.1?}, ENGINE_FUZZ_SEED={seed}); \
                 seen: {tally:?}",
                began.elapsed(),
            );
            reloads_reached(cases, &tally);
        }
        Err(TestError::Fail(why, case)) => panic!(
            "the engine broke an invariant (ENGINE_FUZZ_SEED={seed}): {why}\n\
             shrunk case, to keep in REGRESSIONS:\n{}",
            serde_json::to_string(&case).unwrap()
        ),
        Err(TestError::Abort(why)) => panic!("engine fuzz: {why}"),
    }
}

/// Over enough cases, a good share reload their routes between their requests (some requests
/// under the old table, some under the new one); some run a key again, or replay it, across
/// the reload.
fn reloads_reached(cases: u32, tally: &std::collections::BTreeMap<&'static str, u32>) {
    if cases < 100 {
        return;
    }
    let split = tally
        .get("case with requests on both sides of its reload")
        .copied()
        .unwrap_or(0);
    assert!(
        split >= cases / 5,
        "only {split} of {cases} cases reloaded between their requests"
    );
    for what in [
        "call admitted before the reload, settled after it",
        "key run again across the reload",
        "answer replayed across the reload",
    ] {
        assert!(tally.contains_key(what), "no {what} in {cases} cases");
    }
}

/// `ENGINE_FUZZ_CASES`, or [`DEFAULT_CASES`].
fn cases() -> u32 {
    match std::env::var("ENGINE_FUZZ_CASES") {
        Ok(n) => n.parse().expect("ENGINE_FUZZ_CASES: a number of cases"),
        Err(_) => DEFAULT_CASES,
    }
}

/// `ENGINE_FUZZ_SEED` (`random`: one from the clock), or [`DEFAULT_SEED`].
fn seed() -> u64 {
    match std::env::var("ENGINE_FUZZ_SEED").as_deref() {
        Ok("random") => {
            idemgate::idempotency::record::now_ms() ^ u64::from(std::process::id()) << 40
        }
        Ok(n) => n.parse().expect("ENGINE_FUZZ_SEED: a number, or random"),
        Err(_) => DEFAULT_SEED,
    }
}

/// The inner service's scripted panics are expected by the thousand: the panic hook stays
/// silent for them and speaks for every other.
fn quiet_scripted_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&SCRIPTED_PANIC) {
                hook(info);
            }
        }));
    });
}

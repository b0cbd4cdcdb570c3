//! The checker: a run's history (what the upstream executed, what the clients saw, which
//! gateway processes were killed and what they counted) judged key by key, after the fact.
//!
//! - **Duplicates.** A key's executions that did work (every one but those the upstream answered
//!   503, which did nothing and which the gateway releases) are at most one: the one whose answer
//!   the key replays. Each other one is a duplicate, and needs a reason the gateway gave: it was
//!   in flight on a process killed with `kill -9` (the crash window: it started before the kill,
//!   and the kill came before the process was done with it), or its process counted a call as
//!   unsettled (`idemgate_calls_unsettled_total`; each count explains one duplicate of that
//!   process). Otherwise it is unexplained. A process is done with a call when it has counted
//!   it (a timeout, a broken answer), or a lease after the answer came; a completion the store
//!   did not take is sent again until it does, so the store faults that went on from the answer
//!   extend that to a lease after the last of them. And a process whose client was still
//!   waiting for it on that key when it died (stalled past its own timeouts) was still at it.
//! - **Answers.** Every answer that is not one of the gateway's own refusals (problem+json) is
//!   byte for byte the status and body of one of the key's executions, and every replay is the
//!   first replay, the key's one record. A refusal is one of those a fault explains (in flight,
//!   store unavailable, upstream timeout or failure); any other counts as a wrong body too.
//! - **Stuck keys.** Once the faults stopped and the leases ran out, every key replays.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;

/// What the upstream did with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Answered in full.
    Answer,
    /// Answered in full, but only after the gateway's `upstream_timeout`.
    Slow,
    /// Sent its head and half its body, then dropped the connection.
    Reset,
    /// Answered 503: nothing done, the gateway releases the key.
    Unavailable,
}

/// One request the upstream executed.
#[derive(Debug, Clone)]
pub struct Execution {
    pub key: String,
    /// The gateway process that sent it (its incarnation number).
    pub process: u32,
    /// When it arrived, and when its answer was given (or broken off, or the gateway hung up
    /// before it), from the run's start.
    pub start: Duration,
    pub end: Duration,
    /// The gateway hung up before the answer was due (it was killed, or gave up on the call).
    pub cut_short: bool,
    pub act: Act,
    /// The status and the exact bytes it answered (all of them, even when it broke off).
    pub status: u16,
    pub body: Bytes,
}

/// When an attempt was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// While the nemesis ran.
    Run,
    /// After the faults stopped and the leases ran out: every key retried until it replays.
    Settle,
}

/// What a client got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A whole answer. `problem` is the type of the gateway's own problem+json, if it is one.
    Answered {
        status: u16,
        replayed: bool,
        problem: Option<String>,
        body: Bytes,
    },
    /// The connection was refused, or broke before a whole answer.
    Broken,
    /// No whole answer within the client's timeout.
    TimedOut,
    /// The client hung up on purpose, mid-body or after sending.
    HungUp,
}

impl Outcome {
    /// A 2xx answer.
    pub fn succeeded(&self) -> bool {
        matches!(self, Outcome::Answered { status, .. } if (200..300).contains(status))
    }

    /// A replay.
    pub fn replayed(&self) -> bool {
        matches!(self, Outcome::Answered { replayed: true, .. })
    }
}

/// One request a client sent.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub key: String,
    /// The gateway process it went to (as the harness knew it when sending).
    pub process: u32,
    pub start: Duration,
    pub end: Duration,
    pub phase: Phase,
    pub outcome: Outcome,
}

/// One gateway process, from its start to its end.
#[derive(Debug, Clone)]
pub struct Process {
    pub id: u32,
    /// When it was killed with `kill -9`, if it was.
    pub killed: Option<Duration>,
    /// Its `idemgate_calls_unsettled_total` (every reason), read just before the kill or at the
    /// end of the run.
    pub unsettled: u64,
}

/// A fault the nemesis injected, from its start to its end.
#[derive(Debug, Clone)]
pub struct Fault {
    pub kind: &'static str,
    /// It took the store away (rather than a gateway process).
    pub store: bool,
    pub start: Duration,
    pub end: Duration,
}

/// Everything a run recorded.
#[derive(Debug, Default)]
pub struct History {
    /// Every key the clients used.
    pub keys: Vec<String>,
    pub executions: Vec<Execution>,
    pub attempts: Vec<Attempt>,
    pub processes: Vec<Process>,
    pub faults: Vec<Fault>,
    /// The gateways' lease (`lock_ttl`): how long after its answer a killed process's call
    /// could still have been recorded.
    pub lease: Duration,
    /// The gateways' `upstream_timeout`: when a slow call was counted unsettled.
    pub upstream_timeout: Duration,
}

/// How much later than the upstream saw it a process may count a call it gave up on (the
/// request's way there, a scheduler's delay).
const SLACK: Duration = Duration::from_millis(250);

/// How much later than its process sent it the upstream may log an execution (its body read,
/// a loaded machine's scheduling): one from a process killed that long before was sent before.
const LOGGED_LATE: Duration = Duration::from_secs(1);

/// Until when `e`'s process was working on it: the crash window of a kill ends there.
fn done_with(e: &Execution, h: &History) -> Duration {
    match e.act {
        // Hung up on before its answer: the process gave up then, or died then.
        _ if e.cut_short => e.end + SLACK,
        Act::Slow => e.start + h.upstream_timeout + SLACK,
        Act::Reset => e.end + SLACK,
        Act::Answer | Act::Unavailable => {
            let mut until = e.end + h.lease;
            for f in h.faults.iter().filter(|f| f.store) {
                if f.start <= until && f.end > e.end {
                    until = until.max(f.end + h.lease.max(RESENT_WITHIN));
                }
            }
            until
        }
    }
}

/// How soon after a store comes back a pending completion reaches it: the gateway's longest
/// pause between two sends (1 s), and a store operation's timeout (2 s).
const RESENT_WITHIN: Duration = Duration::from_secs(3);

/// The gateway's own refusals that a fault explains.
const EXPLAINED_REFUSALS: [&str; 5] = [
    "in-flight",
    "store-unavailable",
    "upstream-timeout",
    "upstream-unavailable",
    "upstream-invalid-response",
];

/// What the checker found.
#[derive(Debug, Default)]
pub struct Verdict {
    pub keys: usize,
    pub attempts: usize,
    pub executions: usize,
    /// Executions the upstream answered 503 (not duplicates).
    pub unavailable: usize,
    pub dup_unexplained: usize,
    pub dup_unsettled: usize,
    pub dup_crash: usize,
    pub wrong: usize,
    pub stuck: usize,
    /// Attempts of the run that started during a fault: answered 2xx, and all.
    pub during_faults: (usize, usize),
    /// The same for those that started outside every fault.
    pub outside_faults: (usize, usize),
    /// The gateways' unsettled calls, all processes together.
    pub unsettled: u64,
    /// What is wrong, one line each, key and evidence.
    pub anomalies: Vec<String>,
}

impl Verdict {
    /// No unexplained duplicate, wrong body or stuck key.
    pub fn sound(&self) -> bool {
        self.dup_unexplained == 0 && self.wrong == 0 && self.stuck == 0
    }
}

/// Judge `h`.
pub fn check(h: &History) -> Verdict {
    let mut v = Verdict {
        keys: h.keys.len(),
        attempts: h.attempts.len(),
        executions: h.executions.len(),
        unavailable: h
            .executions
            .iter()
            .filter(|e| e.act == Act::Unavailable)
            .count(),
        unsettled: h.processes.iter().map(|p| p.unsettled).sum(),
        ..Verdict::default()
    };
    let mut executions: HashMap<&str, Vec<&Execution>> = HashMap::new();
    for e in &h.executions {
        executions.entry(&e.key).or_default().push(e);
    }
    let mut attempts: HashMap<&str, Vec<&Attempt>> = HashMap::new();
    for a in &h.attempts {
        attempts.entry(&a.key).or_default().push(a);
    }
    let mut orphans: Vec<Orphan<'_>> = Vec::new();
    for key in &h.keys {
        let mut execs = executions.remove(key.as_str()).unwrap_or_default();
        execs.sort_by_key(|e| e.start);
        let mut atts = attempts.remove(key.as_str()).unwrap_or_default();
        atts.sort_by_key(|a| a.end);
        let record = answers(key, &execs, &atts, &mut v);
        // Every execution that did work but the recorded one (the last, if none replays).
        let worked: Vec<&Execution> = execs
            .into_iter()
            .filter(|e| e.act != Act::Unavailable)
            .collect();
        let kept = record
            .and_then(|body| worked.iter().position(|e| e.body == *body))
            .or(worked.len().checked_sub(1));
        orphans.extend(
            worked
                .iter()
                .enumerate()
                .filter(|&(i, _)| Some(i) != kept)
                .map(|(_, e)| Orphan {
                    e,
                    all: worked.clone(),
                    attempts: atts.clone(),
                }),
        );
        let settled = atts
            .iter()
            .any(|a| a.phase == Phase::Settle && a.outcome.replayed());
        if !settled {
            v.stuck += 1;
            v.anomalies.push(format!(
                "stuck: {key} never replayed after the faults stopped ({})",
                story(&worked, &atts)
            ));
        }
    }
    // Executions nobody asked for (a key the clients never used) are duplicates of nothing.
    for (key, execs) in executions {
        v.dup_unexplained += execs.len();
        v.anomalies
            .push(format!("{key}: executed {} times, never sent", execs.len()));
    }
    attribute(h, orphans, &mut v);
    shares(h, &mut v);
    v
}

/// Check each answer of `key` against its executions; the body of its first replay (its record).
fn answers<'a>(
    key: &str,
    execs: &[&Execution],
    atts: &[&'a Attempt],
    v: &mut Verdict,
) -> Option<&'a Bytes> {
    let record = atts.iter().find_map(|a| match &a.outcome {
        Outcome::Answered {
            replayed: true,
            body,
            ..
        } => Some(body),
        _ => None,
    });
    for a in atts {
        let Outcome::Answered {
            status,
            replayed,
            problem,
            body,
        } = &a.outcome
        else {
            continue;
        };
        let wrong = match problem {
            Some(t) if EXPLAINED_REFUSALS.contains(&t.as_str()) => None,
            Some(t) => Some(format!("refused {status} {t}")),
            None if !execs.iter().any(|e| e.status == *status && e.body == body) => Some(format!(
                "{status} with {} bytes that none of its {} executions answered",
                body.len(),
                execs.len()
            )),
            None if *replayed && Some(body) != record => {
                Some("a replay unlike its first replay".to_string())
            }
            None => None,
        };
        if let Some(what) = wrong {
            v.wrong += 1;
            v.anomalies.push(format!(
                "wrong body: {key} at {:.3} s from process {}: {what}",
                a.end.as_secs_f64(),
                a.process
            ));
        }
    }
    record
}

/// An execution that did work and is not its key's record, with its key's executions and
/// attempts.
struct Orphan<'a> {
    e: &'a Execution,
    all: Vec<&'a Execution>,
    attempts: Vec<&'a Attempt>,
}

impl Orphan<'_> {
    /// Whether its process was still working on it when killed at `k`: by the times the
    /// upstream saw, or because a client's request to that process for the key, sent before
    /// the execution, was still unanswered when the process died (a process stalled past its
    /// own timeouts).
    fn in_flight_at(&self, k: Duration, h: &History) -> bool {
        let e = self.e;
        let waited = self.attempts.iter().any(|a| {
            a.process == e.process
                && a.start <= e.start + LOGGED_LATE
                && a.start <= k
                && a.end + SLACK >= k
                && matches!(a.outcome, Outcome::Broken | Outcome::TimedOut)
        });
        e.start <= k + LOGGED_LATE && (k <= done_with(e, h) || waited)
    }
}

/// Give each orphan execution (did work, not the record) its reason: the crash window of its
/// process, else one of its process's unsettled calls, else none. Only the counts matter; so
/// that the lines name the executions nothing explains, the calls the upstream itself made
/// slow or broke take a process's unsettled count first, then the others as they started.
fn attribute(h: &History, mut orphans: Vec<Orphan<'_>>, v: &mut Verdict) {
    let processes: HashMap<u32, &Process> = h.processes.iter().map(|p| (p.id, p)).collect();
    let mut budget: HashMap<u32, u64> = h.processes.iter().map(|p| (p.id, p.unsettled)).collect();
    orphans.sort_by_key(|o| (o.e.act == Act::Answer, o.e.start, o.e.process));
    for orphan in orphans {
        let (e, all) = (orphan.e, &orphan.all);
        let killed = processes.get(&e.process).and_then(|p| p.killed);
        let in_crash = killed.is_some_and(|k| orphan.in_flight_at(k, h));
        let left = budget.entry(e.process).or_default();
        if in_crash {
            v.dup_crash += 1;
        } else if *left > 0 {
            *left -= 1;
            v.dup_unsettled += 1;
        } else {
            v.dup_unexplained += 1;
            v.anomalies.push(format!(
                "unexplained duplicate: {} ran {} times: {}; the one at {:.3} s by process {} is not its record, and that process {} and counted {} unsettled calls, all spent",
                e.key,
                all.len(),
                all.iter()
                    .map(|x| describe(x))
                    .collect::<Vec<_>>()
                    .join(", "),
                e.start.as_secs_f64(),
                e.process,
                killed.map_or("was not killed".to_string(), |k| format!(
                    "was killed at {:.3} s",
                    k.as_secs_f64()
                )),
                processes.get(&e.process).map_or(0, |p| p.unsettled),
            ));
        }
    }
}

/// The share of the run's attempts answered 2xx, during faults and outside them.
fn shares(h: &History, v: &mut Verdict) {
    for a in h.attempts.iter().filter(|a| a.phase == Phase::Run) {
        let during = h
            .faults
            .iter()
            .any(|f| f.start <= a.start && a.start < f.end);
        let share = if during {
            &mut v.during_faults
        } else {
            &mut v.outside_faults
        };
        share.1 += 1;
        if a.outcome.succeeded() {
            share.0 += 1;
        }
    }
}

/// `p3 201 [Answer] 12.345-12.456 s`
fn describe(e: &Execution) -> String {
    format!(
        "p{} {} [{:?}] {:.3}-{:.3} s",
        e.process,
        e.status,
        e.act,
        e.start.as_secs_f64(),
        e.end.as_secs_f64()
    )
}

/// A key's executions and the outcomes of its attempts, for a stuck key's line.
fn story(execs: &[&Execution], atts: &[&Attempt]) -> String {
    let outcomes: Vec<String> = atts
        .iter()
        .rev()
        .take(6)
        .rev()
        .map(|a| match &a.outcome {
            Outcome::Answered {
                status, problem, ..
            } => format!(
                "{status}{} at {:.3} s",
                problem
                    .as_deref()
                    .map_or(String::new(), |p| format!(" {p}")),
                a.end.as_secs_f64()
            ),
            other => format!("{other:?} at {:.3} s", a.end.as_secs_f64()),
        })
        .collect();
    format!(
        "executions: {}; last answers: {}",
        execs
            .iter()
            .map(|e| describe(e))
            .collect::<Vec<_>>()
            .join(", "),
        outcomes.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    fn exec(key: &str, process: u32, start: f64, act: Act, body: &str) -> Execution {
        Execution {
            key: key.into(),
            process,
            start: s(start),
            end: s(start + 0.1),
            cut_short: false,
            act,
            status: if act == Act::Unavailable { 503 } else { 201 },
            body: Bytes::from(body.to_string()),
        }
    }

    fn answer(key: &str, at: f64, phase: Phase, replayed: bool, body: &str) -> Attempt {
        Attempt {
            key: key.into(),
            process: 1,
            start: s(at),
            end: s(at + 0.2),
            phase,
            outcome: Outcome::Answered {
                status: 201,
                replayed,
                problem: None,
                body: Bytes::from(body.to_string()),
            },
        }
    }

    fn refused(key: &str, at: f64, status: u16, problem: &str) -> Attempt {
        Attempt {
            outcome: Outcome::Answered {
                status,
                replayed: false,
                problem: Some(problem.into()),
                body: Bytes::from_static(b"{}"),
            },
            ..answer(key, at, Phase::Run, false, "")
        }
    }

    fn process(id: u32, killed: Option<f64>, unsettled: u64) -> Process {
        Process {
            id,
            killed: killed.map(s),
            unsettled,
        }
    }

    /// A key run once, answered, then replayed in the settle phase.
    fn clean(key: &str) -> (Vec<Execution>, Vec<Attempt>) {
        (
            vec![exec(key, 1, 1.0, Act::Answer, key)],
            vec![
                answer(key, 1.0, Phase::Run, false, key),
                answer(key, 30.0, Phase::Settle, true, key),
            ],
        )
    }

    fn history(
        keys: &[&str],
        executions: Vec<Execution>,
        attempts: Vec<Attempt>,
        processes: Vec<Process>,
    ) -> History {
        History {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            executions,
            attempts,
            processes,
            faults: Vec::new(),
            lease: s(2.0),
            upstream_timeout: s(1.0),
        }
    }

    #[test]
    fn a_clean_history_is_sound() {
        let (e, a) = clean("k");
        let v = check(&history(&["k"], e, a, vec![process(1, None, 0)]));
        assert!(v.sound(), "{:?}", v.anomalies);
        assert_eq!((v.keys, v.executions, v.attempts), (1, 1, 2));
    }

    #[test]
    fn a_second_execution_is_a_duplicate_unless_a_503_or_explained() {
        let key = "k";
        let attempts = || {
            vec![
                answer(key, 9.0, Phase::Run, false, "second"),
                answer(key, 30.0, Phase::Settle, true, "second"),
            ]
        };
        // A 503 first: released, not a duplicate.
        let execs = vec![
            exec(key, 1, 1.0, Act::Unavailable, "first"),
            exec(key, 2, 9.0, Act::Answer, "second"),
        ];
        let h = history(&[key], execs, attempts(), vec![process(1, None, 0)]);
        let v = check(&h);
        assert!(v.sound(), "{:?}", v.anomalies);
        assert_eq!(v.unavailable, 1);
        // Work done twice, nothing counted: unexplained.
        let execs = || {
            vec![
                exec(key, 1, 1.0, Act::Answer, "first"),
                exec(key, 2, 9.0, Act::Answer, "second"),
            ]
        };
        let v = check(&history(&[key], execs(), attempts(), vec![]));
        assert_eq!(v.dup_unexplained, 1, "{:?}", v.anomalies);
        assert!(!v.sound());
        assert!(v.anomalies[0].contains("process 1"), "{:?}", v.anomalies);
        // Counted unsettled by the process that ran the orphan (not by another).
        let counted = vec![process(1, None, 1), process(2, None, 0)];
        let v = check(&history(&[key], execs(), attempts(), counted));
        assert_eq!((v.dup_unsettled, v.dup_unexplained), (1, 0));
        let elsewhere = vec![process(1, None, 0), process(2, None, 5)];
        let v = check(&history(&[key], execs(), attempts(), elsewhere));
        assert_eq!((v.dup_unsettled, v.dup_unexplained), (0, 1));
        // Killed while the orphan was in flight: the crash window; killed long after: not.
        let crashed = vec![process(1, Some(1.05), 0)];
        let v = check(&history(&[key], execs(), attempts(), crashed));
        assert_eq!((v.dup_crash, v.dup_unexplained), (1, 0));
        let later = vec![process(1, Some(5.0), 0)];
        let v = check(&history(&[key], execs(), attempts(), later));
        assert_eq!((v.dup_crash, v.dup_unexplained), (0, 1));
        let mut late = execs();
        late[0].start = s(3.0);
        late[0].end = s(3.1);
        let before = vec![process(1, Some(1.5), 0)];
        let v = check(&history(&[key], late, attempts(), before));
        assert_eq!((v.dup_crash, v.dup_unexplained), (0, 1));
        // Logged just after its process died: sent before, in flight at the kill.
        let logged_late = vec![process(1, Some(0.9), 0)];
        let v = check(&history(&[key], execs(), attempts(), logged_late));
        assert_eq!((v.dup_crash, v.dup_unexplained), (1, 0));
        // A slow call the process had given up on (and counted) before the kill: the kill
        // explains nothing; killed before it gave up, it does.
        let slow = || {
            vec![
                exec(key, 1, 1.0, Act::Slow, "first"),
                exec(key, 2, 9.0, Act::Answer, "second"),
            ]
        };
        let after_timeout = || vec![process(1, Some(2.5), 0)];
        let v = check(&history(&[key], slow(), attempts(), after_timeout()));
        assert_eq!((v.dup_crash, v.dup_unexplained), (0, 1));
        // ...unless its client was still waiting for that process when it died: stalled.
        let mut waiting = attempts();
        waiting.push(Attempt {
            key: key.into(),
            process: 1,
            start: s(0.9),
            end: s(2.5),
            phase: Phase::Run,
            outcome: Outcome::Broken,
        });
        let v = check(&history(&[key], slow(), waiting.clone(), after_timeout()));
        assert_eq!((v.dup_crash, v.dup_unexplained), (1, 0));
        waiting.last_mut().unwrap().process = 2;
        let v = check(&history(&[key], slow(), waiting, after_timeout()));
        assert_eq!((v.dup_crash, v.dup_unexplained), (0, 1));
        let during = vec![process(1, Some(1.5), 0)];
        let v = check(&history(&[key], slow(), attempts(), during));
        assert_eq!((v.dup_crash, v.dup_unexplained), (1, 0));
        // Hung up on by its process before the answer was due: the kill then explains it.
        let mut cut = slow();
        cut[0].act = Act::Reset;
        cut[0].cut_short = true;
        cut[0].end = s(1.05);
        let at_the_hang_up = vec![process(1, Some(1.05), 0)];
        let v = check(&history(&[key], cut.clone(), attempts(), at_the_hang_up));
        assert_eq!((v.dup_crash, v.dup_unexplained), (1, 0));
        let long_after = vec![process(1, Some(3.0), 0)];
        let v = check(&history(&[key], cut, attempts(), long_after));
        assert_eq!((v.dup_crash, v.dup_unexplained), (0, 1));
        // Answered during a store fault: its completion is sent again until the store is back,
        // so a kill up to a lease (at least 3 s) after the fault's end explains it.
        let killed_late = || vec![process(1, Some(5.5), 0)];
        let mut h = history(&[key], execs(), attempts(), killed_late());
        let v = check(&h);
        assert_eq!((v.dup_crash, v.dup_unexplained), (0, 1));
        for store in [false, true] {
            h.faults = vec![Fault {
                kind: "pause store",
                store,
                start: s(0.5),
                end: s(3.0),
            }];
            let v = check(&h);
            let crash = usize::from(store);
            assert_eq!((v.dup_crash, v.dup_unexplained), (crash, 1 - crash));
        }
    }

    #[test]
    fn the_orphan_is_the_execution_that_is_not_the_record() {
        let key = "k";
        // The record is the first execution's answer: the second one is the orphan.
        let execs = vec![
            exec(key, 1, 1.0, Act::Answer, "first"),
            exec(key, 2, 9.0, Act::Answer, "second"),
        ];
        let attempts = vec![answer(key, 30.0, Phase::Settle, true, "first")];
        let v = check(&history(
            &[key],
            execs,
            attempts,
            vec![process(1, None, 0), process(2, None, 1)],
        ));
        assert_eq!((v.dup_unsettled, v.dup_unexplained), (1, 0));
    }

    #[test]
    fn the_unsettled_count_is_a_budget() {
        let mut execs = Vec::new();
        let mut attempts = Vec::new();
        let keys = ["a", "b", "c"];
        for (i, key) in keys.iter().enumerate() {
            execs.push(exec(key, 1, i as f64, Act::Slow, &format!("{key}1")));
            execs.push(exec(
                key,
                2,
                10.0 + i as f64,
                Act::Answer,
                &format!("{key}2"),
            ));
            attempts.push(answer(key, 30.0, Phase::Settle, true, &format!("{key}2")));
        }
        let v = check(&history(&keys, execs, attempts, vec![process(1, None, 2)]));
        assert_eq!((v.dup_unsettled, v.dup_unexplained), (2, 1));
        assert_eq!(v.unsettled, 2);
        // The count goes to the calls the upstream broke first: the line names the other one.
        let execs = vec![
            exec("a", 1, 1.0, Act::Answer, "a1"),
            exec("a", 1, 9.0, Act::Answer, "a2"),
            exec("b", 1, 2.0, Act::Reset, "b1"),
            exec("b", 1, 9.0, Act::Answer, "b2"),
        ];
        let attempts = vec![
            answer("a", 30.0, Phase::Settle, true, "a2"),
            answer("b", 30.0, Phase::Settle, true, "b2"),
        ];
        let v = check(&history(
            &["a", "b"],
            execs,
            attempts,
            vec![process(1, None, 1)],
        ));
        assert_eq!((v.dup_unsettled, v.dup_unexplained), (1, 1));
        assert!(
            v.anomalies[0].contains("a ran 2 times"),
            "{:?}",
            v.anomalies
        );
    }

    #[test]
    fn answers_are_the_bytes_of_an_execution_and_replays_the_record() {
        let key = "k";
        let (execs, mut attempts) = clean(key);
        // An answer of another key's bytes, and a 201 whose status the execution did not give.
        attempts.push(answer(key, 2.0, Phase::Run, false, "other"));
        let mut bad_status = answer(key, 3.0, Phase::Run, false, key);
        if let Outcome::Answered { status, .. } = &mut bad_status.outcome {
            *status = 200;
        }
        attempts.push(bad_status);
        let v = check(&history(&[key], execs.clone(), attempts, vec![]));
        assert_eq!(v.wrong, 2, "{:?}", v.anomalies);
        // A later replay that is another execution's answer, though the key ran it.
        let execs2 = vec![execs[0].clone(), exec(key, 2, 9.0, Act::Answer, "second")];
        let attempts = vec![
            answer(key, 5.0, Phase::Run, true, key),
            answer(key, 30.0, Phase::Settle, true, "second"),
        ];
        let v = check(&history(
            &[key],
            execs2,
            attempts,
            vec![process(2, None, 1)],
        ));
        assert_eq!(v.wrong, 1, "{:?}", v.anomalies);
        assert!(v.anomalies[0].contains("first replay"), "{:?}", v.anomalies);
        // The gateway's refusals a fault explains are no wrong bodies; another one is.
        let (execs, mut attempts) = clean(key);
        attempts.push(refused(key, 2.0, 409, "in-flight"));
        attempts.push(refused(key, 2.5, 503, "store-unavailable"));
        let v = check(&history(&[key], execs.clone(), attempts.clone(), vec![]));
        assert!(v.sound(), "{:?}", v.anomalies);
        attempts.push(refused(key, 3.0, 409, "mismatch"));
        let v = check(&history(&[key], execs, attempts, vec![]));
        assert_eq!(v.wrong, 1);
    }

    #[test]
    fn a_key_that_never_replays_after_the_faults_is_stuck() {
        let key = "k";
        let execs = vec![exec(key, 1, 1.0, Act::Answer, key)];
        let attempts = vec![
            answer(key, 1.0, Phase::Run, false, key),
            refused(key, 30.0, 409, "in-flight"),
        ];
        let mut h = history(&[key], execs, attempts, vec![]);
        h.attempts[1].phase = Phase::Settle;
        let v = check(&h);
        assert_eq!(v.stuck, 1);
        assert!(
            v.anomalies[0].contains("409 in-flight"),
            "{:?}",
            v.anomalies
        );
        // A key no client sent at all, executed: unexplained.
        let (execs, attempts) = clean("k");
        let mut h = history(&["k"], execs, attempts, vec![]);
        h.executions.push(exec("ghost", 1, 2.0, Act::Answer, "x"));
        assert_eq!(check(&h).dup_unexplained, 1);
    }

    #[test]
    fn shares_split_the_runs_attempts_by_fault() {
        let (execs, mut attempts) = clean("k");
        attempts.push(refused("k", 5.0, 503, "store-unavailable"));
        let mut h = history(&["k"], execs, attempts, vec![]);
        h.faults.push(Fault {
            kind: "pause-store",
            store: true,
            start: s(4.0),
            end: s(6.0),
        });
        let v = check(&h);
        assert_eq!(v.during_faults, (0, 1));
        assert_eq!(v.outside_faults, (1, 1));
    }
}

//! The pure limit table: properties against reference checks, and the contract's edge cases.

use std::collections::BTreeMap;
use std::time::Duration;

use lanes::limit::{Next, Released};
use lanes::{Acquire, LimitError, LimitSpec, LimitTable, Priority, WaitQueue};
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);

fn prio(level: i32, key: Option<u8>, weight: u32) -> Priority {
    let mut p = Priority::level(level).weight(weight);
    if let Some(k) = key {
        p = p.key(format!("k{k}"));
    }
    p
}

#[derive(Debug, Clone)]
enum Op {
    /// Ask for ticket (or a fresh one when `None`) at a priority.
    Acquire(Option<u8>, i32, Option<u8>, u32),
    /// Release the n-th known ticket.
    Release(usize),
    /// Grant the head on its waiter's behalf.
    GrantNext,
    /// Let time pass.
    Advance(u16),
    /// Save and load the table.
    RoundTrip,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (proptest::option::of(0u8..40), 0i32..3, proptest::option::of(0u8..3), 1u32..4)
            .prop_map(|(t, l, k, w)| Op::Acquire(t, l, k, w)),
        4 => any::<usize>().prop_map(Op::Release),
        2 => Just(Op::GrantNext),
        3 => (0u16..400).prop_map(Op::Advance),
        1 => Just(Op::RoundTrip),
    ]
}

fn spec() -> impl Strategy<Value = LimitSpec> {
    (1u32..4, proptest::option::of(1u32..50), 1u32..4).prop_map(|(c, rate, burst)| {
        let mut spec = LimitSpec::concurrent(c);
        if let Some(rate) = rate {
            spec = spec.per_second(f64::from(rate)).burst(burst);
        }
        spec
    })
}

/// Runs `ops`, checking every grant against a shadow wait queue and the limit's bounds; returns
/// the answers and the grant times.
fn run(spec: LimitSpec, ops: &[Op]) -> Result<(Vec<String>, Vec<Duration>), TestCaseError> {
    let mut table = LimitTable::with_max_waiters(64);
    table.define("l", spec).unwrap();
    let mut shadow = WaitQueue::new();
    let mut priorities: BTreeMap<u64, Priority> = BTreeMap::new();
    let mut held: Vec<u64> = Vec::new();
    let mut known: Vec<u64> = Vec::new();
    let mut now = Duration::ZERO;
    let mut fresh = 1_000u64;
    let mut answers = Vec::new();
    let mut grants = Vec::new();
    let mut last_fencing = 0;
    // Arrival number of each waiting ticket; arrival numbers granted per (level, key).
    let mut arrival: BTreeMap<u64, u64> = BTreeMap::new();
    let mut arrivals = 0u64;
    let mut granted_in_key: BTreeMap<(i32, Option<std::sync::Arc<str>>), Vec<u64>> =
        BTreeMap::new();

    let mut on_grant = |ticket: u64,
                        fencing: u64,
                        shadow: &mut WaitQueue,
                        held: &mut Vec<u64>,
                        priorities: &BTreeMap<u64, Priority>,
                        arrival: &BTreeMap<u64, u64>,
                        now: Duration|
     -> Result<(), TestCaseError> {
        // No barging: the grant is exactly what the queue serves next.
        prop_assert_eq!(shadow.pop(), Some(ticket));
        prop_assert!(held.len() < spec.concurrent as usize, "a grant over `concurrent`");
        prop_assert!(fencing > last_fencing, "fencing tokens must grow");
        last_fencing = fencing;
        held.push(ticket);
        grants.push(now);
        let p = &priorities[&ticket];
        granted_in_key.entry((p.level, p.fairness_key.clone())).or_default().push(arrival[&ticket]);
        Ok(())
    };

    for op in ops {
        match op {
            Op::Acquire(t, level, key, weight) => {
                let ticket = t.map_or_else(
                    || {
                        fresh += 1;
                        fresh
                    },
                    u64::from,
                );
                let p = prio(*level, *key, *weight);
                let was_waiting = table.is_waiting("l", ticket);
                let was_held = table.holds("l", ticket);
                let answer = match table.acquire("l", ticket, &p, now) {
                    Ok(answer) => answer,
                    Err(LimitError::TooManyWaiters { .. }) => {
                        prop_assert!(!was_waiting && !was_held);
                        prop_assert_eq!(shadow.len(), 64);
                        answers.push("full".to_owned());
                        continue;
                    }
                    Err(err) => return Err(TestCaseError::fail(err.to_string())),
                };
                if !was_waiting && !was_held {
                    shadow.push(ticket, &p);
                    priorities.insert(ticket, p.clone());
                    arrivals += 1;
                    arrival.insert(ticket, arrivals);
                    known.push(ticket);
                }
                if let Acquire::Granted(grant) = answer {
                    if was_held {
                        prop_assert!(held.contains(&ticket), "idempotent grant");
                    } else {
                        on_grant(
                            ticket,
                            grant.fencing_token,
                            &mut shadow,
                            &mut held,
                            &priorities,
                            &arrival,
                            now,
                        )?;
                    }
                } else {
                    prop_assert!(!held.contains(&ticket));
                }
                if let Acquire::RetryAt(at) = answer {
                    prop_assert!(at > now);
                    prop_assert_eq!(shadow.peek(), Some(ticket), "only the head waits for a token");
                }
                answers.push(format!("{answer:?}"));
            }
            Op::Release(i) if !known.is_empty() => {
                let ticket = known[i % known.len()];
                let released = table.release("l", ticket, now).unwrap();
                let expected = if let Some(pos) = held.iter().position(|t| *t == ticket) {
                    held.remove(pos);
                    Released::Permit
                } else if shadow.remove(ticket) {
                    Released::Withdrawn
                } else {
                    Released::Unknown
                };
                prop_assert_eq!(released, expected);
                answers.push(format!("{released:?}"));
            }
            Op::GrantNext => {
                let next = table.next("l", now).unwrap();
                match table.grant_next("l", now, None).unwrap() {
                    Some((ticket, grant)) => {
                        prop_assert_eq!(next, Some(Next::Ready(ticket)));
                        on_grant(
                            ticket,
                            grant.fencing_token,
                            &mut shadow,
                            &mut held,
                            &priorities,
                            &arrival,
                            now,
                        )?;
                    }
                    None => prop_assert!(!matches!(next, Some(Next::Ready(_)))),
                }
                answers.push(format!("{next:?}"));
            }
            Op::Advance(ms) => now += MS * u32::from(*ms),
            Op::RoundTrip => {
                let json = serde_json::to_string(&table).unwrap();
                let back: LimitTable = serde_json::from_str(&json).unwrap();
                prop_assert_eq!(&back, &table);
                table = back;
            }
            Op::Release(_) => {}
        }
        let info = table.info("l").unwrap();
        prop_assert_eq!(info.in_use as usize, held.len());
        prop_assert_eq!(info.waiting, shadow.len());
        prop_assert!(info.max_in_use <= spec.concurrent);
    }
    // Arrival order within each key.
    for (group, granted) in &granted_in_key {
        prop_assert!(granted.windows(2).all(|w| w[0] < w[1]), "arrival order within {:?}", group);
    }
    Ok((answers, grants))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Bounds, no barging, arrival order within a key, the rate bound in every window, and
    /// determinism (the same operations give the same answers, across a save and load too).
    #[test]
    fn the_table_keeps_its_contract(spec in spec(), ops in proptest::collection::vec(op(), 1..250)) {
        let (answers, grants) = run(spec, &ops)?;
        let (again, _) = run(spec, &ops)?;
        prop_assert_eq!(&answers, &again, "identical operations must give identical answers");
        if let Some(rate) = spec.per_second {
            for (i, start) in grants.iter().enumerate() {
                for (j, end) in grants.iter().enumerate().skip(i) {
                    let window = (*end - *start).as_secs_f64();
                    let count = (j - i + 1) as f64;
                    prop_assert!(
                        count <= f64::from(spec.burst) + rate * window + 1e-9,
                        "{} grants in {}s at {}/s burst {}", count, window, rate, spec.burst
                    );
                }
            }
        }
    }

    /// Weighted round-robin shares: with every key backlogged, each key's share of the grants is
    /// within ±2% of its weight's share.
    #[test]
    fn backlogged_keys_share_by_weight(weights in proptest::collection::vec(1u32..5, 2..6)) {
        let mut table = LimitTable::with_max_waiters(1_000_000);
        table.define("l", LimitSpec::concurrent(1)).unwrap();
        let now = Duration::ZERO;
        let mut ticket = 0u64;
        let mut owner = BTreeMap::new();
        // Every key stays backlogged for the whole run, and one key sends four times more
        // than the others: fairness must not follow demand.
        let total_weight: u32 = weights.iter().sum();
        let rounds = u64::from(total_weight) * 200;
        for (k, weight) in weights.iter().enumerate() {
            let count = if k == 0 { 4 * rounds } else { rounds };
            for _ in 0..count {
                ticket += 1;
                owner.insert(ticket, k);
                let p = Priority::default().key(format!("k{k}")).weight(*weight);
                table.acquire("l", ticket, &p, now).unwrap();
            }
        }
        // Ticket 1 took the only permit when it arrived.
        table.release("l", 1, now).unwrap();
        let mut counts = vec![0u64; weights.len()];
        let mut holder = None;
        for _ in 0..rounds {
            let (granted, _) = table.grant_next("l", now, None).unwrap().unwrap();
            counts[owner[&granted]] += 1;
            table.release("l", granted, now).unwrap();
            holder = Some(granted);
        }
        prop_assert!(holder.is_some());
        for (k, weight) in weights.iter().enumerate() {
            let share = counts[k] as f64 / rounds as f64;
            let expected = f64::from(*weight) / f64::from(total_weight);
            prop_assert!((share - expected).abs() <= 0.02, "key {k}: {share} vs {expected}");
        }
    }
}

#[test]
fn levels_are_served_highest_first() {
    let mut table = LimitTable::new();
    table.define("l", LimitSpec::concurrent(1)).unwrap();
    let now = Duration::ZERO;
    assert!(matches!(
        table.acquire("l", 1, &Priority::default(), now).unwrap(),
        Acquire::Granted(_)
    ));
    for (ticket, level) in [(2, 0), (3, 5), (4, -1), (5, 5)] {
        assert_eq!(
            table.acquire("l", ticket, &Priority::level(level), now).unwrap(),
            Acquire::Queued
        );
    }
    let mut order = Vec::new();
    let mut held = 1;
    for _ in 0..4 {
        table.release("l", held, now).unwrap();
        held = table.grant_next("l", now, None).unwrap().unwrap().0;
        order.push(held);
    }
    assert_eq!(order, [3, 5, 2, 4]);
}

#[test]
fn acquire_is_idempotent_and_keeps_the_first_priority() {
    let mut table = LimitTable::new();
    table.define("l", LimitSpec::concurrent(1)).unwrap();
    let now = Duration::ZERO;
    let Acquire::Granted(first) = table.acquire("l", 1, &Priority::default(), now).unwrap() else {
        panic!("granted");
    };
    assert_eq!(table.acquire("l", 1, &Priority::level(9), now).unwrap(), Acquire::Granted(first));
    assert_eq!(table.acquire("l", 2, &Priority::level(0), now).unwrap(), Acquire::Queued);
    assert_eq!(table.acquire("l", 3, &Priority::level(1), now).unwrap(), Acquire::Queued);
    // Asking again with a higher level does not re-prioritize ticket 2.
    assert_eq!(table.acquire("l", 2, &Priority::level(99), now).unwrap(), Acquire::Queued);
    table.release("l", 1, now).unwrap();
    assert_eq!(table.next("l", now).unwrap(), Some(Next::Ready(3)));
    assert_eq!(table.release("l", 42, now).unwrap(), Released::Unknown);
    assert_eq!(table.release("l", 2, now).unwrap(), Released::Withdrawn);
}

#[test]
fn the_bucket_answers_retry_at_and_never_lets_a_later_ticket_barge() {
    let mut table = LimitTable::new();
    table.define("l", LimitSpec::concurrent(10).per_second(10.0).burst(1)).unwrap();
    let t0 = Duration::from_secs(100);
    assert!(matches!(
        table.acquire("l", 1, &Priority::default(), t0).unwrap(),
        Acquire::Granted(_)
    ));
    let at = t0 + Duration::from_millis(100);
    assert_eq!(table.acquire("l", 2, &Priority::default(), t0).unwrap(), Acquire::RetryAt(at));
    // A later ticket waits behind the head even though permits are free.
    assert_eq!(table.acquire("l", 3, &Priority::default(), t0).unwrap(), Acquire::Queued);
    assert_eq!(table.acquire("l", 2, &Priority::default(), at - MS).unwrap(), Acquire::RetryAt(at));
    assert!(matches!(
        table.acquire("l", 2, &Priority::default(), at).unwrap(),
        Acquire::Granted(_)
    ));
    assert_eq!(table.next("l", at).unwrap(), Some(Next::At(3, at + Duration::from_millis(100))));
}

#[test]
fn redefinition_applies_to_the_next_grants_and_never_revokes() {
    let mut table = LimitTable::new();
    table.define("l", LimitSpec::concurrent(3)).unwrap();
    let now = Duration::ZERO;
    for t in 1..=3 {
        assert!(matches!(
            table.acquire("l", t, &Priority::default(), now).unwrap(),
            Acquire::Granted(_)
        ));
    }
    table.define("l", LimitSpec::concurrent(1)).unwrap();
    assert_eq!(table.info("l").unwrap().in_use, 3, "held permits stay held");
    assert_eq!(table.acquire("l", 4, &Priority::default(), now).unwrap(), Acquire::Queued);
    table.release("l", 1, now).unwrap();
    table.release("l", 2, now).unwrap();
    assert_eq!(table.grant_next("l", now, None).unwrap(), None, "still 1 held of a new max of 1");
    table.release("l", 3, now).unwrap();
    assert_eq!(table.grant_next("l", now, None).unwrap().map(|(t, _)| t), Some(4));
    assert_eq!(table.info("l").unwrap().max_in_use, 3);
    assert_eq!(table.info("l").unwrap().granted_total, 4);
}

#[test]
fn specs_errors_and_limits_of_the_waiting_room() {
    let mut table = LimitTable::with_max_waiters(1);
    let bad = [
        (LimitSpec::concurrent(0), "concurrent"),
        (LimitSpec::concurrent(1).per_second(0.0), "per_second"),
        (LimitSpec::concurrent(1).per_second(f64::NAN), "per_second"),
        (LimitSpec::concurrent(1).per_second(-3.0), "per_second"),
        (LimitSpec::concurrent(1).per_second(5.0).burst(0), "burst"),
    ];
    for (spec, field) in bad {
        match table.define("l", spec) {
            Err(LimitError::InvalidSpec(err)) => assert_eq!(err.field(), field),
            other => panic!("{spec:?}: {other:?}"),
        }
    }
    let now = Duration::ZERO;
    assert!(table.acquire("missing", 1, &Priority::default(), now).unwrap_err().is_unknown_limit());
    table.define("l", LimitSpec::concurrent(1)).unwrap();
    table.acquire("l", 1, &Priority::default(), now).unwrap();
    table.acquire("l", 2, &Priority::default(), now).unwrap();
    let err = table.acquire("l", 3, &Priority::default(), now).unwrap_err();
    assert_eq!(err, LimitError::TooManyWaiters { limit: "l".into(), max: 1 });
    assert!(!table.is_waiting("l", 3), "a refused ticket is not queued");
    assert_eq!(table.remove("l", now).unwrap_err(), LimitError::InUse("l".into()));
    table.release("l", 2, now).unwrap();
    table.release("l", 1, now).unwrap();
    assert_eq!(table.remove("l", now).unwrap(), LimitSpec::concurrent(1));
}

#[test]
fn leases_expire_renew_and_fence() {
    let mut table = LimitTable::new();
    table.define("l", LimitSpec::concurrent(1)).unwrap();
    let lease = Some(Duration::from_secs(3));
    let t0 = Duration::from_secs(10);
    let Acquire::Granted(first) =
        table.acquire_leased("l", 1, &Priority::default(), t0, lease).unwrap()
    else {
        panic!("granted");
    };
    assert_eq!(first.expires_at, Some(t0 + Duration::from_secs(3)));
    assert_eq!(
        table.acquire_leased("l", 2, &Priority::default(), t0, lease).unwrap(),
        Acquire::Queued
    );
    assert!(table.renew("l", 1, t0 + Duration::from_secs(2), Duration::from_secs(3)).unwrap());
    assert_eq!(table.grant_next("l", t0 + Duration::from_secs(4), lease).unwrap(), None, "renewed");
    let later = t0 + Duration::from_secs(5);
    let Some((2, second)) = table.grant_next("l", later, lease).unwrap() else {
        panic!("the expired lease let ticket 2 in");
    };
    assert!(second.fencing_token > first.fencing_token);
    assert!(
        !table.renew("l", 1, later, Duration::from_secs(3)).unwrap(),
        "ticket 1 lost its permit"
    );
    assert_eq!(table.release("l", 1, later).unwrap(), Released::Unknown);
    assert_eq!(table.next_expiry(), Some(later + Duration::from_secs(3)));
    assert_eq!(table.expire(later + Duration::from_secs(3)), [("l".to_owned(), 2)]);
}

/// The per-key view and the refusal, withdrawal and expiry counts a table reports in
/// `LimitInfo`: what the dashboard shows of fairness.
#[test]
fn info_reports_each_fairness_key_and_every_way_a_ticket_left_without_a_permit() {
    let mut table = LimitTable::new();
    table.define("api", LimitSpec::concurrent(1)).unwrap();
    let ms = Duration::from_millis;
    let a = Priority::default().key("a");
    let b = Priority::default().key("b");
    // 1 (a) holds; 2 (a), 3 (b) and 4 (b) wait from t=0.
    assert!(matches!(table.acquire("api", 1, &a, ms(0)).unwrap(), Acquire::Granted(_)));
    for (ticket, who) in [(2, &a), (3, &b), (4, &b)] {
        assert_eq!(table.acquire("api", ticket, who, ms(0)).unwrap(), Acquire::Queued);
    }
    // A try finds it busy; 4 gives up at t=5.
    assert_eq!(table.try_acquire("api", 9, ms(1), None).unwrap(), Acquire::Queued);
    assert_eq!(table.release("api", 4, ms(5)).unwrap(), Released::Withdrawn);
    // At t=10, 1 leaves and the rotation grants 2 (a); at t=30, 3 (b).
    table.release("api", 1, ms(10)).unwrap();
    assert!(matches!(table.check("api", 2, ms(10), None).unwrap(), Acquire::Granted(_)));
    table.release("api", 2, ms(30)).unwrap();
    assert!(matches!(table.check("api", 3, ms(30), None).unwrap(), Acquire::Granted(_)));
    // A leased permit that runs out.
    table.release("api", 3, ms(31)).unwrap();
    assert!(matches!(
        table.acquire_leased("api", 5, &b, ms(31), Some(ms(10))).unwrap(),
        Acquire::Granted(_)
    ));
    assert_eq!(table.release("api", 5, ms(60)).unwrap(), Released::Unknown, "expired first");
    let info = table.info("api").unwrap();
    assert_eq!((info.refused_total, info.withdrawn_total), (1, 1));
    assert_eq!(info.expired_total, 1);
    let keys: Vec<_> = info.keys.iter().map(|k| (k.key.as_deref(), k.granted, k.waiting)).collect();
    assert_eq!(keys, [(Some("a"), 2, 0), (Some("b"), 2, 0)]);
    let b_key = &info.keys[1];
    // b's grants waited 30 ms and 0 ms: the p99 is the 30 ms one (within a factor of two).
    assert!((30.0..=64.0).contains(&b_key.wait_p99_ms), "{b_key:?}");
    // The observations are not the table's state: they are not serialized.
    assert!(!serde_json::to_string(&table).unwrap().contains("refused"));
}

//! The acquire script's answer: one `u64`, as the seed's replicated limit ledger answers.
//!
//! | value | meaning |
//! |---|---|
//! | `0` | queued |
//! | `1` | the asked ticket is granted |
//! | `2 + delay` | ask again after `delay` ms (the token bucket refills then) |
//! | bit 63 set, low bits `zigzag(granted - asked)` | another ticket of the same client, the one the queue serves next, was granted instead |
//!
//! A client with several tickets waiting on one limit re-asks only for one of them: any ask
//! lets the server grant whichever of the client's tickets it serves next, so a client's
//! traffic is O(limits), not O(waiters). The script sends the value as 16 hex digits because
//! Lua numbers are doubles. A grant to the asked ticket itself travels in a shorter form: the
//! script answers it with the grant alone (`"fence:expires"`), which costs Redis less than an
//! array.

use std::time::Duration;

const REDIRECT: u64 = 1 << 63;

/// A decoded acquire answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptAnswer {
    /// The ticket waits.
    Queued,
    /// The asked ticket holds a permit.
    Granted,
    /// The asked ticket is served next; the bucket refills after this long.
    RetryAfter(Duration),
    /// This other ticket of the same client was granted instead.
    GrantedOther(u64),
}

fn zigzag(distance: i64) -> u64 {
    ((distance << 1) ^ (distance >> 63)) as u64
}

fn unzigzag(value: u64) -> i64 {
    ((value >> 1) as i64) ^ -((value & 1) as i64)
}

/// Encodes `answer` to the ticket `asked` (the script does the same in Lua).
///
/// # Panics
///
/// If a redirect's distance does not fit in 62 bits, or a delay in 62 bits of milliseconds:
/// neither can come from 53-bit tickets.
pub fn encode(asked: u64, answer: ScriptAnswer) -> u64 {
    match answer {
        ScriptAnswer::Queued => 0,
        ScriptAnswer::Granted => 1,
        ScriptAnswer::RetryAfter(delay) => {
            let ms = u64::try_from(delay.as_millis()).expect("a delay in range");
            assert!(ms < REDIRECT - 2, "delay out of range");
            2 + ms
        }
        ScriptAnswer::GrantedOther(other) => {
            let distance = i64::try_from(i128::from(other) - i128::from(asked))
                .expect("tickets within 2^63 of each other");
            let encoded = zigzag(distance);
            assert!(encoded < REDIRECT, "distance out of range");
            REDIRECT | encoded
        }
    }
}

/// Decodes the answer to the ticket `asked`.
///
/// # Errors
///
/// A redirect to a ticket outside `u64` (a corrupt answer).
pub fn decode(asked: u64, value: u64) -> Result<ScriptAnswer, String> {
    Ok(match value {
        0 => ScriptAnswer::Queued,
        1 => ScriptAnswer::Granted,
        v if v & REDIRECT == 0 => ScriptAnswer::RetryAfter(Duration::from_millis(v - 2)),
        v => {
            let distance = unzigzag(v & !REDIRECT);
            let other = i128::from(asked) + i128::from(distance);
            ScriptAnswer::GrantedOther(
                u64::try_from(other).map_err(|_| format!("answer {v:#x} points outside u64"))?,
            )
        }
    })
}

/// Decodes the script's hex form.
///
/// # Errors
///
/// Not 16 hex digits, or as for [`decode`].
pub fn decode_hex(asked: u64, hex: &str) -> Result<ScriptAnswer, String> {
    let value = u64::from_str_radix(hex, 16).map_err(|e| format!("answer {hex:?}: {e}"))?;
    decode(asked, value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Tickets are below 2^53 (21 bits of client, 32 of sequence).
    const TICKETS: u64 = 1 << 53;

    fn answers() -> impl Strategy<Value = (u64, ScriptAnswer)> {
        (0..TICKETS).prop_flat_map(|asked| {
            prop_oneof![
                Just((asked, ScriptAnswer::Queued)),
                Just((asked, ScriptAnswer::Granted)),
                (0u64..1 << 40).prop_map(move |ms| (
                    asked,
                    ScriptAnswer::RetryAfter(Duration::from_millis(ms))
                )),
                (0..TICKETS).prop_map(move |other| (asked, ScriptAnswer::GrantedOther(other))),
            ]
        })
    }

    proptest! {
        #[test]
        fn the_encoding_round_trips((asked, answer) in answers()) {
            let value = encode(asked, answer);
            prop_assert_eq!(decode(asked, value), Ok(answer));
            prop_assert_eq!(decode_hex(asked, &format!("{value:016x}")), Ok(answer));
        }

        #[test]
        fn only_redirects_set_the_top_bit((asked, answer) in answers()) {
            let redirect = matches!(answer, ScriptAnswer::GrantedOther(_));
            prop_assert_eq!(encode(asked, answer) & REDIRECT != 0, redirect);
        }
    }

    #[test]
    fn the_small_values_are_fixed() {
        assert_eq!(encode(9, ScriptAnswer::Queued), 0);
        assert_eq!(encode(9, ScriptAnswer::Granted), 1);
        assert_eq!(encode(9, ScriptAnswer::RetryAfter(Duration::from_millis(200))), 202);
        // One ticket later: zigzag(1) = 2; one earlier: zigzag(-1) = 1.
        assert_eq!(encode(9, ScriptAnswer::GrantedOther(10)), REDIRECT | 2);
        assert_eq!(encode(9, ScriptAnswer::GrantedOther(8)), REDIRECT | 1);
        assert_eq!(decode_hex(9, "8000000000000001"), Ok(ScriptAnswer::GrantedOther(8)));
        assert!(decode_hex(9, "not hex").is_err());
        assert!(decode(0, REDIRECT | 1).is_err(), "ticket -1 does not exist");
    }
}

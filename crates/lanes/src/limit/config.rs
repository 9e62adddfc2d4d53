//! The specification of a limit and its validation.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::SpecError;

/// A named limit: at most `concurrent` permits held at once, and — if `per_second` is set — at
/// most `burst + per_second × t` permits granted in any window of length `t`.
///
/// The rate is enforced with GCRA (the generic cell rate algorithm, a token bucket of `burst`
/// tokens refilled at `per_second`) in integer nanoseconds, so it is exact and deterministic.
/// A permit returned does not return its token.
///
/// # Examples
///
/// ```
/// use lanes::LimitSpec;
///
/// let stripe = LimitSpec::concurrent(10).per_second(100.0).burst(20);
/// assert!(stripe.validate().is_ok());
/// assert!(LimitSpec::concurrent(0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LimitSpec {
    /// Permits held at once; at least 1.
    pub concurrent: u32,
    /// Grants per second, finite and above zero; `None` is unlimited.
    pub per_second: Option<f64>,
    /// Grants that may happen at once after an idle period; at least 1.
    pub burst: u32,
}

impl LimitSpec {
    /// At most `concurrent` permits at once, no rate limit.
    pub const fn concurrent(concurrent: u32) -> Self {
        Self { concurrent, per_second: None, burst: 1 }
    }

    /// A pure rate limit: `per_second` grants per second (burst `max(1, ceil(per_second))`),
    /// with no bound on permits held at once.
    pub fn rate(per_second: f64) -> Self {
        Self::concurrent(u32::MAX).per_second(per_second)
    }

    /// Adds a rate limit. The burst becomes `max(1, ceil(per_second))` unless set afterwards.
    #[must_use]
    pub fn per_second(mut self, per_second: f64) -> Self {
        self.per_second = Some(per_second);
        self.burst = if per_second.is_finite() && per_second >= 1.0 {
            per_second.ceil().min(f64::from(u32::MAX)) as u32
        } else {
            1
        };
        self
    }

    /// Sets the burst.
    #[must_use]
    pub const fn burst(mut self, burst: u32) -> Self {
        self.burst = burst;
        self
    }

    /// Checks the rules of every field.
    ///
    /// # Errors
    ///
    /// A [`SpecError`] naming the field: `concurrent` of 0, a `per_second` that is not finite
    /// and above zero, a `burst` of 0.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.concurrent == 0 {
            return Err(SpecError { field: "concurrent", rule: "must be at least 1" });
        }
        if let Some(rate) = self.per_second
            && !(rate.is_finite() && rate > 0.0)
        {
            return Err(SpecError { field: "per_second", rule: "must be finite and above zero" });
        }
        if self.burst == 0 {
            return Err(SpecError { field: "burst", rule: "must be at least 1" });
        }
        Ok(())
    }

    /// The time between two grants at the sustained rate, rounded up so the rate is never
    /// exceeded; `None` without a rate limit.
    pub(crate) fn emission_interval(&self) -> Option<Duration> {
        let rate = self.per_second?;
        let nanos = 1e9 / rate;
        if nanos >= u64::MAX as f64 {
            return Some(Duration::from_nanos(u64::MAX));
        }
        // Rounded up without `f64::ceil` (a libm call on every rate check).
        let whole = nanos as u64;
        Some(Duration::from_nanos(if (whole as f64) < nanos { whole + 1 } else { whole }))
    }

    /// [`emission_interval`](Self::emission_interval) in nanoseconds for the integer GCRA
    /// ([`gcra`]): 0 without a rate, at least 1 with one.
    pub(crate) fn interval_nanos(&self) -> u64 {
        self.emission_interval()
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .max(u64::from(self.per_second.is_some()))
    }
}

/// One GCRA step in nanoseconds: a grant at `now` against a theoretical arrival time `tat`
/// that may run `tolerance` ahead of now (the burst less one token) answers the arrival time
/// after it, or the earliest time a grant conforms. Shared by the fast path's cell (which
/// commits it with a compare-and-swap) and the keyed limit's keys.
#[inline]
pub(crate) fn gcra(tat: u64, now: u64, interval: u64, tolerance: u64) -> Result<u64, u64> {
    let base = tat.max(now);
    let earliest = base.saturating_sub(tolerance);
    if earliest > now { Err(earliest) } else { Ok(base.saturating_add(interval)) }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::LimitSpec;

    #[test]
    fn the_emission_interval_is_rounded_up_so_the_rate_is_never_exceeded() {
        let interval = |rate: f64| LimitSpec::concurrent(1).per_second(rate).emission_interval();
        assert_eq!(interval(1000.0), Some(Duration::from_millis(1)), "exact stays exact");
        assert_eq!(interval(3.0), Some(Duration::from_nanos(333_333_334)));
        assert_eq!(interval(7.0), Some(Duration::from_nanos(142_857_143)));
        assert_eq!(interval(1e-12), Some(Duration::from_nanos(u64::MAX)));
        assert_eq!(LimitSpec::concurrent(1).emission_interval(), None);
        for rate in [0.5, 1.0, 3.0, 7.0, 9.99, 123.456, 1e6, 3e8] {
            let nanos = interval(rate).unwrap().as_nanos() as f64;
            assert!(nanos >= 1e9 / rate && nanos < 1e9 / rate + 1.0, "rate {rate}: {nanos}");
        }
    }
}

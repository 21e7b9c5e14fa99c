//! When a long wait at start-up says it is still waiting.
//!
//! A rank waiting for the rendezvous store or for ranks that have not
//! joined waits up to `ZRT_TIMEOUT` (300 s by default) before it fails
//! naming them. A node whose launcher was never started, or a rank that
//! crashed before it connected (neither of which any process here can
//! see), would leave the job silent all that time; PyTorch's store-based
//! barrier logs who it waits for every few seconds instead, and so does
//! zrt: first after [`FIRST`] (ranks that start normally have met by
//! then), then every [`THEN`].

use std::time::{Duration, Instant};

/// How long a wait goes on before it first says so.
pub(crate) const FIRST: Duration = Duration::from_secs(10);
/// How often it says so after that.
pub(crate) const THEN: Duration = Duration::from_secs(30);

/// The clock of one wait's reports.
#[derive(Debug)]
pub(crate) struct StillWaiting {
    began: Instant,
    /// Time from `began` at which the next report is due.
    next: Duration,
    then: Duration,
}

impl StillWaiting {
    /// Reports after [`FIRST`], then every [`THEN`], from now.
    pub(crate) fn new() -> Self {
        Self::every(FIRST, THEN)
    }

    /// Reports after `first`, then every `then`, from now (tests use
    /// milliseconds).
    pub(crate) fn every(first: Duration, then: Duration) -> Self {
        Self {
            began: Instant::now(),
            next: first,
            // A zero period would report on every poll.
            then: then.max(Duration::from_millis(1)),
        }
    }

    /// How long until the next report is due (zero when it is).
    pub(crate) fn until_due(&self) -> Duration {
        (self.began + self.next).saturating_duration_since(Instant::now())
    }

    /// The time waited so far when a report is due (and the next one is
    /// then a period from now, so reports never come closer than that,
    /// however late the caller looked), else `None`.
    pub(crate) fn due(&mut self) -> Option<Duration> {
        let waited = self.began.elapsed();
        if waited < self.next {
            return None;
        }
        self.next = waited + self.then;
        Some(waited)
    }
}

/// Test helper: at least two reports were said (each with when), each
/// about a period (`period`, less 10 ms) after the one before.
#[cfg(test)]
pub(crate) fn assert_a_period_apart(said: &[(Instant, String)], period: Duration) {
    assert!(said.len() >= 2, "{said:#?}");
    for pair in said.windows(2) {
        assert!(
            pair[1].0 - pair[0].0 >= period - Duration::from_millis(10),
            "{said:#?}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_come_first_after_the_first_delay_then_once_a_period() {
        let ms = Duration::from_millis;
        // Long periods, so that a slow machine's pauses between the
        // calls below cannot reach them.
        let mut w = StillWaiting::every(ms(300), ms(60_000));
        assert_eq!(w.due(), None);
        assert!(w.until_due() <= ms(300), "{:?}", w.until_due());
        std::thread::sleep(ms(310));
        assert_eq!(w.until_due(), Duration::ZERO);
        assert!(w.due().is_some_and(|t| t >= ms(300)));
        // Reported: the next one is a period from now, not due at once.
        assert_eq!(w.due(), None);
        assert!(w.until_due() > ms(59_000), "{:?}", w.until_due());
        // A caller that looks late gets one report, and the next a period
        // after it, not one per period it missed.
        // (On a grid of periods from the start the next would be 100 ms
        // away here.)
        let mut w = StillWaiting::every(ms(0), ms(200));
        std::thread::sleep(ms(700));
        assert!(w.due().is_some_and(|t| t >= ms(700)));
        assert_eq!(w.due(), None);
        assert!(w.until_due() > ms(150), "{:?}", w.until_due());
        assert_eq!(StillWaiting::every(ms(0), ms(0)).then, ms(1));
    }
}

//! The handle an asynchronous collective returns.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use crate::worker::Ticket;
use crate::CommError;

/// What a wait lasts when `ZRT_TIMEOUT` is not set.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a wait lasts unless told otherwise: `ZRT_TIMEOUT` seconds, else
/// 300. A value that is not a positive number of seconds is refused by
/// [`init_from_env`](crate::init_from_env); here (threads of the local
/// backend, waits without a group) it is logged once and 300 s used.
pub fn default_timeout() -> Duration {
    timeout_from_env().unwrap_or_else(|why| {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!("{why}; waiting {} s", DEFAULT_TIMEOUT.as_secs()));
        DEFAULT_TIMEOUT
    })
}

/// `ZRT_TIMEOUT` as a duration (300 s when unset or empty), or what is
/// wrong with it.
pub(crate) fn timeout_from_env() -> Result<Duration, String> {
    parse_timeout(std::env::var("ZRT_TIMEOUT").ok().as_deref())
}

fn parse_timeout(v: Option<&str>) -> Result<Duration, String> {
    let Some(v) = v.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(DEFAULT_TIMEOUT);
    };
    v.parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            format!("ZRT_TIMEOUT={v:?} is not a positive number of seconds (e.g. ZRT_TIMEOUT=600)")
        })
}

/// The instant `timeout` from now, or a century from now when the clock
/// cannot count that far (`Instant + Duration` panics on overflow, and
/// `ZRT_TIMEOUT=1e19` or a caller's `Duration::MAX` mean "wait long").
/// Every wait of the collectives, and the launcher's grace, ends here.
pub fn deadline_in(timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    // A century always fits (the clock counts seconds in an i64); the
    // fallback only keeps this free of a panic path.
    now.checked_add(timeout.min(CENTURY)).unwrap_or(now)
}

/// How much longer [`Work::wait`] waits than the backends' own timeout:
/// they look at their deadline at least every 50 ms.
const WAIT_MARGIN: Duration = Duration::from_millis(500);

/// A pending collective. Dropping it does not cancel the operation (every
/// rank must still complete it); it only discards the result.
#[must_use = "a collective's result (and its error) is only seen through wait()"]
pub struct Work<T> {
    wait: Box<dyn FnOnce(Duration) -> Result<T, CommError> + Send>,
    done: Box<dyn Fn() -> bool + Send>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("done", &(self.done)())
            .finish()
    }
}

impl<T: Send + 'static> Work<T> {
    /// A handle whose result arrives on `rx`.
    pub(crate) fn new(rx: Receiver<Result<T, CommError>>, group: &str, call: String) -> Self {
        let probe = rx.clone();
        let group = group.to_string();
        Self {
            wait: Box::new(move |timeout| match rx.recv_timeout(timeout) {
                Ok(r) => r,
                Err(RecvTimeoutError::Timeout) => Err(CommError::Timeout {
                    group,
                    call,
                    timeout,
                    waiting_for: Vec::new(),
                }),
                Err(RecvTimeoutError::Disconnected) => Err(CommError::Closed { group, call }),
            }),
            done: Box::new(move || !probe.is_empty()),
        }
    }

    /// This handle, its operation run by the waiting thread when the group's
    /// worker has not started it and it is next in the group's order (see
    /// [`crate::worker`]). Only a wait as long as the operation's own
    /// deadline ([`Work::wait`]) does so: running it cannot be cut short,
    /// and a shorter [`Work::wait_timeout`] must return when it says.
    pub(crate) fn runnable_by_waiter(self, ticket: std::sync::Arc<Ticket>) -> Self {
        let wait = self.wait;
        Self {
            wait: Box::new(move |timeout| {
                if timeout >= default_timeout() {
                    ticket.run_here();
                }
                wait(timeout)
            }),
            done: self.done,
        }
    }

    /// A handle that is already complete with `r`.
    pub(crate) fn ready(r: Result<T, CommError>, group: &str, call: String) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _ = tx.send(r);
        Self::new(rx, group, call)
    }

    /// The same operation, its result passed through `f` when waited for
    /// (how the in-place collectives are built on the out-of-place ones).
    pub fn map<U: Send + 'static>(self, f: impl FnOnce(T) -> U + Send + 'static) -> Work<U> {
        let wait = self.wait;
        Work {
            wait: Box::new(move |timeout| wait(timeout).map(f)),
            done: self.done,
        }
    }
}

impl<T> Work<T> {
    /// Whether the result is ready (`wait` will not block).
    pub fn is_done(&self) -> bool {
        (self.done)()
    }

    /// Blocks until the operation completes, at most [`default_timeout`]
    /// and a short margin. The backends time every wait of an operation out
    /// after the same timeout, from when the operation started, and their
    /// error names the ranks that did not arrive; the margin lets that
    /// error, rather than this wait's own, reach the caller.
    pub fn wait(self) -> Result<T, CommError> {
        self.wait_timeout(default_timeout() + WAIT_MARGIN)
    }

    /// Blocks until the operation completes or `timeout` passes.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T, CommError> {
        (self.wait)(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_seconds_and_anything_else_is_named() {
        assert_eq!(parse_timeout(None), Ok(DEFAULT_TIMEOUT));
        assert_eq!(parse_timeout(Some(" ")), Ok(DEFAULT_TIMEOUT));
        assert_eq!(parse_timeout(Some("600")), Ok(Duration::from_secs(600)));
        assert_eq!(parse_timeout(Some("0.5")), Ok(Duration::from_millis(500)));
        for bad in ["30s", "abc", "0", "-5", "inf", "NaN", "1e400"] {
            let e = parse_timeout(Some(bad)).unwrap_err();
            assert!(
                e.contains(&format!("ZRT_TIMEOUT={bad:?}"))
                    && e.contains("positive number of seconds"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_deadline_past_the_clocks_end_is_a_century_away() {
        // Bounded by the instants before and after the call, so a machine
        // that stalls between two lines cannot fail it.
        let century = Duration::from_secs(100 * 365 * 24 * 3600);
        for (timeout, lasts) in [
            (Duration::MAX, century),
            (Duration::from_secs_f64(1e19), century),
            (Duration::from_secs(5), Duration::from_secs(5)),
        ] {
            let before = Instant::now();
            let d = deadline_in(timeout);
            let after = Instant::now();
            assert!(before + lasts <= d && d <= after + lasts, "{timeout:?}");
        }
    }
}

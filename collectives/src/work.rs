//! The handle an asynchronous collective returns.

use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};

use crate::CommError;

/// How long a wait lasts unless told otherwise: `ZRT_TIMEOUT` seconds, else 300.
pub fn default_timeout() -> Duration {
    std::env::var("ZRT_TIMEOUT")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0 && s.is_finite())
        .map_or(Duration::from_secs(300), Duration::from_secs_f64)
}

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

    /// Blocks until the operation completes, at most [`default_timeout`].
    pub fn wait(self) -> Result<T, CommError> {
        self.wait_timeout(default_timeout())
    }

    /// Blocks until the operation completes or `timeout` passes.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T, CommError> {
        (self.wait)(timeout)
    }
}

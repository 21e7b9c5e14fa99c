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
#[derive(Debug)]
pub struct Work<T> {
    rx: Receiver<Result<T, CommError>>,
    group: String,
    call: String,
}

impl<T> Work<T> {
    /// A handle whose result arrives on `rx`.
    pub(crate) fn new(rx: Receiver<Result<T, CommError>>, group: &str, call: String) -> Self {
        Self {
            rx,
            group: group.to_string(),
            call,
        }
    }

    /// A handle that is already complete with `r`.
    pub(crate) fn ready(r: Result<T, CommError>, group: &str, call: String) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _ = tx.send(r);
        Self::new(rx, group, call)
    }

    /// Whether the result is ready (`wait` will not block).
    pub fn is_done(&self) -> bool {
        !self.rx.is_empty()
    }

    /// Blocks until the operation completes, at most [`default_timeout`].
    pub fn wait(self) -> Result<T, CommError> {
        self.wait_timeout(default_timeout())
    }

    /// Blocks until the operation completes or `timeout` passes.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T, CommError> {
        match self.rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(CommError::Timeout {
                group: self.group,
                call: self.call,
                timeout,
                waiting_for: Vec::new(),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(CommError::Closed {
                group: self.group,
                call: self.call,
            }),
        }
    }
}

//! Where a step's wall-clock time goes (DeepSpeed's `wall_clock_breakdown`).

use std::time::{Duration, Instant};

/// One optimizer step's time, split as DeepSpeed's `wall_clock_breakdown`
/// splits it. Summed over the step's micro-steps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepBreakdown {
    /// From the end of the previous engine call to `backward`: the forward
    /// pass (and whatever else the program did, such as loading data).
    pub forward: Duration,
    /// Inside `backward`, including waiting for its reductions.
    pub backward: Duration,
    /// Blocked on communication: gathers (forward and backward), the
    /// backward's reductions, the step's norm and parameter gathers. Part of
    /// the three other figures.
    pub comm_wait: Duration,
    /// Inside `step()` (gradient norm, Adam, sharing the updated shards).
    pub optimizer: Duration,
}

/// The engine's running account.
pub(super) struct Timing {
    /// When the last engine call returned.
    since: Instant,
    cur: StepBreakdown,
    pub(super) last: Option<StepBreakdown>,
}

impl Timing {
    pub(super) fn new() -> Self {
        Self {
            since: Instant::now(),
            cur: StepBreakdown::default(),
            last: None,
        }
    }

    /// `backward` starts: the time since the last call was forward.
    pub(super) fn backward_starts(&mut self) -> Instant {
        let now = Instant::now();
        self.cur.forward += now - self.since;
        now
    }

    pub(super) fn backward_ends(&mut self, started: Instant) {
        self.since = Instant::now();
        self.cur.backward += self.since - started;
    }

    pub(super) fn waited(&mut self, d: Duration) {
        self.cur.comm_wait += d;
    }

    /// `step()` ends at an optimizer step: closes the account (and logs it
    /// when `log`).
    pub(super) fn step_ends(&mut self, started: Instant, log: bool, step: u64) {
        self.since = Instant::now();
        self.cur.optimizer += self.since - started;
        let b = std::mem::take(&mut self.cur);
        if log {
            // Tenths of a millisecond: what a reader compares, and no
            // float noise (84.886356999) in the line.
            let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
            tracing::info!(
                "wall clock breakdown, step {step} (ms): forward {} | backward {} | waiting for communication {} | optimizer {}",
                ms(b.forward),
                ms(b.backward),
                ms(b.comm_wait),
                ms(b.optimizer),
            );
        }
        self.last = Some(b);
    }

    /// `step()` returned without stepping (off the boundary).
    pub(super) fn call_ends(&mut self) {
        self.since = Instant::now();
    }
}

/// Runs `f`, adding its duration to `timing`'s communication wait.
pub(super) fn waiting<T>(timing: &mut Timing, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    timing.waited(t.elapsed());
    r
}

//! DeepSpeed's flops profiler: one step's forward multiply-accumulates,
//! its latencies and the FLOPS they make, on the first rank.
//!
//! What DeepSpeed counts by patching torch's functionals, zrt counts as
//! libtorch runs the operators ([`glue::count_macs`]): the matrix
//! products (linear, matmul, attention, and mm, addmm, bmm, baddbmm
//! called directly), each once. Not
//! the elementwise work (norms, activations, softmax outside a fused
//! kernel), which DeepSpeed adds to its flops and which is a few percent
//! of a transformer's. As in DeepSpeed, the backward's flops are taken
//! as twice the forward's (plus what `recompute_fwd_factor` says it
//! recomputes), its latency measured.
//!
//! Counting runs on the thread that calls the engine (the one that steps,
//! runs the forward and calls `backward`), from the end of the step
//! before the profiled one to the profiled step's end, paused inside
//! `backward`; each unit's forward is counted between its wrapper's hooks.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::config::FlopsProfilerConfig;
use crate::glue;
use crate::EngineError;

use super::StepBreakdown;

/// One unit's forwards in the profiled step.
#[derive(Clone, Copy, Default)]
struct UnitCount {
    macs: u64,
    time: Duration,
    forwards: u64,
}

/// The profile of the step being profiled.
pub(super) struct FlopsProfile {
    units: Vec<UnitCount>,
    /// Unit forwards under way: (unit, multiply-accumulates then, start).
    open: Vec<(usize, u64, Instant)>,
    /// The forward's multiply-accumulates so far.
    forward: u64,
    /// The count when the current forward phase began (`None` inside a
    /// backward).
    since: Option<u64>,
}

impl FlopsProfile {
    /// Starts counting on this thread, a forward phase begun.
    pub(super) fn start(units: usize) -> Result<Self, EngineError> {
        glue::count_macs(true)?;
        Ok(Self {
            units: vec![UnitCount::default(); units],
            open: Vec::new(),
            forward: 0,
            since: Some(glue::macs_counted()),
        })
    }

    /// A backward begins: the forward phase ends.
    pub(super) fn pause(&mut self) {
        if let Some(s) = self.since.take() {
            self.forward += glue::macs_counted().saturating_sub(s);
        }
    }

    /// A backward ended: the next forward phase begins.
    pub(super) fn resume(&mut self) {
        if self.since.is_none() {
            self.since = Some(glue::macs_counted());
        }
    }

    /// Unit `unit`'s forward begins (not a recompute inside a backward).
    pub(super) fn unit_begins(&mut self, unit: usize) {
        if self.since.is_some() {
            self.open.push((unit, glue::macs_counted(), Instant::now()));
        }
    }

    /// Unit `unit`'s forward ended.
    pub(super) fn unit_ends(&mut self, unit: usize) {
        let Some(k) = self.open.iter().rposition(|(u, ..)| *u == unit) else {
            return;
        };
        let (_, macs, started) = self.open.remove(k);
        if let Some(c) = self.units.get_mut(unit) {
            c.macs += glue::macs_counted().saturating_sub(macs);
            c.time += started.elapsed();
            c.forwards += 1;
        }
    }

    /// Stops counting; the report of the step, given its breakdown.
    pub(super) fn finish(mut self, step: &Step<'_>) -> Result<String, EngineError> {
        self.pause();
        glue::count_macs(false)?;
        Ok(report(&self, step))
    }
}

impl Drop for FlopsProfile {
    fn drop(&mut self) {
        // An engine dropped mid-profile, on the thread that counts (where
        // programs drop their engines), leaves it not counting. Dropped
        // on another thread, the counting thread goes on counting (and
        // every operator call in the process through the callback): the
        // flag is that thread's own.
        let _ = glue::count_macs(false);
    }
}

/// What the report says about the profiled step besides its counts.
pub(super) struct Step<'a> {
    pub(super) number: u64,
    pub(super) cfg: &'a FlopsProfilerConfig,
    pub(super) world: usize,
    pub(super) micro_batch: u64,
    pub(super) gas: u64,
    /// Each unit's name and trainable elements.
    pub(super) units: Vec<(String, usize)>,
    pub(super) time: StepBreakdown,
}

/// `n` with a unit prefix, as DeepSpeed prints counts (`12.34 G`).
fn si(n: f64) -> String {
    let (v, p) = match n.abs() {
        x if x >= 1e12 => (n / 1e12, " T"),
        x if x >= 1e9 => (n / 1e9, " G"),
        x if x >= 1e6 => (n / 1e6, " M"),
        x if x >= 1e3 => (n / 1e3, " K"),
        _ => (n, " "),
    };
    format!("{v:.2}{p}")
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// `flops` over `d` as FLOPS.
fn rate(flops: f64, d: Duration) -> String {
    match d.as_secs_f64() {
        s if s > 0.0 => format!("{}FLOPS", si(flops / s)),
        _ => "-".into(),
    }
}

fn report(p: &FlopsProfile, s: &Step<'_>) -> String {
    let t = &s.time;
    let fwd = p.forward as f64 * 2.0;
    let bwd_factor = 2.0 + s.cfg.recompute_fwd_factor;
    let iter = t.forward + t.backward + t.optimizer;
    let params: usize = s.units.iter().map(|(_, n)| n).sum();
    let samples = (s.micro_batch * s.gas) as f64;
    let mut r = String::new();
    let mut line = |k: &str, v: String| {
        let _ = writeln!(r, "{k:<60}{v}");
    };
    line(
        "flops profiler, step:",
        format!(
            "{} (matrix products counted; MACs: multiply-accumulates, flops = 2 MACs)",
            s.number
        ),
    );
    line("world size:", s.world.to_string());
    line("data parallel size:", s.world.to_string());
    line(
        "micro-batch per rank x accumulation steps:",
        format!("{} x {}", s.micro_batch, s.gas),
    );
    line("params of model:", si(params as f64));
    line(
        "fwd MACs per rank:",
        format!("{}MACs", si(p.forward as f64)),
    );
    line("fwd flops per rank:", si(fwd));
    line("fwd latency:", ms(t.forward));
    line("bwd latency:", ms(t.backward));
    line("step latency:", ms(t.optimizer));
    line("iter latency:", ms(iter));
    line(
        "fwd FLOPS per rank = fwd flops / fwd latency:",
        rate(fwd, t.forward),
    );
    line(
        &format!("bwd FLOPS per rank = {bwd_factor} x fwd flops / bwd latency:"),
        rate(bwd_factor * fwd, t.backward),
    );
    line(
        &format!(
            "fwd+bwd FLOPS per rank = {} x fwd flops / (fwd+bwd latency):",
            bwd_factor + 1.0
        ),
        rate((bwd_factor + 1.0) * fwd, t.forward + t.backward),
    );
    line("iter FLOPS per rank:", rate((bwd_factor + 1.0) * fwd, iter));
    line(
        "samples/second per rank:",
        match iter.as_secs_f64() {
            x if x > 0.0 => format!("{:.2}", samples / x),
            _ => "-".into(),
        },
    );
    // The units, and what ran outside them (embeddings' neighbours, the
    // loss, the root's own layers).
    let in_units: u64 = p.units.iter().map(|c| c.macs).sum();
    let mut rows: Vec<(String, usize, UnitCount)> = (s.units.iter().zip(&p.units))
        .map(|((n, e), c)| (n.clone(), *e, *c))
        .collect();
    let outside = p.forward.saturating_sub(in_units);
    let share = |m: u64| match p.forward {
        0 => 0.0,
        f => 100.0 * m as f64 / f as f64,
    };
    let top = s.cfg.top_modules.max(1) as usize;
    let mut by_macs = rows.clone();
    by_macs.sort_by(|a, b| b.2.macs.cmp(&a.2.macs).then(a.0.cmp(&b.0)));
    let mut by_time = rows.clone();
    by_time.sort_by(|a, b| b.2.time.cmp(&a.2.time).then(a.0.cmp(&b.0)));
    let names = |v: &[(String, usize, UnitCount)], f: &dyn Fn(&UnitCount) -> String| {
        (v.iter().take(top))
            .map(|(n, _, c)| format!("`{n}` {}", f(c)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    line(
        "top units by MACs:",
        names(&by_macs, &|c| format!("{}MACs", si(c.macs as f64))),
    );
    line(
        "top units by fwd latency:",
        names(&by_time, &|c| ms(c.time)),
    );
    if s.cfg.detailed {
        rows.push((
            "(outside the units)".into(),
            0,
            UnitCount {
                macs: outside,
                ..Default::default()
            },
        ));
        for (name, elems, c) in rows {
            let _ = writeln!(
                r,
                "  {name:<24} params {:>10}  MACs {:>12} ({:5.1}%)  fwd latency {:>10} over {} forward(s)",
                si(elems as f64),
                format!("{}MACs", si(c.macs as f64)),
                share(c.macs),
                ms(c.time),
                c.forwards,
            );
        }
    }
    r
}

impl<G: zrt_collectives::ProcessGroup + 'static> super::Inner<G> {
    /// Whether this rank profiles (`flops_profiler` on, the first rank).
    fn profiles(&self) -> bool {
        self.cfg.config.flops_profiler.enabled && self.first_rank()
    }

    /// Unit `unit`'s forward begins (`true`) or ends, under a profile.
    pub(super) fn flops_unit(&self, unit: usize, begins: bool) {
        if !self.profiles() {
            return;
        }
        if let Some(p) = self.flops.lock().as_mut() {
            match begins {
                true => p.unit_begins(unit),
                false => p.unit_ends(unit),
            }
        }
    }

    /// `backward` ends the forward phase (`false`) or, returning, lets
    /// the next begin (`true`), under a profile.
    pub(super) fn flops_phase(&self, forward: bool) {
        if !self.profiles() {
            return;
        }
        if let Some(p) = self.flops.lock().as_mut() {
            match forward {
                true => p.resume(),
                false => p.pause(),
            }
        }
    }

    /// A step ended (or the engine was built, `st.step` 0): reports the
    /// profiled step, or starts profiling the next one once
    /// `profile_step` steps have ended.
    pub(super) fn flops_step_ended(&self, st: &super::State) {
        if !self.profiles() {
            return;
        }
        let c = &self.cfg.config.flops_profiler;
        let mut slot = self.flops.lock();
        if let Some(p) = slot.take() {
            let step = Step {
                number: st.step,
                cfg: c,
                world: self.group.size() * self.replicate.as_ref().map_or(1, |r| r.size()),
                micro_batch: self.cfg.batch.micro,
                gas: self.cfg.batch.gas,
                units: (st.units.iter())
                    .map(|u| (u.name.clone(), u.layout.slots.iter().map(|s| s.numel).sum()))
                    .collect(),
                time: st.timing.last.unwrap_or_default(),
            };
            match p.finish(&step) {
                Ok(text) => self.flops_report(&text),
                Err(e) => tracing::warn!("flops profiler: {e}"),
            }
        } else if st.step == c.profile_step {
            match FlopsProfile::start(st.units.len()) {
                Ok(p) => *slot = Some(p),
                Err(e) => tracing::warn!("flops profiler: {e}"),
            }
        }
    }

    /// Writes the report to `output_file`, or logs it.
    fn flops_report(&self, text: &str) {
        match &self.cfg.config.flops_profiler.output_file {
            Some(path) => {
                if let Err(e) = std::fs::write(path, text) {
                    tracing::warn!(
                        "flops profiler: cannot write {} ({e}); the report:\n{text}",
                        path.display()
                    );
                }
            }
            None => {
                for line in text.lines() {
                    tracing::info!("{line}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_with_deepspeeds_prefixes() {
        assert_eq!(si(3_139_930_000_000.0), "3.14 T");
        assert_eq!(si(6_279_860_000.0), "6.28 G");
        assert_eq!(si(12.0), "12.00 ");
        assert_eq!(rate(2e9, Duration::from_millis(500)), "4.00 GFLOPS");
        assert_eq!(rate(2e9, Duration::ZERO), "-");
    }
}

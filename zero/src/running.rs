//! Which units a checkpointed segment's recompute accumulates gradients for.
//!
//! A unit's reduction starts once each of its parameters has its gradient,
//! and at stage 3 the unit is freed then. Inside a checkpointed segment
//! that is not enough: each run of a segment accumulates its parameters'
//! gradients in a backward of its own, so a unit run twice (shared layers)
//! whose checkpoint covers part of it has every parameter's gradient after
//! the second run's recompute and the plain part's backward, while the
//! first run's recompute, still to come, reads the unit's parameters and
//! adds to their gradients. The engine must wait for it.
//!
//! So each segment is told to the engine when its first forward runs with
//! the units it may touch: those whose forward is running around it on
//! this thread (a checkpoint inside a unit) and those whose forward runs
//! inside it (a checkpoint around units). The engine holds their
//! reductions until the segment's recompute has accumulated, or until its
//! graph is dropped without one ([`SegmentTrack`]).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use crate::plan::UnitHook;

/// Units of one engine (its hook), by index.
pub(crate) type UnitsOf = (Arc<dyn UnitHook>, Vec<usize>);

/// One unit of one engine.
type UnitOf = (Arc<dyn UnitHook>, usize);

thread_local! {
    /// The units whose forward is running on this thread, innermost last.
    static RUNNING: RefCell<Vec<UnitOf>> = const { RefCell::new(Vec::new()) };
    /// For each checkpointed segment whose first forward is running on this
    /// thread, the units whose forward ran inside it so far.
    static RECORDING: RefCell<Vec<Vec<UnitOf>>> = const { RefCell::new(Vec::new()) };
}

/// A unit's forward running on this thread, until dropped.
pub(crate) struct Running(());

impl Running {
    /// Unit `unit` of the engine behind `hook` starts its forward: it runs
    /// around any segment that starts before this is dropped, and inside
    /// every segment whose first forward is running.
    pub(crate) fn enter(hook: Arc<dyn UnitHook>, unit: usize) -> Self {
        RECORDING.with(|r| {
            for seen in r.borrow_mut().iter_mut() {
                seen.push((hook.clone(), unit));
            }
        });
        RUNNING.with(|r| r.borrow_mut().push((hook, unit)));
        Running(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.with(|r| r.borrow_mut().pop());
    }
}

/// Pops the recorder `segment_units` pushed, even when `f` unwinds.
struct Recording;

impl Drop for Recording {
    fn drop(&mut self) {
        RECORDING.with(|r| r.borrow_mut().pop());
    }
}

/// Runs a segment's first forward `f`, and returns its result with the
/// units the segment may touch, grouped by engine: those running around it
/// and those run inside it.
pub(crate) fn segment_units<R>(f: impl FnOnce() -> R) -> (R, Vec<UnitsOf>) {
    let mut units = RUNNING.with(|r| r.borrow().clone());
    RECORDING.with(|r| r.borrow_mut().push(Vec::new()));
    let out = {
        let _recording = Recording;
        let out = f();
        units.extend(RECORDING.with(|r| r.borrow().last().cloned().unwrap_or_default()));
        out
    };
    let mut grouped: Vec<UnitsOf> = Vec::new();
    for (hook, unit) in units {
        match grouped
            .iter_mut()
            .find(|(h, _)| std::ptr::addr_eq(Arc::as_ptr(h), Arc::as_ptr(&hook)))
        {
            Some((_, us)) if us.contains(&unit) => {}
            Some((_, us)) => us.push(unit),
            None => grouped.push((hook, vec![unit])),
        }
    }
    (out, grouped)
}

/// One checkpointed segment as the engines see it: told when its first
/// forward made a graph that may recompute it ([`SegmentTrack::begin`]),
/// when a backward recomputed it and accumulated its gradients
/// ([`SegmentTrack::recomputed`]), and, if that never counted, when its
/// graph is dropped (the last reference goes).
#[derive(Default)]
pub(crate) struct SegmentTrack {
    /// The engines' units it holds, until it ends.
    units: Mutex<Option<Vec<UnitsOf>>>,
}

impl SegmentTrack {
    /// The segment's graph exists: each engine holds the reductions of
    /// `units` until it ends.
    pub(crate) fn begin(&self, units: Vec<UnitsOf>) {
        // Held here first: what an engine is told, the drop undoes.
        let Ok(mut held) = self.units.lock() else {
            return;
        };
        for (hook, us) in &units {
            hook.segment_begins(us);
        }
        *held = Some(units);
    }

    /// A backward recomputed the segment and accumulated its gradients.
    /// An engine whose backward keeps its graph may see the segment again
    /// (another backward through it) and keeps holding it.
    pub(crate) fn recomputed(&self) {
        let Ok(mut held) = self.units.lock() else {
            return;
        };
        if let Some(units) = held.as_mut() {
            units.retain(|(hook, us)| !hook.segment_recomputed(us));
        }
    }
}

impl Drop for SegmentTrack {
    fn drop(&mut self) {
        let held = match self.units.get_mut() {
            Ok(held) => held.take(),
            Err(e) => e.into_inner().take(),
        };
        for (hook, us) in held.into_iter().flatten() {
            hook.segment_dropped(&us);
        }
    }
}

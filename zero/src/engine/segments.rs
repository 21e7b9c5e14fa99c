//! The checkpointed segments each unit's reduction waits for.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Per unit, the checkpointed segments that may touch it (see
/// [`crate::running`]) and that no backward has recomputed yet: its
/// reduction waits for them, since each one's recompute adds to its
/// gradients. Atomic, outside the engine's lock: a segment whose graph is
/// dropped says so wherever the graph's last tensor goes, the engine's
/// own code (holding that lock) included. A segment whose graph is kept
/// without a backward through it holds its units until it is dropped; the
/// end of a backward reduces whatever was held.
pub(super) struct Segments {
    held: Vec<AtomicUsize>,
    /// Stage 3: the root unit, when it holds small parameters moved out
    /// of the other units (`stage3_param_persistence_threshold`), which
    /// their segments touch too.
    root_of_moved: Option<usize>,
}

impl Segments {
    /// No segment holds any of `units` units yet.
    pub(super) fn new(units: usize, root_of_moved: Option<usize>) -> Self {
        Self {
            held: (0..units).map(|_| AtomicUsize::new(0)).collect(),
            root_of_moved,
        }
    }

    /// The units a segment that may touch `units` holds.
    fn of(&self, units: &[usize]) -> Vec<usize> {
        let mut all: Vec<usize> = units
            .iter()
            .copied()
            .filter(|&k| k < self.held.len())
            .collect();
        if let Some(root) = self.root_of_moved {
            if !all.contains(&root) {
                all.push(root);
            }
        }
        all
    }

    /// How many segments hold unit `k`.
    pub(super) fn held(&self, k: usize) -> usize {
        self.held.get(k).map_or(0, |h| h.load(Ordering::Acquire))
    }

    /// A segment that may touch `units` begins to hold them.
    pub(super) fn hold(&self, units: &[usize]) {
        for k in self.of(units) {
            self.held[k].fetch_add(1, Ordering::AcqRel);
        }
    }

    /// That segment ended: the units it held.
    pub(super) fn release(&self, units: &[usize]) -> Vec<usize> {
        let all = self.of(units);
        for &k in &all {
            let _ = self.held[k]
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        all
    }
}

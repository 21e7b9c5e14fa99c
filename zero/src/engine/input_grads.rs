//! Stage 3: which forwards through a unit still wait for the gradient of
//! their input.
//!
//! A unit that computes no parameter gradient in a backward (frozen, or a
//! backward that asks for input gradients only), or one with frozen
//! matrices that compute its input's gradient after its last trained one,
//! is freed when the gradient of its input arrives (see
//! `Inner::input_grad_ready`). A unit run twice in one forward waits for
//! both runs' input gradients, so each forward with autograd on takes a
//! [`Ticket`] and the unit is freed when none is open.
//!
//! A forward whose graph is dropped without a backward (an evaluation that
//! forgot `no_grad`) must not leave its ticket open: the next backward
//! would keep the unit gathered to its end, and with a frozen base that is
//! the whole model gathered at once. The ticket lives in the hook
//! registered on the input, which autograd drops with the graph: its
//! `Drop` closes it. The end of a backward also forgets every ticket
//! (`reset`, a new epoch), so one whose graph outlives it (a loss kept for
//! logging) cannot close a later forward's count.
//!
//! The counts sit behind their own lock, not the engine's state: a graph
//! can be dropped on any thread, while that thread holds the state's lock
//! too (a hook that failed to register is dropped at once).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Per unit, the open tickets of the current epoch.
pub(super) struct InputGrads {
    counts: Mutex<Counts>,
}

struct Counts {
    /// Bumped by [`InputGrads::reset`]: tickets of an older epoch count no
    /// more.
    epoch: u64,
    open: Vec<usize>,
}

/// One forward's wait for its input's gradient (see the module docs).
pub(super) struct Ticket {
    grads: Arc<InputGrads>,
    unit: usize,
    epoch: u64,
    open: AtomicBool,
}

impl InputGrads {
    /// No ticket open for any of `units` units.
    pub(super) fn new(units: usize) -> Arc<Self> {
        Arc::new(InputGrads {
            counts: Mutex::new(Counts {
                epoch: 0,
                open: vec![0; units],
            }),
        })
    }

    /// A forward through `unit` whose input's gradient backward will
    /// compute.
    pub(super) fn expect(self: &Arc<Self>, unit: usize) -> Ticket {
        let mut c = self.counts.lock();
        c.open[unit] += 1;
        Ticket {
            grads: self.clone(),
            unit,
            epoch: c.epoch,
            open: AtomicBool::new(true),
        }
    }

    /// `ticket`'s gradient arrived: closes it (once), and says how many
    /// forwards through its unit still wait.
    pub(super) fn arrived(&self, ticket: &Ticket) -> usize {
        self.close(ticket);
        self.waiting(ticket.unit)
    }

    /// How many forwards through `unit` wait for their input's gradient.
    pub(super) fn waiting(&self, unit: usize) -> usize {
        self.counts.lock().open[unit]
    }

    /// The end of a backward: every ticket open now counts no more.
    pub(super) fn reset(&self) {
        let mut c = self.counts.lock();
        c.epoch += 1;
        c.open.fill(0);
    }

    fn close(&self, ticket: &Ticket) {
        if ticket.open.swap(false, Ordering::AcqRel) {
            let mut c = self.counts.lock();
            if c.epoch == ticket.epoch {
                let n = &mut c.open[ticket.unit];
                *n = n.saturating_sub(1);
            }
        }
    }
}

impl Ticket {
    /// The unit whose forward took this ticket.
    pub(super) fn unit(&self) -> usize {
        self.unit
    }
}

impl Drop for Ticket {
    /// The graph holding the hook is gone: its backward will not come.
    fn drop(&mut self) {
        self.grads.close(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_counts_until_its_gradient_or_its_drop_and_only_in_its_epoch() {
        let g = InputGrads::new(2);
        let (a, b) = (g.expect(1), g.expect(1));
        assert_eq!((g.waiting(0), g.waiting(1)), (0, 2));
        assert_eq!(g.arrived(&a), 1);
        // A second arrival (a hook firing again) closes nothing more.
        assert_eq!(g.arrived(&a), 1);
        drop(a);
        assert_eq!(g.waiting(1), 1);
        // Dropped without its gradient: a graph that never ran backward.
        drop(b);
        assert_eq!(g.waiting(1), 0);
        // A ticket of an older epoch closes nothing of the new one.
        let old = g.expect(0);
        g.reset();
        let new = g.expect(0);
        drop(old);
        assert_eq!(g.waiting(0), 1);
        assert_eq!(g.arrived(&new), 0);
    }
}

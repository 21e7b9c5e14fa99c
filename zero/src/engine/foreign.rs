//! Which engine's backward this thread is running, so that an engine can
//! tell gradients its own `backward` asked for from gradients another
//! engine's backward sent through its parameters (a GAN's generator step
//! runs through the discriminator; a student's loss through a teacher).
//!
//! `Engine::backward(loss)` trains that engine only, as PyTorch Lightning
//! does with several optimizers and as DeepSpeed users expect (its issue
//! 399): another engine whose parameters the loss reaches drops their
//! gradients, as `optimizer.zero_grad()` before its own step would, and
//! reduces nothing. A program's own `loss.backward()` still trains every
//! engine it reaches. On CPU, libtorch runs a backward's nodes, and so the
//! hooks, on the thread that called it, hence a thread-local.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

thread_local! {
    /// (engine id, that engine's backward count) of the engine backward
    /// running on this thread; id 0: none.
    static RUNNING: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Engine ids, from 1.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh engine id.
pub(super) fn new_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Marks engine `id`'s backward number `seq` as running on this thread
/// until the guard drops (which restores what ran before: a backward
/// started from inside another's hook).
pub(super) fn running(id: u64, seq: u64) -> Running {
    Running(RUNNING.with(|r| r.replace((id, seq))))
}

/// See [`running`].
pub(super) struct Running((u64, u64));

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.with(|r| r.set(self.0));
    }
}

/// The other engine's backward running on this thread, as (id, count),
/// when it is not engine `id`'s own (and `None` outside every engine's
/// backward: the program's own `loss.backward()`).
pub(super) fn other_than(id: u64) -> Option<(u64, u64)> {
    let (r, seq) = RUNNING.with(Cell::get);
    (r != 0 && r != id).then_some((r, seq))
}

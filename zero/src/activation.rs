//! Activation checkpointing: a block's activations are dropped after its
//! forward and recomputed in its backward, trading compute for memory
//! (PyTorch's `torch.utils.checkpoint` and FSDP's `checkpoint_wrapper`,
//! DeepSpeed's `deepspeed.checkpointing.checkpoint`).
//!
//! The recompute draws dropout's masks again by putting libtorch's CPU
//! generator back where the forward found it, as PyTorch does. That
//! generator is process-wide: ranks that are threads of one process (the
//! in-process backend) share it, so with dropout their draws interleave in
//! whatever order the threads run, and a recompute on one rank moves the
//! others' generator. Give each rank its own process for dropout runs that
//! must repeat.
//!
//! Wrap a block in [`Checkpointed`] ([`CheckpointedT`] for a `ModuleT`
//! block, with dropout), and that inside its
//! [`ShardedModule`](crate::ShardedModule):
//!
//! ```ignore
//! let block = ShardedModule::new(&plan, &path, Checkpointed::new(Block::new(&path)));
//! ```
//!
//! In that order the unit's gather and free stay outside the checkpoint:
//! stage 3 gathers the unit before its forward (which keeps only the
//! block's input), frees it after, and gathers it again before the
//! recompute in backward, exactly as without checkpointing. The recompute
//! accumulates the parameters' gradients, so the engine reduces them as
//! usual. The DeepSpeed config's `activation_checkpointing` block configures
//! DeepSpeed's own partitioning of the saved inputs, which zrt does not do
//! (a warning says so); checkpointing itself is this wrapper, as in
//! DeepSpeed it is the model code's call.
//!
//! A block that reads state of its model besides its input (whether
//! dropout is on, which documents a row packs) reads it again when it is
//! recomputed, in backward, after the program may have changed it; a
//! [`Capture`] given with [`Checkpointed::with_context`] takes that state
//! when the forward runs and puts it back around the recompute
//! (PyTorch's `context_fn`).

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use tch::{nn, Tensor};

use crate::glue;
use crate::running::{self, SegmentTrack};

/// Takes the model state a checkpointed forward sees, when it runs; what
/// it returns puts that state back around the forward's recompute.
pub type Capture = Arc<dyn Fn() -> Replay + Send + Sync>;

/// Puts a forward's state back for its recompute (and, harmlessly, for
/// the forward itself); the [`Restore`] it returns, dropped after the
/// recompute, puts back what was there before.
pub type Replay = Box<dyn Fn() -> Restore + Send>;

/// Undoes a [`Replay`] when dropped.
pub struct Restore(Option<Box<dyn FnOnce()>>);

impl Restore {
    /// Runs `undo` when dropped.
    pub fn new(undo: impl FnOnce() + 'static) -> Self {
        Self(Some(Box::new(undo)))
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(undo) = self.0.take() {
            undo();
        }
    }
}

impl fmt::Debug for Restore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Restore").finish_non_exhaustive()
    }
}

/// A module whose forward keeps only its input, recomputing its
/// activations in backward ([`glue::checkpoint`]).
///
/// It wraps an [`nn::Module`] (one input, one output); a block that
/// implements only `ModuleT` (a train flag for its dropout) takes
/// [`CheckpointedT`], which this is with the flag unused.
#[derive(Debug)]
pub struct Checkpointed<M>(CheckpointedT<M>);

impl<M: nn::Module + 'static> Checkpointed<M> {
    /// Wraps `inner`.
    pub fn new(inner: M) -> Self {
        Self(CheckpointedT::new(inner))
    }

    /// As [`Checkpointed::new`], each recompute running under the state
    /// `capture` took when its forward ran (see [`Capture`]).
    pub fn with_context(inner: M, capture: Capture) -> Self {
        Self(CheckpointedT::with_context(inner, capture))
    }

    /// Runs `f` on the wrapped module (to read its fields, say).
    pub fn with_inner<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        self.0.with_inner(f)
    }

    /// The checkpointed forward, or libtorch's error (the recompute's
    /// errors come out of the backward).
    pub fn f_forward(&self, xs: &Tensor) -> Result<Tensor, glue::GlueError> {
        // A `Module`'s `forward_t` is its `forward`, whatever the flag.
        self.0.f_forward_t(xs, false)
    }
}

impl<M: nn::Module + 'static> nn::Module for Checkpointed<M> {
    /// The checkpointed forward. Panics, as tch's own modules do, if
    /// libtorch fails; [`Checkpointed::f_forward`] returns the error.
    fn forward(&self, xs: &Tensor) -> Tensor {
        match self.f_forward(xs) {
            Ok(y) => y,
            Err(e) => panic!("{e}"),
        }
    }
}

/// [`Checkpointed`] for a block that implements only [`nn::ModuleT`]: the
/// train flag of each forward is the one its recompute uses.
///
/// The module is shared with the autograd graph, which runs it again in
/// backward (possibly after this wrapper is gone), hence the `Arc`; the
/// mutex makes it `Send` for that without asking `M` to be `Sync`.
pub struct CheckpointedT<M> {
    inner: Arc<Mutex<M>>,
    /// The model state each forward's recompute is to see.
    context: Option<Capture>,
}

impl<M> std::fmt::Debug for CheckpointedT<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointedT").finish_non_exhaustive()
    }
}

impl<M: nn::ModuleT + 'static> CheckpointedT<M> {
    /// Wraps `inner`.
    pub fn new(inner: M) -> Self {
        Self {
            inner: Arc::new(Mutex::new(inner)),
            context: None,
        }
    }

    /// As [`CheckpointedT::new`], each recompute running under the state
    /// `capture` took when its forward ran (see [`Capture`]).
    pub fn with_context(inner: M, capture: Capture) -> Self {
        Self {
            inner: Arc::new(Mutex::new(inner)),
            context: Some(capture),
        }
    }

    /// Runs `f` on the wrapped module.
    pub fn with_inner<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        f(&self.inner.lock())
    }

    /// The checkpointed `forward_t`, or libtorch's error.
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor, glue::GlueError> {
        let inner = self.inner.clone();
        // The engines learn which units the segment may touch (see
        // `running`): its recompute adds to their gradients later in
        // backward, and they wait for it.
        let track = Arc::new(SegmentTrack::default());
        let told = track.clone();
        // The state this forward sees, for its recompute.
        let replay = self.context.as_ref().map(|capture| capture());
        let (y, units) = running::segment_units(|| {
            glue::checkpoint_with(
                &[xs],
                move |ins| match ins {
                    [x] => {
                        let _restore = replay.as_ref().map(|r| r());
                        Ok(inner.lock().forward_t(x, train))
                    }
                    _ => Err(format!("one input expected, got {}", ins.len())),
                },
                move || told.recomputed(),
            )
        });
        let y = y?;
        // Without a gradient there is no graph: no recompute will come.
        if y.requires_grad() && !units.is_empty() {
            track.begin(units);
        }
        Ok(y)
    }
}

impl<M: nn::ModuleT + 'static> nn::ModuleT for CheckpointedT<M> {
    /// The checkpointed `forward_t`. Panics, as tch's own modules do, if
    /// libtorch fails; [`CheckpointedT::f_forward_t`] returns the error.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        match self.f_forward_t(xs, train) {
            Ok(y) => y,
            Err(e) => panic!("{e}"),
        }
    }
}

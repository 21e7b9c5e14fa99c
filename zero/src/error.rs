//! The engine's error type.

use zrt_collectives::CommError;
use zrt_kernels::KernelError;

use crate::{CheckpointError, ConfigError, GlueError};

/// Why the engine failed. Every variant names what to fix.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The DeepSpeed config is invalid for this job.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A collective failed (a rank died, calls mismatched, a timeout).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A kernel refused its arguments.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The libtorch glue failed.
    #[error(transparent)]
    Glue(#[from] GlueError),
    /// libtorch raised an error.
    #[error("libtorch: {0}")]
    Torch(String),
    /// The plan of units cannot be used.
    #[error("sharding plan: {0}")]
    Plan(String),
    /// The ranks ran units in different orders.
    #[error("ranks ran units in different orders: {0}; at stage 3 every rank must run the same units in the same order, as each unit's forward gathers it with every rank of its group (a model that leaves units out on some ranks, as rank-dependent LayerDrop does, declares them with ShardPlan::unused_on_some_ranks, and stage 3 then keeps them gathered)")]
    UnitOrder(String),
    /// Ranks reduced gradients in different orders because a parameter got
    /// a gradient on some ranks and not on others.
    #[error("gradient reductions out of step across ranks: {0}")]
    UnevenGradients(String),
    /// Ranks made different engine calls at the same point (a backward on
    /// one, with_full_params on another): their collectives do not line up.
    #[error(
        "ranks out of step: {0}; every rank must make the same engine calls in the same order"
    )]
    OutOfStep(String),
    /// An engine call got an argument it cannot use (a loss that is not
    /// one number, a learning rate that is not finite).
    #[error("bad argument: {0}")]
    BadArgument(String),
    /// Ranks passed different values to a call that must get the same on
    /// every rank (`Engine::set_lr`); names each rank's.
    #[error("ranks passed different values: {0}")]
    ValuesDiffer(String),
    /// Ranks built their engines from different models or configs (found
    /// when the engine is built, before anything trains).
    #[error("ranks built their engines from different models or configs: {0}. Every rank must build the same model (the same variables with the same shapes, wrapped in the same units, under the same ShardPlan rules for weight decay and learning rates; only rank 0's values are used) and pass the same config (only offload_optimizer, offload_param, aio, steps_per_print, wall_clock_breakdown, csv_monitor, tensorboard and comms_logger may differ)")]
    RanksDiffer(String),
    /// A checkpoint could not be saved or loaded.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The optimizer-state swap (NVMe offload) failed.
    #[error(transparent)]
    Offload(#[from] zrt_offload::OffloadError),
    /// A backward failed after part of its gradient had been added to the
    /// step's accumulated gradients: `backward`, `step`, `save_checkpoint`
    /// and `with_full_params` return this until a checkpoint load replaces
    /// them, rather than stepping with part of a micro-batch.
    #[error("accumulated gradients unusable: {0}")]
    GradientsLost(String),
    /// The program called the engine out of order.
    #[error("engine calls out of order: {0}")]
    CallOrder(String),
    /// fp16 gradients overflowed with the loss scale already at
    /// `min_loss_scale` (DeepSpeed stops the run here too).
    #[error("fp16 gradients overflowed at the minimum loss scale ({0}, `fp16.min_loss_scale`): no smaller scale is left, so every step from here would be skipped; look for inf/NaN in the inputs or the loss, lower the learning rate, or train in bf16 (`\"bf16\": {{\"enabled\": true}}`), which needs no loss scaling")]
    LossScaleAtMinimum(f64),
    /// A monitor (`csv_monitor`, `tensorboard`) that cannot start.
    #[error("monitor: {0}")]
    Monitor(String),
    /// A setting this build of the engine does not implement yet.
    #[error("not implemented yet: {0}")]
    Unsupported(String),
}

impl From<tch::TchError> for EngineError {
    fn from(e: tch::TchError) -> Self {
        EngineError::Torch(torch_message(&e.to_string()))
    }
}

/// libtorch's message without what tch and libtorch wrap it in: tch's
/// "Internal torch error: " (the cause is usually the program's) and the
/// C++ stack libtorch appends ("Exception raised from ... frame #0: ..."),
/// 2 KB naming no frame of the program's.
fn torch_message(s: &str) -> String {
    let s = s.strip_prefix("Internal torch error: ").unwrap_or(s);
    let s = s.split("\nException raised from").next().unwrap_or(s);
    s.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn libtorch_messages_lose_their_cpp_stack() {
        let raw = "Internal torch error: element 0 of tensors does not require grad and does not have a grad_fn\nException raised from run_backward at autograd.cpp:104 (most recent call first):\nframe #0: c10::Error::Error() + 0x9d (0x7fa4 in libc10.so)\n";
        assert_eq!(
            super::torch_message(raw),
            "element 0 of tensors does not require grad and does not have a grad_fn"
        );
        assert_eq!(super::torch_message("shape mismatch"), "shape mismatch");
    }
}

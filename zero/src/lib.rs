//! # zrt-zero
//!
//! The ZeRO engine of zrt: flat parameter/gradient/optimizer buffers sharded
//! across ranks (stages 1-3), `ShardedModule`, the DeepSpeed-compatible config,
//! checkpoints, and the libtorch glue that tch does not expose.
//!
//! This crate sits on top of the dependency graph (see DESIGN.md, "Layout"):
//! it imports `zrt-collectives`, `zrt-kernels` and `zrt-offload`; none of them
//! imports it.

pub mod activation;
pub mod checkpoint;
pub mod config;
mod engine;
mod error;
mod first_rank;
pub mod flat;
pub mod glue;
pub mod monitor;
mod plan;
mod running;
pub mod schedule;
mod spill;

pub use checkpoint::{CheckpointError, ExportLayout};
pub use config::{AutoHints, Config, ConfigError, Resolved};
pub use engine::{
    resident_bytes, CommsRow, CommsSummary, Engine, LoadedWeights, MasterShard, OverlapCounts,
    StepBreakdown,
};
pub use error::EngineError;
pub use glue::GlueError;
pub use plan::{ShardPlan, ShardedModule};

/// A fresh empty directory for one unit test (`zrt-{name}-{pid}` under
/// the system's temporary directory).
#[cfg(test)]
pub(crate) fn test_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("zrt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

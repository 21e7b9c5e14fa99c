//! # zrt
//!
//! ZeRO-sharded data-parallel training for models written with
//! [`tch`](https://docs.rs/tch) (libtorch), the FSDP / DeepSpeed-ZeRO idea in
//! Rust. This facade re-exports the workspace's crates:
//!
//! - [`collectives`]: process groups, device mesh, rendezvous, backends;
//! - [`kernels`]: fused Adam/AdamW and helpers on flat shards;
//! - [`offload`]: where optimizer state lives (device, host, NVMe);
//! - [`zero`]: flat buffers, stages 1-3, `ShardedModule`, engine, config.
//!
//! [`gpt`] is a small GPT whose blocks are `ShardedModule`s: the model of
//! the main job, the benchmarks and the parity tests.

pub mod gpt;

pub use zrt_collectives as collectives;
pub use zrt_kernels as kernels;
pub use zrt_offload as offload;
pub use zrt_zero as zero;

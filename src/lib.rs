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

/// This process's peak resident set size in bytes (VmHWM), NaN where
/// /proc is not available: what the main job and `zrt bench train` report.
pub fn peak_rss_bytes() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb * 1024.0)
}

pub use zrt_collectives as collectives;
pub use zrt_kernels as kernels;
pub use zrt_offload as offload;
pub use zrt_zero as zero;

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

/// What [`init_logging`] shows when `RUST_LOG` is not set: warnings and
/// errors from everywhere, and the engine's and offload's info lines
/// (`"auto"` values resolved, `wall_clock_breakdown`, checkpoints saved,
/// what went to NVMe).
pub const DEFAULT_LOG_FILTER: &str = "warn,zrt_zero=info,zrt_offload=info";

/// Sends the workspace's [`tracing`](https://docs.rs/tracing) events to
/// stderr, filtered by `RUST_LOG` (e.g. `RUST_LOG=zrt_collectives=debug`),
/// else by [`DEFAULT_LOG_FILTER`]. The libraries only emit events; a
/// program calls this once at the start of `main` (the main job and the
/// `zrt` CLI do), or installs a subscriber of its own. Without one, warnings
/// such as a config key zrt ignores are never seen. Later calls, or a
/// subscriber already installed, leave things as they are.
pub fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let set = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let (filter, refused) = match set.as_deref().map(EnvFilter::try_new) {
        Some(Ok(f)) => (f, None),
        Some(Err(e)) => (EnvFilter::new(DEFAULT_LOG_FILTER), Some(e)),
        None => (EnvFilter::new(DEFAULT_LOG_FILTER), None),
    };
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        // Under `zrt launch` stderr is a pipe: no colour codes in the lines.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .is_ok();
    if let (true, Some(e), Some(v)) = (installed, refused, set) {
        tracing::warn!("RUST_LOG={v:?} is not a filter ({e}); logging with {DEFAULT_LOG_FILTER:?}");
    }
}

pub use zrt_collectives as collectives;
pub use zrt_kernels as kernels;
pub use zrt_offload as offload;
pub use zrt_zero as zero;

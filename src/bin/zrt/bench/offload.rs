//! `zrt bench offload`: one rank's optimizer step with its state swapped to
//! NVMe (the engine's streamed AdamW over master, m and v in a swap file)
//! against the same step in memory (the peer), and against the disk's raw
//! sequential write + read of the same bytes measured in the same run (the
//! limit: a swapped step cannot beat reading and writing its state once).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use half::bf16;
use serde_json::json;

use super::{median, time_each};
use zrt::kernels::{adam_step, AdamConfig, AdamShard, ComputeCopy, Threads};
use zrt::offload::{raw_write_read, OffloadError, Swap, SwapConfig};

/// Options of `zrt bench offload`.
#[derive(Args, Debug)]
pub struct OffloadArgs {
    /// Parameters in the rank's shard (the swap holds 12 bytes each:
    /// fp32 master, m and v, as bf16 training with NVMe offload does).
    #[arg(long, default_value_t = 20_000_000, value_parser = super::at_least_one())]
    params: usize,
    /// The directory to swap to (`nvme_path`); default: the system temp dir.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Bytes per array per request (`aio.block_size`).
    #[arg(long, default_value_t = 1 << 20, value_parser = super::at_least_one())]
    block_size: usize,
    /// Buffers in flight (`offload_optimizer.buffer_count`).
    #[arg(long, default_value_t = 4, value_parser = super::at_least_one())]
    buffers: usize,
    /// Adam threads.
    #[arg(long, default_value_t = 1, value_parser = super::at_least_one())]
    threads: usize,
    /// Interleaved rounds (in memory, swapped, raw disk, ...).
    #[arg(long, default_value_t = 5, value_parser = super::at_least_one())]
    rounds: usize,
    /// Steps per implementation per round.
    #[arg(long, default_value_t = 2, value_parser = super::at_least_one())]
    steps: usize,
    /// One JSON object per row on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

/// Bytes held in memory at once: the gradient, the bf16 copy, the
/// in-memory master, m and v (18 per parameter), and the swap's buffers (a
/// block of each of its three arrays per buffer) plus the raw disk test's
/// block. The swap file itself is on disk.
fn peak_bytes(a: &OffloadArgs) -> Option<u64> {
    let block = a.block_size as u64;
    let buffers = (a.buffers as u64).checked_mul(3)?.checked_mul(block)?;
    (a.params as u64)
        .checked_mul(18)?
        .checked_add(buffers)?
        .checked_add(block)
}

/// Runs the benchmark and prints its rows.
pub fn run(a: &OffloadArgs) -> Result<()> {
    let n = a.params;
    let what = format!(
        "--params {n} --block-size {} --buffers {}",
        a.block_size, a.buffers
    );
    super::check_fits(peak_bytes(a), &what)?;
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let pool = Threads::new(a.threads)?;
    let cfg = AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::default()
    };
    let g: Vec<f32> = (0..n).map(|i| (i % 777) as f32 * 1e-6).collect();
    let mut copy = vec![bf16::ZERO; n];
    // In memory: master, m, v as the engine keeps them without offload.
    let mut p: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    // Swapped: the same three arrays in one region of a swap file.
    let swap = Swap::create(
        &SwapConfig {
            dir: dir.clone(),
            rank: 0,
            buffer_count: a.buffers,
            chunk_bytes: a.block_size,
            direct: true,
        },
        3,
        &[n],
    )?;
    swap.write_region(0, &[&p, &m, &v])?;
    let bytes = swap.file_bytes();
    let (mut t_mem, mut t_swap, mut t_raw) = (Vec::new(), Vec::new(), Vec::new());
    let mut step = 0u64;
    for round in 0..a.rounds {
        t_mem.extend(time_each(a.steps, || {
            step += 1;
            let shard = AdamShard {
                p: &mut p,
                g: &g,
                m: &mut m,
                v: &mut v,
            };
            adam_step(&pool, &cfg, step, 1.0, shard, ComputeCopy::Bf16(&mut copy))
                .expect("valid Adam arguments");
        }));
        for _ in 0..a.steps {
            step += 1;
            let t = std::time::Instant::now();
            swap.stream(
                |_, r, arrays: &mut [&mut [f32]]| -> Result<(), OffloadError> {
                    let (pm, mv) = arrays.split_at_mut(1);
                    let (mm, vv) = mv.split_at_mut(1);
                    let shard = AdamShard {
                        p: &mut *pm[0],
                        g: &g[r.clone()],
                        m: &mut *mm[0],
                        v: &mut *vv[0],
                    };
                    adam_step(
                        &pool,
                        &cfg,
                        step,
                        1.0,
                        shard,
                        ComputeCopy::Bf16(&mut copy[r]),
                    )
                    .map_err(|e| OffloadError::Compute(e.to_string()))
                },
            )?;
            t_swap.push(t.elapsed().as_secs_f64());
        }
        let (w, r) = raw_write_read(&dir, bytes, a.block_size)?;
        t_raw.push(w + r);
        eprintln!("zrt bench offload: round {}/{} done", round + 1, a.rounds);
    }
    let (mem, swapped, raw) = (median(&t_mem), median(&t_swap), median(&t_raw));
    let disk_gbs = |secs: f64| 2.0 * bytes as f64 / secs / 1e9;
    let rows = [
        ("zrt nvme offload", swapped),
        ("in memory (peer)", mem),
        ("raw write+read (limit)", raw),
    ];
    if !a.json {
        println!(
            "AdamW step on {:.0}M params, state {:.0} MiB in {} ({}), {} x {} KiB buffers, {} rounds x {} steps, medians",
            n as f64 / 1e6,
            bytes as f64 / (1 << 20) as f64,
            dir.display(),
            if swap.direct() { "O_DIRECT" } else { "page cache" },
            a.buffers,
            (a.block_size * 3) >> 10,
            a.rounds,
            a.steps
        );
        println!(
            "{:<24} {:>10} {:>14} {:>12} {:>12}",
            "impl", "s/step", "disk GB/s", "vs limit", "vs peer"
        );
    }
    for (name, secs) in rows {
        // Speed ratios: higher is better; the swapped step's time against
        // the raw time is 1 / ratio_vs_limit (target <= 1.3).
        let (vs_limit, vs_peer) = (raw / secs, mem / secs);
        if a.json {
            println!(
                "{}",
                json!({
                    "bench": "offload", "impl": name, "params": n, "state_bytes": bytes,
                    "seconds_per_step": secs, "disk_gb_per_s": disk_gbs(secs),
                    "raw_write_read_seconds": raw, "in_memory_seconds": mem,
                    "direct_io": swap.direct(), "buffers": a.buffers, "block_size": a.block_size,
                    "ratio_vs_limit": vs_limit, "ratio_vs_peer": vs_peer,
                })
            );
        } else {
            println!(
                "{:<24} {:>10.3} {:>14.2} {:>11.2}x {:>11.2}x",
                name,
                secs,
                disk_gbs(secs),
                vs_limit,
                vs_peer
            );
        }
    }
    if !a.json {
        println!(
            "swapped step / raw write+read = {:.2} (target <= 1.3)",
            swapped / raw
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_18_bytes_a_parameter_and_the_swaps_buffers() {
        let args = |params, block_size, buffers| OffloadArgs {
            params,
            dir: None,
            block_size,
            buffers,
            threads: 1,
            rounds: 1,
            steps: 1,
            json: false,
        };
        // 18 bytes a parameter, 4 buffers of 3 arrays' blocks, one raw block.
        assert_eq!(
            peak_bytes(&args(1000, 4096, 4)),
            Some(18_000 + 4 * 3 * 4096 + 4096)
        );
        assert_eq!(peak_bytes(&args(1000, 4096, usize::MAX)), None);
        assert_eq!(peak_bytes(&args(usize::MAX, 4096, 1)), None);
    }
}

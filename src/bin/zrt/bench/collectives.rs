//! `zrt bench collectives`: all_reduce, reduce_scatter, all_gather and
//! all_to_all on 2 ranks of the shared-memory backend, against
//! torch.distributed's gloo (the peer) and single-core memcpy (the limit),
//! all measured in the same run.
//!
//! Conventions are nccl-tests': `algbw = S / t` with S the full buffer
//! (all_reduce's buffer, reduce_scatter's input, all_gather's output,
//! all_to_all's input); `busbw = algbw * 2(n-1)/n` for all_reduce and
//! `algbw * (n-1)/n` for the others. The limit is memcpy's `S / t` for the
//! same S on one core.
//! Beside it the run measures both cores copying at once (a line above the
//! table; `memcpy_two_cores_gb_per_s` in the JSON): what the memory system
//! gives the pair of ranks together, on which the rows on private buffers
//! depend where their data comes from memory (16 and 128 MiB).

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use super::{median, peer, run_ranks};
use zrt::collectives::{init_from_env, ProcessGroup, ReduceOp};

/// The ops measured; the `_in_place` and `_symmetric` ones (in place on a
/// buffer from `alloc_symmetric`, which peers read where it is) are
/// compared with gloo's out-of-place op of the same kind (its script has
/// neither variant).
const OPS: [&str; 8] = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "reduce_scatter_in_place",
    "all_gather_in_place",
    "reduce_scatter_symmetric",
    "all_gather_symmetric",
    "all_to_all",
];
const RANKS: usize = 2;

/// Options of `zrt bench collectives`.
#[derive(Args, Debug)]
pub struct CollectivesArgs {
    /// Buffer sizes in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,128", value_parser = super::at_least_one())]
    sizes: Vec<usize>,
    /// Interleaved rounds (zrt, gloo, memcpy, zrt, ...).
    #[arg(long, default_value_t = 5, value_parser = super::at_least_one())]
    rounds: usize,
    /// Timed iterations per op and size per round.
    #[arg(long, default_value_t = 5, value_parser = super::at_least_one())]
    iters: usize,
    /// zrt backend to measure: shm or tcp (loopback).
    #[arg(long, default_value = "shm", value_parser = ["shm", "tcp"])]
    backend: String,
    /// Also run the gloo peer in the libtorch venv.
    #[arg(long)]
    peer: bool,
    /// One JSON object per row on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of the hidden per-rank half.
#[derive(Args, Debug)]
pub struct RankArgs {
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    #[arg(long)]
    iters: usize,
}

/// Untimed iterations of each op and size before the timed ones (as
/// nccl-tests' warm-up): the first operations of a group walk its shm
/// staging rings for the first time, and, where the slot stores are
/// chosen by measuring (`ZRT_SHM_SLOT_STORES=auto`), run before the
/// choice is made. With one warm-up iteration the first row (all_reduce,
/// 1 MiB) read up to 2x its steady time.
const WARMUP: usize = 5;

/// Runs inside each rank process: times every op and size, prints rank 0's
/// results (the slowest rank's time per iteration) as one protocol line.
pub fn rank_main(a: &RankArgs) -> Result<()> {
    let dist = init_from_env()?;
    let g = dist.world();
    let n = g.size();
    let mut results = Vec::new();
    for &mib in &a.sizes {
        let len = mib * (1 << 20) / 4;
        let mut full = vec![1f32; len];
        let mut part = vec![1f32; len / n];
        let mut other = vec![1f32; len];
        let mut sym = g.alloc_symmetric::<f32>(len).wait()?;
        sym.fill(1.0);
        for op in OPS {
            let mut times = Vec::new();
            for it in 0..WARMUP + a.iters {
                g.barrier().wait()?;
                let t = std::time::Instant::now();
                match op {
                    "all_reduce" => full = g.all_reduce(full, ReduceOp::Sum).wait()?,
                    "reduce_scatter" => {
                        (full, part) = g.reduce_scatter(full, part, ReduceOp::Sum).wait()?
                    }
                    "all_gather" => (part, full) = g.all_gather(part, full).wait()?,
                    "reduce_scatter_in_place" => {
                        full = g.reduce_scatter_in_place(full, ReduceOp::Sum).wait()?
                    }
                    "reduce_scatter_symmetric" => {
                        sym = g.reduce_scatter_symmetric(sym, ReduceOp::Sum).wait()?
                    }
                    "all_gather_symmetric" => sym = g.all_gather_symmetric(sym).wait()?,
                    "all_to_all" => (full, other) = g.all_to_all(full, other).wait()?,
                    _ => full = g.all_gather_in_place(full).wait()?,
                }
                if it >= WARMUP {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            let slowest = g.all_reduce(times, ReduceOp::Max).wait()?;
            results.push(json!({"op": op, "mib": mib, "times": slowest}));
        }
    }
    if g.rank() == 0 {
        println!("@@zrt {}", json!({ "results": results }));
    }
    Ok(())
}

fn collect(into: &mut std::collections::HashMap<(String, usize), Vec<f64>>, v: &Value) {
    for r in v["results"].as_array().into_iter().flatten() {
        let key = (
            r["op"].as_str().unwrap_or("").to_string(),
            r["mib"].as_u64().unwrap_or(0) as usize,
        );
        into.entry(key).or_default().extend(
            r["times"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_f64),
        );
    }
}

/// Bytes the ranks hold at once for a size of `mib` MiB: each rank's full
/// buffer, its part, all_to_all's output and its symmetric buffer (gloo's
/// ranks, which run between zrt's, hold about as much; the staging slots
/// are small).
fn peak_bytes(mib: usize) -> Option<u64> {
    let s = (mib as u64).checked_mul(1 << 20)?;
    let per_rank = s.checked_mul(3)?.checked_add(s / RANKS as u64)?;
    per_rank.checked_mul(RANKS as u64)
}

/// Runs the benchmark and prints its rows.
pub fn run(a: &CollectivesArgs) -> Result<()> {
    let largest = a.sizes.iter().copied().max().unwrap_or(0);
    super::check_fits(peak_bytes(largest), &format!("--sizes {largest}"))?;
    let me = std::env::current_exe()?;
    let sizes: Vec<String> = a.sizes.iter().map(|s| s.to_string()).collect();
    let sizes = sizes.join(",");
    let rank_args = vec![
        "bench".into(),
        "collectives-rank".into(),
        "--sizes".into(),
        sizes.clone(),
        "--iters".into(),
        a.iters.to_string(),
    ];
    let script =
        std::env::temp_dir().join(format!("zrt-collectives-peer-{}.py", std::process::id()));
    if a.peer {
        std::fs::write(
            &script,
            include_str!("../../../../bench/peers/collectives_peer.py"),
        )?;
    }
    let python = peer::venv_python();
    let (mut zrt, mut gloo) = (Default::default(), Default::default());
    let mut copy: std::collections::HashMap<usize, Vec<f64>> = Default::default();
    let mut pair: std::collections::HashMap<usize, Vec<f64>> = Default::default();
    // Where the host put the two CPUs, per round (see `core_round_trip_ns`).
    let mut trips = Vec::new();
    for round in 0..a.rounds {
        collect(
            &mut zrt,
            &run_ranks(
                &me,
                &rank_args,
                RANKS,
                &[("ZRT_BACKEND", a.backend.clone())],
            )?,
        );
        if a.peer {
            let args = vec![
                script.display().to_string(),
                sizes.clone(),
                a.iters.to_string(),
            ];
            collect(&mut gloo, &run_ranks(&python, &args, RANKS, &[])?);
        }
        for &mib in &a.sizes {
            let bytes = mib << 20;
            // memcpy's S / t on one core, for the same S; small copies
            // repeated until they move as much as three 128 MiB copies
            // (3 reps at 128 MiB, 384 at 1 MiB), so a few slow ones
            // cannot set the median.
            let reps = (3 * (128 << 20) / bytes.max(1)).clamp(3, 384);
            let gbs = super::copy_bandwidth(1, bytes, reps) / 2.0;
            copy.entry(mib).or_default().push(gbs);
            // Both cores copying at once: how much of one core's memcpy a
            // pair of ranks can count on together.
            pair.entry(mib)
                .or_default()
                .push(super::pair_copy_bandwidth(bytes, reps));
        }
        trips.push(super::core_round_trip_ns());
        eprintln!(
            "zrt bench collectives: round {}/{} done",
            round + 1,
            a.rounds
        );
    }
    let _ = std::fs::remove_file(&script);

    let trip = median(&trips);
    if !a.json {
        // The ranks inherit ZRT_SHM_SLOT_STORES: which stores the staged
        // rows ran with is part of what a run measured.
        let stores = match a.backend.as_str() {
            "shm" => format!(
                "; slot stores {}",
                std::env::var("ZRT_SHM_SLOT_STORES")
                    .ok()
                    .filter(|v| !v.trim().is_empty())
                    .unwrap_or_else(|| "auto".into())
            ),
            _ => String::new(),
        };
        println!("{RANKS} ranks, {} backend vs gloo; medians of {} rounds x {} iterations; GB/s = 1e9 B/s{stores}", a.backend, a.rounds, a.iters);
        let (lo, hi) = trips
            .iter()
            .fold((f64::INFINITY, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
        println!(
            "core-to-core round trip {} ns (rounds: {}-{} ns)",
            super::cell(trip, 0, ""),
            super::cell(lo, 0, ""),
            super::cell(hi, 0, "")
        );
        let scaling: Vec<String> = a
            .sizes
            .iter()
            .enumerate()
            .map(|(i, mib)| {
                let f = median(&pair[mib]) / median(&copy[mib]);
                let what = if i == 0 { " one core's memcpy" } else { "" };
                format!("{}{what} at {mib} MiB", super::cell(f, 2, "x"))
            })
            .collect();
        println!("both cores copying at once: {}", scaling.join(", "));
        println!(
            "{:<24} {:>6} {:>10} {:>10} {:>10} {:>11} {:>11} {:>10} {:>10}",
            "op", "MiB", "zrt ms", "algbw", "busbw", "gloo busbw", "memcpy", "vs gloo", "vs memcpy"
        );
    }
    for &mib in &a.sizes {
        let s = (mib << 20) as f64;
        let limit = median(&copy[&mib]);
        let two_cores = median(&pair[&mib]);
        for op in OPS {
            let key = (op.to_string(), mib);
            let factor = if op == "all_reduce" {
                2.0 * (RANKS - 1) as f64 / RANKS as f64
            } else {
                (RANKS - 1) as f64 / RANKS as f64
            };
            let t = median(zrt.get(&key).map_or(&[][..], |v| v));
            let kind = op.trim_end_matches("_in_place");
            let peer_key = (kind.trim_end_matches("_symmetric").to_string(), mib);
            let tg = median(gloo.get(&peer_key).map_or(&[][..], |v| v));
            let (algbw, busbw) = (s / t / 1e9, s / t / 1e9 * factor);
            let gloo_busbw = s / tg / 1e9 * factor;
            let vs_peer = busbw / gloo_busbw;
            let vs_limit = busbw / limit;
            if a.json {
                println!(
                    "{}",
                    json!({
                        "bench": "collectives", "op": op, "mib": mib, "ranks": RANKS, "backend": a.backend,
                        "seconds": t, "algbw_gb_per_s": algbw, "busbw_gb_per_s": busbw,
                        "peer": "gloo", "peer_busbw_gb_per_s": if gloo_busbw.is_finite() { json!(gloo_busbw) } else { Value::Null },
                        "memcpy_gb_per_s": limit,
                        "memcpy_two_cores_gb_per_s": if two_cores.is_finite() { json!(two_cores) } else { Value::Null },
                        "core_round_trip_ns": if trip.is_finite() { json!(trip) } else { Value::Null },
                        "ratio_vs_peer": if vs_peer.is_finite() { json!(vs_peer) } else { Value::Null },
                        "ratio_vs_limit": vs_limit,
                    })
                );
            } else {
                println!(
                    "{:<24} {:>6} {:>10.2} {:>10.2} {:>10.2} {:>11} {:>11.2} {:>10} {:>9.2}x",
                    op,
                    mib,
                    t * 1e3,
                    algbw,
                    busbw,
                    super::cell(gloo_busbw, 2, ""),
                    limit,
                    super::cell(vs_peer, 1, "x"),
                    vs_limit
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_each_ranks_full_buffer_part_output_and_symmetric_buffer() {
        // 2 ranks x (1 MiB + 0.5 MiB + 1 MiB + 1 MiB).
        assert_eq!(peak_bytes(1), Some(7 << 20));
        assert_eq!(peak_bytes(128), Some(896 << 20));
        assert_eq!(peak_bytes(usize::MAX), None);
    }
}

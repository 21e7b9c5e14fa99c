//! `zrt bench adam`: the fused AdamW step on one shard, against PyTorch's
//! fused AdamW and DeepSpeed's CPUAdam (the optimizer behind ZeRO-Offload),
//! and against memory-copy bandwidth measured in the same run (the limit).
//! zrt's Lion step on the same shard is timed in the same rounds (no peer
//! has one: torch 2.13 has no Lion, DeepSpeed's needs its CUDA or CPU
//! build), against the limit and the peers' AdamW; zrt's SGD with
//! momentum against PyTorch's fused SGD, zrt's Adagrad against PyTorch's
//! fused Adagrad, and zrt's RMSprop with momentum against PyTorch's
//! RMSprop (its `foreach` path: torch 2.13 has no fused RMSprop).

use anyhow::{Context, Result};
use clap::Args;
use serde_json::{json, Value};

use super::peer::Peer;
use super::{copy_bandwidth, median, time_each};
use zrt::kernels::{
    adagrad_step, adam_step, lion_step, rmsprop_step, sgd_step, AdagradConfig, AdamConfig,
    AdamShard, ComputeCopy, RmspropConfig, SgdConfig, Threads,
};

/// Bytes an Adam step moves per parameter: read p, g, m, v; write p, m, v
/// (RMSprop's with momentum too: its square average and buffer).
const BYTES_PER_PARAM: f64 = 28.0;

/// Bytes a Lion step, SGD's with momentum or Adagrad's, moves per
/// parameter: read p, g, m (Adagrad's sum); write p, m.
const LION_BYTES_PER_PARAM: f64 = 20.0;

/// Options of `zrt bench adam`.
#[derive(Args, Debug)]
pub struct AdamArgs {
    /// Parameters in the shard.
    #[arg(long, default_value_t = 50_000_000, value_parser = super::at_least_one())]
    params: usize,
    /// Thread counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2", value_parser = super::at_least_one())]
    threads: Vec<usize>,
    /// Interleaved rounds (zrt, peers, limit, zrt, ...).
    #[arg(long, default_value_t = 5, value_parser = super::at_least_one())]
    rounds: usize,
    /// Timed steps per implementation per round.
    #[arg(long, default_value_t = 5, value_parser = super::at_least_one())]
    steps: usize,
    /// Also run the peers (PyTorch fused AdamW, DeepSpeed CPUAdam) in the libtorch venv.
    #[arg(long)]
    peer: bool,
    /// One JSON object per row on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Default)]
struct Samples {
    zrt: Vec<f64>,
    lion: Vec<f64>,
    sgd: Vec<f64>,
    adagrad: Vec<f64>,
    rmsprop: Vec<f64>,
    torch: Vec<f64>,
    torch_sgd: Vec<f64>,
    torch_adagrad: Vec<f64>,
    torch_rmsprop: Vec<f64>,
    deepspeed: Vec<f64>,
    copy_gbs: Vec<f64>,
}

fn peer_times(peer: &mut Peer, imp: &str, threads: usize, steps: usize) -> Result<Vec<f64>> {
    let reply = peer.call(&json!({"impl": imp, "threads": threads, "steps": steps}))?;
    let times = reply["times"]
        .as_array()
        .with_context(|| format!("peer reply without times: {reply}"))?;
    Ok(times.iter().filter_map(Value::as_f64).collect())
}

/// The copy the limit times: the bytes an Adam step moves, up to 1 GiB.
fn copy_bytes(n: usize) -> usize {
    (n.saturating_mul(4 * 7) / 2).min(1 << 30)
}

/// Bytes held at once for `n` parameters: zrt's p, g, m, v (16 each), the
/// limit's source and destination, and with `peer` the peer process's
/// parameter, gradient (and its temporary), two optimizers' m and v,
/// SGD's momentum buffer, Adagrad's sum and RMSprop's square average and
/// buffer.
fn peak_bytes(n: usize, peer: bool) -> Option<u64> {
    let copy = 2 * copy_bytes(n) as u64;
    let n = n as u64;
    let peer = if peer { n.checked_mul(44)? } else { 0 };
    n.checked_mul(16)?.checked_add(copy)?.checked_add(peer)
}

/// Runs the benchmark and prints its rows.
pub fn run(args: &AdamArgs) -> Result<()> {
    let n = args.params;
    let what = format!(
        "--params {n}{}",
        if args.peer { " with --peer" } else { "" }
    );
    super::check_fits(peak_bytes(n, args.peer), &what)?;
    let mut peer = if args.peer {
        Some(Peer::start(
            include_str!("../../../../bench/peers/adam_peer.py"),
            &[n.to_string()],
        )?)
    } else {
        None
    };
    let deepspeed = peer
        .as_ref()
        .is_some_and(|p| p.hello["deepspeed"].as_bool() == Some(true));
    if let Some(p) = &peer {
        if !deepspeed {
            eprintln!(
                "zrt bench adam: DeepSpeed CPUAdam unavailable ({}); `pip install deepspeed ninja` into the venv to add it",
                p.hello["deepspeed_error"].as_str().unwrap_or("?")
            );
        }
    }

    let cfg = AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::default()
    };
    let mut p: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let g: Vec<f32> = (0..n).map(|i| (i % 777) as f32 * 1e-6).collect();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let pools: Vec<Threads> = args
        .threads
        .iter()
        .map(|&t| Threads::new(t))
        .collect::<Result<_, _>>()?;
    let mut samples: Vec<Samples> = args.threads.iter().map(|_| Samples::default()).collect();
    let mut step = 0u64;

    for round in 0..args.rounds {
        for (k, pool) in pools.iter().enumerate() {
            let t = pool.count();
            let s = &mut samples[k];
            let mut zrt_step = || {
                step += 1;
                let shard = AdamShard {
                    p: &mut p,
                    g: &g,
                    m: &mut m,
                    v: &mut v,
                };
                adam_step(pool, &cfg, step, 1.0, shard, ComputeCopy::None)
                    .expect("valid Adam arguments");
            };
            zrt_step(); // warm-up: page faults, pool wake-up
            s.zrt.extend(time_each(args.steps, zrt_step));
            // Lion on the same p, g and m (timing only: the values stay
            // finite, each step moves p by lr).
            let lion = || {
                let shard = AdamShard {
                    p: &mut p,
                    g: &g,
                    m: &mut m,
                    v: &mut [],
                };
                lion_step(pool, &cfg, 1.0, shard, ComputeCopy::None).expect("valid Lion arguments");
            };
            s.lion.extend(time_each(args.steps, lion));
            // SGD with momentum on the same p, g and m: the settings the
            // peer's fused SGD steps with.
            let sgd_cfg = SgdConfig {
                lr: 1e-3,
                momentum: 0.9,
                weight_decay: 0.01,
                ..SgdConfig::default()
            };
            let sgd = || {
                let shard = AdamShard {
                    p: &mut p,
                    g: &g,
                    m: &mut m,
                    v: &mut [],
                };
                sgd_step(pool, &sgd_cfg, false, 1.0, shard, ComputeCopy::None)
                    .expect("valid SGD arguments");
            };
            s.sgd.extend(time_each(args.steps, sgd));
            // Adagrad on the same p and g, Adam's v as its sum (both stay
            // non-negative, so neither step meets a NaN): the settings the
            // peer's fused Adagrad steps with.
            let adagrad_cfg = AdagradConfig {
                weight_decay: 0.01,
                ..AdagradConfig::default()
            };
            let adagrad = || {
                let shard = AdamShard {
                    p: &mut p,
                    g: &g,
                    m: &mut v,
                    v: &mut [],
                };
                adagrad_step(pool, &adagrad_cfg, 1, 1.0, shard, ComputeCopy::None)
                    .expect("valid Adagrad arguments");
            };
            s.adagrad.extend(time_each(args.steps, adagrad));
            // RMSprop with momentum on the same p and g, v as its square
            // average (non-negative) and m as its buffer: the settings the
            // peer's RMSprop steps with.
            let rmsprop_cfg = RmspropConfig {
                momentum: 0.9,
                weight_decay: 0.01,
                ..RmspropConfig::default()
            };
            let rmsprop = || {
                let shard = AdamShard {
                    p: &mut p,
                    g: &g,
                    m: &mut v,
                    v: &mut m,
                };
                rmsprop_step(pool, &rmsprop_cfg, 1.0, shard, ComputeCopy::None)
                    .expect("valid RMSprop arguments");
            };
            s.rmsprop.extend(time_each(args.steps, rmsprop));
            if let Some(peer) = peer.as_mut() {
                s.torch
                    .extend(peer_times(peer, "torch_fused", t, args.steps)?);
                s.torch_sgd
                    .extend(peer_times(peer, "torch_fused_sgd", t, args.steps)?);
                s.torch_adagrad
                    .extend(peer_times(peer, "torch_fused_adagrad", t, args.steps)?);
                s.torch_rmsprop
                    .extend(peer_times(peer, "torch_rmsprop", t, args.steps)?);
                if deepspeed {
                    s.deepspeed
                        .extend(peer_times(peer, "deepspeed", t, args.steps)?);
                }
            }
            // The limit, interleaved too: the same bytes an Adam step moves.
            s.copy_gbs.push(copy_bandwidth(t, copy_bytes(n), 3));
        }
        eprintln!("zrt bench adam: round {}/{} done", round + 1, args.rounds);
    }

    if !args.json {
        println!(
            "AdamW on {:.0}M params, {} rounds x {} steps, medians; GB/s counts {} bytes/param ({} for Lion, SGD with momentum and Adagrad; zrt Lion's vs-peer is against the peers' AdamW, zrt SGD's and Adagrad's against torch's fused ones, zrt RMSprop's against torch's foreach one)",
            n as f64 / 1e6,
            args.rounds,
            args.steps,
            BYTES_PER_PARAM,
            LION_BYTES_PER_PARAM
        );
        println!(
            "{:<22} {:>7} {:>10} {:>12} {:>8} {:>10} {:>13} {:>13}",
            "impl",
            "threads",
            "ms/step",
            "Mparam/s",
            "GB/s",
            "copy GB/s",
            "vs limit",
            "vs best peer"
        );
    }
    for (k, &t) in args.threads.iter().enumerate() {
        let s = &samples[k];
        let limit = median(&s.copy_gbs);
        let zrt_s = median(&s.zrt);
        let peers = [
            ("torch fused AdamW", median(&s.torch)),
            ("DeepSpeed CPUAdam", median(&s.deepspeed)),
        ];
        let best_peer = peers
            .iter()
            .map(|p| p.1)
            .filter(|x| x.is_finite())
            .fold(f64::NAN, f64::min);
        // (row, seconds a step, bytes a parameter, the peer's seconds)
        let mut rows = vec![("zrt", zrt_s, BYTES_PER_PARAM, best_peer)];
        rows.extend(
            (peers.iter().filter(|p| p.1.is_finite()))
                .map(|&(name, secs)| (name, secs, BYTES_PER_PARAM, best_peer)),
        );
        rows.push(("zrt Lion", median(&s.lion), LION_BYTES_PER_PARAM, best_peer));
        // zrt's SGD, Adagrad and RMSprop, each with torch's when it ran.
        let pairs = [
            ("zrt SGD", &s.sgd, "torch fused SGD", &s.torch_sgd),
            (
                "zrt Adagrad",
                &s.adagrad,
                "torch fused Adagrad",
                &s.torch_adagrad,
            ),
            (
                "zrt RMSprop",
                &s.rmsprop,
                "torch RMSprop foreach",
                &s.torch_rmsprop,
            ),
        ];
        for (ours, times, theirs, peer_times) in pairs {
            let peer = median(peer_times);
            let bytes = match ours {
                "zrt RMSprop" => BYTES_PER_PARAM,
                _ => LION_BYTES_PER_PARAM,
            };
            rows.push((ours, median(times), bytes, peer));
            if peer.is_finite() {
                rows.push((theirs, peer, bytes, peer));
            }
        }
        for (name, secs, bytes, peer_secs) in rows {
            let mps = n as f64 / secs / 1e6;
            let gbs = bytes * n as f64 / secs / 1e9;
            let vs_limit = gbs / limit;
            let vs_peer = peer_secs / secs;
            if args.json {
                println!(
                    "{}",
                    json!({
                        "bench": "adam", "impl": name, "threads": t, "params": n,
                        "seconds_per_step": secs, "mparam_per_s": mps, "gb_per_s": gbs,
                        "copy_gb_per_s": limit, "ratio_vs_limit": vs_limit,
                        "ratio_vs_peer": if vs_peer.is_finite() { json!(vs_peer) } else { Value::Null },
                    })
                );
            } else {
                println!(
                    "{:<22} {:>7} {:>10.2} {:>12.0} {:>8.1} {:>10.1} {:>12.2}x {:>13}",
                    name,
                    t,
                    secs * 1e3,
                    mps,
                    gbs,
                    limit,
                    vs_limit,
                    super::cell(vs_peer, 2, "x")
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
    fn the_peak_counts_zrts_arrays_the_limits_copy_and_the_peer() {
        // p, g, m, v (16 bytes a parameter); the limit copies the 14 bytes
        // a step moves per parameter, from a source to a destination.
        assert_eq!(copy_bytes(1000), 14_000);
        assert_eq!(copy_bytes(1 << 30), 1 << 30);
        assert_eq!(peak_bytes(1000, false), Some(16_000 + 28_000));
        // The peer: its parameter, gradient, temporary, two m and v,
        // SGD's buffer, Adagrad's sum, RMSprop's square average and buffer.
        assert_eq!(peak_bytes(1000, true), Some(16_000 + 28_000 + 44_000));
        // The limit's copy stops at 1 GiB.
        assert_eq!(peak_bytes(1 << 30, false), Some((16u64 << 30) + (2 << 30)));
        assert_eq!(peak_bytes(usize::MAX, false), None);
    }
}

//! `zrt bench loss`: a language model's head and cross-entropy, forward
//! and backward, three ways on the same hidden states, matrix and
//! targets, interleaved over rounds:
//!
//! - `fused`: zrt's loss methods' default
//!   (`glue::linear_cross_entropy`), which never holds the whole logits;
//! - `kept`: the head's logits whole, their loss keeping them in their
//!   own dtype (`glue::cross_entropy`, zrt's loss with fusing off);
//! - `fp32`: the logits whole, cast to fp32 for libtorch's cross-entropy,
//!   as `transformers`' `ForCausalLMLoss` computes it (the same libtorch
//!   ops PyTorch runs, called here without Python).
//!
//! Each way's median time a step and the most libtorch held during one
//! above what it held before (the gradients of the matrix and of the
//! hidden states included, the same for all three), with the ratios
//! against `fp32`, the peer. The losses must agree, or it fails: the
//! three did the same work.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;
use tch::{Device, Kind, Tensor};

use super::{cell, median};
use zrt::zero::glue::{
    allocated, cross_entropy, linear_cross_entropy, reset_peak_allocated, track_allocations,
    LogitsAfter,
};

/// Options of `zrt bench loss`.
#[derive(Args, Debug)]
pub struct LossArgs {
    /// Tokens a step (rows of hidden states).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(i64).range(1..))]
    tokens: i64,
    /// The model's width (Gemma 3 1B's by default).
    #[arg(long, default_value_t = 1152, value_parser = clap::value_parser!(i64).range(1..))]
    width: i64,
    /// The vocabulary (Gemma 3's by default).
    #[arg(long, default_value_t = 262_144, value_parser = clap::value_parser!(i64).range(1..))]
    vocab: i64,
    /// The compute dtype: fp32 or bf16.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    dtype: String,
    /// Intra-op threads.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i32).range(1..))]
    threads: i32,
    /// Interleaved rounds (fused, kept, fp32, fused, ...), each way
    /// timed once a round after a first untimed round.
    #[arg(long, default_value_t = 3, value_parser = super::at_least_one())]
    rounds: usize,
    /// The matrix frozen, as under LoRA: only the hidden states get a
    /// gradient (the fused loss then computes it in forward).
    #[arg(long)]
    frozen_head: bool,
    /// One JSON object per row on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

/// The three ways, in the order each round runs them.
const WAYS: [&str; 3] = ["fused", "kept", "fp32"];

/// One step of `way`: its loss, seconds, and the most bytes held above
/// what was held before it.
fn step(way: &str, h: &Tensor, w: &Tensor, y: &Tensor) -> Result<(f64, f64, u64)> {
    reset_peak_allocated();
    let before = allocated().now;
    let t = Instant::now();
    let loss = match way {
        "fused" => linear_cross_entropy(h, w, None, y, -100, true, LogitsAfter::default())?,
        "kept" => cross_entropy(&h.f_matmul(&w.tr())?, y, -100, true)?,
        _ => (h.f_matmul(&w.tr())?.f_to_kind(Kind::Float)?).f_cross_entropy_loss::<Tensor>(
            y,
            None,
            tch::Reduction::Mean,
            -100,
            0.0,
        )?,
    };
    let grads = match w.requires_grad() {
        true => Tensor::run_backward(&[&loss], &[h, w], false, false),
        false => Tensor::run_backward(&[&loss], &[h], false, false),
    };
    let secs = t.elapsed().as_secs_f64();
    let peak = allocated().peak.saturating_sub(before);
    drop(grads);
    Ok((loss.double_value(&[]), secs, peak))
}

/// What the run holds at its peak, about: the fp32 matrix, its
/// gradient and the hidden states' (and the inputs) in fp32, and the
/// peer's logits with their gradient and fp32 log-softmax; `None` when
/// the count overflows.
fn peak_bytes(a: &LossArgs) -> Option<u64> {
    let (t, w, v) = (a.tokens as u64, a.width as u64, a.vocab as u64);
    let matrices = v.checked_mul(w)?.checked_mul(2)?;
    let states = t.checked_mul(w)?.checked_mul(2)?;
    let logits = t.checked_mul(v)?.checked_mul(3)?;
    matrices
        .checked_add(states)?
        .checked_add(logits)?
        .checked_mul(4)
}

/// Runs the benchmark and prints its table (or JSON rows).
pub fn run(a: &LossArgs) -> Result<()> {
    let what = format!(
        "--tokens {} --width {} --vocab {}",
        a.tokens, a.width, a.vocab
    );
    super::check_fits(peak_bytes(a), &what)?;
    track_allocations()?;
    tch::set_num_threads(a.threads);
    let kind = match a.dtype.as_str() {
        "bf16" => Kind::BFloat16,
        _ => Kind::Float,
    };
    tch::manual_seed(0);
    let opts = (Kind::Float, Device::Cpu);
    let h = Tensor::randn([a.tokens, a.width], opts)
        .to_kind(kind)
        .set_requires_grad(true);
    let w = (Tensor::randn([a.vocab, a.width], opts) * 0.02)
        .to_kind(kind)
        .set_requires_grad(!a.frozen_head);
    let y = Tensor::randint(a.vocab, [a.tokens], (Kind::Int64, Device::Cpu));
    let mut times = vec![Vec::new(); WAYS.len()];
    let mut peaks = vec![0u64; WAYS.len()];
    let mut losses = vec![0.0; WAYS.len()];
    // The first round warms up: not timed.
    for round in 0..=a.rounds {
        for (i, way) in WAYS.iter().enumerate() {
            let (loss, secs, peak) = step(way, &h, &w, &y)?;
            if round > 0 {
                times[i].push(secs);
            }
            peaks[i] = peaks[i].max(peak);
            losses[i] = loss;
        }
    }
    for (i, way) in WAYS.iter().enumerate() {
        if (losses[i] - losses[2]).abs() > 1e-3 * losses[2].abs() {
            bail!(
                "the {way} loss is {}, the fp32 logits' {}: they did not compute the same",
                losses[i],
                losses[2]
            );
        }
    }
    let medians: Vec<f64> = times.iter().map(|t| median(t)).collect();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if !a.json {
        println!(
            "head and loss, {} tokens x width {} -> vocabulary {}, {}{}, {} threads, medians of {} rounds; peer: the logits cast to fp32 (transformers' ForCausalLMLoss)",
            a.tokens,
            a.width,
            a.vocab,
            a.dtype,
            match a.frozen_head {
                true => ", the matrix frozen",
                false => "",
            },
            a.threads,
            a.rounds
        );
        println!(
            "{:<6} {:>10} {:>12} {:>14} {:>16}",
            "way", "step s", "peak GiB", "time vs fp32", "memory vs fp32"
        );
    }
    for (i, way) in WAYS.iter().enumerate() {
        let time_ratio = medians[i] / medians[2];
        let memory_ratio = peaks[i] as f64 / peaks[2].max(1) as f64;
        if a.json {
            let row = json!({
                "bench": "loss", "way": way, "tokens": a.tokens, "width": a.width,
                "vocab": a.vocab, "dtype": a.dtype, "threads": a.threads,
                "frozen_head": a.frozen_head,
                "step_s": medians[i], "peak_bytes": peaks[i], "loss": losses[i],
                "ratio_vs_peer": medians[2] / medians[i],
                "memory_vs_peer": memory_ratio,
            });
            println!("{row}");
        } else {
            println!(
                "{:<6} {:>10} {:>12} {:>14} {:>16}",
                way,
                cell(medians[i], 3, ""),
                cell(gib(peaks[i]), 3, ""),
                cell(time_ratio, 2, "x"),
                cell(memory_ratio, 3, "x"),
            );
        }
    }
    Ok(())
}

//! `zrt bench ...`: binaries' measurements against a peer and a limit
//! measured in the same run.
//!
//! This machine is noisy (timings swing 20-50%, a core can vanish for
//! minutes), so every benchmark runs zrt and its peers interleaved
//! (A B A B ...) over several rounds and reports medians.

pub mod adam;
pub mod collectives;
pub mod offload;
pub mod peer;
pub mod plot;
pub mod train;

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// Median of `xs` (the mean of the middle two for even lengths).
///
/// Returns NaN for an empty slice, so a missing measurement shows as NaN in
/// a table rather than as a plausible number.
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Seconds taken by each of `reps` calls of `f`.
pub fn time_each(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect()
}

/// A table cell for a figure that is missing without a peer (`NaN`): `-`
/// instead of `NaN`; `suffix` follows the number ("x" for ratios).
pub fn cell(x: f64, decimals: usize, suffix: &str) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}{suffix}")
    } else {
        "-".to_string()
    }
}

/// Single- or multi-threaded memory copy bandwidth in GB/s, counting bytes
/// read plus bytes written (the convention the Adam figures use), from the
/// median of `reps` copies of `bytes`.
pub fn copy_bandwidth(threads: usize, bytes: usize, reps: usize) -> f64 {
    let n = bytes / 4;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let chunk = n.div_ceil(threads.max(1));
    let times = time_each(reps, || {
        std::thread::scope(|s| {
            for (d, src) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(src));
            }
        });
    });
    std::hint::black_box(&dst);
    2.0 * (n * 4) as f64 / median(&times) / 1e9
}

/// Runs `world` processes of `program args` with the launch contract (the
/// same environment `zrt launch` sets, on loopback) and returns the JSON of
/// the line rank 0 printed as `@@zrt {...}`.
pub fn run_ranks(
    program: &std::path::Path,
    args: &[String],
    world: usize,
    env: &[(&str, String)],
) -> Result<Value> {
    let port = zrt::collectives::store::free_store_port("127.0.0.1")?.to_string();
    let token = format!("bench-{}-{port}", std::process::id());
    let path = peer::venv_path();
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut c = Command::new(program);
            c.args(args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("ZRT_TOKEN", &token)
                .env("OMP_NUM_THREADS", "1")
                // DeepSpeed JIT-builds with the venv's ninja.
                .env("PATH", &path)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn()
                .with_context(|| format!("starting {}", program.display()))
        })
        .collect::<Result<_>>()?;
    let mut line = None;
    for c in children {
        let o = c.wait_with_output()?;
        if !o.status.success() {
            bail!(
                "a rank of {} {:?} failed ({})",
                program.display(),
                args,
                o.status
            );
        }
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some(j) = l.split_once("@@zrt ").map(|x| x.1) {
                line = Some(serde_json::from_str(j)?);
            }
        }
    }
    line.context("no rank printed results")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}

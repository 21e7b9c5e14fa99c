//! Helpers around the optimizer step: sum of squares (global norm), any
//! inf-or-NaN (fp16 overflow), scale in place, and accumulate (micro-steps).
//!
//! `sum_of_squares` is deterministic: the slice is cut into a fixed number of
//! parts whatever the thread count, each part is summed in a fixed lane
//! order in f64, and the parts are added in order. Two runs with different
//! thread counts or SIMD levels agree to the bit, so the clip coefficient,
//! and with it every parameter, does too.

use rayon::prelude::*;

use crate::error::same_len;
use crate::simd::multiversion;
use crate::{KernelError, Threads};

/// Parts of a deterministic reduction (independent of the thread count).
const PARTS: usize = 64;
/// Independent accumulators per part: wide enough for LLVM to vectorize
/// without reordering any addition.
const LANES: usize = 8;

#[inline(always)]
fn sumsq_body(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            let v = c[j] as f64;
            acc[j] += v * v;
        }
    }
    for (j, &r) in chunks.remainder().iter().enumerate() {
        acc[j] += r as f64 * r as f64;
    }
    acc.iter().sum()
}
multiversion!(fn sumsq(x: &[f32]) -> f64 => sumsq_body);

#[inline(always)]
fn nonfinite_body(x: &[f32]) -> bool {
    let mut any = 0u32;
    for &v in x {
        any |= u32::from(v.to_bits() & 0x7F80_0000 == 0x7F80_0000);
    }
    any != 0
}
multiversion!(fn nonfinite(x: &[f32]) -> bool => nonfinite_body);

#[inline(always)]
fn scale_body(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}
multiversion!(fn scale_range(x: &mut [f32], s: f32) => scale_body);

#[inline(always)]
fn accumulate_body(dst: &mut [f32], src: &[f32]) {
    let n = dst.len();
    let src = &src[..n];
    for i in 0..n {
        dst[i] += src[i];
    }
}
multiversion!(fn accumulate_range(dst: &mut [f32], src: &[f32]) => accumulate_body);

/// Sum of squares of `x`, accumulated in f64, deterministic (see module docs).
pub fn sum_of_squares(threads: &Threads, x: &[f32]) -> f64 {
    let part = x.len().div_ceil(PARTS).max(1);
    let mut partials = [0f64; PARTS];
    if threads.chunk_len(x.len()).is_none() {
        for (out, c) in partials.iter_mut().zip(x.chunks(part)) {
            *out = sumsq(c);
        }
    } else {
        threads.install(|| {
            partials
                .par_iter_mut()
                .zip(x.par_chunks(part))
                .for_each(|(out, c)| *out = sumsq(c));
        });
    }
    partials.iter().sum()
}

/// Whether any element of `x` is infinite or NaN.
pub fn has_inf_or_nan(threads: &Threads, x: &[f32]) -> bool {
    match threads.chunk_len(x.len()) {
        None => nonfinite(x),
        Some(cs) => threads.install(|| x.par_chunks(cs).any(nonfinite)),
    }
}

/// `x *= s`, element-wise.
pub fn scale(threads: &Threads, x: &mut [f32], s: f32) {
    match threads.chunk_len(x.len()) {
        None => scale_range(x, s),
        Some(cs) => threads.install(|| x.par_chunks_mut(cs).for_each(|c| scale_range(c, s))),
    }
}

/// `dst += src`, element-wise (gradient accumulation over micro-steps).
pub fn accumulate(threads: &Threads, dst: &mut [f32], src: &[f32]) -> Result<(), KernelError> {
    same_len("src", src.len(), "dst", dst.len())?;
    match threads.chunk_len(dst.len()) {
        None => accumulate_range(dst, src),
        Some(cs) => threads.install(|| {
            dst.par_chunks_mut(cs)
                .zip(src.par_chunks(cs))
                .for_each(|(d, s)| accumulate_range(d, s))
        }),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
            .collect()
    }

    #[test]
    fn sum_of_squares_is_exact_enough_and_thread_independent() {
        let x = data(1_000_003);
        let exact: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let one = sum_of_squares(&Threads::new(1).unwrap(), &x);
        let two = sum_of_squares(&Threads::new(2).unwrap(), &x);
        let five = sum_of_squares(&Threads::new(5).unwrap(), &x);
        assert!((one - exact).abs() <= 1e-12 * exact, "{one} vs {exact}");
        assert_eq!(one.to_bits(), two.to_bits());
        assert_eq!(one.to_bits(), five.to_bits());
        assert_eq!(sum_of_squares(&Threads::new(2).unwrap(), &[]), 0.0);
        assert_eq!(sum_of_squares(&Threads::new(1).unwrap(), &[3.0, 4.0]), 25.0);
    }

    #[test]
    fn finds_a_single_inf_or_nan_anywhere() {
        let pool = Threads::new(2).unwrap();
        let n = 200_001;
        let mut x = data(n);
        assert!(!has_inf_or_nan(&pool, &x));
        for (pos, bad) in [
            (0, f32::INFINITY),
            (n / 2, f32::NAN),
            (n - 1, f32::NEG_INFINITY),
        ] {
            let keep = x[pos];
            x[pos] = bad;
            assert!(has_inf_or_nan(&pool, &x), "missed {bad} at {pos}");
            x[pos] = keep;
        }
        assert!(!has_inf_or_nan(&pool, &[f32::MAX, f32::MIN_POSITIVE, -0.0]));
    }

    #[test]
    fn scale_and_accumulate() {
        let pool = Threads::new(2).unwrap();
        let mut x = data(100_001);
        let y = x.clone();
        scale(&pool, &mut x, 0.5);
        assert!(x.iter().zip(&y).all(|(a, b)| *a == b * 0.5));
        accumulate(&pool, &mut x, &y).unwrap();
        assert!(x.iter().zip(&y).all(|(a, b)| *a == b * 0.5 + b));
        let e = accumulate(&pool, &mut x, &y[1..]).unwrap_err();
        assert!(e.to_string().contains("`src` has 100000"), "{e}");
    }
}

//! Block-wise int8 quantization for ZeRO++: qwZ's gathers
//! (`zero_quantized_weights`: each rank packs its shard into a quarter of
//! its f32 bytes, half of bf16's, the ranks all-gather the packed bytes
//! and every rank unpacks the whole into its compute dtype) and qgZ's
//! reductions (`zero_quantized_gradients`: each rank packs every rank's
//! piece of a gradient bucket, an all_to_all delivers them, and each rank
//! unpacks and sums the pieces of its own part).
//!
//! The engine cuts a buffer at every parameter's start and end and packs
//! each segment on its own ([`quantize_cut`]), so no scale spans two
//! parameters. A segment of `n` elements packs into [`packed_len`]`(n)`
//! bytes: one f32 scale (little-endian) per group of [`GROUP`] elements,
//! then the `n` signed 8-bit codes. A group's scale is its largest
//! magnitude over 127; an element's code is `round_ties_even(x * 127 /
//! max)`, so the largest magnitude of each group comes back to within an
//! ulp or two (then the compute dtype's rounding) and every other value
//! within half a step (`max / 254`). Symmetric, as DeepSpeed's qwZ: no
//! zero point.
//!
//! Non-finite values are not hidden: a group holding an inf or NaN gets a
//! NaN scale, and every element of it unpacks as NaN.
//!
//! Deterministic and the same on every vector level (no FMA contraction),
//! so every rank unpacks the same bits.

use half::{bf16, f16};

use crate::cast;
use crate::error::same_len;
use crate::simd::multiversion;
use crate::KernelError;

/// Elements per quantization group (one scale each). DeepSpeed's qwZ picks
/// groups of a few thousand elements too; a power of two keeps a shard's
/// groups aligned whatever its length.
pub const GROUP: usize = 2048;

/// Bytes a shard of `n` elements packs into: a 4-byte scale per group, a
/// byte per element.
pub fn packed_len(n: usize) -> usize {
    4 * n.div_ceil(GROUP) + n
}

/// An element type a gather can be quantized from and unpacked into.
pub trait Quantizable: Copy + Default {
    /// `src` as f32 (exact), in `buf` unless it is f32 already; `buf`
    /// must have `src`'s length.
    fn widen<'a>(src: &'a [Self], buf: &'a mut [f32]) -> Result<&'a [f32], KernelError>;
    /// `src` into `dst` (of `src`'s length), rounded to nearest even as
    /// libtorch's casts.
    fn narrow(src: &[f32], dst: &mut [Self]) -> Result<(), KernelError>;
}

impl Quantizable for f32 {
    fn widen<'a>(src: &'a [f32], _: &'a mut [f32]) -> Result<&'a [f32], KernelError> {
        Ok(src)
    }
    fn narrow(src: &[f32], dst: &mut [f32]) -> Result<(), KernelError> {
        same_len("dst", dst.len(), "src", src.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

impl Quantizable for bf16 {
    fn widen<'a>(src: &'a [bf16], buf: &'a mut [f32]) -> Result<&'a [f32], KernelError> {
        cast::bf16_to_f32(src, buf)?;
        Ok(buf)
    }
    fn narrow(src: &[f32], dst: &mut [bf16]) -> Result<(), KernelError> {
        cast::f32_to_bf16(src, dst)
    }
}

impl Quantizable for f16 {
    fn widen<'a>(src: &'a [f16], buf: &'a mut [f32]) -> Result<&'a [f32], KernelError> {
        cast::f16_to_f32(src, buf)?;
        Ok(buf)
    }
    fn narrow(src: &[f32], dst: &mut [f16]) -> Result<(), KernelError> {
        cast::f32_to_f16(src, dst)
    }
}

/// Adding and taking away 1.5 x 2^23 rounds an f32 of magnitude below 2^22
/// to the nearest integer, ties to even (the FPU's own rounding), in two
/// instructions every x86-64 vector level has: `round_ties_even` needs
/// SSE4.1, which the baseline build lacks, and is a call per element there.
const ROUND: f32 = 12_582_912.0;

/// The largest `|x|`'s bits: for non-negative floats the integer order is
/// the float order, and inf and NaN sort above every finite value, so one
/// integer maximum (which vectorizes, where `f32::max` does not) gives the
/// group's magnitude and whether it is finite.
#[inline(always)]
fn max_abs_bits_body(x: &[f32]) -> u32 {
    x.iter().fold(0, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF))
}

/// Codes of `x` at `inv` codes per unit.
#[inline(always)]
fn codes_body(x: &[f32], inv: f32, q: &mut [u8]) {
    for (q, v) in q.iter_mut().zip(x) {
        // |x * inv| <= 127 up to rounding, so the clamp only guards the
        // last ulp; the casts then cannot saturate.
        let y = ((v * inv).clamp(-127.0, 127.0) + ROUND) - ROUND;
        // SAFETY: `y` is a whole number in [-127, 127]: the caller passes
        // a finite `inv` for a group of finite values at most 127 / `inv`
        // in magnitude, so `v * inv` is finite.
        *q = unsafe { y.to_int_unchecked::<i32>() } as i8 as u8;
    }
}

/// Codes of a group whose `inv` would overflow, by division (slower, and
/// as rare as weights below 4e-37); a scale that underflowed to 0 (every
/// value below about 2e-43) gives zeros.
fn tiny_codes(x: &[f32], scale: f32, q: &mut [u8]) {
    for (q, v) in q.iter_mut().zip(x) {
        *q = match scale > 0.0 {
            // `as` saturates and takes NaN to 0: no precondition here.
            true => (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8 as u8,
            false => 0,
        };
    }
}

/// Values of codes `q` at `scale` each.
#[inline(always)]
fn values_body(q: &[u8], scale: f32, x: &mut [f32]) {
    for (x, &q) in x.iter_mut().zip(q) {
        *x = f32::from(q as i8) * scale;
    }
}

multiversion!(fn max_abs_bits(x: &[f32]) -> u32 => max_abs_bits_body);
multiversion!(fn codes(x: &[f32], inv: f32, q: &mut [u8]) => codes_body);
multiversion!(fn values(q: &[u8], scale: f32, x: &mut [f32]) => values_body);

/// Packs `src` into `dst` ([`packed_len`]`(src.len())` bytes).
pub fn quantize<T: Quantizable>(src: &[T], dst: &mut [u8]) -> Result<(), KernelError> {
    same_len("dst", dst.len(), "packed_len(src)", packed_len(src.len()))?;
    let (scales, codes_out) = dst.split_at_mut(4 * src.len().div_ceil(GROUP));
    let mut buf = vec![0f32; GROUP.min(src.len())];
    for ((x, q), s) in src
        .chunks(GROUP)
        .zip(codes_out.chunks_mut(GROUP))
        .zip(scales.chunks_mut(4))
    {
        let x = T::widen(x, &mut buf[..x.len()])?;
        let max = f32::from_bits(max_abs_bits(x));
        let scale = match max.is_finite() {
            true => max / 127.0,
            false => f32::NAN,
        };
        s.copy_from_slice(&scale.to_le_bytes());
        match (max.is_finite() && max > 0.0, 127.0 / max) {
            (true, inv) if inv.is_finite() => codes(x, inv, q),
            // A largest magnitude below about 4e-37: 127 / max overflows.
            (true, _) => tiny_codes(x, scale, q),
            (false, _) => q.fill(0),
        }
    }
    Ok(())
}

/// Unpacks `src` (a shard packed by [`quantize`]) into `dst`.
pub fn dequantize<T: Quantizable>(src: &[u8], dst: &mut [T]) -> Result<(), KernelError> {
    same_len("src", src.len(), "packed_len(dst)", packed_len(dst.len()))?;
    let (scales, codes_in) = src.split_at(4 * dst.len().div_ceil(GROUP));
    let mut buf = vec![0f32; GROUP.min(dst.len())];
    for ((x, q), s) in dst
        .chunks_mut(GROUP)
        .zip(codes_in.chunks(GROUP))
        .zip(scales.chunks(4))
    {
        let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let b = &mut buf[..x.len()];
        values(q, scale, b);
        T::narrow(b, x)?;
    }
    Ok(())
}

/// Bytes a buffer cut in segments of the lengths `cuts` packs into by
/// [`quantize_cut`]: each segment's [`packed_len`].
pub fn packed_len_cut(cuts: &[usize]) -> usize {
    cuts.iter().map(|&c| packed_len(c)).sum()
}

/// Packs `src`, cut in segments of the lengths `cuts` (which sum to its
/// length), each segment as [`quantize`] packs a buffer, one after the
/// other: groups restart at every cut, so no scale spans two segments
/// (the engine cuts at every parameter's start and end, so a parameter
/// with large values never sets a neighbour's scale).
pub fn quantize_cut<T: Quantizable>(
    src: &[T],
    cuts: &[usize],
    dst: &mut [u8],
) -> Result<(), KernelError> {
    same_len("src", src.len(), "sum of cuts", cuts.iter().sum())?;
    same_len(
        "dst",
        dst.len(),
        "packed_len_cut(cuts)",
        packed_len_cut(cuts),
    )?;
    let (mut at, mut to) = (0, 0);
    for &c in cuts {
        let p = packed_len(c);
        quantize(&src[at..at + c], &mut dst[to..to + p])?;
        (at, to) = (at + c, to + p);
    }
    Ok(())
}

/// Unpacks `src` (packed by [`quantize_cut`] with the same `cuts`) into
/// `dst`.
pub fn dequantize_cut<T: Quantizable>(
    src: &[u8],
    cuts: &[usize],
    dst: &mut [T],
) -> Result<(), KernelError> {
    same_len("dst", dst.len(), "sum of cuts", cuts.iter().sum())?;
    same_len(
        "src",
        src.len(),
        "packed_len_cut(cuts)",
        packed_len_cut(cuts),
    )?;
    let (mut at, mut from) = (0, 0);
    for &c in cuts {
        let p = packed_len(c);
        dequantize(&src[from..from + p], &mut dst[at..at + c])?;
        (at, from) = (at + c, from + p);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cast::f32_to_bf16_bits;

    /// A group's codes and scale computed the slow way, element by element.
    fn naive(x: &[f32]) -> (f32, Vec<i8>) {
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let q = x
            .iter()
            .map(|v| match max {
                0.0 => 0,
                _ => (v * (127.0 / max)).round_ties_even() as i8,
            })
            .collect();
        (max / 127.0, q)
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3 * (1 + i / GROUP) as f32)
            .collect()
    }

    #[test]
    fn cut_buffers_pack_each_segment_on_its_own() {
        // Large values then small ones: cut between them, the small ones
        // keep their own scale; uncut, they share the large ones' group.
        let mut x = vec![1.0f32; 100];
        x.extend((0..3000).map(|i| ((i % 17) as f32 - 8.0) * 1e-3));
        let cuts = [100, 3000];
        let mut p = vec![0u8; packed_len_cut(&cuts)];
        assert_eq!(p.len(), packed_len(100) + packed_len(3000));
        quantize_cut(&x, &cuts, &mut p).unwrap();
        let mut whole = vec![0u8; packed_len(3000)];
        quantize(&x[100..], &mut whole).unwrap();
        assert_eq!(
            &p[packed_len(100)..],
            &whole[..],
            "the second segment alone"
        );
        let mut y = vec![0f32; x.len()];
        dequantize_cut(&p, &cuts, &mut y).unwrap();
        let worst = |y: &[f32]| {
            (100..3100)
                .map(|i| (x[i] - y[i]).abs())
                .fold(0f32, f32::max)
        };
        assert!(worst(&y) <= 8e-3 / 254.0 * 1.0001, "{}", worst(&y));
        let mut uncut = vec![0u8; packed_len(x.len())];
        quantize(&x, &mut uncut).unwrap();
        dequantize(&uncut, &mut y).unwrap();
        assert!(worst(&y) > 1e-3, "uncut, the small values round to zero");
        // One segment is the plain format; cuts that do not sum to the
        // length are refused.
        let mut one = vec![0u8; packed_len(x.len())];
        quantize_cut(&x, &[x.len()], &mut one).unwrap();
        assert_eq!(one, uncut);
        assert!(quantize_cut(&x, &[100], &mut p).is_err());
        assert!(dequantize_cut(&p, &[100, 2999], &mut y).is_err());
    }

    #[test]
    fn packs_scales_then_codes_per_group() {
        let n = 2 * GROUP + 37;
        let x = values(n);
        let mut p = vec![0u8; packed_len(n)];
        quantize(&x, &mut p).unwrap();
        assert_eq!(p.len(), 12 + n);
        for (g, chunk) in x.chunks(GROUP).enumerate() {
            let (scale, q) = naive(chunk);
            let got = f32::from_le_bytes(p[4 * g..4 * g + 4].try_into().unwrap());
            assert_eq!(got.to_bits(), scale.to_bits(), "group {g}");
            let codes = &p[12 + g * GROUP..12 + g * GROUP + chunk.len()];
            assert_eq!(codes.iter().map(|&c| c as i8).collect::<Vec<_>>(), q);
        }
    }

    #[test]
    fn unpacks_within_half_a_step_and_the_largest_exactly() {
        let n = GROUP + 100;
        let x = values(n);
        let mut p = vec![0u8; packed_len(n)];
        quantize(&x, &mut p).unwrap();
        let mut y = vec![0f32; n];
        dequantize(&p, &mut y).unwrap();
        for chunk in [0..GROUP, GROUP..n] {
            let max = x[chunk.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
            for i in chunk {
                assert!((x[i] - y[i]).abs() <= max / 254.0 * 1.0001, "{i}");
                if x[i].abs() == max {
                    assert!((x[i] - y[i]).abs() <= max * 1e-6, "{i}");
                }
            }
        }
        // bf16 out: the f32 result rounded.
        let mut b = vec![bf16::ZERO; n];
        dequantize(&p, &mut b).unwrap();
        for (b, y) in b.iter().zip(&y) {
            assert_eq!(b.to_bits(), f32_to_bf16_bits(*y));
        }
    }

    #[test]
    fn zeros_and_non_finite_groups() {
        let mut x = vec![0f32; 2 * GROUP];
        x[GROUP + 3] = f32::NAN;
        x[GROUP + 4] = 1.0;
        let mut p = vec![0u8; packed_len(x.len())];
        quantize(&x, &mut p).unwrap();
        let mut y = vec![1f32; x.len()];
        dequantize(&p, &mut y).unwrap();
        assert!(y[..GROUP].iter().all(|v| *v == 0.0));
        assert!(
            y[GROUP..].iter().all(|v| v.is_nan()),
            "a NaN poisons its group"
        );
        x[GROUP + 3] = f32::INFINITY;
        quantize(&x, &mut p).unwrap();
        dequantize(&p, &mut y).unwrap();
        assert!(y[GROUP..].iter().all(|v| v.is_nan()), "so does an inf");
    }

    #[test]
    fn tiny_groups_pack_by_division_and_vanishing_ones_as_zeros() {
        for max in [1e-38f32, 3e-40, 1e-45] {
            let x: Vec<f32> = (0..100).map(|i| max * (i as f32 - 50.0) / 50.0).collect();
            let mut p = vec![0u8; packed_len(x.len())];
            quantize(&x, &mut p).unwrap();
            let mut y = vec![1f32; x.len()];
            dequantize(&p, &mut y).unwrap();
            for (a, b) in x.iter().zip(&y) {
                assert!(b.is_finite(), "{max}");
                // Half a step, plus the subnormal scale's own rounding.
                assert!(
                    (a - b).abs() <= max / 254.0 * 1.01 + 2.0 * f32::from_bits(1) * 127.0,
                    "{max}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn cut_f16_buffers_unpack_segment_by_segment() {
        let n = 48;
        let shards: Vec<Vec<f16>> = (0..3)
            .map(|r| {
                values(n)
                    .iter()
                    .map(|v| f16::from_f32(v * (r + 1) as f32))
                    .collect()
            })
            .collect();
        let whole: Vec<f16> = shards.concat();
        let mut packed = vec![0u8; packed_len_cut(&[n; 3])];
        quantize_cut(&whole, &[n; 3], &mut packed).unwrap();
        let mut all = vec![f16::ZERO; 3 * n];
        dequantize_cut(&packed, &[n; 3], &mut all).unwrap();
        for (r, s) in shards.iter().enumerate() {
            let mut one = vec![f16::ZERO; n];
            let mut p = vec![0u8; packed_len(n)];
            quantize(s, &mut p).unwrap();
            dequantize(&p, &mut one).unwrap();
            assert_eq!(&all[r * n..(r + 1) * n], &one[..]);
        }
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let mut p = vec![0u8; packed_len(10) - 1];
        assert!(matches!(
            quantize(&[0f32; 10], &mut p),
            Err(KernelError::LengthMismatch { name: "dst", .. })
        ));
        assert!(dequantize_cut(&[0u8; 10], &[4, 2], &mut [0f32; 6]).is_err());
        // The element conversions, public, check too.
        assert!(f32::narrow(&[0.0; 3], &mut [0.0; 2]).is_err());
        assert!(bf16::narrow(&[0.0; 3], &mut [bf16::ZERO; 2]).is_err());
        assert!(f16::widen(&[f16::ZERO; 3], &mut [0.0; 2]).is_err());
    }

    /// What the engine's packed frozen shards rely on to resume to the
    /// same bits from a checkpoint of their unpacked fp32 values: packing
    /// them again gives the same bytes. The scale `max / 127` survives
    /// `127 * scale / 127` (checked here for every 997th normal `max` below
    /// 2^127; all of them once, by hand, on 2026-11-29), and the codes are
    /// whole numbers scaled back.
    #[test]
    fn packing_unpacked_fp32_values_again_gives_the_same_bytes() {
        let mut bits: u32 = 0x0080_0000;
        while bits < 0x7f00_0000 {
            let max = f32::from_bits(bits);
            let scale = max / 127.0;
            assert_eq!((127.0 * scale) / 127.0, scale, "max {max:e}");
            bits += 997;
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        for _ in 0..2000 {
            let magnitude = 10f32.powf(next() * 60.0 - 30.0);
            let n = 1 + (next() * 3000.0) as usize;
            let x: Vec<f32> = (0..n).map(|_| (2.0 * next() - 1.0) * magnitude).collect();
            let mut packed = vec![0u8; packed_len(n)];
            quantize(&x, &mut packed).unwrap();
            let mut back = vec![0f32; n];
            dequantize(&packed, &mut back).unwrap();
            let mut again = vec![0u8; packed_len(n)];
            quantize(&back, &mut again).unwrap();
            assert_eq!(again, packed, "{n} values near {magnitude:e}");
        }
    }
}

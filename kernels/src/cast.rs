//! f32 <-> bf16 / f16 casts, bit-identical to libtorch 2.13's CPU `to()`.
//!
//! Round-to-nearest-even everywhere. NaN handling follows what libtorch's
//! vectorized CPU kernels produce (measured, and pinned by the tests in
//! `tests/kernels_vs_libtorch.rs`), which is not what IEEE or the `half` crate do:
//!
//! | cast | NaN becomes |
//! |---|---|
//! | f32 -> bf16 | `0xFFFF`, whatever its sign or payload |
//! | f32 -> f16 | sign, `0x7E00`, and the top 9 payload bits (F16C's rule) |
//! | bf16 -> f32 | the bits shifted left by 16 (payload kept) |
//! | f16 -> f32 | sign, `0x7FC0_0000`, and the payload shifted up (F16C's rule) |
//!
//! libtorch is not self-consistent for f16 -> f32: its vectorized body (groups
//! of 8 elements) follows the rule above, but the scalar tail of a tensor
//! whose length is not a multiple of 8 turns every NaN into `0x7FFF_FFFF`.
//! zrt follows the vectorized rule everywhere; either way the value is NaN.
//!
//! The slice functions are branch-free per element so the compiler
//! vectorizes them; see [`crate::simd`].

use half::{bf16, f16};

use crate::error::same_len;
use crate::simd::multiversion;
use crate::KernelError;

/// f32 -> bf16 bits, round-to-nearest-even; NaN -> `0xFFFF` (libtorch's rule).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        0xFFFF
    } else {
        rounded
    }
}

/// bf16 bits -> f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 -> f16 bits, round-to-nearest-even, overflow to inf, subnormals
/// rounded correctly; NaN keeps its sign and top payload bits, quieted.
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    const INF: u32 = 0xFF << 23;
    // Smallest f32 that rounds to f16 infinity's exponent range: 2^16.
    const F16_OVERFLOW: u32 = (127 + 16) << 23;
    // Below 2^-14 the result is an f16 subnormal (or zero).
    const F16_MIN_NORMAL: u32 = (127 - 14) << 23;
    // Adding 0.5 (as an f32 with this exponent) aligns the subnormal's bits so
    // the FPU's own round-to-nearest-even does the rounding.
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;

    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let a = bits & 0x7FFF_FFFF;

    let nan = 0x7E00 | ((a >> 13) & 0x3FF) as u16;
    let big = if a > INF { nan } else { 0x7C00 };
    let sub = {
        let f = f32::from_bits(a) + f32::from_bits(DENORM_MAGIC);
        f.to_bits().wrapping_sub(DENORM_MAGIC) as u16
    };
    let normal = {
        let odd = (a >> 13) & 1;
        let r = a
            .wrapping_add(((15u32).wrapping_sub(127) << 23).wrapping_add(0xFFF))
            .wrapping_add(odd);
        (r >> 13) as u16
    };
    let out = if a >= F16_OVERFLOW {
        big
    } else if a < F16_MIN_NORMAL {
        sub
    } else {
        normal
    };
    out | sign
}

/// f16 bits -> f32 (exact); NaN keeps sign and payload, quieted (libtorch's
/// vectorized rule).
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1F;
    let mant = h & 0x3FF;
    let normal = sign | ((exp + 112) << 23) | (mant << 13);
    // Subnormal: mant * 2^-24, exact in f32.
    let sub = sign | (mant as f32 * f32::from_bits(0x3380_0000)).to_bits();
    let special = if mant != 0 {
        sign | 0x7FC0_0000 | (mant << 13)
    } else {
        sign | 0x7F80_0000
    };
    let bits = if exp == 0x1F {
        special
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(bits)
}

#[inline(always)]
fn map_to_u16(src: &[f32], dst: &mut [u16], f: impl Fn(f32) -> u16) {
    let n = dst.len().min(src.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    for i in 0..n {
        dst[i] = f(src[i]);
    }
}

#[inline(always)]
fn map_to_f32(src: &[u16], dst: &mut [f32], f: impl Fn(u16) -> f32) {
    let n = dst.len().min(src.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    for i in 0..n {
        dst[i] = f(src[i]);
    }
}

#[inline(always)]
fn bf16_from_f32_body(src: &[f32], dst: &mut [u16]) {
    map_to_u16(src, dst, f32_to_bf16_bits)
}
#[inline(always)]
fn f16_from_f32_body(src: &[f32], dst: &mut [u16]) {
    map_to_u16(src, dst, f32_to_f16_bits)
}
#[inline(always)]
fn f32_from_bf16_body(src: &[u16], dst: &mut [f32]) {
    map_to_f32(src, dst, bf16_bits_to_f32)
}
#[inline(always)]
fn f32_from_f16_body(src: &[u16], dst: &mut [f32]) {
    map_to_f32(src, dst, f16_bits_to_f32)
}

multiversion!(pub(crate) fn bf16_from_f32_bits(src: &[f32], dst: &mut [u16]) => bf16_from_f32_body);
multiversion!(pub(crate) fn f16_from_f32_bits(src: &[f32], dst: &mut [u16]) => f16_from_f32_body);
multiversion!(fn f32_from_bf16_bits(src: &[u16], dst: &mut [f32]) => f32_from_bf16_body);
multiversion!(fn f32_from_f16_bits(src: &[u16], dst: &mut [f32]) => f32_from_f16_body);

fn bits_mut<T>(s: &mut [T]) -> &mut [u16] {
    debug_assert_eq!(std::mem::size_of::<T>(), 2);
    // SAFETY: only called with `half::bf16` / `half::f16`, which are
    // `repr(transparent)` over `u16`; same length, same alignment.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u16>(), s.len()) }
}

fn bits<T>(s: &[T]) -> &[u16] {
    debug_assert_eq!(std::mem::size_of::<T>(), 2);
    // SAFETY: as in `bits_mut`.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u16>(), s.len()) }
}

/// The `u16` bits of a bf16 slice, mutably (used by fused kernels).
pub(crate) fn bf16_bits_mut(s: &mut [bf16]) -> &mut [u16] {
    bits_mut(s)
}

/// The `u16` bits of an f16 slice, mutably (used by fused kernels).
pub(crate) fn f16_bits_mut(s: &mut [f16]) -> &mut [u16] {
    bits_mut(s)
}

/// Casts `src` into `dst` as bf16 (libtorch's rounding and NaN rule).
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<(), KernelError> {
    same_len("dst", dst.len(), "src", src.len())?;
    bf16_from_f32_bits(src, bits_mut(dst));
    Ok(())
}

/// Casts `src` into `dst` as f16 (libtorch's rounding and NaN rule).
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<(), KernelError> {
    same_len("dst", dst.len(), "src", src.len())?;
    f16_from_f32_bits(src, bits_mut(dst));
    Ok(())
}

/// Widens bf16 `src` into `dst` (exact).
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) -> Result<(), KernelError> {
    same_len("dst", dst.len(), "src", src.len())?;
    f32_from_bf16_bits(bits(src), dst);
    Ok(())
}

/// Widens f16 `src` into `dst` (exact; NaN as libtorch's vectorized path).
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) -> Result<(), KernelError> {
    same_len("dst", dst.len(), "src", src.len())?;
    f32_from_f16_bits(bits(src), dst);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite f16 round-trips through f32 and back unchanged, and
    /// agrees with the `half` crate (an independent implementation) on
    /// every non-NaN value.
    #[test]
    fn f16_all_bit_patterns_agree_with_half() {
        for h in 0..=u16::MAX {
            let x = f16_bits_to_f32(h);
            let reference = f16::from_bits(h);
            if reference.is_nan() {
                let quiet = u32::from(h & 0x8000) << 16 | 0x7FC0_0000 | u32::from(h & 0x3FF) << 13;
                assert_eq!(x.to_bits(), quiet, "h={h:#06x}");
                continue;
            }
            assert_eq!(x.to_bits(), reference.to_f32().to_bits(), "h={h:#06x}");
            assert_eq!(f32_to_f16_bits(x), h, "round trip of {h:#06x}");
        }
    }

    #[test]
    fn f32_to_f16_matches_half_on_a_sweep_of_f32_bits() {
        // Every 97th f32 bit pattern covers all exponents, subnormals and
        // rounding cases without taking long.
        let mut b: u32 = 0;
        while let Some(next) = b.checked_add(97) {
            let x = f32::from_bits(b);
            if !x.is_nan() {
                assert_eq!(
                    f32_to_f16_bits(x),
                    f16::from_f32(x).to_bits(),
                    "x bits {b:#010x}"
                );
                assert_eq!(
                    f32_to_bf16_bits(x),
                    bf16::from_f32(x).to_bits(),
                    "x bits {b:#010x}"
                );
            }
            b = next;
        }
    }

    #[test]
    fn slices_equal_scalars_at_every_level_and_odd_length() {
        let src: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.37e-3).collect();
        let mut a = vec![0u16; src.len()];
        bf16_from_f32_bits(&src, &mut a);
        for (s, d) in src.iter().zip(&a) {
            assert_eq!(*d, f32_to_bf16_bits(*s));
        }
        f16_from_f32_bits(&src, &mut a);
        for (s, d) in src.iter().zip(&a) {
            assert_eq!(*d, f32_to_f16_bits(*s));
        }
    }

    #[test]
    fn length_mismatch_is_an_error_naming_both() {
        let err = f32_to_bf16(&[1.0; 3], &mut [bf16::ZERO; 2]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "slice `dst` has 2 elements but `src` has 3: every slice of one shard must have the same length"
        );
    }
}

//! Element types a collective moves, and how they reduce.

use half::{bf16, f16};

/// The element type of a buffer, as named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// Byte.
    U8,
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::U8 => "u8",
        })
    }
}

mod sealed {
    /// Only plain-old-data types the crate knows: backends move them as bytes.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for i64 {}
    impl Sealed for u8 {}
}

/// A type collectives can move and reduce. Sealed: every implementor is
/// plain old data (any bit pattern valid, no padding), so backends may copy
/// it through shared memory or sockets as bytes.
///
/// Half-precision sums are accumulated in f32 and rounded once per element
/// (what NCCL and gloo do), so a sum over ranks loses no more than one
/// rounding. Integer sums wrap.
pub trait Element:
    sealed::Sealed + Copy + Send + Sync + PartialOrd + std::fmt::Debug + 'static
{
    /// This type's tag.
    const DTYPE: DType;
    /// The additive identity.
    const ZERO: Self;
    /// Reduces `xs` (one value per rank, in rank order) with `op`.
    fn reduce(xs: impl Iterator<Item = Self>, op: crate::ReduceOp) -> Self;
    /// `dst[i] = reduce(srcs[0][i], srcs[1][i], ...)`, same bits as
    /// [`Element::reduce`]; `srcs` are in rank order and as long as `dst`.
    /// Backends override nothing: this is the one reduction every backend
    /// uses, so they all compute identical bits.
    fn reduce_into(dst: &mut [Self], srcs: &[&[Self]], op: crate::ReduceOp) {
        for (i, d) in dst.iter_mut().enumerate() {
            *d = Self::reduce(srcs.iter().map(|s| s[i]), op);
        }
    }
    /// [`Element::reduce_into`] (the same bits) into a `dst` that is not in
    /// cache and will not be read soon, with non-temporal stores fused into
    /// the reduction, then a store fence; or `false`, touching nothing, where
    /// there is no such kernel (only f32 sums and averages with AVX2 have
    /// one). Used by the shm backend's out-of-place reduce_scatter. Panics,
    /// as `reduce_into` does, if a source is shorter than `dst`.
    #[doc(hidden)]
    fn reduce_into_streaming(dst: &mut [Self], srcs: &[&[Self]], op: crate::ReduceOp) -> bool {
        let _ = (dst, srcs, op);
        false
    }
    /// [`Element::reduce_into`] (the same bits) over one of its own
    /// sources: `own` is rank `me`'s source and the destination, `others`
    /// the other ranks' sources in rank order; or `false`, touching
    /// nothing, where there is no such kernel (only f32 sums and averages
    /// with AVX2 have one). Used by the shm backend's in-place and
    /// symmetric reduce_scatter, which otherwise reduce into a scratch
    /// window and copy it back. Panics if a source is not as long as `own`
    /// or `me > others.len()`.
    #[doc(hidden)]
    fn reduce_over(own: &mut [Self], others: &[&[Self]], me: usize, op: crate::ReduceOp) -> bool {
        let _ = (own, others, me, op);
        false
    }
}

/// Elements per block of the blocked float reduction (f64 accumulators on the stack).
const BLOCK: usize = 256;
/// How far ahead (elements) the reduction prefetches its sources: the loop
/// is bound by how many misses one core keeps in flight; measured on 2 shm
/// ranks at 128 MiB, reduce_scatter +20%, in place +27%.
const PREFETCH_AHEAD: usize = 1024;

macro_rules! float_element {
    ($t:ty, $d:expr, $zero:expr, $to:expr, $from:expr) => {
        float_element!(
            $t,
            $d,
            $zero,
            $to,
            $from,
            |_: &mut [$t], _: &[&[$t]], _: bool, _: bool| false,
            |_: &mut [$t], _: &[&[$t]], _: usize, _: bool| false
        );
    };
    ($t:ty, $d:expr, $zero:expr, $to:expr, $from:expr, $vector:expr, $over:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const ZERO: Self = $zero;
            fn reduce(xs: impl Iterator<Item = Self>, op: crate::ReduceOp) -> Self {
                use crate::ReduceOp::*;
                let to = $to;
                let from = $from;
                let mut n = 0usize;
                let mut acc: Option<f64> = None;
                for x in xs {
                    let x = to(x);
                    n += 1;
                    acc = Some(match (acc, op) {
                        (None, _) => x,
                        (Some(a), Sum | Avg) => a + x,
                        (Some(a), Max) => {
                            if x > a || x.is_nan() {
                                x
                            } else {
                                a
                            }
                        }
                        (Some(a), Min) => {
                            if x < a || x.is_nan() {
                                x
                            } else {
                                a
                            }
                        }
                    });
                }
                let a = acc.unwrap_or(0.0);
                from(if op == Avg && n > 0 { a / n as f64 } else { a })
            }

            fn reduce_into(dst: &mut [Self], srcs: &[&[Self]], op: crate::ReduceOp) {
                use crate::ReduceOp::*;
                if !matches!(op, Sum | Avg) || srcs.is_empty() {
                    for (i, d) in dst.iter_mut().enumerate() {
                        *d = Self::reduce(srcs.iter().map(|s| s[i]), op);
                    }
                    return;
                }
                if !$vector(dst, srcs, op == Avg, false) {
                    sum_into(dst, srcs, op == Avg, $to, $from);
                }
            }

            fn reduce_into_streaming(
                dst: &mut [Self],
                srcs: &[&[Self]],
                op: crate::ReduceOp,
            ) -> bool {
                use crate::ReduceOp::*;
                matches!(op, Sum | Avg) && !srcs.is_empty() && $vector(dst, srcs, op == Avg, true)
            }

            fn reduce_over(
                own: &mut [Self],
                others: &[&[Self]],
                me: usize,
                op: crate::ReduceOp,
            ) -> bool {
                use crate::ReduceOp::*;
                matches!(op, Sum | Avg) && $over(own, others, me, op == Avg)
            }
        }
    };
}

/// Sum (or average) of `srcs` into `dst` with the arithmetic of
/// [`Element::reduce`] (f64, rank order, one rounding), compiled for the
/// widest vector unit the CPU has (`zrt_kernels::simd::level`). The loop is
/// compute-bound at baseline SSE2 (two f64 lanes): AVX2 doubled the rate
/// from memory (1.7 -> 3.2 Gelem/s, f32, 2 sources). Bits do not depend on
/// the level: conversions and additions are exact IEEE operations and Rust
/// never fuses them.
fn sum_into<T: Copy>(
    dst: &mut [T],
    srcs: &[&[T]],
    avg: bool,
    to: impl Fn(T) -> f64 + Copy,
    from: impl Fn(f64) -> T + Copy,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use zrt_kernels::simd::{level, Level};
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        unsafe fn v512<T: Copy>(
            d: &mut [T],
            s: &[&[T]],
            avg: bool,
            to: impl Fn(T) -> f64 + Copy,
            from: impl Fn(f64) -> T + Copy,
        ) {
            sum_blocked(d, s, avg, to, from)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn v256<T: Copy>(
            d: &mut [T],
            s: &[&[T]],
            avg: bool,
            to: impl Fn(T) -> f64 + Copy,
            from: impl Fn(f64) -> T + Copy,
        ) {
            sum_blocked(d, s, avg, to, from)
        }
        match level() {
            // SAFETY: `level()` only reports features the CPU has.
            Level::Avx512 => return unsafe { v512(dst, srcs, avg, to, from) },
            Level::Avx2 => return unsafe { v256(dst, srcs, avg, to, from) },
            Level::Base => {}
        }
    }
    sum_blocked(dst, srcs, avg, to, from)
}

/// The body of [`sum_into`], blocked so it vectorizes across elements.
#[inline(always)]
fn sum_blocked<T: Copy>(
    dst: &mut [T],
    srcs: &[&[T]],
    avg: bool,
    to: impl Fn(T) -> f64 + Copy,
    from: impl Fn(f64) -> T + Copy,
) {
    let n = srcs.len() as f64;
    // Dividing by a power of two is multiplying by its exact inverse (the
    // same real number, so the same rounding), and a division per element
    // is what made Avg slower than Sum.
    let halvings = srcs.len().is_power_of_two().then(|| 1.0 / n);
    let mut acc = [0f64; BLOCK];
    let mut start = 0;
    while start < dst.len() {
        let end = (start + BLOCK).min(dst.len());
        for s in srcs {
            crate::stream::prefetch(
                &s[(start + PREFETCH_AHEAD).min(s.len())..(end + PREFETCH_AHEAD).min(s.len())],
            );
        }
        let acc = &mut acc[..end - start];
        for (a, &x) in acc.iter_mut().zip(&srcs[0][start..end]) {
            *a = to(x);
        }
        for s in &srcs[1..] {
            for (a, &x) in acc.iter_mut().zip(&s[start..end]) {
                *a += to(x);
            }
        }
        let out = dst[start..end].iter_mut().zip(acc.iter());
        match (avg, halvings) {
            (true, Some(s)) => out.for_each(|(d, &a)| *d = from(a * s)),
            (true, None) => out.for_each(|(d, &a)| *d = from(a / n)),
            _ => out.for_each(|(d, &a)| *d = from(a)),
        }
        start = end;
    }
}

/// [`sum_into`] for f32 with AVX2, the sum in f64 vector registers; `false`
/// without AVX2. The same arithmetic (f64 in rank order, one rounding), so
/// the same bits. With `stream`, `dst` is written with non-temporal stores
/// straight from the registers, then a store fence.
///
/// Without `stream` this is every f32 sum's kernel: the blocked loop
/// round-trips each block through an f64 array and ran at 2.7 Gelem/s on
/// 128K elements of 2 sources in cache, this loop at 6.3 (48 -> 21 us).
/// With it, against summing each window into a scratch and streaming that
/// out (one more pass over the window, through L2), an out-of-place
/// reduce_scatter of 128 MiB on 2 shm ranks took a median 22.2 ms against
/// 24.9, faster in 10 of 12 interleaved pairs, and became as fast as the
/// in-place one (in an hour when this VM's memcpy ran at a third of its
/// usual speed, so the times are twice those of the 2026-11-24 table in
/// docs/collectives-bench.md).
///
/// # Panics
/// If a source is not as long as `dst` (the vector loop reads unchecked).
fn sum_f32_vector(dst: &mut [f32], srcs: &[&[f32]], avg: bool, stream: bool) -> bool {
    assert!(
        srcs.iter().all(|s| s.len() == dst.len()),
        "reduce_into: every source must be as long as the destination"
    );
    #[cfg(target_arch = "x86_64")]
    if f32_kernels() {
        // SAFETY: `f32_kernels()` holds only where the CPU has AVX2.
        unsafe { sum_f32_avx2(dst, srcs, avg, stream) };
        if stream {
            crate::stream::fence();
        }
        return true;
    }
    let _ = (dst, srcs, avg, stream);
    false
}

/// Whether the f32 vector kernels run here: AVX2 (or more) on x86-64, as
/// `zrt_kernels::simd::level` reports it (`ZRT_SIMD` can lower it).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn f32_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use zrt_kernels::simd::{level, Level};
        matches!(level(), Level::Avx2 | Level::Avx512)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_f32_avx2(dst: &mut [f32], srcs: &[&[f32]], avg: bool, stream: bool) {
    // Up to the first 32-byte boundary (where a streaming store may go)
    // and the tail past the last whole vector: the blocked loop.
    let lead = match stream {
        true => dst.as_ptr().align_offset(32).min(dst.len()),
        false => 0,
    };
    let body = (dst.len() - lead) / 8 * 8;
    let (head, rest) = dst.split_at_mut(lead);
    let (mid, tail) = rest.split_at_mut(body);
    let part =
        |r: std::ops::Range<usize>| -> Vec<&[f32]> { srcs.iter().map(|s| &s[r.clone()]).collect() };
    sum_blocked(head, &part(0..lead), avg, F32_TO, F32_FROM);
    sum_blocked(
        tail,
        &part(lead + body..srcs[0].len()),
        avg,
        F32_TO,
        F32_FROM,
    );
    let from: Vec<*const f32> = srcs.iter().map(|s| s.as_ptr().add(lead)).collect();
    // SAFETY: `mid` holds `body` elements and each source as many past
    // `lead` (each is as long as `dst`); aligned past `lead` when streaming.
    sum_f32_avx2_body(mid.as_mut_ptr(), &from, body, avg, stream);
}

/// [`sum_f32_vector`] over one of the sources (`Element::reduce_over`).
fn sum_f32_over(own: &mut [f32], others: &[&[f32]], me: usize, avg: bool) -> bool {
    assert!(
        others.iter().all(|s| s.len() == own.len()) && me <= others.len(),
        "reduce_over: every source must be as long as the destination, and `me` a rank"
    );
    #[cfg(target_arch = "x86_64")]
    if f32_kernels() {
        // SAFETY: `f32_kernels()` holds only where the CPU has AVX2.
        unsafe { sum_f32_over_avx2(own, others, me, avg) };
        return true;
    }
    let _ = (own, others, me, avg);
    false
}

/// Against reducing into a scratch window and copying it back (what the
/// other types do), one pass less over the window, and the destination is
/// prefetched as a source: reading it is what brings its lines in.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_f32_over_avx2(own: &mut [f32], others: &[&[f32]], me: usize, avg: bool) {
    let body = own.len() / 8 * 8;
    {
        // The tail, under one vector, from a copy of this rank's, so no
        // source aliases the destination.
        let (_, tail) = own.split_at_mut(body);
        let mut mine = [0f32; 8];
        mine[..tail.len()].copy_from_slice(tail);
        let mut srcs: Vec<&[f32]> = others.iter().map(|s| &s[body..]).collect();
        srcs.insert(me, &mine[..tail.len()]);
        sum_blocked(tail, &srcs, avg, F32_TO, F32_FROM);
    }
    let d = own.as_mut_ptr();
    let mut from: Vec<*const f32> = others.iter().map(|s| s.as_ptr()).collect();
    from.insert(me, d.cast_const());
    // SAFETY: `d` holds `own.len() >= body` elements, as does each source;
    // the one that is `d` itself is read before each vector is stored.
    sum_f32_avx2_body(d, &from, body, avg, false);
}

/// f32 -> f64 -> f32 for the blocked loop's head and tail of the f32 kernels.
const F32_TO: fn(f32) -> f64 = |x| x as f64;
const F32_FROM: fn(f64) -> f32 = |x| x as f32;

/// The vector loop of the f32 kernels: `len` (a multiple of 8) sums of
/// `srcs` (in rank order) into `d`. A source may be `d` itself: each vector
/// is loaded from every source before it is stored.
///
/// # Safety
/// AVX2; `d` and every source valid for `len` elements; with `stream`, `d`
/// 32-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_f32_avx2_body(d: *mut f32, srcs: &[*const f32], len: usize, avg: bool, stream: bool) {
    use std::arch::x86_64::*;
    if let [a, b] = *srcs {
        return sum2_f32_avx2_body(d, a, b, len, avg, stream);
    }
    let n = srcs.len() as f64;
    let inverse = srcs
        .len()
        .is_power_of_two()
        .then(|| _mm256_set1_pd(1.0 / n));
    let count = _mm256_set1_pd(n);
    let mut i = 0;
    while i < len {
        if i % 16 == 0 {
            for s in srcs {
                // A hint only: it never faults, even past the end.
                _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(i + PREFETCH_AHEAD).cast());
            }
        }
        // SAFETY: `i + 8 <= len`, which every source holds.
        let load = |s: *const f32, half: usize| _mm256_cvtps_pd(_mm_loadu_ps(s.add(i + half)));
        let (mut lo, mut hi) = (load(srcs[0], 0), load(srcs[0], 4));
        for &s in &srcs[1..] {
            lo = _mm256_add_pd(lo, load(s, 0));
            hi = _mm256_add_pd(hi, load(s, 4));
        }
        if avg {
            match inverse {
                Some(inv) => {
                    lo = _mm256_mul_pd(lo, inv);
                    hi = _mm256_mul_pd(hi, inv);
                }
                None => {
                    lo = _mm256_div_pd(lo, count);
                    hi = _mm256_div_pd(hi, count);
                }
            }
        }
        let v = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
        // SAFETY: 8 floats of `d` follow `d + i`, 32-byte aligned when
        // streaming (the caller's promise).
        match stream {
            true => _mm256_stream_ps(d.add(i), v),
            false => _mm256_storeu_ps(d.add(i), v),
        }
        i += 8;
    }
}

/// [`sum_f32_avx2_body`] for two sources, in f32: the same bits without
/// the f64 round trip. The f32 sum of two f32s is their exact sum rounded
/// once, as is the f64 sum rounded to f32 (f64 has more than 2 x 24 + 2
/// bits, so rounding twice changes nothing: Figueroa, "When is double
/// rounding innocuous?", 1995). Halving that sum is exact where it stays
/// normal, and where it would not, the sum was exact (two multiples of
/// 2^-149 under 2^-125 add exactly), so the halving rounds once. What is
/// left is a sum that overflows f32 whose half would not, or a NaN: an Avg
/// vector holding one is summed in f64 as with more sources.
///
/// Why: with 2 sources the f64 loop is bound by its conversions (six a
/// vector), not by memory: a C check on this project's VM, 128K outputs in
/// L2 6.7 -> 4.3 us, 512K outputs 26.8 -> 20.2 us, 8M 595 -> 507 us.
///
/// # Safety
/// As [`sum_f32_avx2_body`], with `a` and `b` its two sources.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum2_f32_avx2_body(
    d: *mut f32,
    a: *const f32,
    b: *const f32,
    len: usize,
    avg: bool,
    stream: bool,
) {
    use std::arch::x86_64::*;
    let half = _mm256_set1_ps(0.5);
    let half_pd = _mm256_set1_pd(0.5);
    let max = _mm256_set1_ps(f32::MAX);
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let mut i = 0;
    while i < len {
        if i % 16 == 0 {
            // A hint only: it never faults, even past the end.
            _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(i + PREFETCH_AHEAD).cast());
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(i + PREFETCH_AHEAD).cast());
        }
        // SAFETY: `i + 8 <= len`, which both sources hold.
        let (x, y) = (_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)));
        let sum = _mm256_add_ps(x, y);
        let v = match avg {
            false => sum,
            // Some lane infinite or NaN (unordered compares true): in f64.
            true if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLE_UQ>(
                _mm256_and_ps(sum, magnitude),
                max,
            )) != 0 =>
            {
                let wide = |v: __m256, hi: bool| match hi {
                    true => _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v)),
                    false => _mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                };
                let lo = _mm256_mul_pd(_mm256_add_pd(wide(x, false), wide(y, false)), half_pd);
                let hi = _mm256_mul_pd(_mm256_add_pd(wide(x, true), wide(y, true)), half_pd);
                _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo))
            }
            true => _mm256_mul_ps(sum, half),
        };
        // SAFETY: as in `sum_f32_avx2_body`.
        match stream {
            true => _mm256_stream_ps(d.add(i), v),
            false => _mm256_storeu_ps(d.add(i), v),
        }
        i += 8;
    }
}

// Floats reduce in f64 in rank order and round once: at most one rounding
// per element, and every rank computes the same bits.
float_element!(
    f32,
    DType::F32,
    0.0,
    |x: f32| x as f64,
    |x: f64| x as f32,
    sum_f32_vector,
    sum_f32_over
);
float_element!(f64, DType::F64, 0.0, |x: f64| x, |x: f64| x);
float_element!(
    bf16,
    DType::BF16,
    bf16::ZERO,
    |x: bf16| x.to_f64(),
    bf16::from_f64
);
float_element!(
    f16,
    DType::F16,
    f16::ZERO,
    |x: f16| x.to_f64(),
    f16::from_f64
);

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const ZERO: Self = 0;
            fn reduce(xs: impl Iterator<Item = Self>, op: crate::ReduceOp) -> Self {
                use crate::ReduceOp::*;
                let mut n: $t = 0;
                let mut acc: Option<$t> = None;
                for x in xs {
                    n = n.wrapping_add(1);
                    acc = Some(match (acc, op) {
                        (None, _) => x,
                        (Some(a), Sum | Avg) => a.wrapping_add(x),
                        (Some(a), Max) => a.max(x),
                        (Some(a), Min) => a.min(x),
                    });
                }
                let a = acc.unwrap_or(0);
                if op == Avg && n > 0 {
                    a / n
                } else {
                    a
                }
            }
        }
    };
}
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

/// The bytes of a slice of elements.
pub(crate) fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: Element is sealed to plain-old-data types.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// The bytes of a slice of elements, writable (every byte pattern is a valid T).
pub(crate) fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; every byte pattern is a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Bytes of `n` elements of T (what the per-op counters add up).
pub(crate) fn bytes_of<T>(n: usize) -> usize {
    n * std::mem::size_of::<T>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReduceOp;

    /// `reduce_into` (for f32 sums with AVX2 the vector kernel, else the
    /// blocked loop) and the blocked loop itself (the vector kernel's head
    /// and tail, and every sum without AVX2) give the bits of the
    /// element-wise `reduce` every backend agrees on, with prefetch and the
    /// power-of-two Avg shortcut.
    fn blocked_equals_elementwise<T: Element>(
        make: impl Fn(f64) -> T,
        to: impl Fn(T) -> f64 + Copy,
        from: impl Fn(f64) -> T + Copy,
    ) {
        for ranks in 1..=5 {
            let len = 3 * BLOCK + 7 + PREFETCH_AHEAD;
            let srcs: Vec<Vec<T>> = (0..ranks)
                .map(|r| {
                    (0..len)
                        .map(|i| make(((i * 7919 + r * 104_729) % 10_007) as f64 / 77.3 - 60.0))
                        .collect()
                })
                .collect();
            let views: Vec<&[T]> = srcs.iter().map(|s| s.as_slice()).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let mut got = vec![T::ZERO; len];
                T::reduce_into(&mut got, &views, op);
                let mut blocked = vec![T::ZERO; len];
                if matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
                    sum_into(&mut blocked, &views, op == ReduceOp::Avg, to, from);
                } else {
                    blocked.clone_from(&got);
                }
                for (i, (g, b)) in got.iter().zip(&blocked).enumerate() {
                    let want = T::reduce(views.iter().map(|s| s[i]), op);
                    let bits = |x: &T| as_bytes(std::slice::from_ref(x)).to_vec();
                    assert!(
                        bits(g) == bits(&want) && bits(b) == bits(&want),
                        "{:?} {ranks} ranks {op:?} at {i}: {g:?} and blocked {b:?} vs {want:?}",
                        T::DTYPE
                    );
                }
            }
        }
    }

    #[test]
    fn vector_and_blocked_reductions_have_the_elementwise_bits() {
        blocked_equals_elementwise(|x| x as f32, |x| x as f64, |x| x as f32);
        blocked_equals_elementwise(|x| x, |x| x, |x| x);
        blocked_equals_elementwise(bf16::from_f64, bf16::to_f64, bf16::from_f64);
        blocked_equals_elementwise(f16::from_f64, f16::to_f64, f16::from_f64);
    }

    /// The f32 vector sum, streaming or not, writes the bits of the
    /// element-wise `reduce` wherever the destination starts (a streaming
    /// vector part begins at a 32-byte boundary), for lengths shorter than
    /// the lead, with NaN, infinities and values whose f64 sum an f32 one
    /// would round differently; other ops and types decline the streaming
    /// kernel and leave the destination alone.
    #[test]
    fn the_f32_vector_sum_has_the_elementwise_bits() {
        let avx2 = f32_kernels();
        each_f32_case(|srcs, op, want| {
            let (ranks, len) = (srcs.len(), want.len());
            let views: Vec<&[f32]> = srcs.iter().map(|s| s.as_slice()).collect();
            for offset in 0..8 {
                let mut plain = vec![-1f32; len + offset];
                f32::reduce_into(&mut plain[offset..], &views, op);
                assert_eq!(
                    as_bytes(&plain[offset..]),
                    as_bytes(want),
                    "reduce_into: {ranks} ranks, {len} elements at offset {offset}, {op:?}"
                );
                let mut buf = vec![-1f32; len + offset];
                let done = f32::reduce_into_streaming(&mut buf[offset..], &views, op);
                assert_eq!(done, avx2 && op != ReduceOp::Max, "{ranks} ranks {op:?}");
                if !done {
                    assert!(buf.iter().all(|&x| x == -1.0), "declined but wrote");
                    continue;
                }
                assert_eq!(
                    as_bytes(&buf[offset..]),
                    as_bytes(want),
                    "{ranks} ranks, {len} elements at offset {offset}, {op:?}"
                );
            }
        });
        let x = [bf16::ONE; 64];
        let mut out = [bf16::ZERO; 64];
        assert!(!bf16::reduce_into_streaming(
            &mut out,
            &[&x, &x],
            ReduceOp::Sum
        ));
    }

    /// Runs `check` on every case of the f32 kernel tests: 1-5 ranks'
    /// sources ([`f32_sources`]) of each of [`F32_LENS`], Sum, Avg and Max,
    /// with the element-wise `reduce` the kernels must match to the bit.
    fn each_f32_case(mut check: impl FnMut(&[Vec<f32>], ReduceOp, &[f32])) {
        for ranks in 1..=5 {
            for len in F32_LENS {
                let srcs = f32_sources(ranks, len);
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                    let want: Vec<f32> = (0..len)
                        .map(|i| f32::reduce(srcs.iter().map(|s| s[i]), op))
                        .collect();
                    check(&srcs, op, &want);
                }
            }
        }
    }

    /// Lengths for the f32 kernels: empty, under one vector, one, just
    /// over, several with a tail, and past the prefetch distance.
    const F32_LENS: [usize; 7] = [0, 1, 7, 8, 9, 31, 3 * BLOCK + 7 + PREFETCH_AHEAD];

    /// `ranks` f32 sources of `len` with NaN, infinities, a subnormal, -0,
    /// values whose f64 sum an f32 one would round differently, and every
    /// 13th element a sum whose value depends on the ranks' order (1e30 +
    /// 1 - 1e30 is 0 in f64, -1e30 + 1e30 + 1 is 1).
    fn f32_sources(ranks: usize, len: usize) -> Vec<Vec<f32>> {
        let special = [
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            f32::MAX,
            1e-40,
            -0.0,
            16_777_217.0,
        ];
        (0..ranks)
            .map(|r| {
                (0..len)
                    .map(|i| match (i * 31 + r * 17) % 97 {
                        _ if i % 13 == 5 => [1e30, 1.0, -1e30, 0.25, 2.0][r],
                        // Sums past f32::MAX whose averages are not.
                        _ if i % 13 == 9 => [f32::MAX, f32::MAX, 3.0, -f32::MAX, 1.0][r],
                        _ if i % 13 == 10 => [-f32::MAX, -1e38, -f32::MAX, 5.0, 2.0][r],
                        // Halves that are subnormal, of exact and of
                        // rounded sums.
                        _ if i % 13 == 11 => [1e-45, 3e-45, 1.5e-38, -1e-45, 7.0][r],
                        _ if i % 13 == 12 => [1.2e-38, 1.0e-38, 2.3e-38, 1e-45, 0.5][r],
                        k if k < special.len() => special[k],
                        _ => ((i * 7919 + r * 104_729) % 10_007) as f32 / 7.3 - 600.0,
                    })
                    .collect()
            })
            .collect()
    }

    /// The f32 sum over one of its own sources (the in-place kernel) writes
    /// the bits of the element-wise `reduce` whichever rank's source it
    /// overwrites, wherever that starts; other ops and types decline it
    /// and leave the destination alone.
    #[test]
    fn the_f32_sum_over_its_own_source_has_the_elementwise_bits() {
        let avx2 = f32_kernels();
        each_f32_case(|srcs, op, want| {
            let (ranks, len) = (srcs.len(), want.len());
            for me in 0..ranks {
                let others: Vec<&[f32]> = (0..ranks)
                    .filter(|&q| q != me)
                    .map(|q| srcs[q].as_slice())
                    .collect();
                for offset in [0, 1, 3] {
                    let mut buf = vec![-1f32; len + offset];
                    buf[offset..].copy_from_slice(&srcs[me]);
                    let done = f32::reduce_over(&mut buf[offset..], &others, me, op);
                    let what = format!("{ranks} ranks, me {me}, {len} at {offset}, {op:?}");
                    assert_eq!(done, avx2 && op != ReduceOp::Max, "{what}");
                    let expect = if done { want } else { &srcs[me][..] };
                    assert_eq!(as_bytes(&buf[offset..]), as_bytes(expect), "{what}");
                    assert!(buf[..offset].iter().all(|&x| x == -1.0), "{what}");
                }
            }
        });
        let x = [bf16::ONE; 64];
        let mut own = [bf16::ONE; 64];
        assert!(!bf16::reduce_over(&mut own, &[&x], 0, ReduceOp::Sum));
        assert_eq!(own, x);
    }

    /// With two sources the f32 sum and average run in f32
    /// (`sum2_f32_avx2_body`): over random bit patterns (subnormals,
    /// infinities, NaN among them) and pairs of near magnitudes, whose sums
    /// round, both have the bits of the f64 route (NaN for NaN).
    #[test]
    fn two_source_f32_sums_in_f32_have_the_f64_bits() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let len = 1 << 16;
        let (mut a, mut b) = (Vec::with_capacity(len), Vec::with_capacity(len));
        for i in 0..len {
            let r = next();
            let p = f32::from_bits(r as u32);
            // Every other pair: b within a few binades of a, either sign.
            let q = match i % 2 {
                0 => f32::from_bits((r >> 32) as u32),
                _ => {
                    let shift = ((r >> 32) % 64) as i32 - 32;
                    let sign = if r >> 63 == 0 { 1.0 } else { -1.0 };
                    sign * p
                        * (1.0 + ((r >> 40) as u32 as f32) / 16_777_216.0)
                        * 2f32.powi(shift / 8)
                }
            };
            a.push(p);
            b.push(q);
        }
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut got = vec![0f32; len];
            f32::reduce_into(&mut got, &[&a, &b], op);
            for i in 0..len {
                let want = f32::reduce([a[i], b[i]].into_iter(), op);
                assert!(
                    got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan()),
                    "{op:?} of {:e} and {:e} ({:#x}, {:#x}): {:e}, f64 route {:e}",
                    a[i],
                    b[i],
                    a[i].to_bits(),
                    b[i].to_bits(),
                    got[i],
                    want
                );
            }
        }
    }

    /// A short source is refused before the unchecked vector loop reads
    /// past it.
    #[test]
    #[should_panic(expected = "every source must be as long as the destination")]
    fn the_streaming_sum_refuses_a_short_source() {
        let (long, short) = (vec![1f32; 4096], vec![1f32; 4000]);
        let mut out = vec![0f32; 4096];
        f32::reduce_into_streaming(&mut out, &[&long, &short], ReduceOp::Sum);
    }
}

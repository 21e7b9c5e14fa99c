//! How a kernel walks a shard: each thread's contiguous range
//! ([`for_each_range`]), within it cache blocks whose compute-dtype copy is
//! written while they are in cache, and within a block steps with software
//! prefetch ahead of every array ([`in_blocks`]). Adam, Lion, SGD, LAMB,
//! Adagrad and RMSprop share it; only their per-element updates differ.

use rayon::prelude::*;

use crate::adam::ComputeCopy;
use crate::cast::{bf16_bits_mut, f16_bits_mut};
use crate::error::same_len;
use crate::{KernelError, Threads};

/// Elements per cache block: the block's p, g, m, v (32 KiB) stay in L1/L2
/// while the compute-dtype copy is written from them.
const BLOCK: usize = 1024;

/// Elements the update walks between software prefetches: two 64-byte lines
/// of each array.
const STEP: usize = 32;

/// How far ahead (elements, 2 KiB per array) the update prefetches p, g, m
/// and v. One core alone cannot keep enough misses in flight for four
/// streams with the hardware prefetcher only: measured on this project's
/// 2-core EPYC, 50M params, 1 thread, this distance gave +7-10% (256 and
/// 768 less, issuing a whole block's prefetches at once -30%).
const PREFETCH_AHEAD: usize = 512;

/// Compute-copy destination as raw bits, so one range function serves both.
pub(crate) enum CopyBits<'a> {
    None,
    Bf16(&'a mut [u16]),
    F16(&'a mut [u16]),
}

impl<'a> CopyBits<'a> {
    /// Checks the destination's length against the shard's `n` and views
    /// it as bits.
    pub(crate) fn of(copy: ComputeCopy<'a>, n: usize) -> Result<Self, KernelError> {
        Ok(match copy {
            ComputeCopy::None => CopyBits::None,
            ComputeCopy::Bf16(d) => {
                same_len("compute copy", d.len(), "p", n)?;
                CopyBits::Bf16(bf16_bits_mut(d))
            }
            ComputeCopy::F16(d) => {
                same_len("compute copy", d.len(), "p", n)?;
                CopyBits::F16(f16_bits_mut(d))
            }
        })
    }

    /// The destination's first `at` elements and the rest (both `None`
    /// when there is no copy), for a range split between threads.
    pub(crate) fn split_at(self, at: usize) -> (Self, Self) {
        match self {
            CopyBits::None => (CopyBits::None, CopyBits::None),
            CopyBits::Bf16(d) => {
                let (a, b) = d.split_at_mut(at);
                (CopyBits::Bf16(a), CopyBits::Bf16(b))
            }
            CopyBits::F16(d) => {
                let (a, b) = d.split_at_mut(at);
                (CopyBits::F16(a), CopyBits::F16(b))
            }
        }
    }

    /// Writes the updated parameters `p`, which start at element `at` of
    /// the range, into the destination (a block still in cache).
    #[inline(always)]
    pub(crate) fn write(&mut self, at: usize, p: &[f32]) {
        match self {
            CopyBits::None => {}
            CopyBits::Bf16(d) => {
                let d = &mut d[at..at + p.len()];
                for i in 0..p.len() {
                    d[i] = crate::cast::f32_to_bf16_bits(p[i]);
                }
            }
            CopyBits::F16(d) => {
                let d = &mut d[at..at + p.len()];
                for i in 0..p.len() {
                    d[i] = crate::cast::f32_to_f16_bits(p[i]);
                }
            }
        }
    }
}

/// Prefetches the [`STEP`] elements at `at` of every stream (each `n` long)
/// into L1; nothing past the end. A hint only: no memory is read or written.
#[inline(always)]
fn prefetch<const N: usize>(streams: &[*const f32; N], n: usize, at: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for line in [at, at + STEP / 2] {
            if line < n {
                for &s in streams {
                    // SAFETY: `line < n`, so the address is inside the slice
                    // `s` points into; prefetch never faults or writes.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(s.add(line).cast::<i8>()) };
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (streams, n, at);
}

/// Walks one thread's range of `p` in cache blocks of [`BLOCK`] and, within
/// a block, in [`STEP`]s, asking for every stream's lines
/// [`PREFETCH_AHEAD`] ahead (`streams`: the arrays the update reads, `p`'s
/// among them, each as long as `p`): `f(p[r], r)` updates the elements
/// `r`, and each block's compute copy is written while it is in cache.
/// It must inline into each dispatch level's body for the update to
/// vectorize there, and so must `f`: mark the closure `#[inline(always)]`
/// (without it Adam's ran as scalar code in the AVX-512 body, 2.7x slower,
/// with every test green; only `zrt bench adam` shows it).
#[inline(always)]
pub(crate) fn in_blocks<const N: usize>(
    p: &mut [f32],
    streams: [*const f32; N],
    mut copy: CopyBits<'_>,
    mut f: impl FnMut(&mut [f32], std::ops::Range<usize>),
) {
    let n = p.len();
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let mut s = start;
        while s < end {
            let e = (s + STEP).min(end);
            prefetch(&streams, n, s + PREFETCH_AHEAD);
            f(&mut p[s..e], s..e);
            s = e;
        }
        copy.write(start, &p[start..end]);
        start = end;
    }
}

/// Runs `f(p, g, moments, copy)` over the whole shard: on this thread when
/// the pool has one thread or the shard is small, else once per thread's
/// contiguous range ([`Threads::chunk_len`]), every array cut at the same
/// points. An empty moment (one the optimizer does not keep) stays empty
/// in every range. The callers check the lengths first (`same_len`).
pub(crate) fn for_each_range<const K: usize>(
    threads: &Threads,
    p: &mut [f32],
    g: &[f32],
    moments: [&mut [f32]; K],
    copy: CopyBits<'_>,
    f: impl Fn(&mut [f32], &[f32], [&mut [f32]; K], CopyBits<'_>) + Sync,
) {
    let Some(cs) = threads.chunk_len(p.len()) else {
        return f(p, g, moments, copy);
    };
    let mut jobs = Vec::with_capacity(p.len().div_ceil(cs));
    let (mut p, mut g, mut moments, mut copy) = (p, g, moments, copy);
    while !p.is_empty() {
        let k = cs.min(p.len());
        let (p1, p2) = std::mem::take(&mut p).split_at_mut(k);
        let (g1, g2) = g.split_at(k);
        let mut m1: [&mut [f32]; K] = std::array::from_fn(|_| &mut [][..]);
        for (head, rest) in m1.iter_mut().zip(moments.iter_mut()) {
            if !rest.is_empty() {
                let (a, b) = std::mem::take(rest).split_at_mut(k);
                (*head, *rest) = (a, b);
            }
        }
        let (c1, c2) = copy.split_at(k);
        jobs.push((p1, g1, m1, c1));
        (p, g, copy) = (p2, g2, c2);
    }
    threads.install(|| {
        jobs.into_par_iter()
            .for_each(|(p, g, m, copy)| f(p, g, m, copy))
    });
}

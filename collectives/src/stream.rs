//! Copies into memory that will not be read again soon, with non-temporal
//! stores.
//!
//! A normal store to a line that is not in cache first *reads* the line from
//! memory (read-for-ownership), so copying S bytes into a cold buffer moves
//! 3 S through the memory bus. A gather's output is exactly that: written
//! once, read later by compute, long after it left the cache. Streaming
//! stores skip the read (2 S) — the reason glibc's memcpy switches to them
//! for copies larger than the cache, which the shm backend's window-sized
//! copies never are.

use crate::Element;

/// Copies smaller than this go through `copy_from_slice`: the fence below
/// costs more than streaming saves.
const STREAM_MIN_BYTES: usize = 64 << 10;

/// Destinations at least this large are streamed into: they do not fit a
/// typical last-level cache (32 MiB on this project's EPYC) anyway, while a
/// smaller one may still be cached when the caller reads it. Measured on 2
/// ranks: all_gather into 128 MiB +7%; into 16 MiB streaming was 20% *slower*
/// (the reused output lived in L3).
pub(crate) const STREAM_MIN_DEST_BYTES: usize = 32 << 20;

/// An out-of-place reduce_scatter streams its part out when the operation's
/// data on the host — n ranks' inputs of S bytes and their parts, (n + 1) S
/// — is at least this (the last-level cache above): the part's lines are
/// cold by the time they are written, and each plain store would first read
/// one. Measured on 2 ranks, streaming against plain stores: with 16 MiB
/// inputs faster in 11 of 13 interleaved pairs (about 1.6 -> 1.4 ms); 8 MiB
/// a wash; 1-4 MiB 10-40% slower (everything cached).
pub(crate) const STREAM_MIN_FOOTPRINT_BYTES: usize = 32 << 20;

/// `dst.copy_from_slice(src)`, with non-temporal stores on x86-64 when
/// `stream` and the copy is at least [`STREAM_MIN_BYTES`]. Then ends with a
/// store fence, so the data is visible to other cores before any later
/// (release) store — the barrier that tells the peers a window is done.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice`); callers pass equal lengths.
pub(crate) fn copy_streaming<T: Element>(dst: &mut [T], src: &[T], stream: bool) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    let bytes = std::mem::size_of_val(dst);
    #[cfg(target_arch = "x86_64")]
    if stream && bytes >= STREAM_MIN_BYTES {
        // SAFETY: both ranges are `bytes` long, valid, and cannot overlap
        // (one is borrowed mutably); every `Element` is plain old data.
        unsafe {
            stream_bytes(
                dst.as_mut_ptr().cast::<u8>(),
                src.as_ptr().cast::<u8>(),
                bytes,
            )
        };
        return;
    }
    let _ = (bytes, stream);
    dst.copy_from_slice(src);
}

/// Copies `len` bytes with 16-byte non-temporal stores (SSE2: every x86-64
/// has it, so no run-time dispatch), plain copies for the unaligned head and
/// the tail, then `sfence`.
///
/// # Safety
/// `dst` and `src` valid for `len` bytes and not overlapping.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Head: up to the destination's next 64-byte line.
    let head = (dst.align_offset(64)).min(len);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let (mut d, mut s) = (dst.add(head), src.add(head));
    let lines = (len - head) / 64;
    for _ in 0..lines {
        // Four loads, then four streams: one whole line per write-combine.
        let a = _mm_loadu_si128(s.cast::<__m128i>());
        let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
        let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
        let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
        _mm_stream_si128(d.cast::<__m128i>(), a);
        _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
        _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
        _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
        d = d.add(64);
        s = s.add(64);
    }
    std::ptr::copy_nonoverlapping(s, d, len - head - lines * 64);
    // Streaming stores are weakly ordered: publish them before returning.
    _mm_sfence();
}

/// Hints the CPU to bring `s`'s cache lines into L1 (one prefetch per 64
/// bytes). Reads and writes nothing: a no-op for correctness.
#[inline]
pub(crate) fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (p, bytes) = (s.as_ptr().cast::<i8>(), std::mem::size_of_val(s));
        let mut at = 0;
        while at < bytes {
            // SAFETY: `at < bytes`, inside the slice; prefetch never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(at)) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_any_alignment_and_length() {
        // Lengths around the threshold and odd offsets of both buffers, so
        // head, lines and tail all vary.
        let src: Vec<u8> = (0..STREAM_MIN_BYTES + 200)
            .map(|i| (i % 251) as u8)
            .collect();
        for off_d in [0, 1, 7, 31] {
            for off_s in [0, 3, 32] {
                for len in [
                    0,
                    5,
                    STREAM_MIN_BYTES - 1,
                    STREAM_MIN_BYTES,
                    STREAM_MIN_BYTES + 37,
                ] {
                    let mut dst = vec![0u8; len + 64];
                    copy_streaming(&mut dst[off_d..off_d + len], &src[off_s..off_s + len], true);
                    assert_eq!(
                        &dst[off_d..off_d + len],
                        &src[off_s..off_s + len],
                        "d {off_d} s {off_s} len {len}"
                    );
                    assert!(
                        dst[..off_d].iter().all(|&x| x == 0),
                        "wrote before the range"
                    );
                    assert!(
                        dst[off_d + len..].iter().all(|&x| x == 0),
                        "wrote past the range"
                    );
                }
            }
        }
    }
}

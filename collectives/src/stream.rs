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

use crate::caches::last_level_cache_bytes;
use crate::Element;

/// Copies smaller than this go through `copy_from_slice`: the fence below
/// costs more than streaming saves.
const STREAM_MIN_BYTES: usize = 64 << 10;

/// Destinations at least this large are streamed into: they do not fit the
/// last-level cache ([`last_level_cache_bytes`]) anyway, while a smaller one
/// may still be cached when the caller reads it. Measured on 2 ranks with a
/// 32 MiB cache: all_gather into 128 MiB +7%; into 16 MiB streaming was 20%
/// *slower* (the reused output lived in L3).
pub(crate) fn stream_min_dest_bytes() -> usize {
    last_level_cache_bytes()
}

/// Whether an out-of-place operation streams this rank's part of its
/// result: when its data on the host, `n` ranks' buffers of `bytes` (a
/// reduce_scatter's inputs, an all_gather's outputs) and their parts,
/// (n + 1) x `bytes`, is at least the last-level cache (`cache`, from
/// [`last_level_cache_bytes`]): the part's lines are cold by the time they
/// are written, and each plain store would first read one.
/// Measured on 2 ranks with a 32 MiB cache, streaming against plain stores:
/// reduce_scatter with 16 MiB inputs faster in 11 of 13 interleaved pairs
/// (about 1.6 -> 1.4 ms); 8 MiB a wash; 1-4 MiB 10-40% slower (everything
/// cached). all_gather into 16 MiB, its own part: 2.76 -> 2.40 ms, 6 of 6.
pub(crate) fn part_streams(bytes: usize, n: usize, cache: usize) -> bool {
    bytes.saturating_mul(n + 1) >= cache
}

/// `dst.copy_from_slice(src)`, with non-temporal stores on x86-64 when
/// `stream` and the copy is at least [`STREAM_MIN_BYTES`]. Then ends with a
/// store fence, so the data is visible to other cores before any later
/// (release) store — the barrier that tells the peers a window is done.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice`); callers pass equal lengths.
pub(crate) fn copy_streaming<T: Element>(dst: &mut [T], src: &[T], stream: bool) {
    copy_streaming_from(dst, src, stream.then_some(STREAM_MIN_BYTES));
}

/// A write into a shared slot: with `streaming`, non-temporal stores for
/// any copy of at least [`SLOT_STREAM_MIN_BYTES`] (on x86-64), then a store
/// fence. The point here is not a read of cold lines skipped but no line
/// left in this core's cache for a peer's core on another die to take (see
/// `slot_stores`), which holds for a window of any size.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice`); callers pass equal lengths.
pub(crate) fn copy_to_slot<T: Element>(dst: &mut [T], src: &[T], streaming: bool) {
    copy_streaming_from(dst, src, streaming.then_some(SLOT_STREAM_MIN_BYTES));
}

/// `dst.copy_from_slice(src)`, streamed (and fenced) on x86-64 when the
/// copy is at least `min` bytes, plain when `min` is `None`.
fn copy_streaming_from<T: Element>(dst: &mut [T], src: &[T], min: Option<usize>) {
    assert!(dst.len() == src.len(), "copy_streaming: lengths differ");
    let bytes = std::mem::size_of_val(src);
    #[cfg(target_arch = "x86_64")]
    if min.is_some_and(|m| bytes >= m) {
        // SAFETY: both ranges are `bytes` long and valid, and they do not
        // overlap (`dst` is borrowed mutably); every `Element` is plain
        // old data.
        unsafe {
            stream_bytes(
                dst.as_mut_ptr().cast::<u8>(),
                src.as_ptr().cast::<u8>(),
                bytes,
            )
        };
        return;
    }
    let _ = min;
    dst.copy_from_slice(src);
}

/// Slot writes smaller than this stay plain: a few lines, where the fence
/// would cost about what the copy does.
const SLOT_STREAM_MIN_BYTES: usize = 4 << 10;

/// Copies `len` bytes into `dst` with 16-byte non-temporal stores (SSE2:
/// every x86-64 has it, so no run-time dispatch), plain copies for the
/// unaligned head and the tail, then `sfence`.
///
/// # Safety
/// `dst` and `src` valid for `len` bytes and not overlapping.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // Head: up to the destination's next 64-byte line.
    let head = (dst.align_offset(64)).min(len);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let lines = (len - head) / 64;
    for l in 0..lines {
        let at = head + l * 64;
        // Four loads, then four streams: one whole line per write-combine.
        let v = [0, 16, 32, 48].map(|k| _mm_loadu_si128(src.add(at + k).cast::<__m128i>()));
        for (k, &x) in [0, 16, 32, 48].iter().zip(&v) {
            _mm_stream_si128(dst.add(at + k).cast::<__m128i>(), x);
        }
    }
    let done = head + lines * 64;
    std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
    // Streaming stores are weakly ordered: publish them before returning.
    fence();
}

/// A store fence: streaming stores made before it are visible to other
/// cores before any store after it (the release that publishes them).
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE, in every x86-64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
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

    /// The measured cases: with a 32 MiB cache and 2 ranks, 16 MiB buffers
    /// stream their part (48 MiB on the host), 8 MiB ones do not (24);
    /// with 3 ranks 8 MiB do (32: the cache exactly); no overflow.
    #[test]
    fn a_part_streams_once_the_operations_data_passes_the_cache() {
        let (mib, cache) = (1 << 20, 32 << 20);
        assert!(part_streams(16 * mib, 2, cache));
        assert!(!part_streams(8 * mib, 2, cache));
        assert!(part_streams(8 * mib, 3, cache));
        assert!(!part_streams(8 * mib - 1, 3, cache));
        assert!(!part_streams(mib, 2, cache));
        assert!(part_streams(usize::MAX, 2, cache));
    }

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
                    let want = &src[off_s..off_s + len];
                    let mut dst = vec![0u8; len + 64];
                    copy_streaming(&mut dst[off_d..off_d + len], want, true);
                    let at = format!("d {off_d} s {off_s} len {len}");
                    assert_eq!(&dst[off_d..off_d + len], want, "{at}");
                    // Only what the copy must write: nothing before or past.
                    assert!(dst[..off_d].iter().all(|&x| x == 0), "wrote before: {at}");
                    assert!(
                        dst[off_d + len..].iter().all(|&x| x == 0),
                        "wrote past: {at}"
                    );
                }
            }
        }
    }
}

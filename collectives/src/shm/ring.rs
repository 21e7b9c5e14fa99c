//! How big a staging slot is, how many a rank's ring holds, and which
//! of them each round of an operation uses.

/// Default bytes of a staging slot (`ZRT_SHM_SLOT_BYTES` overrides), which
/// a round's windows are cut from (a rank's ring holds `ring_laps`
/// slots). Small enough that a window staged by one rank is still in cache
/// when the others read it, large enough that the barriers per window cost
/// little: measured best of 256 KiB .. 8 MiB on 2 ranks
/// (docs/collectives-bench.md).
pub const DEFAULT_SLOT_BYTES: usize = 512 << 10;

/// The smallest staging slot `ZRT_SHM_SLOT_BYTES` may ask for.
pub(super) const MIN_SLOT_BYTES: usize = 4096;

/// Bytes of a staging slot for a group of `n`: `wanted`, raised so that the
/// smallest window (16 elements of the widest dtype, 8 bytes, for each of
/// `n` parts in each of a reduction's three buffers) fits, and rounded up to
/// a cache line. Below that the windows of a large group would run past the
/// slot into the next rank's.
pub(super) fn slot_bytes_for(wanted: usize, n: usize) -> usize {
    wanted.max(MIN_SLOT_BYTES).max(n * 3 * 16 * 8).div_ceil(64) * 64
}

/// Most slots ("laps") a staging ring holds.
pub(super) const MAX_LAPS: usize = 16;

/// Slots of `slot` bytes in each rank's staging ring for a group of `n`
/// whose cores have `core_cache` bytes of level-2 cache: enough that what
/// a peer reads of this rank's ring in one lap (1 / (n - 1) of all it
/// reads) adds up to twice its core's cache, so the lines are gone from it
/// when this rank writes them again; at least 1, at most [`MAX_LAPS`].
///
/// Why: a store into a line another core holds must first take the line
/// from that core's cache. Two pinned threads on this project's VM (cores
/// sharing an L3): writing 512 KiB the other core had just read took
/// 50-53 us, writing it into lines that core had not read 11 us (a copy
/// within one core's cache); with a ring of 4 x 512 KiB the writes took
/// 13.6 us, with 2 x 512 KiB 32.6. One slot reused round after round
/// (the layout before 2026-11-27) spent most of a 1 MiB reduce_scatter
/// there.
pub(super) fn ring_laps(slot: usize, n: usize, core_cache: usize) -> usize {
    if n < 2 {
        return 1;
    }
    (2 * core_cache)
        .div_ceil((n - 1) * slot.max(1))
        .clamp(1, MAX_LAPS)
}

/// Elements (of `size` bytes) in one buffer when a `slot`-byte slot is
/// split into `bufs`, and how many such buffers a ring of `laps` slots
/// holds: at least `bufs`.
pub(super) fn ring_bufs(slot: usize, laps: usize, size: usize, bufs: usize) -> (usize, usize) {
    let size = size.max(1);
    let len = slot / bufs.max(1) / size;
    let per = (slot * laps / (len * size).max(1)).max(1);
    (len, per)
}

/// The buffers an operation claimed along a rank's ring ([`claim_bufs`]):
/// round j's is [`Claimed::at`]`(j)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Claimed {
    /// The first round's buffer's number along the ring.
    pub(super) first: usize,
    /// Elements in one buffer.
    pub(super) len: usize,
    /// Buffers in the ring.
    pub(super) per: usize,
}

impl Claimed {
    /// Element offset, in a rank's ring, of round `j`'s buffer. Round j's
    /// buffer is used again at round j + `per` at the earliest, and `per`
    /// is at least the `bufs` it was claimed with ([`ring_bufs`]): what the
    /// double (gather, broadcast) and triple (reductions) buffering rely on.
    pub(super) fn at(&self, j: usize) -> usize {
        (self.first + j) % self.per * self.len
    }
}

/// Claims an operation's `rounds` buffers of elements of `size` bytes, a
/// slot split into `bufs` ([`ring_bufs`]): the next ones along the ring
/// after byte `at`, where the previous operation's ended, wrapping around;
/// moves `at` past them. Every rank claims the same rounds in the same
/// order, so they agree on where each round's buffer is without saying so.
pub(super) fn claim_bufs(
    at: &mut usize,
    slot: usize,
    laps: usize,
    size: usize,
    bufs: usize,
    rounds: usize,
) -> Claimed {
    let (len, per) = ring_bufs(slot, laps, size, bufs);
    let bytes = (len * size.max(1)).max(1);
    let first = at.div_ceil(bytes) % per;
    *at = (first + rounds) % per * bytes;
    Claimed { first, len, per }
}

/// Elements of `size` bytes per part per window when `parts` windows share
/// one of a `slot`-byte slot's `bufs` buffers: a multiple of 16, at least 16
/// (which [`slot_bytes_for`] makes fit).
pub(super) fn window_len(slot: usize, size: usize, parts: usize, bufs: usize) -> usize {
    (slot / bufs / size.max(1) / parts.max(1) / 16 * 16).max(16)
}

/// `ZRT_SHM_SLOT_BYTES` ([`DEFAULT_SLOT_BYTES`] when unset or empty), or
/// what is wrong with it.
pub(crate) fn slot_bytes_from_env() -> Result<usize, String> {
    crate::env_bytes::from_env("ZRT_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES, MIN_SLOT_BYTES)
}

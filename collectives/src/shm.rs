//! The shared-memory backend: ranks are processes on one host, the default
//! CPU backend.
//!
//! A group maps one segment (`/dev/shm`, unlinked as soon as every member has
//! mapped it, so a crash leaves nothing behind):
//!
//! ```text
//! header | control block per rank (arrive counter, left flag, call slots) | staging ring per rank | result ring
//! ```
//!
//! Every operation first publishes this rank's call description and passes a
//! barrier; then all ranks compare descriptions (a mismatch fails everyone
//! before any data moves). Data moves in windows cut from a staging slot
//! (`ZRT_SHM_SLOT_BYTES`), round after round; each round's buffer is the
//! next one along a rank's ring of several slots, so a rank writes a line
//! again only after the peers that read it have read a few of their core's
//! caches' worth since (`ring_laps` sizes the ring).
//! Reductions are split across ranks: for each window, rank r reduces only
//! part r, reading every rank's slot, so the work and the memory traffic are
//! divided by the group size and no byte round-trips through the kernel.
//!
//! Symmetric buffers ([`SymmetricBuf`]) skip the staging: each rank's
//! buffer is a file of its own in `/dev/shm` that every rank maps when it
//! is allocated (then unlinked, like the segment), so the symmetric
//! reduce-scatter reduces its part reading every rank's buffer where it is
//! and the symmetric all-gather copies the peers' parts straight out of
//! theirs. A barrier closes each, so no rank touches its buffer while a
//! peer still reads it. A rank that dies between creating its file and the
//! end of the allocation leaves that file behind (named after the job).
//!
//! Waiting spins briefly, then sleeps on a futex over the late rank's
//! arrive word, which that rank wakes when it arrives (yielding in a loop
//! instead left a waiting rank behind a busy compute thread for a scheduler
//! tick). At least every 50 ms a waiting rank checks the ranks it waits for:
//! one that left (its handle dropped) or whose process is gone fails the
//! call with [`CommError::RankDied`] naming it, and the deadline fails it
//! with [`CommError::Timeout`]. Large all_gather outputs are written with
//! streaming stores (`stream`). `send`/`recv` go through the rendezvous
//! store (they are rare in ZeRO; correctness over speed).

use std::fs::OpenOptions;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use parking_lot::Mutex;

use crate::dtype::bytes_of;
use crate::front::{forward_process_group, Front, Member, Transport};
use crate::op::{gather_ranges, invalid};
use crate::p2p::Mailbox;
pub use crate::slot_stores::SlotStores;
use crate::slot_stores::{Chooser, Measured, Switch};
use crate::store::StoreClient;
use crate::stream::{copy_streaming, copy_to_slot, part_streams, stream_min_dest_bytes};
use crate::symmetric::Shared;
use crate::worker::Worker;
use crate::{chunk_range, CommError, Element, OpDesc, OpKind, ReduceOp, SymmetricBuf, Work};

const MAGIC: u64 = 0x7a72_745f_7368_6d31; // "zrt_shm1"
const CTRL: usize = 128;
const HEADER: usize = 64;
/// Words of a control block: arrive, left, two call slots of three words,
/// then the count of ranks asleep on this rank's arrive word, then how this
/// rank's two steps of a symmetric allocation went (a word each: a fast
/// rank writes the second while a slow one may still read the first).
const W_ARRIVE: usize = 0;
const W_LEFT: usize = 1;
const W_DESC: usize = 2;
const W_SLEEPERS: usize = 8;
const W_STATUS: usize = 9;
/// Spins before a waiting rank goes to sleep on a futex: long enough to catch
/// a peer that is a few microseconds behind, short enough that a peer still
/// computing gets the core (2 ranks on 2 cores share them with compute).
const SPINS: u32 = 2000;
const LIVENESS_EVERY: Duration = Duration::from_millis(50);

/// Default bytes of a staging slot (`ZRT_SHM_SLOT_BYTES` overrides), which
/// a round's windows are cut from (a rank's ring holds `ring_laps`
/// slots). Small enough that a window staged by one rank is still in cache
/// when the others read it, large enough that the barriers per window cost
/// little: measured best of 256 KiB .. 8 MiB on 2 ranks
/// (docs/collectives-bench.md).
pub const DEFAULT_SLOT_BYTES: usize = 512 << 10;

/// The smallest staging slot `ZRT_SHM_SLOT_BYTES` may ask for.
const MIN_SLOT_BYTES: usize = 4096;

/// Bytes of a staging slot for a group of `n`: `wanted`, raised so that the
/// smallest window (16 elements of the widest dtype, 8 bytes, for each of
/// `n` parts in each of a reduction's three buffers) fits, and rounded up to
/// a cache line. Below that the windows of a large group would run past the
/// slot into the next rank's.
fn slot_bytes_for(wanted: usize, n: usize) -> usize {
    wanted.max(MIN_SLOT_BYTES).max(n * 3 * 16 * 8).div_ceil(64) * 64
}

/// Most slots ("laps") a staging ring holds.
const MAX_LAPS: usize = 16;

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
fn ring_laps(slot: usize, n: usize, core_cache: usize) -> usize {
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
fn ring_bufs(slot: usize, laps: usize, size: usize, bufs: usize) -> (usize, usize) {
    let size = size.max(1);
    let len = slot / bufs.max(1) / size;
    let per = (slot * laps / (len * size).max(1)).max(1);
    (len, per)
}

/// The buffers an operation claimed along a rank's ring ([`claim_bufs`]):
/// round j's is [`Claimed::at`]`(j)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Claimed {
    /// The first round's buffer's number along the ring.
    first: usize,
    /// Elements in one buffer.
    len: usize,
    /// Buffers in the ring.
    per: usize,
}

impl Claimed {
    /// Element offset, in a rank's ring, of round `j`'s buffer. Round j's
    /// buffer is used again at round j + `per` at the earliest, and `per`
    /// is at least the `bufs` it was claimed with ([`ring_bufs`]): what the
    /// double (gather, broadcast) and triple (reductions) buffering rely on.
    fn at(&self, j: usize) -> usize {
        (self.first + j) % self.per * self.len
    }
}

/// Claims an operation's `rounds` buffers of elements of `size` bytes, a
/// slot split into `bufs` ([`ring_bufs`]): the next ones along the ring
/// after byte `at`, where the previous operation's ended, wrapping around;
/// moves `at` past them. Every rank claims the same rounds in the same
/// order, so they agree on where each round's buffer is without saying so.
fn claim_bufs(
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
fn window_len(slot: usize, size: usize, parts: usize, bufs: usize) -> usize {
    (slot / bufs / size.max(1) / parts.max(1) / 16 * 16).max(16)
}

/// `ZRT_SHM_SLOT_BYTES` ([`DEFAULT_SLOT_BYTES`] when unset or empty), or
/// what is wrong with it.
pub(crate) fn slot_bytes_from_env() -> Result<usize, String> {
    crate::env_bytes::from_env("ZRT_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES, MIN_SLOT_BYTES)
}

struct Segment {
    map: MmapMut,
    n: usize,
    /// Bytes of one slot, from which windows are cut.
    slot: usize,
    /// Slots in each rank's ring (and in the result ring).
    laps: usize,
}

impl Segment {
    fn base(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }
    fn word(&self, rank: usize, w: usize) -> &AtomicU64 {
        // SAFETY: in bounds (checked at creation), 8-aligned (page-aligned
        // base, 64/128-byte blocks), and only ever accessed atomically.
        unsafe { &*(self.base().add(HEADER + rank * CTRL + w * 8) as *const AtomicU64) }
    }
    fn data_offset(&self) -> usize {
        HEADER + self.n * CTRL
    }
    /// Bytes of each rank's ring.
    fn ring(&self) -> usize {
        self.slot * self.laps
    }
    /// `len` elements of T from element `at` of rank `r`'s staging ring
    /// (`r == n`: the result ring).
    ///
    /// # Safety
    /// The caller must hold the protocol's right to the range: only its owner
    /// writes a slot between two barriers, and readers read after the barrier.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot<T: Element>(&self, r: usize, at: usize, len: usize) -> &mut [T] {
        debug_assert!((at + len) * std::mem::size_of::<T>() <= self.ring());
        let p = self.base().add(self.data_offset() + r * self.ring()) as *mut T;
        std::slice::from_raw_parts_mut(p.add(at), len)
    }
    fn bytes(n: usize, slot: usize, laps: usize) -> usize {
        HEADER + n * CTRL + (n + 1) * slot * laps
    }
}

struct State {
    /// Where along the rings the next operation's first buffer goes (a
    /// byte offset; the same on every rank, which all claim the same
    /// rounds in the same order).
    ring_at: usize,
    seq: u64,
    epoch: u64,
    /// Symmetric buffers allocated so far (the next one's number).
    allocs: u32,
    /// After a mismatch the ranks are out of step: every later call fails too.
    poisoned: Option<CommError>,
    /// Plain or streaming stores into this rank's slots.
    stores: Chooser,
}

struct Inner {
    seg: Segment,
    m: Member,
    pids: Vec<u32>,
    state: Mutex<State>,
    /// Process-unique: which group a symmetric buffer came from.
    serial: u64,
    /// The segment's path; symmetric buffers' files add a suffix to it.
    path: String,
}

/// Serials of the groups this process has joined.
static SERIALS: AtomicU64 = AtomicU64::new(1);

// SAFETY: the mapping is shared memory; all cross-rank access goes through
// atomics or through ranges the barrier protocol hands to one writer.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// Whether process `pid` is gone (or a zombie: it died and is not yet reaped).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // Field 3, after the parenthesized command name: the state letter.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|st| st == "Z" || st == "X"),
    }
}

/// Futex wait and wake on the low 32 bits of a shared 64-bit word (the
/// mapping is shared between processes, so not the `PRIVATE` variants).
mod futex {
    use std::sync::atomic::AtomicU64;
    use std::time::Duration;

    /// The word's low half (little-endian: its first four bytes).
    fn low(word: &AtomicU64) -> *const u32 {
        let p = word.as_ptr().cast::<u32>();
        if cfg!(target_endian = "little") {
            p
        } else {
            p.wrapping_add(1)
        }
    }

    /// Sleeps while the word's low half is still `seen`'s, for at most
    /// `at_most`. Returns early on a wake, a signal or a changed value;
    /// callers re-check.
    #[cfg(target_os = "linux")]
    pub(super) fn wait(word: &AtomicU64, seen: u64, at_most: Duration) {
        let ts = libc::timespec {
            tv_sec: at_most.as_secs() as libc::time_t,
            tv_nsec: at_most.subsec_nanos() as libc::c_long,
        };
        // SAFETY: the address is a live, aligned word of the shared mapping
        // and the timespec outlives the call; a futex only reads the word.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                low(word),
                libc::FUTEX_WAIT,
                seen as u32,
                &ts as *const libc::timespec,
            );
        }
    }

    /// Elsewhere (no futex): a short sleep; the caller re-checks.
    #[cfg(not(target_os = "linux"))]
    pub(super) fn wait(_word: &AtomicU64, _seen: u64, at_most: Duration) {
        std::thread::sleep(at_most.min(Duration::from_micros(50)));
    }

    /// Wakes every rank asleep on the word.
    #[cfg(not(target_os = "linux"))]
    pub(super) fn wake_all(_word: &AtomicU64) {}

    /// Wakes every rank asleep on the word.
    #[cfg(target_os = "linux")]
    pub(super) fn wake_all(word: &AtomicU64) {
        // SAFETY: as in `wait`; waking touches no memory.
        unsafe {
            libc::syscall(libc::SYS_futex, low(word), libc::FUTEX_WAKE, i32::MAX);
        }
    }
}

impl Inner {
    /// Waits until every rank's arrive word is at least `epoch`, failing on
    /// a rank that left or died, and on the deadline. Spins [`SPINS`] times,
    /// then sleeps on the first late rank's arrive word (a futex, woken by
    /// its arrival) for at most the liveness period.
    fn wait_all(&self, call: &OpDesc, deadline: Instant, epoch: u64) -> Result<(), CommError> {
        let arrived = |r: usize| self.seg.word(r, W_ARRIVE).load(Ordering::Acquire) >= epoch;
        let mut spins = 0u32;
        let mut next_check = Instant::now() + LIVENESS_EVERY;
        loop {
            let Some(late) = (0..self.n()).find(|&r| !arrived(r)) else {
                return Ok(());
            };
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now < next_check {
                self.sleep_on(late, epoch, next_check - now);
                continue;
            }
            let cond = arrived;
            next_check = now + LIVENESS_EVERY;
            let missing: Vec<usize> = (0..self.n()).filter(|&r| !cond(r)).collect();
            if let Some(&r) = missing.iter().find(|&&r| self.peer_gone(r)) {
                return Err(CommError::RankDied {
                    group: self.m.name.clone(),
                    rank: self.m.world_ranks[r],
                    call: call.to_string(),
                });
            }
            if now >= deadline {
                return Err(CommError::Timeout {
                    group: self.m.name.clone(),
                    call: call.to_string(),
                    timeout: self.m.timeout,
                    waiting_for: missing.iter().map(|&r| self.m.world_ranks[r]).collect(),
                });
            }
        }
    }

    /// Sleeps until rank `r` arrives at `epoch` (or `at_most` passes, or a
    /// spurious wake-up). The sleeper count is raised before the last look at
    /// the word, and the arriver reads it after storing (both SeqCst), so
    /// either this rank sees the arrival or the arriver sees the sleeper.
    fn sleep_on(&self, r: usize, epoch: u64, at_most: Duration) {
        let (word, sleepers) = (self.seg.word(r, W_ARRIVE), self.seg.word(r, W_SLEEPERS));
        sleepers.fetch_add(1, Ordering::SeqCst);
        let seen = word.load(Ordering::SeqCst);
        if seen < epoch {
            futex::wait(word, seen, at_most);
        }
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    fn pass_barrier(
        &self,
        st: &mut State,
        call: &OpDesc,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let e = self.arrive(st);
        self.wait_all(call, deadline, e)
    }

    /// The first half of a barrier: tells the others this rank is there
    /// (waking any asleep on it) and returns the epoch to wait for. Work
    /// that touches nothing shared can go between this and `wait_all`.
    fn arrive(&self, st: &mut State) -> u64 {
        st.epoch += 1;
        let e = st.epoch;
        let word = self.seg.word(self.m.me, W_ARRIVE);
        word.store(e, Ordering::SeqCst);
        if self.seg.word(self.m.me, W_SLEEPERS).load(Ordering::SeqCst) > 0 {
            futex::wake_all(word);
        }
        e
    }

    /// Publishes `desc`, passes a barrier, and returns every rank's
    /// description, or the mismatch.
    fn agree(
        &self,
        st: &mut State,
        desc: &OpDesc,
        deadline: Instant,
    ) -> Result<Vec<OpDesc>, CommError> {
        if let Some(e) = &st.poisoned {
            return Err(e.clone());
        }
        let seq = st.seq;
        st.seq += 1;
        // Two call slots by parity: a rank can be at most one call ahead.
        let at = W_DESC + (seq as usize % 2) * 3;
        for (i, w) in desc.encode().iter().enumerate() {
            self.seg
                .word(self.m.me, at + i)
                .store(*w, Ordering::Relaxed);
        }
        self.pass_barrier(st, desc, deadline)?;
        let descs: Vec<Option<OpDesc>> = (0..self.n())
            .map(|r| {
                OpDesc::decode([0, 1, 2].map(|i| self.seg.word(r, at + i).load(Ordering::Relaxed)))
            })
            .collect();
        self.m.agreed_calls(seq, descs).inspect_err(|e| {
            // Every later call on this group fails with the same error.
            st.poisoned = Some(e.clone());
        })
    }

    /// Tells the group's chooser of slot stores what an operation of
    /// `rounds` rounds took with `streamed` stores, and says when that
    /// changes them (debug: a run's speed moving for minutes at a time has
    /// this as one cause).
    fn learn(&self, st: &mut State, rounds: usize, streamed: bool, took: &Measured) {
        match st.stores.observe(rounds, streamed, took) {
            Some(Switch::ToStreaming(x)) => tracing::debug!(
                group = %self.m.name,
                "shm: staging with plain stores took {x:.2}x as long per byte as with \
                 streaming ones (cores on different dies?): streaming stores into the slots"
            ),
            Some(Switch::ToPlain(x)) => tracing::debug!(
                group = %self.m.name,
                "shm: staging with streaming stores took {x:.2}x as long per byte as with \
                 plain ones: plain stores into the slots again"
            ),
            None => {}
        }
    }

    /// Elements of T per part per window when `parts` windows share one of
    /// a slot's `bufs` buffers.
    fn window<T>(&self, parts: usize, bufs: usize) -> usize {
        window_len(self.seg.slot, std::mem::size_of::<T>(), parts, bufs)
    }

    /// Claims the buffers (1 / `bufs` of a slot each) of an operation's
    /// `rounds` rounds of T ([`claim_bufs`]).
    fn claim<T>(&self, st: &mut State, rounds: usize, bufs: usize) -> Claimed {
        let size = std::mem::size_of::<T>();
        let (slot, laps) = (self.seg.slot, self.seg.laps);
        claim_bufs(&mut st.ring_at, slot, laps, size, bufs, rounds)
    }

    /// reduce_scatter (`full == false`: this rank's reduced part goes to
    /// `part`) or all_reduce (`full == true`: the whole result is written back
    /// into `buf`, window by window, after each window was staged). Reuses
    /// the caller's buffers: no allocation, no page faults.
    ///
    /// all_reduce: each rank writes its window's result into the result
    /// area, and the results of round j are copied back during round j + 1,
    /// after its barrier (which every writer passed after writing), the
    /// last round's after one closing barrier: one barrier a round instead
    /// of two (about 3% at 16-128 MiB on 2 ranks).
    ///
    /// Staging is pipelined: between arriving at round j's barrier and
    /// waiting on it, a rank stages round j + 1 (its own input into its own
    /// slot: nothing anyone reads yet), so that copy overlaps the peers'
    /// arrival instead of delaying its own. The rounds' buffers are
    /// therefore thirds of a slot, at least three along the ring
    /// ([`ring_bufs`]): round j + 1's staging writes a buffer that
    /// round j - 2 read at the latest, and every reader of it has arrived
    /// at round j - 1's barrier, which this rank has passed (the next
    /// operation's agreement barrier protects the last rounds).
    fn reduce<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        dest: Dest<'_, T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let (n, me, len) = (self.n(), self.m.me, buf.len());
        let parts: Vec<std::ops::Range<usize>> = (0..n).map(|p| chunk_range(len, n, p)).collect();
        const BUFS: usize = 3;
        let w = self.window::<T>(n, BUFS);
        let rounds = parts[0].len().div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, BUFS);
        let full = matches!(dest, Dest::All);
        // Plain or streaming stores into the slots (`slot_stores`), and
        // what this operation's writes and reads took, to choose again.
        let nt = st.stores.streaming(rounds);
        let mut took = Measured::default();
        // Out of place, when the destination cannot be cached anyway, it
        // is written with streaming stores: a plain store would first read
        // every cold line of the destination (read-for-ownership), 2 S
        // instead of 1.5 S per rank through the memory bus the ranks share.
        // Measured at 128 MiB on 2 ranks: 15.3 -> 12.1 ms. f32 sums and
        // averages stream from the reduction's own registers
        // (`Element::reduce_into_streaming`); other types reduce each
        // window into a window-sized buffer and stream that out, one more
        // pass over the window (about 10% slower at 128 MiB).
        let stream = matches!(dest, Dest::Part(_))
            && part_streams(
                bytes_of::<T>(len),
                n,
                crate::caches::last_level_cache_bytes(),
            );
        // Every window is reduced into a private window-sized buffer first,
        // unless it goes straight into the destination (reduce_scatter out
        // of place: small, or f32 streamed; in place: f32 sums, over this
        // rank's own input). From there it is written
        // over this rank's input (in place), streamed out (above), or
        // copied into the result area (all_reduce). The last matters when
        // the ranks' cores are on different dies: the reduction loop's own
        // stores into shared lines a peer's core held last stalled it, and
        // all_reduce ran 1.7-1.9x slower than with the copy, which moves
        // them many at a time.
        let mut part = match dest {
            Dest::Part(part) => {
                // Reuse the caller's buffer as it is: clearing would zero-fill it again.
                part.truncate(parts[me].len());
                part.resize(parts[me].len(), T::ZERO);
                Some(part)
            }
            Dest::All | Dest::InPlace => None,
        };
        // Allocated on first use: a call that never needs it (straight
        // into the destination, or the fused f32 stream) does not zero
        // one for nothing.
        let mut tmp: Vec<T> = Vec::new();
        let cap = w.min(parts[me].len());
        let window = |p: usize, j: usize| {
            let s = (parts[p].start + j * w).min(parts[p].end);
            s..(s + w).min(parts[p].end)
        };
        // Only the parts other ranks reduce are staged: this rank reads its
        // own part straight from `buf`.
        // Timed into `took`, with the bytes it wrote.
        let stage = |buf: &[T], j: usize, took: &mut Measured| {
            let (t, h) = (Instant::now(), ring.at(j));
            let mut bytes = 0;
            for p in (0..n).filter(|&p| p != me) {
                let r = window(p, j);
                bytes += bytes_of::<T>(r.len());
                // SAFETY: only rank `me` writes its own ring, and round
                // j's buffer is one no peer reads now (see above).
                copy_to_slot(
                    unsafe { self.seg.slot::<T>(me, h + p * w, r.len()) },
                    &buf[r],
                    nt,
                );
            }
            took.wrote(t, bytes);
        };
        // all_reduce: copies every rank's result of round j back into `buf`.
        let take_results = |buf: &mut [T], j: usize| {
            let h = ring.at(j);
            for p in 0..n {
                let r = window(p, j);
                let l = r.len();
                // SAFETY: round j's buffer of the result ring, complete
                // (its writers arrived at a later barrier this rank
                // passed) and rewritten in round j + 3 at the earliest,
                // after this rank arrived at that round's barrier.
                buf[r].copy_from_slice(unsafe { self.seg.slot::<T>(n, h + p * w, l) });
            }
        };
        if rounds > 0 {
            stage(buf, 0, &mut took);
        }
        // Round j's reading of the peers' windows, timed up to the next
        // round (it ends in more than one place), less all_reduce's writing
        // of its result into the shared area meanwhile (a write like
        // staging, counted as one).
        let mut reading: Option<(Instant, usize)> = None;
        let mut results_written = Duration::ZERO;
        for j in 0..rounds {
            if let Some((t, b)) = reading.take() {
                took.read_less(t, std::mem::take(&mut results_written), b);
            }
            let h = ring.at(j);
            let e = self.arrive(&mut st);
            if j + 1 < rounds {
                stage(buf, j + 1, &mut took);
            }
            self.wait_all(desc, deadline, e)?;
            // Read from shared memory this round: the peers' windows, and
            // for all_reduce the results too (about n windows, taken a
            // round later).
            let windows = if full { 2 * n - 1 } else { n - 1 };
            reading = Some((Instant::now(), windows * bytes_of::<T>(window(me, j).len())));
            // SAFETY (slots below): peers' buffers of round j are complete
            // (they arrived after staging them); between barriers only rank
            // `me` writes its own window of the result ring's buffer.
            let r = window(me, j);
            let others: Vec<&[T]> = (0..n)
                .filter(|&q| q != me)
                .map(|q| &*unsafe { self.seg.slot::<T>(q, h + me * w, r.len()) })
                .collect();
            // In place, an f32 sum reduces over this rank's input where it
            // is (`Element::reduce_over`): no scratch window to copy back.
            if !full && part.is_none() && T::reduce_over(&mut buf[r.clone()], &others, me, op) {
                continue;
            }
            let mut srcs = others;
            srcs.insert(me, &buf[r.clone()]);
            if full {
                let l = r.len();
                let tmp = scratch(&mut tmp, cap, l);
                T::reduce_into(tmp, &srcs, op);
                drop(srcs);
                let t = Instant::now();
                copy_to_slot(unsafe { self.seg.slot::<T>(n, h + me * w, l) }, tmp, nt);
                let d = t.elapsed();
                took.wrote_for(d, bytes_of::<T>(l));
                results_written += d;
                if j > 0 {
                    take_results(buf, j - 1);
                }
            } else {
                let at = r.start - parts[me].start;
                let l = r.len();
                // Streamed straight from the reduction where the type has
                // a kernel for it (above); else through `tmp` below.
                let fused = stream
                    && part.as_mut().is_some_and(|part| {
                        T::reduce_into_streaming(&mut part[at..at + l], &srcs, op)
                    });
                match part.as_mut() {
                    _ if fused => {}
                    Some(part) if !stream => T::reduce_into(&mut part[at..at + l], &srcs, op),
                    part => {
                        let tmp = scratch(&mut tmp, cap, l);
                        T::reduce_into(tmp, &srcs, op);
                        drop(srcs);
                        let to = match part {
                            Some(part) => &mut part[at..at + l],
                            None => &mut buf[r],
                        };
                        copy_streaming(to, tmp, stream);
                    }
                }
            }
        }
        if let Some((t, b)) = reading.take() {
            took.read_less(t, results_written, b);
        }
        // all_reduce counted its results written as writes and those it
        // reads as reads, so its ratio compares like with like (measured:
        // 1.1-1.7 with a shared cache, 3.6-6.4 across dies).
        self.learn(&mut st, rounds, nt, &took);
        if full && rounds > 0 {
            self.pass_barrier(&mut st, desc, deadline)?;
            take_results(buf, rounds - 1);
        }
        Ok(())
    }

    /// Concatenates the ranks' parts into `out`. `input` is this rank's
    /// part, or `None` when it is already in `out` at its place (in place:
    /// one copy less).
    fn gather<T: Element>(
        &self,
        desc: &OpDesc,
        input: Option<&[T]>,
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        let descs = self.agree(&mut st, desc, deadline)?;
        let parts = gather_ranges(&descs);
        // Reuse the caller's buffer as it is: clearing would zero-fill it again.
        let total = parts.last().map_or(0, |p| p.end);
        if input.is_none() && out.len() != total {
            return Err(invalid(
                &self.m.name,
                desc,
                format!("in-place all_gather needs a buffer of {total} elements (the parts' sum), got {}", out.len()),
            ));
        }
        out.truncate(total);
        out.resize(total, T::ZERO);
        let w = self.window::<T>(1, 2);
        let rounds = parts.iter().map(|p| p.len()).max().unwrap_or(0).div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, 2);
        let stream = bytes_of::<T>(total) >= stream_min_dest_bytes();
        // Out of place (the only copy it is used for), this rank's own
        // part is streamed into `out` by the rule reduce_scatter's part
        // follows ([`part_streams`]). The peers' parts, copied last, stay
        // plain below `stream`: what the caller reads next, and what stays
        // cached of `out`.
        let stream_own = stream
            || part_streams(
                bytes_of::<T>(total),
                self.n(),
                crate::caches::last_level_cache_bytes(),
            );
        let nt = st.stores.streaming(rounds);
        let mut took = Measured::default();
        for j in 0..rounds {
            let h = ring.at(j);
            // Rank r's window of this round, within its part and in `out`.
            let part = |r: usize| (j * w).min(parts[r].len())..((j + 1) * w).min(parts[r].len());
            let place = |r: usize, p: &std::ops::Range<usize>| {
                parts[r].start + p.start..parts[r].start + p.end
            };
            let mine = part(self.m.me);
            let own = place(self.m.me, &mine);
            // SAFETY: own ring written between barriers; others read
            // after. Round j + 1 writes a buffer that round j - 1 read at
            // the latest (half a slot each, at least two along the ring),
            // whose readers have all arrived at round j.
            let slot = unsafe { self.seg.slot::<T>(self.m.me, h, mine.len()) };
            // Out of place, this rank's part goes into `out` after
            // arriving, so the copy overlaps the peers' arrival instead of
            // delaying it. When `out` is streamed into, it is copied from
            // the slot, still in this core's cache, not from `input`: one
            // read of the part from memory. Copying into the slot and
            // streaming into `out` in one loop instead (one read too) was
            // 1.6x slower at 128 MiB on 2 ranks (AMD EPYC, AVX-512 VM:
            // 12.4 -> 7.9 ms median, faster in 12 of 12 interleaved pairs):
            // plain stores between the streaming ones seem to break up
            // their write-combining. Streamed into the slot (`slot_stores`),
            // the part is not in this core's cache after all: it goes into
            // `out` from `input`.
            let t = Instant::now();
            let later = match input {
                Some(input) => {
                    copy_to_slot(slot, &input[mine.clone()], nt);
                    Some(if stream && !nt {
                        &*slot
                    } else {
                        &input[mine.clone()]
                    })
                }
                None => {
                    copy_to_slot(slot, &out[own.clone()], nt);
                    None
                }
            };
            took.wrote(t, bytes_of::<T>(mine.len()));
            // The peers may read the slot now (and this rank, below).
            let e = self.arrive(&mut st);
            if let Some(src) = later {
                copy_streaming(&mut out[own], src, stream_own);
            }
            self.wait_all(desc, deadline, e)?;
            let t = Instant::now();
            let mut bytes = 0;
            for r in (0..self.n()).filter(|&r| r != self.m.me) {
                let p = part(r);
                // SAFETY: rank r's buffer of this round, read after the barrier.
                let src = unsafe { self.seg.slot::<T>(r, h, p.len()) };
                copy_streaming(&mut out[place(r, &p)], src, stream);
                bytes += bytes_of::<T>(p.len());
            }
            took.read(t, bytes);
        }
        self.learn(&mut st, rounds, nt, &took);
        Ok(())
    }
}

impl Inner {
    /// all_to_all a window at a time, as [`Inner::gather`] moves its parts:
    /// each round, this rank stages its window of every peer's chunk in
    /// its slot (cut in `n - 1` windows, one per peer: its own chunk is
    /// never staged, so on 2 ranks a window is as long as a gather's),
    /// arrives, copies its own chunk's window into `out` meanwhile, and
    /// after the barrier reads its window from every peer's slot into
    /// that peer's place in `out`. Two buffers along the ring, for
    /// gather's reason. It takes 1.2-1.3x an all_gather of the same
    /// output at 16-128 MiB on 2 ranks: it reads its whole input from
    /// memory, where a gather reads its part.
    fn exchange_chunks<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let (n, me, len) = (self.n(), self.m.me, input.len());
        // Agreement made every rank's input as long: chunk `p` is the same
        // range on every rank.
        let parts: Vec<std::ops::Range<usize>> = (0..n).map(|p| chunk_range(len, n, p)).collect();
        let m = parts[me].len();
        out.truncate(n * m);
        out.resize(n * m, T::ZERO);
        let w = self.window::<T>(n - 1, 2);
        let rounds = parts[0].len().div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, 2);
        let nt = st.stores.streaming(rounds);
        let stream = bytes_of::<T>(n * m) >= stream_min_dest_bytes();
        // Where rank `from` stages its window for rank `to` (`to != from`):
        // the peers in rank order, `from` left out.
        let at_of = |to: usize, from: usize| (to - usize::from(to > from)) * w;
        let window = |p: usize, j: usize| {
            let s = (parts[p].start + j * w).min(parts[p].end);
            s..(s + w).min(parts[p].end)
        };
        let mut took = Measured::default();
        for j in 0..rounds {
            let h = ring.at(j);
            let t = Instant::now();
            let mut bytes = 0;
            for p in (0..n).filter(|&p| p != me) {
                let r = window(p, j);
                bytes += bytes_of::<T>(r.len());
                // SAFETY: only rank `me` writes its own ring; round j's
                // buffer was last read in round j - 2 at the latest, whose
                // readers have all arrived at round j - 1's barrier, which
                // this rank passed.
                copy_to_slot(
                    unsafe { self.seg.slot::<T>(me, h + at_of(p, me), r.len()) },
                    &input[r],
                    nt,
                );
            }
            took.wrote(t, bytes);
            let e = self.arrive(&mut st);
            // Where a window of chunk `me` goes in `out`, from rank `q`.
            let r = window(me, j);
            let at = |q: usize| q * m + r.start - parts[me].start..q * m + r.end - parts[me].start;
            copy_streaming(&mut out[at(me)], &input[r.clone()], stream);
            self.wait_all(desc, deadline, e)?;
            let t = Instant::now();
            for q in (0..n).filter(|&q| q != me) {
                // SAFETY: rank q's buffer of this round, complete (it
                // arrived after staging it), read after the barrier.
                let src = unsafe { self.seg.slot::<T>(q, h + at_of(me, q), r.len()) };
                copy_streaming(&mut out[at(q)], src, stream);
            }
            took.read(t, (n - 1) * bytes_of::<T>(r.len()));
        }
        self.learn(&mut st, rounds, nt, &took);
        Ok(())
    }

    /// Allocates this rank's buffer of symmetric allocation `desc.buffer`
    /// and maps every peer's. In two phases, each ending at a barrier with
    /// every rank's outcome in its status word, so a rank that fails fails
    /// every rank with its name instead of leaving them waiting: (1) each
    /// rank creates and maps its own file, its pages reserved up front
    /// (`posix_fallocate`: a full /dev/shm is an error here, not a SIGBUS
    /// later); (2) each maps the peers' files. Then the names go, as the
    /// segment's do: the memory lives as long as some rank maps it.
    fn alloc<T: Element>(&self, len: usize) -> Result<SymmetricBuf<T>, CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        let id = st.allocs;
        st.allocs += 1;
        let desc = OpDesc {
            buffer: Some(id),
            ..OpDesc::new(OpKind::AllocSymmetric, Some(T::DTYPE), len)
        };
        self.agree(&mut st, &desc, deadline)?;
        let (n, me) = (self.n(), self.m.me);
        let bytes = bytes_of::<T>(len).max(1).div_ceil(4096) * 4096;
        let file = |r: usize| format!("{}-sym{id}-r{r}", self.path);
        let own = create_mapped(&file(me), bytes);
        // However this ends, the name goes when it returns: after phase 1
        // every rank has mapped the file or given up.
        let _unlink = Unlink(file(me));
        self.phase(&mut st, &desc, deadline, id, 0, own.as_ref().err().cloned())??;
        // Its own failure would have been reported by `phase`.
        let mut own = Some(own.map_err(|why| self.shm_error(&desc, why))?);
        let mut maps = Vec::with_capacity(n);
        let mut failed = None;
        for r in 0..n {
            let m = match own.take_if(|_| r == me) {
                Some(m) => Ok(m),
                None => open_mapped(&file(r), bytes),
            };
            match m {
                Ok(m) => maps.push(m),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        self.phase(&mut st, &desc, deadline, id, 1, failed)??;
        let shared = Shared {
            group: self.serial,
            id,
            maps,
            me,
        };
        Ok(SymmetricBuf::shared(shared, len))
    }

    /// Publishes how this rank's step of an allocation went (`failed`: why
    /// not), passes a barrier and returns the first failure: this rank's own
    /// (with its reason) or a peer's (naming it). The outer error is the
    /// barrier's own (a dead rank, the deadline).
    fn phase(
        &self,
        st: &mut State,
        desc: &OpDesc,
        deadline: Instant,
        id: u32,
        phase: u64,
        failed: Option<String>,
    ) -> Result<Result<(), CommError>, CommError> {
        // Tagged with the allocation and the phase, so a word left from an
        // earlier one never reads as success.
        let tag = |ok: bool| (u64::from(id) + 1) << 2 | phase << 1 | u64::from(!ok);
        let w = W_STATUS + phase as usize;
        self.seg
            .word(self.m.me, w)
            .store(tag(failed.is_none()), Ordering::Relaxed);
        self.pass_barrier(st, desc, deadline)?;
        if let Some(why) = failed {
            return Ok(Err(self.shm_error(desc, why)));
        }
        let bad = (0..self.n()).find(|&r| self.seg.word(r, w).load(Ordering::Relaxed) != tag(true));
        Ok(match bad {
            None => Ok(()),
            Some(r) => Err(self.shm_error(
                desc,
                format!(
                    "rank {} failed to {} (its own error says why)",
                    self.m.world_ranks[r],
                    if phase == 0 {
                        "create its buffer"
                    } else {
                        "map a peer's buffer"
                    }
                ),
            )),
        })
    }

    fn shm_error(&self, desc: &OpDesc, why: String) -> CommError {
        CommError::SharedMemory {
            group: self.m.name.clone(),
            call: desc.to_string(),
            why,
        }
    }

    /// `buf`'s shared side, if this group allocated it.
    fn own_buffer<'a, T: Element>(&self, buf: &'a SymmetricBuf<T>) -> Option<&'a Shared> {
        buf.shared_part()
            .filter(|s| s.group == self.serial && s.maps.len() == self.n())
    }

    /// Runs a symmetric collective on `buf`: agrees on `desc`, runs `body`
    /// on the buffer's mappings, then passes a closing barrier, which keeps
    /// every rank's buffer still until all peers' reads are done. A rank
    /// whose buffer is not this group's still takes part in the agreement
    /// (its description names no buffer), so the peers fail at once on the
    /// mismatch instead of waiting for it, and it reports the foreign
    /// buffer itself.
    fn symmetric<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &SymmetricBuf<T>,
        body: impl FnOnce(&Shared),
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        let agreed = self.agree(&mut st, desc, deadline);
        let sh = self
            .own_buffer(buf)
            .ok_or_else(|| foreign_buffer(&self.m.name, desc))?;
        agreed?;
        body(sh);
        self.pass_barrier(&mut st, desc, deadline)
    }

    /// reduce_scatter on a symmetric buffer: this rank reduces its part
    /// reading every rank's buffer where it is, a window at a time, over
    /// its own part (f32 sums) or into a cache-sized scratch then written
    /// over it. Peers read only their own parts of this rank's buffer, so
    /// nothing they read changes.
    /// Runs inside [`Inner::symmetric`], between agreement and barrier.
    fn reduce_symmetric<T: Element>(&self, sh: &Shared, len: usize, op: ReduceOp) {
        let (n, me) = (self.n(), self.m.me);
        let part = chunk_range(len, n, me);
        let w = (SCRATCH_BYTES / std::mem::size_of::<T>().max(1)).min(part.len());
        // Allocated on first use: f32 sums reduce over their own part.
        let mut tmp = Vec::new();
        let mut at = part.start;
        while at < part.end {
            let l = w.min(part.end - at);
            // SAFETY: each buffer holds `len` elements; between the
            // agreement and the closing barrier no rank writes any rank's
            // part `me` but this one, and no peer reads it.
            let src = |q: usize| unsafe { std::slice::from_raw_parts(sh.ptr::<T>(q).add(at), l) };
            let own = unsafe { std::slice::from_raw_parts_mut(sh.ptr::<T>(me).add(at), l) };
            let others: Vec<&[T]> = (0..n).filter(|&q| q != me).map(src).collect();
            // An f32 sum reduces over this rank's part where it is
            // (`Element::reduce_over`); other types into the scratch,
            // which is then written over it.
            if !T::reduce_over(own, &others, me, op) {
                let tmp = scratch(&mut tmp, w, l);
                let mut srcs = others;
                srcs.insert(me, own);
                T::reduce_into(tmp, &srcs, op);
                own.copy_from_slice(tmp);
            }
            at += l;
        }
    }

    /// all_gather on a symmetric buffer: every rank's part is already in
    /// its own buffer, so each rank copies the peers' parts straight from
    /// theirs (starting at the next rank, so n > 2 ranks do not all read
    /// rank 0 first). Runs inside [`Inner::symmetric`], between agreement
    /// and barrier.
    fn gather_symmetric<T: Element>(&self, sh: &Shared, len: usize) {
        let (n, me) = (self.n(), self.m.me);
        let stream = bytes_of::<T>(len) >= stream_min_dest_bytes();
        for q in (1..n).map(|k| (me + k) % n) {
            let r = chunk_range(len, n, q);
            // SAFETY: rank q's part of its own buffer, which nobody writes
            // during the collective; this rank's part q, which only this
            // rank writes (and nobody reads) during it.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(sh.ptr::<T>(q).add(r.start), r.len()),
                    std::slice::from_raw_parts_mut(sh.ptr::<T>(me).add(r.start), r.len()),
                )
            };
            copy_streaming(dst, src, stream);
        }
    }
}

/// The first `l` elements of `tmp`, grown to `cap` (at least `l`) zeroed
/// elements the first time it is too short.
fn scratch<T: Element>(tmp: &mut Vec<T>, cap: usize, l: usize) -> &mut [T] {
    if tmp.len() < l {
        tmp.resize(cap.max(l), T::ZERO);
    }
    &mut tmp[..l]
}

/// The error for a symmetric buffer passed to a group that did not allocate it.
fn foreign_buffer(group: &str, desc: &OpDesc) -> CommError {
    invalid(
        group,
        desc,
        "the symmetric buffer was allocated by another group: use a buffer from this group's alloc_symmetric",
    )
}

/// Scratch of the symmetric reduce-scatter: a window this size stays in L2.
const SCRATCH_BYTES: usize = 64 << 10;

/// Removes a file when dropped.
struct Unlink(String);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Creates `path` (exclusively) with `bytes` reserved and maps it.
fn create_mapped(path: &str, bytes: usize) -> Result<MmapMut, String> {
    let _ = std::fs::remove_file(path);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| format!("creating {path}: {e}"))?;
    reserve(&f, bytes).map_err(|e| format!("reserving {bytes} bytes for {path}: {e}"))?;
    // SAFETY: this job's file, sized above; shared only through the
    // symmetric collectives' protocol.
    unsafe { MmapMut::map_mut(&f) }.map_err(|e| format!("mapping {path}: {e}"))
}

/// Maps a peer's file made by [`create_mapped`], checking its size.
fn open_mapped(path: &str, bytes: usize) -> Result<MmapMut, String> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("opening {path}: {e}"))?;
    let have = f.metadata().map_err(|e| format!("{path}: {e}"))?.len();
    if have != bytes as u64 {
        return Err(format!("{path} has {have} bytes, not {bytes}"));
    }
    // SAFETY: as in `create_mapped`.
    unsafe { MmapMut::map_mut(&f) }.map_err(|e| format!("mapping {path}: {e}"))
}

/// Sizes `f` to `bytes`, with the pages allocated now where the platform
/// can, so running out of shared memory is an error instead of a SIGBUS.
fn reserve(f: &std::fs::File, bytes: usize) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor, a non-negative range.
        let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, bytes as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    #[allow(unreachable_code)]
    f.set_len(bytes as u64)
}

/// Where `reduce` leaves its result.
enum Dest<'a, T> {
    /// all_reduce: the whole result back into the buffer.
    All,
    /// reduce_scatter: this rank's part into this vector.
    Part(&'a mut Vec<T>),
    /// reduce_scatter in place: this rank's part over its own input.
    InPlace,
}

/// One rank's handle on a shared-memory group.
pub struct ShmGroup {
    front: Front<Inner>,
}

/// What a rank needs to join a shared-memory group.
pub struct ShmJoin<'a> {
    /// The job's store.
    pub store: Arc<StoreClient>,
    /// Unique per job (names the segment file).
    pub job: &'a str,
    /// The group's name (unique within the job).
    pub name: &'a str,
    /// The members' world ranks, in group order.
    pub world_ranks: Vec<usize>,
    /// This rank's world rank.
    pub world_rank: usize,
    /// Staging bytes per rank.
    pub slot_bytes: usize,
    /// How this rank writes its slots (`ZRT_SHM_SLOT_STORES`).
    pub slot_stores: SlotStores,
    /// Timeout of every wait.
    pub timeout: Duration,
}

impl ShmGroup {
    /// Creates (group rank 0) or maps (the others) the group's segment.
    /// Every member must call it.
    pub fn join(j: ShmJoin<'_>) -> Result<Self, CommError> {
        let n = j.world_ranks.len();
        let me = j
            .world_ranks
            .iter()
            .position(|&r| r == j.world_rank)
            .ok_or_else(|| CommError::Invalid {
                group: j.name.to_string(),
                call: "join".into(),
                why: format!(
                    "rank {} is not a member of {:?}",
                    j.world_rank, j.world_ranks
                ),
            })?;
        let own_slot = slot_bytes_for(j.slot_bytes, n);
        let safe: String = j
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = std::path::PathBuf::from(format!("/dev/shm/zrt-{}-{safe}", j.job));
        let key = |k: &str| format!("shm/{}/{k}", j.name);
        // A wait for a peer's step of the join, whose failure names the
        // peer and the group rather than a store key.
        let await_rank = |r: usize, step: &str, k: &str| {
            crate::store::await_rank(&j.store, &key(k), j.world_ranks[r], j.timeout, || {
                format!("{step} shared-memory group `{}`", j.name)
            })
        };
        let io = |what: &str, e: std::io::Error| {
            CommError::Rendezvous(format!("{what} {}: {e}", path.display()))
        };
        let (file, slot, laps, unlink) = if me == 0 {
            let slot = own_slot;
            let laps = ring_laps(slot, n, crate::caches::core_cache_bytes());
            let _ = std::fs::remove_file(&path);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| io("creating", e))?;
            // From here the name goes however join ends: a failure below
            // (a rank that never maps it, a timeout) must not leave the
            // segment in /dev/shm, holding its memory until reboot.
            // Every rank holds such a guard once the file exists, so that
            // a rank 0 killed before everyone mapped it (nothing runs in a
            // killed process) does not leave it either.
            let unlink = Unlink(path.display().to_string());
            // Its pages reserved now: a sparse file on a /dev/shm too
            // small for it (Docker gives containers 64 MiB) joined fine and
            // killed the ranks with SIGBUS at their first collective.
            let bytes = Segment::bytes(n, slot, laps);
            reserve(&f, bytes).map_err(|e| {
                CommError::Rendezvous(format!(
                    "reserving {bytes} bytes of shared memory for {}: {e}; /dev/shm is full \
                     or smaller than the job needs (see `df -h /dev/shm`; Docker gives a \
                     container 64 MiB unless run with --shm-size): free space there, or use \
                     ZRT_BACKEND=tcp",
                    path.display()
                ))
            })?;
            // The layout is rank 0's: a rank started with another
            // ZRT_SHM_SLOT_BYTES, or on a core with another cache, must
            // not index the segment differently.
            let layout = [slot as u64, laps as u64].map(u64::to_le_bytes).concat();
            j.store.set(&key("created"), &layout)?;
            (f, slot, laps, unlink)
        } else {
            let b = await_rank(0, "create", "created")?;
            let word = |i: usize| {
                b.get(i * 8..i * 8 + 8)
                    .and_then(|w| <[u8; 8]>::try_from(w).ok())
                    .map(|w| u64::from_le_bytes(w) as usize)
            };
            let (slot, laps) = match (b.len(), word(0), word(1)) {
                (16, Some(slot), Some(laps)) => (slot, laps),
                _ => return Err(CommError::Rendezvous("malformed segment layout".into())),
            };
            if slot != own_slot {
                tracing::warn!(
                    group = j.name,
                    rank0 = slot,
                    here = own_slot,
                    "ZRT_SHM_SLOT_BYTES differs from rank 0's: using rank 0's staging slots"
                );
            }
            let unlink = Unlink(path.display().to_string());
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| io("opening", e))?;
            (f, slot, laps, unlink)
        };
        // SAFETY: the file is this job's, sized above, and only accessed
        // through `Segment`'s atomics and protocol-owned ranges.
        let map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&file) }
            .map_err(|e| io("mapping", e))?;
        if map.len() < Segment::bytes(n, slot, laps) {
            return Err(CommError::Rendezvous(format!(
                "{} holds {} bytes, the group's layout needs {}",
                path.display(),
                map.len(),
                Segment::bytes(n, slot, laps)
            )));
        }
        let seg = Segment { map, n, slot, laps };
        if me == 0 {
            // SAFETY: header words, written before anyone is told "ready".
            unsafe { (seg.base() as *mut u64).write(MAGIC) };
        }
        // Publish this process's pid for liveness checks, then read every
        // rank's: a rank publishes only once it has mapped the segment (and
        // rank 0 once it wrote the header), so having all pids is the
        // barrier that lets the name go and the header be read.
        j.store.set(
            &key(&format!("pid/{me}")),
            &std::process::id().to_le_bytes(),
        )?;
        let mut pids = Vec::with_capacity(n);
        for r in 0..n {
            let b = await_rank(r, "join", &format!("pid/{r}"))?;
            pids.push(u32::from_le_bytes(
                b.as_slice()
                    .try_into()
                    .map_err(|_| CommError::Rendezvous("malformed pid".into()))?,
            ));
        }
        // Everyone has mapped it: the name can go, the memory stays.
        drop(unlink);
        // SAFETY: header word written by rank 0 before it published its pid.
        if unsafe { (seg.base() as *const u64).read() } != MAGIC {
            return Err(CommError::Rendezvous(format!(
                "{} is not a zrt segment",
                path.display()
            )));
        }
        let inner = Arc::new(Inner {
            seg,
            m: Member {
                name: j.name.to_string(),
                me,
                world_ranks: j.world_ranks,
                timeout: j.timeout,
                store: j.store,
                mailbox: Mailbox::default(),
            },
            pids,
            state: Mutex::new(State {
                ring_at: 0,
                seq: 0,
                epoch: 0,
                allocs: 0,
                poisoned: None,
                stores: Chooser::new(j.slot_stores),
            }),
            serial: SERIALS.fetch_add(1, Ordering::Relaxed),
            path: path.display().to_string(),
        });
        let i2 = inner.clone();
        let worker = Worker::start(j.name, me, move || i2.leave())?;
        Ok(Self {
            front: Front::new(inner, worker),
        })
    }

    /// Whether every other member has left the group or died.
    pub fn peers_gone(&self) -> bool {
        self.front.peers_gone()
    }

    /// Finishes what was issued and leaves the group, as dropping it does,
    /// but keeps it to ask [`Self::peers_gone`]; later operations fail with
    /// [`CommError::Closed`].
    pub fn close(&mut self) {
        self.front.close();
    }
}

impl Transport for Inner {
    fn member(&self) -> &Member {
        &self.m
    }
    fn n(&self) -> usize {
        self.seg.n
    }
    fn peer_gone(&self, r: usize) -> bool {
        self.seg.word(r, W_LEFT).load(Ordering::Acquire) != 0 || process_gone(self.pids[r])
    }
    fn leave(&self) {
        self.seg.word(self.m.me, W_LEFT).store(1, Ordering::Release);
        // Peers asleep on this rank's arrival look again at once.
        futex::wake_all(self.seg.word(self.m.me, W_ARRIVE));
    }

    /// Agrees on the call, then passes a second barrier: a rank that
    /// reached the barrier and then gave up on it (timed out, and left)
    /// has arrived at the first but never arrives at the second, so a
    /// late rank fails naming it instead of passing (as a late rank's
    /// gather fails: it needs the peer's data).
    fn barrier(&self, desc: &OpDesc) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        self.pass_barrier(&mut st, desc, deadline)
    }
    fn all_reduce<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce(desc, buf, Dest::All, op)
    }
    fn reduce_scatter<T: Element>(
        &self,
        desc: &OpDesc,
        input: &mut [T],
        out: &mut Vec<T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce(desc, input, Dest::Part(out), op)
    }
    fn all_gather<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        self.gather(desc, Some(input), out)
    }
    fn all_to_all<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        self.exchange_chunks(desc, input, out)
    }
    fn broadcast<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let w = self.window::<T>(1, 2);
        let rounds = buf.len().div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, 2);
        // The root writes with the stores the group's other operations
        // chose (`slot_stores`); a broadcast teaches nothing, as no rank
        // both writes and reads in it.
        let nt = st.stores.streaming(rounds);
        for j in 0..rounds {
            let h = ring.at(j);
            let r = j * w..((j + 1) * w).min(buf.len());
            if self.m.me == root {
                // SAFETY: the root alone writes its ring between barriers
                // (at least two buffers along it, as in `gather`).
                copy_to_slot(
                    unsafe { self.seg.slot::<T>(root, h, r.len()) },
                    &buf[r.clone()],
                    nt,
                );
            }
            self.pass_barrier(&mut st, desc, deadline)?;
            if self.m.me != root {
                buf[r.clone()].copy_from_slice(unsafe { self.seg.slot::<T>(root, h, r.len()) });
            }
        }
        Ok(())
    }
}

forward_process_group!(ShmGroup {
    fn reduce_scatter_in_place<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let desc = OpDesc::new(OpKind::ReduceScatter(op), Some(T::DTYPE), buf.len());
        let n = self.front.size();
        self.front.run(desc, move |g| {
            g.reduce(&desc, &mut buf, Dest::InPlace, op)?;
            let s = bytes_of::<T>(buf.len());
            Ok((buf, s, s / n.max(1)))
        })
    }

    fn alloc_symmetric<T: Element>(&self, len: usize) -> Work<SymmetricBuf<T>> {
        let desc = OpDesc::new(OpKind::AllocSymmetric, Some(T::DTYPE), len);
        self.front.run(desc, move |g| Ok((g.alloc::<T>(len)?, 0, 0)))
    }

    fn reduce_scatter_symmetric<T: Element>(
        &self,
        buf: SymmetricBuf<T>,
        op: ReduceOp,
    ) -> Work<SymmetricBuf<T>> {
        let mut desc = OpDesc::new(OpKind::ReduceScatter(op), Some(T::DTYPE), buf.len());
        desc.buffer = self.front.inner.own_buffer(&buf).map(|s| s.id);
        let n = self.front.size();
        self.front.run(desc, move |g| {
            g.symmetric(&desc, &buf, |sh| g.reduce_symmetric::<T>(sh, buf.len(), op))?;
            let s = bytes_of::<T>(buf.len());
            Ok((buf, s, s / n.max(1)))
        })
    }

    fn all_gather_symmetric<T: Element>(&self, buf: SymmetricBuf<T>) -> Work<SymmetricBuf<T>> {
        let own = chunk_range(buf.len(), self.front.size(), self.front.rank());
        let mut desc = OpDesc::new(OpKind::AllGatherInPlace, Some(T::DTYPE), buf.len());
        desc.buffer = self.front.inner.own_buffer(&buf).map(|s| s.id);
        self.front.run(desc, move |g| {
            g.symmetric(&desc, &buf, |sh| g.gather_symmetric::<T>(sh, buf.len()))?;
            let (s, r) = (bytes_of::<T>(own.len()), bytes_of::<T>(buf.len()));
            Ok((buf, s, r))
        })
    }

    fn all_gather_in_place<T: Element>(&self, mut buf: Vec<T>) -> Work<Vec<T>> {
        let own = chunk_range(buf.len(), self.front.size(), self.front.rank());
        let desc = OpDesc::new(OpKind::AllGatherInPlace, Some(T::DTYPE), buf.len());
        self.front.run(desc, move |g| {
            g.gather(&desc, None, &mut buf)?;
            let (s, r) = (bytes_of::<T>(own.len()), bytes_of::<T>(buf.len()));
            Ok((buf, s, r))
        })
    }
});

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ProcessGroup;

    #[test]
    fn windows_fit_their_slot_for_any_group_and_dtype() {
        for wanted in [0, 4096, 5000, DEFAULT_SLOT_BYTES] {
            for n in 1..=64 {
                let slot = slot_bytes_for(wanted, n);
                assert!(slot >= wanted && slot % 64 == 0, "{wanted} {n}: {slot}");
                for size in [1, 2, 4, 8] {
                    // Reductions: n parts in 3 buffers; gathers: 1 in 2.
                    for (parts, bufs) in [(n, 3), (1, 2)] {
                        let w = window_len(slot, size, parts, bufs);
                        assert!(
                            w % 16 == 0 && w * parts * bufs * size <= slot,
                            "slot {slot} n {n} size {size}: window {w}"
                        );
                        // And the largest that fits: fewer, longer windows
                        // mean fewer barriers.
                        assert!(
                            (w + 16) * parts * bufs * size > slot,
                            "slot {slot} n {n} size {size}: window {w} could be longer"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_ring_spans_twice_a_cores_cache_of_what_one_peer_reads() {
        let (kib, mib) = (1 << 10, 1 << 20);
        // 2 ranks, 512 KiB slots, 1 MiB of L2: 4 slots (2 MiB).
        assert_eq!(ring_laps(512 * kib, 2, mib), 4);
        // A peer reads 2 rings a lap with 3 ranks, 4 with 5.
        assert_eq!(ring_laps(512 * kib, 3, mib), 2);
        assert_eq!(ring_laps(512 * kib, 5, mib), 1);
        assert_eq!(ring_laps(512 * kib, 64, mib), 1);
        assert_eq!(ring_laps(512 * kib, 2, 2 * mib), 8);
        assert_eq!(ring_laps(512 * kib, 1, mib), 1);
        // Small slots: at most MAX_LAPS; large ones: one.
        assert_eq!(ring_laps(4 * kib, 2, mib), MAX_LAPS);
        assert_eq!(ring_laps(8 * mib, 2, mib), 1);
    }

    #[test]
    fn operations_walk_the_ring_and_no_round_reuses_a_buffer_too_soon() {
        let slot = slot_bytes_for(5000, 3);
        for laps in [1, 2, 5] {
            let ring = slot * laps;
            let mut at = 0;
            let mut used = std::collections::BTreeSet::new();
            let mut last_end = 0;
            // Operations of every buffering, element size and length, in
            // an irregular order, as a training step issues them.
            for k in 0..500usize {
                let bufs = [2, 3][k % 2];
                let size = [4, 2, 8, 1, 4][k % 5];
                let rounds = [1, 2, 7, 3, 40, 1, 5][k % 7];
                let c = claim_bufs(&mut at, slot, laps, size, bufs, rounds);
                assert_eq!((c.len, c.per), ring_bufs(slot, laps, size, bufs));
                assert!(c.per >= bufs * laps, "{laps} {bufs} {size}: {c:?}");
                let bytes = |j: usize| c.at(j) * size..(c.at(j) + c.len) * size;
                // Where the previous operation ended, unless that was the
                // end of the ring.
                if bytes(0).start != 0 {
                    assert!(bytes(0).start >= last_end, "op {k}");
                }
                for j in 0..rounds {
                    let r = bytes(j);
                    assert!(r.end <= ring, "op {k} round {j}: {r:?} past {ring}");
                    used.insert(r.start);
                    // The rounds the buffering protects never share a byte.
                    for d in 1..bufs.min(rounds - j) {
                        let q = bytes(j + d);
                        assert!(
                            r.end <= q.start || q.end <= r.start,
                            "op {k}: {j} and {}",
                            j + d
                        );
                    }
                }
                last_end = bytes(rounds - 1).end;
            }
            // Every lap was written, not only the first.
            assert!(
                used.iter().any(|&b| b >= ring - slot),
                "laps {laps}: {used:?}"
            );
            // One-round operations take the ring's buffers in turn.
            let (_, per) = ring_bufs(slot, laps, 4, 2);
            let mut at = 0;
            let firsts: Vec<usize> = (0..2 * per)
                .map(|_| claim_bufs(&mut at, slot, laps, 4, 2, 1).first)
                .collect();
            let turns: Vec<usize> = (0..2 * per).map(|k| k % per).collect();
            assert_eq!(firsts, turns, "laps {laps}");
        }
    }

    /// A waiting rank really sleeps (a futex on the wrong address returns
    /// at once, and the rank would spin on a core its peer needs), wakes
    /// when the word is no longer what it saw, and is woken by `wake_all`.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_futex_sleeper_sleeps_until_woken() {
        let word = AtomicU64::new(5);
        let t = Instant::now();
        futex::wait(&word, 5, Duration::from_millis(200));
        assert!(
            t.elapsed() >= Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
        let t = Instant::now();
        futex::wait(&word, 6, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        std::thread::scope(|s| {
            let t = Instant::now();
            let sleeper = s.spawn(|| futex::wait(&word, 5, Duration::from_secs(10)));
            // Woken again and again: the sleeper may not be asleep yet.
            while !sleeper.is_finished() {
                assert!(t.elapsed() < Duration::from_secs(5), "wake_all woke nobody");
                futex::wake_all(&word);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
    }

    /// Runs `f` on two ranks (threads) of a new shm group `name` with
    /// 64 KiB slots written under `stores`; each rank's result, in order.
    fn on_two_ranks<R: Send>(
        name: &str,
        stores: SlotStores,
        f: impl Fn(usize, &ShmGroup) -> R + Sync,
    ) -> Vec<R> {
        let srv = crate::store::StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let store = StoreClient::connect(&srv.addr().to_string(), "tok", Duration::from_secs(5));
        let store = Arc::new(store.unwrap());
        let job = format!("two-{}", std::process::id());
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    let (store, job, f) = (store.clone(), &job, &f);
                    sc.spawn(move || {
                        let g = ShmGroup::join(ShmJoin {
                            store,
                            job,
                            name,
                            world_ranks: vec![0, 1],
                            world_rank: r,
                            slot_bytes: 64 << 10,
                            slot_stores: stores,
                            timeout: Duration::from_secs(20),
                        })
                        .unwrap();
                        f(r, &g)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Streaming stores into the slots move the same bytes as plain ones:
    /// two ranks (threads) run every staged operation (and a broadcast), over many rounds and
    /// with parts that do not divide evenly, under each fixed policy, and
    /// the results equal a reference computed here.
    #[test]
    fn streaming_and_plain_slot_stores_give_the_same_results() {
        let len = 50_003; // 200 KB: many 64 KiB-slot rounds, uneven parts
        let inputs: Vec<Vec<f32>> = (0..2)
            .map(|r| {
                (0..len)
                    .map(|i| ((i * 7 + r * 13) % 1000) as f32 * 0.25)
                    .collect()
            })
            .collect();
        let input = |r: usize| inputs[r].clone();
        let sum: Vec<f32> = (0..len).map(|i| inputs[0][i] + inputs[1][i]).collect();
        let half = |r: usize| chunk_range(len, 2, r);
        for (name, stores) in [("plain", SlotStores::Plain), ("nt", SlotStores::Streaming)] {
            let results = on_two_ranks(name, stores, |r, g| {
                let all = g.all_reduce(input(r), ReduceOp::Sum).wait().unwrap();
                let (_, part) = g
                    .reduce_scatter(input(r), Vec::new(), ReduceOp::Sum)
                    .wait()
                    .unwrap();
                let in_place = g
                    .reduce_scatter_in_place(input(r), ReduceOp::Sum)
                    .wait()
                    .unwrap();
                // Parts of equal length (all_gather's rule): 25001 each.
                let mine = input(r)[r * 25_001..(r + 1) * 25_001].to_vec();
                let (_, gathered) = g.all_gather(mine, Vec::new()).wait().unwrap();
                let mut buf = vec![0.0; len];
                buf[half(r)].copy_from_slice(&input(r)[half(r)]);
                let gathered_in_place = g.all_gather_in_place(buf).wait().unwrap();
                let sent = g.broadcast(input(1), 1).wait().unwrap();
                assert!(sent == input(1), "{name}: rank {r}'s broadcast from rank 1");
                (
                    all,
                    part,
                    in_place[half(r)].to_vec(),
                    gathered,
                    gathered_in_place,
                )
            });
            // Each rank's gathered part is its own input's.
            let gathered: Vec<f32> = (0..2)
                .flat_map(|r| input(r)[r * 25_001..(r + 1) * 25_001].to_vec())
                .collect();
            let halves: Vec<f32> = (0..2).flat_map(|r| input(r)[half(r)].to_vec()).collect();
            for (r, (all, part, in_place, g, g_in_place)) in results.into_iter().enumerate() {
                assert!(all == sum, "{name}: rank {r}'s all_reduce");
                assert!(part == sum[half(r)], "{name}: rank {r}'s reduce_scatter");
                assert!(
                    in_place == sum[half(r)],
                    "{name}: rank {r}'s in-place reduce_scatter"
                );
                assert!(g == gathered, "{name}: rank {r}'s all_gather");
                assert!(
                    g_in_place == halves,
                    "{name}: rank {r}'s in-place all_gather"
                );
            }
        }
    }

    /// What `auto` measures to choose its stores: every byte a rank wrote
    /// into shared memory and read out of it, per operation kind.
    #[test]
    fn a_rank_counts_the_bytes_it_writes_into_and_reads_from_shared_memory() {
        let len = 50_003;
        let counted = on_two_ranks("counts", SlotStores::Auto, |_, g| {
            let counts = || g.front.inner.state.lock().stores.pending_bytes();
            let mut seen = vec![counts()];
            g.all_gather(vec![1f32; 25_001], Vec::new()).wait().unwrap();
            seen.push(counts());
            let v = vec![1f32; len];
            g.reduce_scatter(v.clone(), Vec::new(), ReduceOp::Sum)
                .wait()
                .unwrap();
            seen.push(counts());
            g.all_reduce(v, ReduceOp::Sum).wait().unwrap();
            seen.push(counts());
            // One round (a 1 KiB gather): not counted.
            g.all_gather(vec![1f32; 256], Vec::new()).wait().unwrap();
            seen.push(counts());
            seen
        });
        for (r, seen) in counted.iter().enumerate() {
            let own = 4 * chunk_range(len, 2, r).len();
            let peer = 4 * chunk_range(len, 2, 1 - r).len();
            let gather = (100_004, 100_004);
            // reduce_scatter stages the peer's part, reduces its own from
            // the peer's slot; all_reduce also writes its own part's result
            // and reads both results.
            let scatter = (gather.0 + peer, gather.1 + own);
            let all = (scatter.0 + peer + own, scatter.1 + 3 * own);
            // A trial takes plain and streaming stores in turn: the
            // gather and the all_reduce plain, the reduce_scatter streamed.
            let none = (0, 0);
            let streamed = (scatter.0 - gather.0, scatter.1 - gather.1);
            let plain = (all.0 - streamed.0, all.1 - streamed.1);
            assert_eq!(
                seen,
                &[
                    (none, none),
                    (gather, none),
                    (gather, streamed),
                    (plain, streamed),
                    (plain, streamed)
                ],
                "rank {r}"
            );
        }
    }

    /// A group's operations take the next buffers along its ring, the same
    /// on every rank: one-round operations, whatever their buffering and
    /// element type, each start past the previous one's buffer.
    #[test]
    fn a_groups_operations_walk_its_ring_in_step_on_every_rank() {
        let seen = on_two_ranks("ring", SlotStores::Plain, |_, g| {
            let inner = &g.front.inner;
            let at = || inner.state.lock().ring_at;
            let mut seen = vec![at()];
            for k in 0..6 {
                match k % 3 {
                    0 => drop(g.all_gather(vec![1f32; 100], Vec::new()).wait().unwrap()),
                    1 => drop(g.all_reduce(vec![1f64; 100], ReduceOp::Sum).wait().unwrap()),
                    _ => drop(g.all_gather(vec![1u8; 100], Vec::new()).wait().unwrap()),
                }
                seen.push(at());
            }
            (seen, inner.seg.slot, inner.seg.laps)
        });
        let (positions, slot, laps) = &seen[0];
        assert_eq!(&seen[1].0, positions, "the ranks walk their rings apart");
        assert_eq!(
            *laps,
            ring_laps(*slot, 2, crate::caches::core_cache_bytes())
        );
        assert!(*laps >= 4, "a ring of {laps} slots of {slot} bytes");
        // One f32 gather buffer (half a slot) from the start, then on.
        assert_eq!(positions[..2], [0, slot / 2]);
        assert!(positions.windows(2).all(|w| w[1] > w[0]), "{positions:?}");
    }

    #[test]
    fn a_join_a_rank_never_comes_to_fails_naming_it_and_leaves_no_segment() {
        let srv = crate::store::StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let store = StoreClient::connect(&srv.addr().to_string(), "tok", Duration::from_secs(5));
        let store = Arc::new(store.unwrap());
        let job = format!("unit-{}", std::process::id());
        let path = format!("/dev/shm/zrt-{job}-lonely");
        let join = |name, world_rank| {
            ShmGroup::join(ShmJoin {
                store: store.clone(),
                job: &job,
                name,
                world_ranks: vec![4, 9],
                world_rank,
                slot_bytes: 4096,
                slot_stores: SlotStores::Auto,
                timeout: Duration::from_millis(300),
            })
        };
        // Rank 0 (world rank 4) made the segment, then waited for rank 9.
        let e = join("lonely", 4).err().unwrap().to_string();
        assert!(
            e.starts_with("rendezvous failed: rank 9 did not join shared-memory group `lonely` within 300ms: check that rank's output"),
            "{e}"
        );
        assert!(!std::path::Path::new(&path).exists(), "{path} left behind");
        // Group rank 1 (world rank 9) waited for rank 4 to make one.
        let e = join("empty", 9).err().unwrap().to_string();
        assert!(
            e.starts_with(
                "rendezvous failed: rank 4 did not create shared-memory group `empty` within 300ms"
            ),
            "{e}"
        );
        // Rank 4 made the segment and was killed: rank 9 maps it, waits
        // for rank 4's pid, and removes the name on its way out.
        let slot = slot_bytes_for(4096, 2);
        // A segment as rank 4 would have made it: a file holding `laps`
        // slots per rank, and the layout published (`published` slots).
        let made = |name: &str, laps: usize, published: u64| {
            let path = format!("/dev/shm/zrt-{job}-{name}");
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(Segment::bytes(2, slot, laps) as u64).unwrap();
            let layout = [slot as u64, published].map(u64::to_le_bytes).concat();
            store.set(&format!("shm/{name}/created"), &layout).unwrap();
            path
        };
        let orphan = made("orphan", 1, 1);
        let e = join("orphan", 9).err().unwrap().to_string();
        assert!(
            e.starts_with("rendezvous failed: rank 4 did not join shared-memory group `orphan`"),
            "{e}"
        );
        assert!(
            !std::path::Path::new(&orphan).exists(),
            "{orphan} left behind"
        );
        // A segment that holds less than the layout rank 0 published (a
        // ring of 4 slots in a file made for 1): refused before any rank
        // indexes past its end, and removed.
        let short = made("short", 1, 4);
        let e = join("short", 9).err().unwrap().to_string();
        let (has, needs) = (Segment::bytes(2, slot, 1), Segment::bytes(2, slot, 4));
        assert_eq!(
            e,
            format!(
                "rendezvous failed: {short} holds {has} bytes, the group's layout needs {needs}"
            )
        );
        assert!(
            !std::path::Path::new(&short).exists(),
            "{short} left behind"
        );
        // Had rank 4's process ended, its store connection would have said
        // so: the wait ends at once instead of at the timeout.
        store.set("gone/4", b"").unwrap();
        let join = |name| {
            ShmGroup::join(ShmJoin {
                store: store.clone(),
                job: &job,
                name,
                world_ranks: vec![4, 9],
                world_rank: 9,
                slot_bytes: 4096,
                slot_stores: SlotStores::Auto,
                timeout: Duration::from_secs(60),
            })
        };
        let t = std::time::Instant::now();
        let e = join("ended").err().unwrap().to_string();
        assert!(
            e.starts_with("rendezvous failed: rank 4 left the job before it could create shared-memory group `ended`: its process exited, died or dropped its `Dist`"),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn slot_sizes_from_the_environment_are_checked() {
        let parse = |v| {
            crate::env_bytes::parse("ZRT_SHM_SLOT_BYTES", v, DEFAULT_SLOT_BYTES, MIN_SLOT_BYTES)
        };
        // The default the README's environment table gives.
        assert_eq!(parse(None), Ok(524_288));
        assert_eq!(parse(Some("")), Ok(DEFAULT_SLOT_BYTES));
        assert_eq!(parse(Some(" 4096 ")), Ok(4096));
        for bad in ["512k", "100", "-1", "x", "2000000000"] {
            let e = parse(Some(bad)).unwrap_err();
            assert!(e.contains(&format!("ZRT_SHM_SLOT_BYTES={bad:?}")), "{e}");
            assert!(
                e.contains("from 4096 to 1073741824 (e.g. ZRT_SHM_SLOT_BYTES=524288, the default)"),
                "{e}"
            );
        }
    }
}

//! How a rank of the shm backend writes the shared slots its peers read:
//! plain stores, or streaming (non-temporal) ones, chosen by measuring.
//!
//! A slot (and all_reduce's result area) is written by one rank and read by
//! the others, round after round. When the ranks' cores share a last-level
//! cache, plain stores are best: the peer reads the window from that cache.
//! When they do not (cores on different dies or sockets), plain stores into
//! lines the peer's core read last ran 4-6x slower per byte than reading a
//! peer's slot (evidently each line has to be taken back from the other
//! die first); streaming stores do not wait for that, and the peer reads
//! the window from memory. Measured on this project's 2-vCPU VM, whose host
//! moves the vCPUs between the two placements for minutes at a time
//! (docs/collectives-bench.md, 2026-11-27), medians of 128 MiB operations:
//! across dies all_gather and reduce_scatter took 38 ms with plain stores
//! and 12-14 ms streamed, all_reduce 71 and 26 ms; with a shared cache
//! streaming cost up to a quarter (all_reduce 21 -> 26 ms, a 1 MiB
//! all_gather 0.04 -> 0.08 ms), so neither choice is right everywhere.
//!
//! So each rank times its own operations. Operations of several rounds
//! that staged with plain stores each time how long this rank took to
//! write into shared memory and to read from it; once [`DECIDE_BYTES`] of
//! each are in over [`DECIDE_OPS`] operations, the median operation
//! writing [`SLOW_WRITES`] times slower per byte than it read switches the
//! group to streaming stores. After [`PROBE_EVERY`] such
//! operations it stages with plain stores again until it has measured as
//! much, to see whether the cores have moved back. Each rank decides for
//! the stores it makes; the bytes moved are the same either way, so ranks
//! that decide differently only run at different speeds.

use std::time::{Duration, Instant};

/// Which stores a rank's slot writes use (`ZRT_SHM_SLOT_STORES`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SlotStores {
    /// Measure and choose (the default).
    #[default]
    Auto,
    /// Always plain stores (cores that share a cache).
    Plain,
    /// Streaming stores for every operation of two or more rounds (cores
    /// on different dies or sockets); a one-round operation stays in cache.
    Streaming,
}

impl SlotStores {
    /// `ZRT_SHM_SLOT_STORES` ([`SlotStores::Auto`] when unset or empty), or
    /// what is wrong with it.
    pub(crate) fn from_env() -> Result<Self, String> {
        Self::parse(std::env::var("ZRT_SHM_SLOT_STORES").ok().as_deref())
    }

    fn parse(v: Option<&str>) -> Result<Self, String> {
        match v.map(str::trim).unwrap_or("") {
            "" | "auto" => Ok(Self::Auto),
            "plain" => Ok(Self::Plain),
            "streaming" => Ok(Self::Streaming),
            other => Err(format!(
                "ZRT_SHM_SLOT_STORES={other:?} is not one of auto (the default: measure and \
                 choose), plain or streaming"
            )),
        }
    }
}

/// Writing a slot this many times slower per byte than reading a peer's
/// (the median over the operations of a decision) switches to streaming
/// stores. Measured on 2 ranks, per benchmark run and operation: 1.1-1.9
/// with a shared cache, 3.6-6.4 across dies; but single 1 MiB all_gathers
/// with a shared cache ran at 1.0-2.8, some up to 5 (2026-11-27). With 2.5
/// and every byte of a decision added up, 4 of 6 benchmark runs with a
/// shared cache switched to streaming for a while, which costs there
/// (forced: 1 MiB rows 0.06-0.07 -> 0.07-0.08 ms, all_reduce at 128 MiB up
/// to a quarter).
const SLOW_WRITES: f64 = 3.0;

/// While streaming, after this many eligible operations the group stages
/// with plain stores until it has measured enough to decide, to notice cores
/// that moved back next to each other.
const PROBE_EVERY: u32 = 32;

/// Bytes written and read with plain stores that one decision rests on: a
/// single operation's rounds at 1 MiB take microseconds, and one of them
/// late or interrupted would decide alone.
const DECIDE_BYTES: usize = 2 << 20;

/// Operations one decision rests on, unless they moved [`DECIDE_BYTES_FEW`].
/// Why: the first 1 MiB operations after a pause or after a 128 MiB one
/// wrote 4-5x slower than they read with the cores sharing a cache, the
/// next ones 1-1.6x (2026-11-27); two of them made a decision, and the
/// group streamed until its next probe. Eight with their median still
/// switched in 2 of 5 such runs (against 4 of 5 before): phases of eight
/// and more slow writes happen with a shared cache too.
const DECIDE_OPS: usize = 8;

/// Bytes written and read that decide with fewer than [`DECIDE_OPS`]
/// operations: a 128 MiB operation's rounds take milliseconds, and waiting
/// for eight of them across dies would cost a second.
const DECIDE_BYTES_FEW: usize = 16 * DECIDE_BYTES;

/// Ratios one decision keeps: operations that read a few bytes each (an
/// all_gather_v whose peers' parts are tiny) could take a long time to add
/// up [`DECIDE_BYTES`], and the list must not grow meanwhile.
const MAX_RATIOS: usize = 256;

/// Time and bytes of an operation's writes into shared memory and reads
/// out of it (or of several operations', added up).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Measured {
    /// Writing this rank's slots (staging, and all_reduce's results).
    pub(crate) write: Duration,
    /// Bytes written into them.
    pub(crate) written: usize,
    /// Reading the peers' slots (copying or reducing them).
    pub(crate) read: Duration,
    /// Bytes read from them.
    pub(crate) read_bytes: usize,
}

impl Measured {
    /// Adds a write of `bytes` that began at `t`.
    pub(crate) fn wrote(&mut self, t: Instant, bytes: usize) {
        self.wrote_for(t.elapsed(), bytes);
    }

    /// Adds a write of `bytes` that took `d`.
    pub(crate) fn wrote_for(&mut self, d: Duration, bytes: usize) {
        self.write += d;
        self.written += bytes;
    }

    /// Adds a read of `bytes` that began at `t`.
    pub(crate) fn read(&mut self, t: Instant, bytes: usize) {
        self.read_less(t, Duration::ZERO, bytes);
    }

    /// Adds a read of `bytes` that began at `t`, less `writing` spent
    /// meanwhile on writes counted by [`Measured::wrote_for`].
    pub(crate) fn read_less(&mut self, t: Instant, writing: Duration, bytes: usize) {
        self.read += t.elapsed().saturating_sub(writing);
        self.read_bytes += bytes;
    }

    /// Nanoseconds per byte written over those per byte read, if both
    /// happened.
    fn write_over_read(&self) -> Option<f64> {
        let per = |d: Duration, b: usize| (b > 0).then(|| d.as_nanos() as f64 / b as f64);
        let (w, r) = (
            per(self.write, self.written)?,
            per(self.read, self.read_bytes)?,
        );
        (r > 0.0).then_some(w / r)
    }
}

/// A group's choice between plain and streaming slot stores.
#[derive(Debug, Default)]
pub(crate) struct Chooser {
    policy: SlotStores,
    /// Streaming now (under [`SlotStores::Auto`]).
    streaming: bool,
    /// Streaming, but staging with plain stores to measure again.
    probing: bool,
    /// Eligible operations since streaming began or was last probed.
    since_probe: u32,
    /// Bytes written and read by the plain-store operations not yet
    /// decided on (their times are in `ratios`).
    pending: (usize, usize),
    /// Their operations' write-over-read ratios, the first
    /// [`MAX_RATIOS`] of them.
    ratios: Vec<f64>,
}

/// What [`Chooser::observe`] changed.
#[derive(Debug, PartialEq)]
pub(crate) enum Switch {
    /// To streaming stores: writes took this many times longer per byte.
    ToStreaming(f64),
    /// Back to plain stores: writes took this many times longer per byte.
    ToPlain(f64),
}

impl Chooser {
    /// A chooser following `policy`.
    pub(crate) fn new(policy: SlotStores) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }

    /// Bytes written and read that the next decision will rest on.
    #[cfg(test)]
    pub(crate) fn pending_bytes(&self) -> (usize, usize) {
        self.pending
    }

    /// Whether an operation of `rounds` rounds writes its slots with
    /// streaming stores. One round is not worth it: a small operation's
    /// data stays in cache, and its time is the barrier's.
    pub(crate) fn streaming(&mut self, rounds: usize) -> bool {
        match self.policy {
            SlotStores::Plain => false,
            SlotStores::Streaming => rounds > 1,
            SlotStores::Auto if rounds < 2 || !self.streaming || self.probing => false,
            SlotStores::Auto => {
                self.since_probe += 1;
                if self.since_probe >= PROBE_EVERY {
                    // A probe: plain stores until measured enough.
                    self.since_probe = 0;
                    self.probing = true;
                    return false;
                }
                true
            }
        }
    }

    /// Learns from an operation of `rounds` rounds that ran with
    /// `streamed` stores: only plain ones of several rounds tell how the
    /// cores share lines now, once they add up to [`DECIDE_BYTES`] over
    /// [`DECIDE_OPS`] operations (or [`DECIDE_BYTES_FEW`] over fewer).
    pub(crate) fn observe(
        &mut self,
        rounds: usize,
        streamed: bool,
        m: &Measured,
    ) -> Option<Switch> {
        if self.policy != SlotStores::Auto || streamed || rounds < 2 {
            return None;
        }
        self.pending.0 += m.written;
        self.pending.1 += m.read_bytes;
        if self.ratios.len() < MAX_RATIOS {
            self.ratios.extend(m.write_over_read());
        }
        let moved = self.pending.0.min(self.pending.1);
        if moved < DECIDE_BYTES || (self.ratios.len() < DECIDE_OPS && moved < DECIDE_BYTES_FEW) {
            return None;
        }
        self.probing = false;
        self.pending = (0, 0);
        // The median operation: one interrupted or unlucky operation does
        // not decide for the rest.
        let mut ratios = std::mem::take(&mut self.ratios);
        ratios.sort_by(f64::total_cmp);
        let ratio = *ratios.get(ratios.len().saturating_sub(1) / 2)?;
        let slow = ratio > SLOW_WRITES;
        if slow == self.streaming {
            return None;
        }
        self.streaming = slow;
        self.since_probe = 0;
        Some(match slow {
            true => Switch::ToStreaming(ratio),
            false => Switch::ToPlain(ratio),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `w` ns per byte written and `r` per byte read, over `bytes` each.
    fn m_over(w: u64, r: u64, bytes: usize) -> Measured {
        Measured {
            write: Duration::from_nanos(w * bytes as u64),
            written: bytes,
            read: Duration::from_nanos(r * bytes as u64),
            read_bytes: bytes,
        }
    }

    /// As [`m_over`], over enough bytes for one operation to decide.
    fn m(w: u64, r: u64) -> Measured {
        m_over(w, r, DECIDE_BYTES_FEW)
    }

    #[test]
    fn the_environment_names_the_policy_or_what_is_wrong() {
        assert_eq!(SlotStores::parse(None), Ok(SlotStores::Auto));
        assert_eq!(SlotStores::parse(Some(" ")), Ok(SlotStores::Auto));
        assert_eq!(SlotStores::parse(Some("auto")), Ok(SlotStores::Auto));
        assert_eq!(SlotStores::parse(Some("plain")), Ok(SlotStores::Plain));
        assert_eq!(
            SlotStores::parse(Some(" streaming ")),
            Ok(SlotStores::Streaming)
        );
        let e = SlotStores::parse(Some("nt")).unwrap_err();
        assert!(
            e.starts_with("ZRT_SHM_SLOT_STORES=\"nt\" is not one of auto")
                && e.contains("plain or streaming"),
            "{e}"
        );
    }

    #[test]
    fn slow_writes_switch_to_streaming_and_a_probe_switches_back() {
        let mut c = Chooser::new(SlotStores::Auto);
        // Writing about as fast as reading: plain stays. Exactly 3x is
        // not slower than the threshold.
        assert!(!c.streaming(8));
        assert_eq!(c.observe(8, false, &m(2, 1)), None);
        assert_eq!(c.observe(2, false, &m(3, 1)), None);
        assert!(!c.streaming(8));
        // One round: neither streamed nor learnt from, however slow.
        assert_eq!(c.observe(1, false, &m(9, 1)), None);
        assert!(!c.streaming(8));
        // Writes 4x slower per byte (8 ns/B against 2, with unequal bytes
        // written and read), in two operations: the decision waits until
        // enough was read too, then streaming from the next one.
        let wrote = Measured {
            write: Duration::from_nanos(8 * DECIDE_BYTES_FEW as u64),
            written: DECIDE_BYTES_FEW,
            read: Duration::from_nanos(DECIDE_BYTES_FEW as u64),
            read_bytes: DECIDE_BYTES_FEW / 2,
        };
        assert_eq!(c.observe(8, false, &wrote), None);
        assert!(!c.streaming(8));
        let read = Measured {
            write: Duration::from_nanos(4 * DECIDE_BYTES_FEW as u64),
            written: DECIDE_BYTES_FEW / 2,
            read: Duration::from_nanos(3 * DECIDE_BYTES_FEW as u64),
            read_bytes: 3 * DECIDE_BYTES_FEW / 2,
        };
        assert_eq!(c.observe(2, false, &read), Some(Switch::ToStreaming(4.0)));
        // A streamed operation teaches nothing (its writes are another
        // kind); two rounds are enough to stream.
        for _ in 0..PROBE_EVERY - 1 {
            assert!(c.streaming(2));
            assert_eq!(c.observe(8, true, &m(1, 9)), None);
        }
        // One-round operations neither stream nor count towards the probe.
        assert!(!c.streaming(1));
        // Then a probe: plain stores until measured enough, still slow, so
        // streaming goes on.
        let half = m_over(5, 1, DECIDE_BYTES_FEW / 2);
        assert!(!c.streaming(8));
        assert_eq!(c.observe(8, false, &half), None);
        assert!(
            !c.streaming(8),
            "a probe lasts until it has measured enough"
        );
        assert_eq!(c.observe(8, false, &half), None);
        for _ in 0..PROBE_EVERY - 1 {
            assert!(c.streaming(8));
        }
        // The next probe finds the cores sharing lines again: back to plain.
        assert!(!c.streaming(8));
        assert_eq!(c.observe(8, false, &m(1, 1)), Some(Switch::ToPlain(1.0)));
        assert!(!c.streaming(8));
        // Nothing read: nothing learnt, and nothing kept to add up.
        let unread = Measured {
            read: Duration::ZERO,
            ..m(9, 1)
        };
        assert_eq!(c.observe(8, false, &unread), None);
        assert_eq!(
            c.observe(8, false, &m(4, 1)),
            Some(Switch::ToStreaming(4.0))
        );
        assert_eq!(Measured::default().write_over_read(), None);
    }

    /// A decision is the median operation's, over at least
    /// [`DECIDE_OPS`] of them when they are small: a few slow operations
    /// among fast ones (the first after a pause, a rank interrupted) do
    /// not switch, however slow; most operations slow do, however fast
    /// one is.
    #[test]
    fn the_median_of_enough_operations_decides() {
        let mut c = Chooser::new(SlotStores::Auto);
        let small = |w| m_over(w, 1, DECIDE_BYTES / 4);
        // Enough bytes after four, but not enough operations.
        for w in [40, 50, 2, 2, 2, 1, 2] {
            assert_eq!(c.observe(8, false, &small(w)), None);
        }
        // Added up, writes took 12.6x as long; the median operation 2x.
        assert_eq!(c.observe(8, false, &small(2)), None);
        assert!(!c.streaming(8));
        for w in [4, 1, 5, 4, 9, 2, 4] {
            assert_eq!(c.observe(8, false, &small(w)), None);
        }
        // Of 1, 2, 4, 4, 4, 5, 6 and 9 the lower median: 4.
        assert_eq!(
            c.observe(8, false, &small(6)),
            Some(Switch::ToStreaming(4.0))
        );
        assert!(c.streaming(8));
    }

    /// Eight operations decide only with [`DECIDE_BYTES`] among them:
    /// tiny ones never do, however slow; eight that move exactly that
    /// much do, at the eighth.
    #[test]
    fn eight_operations_decide_once_they_moved_enough() {
        let mut c = Chooser::new(SlotStores::Auto);
        for _ in 0..3 * DECIDE_OPS {
            assert_eq!(c.observe(8, false, &m_over(9, 1, 1024)), None);
        }
        let mut c = Chooser::new(SlotStores::Auto);
        let eighth = m_over(9, 1, DECIDE_BYTES / DECIDE_OPS);
        for _ in 1..DECIDE_OPS {
            assert_eq!(c.observe(8, false, &eighth), None);
        }
        assert_eq!(c.observe(8, false, &eighth), Some(Switch::ToStreaming(9.0)));
    }

    /// Operations that read little keep at most [`MAX_RATIOS`] ratios
    /// until they have read enough, then decide on those.
    #[test]
    fn operations_that_read_little_keep_a_bounded_list() {
        let mut c = Chooser::new(SlotStores::Auto);
        let little = Measured {
            write: Duration::from_nanos(9 * 4096),
            written: 4096,
            read: Duration::from_nanos(64),
            read_bytes: 64,
        };
        for _ in 0..DECIDE_BYTES / 64 - 1 {
            assert_eq!(c.observe(8, false, &little), None);
        }
        assert_eq!(c.ratios.len(), MAX_RATIOS);
        assert_eq!(c.observe(8, false, &little), Some(Switch::ToStreaming(9.0)));
        assert!(c.ratios.is_empty());
    }

    #[test]
    fn a_fixed_policy_never_changes() {
        let mut plain = Chooser::new(SlotStores::Plain);
        assert_eq!(plain.observe(8, false, &m(9, 1)), None);
        assert!(!plain.streaming(8));
        let mut streaming = Chooser::new(SlotStores::Streaming);
        assert!(!streaming.streaming(1), "one round is never streamed");
        for _ in 0..2 * PROBE_EVERY {
            assert!(streaming.streaming(8));
            assert_eq!(streaming.observe(8, false, &m(1, 1)), None);
        }
    }

    #[test]
    fn reads_leave_out_the_writes_made_meanwhile() {
        let mut took = Measured::default();
        let t = Instant::now() - Duration::from_millis(10);
        took.wrote_for(Duration::from_millis(4), 100);
        took.read_less(t, Duration::from_millis(4), 300);
        assert!(
            took.read >= Duration::from_millis(6) && took.read < Duration::from_millis(10),
            "{took:?}"
        );
        assert_eq!((took.written, took.read_bytes), (100, 300));
        // More writing than the interval (clock granularity): zero, not
        // a wrap-around.
        took.read_less(Instant::now(), Duration::from_secs(1), 1);
        assert!(took.read < Duration::from_millis(10), "{took:?}");
    }
}

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
//! A third placement showed on 2026-11-28 (round trip 440-490 ns, against
//! 70-90 with a shared cache): there a rank's writes ran no slower than
//! its reads (0.5-1.2x per byte), so the first rule here, which switched
//! when writes ran 3x slower, never did, while streaming made the 1 MiB
//! staged rows 0.10-0.11 ms against plain stores' 0.18-0.20 (and where
//! the cores shared a cache, 0.10-0.13 against 0.07-0.08).
//!
//! So each rank tries both. Operations of several rounds are what it
//! learns from: at a trial it runs them with plain and streaming stores in
//! turn (both kinds then see the same mix of sizes and operations), each
//! timing its writes into shared memory and its reads out of it, until
//! each kind has [`DECIDE_BYTES`] written and read over [`DECIDE_OPS`]
//! operations (or [`DECIDE_BYTES_FEW`] over fewer), and keeps the stores
//! whose median operation took less per byte;
//! the other must be [`MARGIN`] times faster to replace the current
//! choice. The first eligible operation starts a trial; the next comes
//! [`FIRST_PERIOD`] eligible operations after a trial that switched, and
//! twice as long after one that did not, up to [`LONGEST_PERIOD`], so
//! trying the losing stores costs a few percent at first and about 1%
//! once the choice has held. Both arms run the same operations on every
//! rank (collectives are issued in one order), so the ranks try each kind
//! together; each rank decides for the stores it makes, and the bytes
//! moved are the same either way, so ranks that decide differently only
//! run at different speeds.

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

/// How much faster per byte the other stores' median operation must run
/// in a trial to replace the current choice. Where the choice matters it
/// is by 2-5x (1 MiB rows on 2026-11-27 across dies: 0.25 ms plain
/// against 0.05 streamed; on 2026-11-28 0.19 against 0.10); with 1.1 the
/// benchmark's runs with a shared cache, where plain stores are right,
/// switched now and then (a trial during a placement change), costing a
/// row a fifth.
const MARGIN: f64 = 1.25;

/// Eligible operations (of two or more rounds) from a trial that switched
/// to the next trial.
const FIRST_PERIOD: u32 = 32;

/// The longest period between trials: a choice that held doubles the
/// period up to this. With [`DECIDE_OPS`] operations an arm, the losing
/// stores then run about 1 operation in 130; a placement that changes
/// is noticed within this many operations (at 1 MiB, a tenth of a
/// second; at 128 MiB, about 15 s).
const LONGEST_PERIOD: u32 = 1024;

/// Bytes written and read that one arm of a trial rests on: a single
/// operation's rounds at 1 MiB take microseconds, and one of them late or
/// interrupted would decide alone.
const DECIDE_BYTES: usize = 2 << 20;

/// Operations one arm rests on, unless they moved [`DECIDE_BYTES_FEW`].
/// Why: the first 1 MiB operations after a pause or after a 128 MiB one
/// ran 4-5x slower than the next ones (2026-11-27), and phases of eight
/// and more slow operations happen too: the median of eight is what an
/// arm's operations took.
const DECIDE_OPS: usize = 8;

/// Bytes written and read that end an arm with fewer than [`DECIDE_OPS`]
/// operations: a 128 MiB operation's rounds take milliseconds, and eight
/// of them in the slower stores would cost a second.
const DECIDE_BYTES_FEW: usize = 16 * DECIDE_BYTES;

/// Times one arm keeps: operations that move a few bytes each (an
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

    /// Nanoseconds per byte written or read, if any was.
    fn per_byte(&self) -> Option<f64> {
        let bytes = self.written + self.read_bytes;
        (bytes > 0).then(|| (self.write + self.read).as_nanos() as f64 / bytes as f64)
    }
}

/// A group's choice between plain and streaming slot stores.
#[derive(Debug)]
pub(crate) struct Chooser {
    policy: SlotStores,
    /// Streaming now (under [`SlotStores::Auto`]), outside trials.
    streaming: bool,
    /// The trial under way, if one is.
    trial: Option<Trial>,
    /// Eligible operations until the next trial.
    until_trial: u32,
    /// The last gap between trials: doubled after a trial that kept the
    /// choice, back to [`FIRST_PERIOD`] after one that switched.
    period: u32,
}

/// Plain and streaming stores measured in turn, operation by operation,
/// so that both arms see the same mix of operations (a group's sizes and
/// kinds come in runs: all_gathers of one unit, then reduce_scatters; a
/// benchmark's rows one after another).
#[derive(Debug, Default)]
struct Trial {
    /// The next operation's stores: streaming ones.
    next_streams: bool,
    /// The plain arm.
    plain: Arm,
    /// The streaming arm.
    streamed: Arm,
}

/// One kind of stores' operations in a trial.
#[derive(Debug, Default)]
struct Arm {
    /// Bytes written and read.
    moved: (usize, usize),
    /// Each operation's nanoseconds per byte, the first [`MAX_RATIOS`].
    per_byte: Vec<f64>,
}

impl Arm {
    /// Whether the arm has measured enough to be compared.
    fn done(&self) -> bool {
        let moved = self.moved.0.min(self.moved.1);
        let ops = self.per_byte.len();
        ops > 0 && ((moved >= DECIDE_BYTES && ops >= DECIDE_OPS) || moved >= DECIDE_BYTES_FEW)
    }

    /// The median operation's nanoseconds per byte (the lower one of an
    /// even count): a few interrupted or unlucky operations do not decide
    /// for the rest.
    fn median(&mut self) -> f64 {
        self.per_byte.sort_by(f64::total_cmp);
        let n = self.per_byte.len();
        self.per_byte
            .get(n.saturating_sub(1) / 2)
            .copied()
            .unwrap_or(f64::NAN)
    }
}

/// What [`Chooser::observe`] changed.
#[derive(Debug, PartialEq)]
pub(crate) enum Switch {
    /// To streaming stores: plain ones took this many times as long per
    /// byte in the trial.
    ToStreaming(f64),
    /// Back to plain stores: streaming ones took this many times as long
    /// per byte in the trial.
    ToPlain(f64),
}

impl Chooser {
    /// A chooser following `policy`.
    pub(crate) fn new(policy: SlotStores) -> Self {
        Self {
            policy,
            streaming: false,
            trial: None,
            until_trial: 0,
            period: FIRST_PERIOD,
        }
    }

    /// Bytes written and read by each arm of the trial under way:
    /// (plain, streaming).
    #[cfg(test)]
    pub(crate) fn pending_bytes(&self) -> ((usize, usize), (usize, usize)) {
        self.trial
            .as_ref()
            .map_or(((0, 0), (0, 0)), |t| (t.plain.moved, t.streamed.moved))
    }

    /// Whether an operation of `rounds` rounds writes its slots with
    /// streaming stores. One round is not worth it: a small operation's
    /// data stays in cache, and its time is the barrier's.
    pub(crate) fn streaming(&mut self, rounds: usize) -> bool {
        match self.policy {
            SlotStores::Plain => false,
            SlotStores::Streaming => rounds > 1,
            SlotStores::Auto if rounds < 2 => false,
            SlotStores::Auto => {
                if self.trial.is_none() {
                    if self.until_trial > 0 {
                        self.until_trial -= 1;
                        return self.streaming;
                    }
                    self.trial = Some(Trial::default());
                }
                self.trial.as_ref().is_some_and(|t| t.next_streams)
            }
        }
    }

    /// Learns from an operation of `rounds` rounds that ran with
    /// `streamed` stores: only operations of several rounds in a trial
    /// count, in the arm of their stores.
    pub(crate) fn observe(
        &mut self,
        rounds: usize,
        streamed: bool,
        m: &Measured,
    ) -> Option<Switch> {
        if self.policy != SlotStores::Auto || rounds < 2 {
            return None;
        }
        let trial = self.trial.as_mut()?;
        let arm = match streamed {
            true => &mut trial.streamed,
            false => &mut trial.plain,
        };
        arm.moved.0 += m.written;
        arm.moved.1 += m.read_bytes;
        if arm.per_byte.len() < MAX_RATIOS {
            arm.per_byte.extend(m.per_byte());
        }
        // The other arm next, unless it has measured enough.
        let (done_plain, done_streamed) = (trial.plain.done(), trial.streamed.done());
        trial.next_streams = match (done_plain, done_streamed) {
            (false, false) => !streamed,
            (true, false) => true,
            (false, true) => false,
            (true, true) => false,
        };
        if !(done_plain && done_streamed) {
            return None;
        }
        let (plain, streamed) = (trial.plain.median(), trial.streamed.median());
        self.trial = None;
        let switch = match self.streaming {
            false if streamed * MARGIN < plain => Some(Switch::ToStreaming(plain / streamed)),
            true if plain * MARGIN < streamed => Some(Switch::ToPlain(streamed / plain)),
            _ => None,
        };
        self.period = match switch {
            Some(_) => FIRST_PERIOD,
            None => (self.period * 2).min(LONGEST_PERIOD),
        };
        self.until_trial = self.period;
        if switch.is_some() {
            self.streaming = !self.streaming;
        }
        switch
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

    /// As [`m_over`], over enough bytes for one operation to end an arm.
    fn m(w: u64, r: u64) -> Measured {
        m_over(w, r, DECIDE_BYTES_FEW)
    }

    /// Runs one eligible operation taking `took` with whatever stores the
    /// chooser picks: `took(streamed)`.
    fn op(c: &mut Chooser, took: impl Fn(bool) -> Measured) -> (bool, Option<Switch>) {
        let streamed = c.streaming(8);
        (streamed, c.observe(8, streamed, &took(streamed)))
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

    /// A trial runs plain stores, then streaming ones, and keeps the
    /// faster by [`MARGIN`]; between trials the choice holds, and the gap
    /// doubles while the choice holds.
    #[test]
    fn a_trial_of_both_keeps_the_faster_stores() {
        let mut c = Chooser::new(SlotStores::Auto);
        // Streaming 2 ns/B against plain's 4 (writes and reads alike: the
        // placement of 2026-11-28, where plain writes ran no slower than
        // reads). The first eligible operation starts a trial.
        let slow_plain = |s: bool| if s { m(2, 2) } else { m(4, 4) };
        assert_eq!(op(&mut c, slow_plain), (false, None));
        assert_eq!(
            op(&mut c, slow_plain),
            (true, Some(Switch::ToStreaming(2.0)))
        );
        for _ in 0..FIRST_PERIOD {
            assert_eq!(op(&mut c, slow_plain), (true, None));
        }
        // The next trial: plain, then streaming, which still wins by less
        // than the margin would ask of plain: streaming stays, and the
        // gap doubles.
        let close = |s: bool| if s { m(10, 10) } else { m(11, 10) };
        assert_eq!(op(&mut c, close), (false, None));
        assert_eq!(op(&mut c, close), (true, None));
        for _ in 0..2 * FIRST_PERIOD {
            assert_eq!(op(&mut c, close), (true, None));
        }
        // The cores share a cache again: plain wins the next trial.
        let slow_streaming = |s: bool| if s { m(3, 9) } else { m(2, 2) };
        assert_eq!(op(&mut c, slow_streaming), (false, None));
        assert_eq!(
            op(&mut c, slow_streaming),
            (true, Some(Switch::ToPlain(3.0)))
        );
        for _ in 0..FIRST_PERIOD {
            assert_eq!(op(&mut c, slow_streaming), (false, None));
        }
        // Streaming a fifth faster (6 ns/B against 5) is within the
        // margin: plain stays.
        let a_fifth = |s: bool| if s { m(5, 5) } else { m(6, 6) };
        assert_eq!(op(&mut c, a_fifth), (false, None));
        assert_eq!(op(&mut c, a_fifth), (true, None));
        assert!(!c.streaming(8));
        // One-round operations neither stream nor count, in a trial or not.
        assert!(!c.streaming(1));
        assert_eq!(c.observe(1, false, &m(9, 9)), None);
        // Nothing moved: nothing learnt.
        assert_eq!(Measured::default().per_byte(), None);
    }

    /// A held choice doubles the gap between trials up to
    /// [`LONGEST_PERIOD`] eligible operations.
    #[test]
    fn trials_thin_out_while_the_choice_holds() {
        let mut c = Chooser::new(SlotStores::Auto);
        let mut trials = Vec::new();
        let mut gap = 0;
        for _ in 0..6000 {
            let streamed = c.streaming(8);
            if c.trial.is_some() {
                if gap > 0 {
                    trials.push(gap);
                }
                gap = 0;
            } else {
                gap += 1;
                assert!(!streamed);
            }
            assert_eq!(c.observe(8, streamed, &m(1, 1)), None);
        }
        assert_eq!(trials, [64, 128, 256, 512, 1024, 1024, 1024, 1024]);
    }

    /// An arm is the median operation's, over at least [`DECIDE_OPS`]
    /// of them when they are small: a few slow operations among fast ones
    /// (the first after a pause, a rank interrupted) do not decide.
    #[test]
    fn the_median_of_enough_operations_decides() {
        let mut c = Chooser::new(SlotStores::Auto);
        let small = |w| m_over(w, w, DECIDE_BYTES / 4);
        // In turn, plain then streaming: enough bytes after four of each,
        // but not enough operations. Two very slow plain ones among eight
        // do not make plain slow: its median is 2, streaming's 3.
        let plain = [40, 50, 2, 2, 2, 2, 2, 2];
        let streamed = [1, 1, 1, 3, 3, 3, 3, 3];
        for (p, s) in plain.into_iter().zip(streamed) {
            assert_eq!(op(&mut c, |_| small(p)), (false, None));
            assert_eq!(op(&mut c, |_| small(s)), (true, None));
        }
        assert!(c.trial.is_none(), "the trial ended");
        assert!(!c.streaming(8), "plain stays");
    }

    /// Eight operations end an arm only with [`DECIDE_BYTES`] among them:
    /// tiny ones never do; eight that move exactly that much do, at the
    /// eighth; an arm that has ended leaves the rest of the trial to the
    /// other.
    #[test]
    fn eight_operations_end_an_arm_once_they_moved_enough() {
        let mut c = Chooser::new(SlotStores::Auto);
        for i in 0..3 * DECIDE_OPS {
            assert_eq!(op(&mut c, |_| m_over(9, 1, 1024)), (i % 2 == 1, None));
        }
        let mut c = Chooser::new(SlotStores::Auto);
        let eighth = m_over(1, 1, DECIDE_BYTES / DECIDE_OPS);
        for _ in 0..DECIDE_OPS - 1 {
            assert_eq!(op(&mut c, |_| eighth), (false, None));
            assert_eq!(op(&mut c, |_| eighth), (true, None));
        }
        // The plain arm's eighth ends it; a large streamed operation ends
        // the other.
        assert_eq!(op(&mut c, |_| eighth), (false, None));
        assert_eq!(c.pending_bytes().0, (DECIDE_BYTES, DECIDE_BYTES));
        assert_eq!(op(&mut c, |_| m(1, 1)), (true, None));
        assert!(c.trial.is_none(), "the trial ended");
        // Which a plain arm that ended first leaves to streaming alone.
        let mut c = Chooser::new(SlotStores::Auto);
        assert_eq!(op(&mut c, |_| m(1, 1)), (false, None));
        for _ in 0..DECIDE_OPS - 1 {
            assert_eq!(op(&mut c, |_| eighth), (true, None));
        }
        assert_eq!(op(&mut c, |_| eighth), (true, None));
        assert!(c.trial.is_none(), "the trial ended");
    }

    /// Operations that read little keep at most [`MAX_RATIOS`] times
    /// until they have read enough, then end their arm on those.
    #[test]
    fn operations_that_read_little_keep_a_bounded_list() {
        let mut c = Chooser::new(SlotStores::Auto);
        let little = Measured {
            write: Duration::from_nanos(9 * 4096),
            written: 4096,
            read: Duration::from_nanos(64),
            read_bytes: 64,
        };
        for _ in 0..2 * (DECIDE_BYTES / 64 - 1) {
            op(&mut c, |_| little);
        }
        let kept = c
            .trial
            .as_ref()
            .map(|t| (t.plain.per_byte.len(), t.streamed.per_byte.len()));
        assert_eq!(kept, Some((MAX_RATIOS, MAX_RATIOS)));
        op(&mut c, |_| little);
        op(&mut c, |_| little);
        assert!(c.trial.is_none(), "the trial ended");
    }

    #[test]
    fn a_fixed_policy_never_changes() {
        let mut plain = Chooser::new(SlotStores::Plain);
        for _ in 0..4 * FIRST_PERIOD {
            assert_eq!(
                op(&mut plain, |s| m(if s { 1 } else { 9 }, 1)),
                (false, None)
            );
        }
        let mut streaming = Chooser::new(SlotStores::Streaming);
        assert!(!streaming.streaming(1), "one round is never streamed");
        for _ in 0..4 * FIRST_PERIOD {
            assert_eq!(
                op(&mut streaming, |s| m(if s { 9 } else { 1 }, 1)),
                (true, None)
            );
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

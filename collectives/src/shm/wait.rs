//! Waiting for peers: spinning, then a futex on the late rank's arrive
//! word; a rank that left or whose process is gone fails the wait.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::front::Transport;
use crate::{CommError, OpDesc};

use super::segment::{W_ARRIVE, W_DESC, W_SLEEPERS};
use super::{Inner, State};

/// Spins before a waiting rank goes to sleep on a futex: long enough to catch
/// a peer that is a few microseconds behind, short enough that a peer still
/// computing gets the core (2 ranks on 2 cores share them with compute).
pub(super) const SPINS: u32 = 2000;
/// How often a waiting rank checks on the ranks it waits for.
pub(super) const LIVENESS_EVERY: Duration = Duration::from_millis(50);

/// Whether process `pid` is gone (or a zombie: it died and is not yet reaped).
pub(super) fn process_gone(pid: u32) -> bool {
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
pub(super) mod futex {
    use std::sync::atomic::AtomicU64;
    use std::time::Duration;

    /// The word's low half (little-endian: its first four bytes).
    pub(in crate::shm) fn low(word: &AtomicU64) -> *const u32 {
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
    pub(in crate::shm) fn wait(word: &AtomicU64, seen: u64, at_most: Duration) {
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
    pub(in crate::shm) fn wait(_word: &AtomicU64, _seen: u64, at_most: Duration) {
        std::thread::sleep(at_most.min(Duration::from_micros(50)));
    }

    /// Wakes every rank asleep on the word.
    #[cfg(not(target_os = "linux"))]
    pub(in crate::shm) fn wake_all(_word: &AtomicU64) {}

    /// Wakes every rank asleep on the word.
    #[cfg(target_os = "linux")]
    pub(in crate::shm) fn wake_all(word: &AtomicU64) {
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
    pub(super) fn wait_all(
        &self,
        call: &OpDesc,
        deadline: Instant,
        epoch: u64,
    ) -> Result<(), CommError> {
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
    pub(super) fn sleep_on(&self, r: usize, epoch: u64, at_most: Duration) {
        let (word, sleepers) = (self.seg.word(r, W_ARRIVE), self.seg.word(r, W_SLEEPERS));
        sleepers.fetch_add(1, Ordering::SeqCst);
        let seen = word.load(Ordering::SeqCst);
        if seen < epoch {
            futex::wait(word, seen, at_most);
        }
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    pub(super) fn pass_barrier(
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
    pub(super) fn arrive(&self, st: &mut State) -> u64 {
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
    pub(super) fn agree(
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
}

//! Ending a training loop cleanly when the job is asked to stop: a
//! scheduler's SIGTERM (preemption) or Ctrl-C, which `zrt launch` forwards
//! to every rank.
//!
//! By default either signal kills a rank mid-step and the job loses what
//! it trained since its last checkpoint. With [`on_signals`] a rank only
//! notes the signal; the loop asks [`any_rank`] once a step (every rank
//! must get the same answer, or one would save while another waits in the
//! next step's collectives), saves, and returns. The launcher's `--grace`
//! (5 s by default) bounds how long it may take before SIGKILL.
//!
//! The launcher also sends SIGTERM to the other ranks when one fails. A
//! rank that only notes it runs on to its next collective, which then
//! fails naming the dead peer (within seconds): its end comes a little
//! later than at once, and a step longer than `--grace` is cut short by
//! SIGKILL as before.
//!
//! ```no_run
//! # fn run(
//! #     engine: &zrt::zero::Engine<zrt::collectives::Group>,
//! #     world: &zrt::collectives::Group,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! zrt::stop::on_signals();
//! for step in 1..=1000 {
//!     // ... backward, step ...
//!     if zrt::stop::any_rank(world, zrt::stop::requested().is_some())? {
//!         engine.save_checkpoint("checkpoints", &format!("step{step}"))?;
//!         return Ok(());
//!     }
//! }
//! # Ok(())
//! # }
//! ```

use std::sync::atomic::{AtomicI32, Ordering};

use crate::collectives::{CommError, ProcessGroup, ReduceOp};

/// The signal that asked this process to stop (0: none yet).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Has SIGTERM and SIGINT only note that the job is asked to stop (see
/// [`requested`]) instead of ending the process. Call it once, early in
/// `main`.
pub fn on_signals() {
    // SAFETY: installing a handler that only stores to an atomic, which is
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
}

/// The signal this process got since [`on_signals`], if any.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}

/// Whether `flag` is set on any rank of `group` (a collective: every rank
/// calls it, at the same point): the same answer on every rank, so all of
/// them stop after the same step.
pub fn any_rank<G: ProcessGroup>(group: &G, flag: bool) -> Result<bool, CommError> {
    let any = group
        .all_reduce(vec![u8::from(flag)], ReduceOp::Max)
        .wait()?;
    Ok(any.first().is_some_and(|&f| f != 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `any_rank` on ranks (threads) whose flags are `flags`.
    fn on_threads(flags: &[bool]) -> Vec<bool> {
        let handles: Vec<_> = crate::collectives::local::world(flags.len())
            .into_iter()
            .zip(flags.to_vec())
            .map(|(r, f)| std::thread::spawn(move || any_rank(r.world(), f).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_hears_of_any_ranks_flag() {
        assert_eq!(on_threads(&[false, true, false]), [true; 3]);
        assert_eq!(on_threads(&[true, false]), [true; 2]);
        assert_eq!(on_threads(&[false, false, false, false]), [false; 4]);
        assert_eq!(on_threads(&[false]), [false]);
    }
}

//! Errors of collectives: each names what happened and what to do.

use std::time::Duration;

/// Why a collective failed. Every variant names the group and the call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// A rank of the group is gone (its process or thread died, or it
    /// dropped the group), so this collective can never complete.
    #[error("rank {rank} of group `{group}` died or left the group during {call}: every rank must stay until the last collective (a rank that ran out of data and returned early leaves too: give every rank the same number of steps); otherwise check rank {rank}'s output for its error")]
    RankDied {
        /// The group.
        group: String,
        /// The rank that is gone (global rank).
        rank: usize,
        /// This rank's pending call.
        call: String,
    },
    /// Ranks issued different collectives at the same position in the group's sequence.
    #[error("collective mismatch on group `{group}` at call #{seq}: rank {rank_a} called {call_a} but rank {rank_b} called {call_b}; every rank must issue the same collectives, with the same sizes and dtypes, in the same order")]
    Mismatch {
        /// The group.
        group: String,
        /// Position in the group's sequence of calls (0-based).
        seq: u64,
        /// One rank and its call.
        rank_a: usize,
        /// Its call.
        call_a: String,
        /// A rank that disagrees.
        rank_b: usize,
        /// Its call.
        call_b: String,
    },
    /// The call did not complete in time.
    #[error("{call} on group `{group}` timed out after {:.1} s {}; a rank is stuck or slow (raise ZRT_TIMEOUT if it is only slow)", timeout.as_secs_f64(), waiting(waiting_for))]
    Timeout {
        /// The group.
        group: String,
        /// The call.
        call: String,
        /// How long it waited.
        timeout: Duration,
        /// Ranks that had not arrived (global ranks).
        waiting_for: Vec<usize>,
    },
    /// The arguments cannot be valid on any rank.
    #[error("invalid {call} on group `{group}`: {why}")]
    Invalid {
        /// The group.
        group: String,
        /// The call.
        call: String,
        /// What is wrong.
        why: String,
    },
    /// Shared memory for a symmetric buffer could not be created or mapped
    /// (on this rank, or on the rank named in `why`).
    #[error("{call} on group `{group}` could not set up shared memory: {why}; free space in /dev/shm (see `df /dev/shm`) or allocate smaller buffers")]
    SharedMemory {
        /// The group.
        group: String,
        /// The call.
        call: String,
        /// What failed, and on which rank.
        why: String,
    },
    /// Rendezvous or the environment contract failed.
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
    /// An earlier collective on this group failed on this rank, which then
    /// left the group (its peers see it as gone instead of reading a slot
    /// it never filled): later calls on the group are not run.
    #[error("{call} on group `{group}` was not run: an earlier collective on the group failed on this rank, which then left it ({cause}); a group cannot be used after one of its collectives failed")]
    Failed {
        /// The group.
        group: String,
        /// The call that was not run.
        call: String,
        /// Why the earlier collective failed.
        cause: Box<CommError>,
    },
    /// The collective panicked on this rank: a bug in zrt (nothing a caller
    /// or a peer can do should cause one). The rank left the group, as after
    /// any failed collective, so its peers fail too instead of waiting.
    #[error("{call} on group `{group}` panicked on this rank ({why}): this is a bug in zrt, please report it with this message; the rank has left the group, so its peers fail too")]
    Panicked {
        /// The group.
        group: String,
        /// The call.
        call: String,
        /// The panic's message.
        why: String,
    },
    /// The group was shut down (closed, or its handle dropped) before this call ran.
    #[error(
        "group `{group}` is shut down: {call} was issued after this rank closed the group (or dropped its handle)"
    )]
    Closed {
        /// The group.
        group: String,
        /// The call.
        call: String,
    },
}

/// Whom a timed-out call waited for: the ranks, when the backend saw them
/// missing; otherwise the wait was on this rank's handle, while the call (or
/// one issued before it on the group) was still waiting for the others.
fn waiting(ranks: &[usize]) -> String {
    if ranks.is_empty() {
        "waiting for the call to finish on this rank's group worker (it, or a call issued before it on the group, is still waiting for other ranks)".to_string()
    } else {
        format!("waiting for rank(s) {ranks:?}")
    }
}

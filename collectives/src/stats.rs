//! Per-operation counters, read by benchmarks and by the engine's
//! communication log (DeepSpeed's `comms_logger`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::OpKind;

const KINDS: usize = 9;

fn index(k: &OpKind) -> usize {
    match k {
        OpKind::AllReduce(_) => 0,
        OpKind::ReduceScatter(_) => 1,
        // The gathers share one counter: a benchmark reads "all_gather".
        OpKind::AllGather | OpKind::AllGatherV | OpKind::AllGatherInPlace => 2,
        OpKind::Broadcast { .. } => 3,
        OpKind::Barrier => 4,
        OpKind::Send { .. } => 5,
        OpKind::Recv { .. } => 6,
        OpKind::AllocSymmetric => 7,
        OpKind::AllToAll => 8,
    }
}

const NAMES: [&str; KINDS] = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "barrier",
    "send",
    "recv",
    "alloc_symmetric",
    "all_to_all",
];

#[derive(Default)]
struct Counter {
    calls: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    nanos: AtomicU64,
}

/// What [`Stats::observe`] is told of each completed operation.
pub type Observer = Arc<dyn Fn(&OpRecord) + Send + Sync>;

/// Counters of one group's operations on this rank: calls, bytes this rank
/// contributed (sent) and got back (received), and time from the start of
/// the operation on the worker to its completion (including waiting for
/// peers). The same per message size ([`Stats::by_size`]), and each
/// operation as it completes to an observer ([`Stats::observe`]).
#[derive(Default)]
pub struct Stats {
    ops: [Counter; KINDS],
    /// (operation, message bytes) -> (calls, time). Few entries: a
    /// training job repeats the same bucket sizes.
    sizes: Mutex<BTreeMap<(usize, u64), (u64, Duration)>>,
    observer: RwLock<Option<Observer>>,
}

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.snapshot()).finish()
    }
}

/// A snapshot of one operation's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpStats {
    /// The operation's name.
    pub op: &'static str,
    /// Completed calls.
    pub calls: u64,
    /// Bytes this rank contributed.
    pub bytes_sent: u64,
    /// Bytes this rank received.
    pub bytes_received: u64,
    /// Total time on the worker.
    pub time: Duration,
}

/// One operation's counters at one message size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeStats {
    /// The operation's name.
    pub op: &'static str,
    /// The message: the whole buffer the operation works on (the input of
    /// a reduce-scatter, the output of a gather, the buffer of the
    /// others), nccl-tests' "size".
    pub bytes: u64,
    /// Completed calls of that size.
    pub calls: u64,
    /// Their total time on the worker.
    pub time: Duration,
}

/// One completed operation, as an observer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpRecord {
    /// The operation's name.
    pub op: &'static str,
    /// The message's bytes, as [`SizeStats::bytes`].
    pub bytes: u64,
    /// Its time on the worker.
    pub time: Duration,
}

impl Stats {
    pub(crate) fn record(&self, kind: &OpKind, sent: usize, received: usize, took: Duration) {
        let i = index(kind);
        let c = &self.ops[i];
        c.calls.fetch_add(1, Relaxed);
        c.sent.fetch_add(sent as u64, Relaxed);
        c.received.fetch_add(received as u64, Relaxed);
        c.nanos.fetch_add(took.as_nanos() as u64, Relaxed);
        // Whichever way the op moves data, the larger side is the whole
        // buffer: a reduce-scatter sends its input and keeps a part, a
        // gather sends a part and receives the whole.
        let bytes = sent.max(received) as u64;
        {
            let mut sizes = self.sizes.lock();
            let e = sizes.entry((i, bytes)).or_default();
            e.0 += 1;
            e.1 += took;
        }
        if let Some(f) = self.observer.read().as_ref() {
            f(&OpRecord {
                op: NAMES[i],
                bytes,
                time: took,
            });
        }
    }

    /// Every operation's counters per message size, in the order of
    /// [`Stats::snapshot`] and by size within an operation. Only sizes
    /// that ran appear.
    pub fn by_size(&self) -> Vec<SizeStats> {
        self.sizes
            .lock()
            .iter()
            .map(|(&(i, bytes), &(calls, time))| SizeStats {
                op: NAMES[i],
                bytes,
                calls,
                time,
            })
            .collect()
    }

    /// Calls `f` on the group's communication thread after each operation
    /// completes (an operation that fails is not counted, nor told). One
    /// observer per group: a later call replaces it, `None` removes it.
    /// `f` runs before the operation's waiters are woken, so it must be
    /// quick (a log line), and must not call `observe` (the observer is
    /// held while it runs).
    pub fn observe(&self, f: Option<Observer>) {
        *self.observer.write() = f;
    }

    /// Every operation's counters, in a fixed order.
    pub fn snapshot(&self) -> Vec<OpStats> {
        self.ops
            .iter()
            .zip(NAMES)
            .map(|(c, op)| OpStats {
                op,
                calls: c.calls.load(Relaxed),
                bytes_sent: c.sent.load(Relaxed),
                bytes_received: c.received.load(Relaxed),
                time: Duration::from_nanos(c.nanos.load(Relaxed)),
            })
            .collect()
    }

    /// One operation's counters, by name (`"all_reduce"`, ...).
    pub fn get(&self, op: &str) -> Option<OpStats> {
        self.snapshot().into_iter().find(|s| s.op == op)
    }
}

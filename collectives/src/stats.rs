//! Per-operation counters, read by benchmarks.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::OpKind;

const KINDS: usize = 8;

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
];

#[derive(Default)]
struct Counter {
    calls: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    nanos: AtomicU64,
}

/// Counters of one group's operations on this rank: calls, bytes this rank
/// contributed (sent) and got back (received), and time from the start of
/// the operation on the worker to its completion (including waiting for
/// peers).
#[derive(Default)]
pub struct Stats {
    ops: [Counter; KINDS],
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

impl Stats {
    pub(crate) fn record(&self, kind: &OpKind, sent: usize, received: usize, took: Duration) {
        let c = &self.ops[index(kind)];
        c.calls.fetch_add(1, Relaxed);
        c.sent.fetch_add(sent as u64, Relaxed);
        c.received.fetch_add(received as u64, Relaxed);
        c.nanos.fetch_add(took.as_nanos() as u64, Relaxed);
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

//! The collective interface every backend implements.

use std::fmt;
use std::ops::Range;

use crate::{CommError, DType, Element, Stats, Work};

/// How `all_reduce` and `reduce_scatter` combine ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Sum divided by the group size (integers: truncating division).
    Avg,
    /// Maximum (NaN wins, as in torch).
    Max,
    /// Minimum (NaN wins, as in torch).
    Min,
}

/// Which collective, with the arguments every rank must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `all_reduce`.
    AllReduce(ReduceOp),
    /// `reduce_scatter`.
    ReduceScatter(ReduceOp),
    /// `all_gather` (per-rank lengths may differ).
    AllGather,
    /// `broadcast` from a group rank.
    Broadcast {
        /// Source (group rank).
        root: usize,
    },
    /// `barrier`.
    Barrier,
    /// `send` to a group rank.
    Send {
        /// Destination (group rank).
        to: usize,
    },
    /// `recv` from a group rank.
    Recv {
        /// Source (group rank).
        from: usize,
    },
}

impl OpKind {
    /// The collective's name, as in torch.distributed.
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::AllReduce(_) => "all_reduce",
            OpKind::ReduceScatter(_) => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast { .. } => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::Send { .. } => "send",
            OpKind::Recv { .. } => "recv",
        }
    }
}

/// One rank's description of a call: what ranks compare to detect mismatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpDesc {
    /// The collective.
    pub kind: OpKind,
    /// Element type (`None` for barrier).
    pub dtype: Option<DType>,
    /// Elements in the input (for `all_gather`, this rank's own part).
    pub len: usize,
}

impl OpDesc {
    /// Whether two ranks' descriptions can belong to one collective.
    /// `all_gather` parts may differ in length (all_gather_v).
    pub fn compatible(&self, other: &OpDesc) -> bool {
        match self.kind {
            OpKind::AllGather => self.kind == other.kind && self.dtype == other.dtype,
            _ => self == other,
        }
    }
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dt = self
            .dtype
            .map_or_else(String::new, |d| format!("{d} x {}", self.len));
        match self.kind {
            OpKind::AllReduce(op) | OpKind::ReduceScatter(op) => {
                write!(f, "{}({dt}, {op:?})", self.kind.name())
            }
            OpKind::Broadcast { root } => write!(f, "broadcast({dt}, root {root})"),
            OpKind::Send { to } => write!(f, "send({dt}, to {to})"),
            OpKind::Recv { from } => write!(f, "recv({dt}, from {from})"),
            OpKind::AllGather | OpKind::Barrier => write!(f, "{}({dt})", self.kind.name()),
        }
    }
}

/// The part of `len` elements that rank `i` of `parts` owns in
/// `reduce_scatter` / `all_gather`: `torch.tensor_split` semantics, so the
/// first `len % parts` parts have one element more.
pub fn chunk_range(len: usize, parts: usize, i: usize) -> Range<usize> {
    let parts = parts.max(1);
    let (base, extra) = (len / parts, len % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// A group of ranks that run collectives together.
///
/// Calls return at once; the work runs on the group's communication worker
/// in issue order. Buffers are moved in and handed back by [`Work::wait`].
/// Every rank of the group must issue the same calls in the same order.
pub trait ProcessGroup: Send + Sync {
    /// The group's name, used in every error.
    fn name(&self) -> &str;
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// The world ranks of the group's members, in group order.
    fn world_ranks(&self) -> &[usize];
    /// Bytes and time per operation so far.
    fn stats(&self) -> &Stats;

    /// Reduces `buf` across ranks, in place: every rank gets the result.
    fn all_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>>;

    /// Reduces `input` (same length on every rank) across ranks and leaves
    /// this rank its part ([`chunk_range`]) in `out`, resized to fit.
    /// Returns `(input, out)`.
    fn reduce_scatter<T: Element>(
        &self,
        input: Vec<T>,
        out: Vec<T>,
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)>;

    /// Concatenates every rank's `input` (lengths may differ) in rank order
    /// into `out`, resized to fit. Returns `(input, out)`.
    fn all_gather<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)>;

    /// Overwrites `buf` on every rank with group rank `root`'s `buf`.
    fn broadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>>;

    /// Completes once every rank has called it.
    fn barrier(&self) -> Work<()>;

    /// Sends `buf` to group rank `to`, which must `recv` it.
    fn send<T: Element>(&self, buf: Vec<T>, to: usize) -> Work<()>;

    /// Receives `len` elements from group rank `from`'s matching `send`.
    fn recv<T: Element>(&self, len: usize, from: usize) -> Work<Vec<T>>;
}

/// Builds the error for a call that cannot be valid.
pub(crate) fn invalid(group: &str, desc: &OpDesc, why: impl Into<String>) -> CommError {
    CommError::Invalid {
        group: group.to_string(),
        call: desc.to_string(),
        why: why.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_like_tensor_split() {
        for len in 0..40 {
            for parts in 1..6 {
                let ranges: Vec<_> = (0..parts).map(|i| chunk_range(len, parts, i)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[parts - 1].end, len);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() == w[1].len() || w[0].len() == w[1].len() + 1);
                }
            }
        }
        assert_eq!(chunk_range(10, 3, 0), 0..4);
        assert_eq!(chunk_range(10, 3, 2), 7..10);
    }

    #[test]
    fn descriptions_read_like_calls() {
        let d = OpDesc {
            kind: OpKind::AllReduce(ReduceOp::Sum),
            dtype: Some(DType::F32),
            len: 10,
        };
        assert_eq!(d.to_string(), "all_reduce(f32 x 10, Sum)");
        let b = OpDesc {
            kind: OpKind::Barrier,
            dtype: None,
            len: 0,
        };
        assert_eq!(b.to_string(), "barrier()");
    }
}

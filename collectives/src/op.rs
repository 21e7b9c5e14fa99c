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

const REDUCE_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
const DTYPES: [DType; 6] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F64,
    DType::I64,
    DType::U8,
];

impl OpDesc {
    /// Three words a peer can read from shared memory or a socket.
    pub(crate) fn encode(&self) -> [u64; 3] {
        let rop = |op: ReduceOp| REDUCE_OPS.iter().position(|&o| o == op).unwrap_or(0) as u64;
        let (kind, arg) = match self.kind {
            OpKind::AllReduce(op) => (1, rop(op)),
            OpKind::ReduceScatter(op) => (2, rop(op)),
            OpKind::AllGather => (3, 0),
            OpKind::Broadcast { root } => (4, root as u64),
            OpKind::Barrier => (5, 0),
            OpKind::Send { to } => (6, to as u64),
            OpKind::Recv { from } => (7, from as u64),
        };
        let dt = self
            .dtype
            .and_then(|d| DTYPES.iter().position(|&x| x == d))
            .map_or(0, |i| i as u64 + 1);
        [kind | arg << 8, dt, self.len as u64]
    }

    /// The inverse of [`OpDesc::encode`]; `None` for words no rank wrote.
    pub(crate) fn decode(w: [u64; 3]) -> Option<OpDesc> {
        let arg = (w[0] >> 8) as usize;
        let rop = || REDUCE_OPS.get(arg).copied();
        let kind = match w[0] & 0xFF {
            1 => OpKind::AllReduce(rop()?),
            2 => OpKind::ReduceScatter(rop()?),
            3 => OpKind::AllGather,
            4 => OpKind::Broadcast { root: arg },
            5 => OpKind::Barrier,
            6 => OpKind::Send { to: arg },
            7 => OpKind::Recv { from: arg },
            _ => return None,
        };
        let dtype = match w[1] {
            0 => None,
            i => Some(*DTYPES.get(i as usize - 1)?),
        };
        Some(OpDesc {
            kind,
            dtype,
            len: w[2] as usize,
        })
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

    /// [`ProcessGroup::all_gather`] in place: `buf` has the whole length
    /// on every rank and holds this rank's part ([`chunk_range`]) on entry;
    /// on return it holds every rank's part. Backends that can skip copying
    /// this rank's own part (shm) do.
    fn all_gather_in_place<T: Element>(&self, buf: Vec<T>) -> Work<Vec<T>> {
        let part = buf[chunk_range(buf.len(), self.size(), self.rank())].to_vec();
        self.all_gather(part, buf).map(|(_, out)| out)
    }

    /// [`ProcessGroup::reduce_scatter`] in place: reduces `buf` (same
    /// length on every rank); on return this rank's part ([`chunk_range`])
    /// of `buf` holds the result and the rest is unspecified.
    fn reduce_scatter_in_place<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let r = chunk_range(buf.len(), self.size(), self.rank());
        self.reduce_scatter(buf, Vec::new(), op)
            .map(move |(mut buf, part)| {
                buf[r].copy_from_slice(&part);
                buf
            })
    }

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
    fn descriptions_round_trip_through_words() {
        let all = [
            OpKind::AllReduce(ReduceOp::Min),
            OpKind::ReduceScatter(ReduceOp::Avg),
            OpKind::AllGather,
            OpKind::Broadcast { root: 3 },
            OpKind::Barrier,
            OpKind::Send { to: 1 },
            OpKind::Recv { from: 2 },
        ];
        for kind in all {
            for dtype in [None, Some(DType::BF16), Some(DType::U8)] {
                let d = OpDesc {
                    kind,
                    dtype,
                    len: 12345,
                };
                assert_eq!(OpDesc::decode(d.encode()), Some(d));
            }
        }
        assert_eq!(OpDesc::decode([0, 0, 0]), None);
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

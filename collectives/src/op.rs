//! The collective interface every backend implements.

use std::fmt;
use std::ops::Range;

use crate::{CommError, DType, Element, Stats, SymmetricBuf, Work};

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
    /// `all_gather`: every rank's part has the same length.
    AllGather,
    /// `all_gather_v`: parts may differ in length.
    AllGatherV,
    /// `all_gather_in_place` (and `all_gather_symmetric`): the length is
    /// the whole buffer's, the same on every rank, and the parts are its
    /// [`chunk_range`]s.
    AllGatherInPlace,
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
    /// `alloc_symmetric`: every rank allocates its buffer of a symmetric set.
    AllocSymmetric,
    /// `all_to_all`: every rank's input has the same length; its
    /// [`chunk_range`] `p` goes to rank `p`.
    AllToAll,
}

impl OpKind {
    /// The collective's name, as in torch.distributed.
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::AllReduce(_) => "all_reduce",
            OpKind::ReduceScatter(_) => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::AllGatherV => "all_gather_v",
            OpKind::AllGatherInPlace => "all_gather_in_place",
            OpKind::Broadcast { .. } => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::Send { .. } => "send",
            OpKind::Recv { .. } => "recv",
            OpKind::AllocSymmetric => "alloc_symmetric",
            OpKind::AllToAll => "all_to_all",
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
    /// Elements in the input (for `all_gather` and `all_gather_v`, this
    /// rank's own part; for `all_gather_in_place`, the whole buffer).
    pub len: usize,
    /// For calls on a [`SymmetricBuf`] of the shm backend: the buffer's
    /// allocation number, so ranks that pass buffers of different
    /// allocations fail instead of reading the wrong peer buffers.
    pub buffer: Option<u32>,
}

impl OpDesc {
    /// A call on ordinary buffers.
    pub fn new(kind: OpKind, dtype: Option<DType>, len: usize) -> Self {
        Self {
            kind,
            dtype,
            len,
            buffer: None,
        }
    }
}

impl OpDesc {
    /// Whether two ranks' descriptions can belong to one collective: the
    /// same in every field, except that `all_gather_v` parts may differ
    /// in length. Plain `all_gather` is strict on purpose: two different
    /// calls that happen to be gathers of one dtype (a 1-element flag met
    /// by a 6-element exchange, say) must fail, not concatenate.
    pub fn compatible(&self, other: &OpDesc) -> bool {
        match self.kind {
            OpKind::AllGatherV => {
                self.kind == other.kind && self.dtype == other.dtype && self.buffer == other.buffer
            }
            _ => self == other,
        }
    }
}

/// The length of each rank's part in a gather whose ranks described their
/// calls as `descs` (agreed, in group order).
pub(crate) fn gather_lens(descs: &[OpDesc]) -> Vec<usize> {
    let n = descs.len();
    descs
        .iter()
        .enumerate()
        .map(|(r, d)| match d.kind {
            OpKind::AllGatherInPlace => chunk_range(d.len, n, r).len(),
            _ => d.len,
        })
        .collect()
}

/// Where each rank's part lies in the output of a gather whose ranks
/// described their calls as `descs`: [`gather_lens`] laid end to end, in
/// group order. The last range ends at the output's length.
pub(crate) fn gather_ranges(descs: &[OpDesc]) -> Vec<Range<usize>> {
    let mut at = 0;
    gather_lens(descs)
        .into_iter()
        .map(|len| {
            at += len;
            at - len..at
        })
        .collect()
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
            OpKind::AllocSymmetric => (8, 0),
            OpKind::AllGatherV => (9, 0),
            OpKind::AllGatherInPlace => (10, 0),
            OpKind::AllToAll => (11, 0),
        };
        let dt = self
            .dtype
            .and_then(|d| DTYPES.iter().position(|&x| x == d))
            .map_or(0, |i| i as u64 + 1);
        let buffer = self.buffer.map_or(0, |b| u64::from(b) + 1);
        [kind | arg << 8, dt | buffer << 32, self.len as u64]
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
            8 => OpKind::AllocSymmetric,
            9 => OpKind::AllGatherV,
            10 => OpKind::AllGatherInPlace,
            11 => OpKind::AllToAll,
            _ => return None,
        };
        let dtype = match w[1] & 0xFFFF_FFFF {
            0 => None,
            i => Some(*DTYPES.get(i as usize - 1)?),
        };
        let buffer = match w[1] >> 32 {
            0 => None,
            b => Some(u32::try_from(b - 1).ok()?),
        };
        Some(OpDesc {
            kind,
            dtype,
            len: w[2] as usize,
            buffer,
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
            OpKind::AllGather
            | OpKind::AllGatherV
            | OpKind::AllGatherInPlace
            | OpKind::Barrier
            | OpKind::AllocSymmetric
            | OpKind::AllToAll => {
                write!(f, "{}({dt})", self.kind.name())
            }
        }?;
        match self.buffer {
            Some(b) => write!(f, " on symmetric buffer #{b}"),
            None => Ok(()),
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

    /// Concatenates every rank's `input` in rank order into `out`, resized
    /// to fit. Returns `(input, out)`. Every rank's `input` has the same
    /// length (as torch's `all_gather_into_tensor`): a rank whose length
    /// differs fails the call on every rank, naming both calls. Parts of
    /// different lengths go through [`ProcessGroup::all_gather_v`].
    fn all_gather<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)>;

    /// [`ProcessGroup::all_gather`] of parts whose lengths may differ from
    /// rank to rank (MPI's `allgatherv`): the lengths are exchanged with
    /// the call, so the caller need not know them. Only the element type
    /// must agree.
    fn all_gather_v<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)>;

    /// [`ProcessGroup::all_gather`] in place: `buf` has the whole length,
    /// the same on every rank, and holds this rank's part ([`chunk_range`])
    /// on entry; on return it holds every rank's part. Backends that can
    /// skip copying this rank's own part (shm) do.
    fn all_gather_in_place<T: Element>(&self, buf: Vec<T>) -> Work<Vec<T>>;

    /// Every rank sends each rank its own piece of `input`: the
    /// [`chunk_range`] `p` of `input` goes to rank `p`, and `out` (resized,
    /// its allocation reused) receives, in rank order, every rank's chunk
    /// `self.rank()`. `input` has the same length on every rank.
    /// Returns `(input, out)`. (`torch.distributed.all_to_all_single`
    /// without split sizes; a length the group does not divide splits as
    /// `reduce_scatter`'s does.)
    fn all_to_all<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)>;

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

    /// Allocates a [`SymmetricBuf`] of `len` zeros on every rank together:
    /// a collective, so every rank must call it, with the same length and
    /// type, at the same place in the group's sequence. The shm backend
    /// puts it in shared memory that every rank maps, so the symmetric
    /// collectives below read peers' buffers in place instead of staging
    /// them; other backends hand out a heap buffer.
    fn alloc_symmetric<T: Element>(&self, len: usize) -> Work<SymmetricBuf<T>> {
        Work::ready(
            Ok(SymmetricBuf::heap(vec![T::ZERO; len])),
            self.name(),
            OpDesc::new(OpKind::AllocSymmetric, Some(T::DTYPE), len).to_string(),
        )
    }

    /// [`ProcessGroup::reduce_scatter_in_place`] on a symmetric buffer (of
    /// this group; every rank passes its buffer of the same allocation).
    /// On shm each rank reduces its part reading every rank's buffer in
    /// place: no staging copies. Elsewhere it is the in-place op (a buffer
    /// another backend allocated goes through a copy).
    fn reduce_scatter_symmetric<T: Element>(
        &self,
        buf: SymmetricBuf<T>,
        op: ReduceOp,
    ) -> Work<SymmetricBuf<T>> {
        match buf.into_heap() {
            Ok(v) => self.reduce_scatter_in_place(v, op).map(SymmetricBuf::heap),
            Err(mut buf) => self
                .reduce_scatter_in_place(buf.to_vec(), op)
                .map(move |v| {
                    buf.copy_from_slice(&v);
                    buf
                }),
        }
    }

    /// [`ProcessGroup::all_gather_in_place`] on a symmetric buffer (of this
    /// group; every rank passes its buffer of the same allocation). On shm
    /// each rank copies the peers' parts straight from their buffers.
    /// Elsewhere it is the in-place op (a buffer another backend allocated
    /// goes through a copy).
    fn all_gather_symmetric<T: Element>(&self, buf: SymmetricBuf<T>) -> Work<SymmetricBuf<T>> {
        match buf.into_heap() {
            Ok(v) => self.all_gather_in_place(v).map(SymmetricBuf::heap),
            Err(mut buf) => self.all_gather_in_place(buf.to_vec()).map(move |v| {
                buf.copy_from_slice(&v);
                buf
            }),
        }
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
            OpKind::AllocSymmetric,
            OpKind::AllGatherV,
            OpKind::AllGatherInPlace,
            OpKind::AllToAll,
        ];
        for kind in all {
            for dtype in [None, Some(DType::BF16), Some(DType::U8)] {
                for buffer in [None, Some(0), Some(7)] {
                    let d = OpDesc {
                        buffer,
                        ..OpDesc::new(kind, dtype, 12345)
                    };
                    assert_eq!(OpDesc::decode(d.encode()), Some(d));
                }
            }
        }
        assert_eq!(OpDesc::decode([0, 0, 0]), None);
    }

    #[test]
    fn descriptions_read_like_calls() {
        let d = OpDesc::new(OpKind::AllReduce(ReduceOp::Sum), Some(DType::F32), 10);
        assert_eq!(d.to_string(), "all_reduce(f32 x 10, Sum)");
        let b = OpDesc::new(OpKind::Barrier, None, 0);
        assert_eq!(b.to_string(), "barrier()");
        let s = OpDesc {
            buffer: Some(3),
            ..OpDesc::new(OpKind::AllGatherInPlace, Some(DType::BF16), 5)
        };
        assert_eq!(
            s.to_string(),
            "all_gather_in_place(bf16 x 5) on symmetric buffer #3"
        );
        assert!(!s.compatible(&OpDesc {
            buffer: Some(4),
            ..s
        }));
    }

    #[test]
    fn only_all_gather_v_parts_may_differ_in_length() {
        let d = |kind, dtype, len| OpDesc::new(kind, Some(dtype), len);
        for kind in [OpKind::AllGather, OpKind::AllGatherInPlace] {
            assert!(d(kind, DType::F32, 6).compatible(&d(kind, DType::F32, 6)));
            assert!(!d(kind, DType::I64, 1).compatible(&d(kind, DType::I64, 6)));
        }
        let v = OpKind::AllGatherV;
        assert!(d(v, DType::I64, 1).compatible(&d(v, DType::I64, 6)));
        assert!(d(v, DType::I64, 6).compatible(&d(v, DType::I64, 1)));
        assert!(!d(v, DType::I64, 1).compatible(&d(v, DType::F32, 1)));
        // A gather of one kind never runs with another kind's call.
        assert!(!d(v, DType::F32, 4).compatible(&d(OpKind::AllGather, DType::F32, 4)));
        assert!(!d(OpKind::AllGather, DType::F32, 4).compatible(&d(v, DType::F32, 4)));
        let in_place = d(OpKind::AllGatherInPlace, DType::F32, 4);
        assert!(!in_place.compatible(&d(OpKind::AllGather, DType::F32, 4)));
    }

    #[test]
    fn gathered_parts_are_the_callers_lengths_or_chunks_of_the_whole() {
        let d = |kind, len| OpDesc::new(kind, Some(DType::F32), len);
        let v = [
            d(OpKind::AllGatherV, 3),
            d(OpKind::AllGatherV, 0),
            d(OpKind::AllGatherV, 5),
        ];
        assert_eq!(gather_lens(&v), [3, 0, 5]);
        assert_eq!(gather_ranges(&v), [0..3, 3..3, 3..8]);
        assert_eq!(gather_lens(&[d(OpKind::AllGather, 4); 3]), [4, 4, 4]);
        // In place the whole of 10 splits like torch.tensor_split.
        assert_eq!(
            gather_lens(&[d(OpKind::AllGatherInPlace, 10); 3]),
            [4, 3, 3]
        );
        assert_eq!(
            gather_ranges(&[d(OpKind::AllGatherInPlace, 10); 3]),
            [0..4, 4..7, 7..10]
        );
    }
}

//! The in-process backend: ranks are threads of one process.
//!
//! Each group has a shared *board*. For the n-th collective of the group,
//! every rank posts its call description and its buffer in slot n, waits
//! until every rank has posted, checks that all descriptions agree, and
//! computes its own result from the others' buffers. That makes this backend
//! the plain reference the faster ones are tested against, and lets it detect
//! every fault by looking at the board: a description that differs is a
//! mismatch; a rank that has not posted and whose handle is gone is dead; a
//! deadline that passes is a timeout naming the ranks still missing.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::dtype::bytes_of;
use crate::front::FirstFailure;
use crate::op::invalid;
use crate::p2p::check_peer;
use crate::worker::{contain, Worker};
use crate::{
    chunk_range, default_timeout, CommError, DeviceMesh, Element, OpDesc, OpKind, ProcessGroup,
    ReduceOp, Stats, Work,
};

type Payload = Arc<dyn Any + Send + Sync>;
/// A group's members and how many groups with those members came before it.
type GroupKey = (Vec<usize>, u32);

/// Creates a world of `size` ranks with the default timeout; hand one
/// [`LocalRank`] to each thread.
pub fn world(size: usize) -> Vec<LocalRank> {
    world_with_timeout(size, default_timeout())
}

/// Creates a world of `size` ranks whose collectives time out after `timeout`.
pub fn world_with_timeout(size: usize, timeout: Duration) -> Vec<LocalRank> {
    let shared = Arc::new(WorldShared {
        timeout,
        boards: Mutex::new(HashMap::new()),
    });
    let all: Vec<usize> = (0..size).collect();
    (0..size)
        .map(|r| {
            let created = Mutex::new(HashMap::new());
            let board = shared.board(&all, 0, "world");
            LocalRank {
                world_rank: r,
                world_size: size,
                shared: shared.clone(),
                created,
                world: LocalGroup::new(board, r),
            }
        })
        .collect()
}

struct WorldShared {
    timeout: Duration,
    /// Boards by (members, how many groups with these members existed before).
    boards: Mutex<HashMap<GroupKey, Arc<Board>>>,
}

impl WorldShared {
    fn board(&self, ranks: &[usize], nth: u32, name: &str) -> Arc<Board> {
        self.boards
            .lock()
            .entry((ranks.to_vec(), nth))
            .or_insert_with(|| Arc::new(Board::new(name.to_string(), ranks.to_vec(), self.timeout)))
            .clone()
    }
}

/// One rank of a local world: its world group, and the way to make sub-groups.
pub struct LocalRank {
    world_rank: usize,
    world_size: usize,
    shared: Arc<WorldShared>,
    /// How many groups with the same members this rank made already, so the
    /// k-th `new_group(ranks)` of every member meets on the same board.
    created: Mutex<HashMap<Vec<usize>, u32>>,
    world: LocalGroup,
}

impl LocalRank {
    /// This rank's index in the world.
    pub fn rank(&self) -> usize {
        self.world_rank
    }

    /// The group of every rank.
    pub fn world(&self) -> &LocalGroup {
        &self.world
    }

    /// A group of the given world ranks (in that order), which this rank must
    /// belong to. Every member calls it; non-members need not.
    pub fn new_group(&self, ranks: &[usize]) -> Result<LocalGroup, CommError> {
        let name = format!("ranks{ranks:?}");
        let bad = |why: String| CommError::Invalid {
            group: name.clone(),
            call: "new_group".into(),
            why,
        };
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(bad(format!(
                "rank {r} is not in the world of {} ranks",
                self.world_size
            )));
        }
        let mut seen = ranks.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ranks.len() {
            return Err(bad("a rank is listed twice".into()));
        }
        let Some(me) = ranks.iter().position(|&r| r == self.world_rank) else {
            return Err(bad(format!(
                "this rank ({}) is not a member",
                self.world_rank
            )));
        };
        let nth = {
            let mut c = self.created.lock();
            let n = c.entry(ranks.to_vec()).or_insert(0);
            *n += 1;
            *n - 1
        };
        Ok(LocalGroup::new(self.shared.board(ranks, nth, &name), me))
    }

    /// This rank's view of a (replicate x shard) mesh over the world.
    pub fn mesh(&self, shard_size: usize) -> Result<DeviceMesh<LocalGroup>, CommError> {
        DeviceMesh::new(self.world_rank, self.world_size, shard_size, |ranks| {
            self.new_group(ranks)
        })
    }
}

struct Slot {
    descs: Vec<Option<OpDesc>>,
    data: Vec<Option<Payload>>,
    finished: usize,
}

#[derive(Default)]
struct BoardState {
    slots: HashMap<u64, Slot>,
    alive: Vec<bool>,
    /// Point-to-point messages by (from, to) group ranks.
    mail: HashMap<(usize, usize), VecDeque<(OpDesc, Payload)>>,
}

struct Board {
    name: String,
    world_ranks: Vec<usize>,
    timeout: Duration,
    st: Mutex<BoardState>,
    cv: Condvar,
}

impl Board {
    fn new(name: String, world_ranks: Vec<usize>, timeout: Duration) -> Self {
        let st = BoardState {
            alive: vec![true; world_ranks.len()],
            ..Default::default()
        };
        Self {
            name,
            world_ranks,
            timeout,
            st: Mutex::new(st),
            cv: Condvar::new(),
        }
    }

    fn size(&self) -> usize {
        self.world_ranks.len()
    }

    /// Posts this rank's part of collective `seq` and returns every rank's part.
    fn exchange(
        &self,
        seq: u64,
        rank: usize,
        desc: OpDesc,
        data: Payload,
    ) -> Result<Vec<Payload>, CommError> {
        let deadline = crate::work::deadline_in(self.timeout);
        let n = self.size();
        let mut st = self.st.lock();
        {
            let slot = st.slots.entry(seq).or_insert_with(|| Slot {
                descs: vec![None; n],
                data: vec![None; n],
                finished: 0,
            });
            slot.descs[rank] = Some(desc);
            slot.data[rank] = Some(data);
        }
        self.cv.notify_all();
        loop {
            let slot = st.slots.get_mut(&seq).ok_or_else(|| CommError::Closed {
                group: self.name.clone(),
                call: desc.to_string(),
            })?;
            // Any two posted descriptions that disagree: a mismatch, now.
            let posted: Vec<(usize, OpDesc)> = slot
                .descs
                .iter()
                .enumerate()
                .filter_map(|(r, d)| d.map(|d| (r, d)))
                .collect();
            if let Some(&(ra, da)) = posted.first() {
                if let Some(&(rb, db)) = posted.iter().find(|(_, d)| !da.compatible(d)) {
                    return Err(CommError::Mismatch {
                        group: self.name.clone(),
                        seq,
                        rank_a: self.world_ranks[ra],
                        call_a: da.to_string(),
                        rank_b: self.world_ranks[rb],
                        call_b: db.to_string(),
                    });
                }
            }
            let missing: Vec<usize> = (0..n).filter(|&r| slot.descs[r].is_none()).collect();
            if missing.is_empty() {
                let parts: Vec<Payload> = slot.data.iter().flatten().cloned().collect();
                slot.finished += 1;
                if slot.finished == n {
                    st.slots.remove(&seq);
                }
                return Ok(parts);
            }
            if let Some(&dead) = missing.iter().find(|&&r| !st.alive[r]) {
                return Err(CommError::RankDied {
                    group: self.name.clone(),
                    rank: self.world_ranks[dead],
                    call: desc.to_string(),
                });
            }
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    group: self.name.clone(),
                    call: desc.to_string(),
                    timeout: self.timeout,
                    waiting_for: missing.iter().map(|&r| self.world_ranks[r]).collect(),
                });
            }
            self.cv.wait_until(&mut st, deadline);
        }
    }

    fn post(&self, from: usize, to: usize, desc: OpDesc, data: Payload) {
        self.st
            .lock()
            .mail
            .entry((from, to))
            .or_default()
            .push_back((desc, data));
        self.cv.notify_all();
    }

    fn take(&self, from: usize, to: usize, want: OpDesc) -> Result<Payload, CommError> {
        let deadline = crate::work::deadline_in(self.timeout);
        let mut st = self.st.lock();
        loop {
            if let Some((desc, data)) = st.mail.get_mut(&(from, to)).and_then(VecDeque::pop_front) {
                if desc.dtype != want.dtype || desc.len != want.len {
                    return Err(CommError::Mismatch {
                        group: self.name.clone(),
                        seq: 0,
                        rank_a: self.world_ranks[from],
                        call_a: desc.to_string(),
                        rank_b: self.world_ranks[to],
                        call_b: want.to_string(),
                    });
                }
                return Ok(data);
            }
            if !st.alive[from] {
                return Err(CommError::RankDied {
                    group: self.name.clone(),
                    rank: self.world_ranks[from],
                    call: want.to_string(),
                });
            }
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    group: self.name.clone(),
                    call: want.to_string(),
                    timeout: self.timeout,
                    waiting_for: vec![self.world_ranks[from]],
                });
            }
            self.cv.wait_until(&mut st, deadline);
        }
    }

    fn leave(&self, rank: usize) {
        self.st.lock().alive[rank] = false;
        self.cv.notify_all();
    }
}

/// One rank's handle on a local group. Dropping it waits for this rank's
/// queued operations, then marks the rank gone: peers' later collectives
/// fail with [`CommError::RankDied`] instead of waiting.
///
/// As on the process backends, a collective that fails (a timeout, a dead
/// peer, a mismatch) makes this rank leave the group, and its later
/// collectives fail with [`CommError::Failed`] quoting that error. The board
/// itself could go on (every call has a slot of its own), but tests on
/// threads should see what a program on shm or tcp sees.
pub struct LocalGroup {
    board: Arc<Board>,
    rank: usize,
    seq: AtomicU64,
    worker: Result<Worker, CommError>,
    /// The first collective that failed on this rank, once one has.
    failed: FirstFailure,
}

impl LocalGroup {
    fn new(board: Arc<Board>, rank: usize) -> Self {
        let b = board.clone();
        // When the handle is gone and its queue drained, this rank has left.
        let worker = Worker::start(&board.name, rank, move || b.leave(rank));
        if worker.is_err() {
            board.leave(rank);
        }
        Self {
            board,
            rank,
            seq: AtomicU64::new(0),
            worker,
            failed: FirstFailure::default(),
        }
    }

    /// Queues `f` on the worker; its result arrives through the returned Work.
    fn submit<R: Send + 'static>(
        &self,
        desc: OpDesc,
        f: impl FnOnce(&Board) -> Result<(R, usize, usize), CommError> + Send + 'static,
    ) -> Work<R> {
        match &self.worker {
            Ok(w) => {
                let board = self.board.clone();
                w.submit(desc, move || f(&board))
            }
            Err(e) => Work::ready(Err(e.clone()), &self.board.name, desc.to_string()),
        }
    }

    /// A collective: claim the next sequence number now (issue order), then
    /// exchange on the worker and let `compute` build this rank's result from
    /// every rank's input (in group order).
    fn collective<T: Element, R: Send + 'static>(
        &self,
        desc: OpDesc,
        input: Vec<T>,
        compute: impl FnOnce(&[&Vec<T>]) -> (R, usize) + Send + 'static,
    ) -> Work<R> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let rank = self.rank;
        let failed = self.failed.clone();
        self.submit(desc, move |board| {
            failed.check(&board.name, &desc)?;
            let sent = bytes_of::<T>(input.len());
            let exchange = || board.exchange(seq, rank, desc, Arc::new(input));
            let parts = contain(&board.name, &desc, exchange)
                .inspect_err(|e| failed.record(&board.name, e, || board.leave(rank)))?;
            let typed: Vec<&Vec<T>> = parts
                .iter()
                .filter_map(|p| p.downcast_ref::<Vec<T>>())
                .collect();
            if typed.len() != parts.len() {
                return Err(invalid(
                    &board.name,
                    &desc,
                    "a peer posted another element type",
                ));
            }
            let (out, received) = compute(&typed);
            Ok((out, sent, received))
        })
    }

    /// Every gather (`desc` says which): concatenates the ranks' `input`s
    /// into `out`. Returns `(input, out)`.
    fn gather<T: Element>(
        &self,
        desc: OpDesc,
        input: Vec<T>,
        mut out: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let rank = self.rank;
        self.collective(desc, input, move |parts| {
            out.clear();
            for p in parts {
                out.extend_from_slice(p);
            }
            let got = bytes_of::<T>(out.len());
            ((parts[rank].clone(), out), got)
        })
    }
}

fn reduce_into<T: Element>(
    parts: &[&Vec<T>],
    range: std::ops::Range<usize>,
    op: ReduceOp,
    out: &mut Vec<T>,
) {
    let srcs: Vec<&[T]> = parts.iter().map(|p| &p[range.clone()]).collect();
    out.clear();
    out.resize(range.len(), T::ZERO);
    T::reduce_into(out, &srcs, op);
}

impl ProcessGroup for LocalGroup {
    fn name(&self) -> &str {
        &self.board.name
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.board.size()
    }
    fn world_ranks(&self) -> &[usize] {
        &self.board.world_ranks
    }
    fn stats(&self) -> &Stats {
        static NONE: std::sync::OnceLock<Stats> = std::sync::OnceLock::new();
        match &self.worker {
            Ok(w) => w.stats(),
            Err(_) => NONE.get_or_init(Stats::default),
        }
    }

    fn all_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let desc = OpDesc::new(OpKind::AllReduce(op), Some(T::DTYPE), buf.len());
        let n = buf.len();
        self.collective(desc, buf, move |parts| {
            let mut out = Vec::with_capacity(n);
            reduce_into(parts, 0..n, op, &mut out);
            (out, bytes_of::<T>(n))
        })
    }

    fn reduce_scatter<T: Element>(
        &self,
        input: Vec<T>,
        mut out: Vec<T>,
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let desc = OpDesc::new(OpKind::ReduceScatter(op), Some(T::DTYPE), input.len());
        let (rank, range) = (self.rank, chunk_range(input.len(), self.size(), self.rank));
        self.collective(desc, input, move |parts| {
            reduce_into(parts, range, op, &mut out);
            let got = bytes_of::<T>(out.len());
            ((parts[rank].clone(), out), got)
        })
    }

    fn all_gather<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        let desc = OpDesc::new(OpKind::AllGather, Some(T::DTYPE), input.len());
        self.gather(desc, input, out)
    }

    fn all_gather_v<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        let desc = OpDesc::new(OpKind::AllGatherV, Some(T::DTYPE), input.len());
        self.gather(desc, input, out)
    }

    fn all_gather_in_place<T: Element>(&self, buf: Vec<T>) -> Work<Vec<T>> {
        // Described by the whole length, so agreement makes every part a
        // chunk of the same whole: together they fill `buf`.
        let desc = OpDesc::new(OpKind::AllGatherInPlace, Some(T::DTYPE), buf.len());
        let part = buf[chunk_range(buf.len(), self.size(), self.rank)].to_vec();
        self.gather(desc, part, buf).map(|(_, buf)| buf)
    }

    fn all_to_all<T: Element>(&self, input: Vec<T>, mut out: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        let desc = OpDesc::new(OpKind::AllToAll, Some(T::DTYPE), input.len());
        let (rank, n) = (self.rank, self.size());
        self.collective(desc, input, move |parts| {
            // Agreement made every input as long: every rank's chunk
            // `rank` is the same range.
            out.clear();
            for p in parts {
                out.extend_from_slice(&p[chunk_range(p.len(), n, rank)]);
            }
            let got = bytes_of::<T>(out.len());
            ((parts[rank].clone(), out), got)
        })
    }

    fn broadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        let desc = OpDesc::new(OpKind::Broadcast { root }, Some(T::DTYPE), buf.len());
        if root >= self.size() {
            let e = invalid(
                self.name(),
                &desc,
                format!("root {root} is not a rank of this group of {}", self.size()),
            );
            return Work::ready(Err(e), self.name(), desc.to_string());
        }
        self.collective(desc, buf, move |parts| {
            let out = parts[root].clone();
            let got = bytes_of::<T>(out.len());
            (out, got)
        })
    }

    fn barrier(&self) -> Work<()> {
        let desc = OpDesc::new(OpKind::Barrier, None, 0);
        self.collective::<u8, ()>(desc, Vec::new(), |_| ((), 0))
    }

    fn send<T: Element>(&self, buf: Vec<T>, to: usize) -> Work<()> {
        let desc = OpDesc::new(OpKind::Send { to }, Some(T::DTYPE), buf.len());
        if let Some(e) = check_peer(self.name(), &desc, to, self.rank, self.size()) {
            return Work::ready(Err(e), self.name(), desc.to_string());
        }
        let from = self.rank;
        self.submit(desc, move |board| {
            let sent = bytes_of::<T>(buf.len());
            board.post(from, to, desc, Arc::new(buf));
            Ok(((), sent, 0))
        })
    }

    fn recv<T: Element>(&self, len: usize, from: usize) -> Work<Vec<T>> {
        let desc = OpDesc::new(OpKind::Recv { from }, Some(T::DTYPE), len);
        if let Some(e) = check_peer(self.name(), &desc, from, self.rank, self.size()) {
            return Work::ready(Err(e), self.name(), desc.to_string());
        }
        let to = self.rank;
        self.submit(desc, move |board| {
            let data = board.take(from, to, desc)?;
            let v = data.downcast_ref::<Vec<T>>().cloned().ok_or_else(|| {
                invalid(&board.name, &desc, "the sender posted another element type")
            })?;
            let got = bytes_of::<T>(v.len());
            Ok((v, 0, got))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_collectives_leave_nothing_on_the_board() {
        // Each collective's slot holds every rank's buffer until the last
        // rank has read it; a slot kept after that would grow the board by
        // a whole buffer per call for the life of the group.
        let ranks = world(2);
        std::thread::scope(|s| {
            for r in &ranks {
                s.spawn(|| {
                    for _ in 0..3 {
                        let w = r.world().all_reduce(vec![1f32; 4], ReduceOp::Sum);
                        assert_eq!(w.wait().unwrap(), vec![2.0; 4]);
                    }
                });
            }
        });
        assert!(ranks[0].world().board.st.lock().slots.is_empty());
    }
}

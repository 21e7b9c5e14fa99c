//! What the process backends (shm, tcp) share: turning a [`ProcessGroup`]
//! call into a described operation, run in issue order on the group's
//! worker, with its byte counts, and `send`/`recv` through the store.
//!
//! A backend provides a [`Transport`] (how data moves) and keeps a
//! [`Front`] over it; its `ProcessGroup` impl forwards each call here. The
//! `local` backend is different enough (threads, one board) to stand alone.
//!
//! [`ProcessGroup`]: crate::ProcessGroup

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::dtype::bytes_of;
use crate::op::invalid;
use crate::p2p::{check_peer, Mailbox, Peers};
use crate::store::StoreClient;
use crate::worker::{contain, Worker};
use crate::{CommError, Element, OpDesc, OpKind, ReduceOp, Stats, Work};

/// How a process backend moves data. Every method runs on the group's
/// worker thread, one operation at a time, in issue order; each first
/// agrees with the other ranks on `desc` (a mismatch fails every rank).
pub(crate) trait Transport: Send + Sync + 'static {
    /// Who this rank is in which group.
    fn member(&self) -> &Member;
    /// Ranks in the group.
    fn n(&self) -> usize;
    /// Whether group rank `r` left or died.
    fn peer_gone(&self, r: usize) -> bool;
    /// Leaves the group: every peer's pending and later collectives see
    /// this rank as gone ([`Transport::peer_gone`]). Called when the group
    /// is dropped, and when a collective failed part-way on this rank.
    fn leave(&self);

    /// The group's name.
    fn name(&self) -> &str {
        &self.member().name
    }
    /// This rank's index in the group.
    fn me(&self) -> usize {
        self.member().me
    }
    /// The members' world ranks, in group order.
    fn world_ranks(&self) -> &[usize] {
        &self.member().world_ranks
    }
    /// The timeout of every wait.
    fn timeout(&self) -> Duration {
        self.member().timeout
    }
    /// The store-side view of the group, for `send`/`recv`.
    fn peers(&self) -> Peers<'_> {
        let m = self.member();
        Peers {
            store: &m.store,
            group: &m.name,
            world_ranks: &m.world_ranks,
            me: m.me,
        }
    }

    /// Agrees on `desc` with every rank: the barrier.
    fn barrier(&self, desc: &OpDesc) -> Result<(), CommError>;
    /// Reduces `buf` over the group, leaving the result in every rank's `buf`.
    fn all_reduce<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Reduces `input` over the group; this rank's part goes to `out`
    /// (resized to it, reusing its allocation).
    fn reduce_scatter<T: Element>(
        &self,
        desc: &OpDesc,
        input: &mut [T],
        out: &mut Vec<T>,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Concatenates every rank's `input` into `out` (resized to the sum).
    fn all_gather<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError>;
    /// Sends chunk `p` ([`chunk_range`](crate::chunk_range)) of `input` to
    /// rank `p`; `out` (resized) receives every rank's chunk of this rank,
    /// in rank order.
    fn all_to_all<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError>;
    /// Copies `root`'s `buf` into every rank's.
    fn broadcast<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        root: usize,
    ) -> Result<(), CommError>;
}

/// What every process backend knows of its group and of this rank in it.
pub(crate) struct Member {
    /// The group's name (unique within the job).
    pub(crate) name: String,
    /// This rank's index in the group.
    pub(crate) me: usize,
    /// The members' world ranks, in group order.
    pub(crate) world_ranks: Vec<usize>,
    /// The timeout of every wait.
    pub(crate) timeout: Duration,
    /// The job's rendezvous store (`send`/`recv` go through it).
    pub(crate) store: Arc<StoreClient>,
    /// Messages received ahead of their `recv`.
    pub(crate) mailbox: Mailbox,
}

impl Member {
    /// Checks the calls every rank made at position `seq` (`None`: one that
    /// could not be read, e.g. a rank still at an older position) and returns
    /// them, or the error naming rank 0's call and the first rank whose call
    /// differs — never a collective run on mismatched sizes or dtypes.
    pub(crate) fn agreed_calls(
        &self,
        seq: u64,
        calls: Vec<Option<OpDesc>>,
    ) -> Result<Vec<OpDesc>, CommError> {
        let first = calls[0];
        if let Some(b) = (1..calls.len()).find(|&r| match (first, calls[r]) {
            (Some(a), Some(d)) => !a.compatible(&d),
            _ => true,
        }) {
            let show = |d: Option<OpDesc>| {
                d.map_or_else(|| "an unknown call".to_string(), |d| d.to_string())
            };
            return Err(CommError::Mismatch {
                group: self.name.clone(),
                seq,
                rank_a: self.world_ranks[0],
                call_a: show(first),
                rank_b: self.world_ranks[b],
                call_b: show(calls[b]),
            });
        }
        Ok(calls.into_iter().flatten().collect())
    }
}

/// A process backend's [`ProcessGroup`](crate::ProcessGroup) half: the
/// transport and the worker its operations run on.
pub(crate) struct Front<X> {
    pub(crate) inner: Arc<X>,
    pub(crate) worker: Worker,
    failed: FirstFailure,
}

/// The first collective that failed on a rank's handle of a group: once
/// set, the rank has left the group and runs nothing more on it (every
/// backend's rule; see [`Front::run`]). Clones share it.
#[derive(Clone, Default)]
pub(crate) struct FirstFailure(Arc<OnceLock<CommError>>);

impl FirstFailure {
    /// [`CommError::Failed`] for `desc` once a collective on `group` failed.
    pub(crate) fn check(&self, group: &str, desc: &OpDesc) -> Result<(), CommError> {
        match self.0.get() {
            Some(cause) => Err(CommError::Failed {
                group: group.to_string(),
                call: desc.to_string(),
                cause: Box::new(cause.clone()),
            }),
            None => Ok(()),
        }
    }

    /// Records `e` if it is the group's first failure, and then runs
    /// `leave` (this rank leaves the group).
    pub(crate) fn record(&self, group: &str, e: &CommError, leave: impl FnOnce()) {
        if self.0.set(e.clone()).is_ok() {
            tracing::debug!(group, "leaving the group after: {e}");
            leave();
        }
    }
}

fn desc<T: Element>(kind: OpKind, len: usize) -> OpDesc {
    OpDesc::new(kind, Some(T::DTYPE), len)
}

impl<X: Transport> Front<X> {
    /// The front of `inner`, whose operations run on `worker` (started with
    /// `inner.leave()` as what it does on exit).
    pub(crate) fn new(inner: Arc<X>, worker: Worker) -> Self {
        Self {
            inner,
            worker,
            failed: FirstFailure::default(),
        }
    }

    /// Runs `f` on the worker; it returns the result and the bytes it sent
    /// and received (for [`Stats`]).
    ///
    /// A collective that fails part-way (a timeout, a dead peer, a
    /// mismatch, bad arguments found after the ranks agreed) leaves the
    /// ranks at different points of the group's protocol. Going on would
    /// let this rank's next call satisfy a barrier its peers are still
    /// waiting at in the failed one, and they would read slots it never
    /// filled. So the first failure makes this rank leave the group (its
    /// peers then fail within the liveness period, naming it) and every
    /// later call fails with [`CommError::Failed`]. A panic in `f` (a bug)
    /// is such a failure too ([`CommError::Panicked`]). `send`/`recv` go
    /// through the store, not the group's protocol, and do not count; nor
    /// does a failed shared-memory allocation, which every rank learns
    /// together.
    pub(crate) fn run<R: Send + 'static>(
        &self,
        desc: OpDesc,
        f: impl FnOnce(&X) -> Result<(R, usize, usize), CommError> + Send + 'static,
    ) -> Work<R> {
        let inner = self.inner.clone();
        let failed = self.failed.clone();
        let counts = !matches!(desc.kind, OpKind::Send { .. } | OpKind::Recv { .. });
        self.worker.submit(desc, move || {
            failed.check(inner.name(), &desc)?;
            let r = contain(inner.name(), &desc, || f(&inner));
            if let Err(e) = &r {
                if counts && !matches!(e, CommError::SharedMemory { .. }) {
                    failed.record(inner.name(), e, || inner.leave());
                }
            }
            r
        })
    }

    pub(crate) fn name(&self) -> &str {
        self.inner.name()
    }
    pub(crate) fn rank(&self) -> usize {
        self.inner.me()
    }
    pub(crate) fn size(&self) -> usize {
        self.inner.n()
    }
    pub(crate) fn world_ranks(&self) -> &[usize] {
        self.inner.world_ranks()
    }
    pub(crate) fn stats(&self) -> &Stats {
        self.worker.stats()
    }

    /// Finishes what was issued and leaves the group (peers learn it);
    /// later operations fail with [`CommError::Closed`]. [`Self::peers_gone`]
    /// still answers.
    pub(crate) fn close(&mut self) {
        self.worker.close();
    }

    /// Whether every other member has left the group or died.
    pub(crate) fn peers_gone(&self) -> bool {
        let i = &self.inner;
        (0..i.n()).filter(|&r| r != i.me()).all(|r| i.peer_gone(r))
    }

    pub(crate) fn all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let d = desc::<T>(OpKind::AllReduce(op), buf.len());
        self.run(d, move |g| {
            g.all_reduce(&d, &mut buf, op)?;
            let b = bytes_of::<T>(buf.len());
            Ok((buf, b, b))
        })
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &self,
        mut input: Vec<T>,
        mut out: Vec<T>,
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let d = desc::<T>(OpKind::ReduceScatter(op), input.len());
        self.run(d, move |g| {
            g.reduce_scatter(&d, &mut input, &mut out, op)?;
            let (s, r) = (bytes_of::<T>(input.len()), bytes_of::<T>(out.len()));
            Ok(((input, out), s, r))
        })
    }

    /// `all_gather` (`kind` [`OpKind::AllGather`]) or `all_gather_v`
    /// ([`OpKind::AllGatherV`]): the same data movement, agreed on
    /// differently.
    pub(crate) fn all_gather<T: Element>(
        &self,
        kind: OpKind,
        input: Vec<T>,
        out: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        self.gather(desc::<T>(kind, input.len()), input, out)
    }

    /// Every gather (`d` says which): the transport concatenates the
    /// ranks' `input`s into `out`. Returns `(input, out)`.
    fn gather<T: Element>(
        &self,
        d: OpDesc,
        input: Vec<T>,
        mut out: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        self.run(d, move |g| {
            g.all_gather(&d, &input, &mut out)?;
            let (s, r) = (bytes_of::<T>(input.len()), bytes_of::<T>(out.len()));
            Ok(((input, out), s, r))
        })
    }

    pub(crate) fn all_to_all<T: Element>(
        &self,
        input: Vec<T>,
        mut out: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let d = desc::<T>(OpKind::AllToAll, input.len());
        self.run(d, move |g| {
            g.all_to_all(&d, &input, &mut out)?;
            let (s, r) = (bytes_of::<T>(input.len()), bytes_of::<T>(out.len()));
            Ok(((input, out), s, r))
        })
    }

    pub(crate) fn broadcast<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        let d = desc::<T>(OpKind::Broadcast { root }, buf.len());
        if root >= self.size() {
            let why = format!("root {root} is not a rank of this group of {}", self.size());
            return self.worker.fail(&d, invalid(self.name(), &d, why));
        }
        self.run(d, move |g| {
            g.broadcast(&d, &mut buf, root)?;
            let b = bytes_of::<T>(buf.len());
            Ok((buf, b, b))
        })
    }

    pub(crate) fn barrier(&self) -> Work<()> {
        let d = OpDesc::new(OpKind::Barrier, None, 0);
        self.run(d, move |g| {
            g.barrier(&d)?;
            Ok(((), 0, 0))
        })
    }

    /// `send`/`recv` go through the rendezvous store: they are rare in ZeRO
    /// (correctness over speed).
    pub(crate) fn send<T: Element>(&self, buf: Vec<T>, to: usize) -> Work<()> {
        let d = desc::<T>(OpKind::Send { to }, buf.len());
        if let Some(e) = check_peer(self.name(), &d, to, self.rank(), self.size()) {
            return self.worker.fail(&d, e);
        }
        self.run(d, move |g| {
            g.member().mailbox.send(&g.peers(), to, &d, &buf)?;
            Ok(((), bytes_of::<T>(buf.len()), 0))
        })
    }

    pub(crate) fn recv<T: Element>(&self, len: usize, from: usize) -> Work<Vec<T>> {
        let d = desc::<T>(OpKind::Recv { from }, len);
        if let Some(e) = check_peer(self.name(), &d, from, self.rank(), self.size()) {
            return self.worker.fail(&d, e);
        }
        self.run(d, move |g| {
            let gone = || g.peer_gone(from);
            let v = g
                .member()
                .mailbox
                .recv::<T>(&g.peers(), from, &d, g.timeout(), gone)?;
            let b = bytes_of::<T>(v.len());
            Ok((v, 0, b))
        })
    }
}

/// Implements [`ProcessGroup`](crate::ProcessGroup) for a backend struct
/// with a `front: Front<_>` field by forwarding every call to it; the
/// backend adds `all_gather_in_place` and any op it does better than the
/// trait's default (`$extra`).
macro_rules! forward_process_group {
    ($ty:ty { $($extra:tt)* }) => {
        impl $crate::ProcessGroup for $ty {
            fn name(&self) -> &str {
                self.front.name()
            }
            fn rank(&self) -> usize {
                self.front.rank()
            }
            fn size(&self) -> usize {
                self.front.size()
            }
            fn world_ranks(&self) -> &[usize] {
                self.front.world_ranks()
            }
            fn stats(&self) -> &$crate::Stats {
                self.front.stats()
            }
            fn all_reduce<T: $crate::Element>(
                &self,
                buf: Vec<T>,
                op: $crate::ReduceOp,
            ) -> $crate::Work<Vec<T>> {
                self.front.all_reduce(buf, op)
            }
            fn reduce_scatter<T: $crate::Element>(
                &self,
                input: Vec<T>,
                out: Vec<T>,
                op: $crate::ReduceOp,
            ) -> $crate::Work<(Vec<T>, Vec<T>)> {
                self.front.reduce_scatter(input, out, op)
            }
            fn all_gather<T: $crate::Element>(
                &self,
                input: Vec<T>,
                out: Vec<T>,
            ) -> $crate::Work<(Vec<T>, Vec<T>)> {
                self.front.all_gather($crate::OpKind::AllGather, input, out)
            }
            fn all_gather_v<T: $crate::Element>(
                &self,
                input: Vec<T>,
                out: Vec<T>,
            ) -> $crate::Work<(Vec<T>, Vec<T>)> {
                self.front.all_gather($crate::OpKind::AllGatherV, input, out)
            }
            fn all_to_all<T: $crate::Element>(
                &self,
                input: Vec<T>,
                out: Vec<T>,
            ) -> $crate::Work<(Vec<T>, Vec<T>)> {
                self.front.all_to_all(input, out)
            }
            fn broadcast<T: $crate::Element>(&self, buf: Vec<T>, root: usize) -> $crate::Work<Vec<T>> {
                self.front.broadcast(buf, root)
            }
            fn barrier(&self) -> $crate::Work<()> {
                self.front.barrier()
            }
            fn send<T: $crate::Element>(&self, buf: Vec<T>, to: usize) -> $crate::Work<()> {
                self.front.send(buf, to)
            }
            fn recv<T: $crate::Element>(&self, len: usize, from: usize) -> $crate::Work<Vec<T>> {
                self.front.recv(len, from)
            }
            $($extra)*
        }
    };
}
pub(crate) use forward_process_group;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreServer;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A one-rank transport whose all_reduce panics (standing in for a bug
    /// in a backend) and that counts how often it left.
    struct Panicky {
        m: Member,
        left: AtomicUsize,
    }

    impl Transport for Panicky {
        fn member(&self) -> &Member {
            &self.m
        }
        fn n(&self) -> usize {
            2
        }
        fn peer_gone(&self, _: usize) -> bool {
            false
        }
        fn leave(&self) {
            self.left.fetch_add(1, Ordering::SeqCst);
        }
        fn barrier(&self, _: &OpDesc) -> Result<(), CommError> {
            Ok(())
        }
        fn all_reduce<T: Element>(
            &self,
            _: &OpDesc,
            _: &mut [T],
            _: ReduceOp,
        ) -> Result<(), CommError> {
            panic!("index out of bounds in the reduction")
        }
        fn reduce_scatter<T: Element>(
            &self,
            _: &OpDesc,
            _: &mut [T],
            _: &mut Vec<T>,
            _: ReduceOp,
        ) -> Result<(), CommError> {
            Ok(())
        }
        fn all_gather<T: Element>(
            &self,
            _: &OpDesc,
            _: &[T],
            _: &mut Vec<T>,
        ) -> Result<(), CommError> {
            Ok(())
        }
        fn all_to_all<T: Element>(
            &self,
            _: &OpDesc,
            _: &[T],
            _: &mut Vec<T>,
        ) -> Result<(), CommError> {
            Ok(())
        }
        fn broadcast<T: Element>(
            &self,
            _: &OpDesc,
            _: &mut [T],
            _: usize,
        ) -> Result<(), CommError> {
            Ok(())
        }
    }

    #[test]
    fn a_collective_that_panics_fails_and_leaves_the_group() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let store = StoreClient::connect(&srv.addr().to_string(), "tok", Duration::from_secs(5));
        let inner = Arc::new(Panicky {
            m: Member {
                name: "g".into(),
                me: 0,
                world_ranks: vec![0, 1],
                timeout: Duration::from_secs(5),
                store: Arc::new(store.unwrap()),
                mailbox: Mailbox::default(),
            },
            left: AtomicUsize::new(0),
        });
        let i2 = inner.clone();
        let worker = Worker::start("g", 0, move || i2.leave()).unwrap();
        let mut front = Front::new(inner.clone(), worker);
        assert!(front.barrier().wait().is_ok());
        // On the worker (a short wait leaves it there) and on a waiter.
        let on_worker = front.all_reduce(vec![1.0f32], ReduceOp::Sum);
        let e = on_worker.wait_timeout(Duration::from_secs(10)).unwrap_err();
        assert!(
            matches!(&e, CommError::Panicked { group, why, .. }
                if group == "g" && why == "index out of bounds in the reduction"),
            "{e:?}"
        );
        assert!(e.to_string().contains("this is a bug in zrt"), "{e}");
        assert_eq!(
            inner.left.load(Ordering::SeqCst),
            1,
            "did not leave the group"
        );
        // Later calls are refused, quoting the panic; the worker lives on.
        let later = front.barrier().wait().unwrap_err();
        assert!(
            matches!(&later, CommError::Failed { cause, .. } if **cause == e),
            "{later:?}"
        );
        front.close();
        assert_eq!(
            inner.left.load(Ordering::SeqCst),
            2,
            "the exit hook did not run"
        );
    }
}

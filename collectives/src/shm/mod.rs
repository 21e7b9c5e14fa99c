//! The shared-memory backend: ranks are processes on one host, the default
//! CPU backend.
//!
//! A group maps one segment (`/dev/shm`, unlinked as soon as every member has
//! mapped it, so a crash leaves nothing behind):
//!
//! ```text
//! header | control block per rank (arrive counter, left flag, call slots) | staging ring per rank | result ring
//! ```
//!
//! Every operation first publishes this rank's call description and passes a
//! barrier; then all ranks compare descriptions (a mismatch fails everyone
//! before any data moves). Data moves in windows cut from a staging slot
//! (`ZRT_SHM_SLOT_BYTES`), round after round; each round's buffer is the
//! next one along a rank's ring of several slots, so a rank writes a line
//! again only after the peers that read it have read a few of their core's
//! caches' worth since (`ring_laps` sizes the ring).
//! Reductions are split across ranks: for each window, rank r reduces only
//! part r, reading every rank's slot, so the work and the memory traffic are
//! divided by the group size and no byte round-trips through the kernel.
//!
//! Symmetric buffers ([`SymmetricBuf`]) skip the staging: each rank's
//! buffer is a file of its own in `/dev/shm` that every rank maps when it
//! is allocated (then unlinked, like the segment), so the symmetric
//! reduce-scatter reduces its part reading every rank's buffer where it is
//! and the symmetric all-gather copies the peers' parts straight out of
//! theirs. A barrier closes each, so no rank touches its buffer while a
//! peer still reads it. A rank that dies between creating its file and the
//! end of the allocation leaves that file behind (named after the job).
//!
//! Waiting spins briefly, then sleeps on a futex over the late rank's
//! arrive word, which that rank wakes when it arrives (yielding in a loop
//! instead left a waiting rank behind a busy compute thread for a scheduler
//! tick). At least every 50 ms a waiting rank checks the ranks it waits for:
//! one that left (its handle dropped) or whose process is gone fails the
//! call with [`CommError::RankDied`] naming it, and the deadline fails it
//! with [`CommError::Timeout`]. Large all_gather outputs are written with
//! streaming stores (`stream`). `send`/`recv` go through the rendezvous
//! store (they are rare in ZeRO; correctness over speed).

use std::fs::OpenOptions;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::dtype::bytes_of;
use crate::front::{forward_process_group, Front, Member, Transport};
use crate::p2p::Mailbox;
use crate::slot_stores::Chooser;
pub use crate::slot_stores::SlotStores;
use crate::store::StoreClient;
use crate::stream::copy_to_slot;
use crate::worker::Worker;
use crate::{chunk_range, CommError, Element, OpDesc, OpKind, ReduceOp, SymmetricBuf, Work};

mod ring;
mod segment;
mod staged;
mod symmetric;
#[cfg(test)]
mod tests;
mod wait;

pub(crate) use ring::slot_bytes_from_env;
pub use ring::DEFAULT_SLOT_BYTES;

use ring::{ring_laps, slot_bytes_for};
use segment::{reserve, Segment, Unlink, MAGIC, W_ARRIVE, W_LEFT};
use wait::{futex, process_gone};

struct State {
    /// Where along the rings the next operation's first buffer goes (a
    /// byte offset; the same on every rank, which all claim the same
    /// rounds in the same order).
    ring_at: usize,
    seq: u64,
    epoch: u64,
    /// Symmetric buffers allocated so far (the next one's number).
    allocs: u32,
    /// After a mismatch the ranks are out of step: every later call fails too.
    poisoned: Option<CommError>,
    /// Plain or streaming stores into this rank's slots.
    stores: Chooser,
}

struct Inner {
    seg: Segment,
    m: Member,
    pids: Vec<u32>,
    state: Mutex<State>,
    /// Process-unique: which group a symmetric buffer came from.
    serial: u64,
    /// The segment's path; symmetric buffers' files add a suffix to it.
    path: String,
}

/// Serials of the groups this process has joined.
static SERIALS: AtomicU64 = AtomicU64::new(1);

// SAFETY: the mapping is shared memory; all cross-rank access goes through
// atomics or through ranges the barrier protocol hands to one writer.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// Where `reduce` leaves its result.
enum Dest<'a, T> {
    /// all_reduce: the whole result back into the buffer.
    All,
    /// reduce_scatter: this rank's part into this vector.
    Part(&'a mut Vec<T>),
    /// reduce_scatter in place: this rank's part over its own input.
    InPlace,
}

/// One rank's handle on a shared-memory group.
pub struct ShmGroup {
    front: Front<Inner>,
}

/// What a rank needs to join a shared-memory group.
pub struct ShmJoin<'a> {
    /// The job's store.
    pub store: Arc<StoreClient>,
    /// Unique per job (names the segment file).
    pub job: &'a str,
    /// The group's name (unique within the job).
    pub name: &'a str,
    /// The members' world ranks, in group order.
    pub world_ranks: Vec<usize>,
    /// This rank's world rank.
    pub world_rank: usize,
    /// Staging bytes per rank.
    pub slot_bytes: usize,
    /// How this rank writes its slots (`ZRT_SHM_SLOT_STORES`).
    pub slot_stores: SlotStores,
    /// Timeout of every wait.
    pub timeout: Duration,
}

impl ShmGroup {
    /// Creates (group rank 0) or maps (the others) the group's segment.
    /// Every member must call it.
    pub fn join(j: ShmJoin<'_>) -> Result<Self, CommError> {
        let n = j.world_ranks.len();
        let me = j
            .world_ranks
            .iter()
            .position(|&r| r == j.world_rank)
            .ok_or_else(|| CommError::Invalid {
                group: j.name.to_string(),
                call: "join".into(),
                why: format!(
                    "rank {} is not a member of {:?}",
                    j.world_rank, j.world_ranks
                ),
            })?;
        let own_slot = slot_bytes_for(j.slot_bytes, n);
        let safe: String = j
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = std::path::PathBuf::from(format!("/dev/shm/zrt-{}-{safe}", j.job));
        let key = |k: &str| format!("shm/{}/{k}", j.name);
        // A wait for a peer's step of the join, whose failure names the
        // peer and the group rather than a store key.
        let await_rank = |r: usize, step: &str, k: &str| {
            crate::store::await_rank(&j.store, &key(k), j.world_ranks[r], j.timeout, || {
                format!("{step} shared-memory group `{}`", j.name)
            })
        };
        let io = |what: &str, e: std::io::Error| {
            CommError::Rendezvous(format!("{what} {}: {e}", path.display()))
        };
        let (file, slot, laps, unlink) = if me == 0 {
            let slot = own_slot;
            let laps = ring_laps(slot, n, crate::caches::core_cache_bytes());
            let _ = std::fs::remove_file(&path);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| io("creating", e))?;
            // From here the name goes however join ends: a failure below
            // (a rank that never maps it, a timeout) must not leave the
            // segment in /dev/shm, holding its memory until reboot.
            // Every rank holds such a guard once the file exists, so that
            // a rank 0 killed before everyone mapped it (nothing runs in a
            // killed process) does not leave it either.
            let unlink = Unlink(path.display().to_string());
            // Its pages reserved now: a sparse file on a /dev/shm too
            // small for it (Docker gives containers 64 MiB) joined fine and
            // killed the ranks with SIGBUS at their first collective.
            let bytes = Segment::bytes(n, slot, laps);
            reserve(&f, bytes).map_err(|e| {
                CommError::Rendezvous(format!(
                    "reserving {bytes} bytes of shared memory for {}: {e}; /dev/shm is full \
                     or smaller than the job needs (see `df -h /dev/shm`; Docker gives a \
                     container 64 MiB unless run with --shm-size): free space there, or use \
                     ZRT_BACKEND=tcp",
                    path.display()
                ))
            })?;
            // The layout is rank 0's: a rank started with another
            // ZRT_SHM_SLOT_BYTES, or on a core with another cache, must
            // not index the segment differently.
            let layout = [slot as u64, laps as u64].map(u64::to_le_bytes).concat();
            j.store.set(&key("created"), &layout)?;
            (f, slot, laps, unlink)
        } else {
            let b = await_rank(0, "create", "created")?;
            let word = |i: usize| {
                b.get(i * 8..i * 8 + 8)
                    .and_then(|w| <[u8; 8]>::try_from(w).ok())
                    .map(|w| u64::from_le_bytes(w) as usize)
            };
            let (slot, laps) = match (b.len(), word(0), word(1)) {
                (16, Some(slot), Some(laps)) => (slot, laps),
                _ => return Err(CommError::Rendezvous("malformed segment layout".into())),
            };
            if slot != own_slot {
                tracing::warn!(
                    group = j.name,
                    rank0 = slot,
                    here = own_slot,
                    "ZRT_SHM_SLOT_BYTES differs from rank 0's: using rank 0's staging slots"
                );
            }
            let unlink = Unlink(path.display().to_string());
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| io("opening", e))?;
            (f, slot, laps, unlink)
        };
        // SAFETY: the file is this job's, sized above, and only accessed
        // through `Segment`'s atomics and protocol-owned ranges.
        let map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&file) }
            .map_err(|e| io("mapping", e))?;
        if map.len() < Segment::bytes(n, slot, laps) {
            return Err(CommError::Rendezvous(format!(
                "{} holds {} bytes, the group's layout needs {}",
                path.display(),
                map.len(),
                Segment::bytes(n, slot, laps)
            )));
        }
        let seg = Segment { map, n, slot, laps };
        if me == 0 {
            // SAFETY: header words, written before anyone is told "ready".
            unsafe { (seg.base() as *mut u64).write(MAGIC) };
        }
        // Publish this process's pid for liveness checks, then read every
        // rank's: a rank publishes only once it has mapped the segment (and
        // rank 0 once it wrote the header), so having all pids is the
        // barrier that lets the name go and the header be read.
        j.store.set(
            &key(&format!("pid/{me}")),
            &std::process::id().to_le_bytes(),
        )?;
        let mut pids = Vec::with_capacity(n);
        for r in 0..n {
            let b = await_rank(r, "join", &format!("pid/{r}"))?;
            pids.push(u32::from_le_bytes(
                b.as_slice()
                    .try_into()
                    .map_err(|_| CommError::Rendezvous("malformed pid".into()))?,
            ));
        }
        // Everyone has mapped it: the name can go, the memory stays.
        drop(unlink);
        // SAFETY: header word written by rank 0 before it published its pid.
        if unsafe { (seg.base() as *const u64).read() } != MAGIC {
            return Err(CommError::Rendezvous(format!(
                "{} is not a zrt segment",
                path.display()
            )));
        }
        let inner = Arc::new(Inner {
            seg,
            m: Member {
                name: j.name.to_string(),
                me,
                world_ranks: j.world_ranks,
                timeout: j.timeout,
                store: j.store,
                mailbox: Mailbox::default(),
            },
            pids,
            state: Mutex::new(State {
                ring_at: 0,
                seq: 0,
                epoch: 0,
                allocs: 0,
                poisoned: None,
                stores: Chooser::new(j.slot_stores),
            }),
            serial: SERIALS.fetch_add(1, Ordering::Relaxed),
            path: path.display().to_string(),
        });
        let i2 = inner.clone();
        let worker = Worker::start(j.name, me, move || i2.leave())?;
        Ok(Self {
            front: Front::new(inner, worker),
        })
    }

    /// Whether every other member has left the group or died.
    pub fn peers_gone(&self) -> bool {
        self.front.peers_gone()
    }

    /// Finishes what was issued and leaves the group, as dropping it does,
    /// but keeps it to ask [`Self::peers_gone`]; later operations fail with
    /// [`CommError::Closed`].
    pub fn close(&mut self) {
        self.front.close();
    }
}

impl Transport for Inner {
    fn member(&self) -> &Member {
        &self.m
    }
    fn n(&self) -> usize {
        self.seg.n
    }
    fn peer_gone(&self, r: usize) -> bool {
        self.seg.word(r, W_LEFT).load(Ordering::Acquire) != 0 || process_gone(self.pids[r])
    }
    fn leave(&self) {
        self.seg.word(self.m.me, W_LEFT).store(1, Ordering::Release);
        // Peers asleep on this rank's arrival look again at once.
        futex::wake_all(self.seg.word(self.m.me, W_ARRIVE));
    }

    /// Agrees on the call, then passes a second barrier: a rank that
    /// reached the barrier and then gave up on it (timed out, and left)
    /// has arrived at the first but never arrives at the second, so a
    /// late rank fails naming it instead of passing (as a late rank's
    /// gather fails: it needs the peer's data).
    fn barrier(&self, desc: &OpDesc) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        self.pass_barrier(&mut st, desc, deadline)
    }
    fn all_reduce<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce(desc, buf, Dest::All, op)
    }
    fn reduce_scatter<T: Element>(
        &self,
        desc: &OpDesc,
        input: &mut [T],
        out: &mut Vec<T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce(desc, input, Dest::Part(out), op)
    }
    fn all_gather<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        self.gather(desc, Some(input), out)
    }
    fn all_to_all<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        self.exchange_chunks(desc, input, out)
    }
    fn broadcast<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let w = self.window::<T>(1, 2);
        let rounds = buf.len().div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, 2);
        // The root writes with the stores the group's other operations
        // chose (`slot_stores`); a broadcast teaches nothing, as no rank
        // both writes and reads in it.
        let nt = st.stores.streaming(rounds);
        for j in 0..rounds {
            let h = ring.at(j);
            let r = j * w..((j + 1) * w).min(buf.len());
            if self.m.me == root {
                // SAFETY: the root alone writes its ring between barriers
                // (at least two buffers along it, as in `gather`).
                copy_to_slot(
                    unsafe { self.seg.slot::<T>(root, h, r.len()) },
                    &buf[r.clone()],
                    nt,
                );
            }
            self.pass_barrier(&mut st, desc, deadline)?;
            if self.m.me != root {
                buf[r.clone()].copy_from_slice(unsafe { self.seg.slot::<T>(root, h, r.len()) });
            }
        }
        Ok(())
    }
}

forward_process_group!(ShmGroup {
    fn reduce_scatter_in_place<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let desc = OpDesc::new(OpKind::ReduceScatter(op), Some(T::DTYPE), buf.len());
        let n = self.front.size();
        self.front.run(desc, move |g| {
            g.reduce(&desc, &mut buf, Dest::InPlace, op)?;
            let s = bytes_of::<T>(buf.len());
            Ok((buf, s, s / n.max(1)))
        })
    }

    fn alloc_symmetric<T: Element>(&self, len: usize) -> Work<SymmetricBuf<T>> {
        let desc = OpDesc::new(OpKind::AllocSymmetric, Some(T::DTYPE), len);
        self.front.run(desc, move |g| Ok((g.alloc::<T>(len)?, 0, 0)))
    }

    fn reduce_scatter_symmetric<T: Element>(
        &self,
        buf: SymmetricBuf<T>,
        op: ReduceOp,
    ) -> Work<SymmetricBuf<T>> {
        let mut desc = OpDesc::new(OpKind::ReduceScatter(op), Some(T::DTYPE), buf.len());
        desc.buffer = self.front.inner.own_buffer(&buf).map(|s| s.id);
        let n = self.front.size();
        self.front.run(desc, move |g| {
            g.symmetric(&desc, &buf, |sh| g.reduce_symmetric::<T>(sh, buf.len(), op))?;
            let s = bytes_of::<T>(buf.len());
            Ok((buf, s, s / n.max(1)))
        })
    }

    fn all_gather_symmetric<T: Element>(&self, buf: SymmetricBuf<T>) -> Work<SymmetricBuf<T>> {
        let own = chunk_range(buf.len(), self.front.size(), self.front.rank());
        let mut desc = OpDesc::new(OpKind::AllGatherInPlace, Some(T::DTYPE), buf.len());
        desc.buffer = self.front.inner.own_buffer(&buf).map(|s| s.id);
        self.front.run(desc, move |g| {
            g.symmetric(&desc, &buf, |sh| g.gather_symmetric::<T>(sh, buf.len()))?;
            let (s, r) = (bytes_of::<T>(own.len()), bytes_of::<T>(buf.len()));
            Ok((buf, s, r))
        })
    }

    fn all_gather_in_place<T: Element>(&self, mut buf: Vec<T>) -> Work<Vec<T>> {
        let own = chunk_range(buf.len(), self.front.size(), self.front.rank());
        let desc = OpDesc::new(OpKind::AllGatherInPlace, Some(T::DTYPE), buf.len());
        self.front.run(desc, move |g| {
            g.gather(&desc, None, &mut buf)?;
            let (s, r) = (bytes_of::<T>(own.len()), bytes_of::<T>(buf.len()));
            Ok((buf, s, r))
        })
    }
});

//! The TCP backend: ranks are processes on any hosts.
//!
//! Every pair of ranks has one connection (a full mesh, made at group
//! creation through the rendezvous store; each connection presents the job's
//! token, as the store does). Collectives are *direct*: for reduce_scatter
//! every rank sends each peer that peer's part and reduces the parts it
//! receives in rank order; all_reduce is that plus an all_gather (or, when
//! small, whole buffers to every peer: [`WHOLE_ALL_REDUCE_BYTES`]). Per rank
//! this moves the same bytes as a ring, and it buys two things: the
//! reduction is the same rank-ordered f64 sum as the other backends (so all
//! backends agree to the bit), and a dead rank is named exactly (its own
//! connection closes). The connections are nonblocking: the worker
//! thread moves whatever each takes or has and sleeps in `poll` when none
//! can move, so concurrent sends never block each other and no thread is
//! started per call. `send`/`recv` go through the store, as in shm.
//!
//! Reductions run a window at a time ([`DEFAULT_WINDOW_BYTES`] per peer):
//! what the peers send is received into scratch the group keeps, and the
//! window is reduced before the next is exchanged. No buffer is allocated
//! per call: the in-place ops reduce over, and gather into, the caller's
//! buffer, and all_gather and broadcast send from where the data lies.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::dtype::{as_bytes, as_bytes_mut, bytes_of};
use crate::front::{forward_process_group, Front, Member, Transport};
use crate::op::gather_ranges;
use crate::p2p::Mailbox;
use crate::store::{same_token, StoreClient, MAX_TOKEN_LEN};
use crate::worker::Worker;
use crate::{chunk_range, CommError, Element, OpDesc, OpKind, ReduceOp, Work};

/// An all_reduce is done in one exchange of data when a rank sends at most
/// this many bytes that way (its buffer to each of `n - 1` peers): each
/// rank sends its whole buffer to every peer and reduces all of it,
/// rather than reduce-scattering and then all-gathering the parts. It
/// moves `n - 1` buffers per rank instead of `2 (n - 1) / n` (the same on
/// 2 ranks) and saves a round trip: most of what a loss or a gradient
/// norm costs. (Medians on 2 ranks, loopback: docs/collectives-bench.md.)
pub const WHOLE_ALL_REDUCE_BYTES: usize = 64 << 10;

/// What a rank needs to join a TCP group.
pub struct TcpJoin<'a> {
    /// The job's store.
    pub store: Arc<StoreClient>,
    /// The job's token (connections present it).
    pub token: &'a str,
    /// The group's name (unique within the job).
    pub name: &'a str,
    /// The members' world ranks, in group order.
    pub world_ranks: Vec<usize>,
    /// This rank's world rank.
    pub world_rank: usize,
    /// Timeout of every wait.
    pub timeout: Duration,
    /// Bytes per peer of one window of this rank's reductions
    /// ([`DEFAULT_WINDOW_BYTES`]; `ZRT_TCP_WINDOW_BYTES` through
    /// [`init_from_env`](crate::init_from_env); at least 4096). Ranks may
    /// differ: a window only says how much this rank sends and receives
    /// before it reduces, not what crosses a connection (each peer's part,
    /// in order, either way).
    pub window_bytes: usize,
}

/// Bytes per peer of one window of a reduction (reduce_scatter, all_reduce)
/// unless `ZRT_TCP_WINDOW_BYTES` says otherwise. A rank's scratch is at
/// most one window per rank of the group, reused by every operation; buffers as
/// large as the part, allocated per call, made all_reduce 2x slower than
/// reduce_scatter and all_gather in turn (page faults).
pub const DEFAULT_WINDOW_BYTES: usize = 4 << 20;

/// The smallest window `ZRT_TCP_WINDOW_BYTES` may ask for.
const MIN_WINDOW_BYTES: usize = 4096;

/// `ZRT_TCP_WINDOW_BYTES`, checked.
pub(crate) fn window_bytes_from_env() -> Result<usize, String> {
    crate::env_bytes::from_env(
        "ZRT_TCP_WINDOW_BYTES",
        DEFAULT_WINDOW_BYTES,
        MIN_WINDOW_BYTES,
    )
}

struct Inner {
    m: Member,
    /// Connection to each peer (None for this rank).
    peers: Vec<Option<Peer>>,
    state: Mutex<State>,
    /// Bytes per peer of a reduction's window.
    window: usize,
    /// Set once this rank has left the group.
    left: AtomicBool,
}

/// One connection (nonblocking), with separate handles per direction:
/// looking whether a peer is gone takes the reading one only.
struct Peer {
    r: Mutex<TcpStream>,
    w: Mutex<TcpStream>,
}

struct State {
    seq: u64,
    poisoned: Option<CommError>,
    /// The reductions' windows ([`scratch`]): u64 words, so that every
    /// element type is aligned in them.
    scratch: Vec<u64>,
}

impl Inner {
    fn died(&self, peer: usize, call: &OpDesc) -> CommError {
        CommError::RankDied {
            group: self.m.name.clone(),
            rank: self.m.world_ranks[peer],
            call: call.to_string(),
        }
    }

    fn io_err(&self, peer: usize, call: &OpDesc, e: &std::io::Error) -> CommError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CommError::Timeout {
                group: self.m.name.clone(),
                call: call.to_string(),
                timeout: self.m.timeout,
                waiting_for: vec![self.m.world_ranks[peer]],
            },
            _ => self.died(peer, call),
        }
    }

    /// Sends `out[p]` to every peer p and receives `into[p]` (exactly its
    /// length) from every peer, concurrently: one thread moves whatever
    /// each nonblocking connection takes or has, and sleeps in `poll` when
    /// none can move. (It used to spawn a reader thread per peer per call:
    /// 0.4-1.7 ms for an all_reduce of one element on 2 ranks here, the
    /// new threads waiting for a core; now about 80 us.)
    fn exchange(
        &self,
        call: &OpDesc,
        deadline: Instant,
        out: &[&[u8]],
        into: &mut [&mut [u8]],
    ) -> Result<(), CommError> {
        use std::io::ErrorKind::{Interrupted, WouldBlock};
        use std::os::fd::AsRawFd;
        let n = self.n();
        // The connections this call uses, locked for its length.
        let conns: Vec<Option<(MutexGuard<'_, TcpStream>, MutexGuard<'_, TcpStream>)>> = (0..n)
            .map(|p| match &self.peers[p] {
                Some(c) if !out[p].is_empty() || !into[p].is_empty() => {
                    Some((c.r.lock(), c.w.lock()))
                }
                _ => None,
            })
            .collect();
        let (mut sent, mut got) = (vec![0usize; n], vec![0usize; n]);
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2 * n);
        loop {
            fds.clear();
            let mut moved = false;
            for (p, conn) in conns.iter().enumerate() {
                let Some((r, w)) = conn else { continue };
                if sent[p] < out[p].len() {
                    match (&**w).write(&out[p][sent[p]..]) {
                        Ok(0) => return Err(self.died(p, call)),
                        Ok(k) => (sent[p], moved) = (sent[p] + k, true),
                        Err(e) if matches!(e.kind(), WouldBlock | Interrupted) => {}
                        Err(e) => return Err(self.io_err(p, call, &e)),
                    }
                }
                if got[p] < into[p].len() {
                    match (&**r).read(&mut into[p][got[p]..]) {
                        Ok(0) => return Err(self.died(p, call)),
                        Ok(k) => (got[p], moved) = (got[p] + k, true),
                        Err(e) if matches!(e.kind(), WouldBlock | Interrupted) => {}
                        Err(e) => return Err(self.io_err(p, call, &e)),
                    }
                }
                let mut events = 0;
                if sent[p] < out[p].len() {
                    events |= libc::POLLOUT;
                }
                if got[p] < into[p].len() {
                    events |= libc::POLLIN;
                }
                if events != 0 {
                    fds.push(libc::pollfd {
                        fd: r.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                }
            }
            if fds.is_empty() {
                return Ok(());
            }
            // Checked on every pass, moving or not: a peer that trickles
            // bytes must not hold this rank past its deadline either.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The first peer still owing bytes (or still owed them).
                let owes = |p: usize| conns[p].is_some() && got[p] < into[p].len();
                let owed = |p: usize| conns[p].is_some() && sent[p] < out[p].len();
                let late = (0..n)
                    .find(|&p| owes(p))
                    .or_else(|| (0..n).find(|&p| owed(p)));
                let late = late.unwrap_or(self.m.me);
                return Err(self.io_err(
                    late,
                    call,
                    &std::io::Error::from(std::io::ErrorKind::TimedOut),
                ));
            }
            if moved {
                continue;
            }
            // At most a second per sleep: the deadline is checked above.
            let ms = left.as_millis().clamp(1, 1000) as libc::c_int;
            // SAFETY: `fds` is a live array of `fds.len()` pollfds.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        }
    }

    /// Every rank learns every rank's call description (this also acts as
    /// a barrier); a mismatch fails every rank.
    fn agree(
        &self,
        st: &mut State,
        desc: &OpDesc,
        deadline: Instant,
    ) -> Result<Vec<OpDesc>, CommError> {
        if let Some(e) = &st.poisoned {
            return Err(e.clone());
        }
        let seq = st.seq;
        st.seq += 1;
        let mine: Vec<u8> = [seq]
            .iter()
            .chain(desc.encode().iter())
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let n = self.n();
        let outs: Vec<&[u8]> = (0..n).map(|_| mine.as_slice()).collect();
        let mut bufs = vec![[0u8; 32]; n];
        {
            let mut into: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            self.exchange(desc, deadline, &outs, &mut into)?;
        }
        let descs: Vec<Option<OpDesc>> = (0..n)
            .map(|p| {
                if p == self.m.me {
                    return Some(*desc);
                }
                let w: Vec<u64> = bufs[p]
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect();
                (w[0] == seq)
                    .then(|| OpDesc::decode([w[1], w[2], w[3]]))
                    .flatten()
            })
            .collect();
        self.m.agreed_calls(seq, descs).inspect_err(|e| {
            // Every later call on this group fails with the same error.
            st.poisoned = Some(e.clone());
        })
    }

    /// Reduces `buf` (this rank's input; every rank's is as long) a window
    /// at a time. Each round sends every peer its window of that peer's
    /// part and receives every peer's window of this rank's part into
    /// scratch, then reduces that window in rank order: into `out` (out of
    /// place) or, with `out` `None`, over this rank's own part of `buf`.
    /// With `gather`, then all_gathers the reduced parts into `buf`
    /// (all_reduce); a small all_reduce ([`WHOLE_ALL_REDUCE_BYTES`])
    /// instead sends every peer the whole buffer and reduces all of it
    /// (one exchange of data, not two).
    fn reduce<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        mut out: Option<&mut Vec<T>>,
        op: ReduceOp,
        gather: bool,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let (n, me, len) = (self.n(), self.m.me, buf.len());
        // Every rank's "part" is then the whole buffer: each reduces all
        // of it, in rank order, as the parts would have been (the same bits).
        let whole = gather && bytes_of::<T>(len).saturating_mul(n - 1) <= WHOLE_ALL_REDUCE_BYTES;
        let parts: Vec<Range<usize>> = (0..n)
            .map(|p| match whole {
                true => 0..len,
                false => chunk_range(len, n, p),
            })
            .collect();
        let mine = parts[me].clone();
        if let Some(out) = out.as_deref_mut() {
            out.truncate(mine.len());
            out.resize(mine.len(), T::ZERO);
        }
        let w = (self.window / std::mem::size_of::<T>()).max(1);
        // Rounds enough for the longest part: every peer's part is sent
        // and this rank's received whole. A peer with other windows cuts
        // the same bytes differently; each connection carries them in order.
        let longest = parts.iter().map(|p| p.len()).max().unwrap_or(0);
        let rounds = longest.div_ceil(w);
        // A window per peer received, and one for a result that the type
        // cannot sum over its own source (`reduce_over`); no longer than
        // a part, so a group that only reduces a few values keeps little.
        let c = w.min(longest).max(1);
        let (recv, tmp) = scratch::<T>(&mut st.scratch, n * c).split_at_mut((n - 1) * c);
        let window = |j: usize, p: &Range<usize>| {
            p.start + (j * w).min(p.len())..p.start + ((j + 1) * w).min(p.len())
        };
        for j in 0..rounds {
            let own = window(j, &mine);
            let k = own.len();
            {
                let outs: Vec<&[u8]> = (0..n)
                    .map(|p| match p == me {
                        true => &[][..],
                        false => as_bytes(&buf[window(j, &parts[p])]),
                    })
                    .collect();
                let mut peers = recv.chunks_mut(c);
                let mut into: Vec<&mut [u8]> = (0..n)
                    .map(|p| match p == me {
                        true => &mut [][..],
                        false => peers
                            .next()
                            .map_or(&mut [][..], |r| as_bytes_mut(&mut r[..k])),
                    })
                    .collect();
                self.exchange(desc, deadline, &outs, &mut into)?;
            }
            let others: Vec<&[T]> = recv.chunks(c).map(|r| &r[..k]).collect();
            match out.as_deref_mut() {
                Some(out) => {
                    let at = own.start - mine.start..own.end - mine.start;
                    T::reduce_into(&mut out[at], &in_rank_order(&others, me, &buf[own]), op);
                }
                None if T::reduce_over(&mut buf[own.clone()], &others, me, op) => {}
                None => {
                    let t = &mut tmp[..k];
                    T::reduce_into(t, &in_rank_order(&others, me, &buf[own.clone()]), op);
                    buf[own].copy_from_slice(t);
                }
            }
        }
        if gather && !whole {
            self.gather_parts(desc, deadline, buf, &parts)?;
        }
        Ok(())
    }

    /// Concatenates the ranks' parts into `out`, in rank order. `input` is
    /// this rank's part, or `None` when it is already in `out` at its place
    /// (in place: no copy).
    fn gather<T: Element>(
        &self,
        desc: &OpDesc,
        input: Option<&[T]>,
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        let descs = self.agree(&mut st, desc, deadline)?;
        let parts = gather_ranges(&descs);
        let at = parts.last().map_or(0, |p| p.end);
        // In place the agreed length is the buffer's, so `at` is too: the
        // resize below changes nothing then.
        out.truncate(at);
        out.resize(at, T::ZERO);
        if let Some(input) = input {
            out[parts[self.m.me].clone()].copy_from_slice(input);
        }
        self.gather_parts(desc, deadline, out, &parts)
    }

    /// Fills every peer's range of `out` from that peer, sending this
    /// rank's own range (already there) to every peer.
    fn gather_parts<T: Element>(
        &self,
        desc: &OpDesc,
        deadline: Instant,
        out: &mut [T],
        parts: &[Range<usize>],
    ) -> Result<(), CommError> {
        let me = self.m.me;
        // Split `out` into the disjoint per-rank ranges: this rank's is
        // read (sent), the peers' written (received), with no copy.
        let mut own: &[u8] = &[];
        let mut into: Vec<&mut [u8]> = Vec::with_capacity(self.n());
        let mut rest = as_bytes_mut(out);
        let size = std::mem::size_of::<T>();
        let mut at = 0;
        for (p, r) in parts.iter().enumerate() {
            let (_, tail) = rest.split_at_mut((r.start - at) * size);
            let (this, tail) = tail.split_at_mut(r.len() * size);
            if p == me {
                own = this;
                into.push(&mut [][..]);
            } else {
                into.push(this);
            }
            rest = tail;
            at = r.end;
        }
        let outs: Vec<&[u8]> = (0..self.n())
            .map(|p| if p == me { &[][..] } else { own })
            .collect();
        self.exchange(desc, deadline, &outs, &mut into)
    }
}

/// The sources of a reduction in rank order: `others` with `own` at `me`.
fn in_rank_order<'a, T>(others: &[&'a [T]], me: usize, own: &'a [T]) -> Vec<&'a [T]> {
    let mut srcs = others.to_vec();
    srcs.insert(me, own);
    srcs
}

/// `len` elements of T over `words`, grown (zero-filled) when too short,
/// else as the last operation left them. Reused by every operation of the
/// group: a buffer allocated per call costs a page fault per 4 KiB it
/// touches (an 8 MiB one about 4 ms on this project's VM, more than
/// copying it), and the reductions' scratch was two or three of those.
fn scratch<T: Element>(words: &mut Vec<u64>, len: usize) -> &mut [T] {
    const { assert!(std::mem::align_of::<T>() <= std::mem::align_of::<u64>()) };
    let need = (len * std::mem::size_of::<T>()).div_ceil(8);
    if words.len() < need {
        words.resize(need, 0);
    }
    // SAFETY: `need` words hold `len` elements; u64 storage is aligned
    // for every Element (asserted above); every byte pattern is a valid T
    // (Element is sealed to plain-old-data types).
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<T>(), len) }
}

/// One rank's handle on a TCP group.
pub struct TcpGroup {
    front: Front<Inner>,
}

impl TcpGroup {
    /// Connects this rank to every other member. Every member must call it.
    pub fn join(j: TcpJoin<'_>) -> Result<Self, CommError> {
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
        let rdv = |why: String| CommError::Rendezvous(format!("group `{}`: {why}", j.name));
        let ip = match std::env::var("ZRT_BIND_ADDR") {
            Ok(a) => a
                .parse()
                .map_err(|_| rdv(format!("ZRT_BIND_ADDR={a:?} is not an IP address")))?,
            Err(_) => j.store.local_ip()?,
        };
        let listener =
            TcpListener::bind((ip, 0)).map_err(|e| rdv(format!("cannot listen on {ip}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| rdv(e.to_string()))?;
        j.store.set(
            &format!("tcp/{}/addr/{me}", j.name),
            addr.to_string().as_bytes(),
        )?;
        let mut peers: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        // Connect to every higher rank, presenting the token and our rank.
        for (q, slot) in peers.iter_mut().enumerate().skip(me + 1) {
            let a = crate::store::await_rank(
                &j.store,
                &format!("tcp/{}/addr/{q}", j.name),
                j.world_ranks[q],
                j.timeout,
                || format!("join tcp group `{}`", j.name),
            )?;
            let a = String::from_utf8_lossy(&a).to_string();
            let mut c = TcpStream::connect(&a).map_err(|e| {
                rdv(format!(
                    "cannot connect to rank {} at {a}: {e}",
                    j.world_ranks[q]
                ))
            })?;
            let mut hello = (j.token.len() as u32).to_le_bytes().to_vec();
            hello.extend_from_slice(j.token.as_bytes());
            hello.extend_from_slice(&(me as u32).to_le_bytes());
            c.write_all(&hello).map_err(|e| rdv(e.to_string()))?;
            let _ = c.set_nodelay(true);
            *slot = Some(c);
        }
        // Accept every lower rank; connections without the token are dropped.
        let deadline = crate::work::deadline_in(j.timeout);
        listener
            .set_nonblocking(true)
            .map_err(|e| rdv(e.to_string()))?;
        let mut looked = Instant::now();
        while peers[..me].iter().any(Option::is_none) {
            let missing = || -> Vec<usize> {
                (0..me)
                    .filter(|&q| peers[q].is_none())
                    .map(|q| j.world_ranks[q])
                    .collect()
            };
            if Instant::now() >= deadline {
                return Err(rdv(format!("ranks {:?} never connected", missing())));
            }
            // A lower rank that ended (its store connection closed) will
            // not connect: say so now rather than at the deadline.
            if looked.elapsed() >= Duration::from_millis(100) {
                looked = Instant::now();
                for q in missing() {
                    if j.store
                        .get_within(&crate::store::gone_key(q), Duration::ZERO)?
                        .is_some()
                    {
                        return Err(rdv(format!(
                            "rank {q} left the job before it connected to this rank: its process exited, died or dropped its `Dist` (its rendezvous store connection closed); check that rank's output"
                        )));
                    }
                }
            }
            match listener.accept() {
                Ok((mut c, _)) => {
                    let _ = c.set_nonblocking(false);
                    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                    let hello = (|| -> std::io::Result<(Vec<u8>, usize)> {
                        let mut l = [0u8; 4];
                        c.read_exact(&mut l)?;
                        let tl = u32::from_le_bytes(l) as usize;
                        if tl > MAX_TOKEN_LEN {
                            return Err(std::io::Error::other("token too long"));
                        }
                        let mut t = vec![0u8; tl];
                        c.read_exact(&mut t)?;
                        c.read_exact(&mut l)?;
                        Ok((t, u32::from_le_bytes(l) as usize))
                    })();
                    match hello {
                        Ok((t, q))
                            if same_token(&t, j.token.as_bytes())
                                && q < me
                                && peers[q].is_none() =>
                        {
                            let _ = c.set_read_timeout(None);
                            let _ = c.set_nodelay(true);
                            peers[q] = Some(c);
                        }
                        _ => tracing::warn!(
                            group = j.name,
                            "refused a connection without the job's token"
                        ),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => return Err(rdv(format!("accept: {e}"))),
            }
        }
        let inner = Arc::new(Inner {
            m: Member {
                name: j.name.to_string(),
                me,
                world_ranks: j.world_ranks,
                timeout: j.timeout,
                store: j.store,
                mailbox: Mailbox::default(),
            },
            peers: peers
                .into_iter()
                .enumerate()
                .map(|(q, c)| match c {
                    None => Ok(None),
                    Some(c) => {
                        // Nonblocking for good: `exchange` polls them.
                        let w = c
                            .set_nonblocking(true)
                            .and_then(|()| c.try_clone())
                            .map_err(|e| rdv(format!("connection to rank {}: {e}", q)))?;
                        Ok(Some(Peer {
                            r: Mutex::new(c),
                            w: Mutex::new(w),
                        }))
                    }
                })
                .collect::<Result<_, CommError>>()?,
            state: Mutex::new(State {
                seq: 0,
                poisoned: None,
                scratch: Vec::new(),
            }),
            window: j.window_bytes.max(MIN_WINDOW_BYTES),
            left: AtomicBool::new(false),
        });
        let i2 = inner.clone();
        let worker = Worker::start(j.name, me, move || i2.leave())?;
        Ok(Self {
            front: Front::new(inner, worker),
        })
    }

    /// Whether every other member has closed its connection (left or died).
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
        self.peers.len()
    }

    /// Leaving closes this rank's sending side of each connection, which is
    /// how peers learn it (their reads end). The receiving side stays open,
    /// so that [`Self::peer_gone`] can still see a peer close its own.
    fn leave(&self) {
        self.left.store(true, Ordering::Release);
        for c in self.peers.iter().flatten() {
            let _ = c.w.lock().shutdown(std::net::Shutdown::Write);
        }
    }

    /// Whether group rank `p` closed its connection (left or died). Only
    /// called while no collective reads from it (the worker runs one
    /// operation at a time).
    fn peer_gone(&self, p: usize) -> bool {
        let Some(peer) = &self.peers[p] else {
            return false;
        };
        // Nonblocking since the join: a look never waits.
        let mut c = peer.r.lock();
        let left = self.left.load(Ordering::Acquire);
        let mut b = [0u8; 1 << 12];
        let mut drained = 0;
        loop {
            match c.peek(&mut b[..1]) {
                Ok(0) => break true,
                // Once this rank has left, nothing reads the connection
                // again: what the peer sent before it closed is dropped
                // (a bounded amount per look) so that its close, behind
                // it, can be seen.
                Ok(_) if left && drained < 64 => {
                    drained += 1;
                    match c.read(&mut b) {
                        Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => break true,
                        _ => {}
                    }
                }
                Ok(_) => break false,
                Err(e) => break e.kind() != std::io::ErrorKind::WouldBlock,
            }
        }
    }

    /// Agrees on the call, then exchanges a byte with every peer: a rank
    /// that reached the barrier and then gave up on it (timed out, and
    /// left) sent its description but never sends the byte, so a late
    /// rank reads the connection's end and fails naming it instead of
    /// passing (as a late rank's gather fails: it needs the peer's data).
    /// A peer that passed and then exited sent the byte before it closed.
    fn barrier(&self, desc: &OpDesc) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        // An all_gather of one byte per rank.
        let parts: Vec<Range<usize>> = (0..self.n()).map(|p| p..p + 1).collect();
        self.gather_parts(desc, deadline, &mut vec![1u8; self.n()], &parts)
    }

    fn all_reduce<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce(desc, buf, None, op, true)
    }

    fn reduce_scatter<T: Element>(
        &self,
        desc: &OpDesc,
        input: &mut [T],
        out: &mut Vec<T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce(desc, input, Some(out), op, false)
    }

    fn all_gather<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        self.gather(desc, Some(input), out)
    }

    /// One exchange: each peer's chunk of `input` goes straight out of
    /// `input`, each peer's chunk of this rank straight into its place in
    /// `out`.
    fn all_to_all<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let (n, me) = (self.n(), self.m.me);
        let mine = chunk_range(input.len(), n, me);
        let m = mine.len();
        out.truncate(n * m);
        out.resize(n * m, T::ZERO);
        out[me * m..(me + 1) * m].copy_from_slice(&input[mine]);
        let outs: Vec<&[u8]> = (0..n)
            .map(|p| match p == me {
                true => &[][..],
                false => as_bytes(&input[chunk_range(input.len(), n, p)]),
            })
            .collect();
        let mut into: Vec<&mut [u8]> = as_bytes_mut(out)
            .chunks_mut((m * std::mem::size_of::<T>()).max(1))
            .enumerate()
            .map(|(p, c)| if p == me { &mut [][..] } else { c })
            .collect();
        // `chunks_mut` yields nothing for an empty `out`.
        into.resize_with(n, || &mut [][..]);
        self.exchange(desc, deadline, &outs, &mut into)
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
        let n = self.n();
        // The root sends `buf` to every peer and receives nothing; the
        // others receive it from the root into `buf` and send nothing.
        let mut outs: Vec<&[u8]> = vec![&[][..]; n];
        let mut into: Vec<&mut [u8]> = (0..n).map(|_| &mut [][..]).collect();
        if self.m.me == root {
            outs = (0..n)
                .map(|p| if p == root { &[][..] } else { as_bytes(buf) })
                .collect();
        } else {
            into[root] = as_bytes_mut(buf);
        }
        self.exchange(desc, deadline, &outs, &mut into)
    }
}

forward_process_group!(TcpGroup {
    fn reduce_scatter_in_place<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let desc = OpDesc::new(OpKind::ReduceScatter(op), Some(T::DTYPE), buf.len());
        let n = self.front.size();
        self.front.run(desc, move |g| {
            g.reduce(&desc, &mut buf, None, op, false)?;
            let s = bytes_of::<T>(buf.len());
            Ok((buf, s, s / n.max(1)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreServer;
    use crate::ProcessGroup;

    fn join(addr: &str, token: &str, world_rank: usize) -> Result<TcpGroup, CommError> {
        let store = StoreClient::connect(addr, token, Duration::from_secs(5))?;
        TcpGroup::join(TcpJoin {
            store: Arc::new(store),
            token,
            name: "g",
            world_ranks: vec![0, 1],
            world_rank,
            timeout: Duration::from_secs(3),
            window_bytes: DEFAULT_WINDOW_BYTES,
        })
    }

    /// Connects to `addr` and says `hello`: a token, then the rank it claims.
    fn intrude(addr: &str, token: &str, claims: u32) -> TcpStream {
        let mut c = TcpStream::connect(addr).unwrap();
        let mut hello = (token.len() as u32).to_le_bytes().to_vec();
        hello.extend_from_slice(token.as_bytes());
        hello.extend_from_slice(&claims.to_le_bytes());
        c.write_all(&hello).unwrap();
        c
    }

    #[test]
    fn a_closed_group_still_sees_its_peer_close_behind_unread_data() {
        let srv = StoreServer::serve("127.0.0.1:0", "t").unwrap();
        let addr = srv.addr().to_string();
        let a = addr.clone();
        let rank1 = std::thread::spawn(move || join(&a, "t", 1));
        let mut g0 = join(&addr, "t", 0).unwrap();
        let g1 = rank1.join().unwrap().unwrap();
        g0.close();
        assert!(g1.peers_gone(), "rank 1 was not told that rank 0 left");
        assert!(
            !g0.peers_gone(),
            "rank 0 takes itself leaving for rank 1 gone"
        );
        // Rank 1 had sent more than rank 0 will ever read, then it goes.
        let peer = g1.front.inner.peers[0].as_ref().unwrap();
        peer.w.lock().write_all(&[7u8; 100_000]).unwrap();
        drop(g1);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !g0.peers_gone() {
            assert!(Instant::now() < deadline, "rank 1's close was never seen");
            std::thread::sleep(Duration::from_millis(20));
        }
        let late = g0.barrier().wait().unwrap_err().to_string();
        assert!(
            late.contains("barrier() was issued after this rank closed the group"),
            "{late}"
        );
    }

    #[test]
    fn a_rank_admits_only_lower_ranks_that_present_the_token() {
        // The longest token the hello takes, and wrong ones of its length.
        let token = "t".repeat(MAX_TOKEN_LEN);
        let wrong = format!("{}x", "t".repeat(MAX_TOKEN_LEN - 1));
        let srv = StoreServer::serve("127.0.0.1:0", &token).unwrap();
        let addr = srv.addr().to_string();
        let a = addr.clone();
        let t = token.clone();
        let rank1 = std::thread::spawn(move || join(&a, &t, 1));
        // Before rank 0 connects, strays reach rank 1's listener: the wrong
        // token claiming rank 0, the right one claiming rank 1 itself and a
        // rank past the group. None may take rank 0's place or crash the join.
        let store = StoreClient::connect(&addr, &token, Duration::from_secs(5)).unwrap();
        let listener =
            String::from_utf8(store.get("tcp/g/addr/1", Duration::from_secs(5)).unwrap()).unwrap();
        let _strays = [
            intrude(&listener, &wrong, 0),
            intrude(&listener, &token, 1),
            intrude(&listener, &token, 7),
        ];
        std::thread::sleep(Duration::from_millis(200));
        let g0 = join(&addr, &token, 0).unwrap();
        let g1 = rank1.join().unwrap().unwrap();
        for g in [&g0, &g1] {
            let me = g.front.inner.m.me;
            assert!(
                g.front.inner.peers[me].is_none(),
                "rank {me} holds a connection to itself"
            );
        }
        let w0 = g0.all_reduce(vec![1f32, 2.0], ReduceOp::Sum);
        let w1 = g1.all_reduce(vec![10f32, 20.0], ReduceOp::Sum);
        assert_eq!(w0.wait().unwrap(), [11.0, 22.0]);
        assert_eq!(w1.wait().unwrap(), [11.0, 22.0]);
    }
}

//! Symmetric buffers: allocated by every rank together, read by peers
//! where they are.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::dtype::bytes_of;
use crate::front::Transport;
use crate::op::invalid;
use crate::stream::{copy_streaming, stream_min_dest_bytes};
use crate::symmetric::Shared;
use crate::{chunk_range, CommError, Element, OpDesc, OpKind, ReduceOp, SymmetricBuf};

use super::segment::{create_mapped, open_mapped, Unlink, W_STATUS};
use super::staged::scratch;
use super::{Inner, State};

impl Inner {
    /// Allocates this rank's buffer of symmetric allocation `desc.buffer`
    /// and maps every peer's. In two phases, each ending at a barrier with
    /// every rank's outcome in its status word, so a rank that fails fails
    /// every rank with its name instead of leaving them waiting: (1) each
    /// rank creates and maps its own file, its pages reserved up front
    /// (`posix_fallocate`: a full /dev/shm is an error here, not a SIGBUS
    /// later); (2) each maps the peers' files. Then the names go, as the
    /// segment's do: the memory lives as long as some rank maps it.
    pub(super) fn alloc<T: Element>(&self, len: usize) -> Result<SymmetricBuf<T>, CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        let id = st.allocs;
        st.allocs += 1;
        let desc = OpDesc {
            buffer: Some(id),
            ..OpDesc::new(OpKind::AllocSymmetric, Some(T::DTYPE), len)
        };
        self.agree(&mut st, &desc, deadline)?;
        let (n, me) = (self.n(), self.m.me);
        let bytes = bytes_of::<T>(len).max(1).div_ceil(4096) * 4096;
        let file = |r: usize| format!("{}-sym{id}-r{r}", self.path);
        let own = create_mapped(&file(me), bytes);
        // However this ends, the name goes when it returns: after phase 1
        // every rank has mapped the file or given up.
        let _unlink = Unlink(file(me));
        self.phase(&mut st, &desc, deadline, id, 0, own.as_ref().err().cloned())??;
        // Its own failure would have been reported by `phase`.
        let mut own = Some(own.map_err(|why| self.shm_error(&desc, why))?);
        let mut maps = Vec::with_capacity(n);
        let mut failed = None;
        for r in 0..n {
            let m = match own.take_if(|_| r == me) {
                Some(m) => Ok(m),
                None => open_mapped(&file(r), bytes),
            };
            match m {
                Ok(m) => maps.push(m),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        self.phase(&mut st, &desc, deadline, id, 1, failed)??;
        let shared = Shared {
            group: self.serial,
            id,
            maps,
            me,
        };
        Ok(SymmetricBuf::shared(shared, len))
    }

    /// Publishes how this rank's step of an allocation went (`failed`: why
    /// not), passes a barrier and returns the first failure: this rank's own
    /// (with its reason) or a peer's (naming it). The outer error is the
    /// barrier's own (a dead rank, the deadline).
    pub(super) fn phase(
        &self,
        st: &mut State,
        desc: &OpDesc,
        deadline: Instant,
        id: u32,
        phase: u64,
        failed: Option<String>,
    ) -> Result<Result<(), CommError>, CommError> {
        // Tagged with the allocation and the phase, so a word left from an
        // earlier one never reads as success.
        let tag = |ok: bool| (u64::from(id) + 1) << 2 | phase << 1 | u64::from(!ok);
        let w = W_STATUS + phase as usize;
        self.seg
            .word(self.m.me, w)
            .store(tag(failed.is_none()), Ordering::Relaxed);
        self.pass_barrier(st, desc, deadline)?;
        if let Some(why) = failed {
            return Ok(Err(self.shm_error(desc, why)));
        }
        let bad = (0..self.n()).find(|&r| self.seg.word(r, w).load(Ordering::Relaxed) != tag(true));
        Ok(match bad {
            None => Ok(()),
            Some(r) => Err(self.shm_error(
                desc,
                format!(
                    "rank {} failed to {} (its own error says why)",
                    self.m.world_ranks[r],
                    if phase == 0 {
                        "create its buffer"
                    } else {
                        "map a peer's buffer"
                    }
                ),
            )),
        })
    }

    pub(super) fn shm_error(&self, desc: &OpDesc, why: String) -> CommError {
        CommError::SharedMemory {
            group: self.m.name.clone(),
            call: desc.to_string(),
            why,
        }
    }

    /// `buf`'s shared side, if this group allocated it.
    pub(super) fn own_buffer<'a, T: Element>(
        &self,
        buf: &'a SymmetricBuf<T>,
    ) -> Option<&'a Shared> {
        buf.shared_part()
            .filter(|s| s.group == self.serial && s.maps.len() == self.n())
    }

    /// Runs a symmetric collective on `buf`: agrees on `desc`, runs `body`
    /// on the buffer's mappings, then passes a closing barrier, which keeps
    /// every rank's buffer still until all peers' reads are done. A rank
    /// whose buffer is not this group's still takes part in the agreement
    /// (its description names no buffer), so the peers fail at once on the
    /// mismatch instead of waiting for it, and it reports the foreign
    /// buffer itself.
    pub(super) fn symmetric<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &SymmetricBuf<T>,
        body: impl FnOnce(&Shared),
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        let agreed = self.agree(&mut st, desc, deadline);
        let sh = self
            .own_buffer(buf)
            .ok_or_else(|| foreign_buffer(&self.m.name, desc))?;
        agreed?;
        body(sh);
        self.pass_barrier(&mut st, desc, deadline)
    }

    /// reduce_scatter on a symmetric buffer: this rank reduces its part
    /// reading every rank's buffer where it is, a window at a time, over
    /// its own part (f32 sums) or into a cache-sized scratch then written
    /// over it. Peers read only their own parts of this rank's buffer, so
    /// nothing they read changes.
    /// Runs inside [`Inner::symmetric`], between agreement and barrier.
    pub(super) fn reduce_symmetric<T: Element>(&self, sh: &Shared, len: usize, op: ReduceOp) {
        let (n, me) = (self.n(), self.m.me);
        let part = chunk_range(len, n, me);
        let w = (SCRATCH_BYTES / std::mem::size_of::<T>().max(1)).min(part.len());
        // Allocated on first use: f32 sums reduce over their own part.
        let mut tmp = Vec::new();
        let mut at = part.start;
        while at < part.end {
            let l = w.min(part.end - at);
            // SAFETY: each buffer holds `len` elements; between the
            // agreement and the closing barrier no rank writes any rank's
            // part `me` but this one, and no peer reads it.
            let src = |q: usize| unsafe { std::slice::from_raw_parts(sh.ptr::<T>(q).add(at), l) };
            let own = unsafe { std::slice::from_raw_parts_mut(sh.ptr::<T>(me).add(at), l) };
            let others: Vec<&[T]> = (0..n).filter(|&q| q != me).map(src).collect();
            // An f32 sum reduces over this rank's part where it is
            // (`Element::reduce_over`); other types into the scratch,
            // which is then written over it.
            if !T::reduce_over(own, &others, me, op) {
                let tmp = scratch(&mut tmp, w, l);
                let mut srcs = others;
                srcs.insert(me, own);
                T::reduce_into(tmp, &srcs, op);
                own.copy_from_slice(tmp);
            }
            at += l;
        }
    }

    /// all_gather on a symmetric buffer: every rank's part is already in
    /// its own buffer, so each rank copies the peers' parts straight from
    /// theirs (starting at the next rank, so n > 2 ranks do not all read
    /// rank 0 first). Runs inside [`Inner::symmetric`], between agreement
    /// and barrier.
    pub(super) fn gather_symmetric<T: Element>(&self, sh: &Shared, len: usize) {
        let (n, me) = (self.n(), self.m.me);
        let stream = bytes_of::<T>(len) >= stream_min_dest_bytes();
        for q in (1..n).map(|k| (me + k) % n) {
            let r = chunk_range(len, n, q);
            // SAFETY: rank q's part of its own buffer, which nobody writes
            // during the collective; this rank's part q, which only this
            // rank writes (and nobody reads) during it.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(sh.ptr::<T>(q).add(r.start), r.len()),
                    std::slice::from_raw_parts_mut(sh.ptr::<T>(me).add(r.start), r.len()),
                )
            };
            copy_streaming(dst, src, stream);
        }
    }
}

/// The error for a symmetric buffer passed to a group that did not allocate it.
pub(super) fn foreign_buffer(group: &str, desc: &OpDesc) -> CommError {
    invalid(
        group,
        desc,
        "the symmetric buffer was allocated by another group: use a buffer from this group's alloc_symmetric",
    )
}

/// Scratch of the symmetric reduce-scatter: a window this size stays in L2.
pub(super) const SCRATCH_BYTES: usize = 64 << 10;

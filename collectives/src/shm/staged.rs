//! Collectives over private buffers: every byte a peer needs is staged
//! through this rank's ring, window by window.

use std::time::{Duration, Instant};

use crate::dtype::bytes_of;
use crate::front::Transport;
use crate::op::{gather_ranges, invalid};
use crate::slot_stores::{Measured, Switch};
use crate::stream::{copy_streaming, copy_to_slot, part_streams, stream_min_dest_bytes};
use crate::{chunk_range, CommError, Element, OpDesc, ReduceOp};

use super::ring::{claim_bufs, window_len, Claimed};
use super::{Dest, Inner, State};

impl Inner {
    /// Tells the group's chooser of slot stores what an operation of
    /// `rounds` rounds took with `streamed` stores, and says when that
    /// changes them (debug: a run's speed moving for minutes at a time has
    /// this as one cause).
    pub(super) fn learn(&self, st: &mut State, rounds: usize, streamed: bool, took: &Measured) {
        match st.stores.observe(rounds, streamed, took) {
            Some(Switch::ToStreaming(x)) => tracing::debug!(
                group = %self.m.name,
                "shm: staging with plain stores took {x:.2}x as long per byte as with \
                 streaming ones (cores on different dies?): streaming stores into the slots"
            ),
            Some(Switch::ToPlain(x)) => tracing::debug!(
                group = %self.m.name,
                "shm: staging with streaming stores took {x:.2}x as long per byte as with \
                 plain ones: plain stores into the slots again"
            ),
            None => {}
        }
    }

    /// Elements of T per part per window when `parts` windows share one of
    /// a slot's `bufs` buffers.
    pub(super) fn window<T>(&self, parts: usize, bufs: usize) -> usize {
        window_len(self.seg.slot, std::mem::size_of::<T>(), parts, bufs)
    }

    /// Claims the buffers (1 / `bufs` of a slot each) of an operation's
    /// `rounds` rounds of T ([`claim_bufs`]).
    pub(super) fn claim<T>(&self, st: &mut State, rounds: usize, bufs: usize) -> Claimed {
        let size = std::mem::size_of::<T>();
        let (slot, laps) = (self.seg.slot, self.seg.laps);
        claim_bufs(&mut st.ring_at, slot, laps, size, bufs, rounds)
    }

    /// reduce_scatter (`full == false`: this rank's reduced part goes to
    /// `part`) or all_reduce (`full == true`: the whole result is written back
    /// into `buf`, window by window, after each window was staged). Reuses
    /// the caller's buffers: no allocation, no page faults.
    ///
    /// all_reduce: each rank writes its window's result into the result
    /// area, and the results of round j are copied back during round j + 1,
    /// after its barrier (which every writer passed after writing), the
    /// last round's after one closing barrier: one barrier a round instead
    /// of two (about 3% at 16-128 MiB on 2 ranks).
    ///
    /// Staging is pipelined: between arriving at round j's barrier and
    /// waiting on it, a rank stages round j + 1 (its own input into its own
    /// slot: nothing anyone reads yet), so that copy overlaps the peers'
    /// arrival instead of delaying its own. The rounds' buffers are
    /// therefore thirds of a slot, at least three along the ring
    /// ([`ring_bufs`]): round j + 1's staging writes a buffer that
    /// round j - 2 read at the latest, and every reader of it has arrived
    /// at round j - 1's barrier, which this rank has passed (the next
    /// operation's agreement barrier protects the last rounds).
    pub(super) fn reduce<T: Element>(
        &self,
        desc: &OpDesc,
        buf: &mut [T],
        dest: Dest<'_, T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let (n, me, len) = (self.n(), self.m.me, buf.len());
        let parts: Vec<std::ops::Range<usize>> = (0..n).map(|p| chunk_range(len, n, p)).collect();
        const BUFS: usize = 3;
        let w = self.window::<T>(n, BUFS);
        let rounds = parts[0].len().div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, BUFS);
        let full = matches!(dest, Dest::All);
        // Plain or streaming stores into the slots (`slot_stores`), and
        // what this operation's writes and reads took, to choose again.
        let nt = st.stores.streaming(rounds);
        let mut took = Measured::default();
        // Out of place, when the destination cannot be cached anyway, it
        // is written with streaming stores: a plain store would first read
        // every cold line of the destination (read-for-ownership), 2 S
        // instead of 1.5 S per rank through the memory bus the ranks share.
        // Measured at 128 MiB on 2 ranks: 15.3 -> 12.1 ms. f32 sums and
        // averages stream from the reduction's own registers
        // (`Element::reduce_into_streaming`); other types reduce each
        // window into a window-sized buffer and stream that out, one more
        // pass over the window (about 10% slower at 128 MiB).
        let stream = matches!(dest, Dest::Part(_))
            && part_streams(
                bytes_of::<T>(len),
                n,
                crate::caches::last_level_cache_bytes(),
            );
        // Every window is reduced into a private window-sized buffer first,
        // unless it goes straight into the destination (reduce_scatter out
        // of place: small, or f32 streamed; in place: f32 sums, over this
        // rank's own input). From there it is written
        // over this rank's input (in place), streamed out (above), or
        // copied into the result area (all_reduce). The last matters when
        // the ranks' cores are on different dies: the reduction loop's own
        // stores into shared lines a peer's core held last stalled it, and
        // all_reduce ran 1.7-1.9x slower than with the copy, which moves
        // them many at a time.
        let mut part = match dest {
            Dest::Part(part) => {
                // Reuse the caller's buffer as it is: clearing would zero-fill it again.
                part.truncate(parts[me].len());
                part.resize(parts[me].len(), T::ZERO);
                Some(part)
            }
            Dest::All | Dest::InPlace => None,
        };
        // Allocated on first use: a call that never needs it (straight
        // into the destination, or the fused f32 stream) does not zero
        // one for nothing.
        let mut tmp: Vec<T> = Vec::new();
        let cap = w.min(parts[me].len());
        let window = |p: usize, j: usize| {
            let s = (parts[p].start + j * w).min(parts[p].end);
            s..(s + w).min(parts[p].end)
        };
        // Only the parts other ranks reduce are staged: this rank reads its
        // own part straight from `buf`.
        // Timed into `took`, with the bytes it wrote.
        let stage = |buf: &[T], j: usize, took: &mut Measured| {
            let (t, h) = (Instant::now(), ring.at(j));
            let mut bytes = 0;
            for p in (0..n).filter(|&p| p != me) {
                let r = window(p, j);
                bytes += bytes_of::<T>(r.len());
                // SAFETY: only rank `me` writes its own ring, and round
                // j's buffer is one no peer reads now (see above).
                copy_to_slot(
                    unsafe { self.seg.slot::<T>(me, h + p * w, r.len()) },
                    &buf[r],
                    nt,
                );
            }
            took.wrote(t, bytes);
        };
        // all_reduce: copies every rank's result of round j back into `buf`.
        let take_results = |buf: &mut [T], j: usize| {
            let h = ring.at(j);
            for p in 0..n {
                let r = window(p, j);
                let l = r.len();
                // SAFETY: round j's buffer of the result ring, complete
                // (its writers arrived at a later barrier this rank
                // passed) and rewritten in round j + 3 at the earliest,
                // after this rank arrived at that round's barrier.
                buf[r].copy_from_slice(unsafe { self.seg.slot::<T>(n, h + p * w, l) });
            }
        };
        if rounds > 0 {
            stage(buf, 0, &mut took);
        }
        // Round j's reading of the peers' windows, timed up to the next
        // round (it ends in more than one place), less all_reduce's writing
        // of its result into the shared area meanwhile (a write like
        // staging, counted as one).
        let mut reading: Option<(Instant, usize)> = None;
        let mut results_written = Duration::ZERO;
        for j in 0..rounds {
            if let Some((t, b)) = reading.take() {
                took.read_less(t, std::mem::take(&mut results_written), b);
            }
            let h = ring.at(j);
            let e = self.arrive(&mut st);
            if j + 1 < rounds {
                stage(buf, j + 1, &mut took);
            }
            self.wait_all(desc, deadline, e)?;
            // Read from shared memory this round: the peers' windows, and
            // for all_reduce the results too (about n windows, taken a
            // round later).
            let windows = if full { 2 * n - 1 } else { n - 1 };
            reading = Some((Instant::now(), windows * bytes_of::<T>(window(me, j).len())));
            // SAFETY (slots below): peers' buffers of round j are complete
            // (they arrived after staging them); between barriers only rank
            // `me` writes its own window of the result ring's buffer.
            let r = window(me, j);
            let others: Vec<&[T]> = (0..n)
                .filter(|&q| q != me)
                .map(|q| &*unsafe { self.seg.slot::<T>(q, h + me * w, r.len()) })
                .collect();
            // In place, an f32 sum reduces over this rank's input where it
            // is (`Element::reduce_over`): no scratch window to copy back.
            if !full && part.is_none() && T::reduce_over(&mut buf[r.clone()], &others, me, op) {
                continue;
            }
            let mut srcs = others;
            srcs.insert(me, &buf[r.clone()]);
            if full {
                let l = r.len();
                let tmp = scratch(&mut tmp, cap, l);
                T::reduce_into(tmp, &srcs, op);
                drop(srcs);
                let t = Instant::now();
                copy_to_slot(unsafe { self.seg.slot::<T>(n, h + me * w, l) }, tmp, nt);
                let d = t.elapsed();
                took.wrote_for(d, bytes_of::<T>(l));
                results_written += d;
                if j > 0 {
                    take_results(buf, j - 1);
                }
            } else {
                let at = r.start - parts[me].start;
                let l = r.len();
                // Streamed straight from the reduction where the type has
                // a kernel for it (above); else through `tmp` below.
                let fused = stream
                    && part.as_mut().is_some_and(|part| {
                        T::reduce_into_streaming(&mut part[at..at + l], &srcs, op)
                    });
                match part.as_mut() {
                    _ if fused => {}
                    Some(part) if !stream => T::reduce_into(&mut part[at..at + l], &srcs, op),
                    part => {
                        let tmp = scratch(&mut tmp, cap, l);
                        T::reduce_into(tmp, &srcs, op);
                        drop(srcs);
                        let to = match part {
                            Some(part) => &mut part[at..at + l],
                            None => &mut buf[r],
                        };
                        copy_streaming(to, tmp, stream);
                    }
                }
            }
        }
        if let Some((t, b)) = reading.take() {
            took.read_less(t, results_written, b);
        }
        // all_reduce counted its results written as writes and those it
        // reads as reads, so its ratio compares like with like (measured:
        // 1.1-1.7 with a shared cache, 3.6-6.4 across dies).
        self.learn(&mut st, rounds, nt, &took);
        if full && rounds > 0 {
            self.pass_barrier(&mut st, desc, deadline)?;
            take_results(buf, rounds - 1);
        }
        Ok(())
    }

    /// Concatenates the ranks' parts into `out`. `input` is this rank's
    /// part, or `None` when it is already in `out` at its place (in place:
    /// one copy less).
    pub(super) fn gather<T: Element>(
        &self,
        desc: &OpDesc,
        input: Option<&[T]>,
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        let descs = self.agree(&mut st, desc, deadline)?;
        let parts = gather_ranges(&descs);
        // Reuse the caller's buffer as it is: clearing would zero-fill it again.
        let total = parts.last().map_or(0, |p| p.end);
        if input.is_none() && out.len() != total {
            return Err(invalid(
                &self.m.name,
                desc,
                format!("in-place all_gather needs a buffer of {total} elements (the parts' sum), got {}", out.len()),
            ));
        }
        out.truncate(total);
        out.resize(total, T::ZERO);
        let w = self.window::<T>(1, 2);
        let rounds = parts.iter().map(|p| p.len()).max().unwrap_or(0).div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, 2);
        let stream = bytes_of::<T>(total) >= stream_min_dest_bytes();
        // Out of place (the only copy it is used for), this rank's own
        // part is streamed into `out` by the rule reduce_scatter's part
        // follows ([`part_streams`]). The peers' parts, copied last, stay
        // plain below `stream`: what the caller reads next, and what stays
        // cached of `out`.
        let stream_own = stream
            || part_streams(
                bytes_of::<T>(total),
                self.n(),
                crate::caches::last_level_cache_bytes(),
            );
        let nt = st.stores.streaming(rounds);
        let mut took = Measured::default();
        for j in 0..rounds {
            let h = ring.at(j);
            // Rank r's window of this round, within its part and in `out`.
            let part = |r: usize| (j * w).min(parts[r].len())..((j + 1) * w).min(parts[r].len());
            let place = |r: usize, p: &std::ops::Range<usize>| {
                parts[r].start + p.start..parts[r].start + p.end
            };
            let mine = part(self.m.me);
            let own = place(self.m.me, &mine);
            // SAFETY: own ring written between barriers; others read
            // after. Round j + 1 writes a buffer that round j - 1 read at
            // the latest (half a slot each, at least two along the ring),
            // whose readers have all arrived at round j.
            let slot = unsafe { self.seg.slot::<T>(self.m.me, h, mine.len()) };
            // Out of place, this rank's part goes into `out` after
            // arriving, so the copy overlaps the peers' arrival instead of
            // delaying it. When `out` is streamed into, it is copied from
            // the slot, still in this core's cache, not from `input`: one
            // read of the part from memory. Copying into the slot and
            // streaming into `out` in one loop instead (one read too) was
            // 1.6x slower at 128 MiB on 2 ranks (AMD EPYC, AVX-512 VM:
            // 12.4 -> 7.9 ms median, faster in 12 of 12 interleaved pairs):
            // plain stores between the streaming ones seem to break up
            // their write-combining. Streamed into the slot (`slot_stores`),
            // the part is not in this core's cache after all: it goes into
            // `out` from `input`.
            let t = Instant::now();
            let later = match input {
                Some(input) => {
                    copy_to_slot(slot, &input[mine.clone()], nt);
                    Some(if stream && !nt {
                        &*slot
                    } else {
                        &input[mine.clone()]
                    })
                }
                None => {
                    copy_to_slot(slot, &out[own.clone()], nt);
                    None
                }
            };
            took.wrote(t, bytes_of::<T>(mine.len()));
            // The peers may read the slot now (and this rank, below).
            let e = self.arrive(&mut st);
            if let Some(src) = later {
                copy_streaming(&mut out[own], src, stream_own);
            }
            self.wait_all(desc, deadline, e)?;
            let t = Instant::now();
            let mut bytes = 0;
            for r in (0..self.n()).filter(|&r| r != self.m.me) {
                let p = part(r);
                // SAFETY: rank r's buffer of this round, read after the barrier.
                let src = unsafe { self.seg.slot::<T>(r, h, p.len()) };
                copy_streaming(&mut out[place(r, &p)], src, stream);
                bytes += bytes_of::<T>(p.len());
            }
            took.read(t, bytes);
        }
        self.learn(&mut st, rounds, nt, &took);
        Ok(())
    }

    /// all_to_all a window at a time, as [`Inner::gather`] moves its parts:
    /// each round, this rank stages its window of every peer's chunk in
    /// its slot (cut in `n - 1` windows, one per peer: its own chunk is
    /// never staged, so on 2 ranks a window is as long as a gather's),
    /// arrives, copies its own chunk's window into `out` meanwhile, and
    /// after the barrier reads its window from every peer's slot into
    /// that peer's place in `out`. Two buffers along the ring, for
    /// gather's reason. It takes 1.2-1.3x an all_gather of the same
    /// output at 16-128 MiB on 2 ranks: it reads its whole input from
    /// memory, where a gather reads its part.
    pub(super) fn exchange_chunks<T: Element>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: &mut Vec<T>,
    ) -> Result<(), CommError> {
        let deadline = crate::work::deadline_in(self.m.timeout);
        let mut st = self.state.lock();
        self.agree(&mut st, desc, deadline)?;
        let (n, me, len) = (self.n(), self.m.me, input.len());
        // Agreement made every rank's input as long: chunk `p` is the same
        // range on every rank.
        let parts: Vec<std::ops::Range<usize>> = (0..n).map(|p| chunk_range(len, n, p)).collect();
        let m = parts[me].len();
        out.truncate(n * m);
        out.resize(n * m, T::ZERO);
        let w = self.window::<T>(n - 1, 2);
        let rounds = parts[0].len().div_ceil(w);
        let ring = self.claim::<T>(&mut st, rounds, 2);
        let nt = st.stores.streaming(rounds);
        let stream = bytes_of::<T>(n * m) >= stream_min_dest_bytes();
        // Where rank `from` stages its window for rank `to` (`to != from`):
        // the peers in rank order, `from` left out.
        let at_of = |to: usize, from: usize| (to - usize::from(to > from)) * w;
        let window = |p: usize, j: usize| {
            let s = (parts[p].start + j * w).min(parts[p].end);
            s..(s + w).min(parts[p].end)
        };
        let mut took = Measured::default();
        for j in 0..rounds {
            let h = ring.at(j);
            let t = Instant::now();
            let mut bytes = 0;
            for p in (0..n).filter(|&p| p != me) {
                let r = window(p, j);
                bytes += bytes_of::<T>(r.len());
                // SAFETY: only rank `me` writes its own ring; round j's
                // buffer was last read in round j - 2 at the latest, whose
                // readers have all arrived at round j - 1's barrier, which
                // this rank passed.
                copy_to_slot(
                    unsafe { self.seg.slot::<T>(me, h + at_of(p, me), r.len()) },
                    &input[r],
                    nt,
                );
            }
            took.wrote(t, bytes);
            let e = self.arrive(&mut st);
            // Where a window of chunk `me` goes in `out`, from rank `q`.
            let r = window(me, j);
            let at = |q: usize| q * m + r.start - parts[me].start..q * m + r.end - parts[me].start;
            copy_streaming(&mut out[at(me)], &input[r.clone()], stream);
            self.wait_all(desc, deadline, e)?;
            let t = Instant::now();
            for q in (0..n).filter(|&q| q != me) {
                // SAFETY: rank q's buffer of this round, complete (it
                // arrived after staging it), read after the barrier.
                let src = unsafe { self.seg.slot::<T>(q, h + at_of(me, q), r.len()) };
                copy_streaming(&mut out[at(q)], src, stream);
            }
            took.read(t, (n - 1) * bytes_of::<T>(r.len()));
        }
        self.learn(&mut st, rounds, nt, &took);
        Ok(())
    }
}

/// The first `l` elements of `tmp`, grown to `cap` (at least `l`) zeroed
/// elements the first time it is too short.
pub(super) fn scratch<T: Element>(tmp: &mut Vec<T>, cap: usize, l: usize) -> &mut [T] {
    if tmp.len() < l {
        tmp.resize(cap.max(l), T::ZERO);
    }
    &mut tmp[..l]
}

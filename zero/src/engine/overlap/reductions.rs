//! Gradient reductions: issued from the hooks as each unit's gradients
//! are whole (in `reduce_bucket_size` buckets, 16-bit or int8 when the
//! config asks), held in flight in issue order, and retired into the
//! gradient shards (under hybrid sharding, through their replicate-group
//! averages).

use half::{bf16, f16};
use zrt_collectives::{chunk_range, ProcessGroup, ReduceOp, Work};
use zrt_kernels::{cast, quant, reduce};

use crate::engine::timing::waiting;
use crate::engine::{elems, Compute, Inner, State};
use crate::flat::FlatLayout;
use crate::{glue, EngineError};

use super::announce::{
    check_announced, explain_by_prefetches, explain_uneven, uneven_after_backward, uneven_now,
    Disagreement, Kind, UnitIds,
};

/// A reduction in flight.
pub(in crate::engine) enum Reduce {
    All(Work<Vec<f32>>),
    /// fp32 reduce-scatter, in place: the result is the buffer's range
    /// (this rank's part), so no output is allocated and the buffer goes
    /// back to the pool whole.
    Scatter(Work<Vec<f32>>, std::ops::Range<usize>),
    /// `communication_data_type` bf16 / fp16: reduced in 16 bits, widened
    /// back to fp32 when waited for.
    AllBf16(Work<Vec<bf16>>),
    ScatterBf16(Work<(Vec<bf16>, Vec<bf16>)>),
    AllF16(Work<Vec<f16>>),
    ScatterF16(Work<(Vec<f16>, Vec<f16>)>),
    /// ZeRO++ qgZ (`zero_quantized_gradients`): every rank's packed piece
    /// of this rank's part (an all_to_all of `chunk` bytes per rank), cut
    /// as `cuts` says, from each of `ranks` ranks; unpacked and averaged
    /// in rank order when waited for.
    Quantized {
        work: Work<(Vec<u8>, Vec<u8>)>,
        cuts: Vec<usize>,
        chunk: usize,
        ranks: usize,
    },
}

/// A finished reduction: the result is `buf[range]`.
pub(in crate::engine) struct Reduced {
    /// The buffer holding the result (for a reduce-scatter in place, the
    /// whole input: the caller may reuse it).
    pub(in crate::engine) buf: Vec<f32>,
    range: std::ops::Range<usize>,
}

impl Reduced {
    /// The reduced values.
    pub(in crate::engine) fn values(&self) -> &[f32] {
        &self.buf[self.range.clone()]
    }
}

impl Reduce {
    /// Waits and returns the result in fp32.
    pub(in crate::engine) fn wait(self) -> Result<Reduced, EngineError> {
        fn widen<T>(
            v: &[T],
            f: impl Fn(&[T], &mut [f32]) -> Result<(), zrt_kernels::KernelError>,
        ) -> Result<Vec<f32>, EngineError> {
            let mut out = vec![0f32; v.len()];
            f(v, &mut out)?;
            Ok(out)
        }
        let whole = |buf: Vec<f32>| Reduced {
            range: 0..buf.len(),
            buf,
        };
        Ok(match self {
            Reduce::All(w) => whole(w.wait()?),
            Reduce::Scatter(w, range) => Reduced {
                buf: w.wait()?,
                range,
            },
            Reduce::AllBf16(w) => whole(widen(&w.wait()?, cast::bf16_to_f32)?),
            Reduce::ScatterBf16(w) => whole(widen(&w.wait()?.1, cast::bf16_to_f32)?),
            Reduce::AllF16(w) => whole(widen(&w.wait()?, cast::f16_to_f32)?),
            Reduce::ScatterF16(w) => whole(widen(&w.wait()?.1, cast::f16_to_f32)?),
            Reduce::Quantized {
                work,
                cuts,
                chunk,
                ranks,
            } => {
                let (_, packed) = work.wait()?;
                let (n, used) = (cuts.iter().sum::<usize>(), quant::packed_len_cut(&cuts));
                // Past the call agreement only a bug could make these differ.
                if packed.len() != ranks * chunk || used > chunk {
                    return Err(EngineError::Plan(format!(
                        "a packed gradient reduction received {} bytes, not {ranks} pieces of {chunk} holding {used} each (this is a bug in zrt)",
                        packed.len()
                    )));
                }
                let mut all = vec![0f32; ranks * n];
                for (q, x) in all.chunks_exact_mut(n.max(1)).enumerate() {
                    let at = q * chunk;
                    quant::dequantize_cut(&packed[at..at + used], &cuts, x)?;
                }
                let (sum, rest) = all.split_at_mut(n);
                // In rank order and in f32, on every backend alike (the
                // backends' reduce_scatter sums f32 in f64: this is not
                // that sum of the unpacked values, nor meant to be).
                for part in rest.chunks_exact(n.max(1)) {
                    sum.iter_mut().zip(part).for_each(|(s, x)| *s += x);
                }
                let k = ranks.max(1) as f32;
                sum.iter_mut().for_each(|s| *s /= k);
                Reduced {
                    buf: all,
                    range: 0..n,
                }
            }
        })
    }
}

/// Drops this backward's reductions unwaited (the workers still run them).
pub(super) fn drop_reductions(st: &mut State) {
    st.prog.inflight.clear();
    st.prog.replicating.clear();
    st.prog.inflight_elems = 0;
    st.prog.reduce_ids.clear();
}

/// Adds a sparse gradient (`embedding(.., sparse = true)`'s looked-up
/// rows, in any dtype, duplicates not summed yet) into `dst`, the
/// parameter's slot of a unit's fp32 gradient buffer, shaped `dims`: the
/// rows go straight into the flat buffer, so a vocabulary-sized parameter's
/// gradient is never also a dense matrix of its own.
fn add_sparse(dst: &mut [f32], dims: &[i64], g: &tch::Tensor) -> Result<(), tch::TchError> {
    if dst.is_empty() {
        return Ok(());
    }
    if dims.iter().product::<i64>() != dst.len() as i64 {
        return Err(tch::TchError::Shape(format!(
            "a sparse gradient of shape {dims:?} for a slot of {} elements (this is a bug in zrt)",
            dst.len()
        )));
    }
    let mut strides = vec![1i64; dims.len()];
    for i in (1..dims.len()).rev() {
        strides[i - 1] = strides[i] * dims[i];
    }
    // SAFETY: `dst` holds exactly the `dims` elements (checked above), as
    // f32 row-major, and stays borrowed mutably while the view (dropped
    // below) writes it.
    let mut view = unsafe {
        tch::Tensor::f_from_blob(
            dst.as_mut_ptr() as *const u8,
            dims,
            &strides,
            tch::Kind::Float,
            tch::Device::Cpu,
        )?
    };
    let _ = view.f_add_(&g.f_to_kind(tch::Kind::Float)?)?;
    Ok(())
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Takes unit `k`'s gradients and issues their reduction.
    pub(in crate::engine) fn launch_reduce(
        &self,
        st: &mut State,
        k: usize,
        free: bool,
    ) -> Result<(), EngineError> {
        // Not while the gradient of the unit's input is still to come to
        // a unit with frozen parameters: they compute it, after the last
        // trained one's gradient perhaps (`input_grad_ready` frees it).
        let frozen_needed = st.units[k].frozen.is_some() && self.input_grads.waiting(k) > 0;
        if free && !frozen_needed {
            // Before the gradient buffer is taken: the gathered parameters'
            // buffer, the same size in fp32, goes back to the pool and
            // becomes it, rather than the two (and the gradients) being
            // alive at once.
            self.free_if_gathered(st, k)?;
        }
        let u = &st.units[k];
        // A kept buffer (already paged in) with stale contents: every element
        // is written below, gradients where they exist and zeros elsewhere.
        let mut full = self.pools.f32.take(u.layout.padded, 0.0);
        let mut written = 0;
        for (slot, t) in u.layout.slots.iter().zip(&u.params) {
            full[written..slot.offset].fill(0.0);
            let dst = &mut full[slot.offset..slot.offset + slot.numel];
            let g = t.grad();
            if g.defined() && g.is_sparse() {
                dst.fill(0.0);
                add_sparse(dst, &t.size(), &g)?;
            } else if g.defined() {
                // Widened to fp32 before any reduction.
                let g = g.f_to_kind(tch::Kind::Float)?.f_contiguous()?;
                // SAFETY: a contiguous f32 tensor of `numel` elements.
                dst.copy_from_slice(unsafe { elems::<f32>(&g, slot.numel) });
            } else {
                dst.fill(0.0);
            }
            written = slot.offset + slot.numel;
            glue::clear_grad(t)?;
        }
        full[written..].fill(0.0);
        if st.prog.bare && self.cfg.batch.gas > 1 {
            // `Engine::backward` divides the loss by the accumulation steps;
            // a bare backward did not.
            reduce::scale(&self.threads, &mut full, 1.0 / self.cfg.batch.gas as f32);
        }
        if self.stage == 1 {
            reduce::accumulate(&self.threads, &mut st.shards[k].g, &full)?;
            st.prog.added.push(k);
            if self.stage1_reduces_now(st) {
                // The boundary's backward: reduce the step's sum now, from
                // a copy, so that the sum stays whole until `step()` (a
                // checkpoint saved before it holds it; a load replaces it).
                full.copy_from_slice(&st.shards[k].g);
                let shard = full.len() / self.group.size();
                st.shards[k].reduced = vec![0.0; shard];
                self.issue_unit_reduction(st, k, full)?;
            } else {
                self.pools.f32.give(full);
            }
        } else {
            self.issue_unit_reduction(st, k, full)?;
        }
        st.prog.launched[k] = true;
        Ok(())
    }

    /// Whether stage 1 reduces in this backward, each unit in its turn
    /// once its gradients are whole, rather than in `step()`: this
    /// backward ends the accumulation (DeepSpeed's stage 1 reduces from
    /// its hooks at the boundary too) and the ranks have agreed the order
    /// they reduce the units in (at the end of the first backward, see
    /// `agrees_launch_order`), so a unit one rank's loss leaves out holds
    /// back the later ones there rather than reordering its reductions.
    pub(in crate::engine) fn stage1_reduces_now(&self, st: &State) -> bool {
        self.stage == 1
            && (st.micro + 1) % self.cfg.batch.gas == 0
            && st.prog.order_agreed.is_some()
    }

    /// Issues the reduction of unit `k`'s gradient buffer `full` (an
    /// all-reduce at stage 0, reduce-scatters above), holding it in flight
    /// and retiring the oldest units' reductions past two buckets.
    fn issue_unit_reduction(
        &self,
        st: &mut State,
        k: usize,
        full: Vec<f32>,
    ) -> Result<(), EngineError> {
        // Name the unit to the peers first, as gathers do: units reduced
        // in different orders (a parameter only some ranks' losses use
        // completes a unit early on some ranks) would otherwise sum
        // same-sized buffers of different units into silent garbage.
        self.delay();
        let mut ids = vec![UnitIds::issue(&self.group, Kind::Reduce, k)];
        if let Some(r) = &self.replicate {
            ids.push(UnitIds::issue(r, Kind::Reduce, k));
        }
        st.prog.reduce_ids.push((k, ids));
        let n = if self.stage == 0 {
            1
        } else {
            self.group.size()
        };
        let layout = &st.units[k].layout;
        for (range, r) in self.reduce_in_buckets(full, self.stage == 0, layout)? {
            if matches!(r, Reduce::Quantized { .. }) {
                st.prog.counts.quantized_reductions += 1;
            }
            // A bucket's buffer: its range of every rank's shard.
            let elems = range.len() * n;
            st.prog.inflight_elems += elems;
            st.prog.inflight.push((k, range, r, elems));
        }
        // DeepSpeed keeps two buckets of `reduce_bucket_size` elements
        // of gradients in flight; here units wait for their reductions,
        // oldest first, once the buffers in flight exceed that (the
        // newest always stays in flight, to overlap what backward does
        // next). Otherwise every unit's full gradient would be alive at
        // the end of backward: the whole model's, in fp32, on each rank.
        let bound = self.reduce_bucket().saturating_mul(2);
        while st.prog.inflight_elems > bound
            && st.prog.reduce_ids.first().is_some_and(|(u, _)| *u != k)
        {
            self.retire_oldest(st)?;
        }
        Ok(())
    }

    /// `reduce_bucket_size` in elements (at least 1).
    fn reduce_bucket(&self) -> usize {
        let z = &self.cfg.config.zero;
        z.reduce_bucket_size.value().unwrap_or(u64::MAX).max(1) as usize
    }

    /// `overlap_comm: false`: backward waits in the hook for the
    /// reductions it just issued (and under hybrid sharding their
    /// replicate-group averages), so no gradient buffer outlives its unit's
    /// hook and communication never runs beside backward's compute.
    pub(super) fn wait_for_reductions(&self, st: &mut State) -> Result<(), EngineError> {
        let mut waited = || {
            while !st.prog.reduce_ids.is_empty() {
                self.retire_oldest_explained(st, uneven_after_backward)?;
            }
            self.finish_replicas(st)
        };
        waited().map_err(|e| explain_by_prefetches(st, e))
    }

    /// Waits for the oldest unit's reductions (once its announcement shows
    /// every rank reduced that unit) and adds them to its gradient shard,
    /// which frees their buffers.
    fn retire_oldest(&self, st: &mut State) -> Result<(), EngineError> {
        self.retire_oldest_explained(st, |st, d| uneven_now(st, d))
    }

    /// [`Self::retire_oldest`], with `explain` making the error when the
    /// ranks announced different units.
    fn retire_oldest_explained(
        &self,
        st: &mut State,
        explain: impl FnOnce(&mut State, Disagreement) -> EngineError,
    ) -> Result<(), EngineError> {
        if st.prog.reduce_ids.is_empty() {
            return Ok(());
        }
        let (k, works) = st.prog.reduce_ids.remove(0);
        check_announced(st, k, works, explain)?;
        // The previous retired unit's replicate averages have had a unit's
        // backward to run.
        self.finish_replicas(st)?;
        while st.prog.inflight.first().is_some_and(|f| f.0 == k) {
            let (k, range, r, elems) = st.prog.inflight.remove(0);
            st.prog.inflight_elems -= elems;
            self.finish_reduction(st, k, range, r)?;
        }
        Ok(())
    }

    /// Waits for one reduction of unit `k` and adds it to `range` of the
    /// unit's gradient shard; under hybrid sharding, issues its average
    /// across replicas instead, which [`Self::finish_replicas`] adds.
    fn finish_reduction(
        &self,
        st: &mut State,
        k: usize,
        range: std::ops::Range<usize>,
        r: Reduce,
    ) -> Result<(), EngineError> {
        // The ranks announced this very reduction, built alike (see
        // `agree`), so its shape matches theirs.
        let red = waiting(&mut st.timing, || r.wait())?;
        match self.replicate_average(red.values()) {
            Some(w) => st.prog.replicating.push((k, range, w)),
            None => self.add_reduced(st, k, range, red.values())?,
        }
        // A whole unit's gradient buffer (a reduce-scatter's input, or
        // stage 0's all-reduced buffer; not a bucket) serves the next
        // launch_reduce or gather of that size.
        if red.buf.len() == st.units[k].layout.padded {
            self.pools.f32.give(red.buf);
        }
        Ok(())
    }

    /// Waits for the replicate-group averages issued so far, in issue order,
    /// and adds each to its unit's gradient shard.
    fn finish_replicas(&self, st: &mut State) -> Result<(), EngineError> {
        for (k, range, w) in std::mem::take(&mut st.prog.replicating) {
            let v = waiting(&mut st.timing, || w.wait())?;
            self.add_reduced(st, k, range, &v)?;
        }
        Ok(())
    }

    /// Puts a reduced piece of unit `k`'s gradient into `range` of its
    /// shard: added to the accumulated shard (stages 2 and 3; stage 0's
    /// range is the whole buffer), or at stage 1 written to the step's
    /// reduced shard (the step's whole sum was reduced).
    fn add_reduced(
        &self,
        st: &mut State,
        k: usize,
        range: std::ops::Range<usize>,
        v: &[f32],
    ) -> Result<(), EngineError> {
        let sh = &mut st.shards[k];
        if self.stage == 1 {
            // The ranks announced this reduction, built alike (see
            // `agree`): only a bug could make the lengths differ.
            let Some(dst) = sh.reduced.get_mut(range).filter(|d| d.len() == v.len()) else {
                return Err(EngineError::Plan(format!(
                    "a reduced piece of {} gradients does not fit unit `{}`'s reduced shard of {} (this is a bug in zrt)",
                    v.len(),
                    st.units[k].name,
                    sh.reduced.len()
                )));
            };
            dst.copy_from_slice(v);
        } else {
            reduce::accumulate(&self.threads, &mut sh.g[range], v)?;
        }
        st.prog.added.push(k);
        Ok(())
    }

    /// Issues the averaging of a unit's full gradient buffer over the group
    /// in buckets of at most `reduce_bucket_size` elements: an all-reduce
    /// (`all`: pieces of the buffer) or reduce-scatters (each bucket takes
    /// the same slice of every rank's shard, staged rank-major, so each
    /// rank receives a contiguous piece of its own shard). Returns each
    /// bucket with the range of the result buffer (the whole buffer for
    /// all-reduce, the shard otherwise) it covers. Element-wise sums in the
    /// same rank order: bucketing changes no bit.
    pub(in crate::engine) fn reduce_in_buckets(
        &self,
        full: Vec<f32>,
        all: bool,
        layout: &FlatLayout,
    ) -> Result<Vec<(std::ops::Range<usize>, Reduce)>, EngineError> {
        let bucket = self.reduce_bucket();
        let n = self.group.size();
        let len = full.len();
        let mut out = Vec::new();
        if len <= bucket {
            self.delay();
            let range = if all { 0..len } else { 0..len / n };
            let cut = (!all).then(|| (layout, range.clone()));
            out.push((range, self.issue_reduce(full, cut)?));
            return Ok(out);
        }
        if all {
            for a in (0..len).step_by(bucket) {
                let r = a..(a + bucket).min(len);
                self.delay();
                out.push((r.clone(), self.issue_reduce(full[r].to_vec(), None)?));
            }
            return Ok(out);
        }
        // Reduce-scatter: `len` is a multiple of the group size (padding).
        let shard = len / n;
        let per = (bucket / n).max(1);
        for a in (0..shard).step_by(per) {
            let r = a..(a + per).min(shard);
            let mut staged = Vec::with_capacity(r.len() * n);
            for p in 0..n {
                staged.extend_from_slice(&full[p * shard + r.start..p * shard + r.end]);
            }
            self.delay();
            out.push((r.clone(), self.issue_reduce(staged, Some((layout, r)))?));
        }
        Ok(out)
    }

    /// Issues the averaging of `full` over the group: an all-reduce
    /// (`cut` None) or a reduce-scatter, in fp32 or, when the config asks for
    /// it (`communication_data_type`), in the 16-bit compute dtype; at
    /// stage 3 under `zero_quantized_gradients`, as an all_to_all of
    /// int8 pieces ([`Reduce::Quantized`]), each piece cut at the
    /// parameters' bounds of `cut`'s layout (`cut`: the unit's layout and
    /// the range of each rank's shard the pieces hold).
    pub(in crate::engine) fn issue_reduce(
        &self,
        full: Vec<f32>,
        cut: Option<(&FlatLayout, std::ops::Range<usize>)>,
    ) -> Result<Reduce, EngineError> {
        let g = &self.group;
        let all = cut.is_none();
        let qgz = self.stage == 3 && self.cfg.config.zero.zero_quantized_gradients;
        if let Some((l, r)) = cut.filter(|_| qgz) {
            // ZeRO++ qgZ: each rank's piece of `full` (rank-major, a
            // multiple of the group size) packed on its own, cut at its
            // parameters' bounds, so that the all_to_all hands every rank
            // its pieces and no scale spans two parameters. The pieces'
            // packed lengths differ (their cuts do): each goes in a chunk
            // of the longest one's length.
            let (ranks, n) = (g.size(), full.len() / g.size());
            let cuts: Vec<Vec<usize>> = (0..ranks)
                .map(|p| {
                    let at = p * l.shard_len();
                    l.segments(at + r.start..at + r.end)
                })
                .collect();
            let chunk = cuts.iter().map(|c| quant::packed_len_cut(c)).max();
            let chunk = chunk.unwrap_or(0);
            let mut packed = vec![0u8; ranks * chunk];
            for (p, c) in cuts.iter().enumerate() {
                let (at, used) = (p * chunk, quant::packed_len_cut(c));
                quant::quantize_cut(&full[p * n..(p + 1) * n], c, &mut packed[at..at + used])?;
            }
            self.pools.f32.give(full);
            let work = g.all_to_all(packed, Vec::new());
            let cuts = cuts.into_iter().nth(g.rank()).unwrap_or_default();
            return Ok(Reduce::Quantized {
                work,
                cuts,
                chunk,
                ranks,
            });
        }
        Ok(match (self.reduce_16, self.compute) {
            (true, Compute::Bf16) => {
                let mut h = vec![bf16::ZERO; full.len()];
                cast::f32_to_bf16(&full, &mut h)?;
                match all {
                    true => Reduce::AllBf16(g.all_reduce(h, ReduceOp::Avg)),
                    false => Reduce::ScatterBf16(g.reduce_scatter(h, Vec::new(), ReduceOp::Avg)),
                }
            }
            (true, Compute::F16) => {
                let mut h = vec![f16::ZERO; full.len()];
                cast::f32_to_f16(&full, &mut h)?;
                match all {
                    true => Reduce::AllF16(g.all_reduce(h, ReduceOp::Avg)),
                    false => Reduce::ScatterF16(g.reduce_scatter(h, Vec::new(), ReduceOp::Avg)),
                }
            }
            _ => match all {
                true => Reduce::All(g.all_reduce(full, ReduceOp::Avg)),
                false => {
                    let own = chunk_range(full.len(), g.size(), g.rank());
                    Reduce::Scatter(g.reduce_scatter_in_place(full, ReduceOp::Avg), own)
                }
            },
        })
    }

    /// Waits for every reduction issued so far, in issue order, and adds
    /// them to the gradient shards (under hybrid sharding through their
    /// replicate-group averages). `without` names the parameters this rank
    /// has no gradient for, for the error when the ranks announced
    /// different units.
    pub(super) fn settle_reductions(
        &self,
        st: &mut State,
        without: &[(String, String)],
    ) -> Result<(), EngineError> {
        for (k, works) in std::mem::take(&mut st.prog.reduce_ids) {
            // A mismatch here is `OutOfStep` (another engine call) or a
            // peer's checkpoint agreement, left for `checkpoint_on_a_peer`.
            check_announced(st, k, works, |_, d| {
                d.error(
                    |names| explain_uneven(&names, without),
                    |names, _| explain_uneven(&names, without),
                )
            })?;
        }
        st.prog.inflight_elems = 0;
        for (k, range, r, _) in std::mem::take(&mut st.prog.inflight) {
            self.finish_reduction(st, k, range, r)?;
        }
        self.finish_replicas(st)
    }
}

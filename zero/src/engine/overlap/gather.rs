//! Stage 3's gathers: a unit's shards (16-bit, int8 under qwZ, or hpZ's
//! secondary copies) all-gathered into a pooled buffer that becomes the
//! unit's storage, issued ahead in the order the last forward ran
//! (prefetch) and waited for when the unit is needed.

use std::sync::Arc;

use half::{bf16, f16};
use tch::Tensor;
use zrt_collectives::{ProcessGroup, Work};
use zrt_kernels::quant;

use crate::engine::elems::Elems;
use crate::engine::offload::ReadAhead;
use crate::engine::pool::{Pool, Pools};
use crate::engine::{Compute, CopyShard, Inner, State};
use crate::{glue, EngineError};

use super::announce::{explain_uneven, unit_name, without_gradient, Kind, UnitIds};
use super::stays_gathered;

/// A gather in flight, with the unit-order check issued before it.
pub(in crate::engine) struct Prefetch {
    pub(super) ids: UnitIds,
    /// What `ids` announced: a gather in forward or in backward.
    pub(super) kind: Kind,
    data: Fetch,
    /// Gathered from the hpZ secondary copies (dropped after), not the
    /// shards.
    pub(super) secondary: bool,
    /// The unit's sharded frozen parameters, and whether from the shard
    /// (which then comes back) rather than a secondary copy.
    pub(super) frozen: Option<(Fetch, bool)>,
}

/// ZeRO++ hpZ: the part of a unit's gathered parameters (and of its
/// sharded frozen ones) this rank keeps after forward for its hpZ group's
/// backward gather.
pub(in crate::engine) struct Secondary {
    pub(super) unit: Elems,
    pub(super) frozen: Option<Elems>,
}

/// An all-gather in flight: (this rank's part back, the whole).
pub(in crate::engine) enum Fetch {
    F32(Work<(Vec<f32>, Vec<f32>)>),
    Bf16(Work<(Vec<bf16>, Vec<bf16>)>),
    F16(Work<(Vec<f16>, Vec<f16>)>),
    /// ZeRO++ qwZ: every rank's shard packed as int8 codes and scales
    /// ([`quant::quantize_cut`]), cut at its parameters' bounds: `.1`
    /// holds each rank's cuts, in rank order (the packed lengths differ
    /// by rank, so the gather is an all_gather_v). The shard itself never
    /// left its unit.
    Packed(Work<(Vec<u8>, Vec<u8>)>, Vec<Vec<usize>>),
}

impl Fetch {
    /// Waits for the gather and, with `fill`, makes the whole (unpacked
    /// into `compute`'s dtype when packed) `flat`'s storage. Gives back
    /// this rank's part, unless it never left (packed).
    fn land(
        self,
        what: (&str, &str),
        (flat, padded): (&Tensor, usize),
        fill: bool,
        pools: &Pools,
        compute: Compute,
    ) -> Result<Option<Elems>, EngineError> {
        Ok(Some(match self {
            Fetch::F32(w) => {
                let (mine, full) = w.wait()?;
                install(what, flat, padded, full, fill, &pools.f32)?;
                Elems::F32(mine)
            }
            Fetch::Bf16(w) => {
                let (mine, full) = w.wait()?;
                install(what, flat, padded, full, fill, &pools.bf16)?;
                Elems::Bf16(mine)
            }
            Fetch::F16(w) => {
                let (mine, full) = w.wait()?;
                install(what, flat, padded, full, fill, &pools.f16)?;
                Elems::F16(mine)
            }
            Fetch::Packed(w, cuts) => {
                let packed = w.wait()?.1;
                if fill {
                    let to = (flat, padded);
                    match compute {
                        Compute::F32 => unpack(what, to, &packed, &cuts, &pools.f32)?,
                        Compute::Bf16 => unpack(what, to, &packed, &cuts, &pools.bf16)?,
                        Compute::F16 => unpack(what, to, &packed, &cuts, &pools.f16)?,
                    }
                }
                return Ok(None);
            }
        }))
    }
}

/// `shard` packed (for a qwZ gather, or as a frozen shard held packed),
/// cut as `cuts` says.
pub(in crate::engine) fn pack<T: quant::Quantizable>(
    shard: &[T],
    cuts: &[usize],
) -> Result<Vec<u8>, EngineError> {
    let mut packed = vec![0u8; quant::packed_len_cut(cuts)];
    quant::quantize_cut(shard, cuts, &mut packed)?;
    Ok(packed)
}

/// Unpacks a qwZ gather of every rank's shard, cut as `cuts` says for
/// each, into a pooled buffer that becomes `flat`'s storage.
fn unpack<T: quant::Quantizable + Send + 'static>(
    what: (&str, &str),
    (flat, padded): (&Tensor, usize),
    packed: &[u8],
    cuts: &[Vec<usize>],
    pool: &Arc<Pool<T>>,
) -> Result<(), EngineError> {
    let mut full = pool.take(padded, T::default());
    unpack_all(what, packed, cuts, &mut full)?;
    install(what, flat, padded, full, true, pool)
}

/// Unpacks every rank's packed shard (laid end to end in `packed`, in rank
/// order), cut as `cuts` says for each, into `full`, the whole padded
/// buffer.
pub(in crate::engine) fn unpack_all<T: quant::Quantizable>(
    what: (&str, &str),
    packed: &[u8],
    cuts: &[Vec<usize>],
    full: &mut [T],
) -> Result<(), EngineError> {
    let want: usize = cuts.iter().map(|c| quant::packed_len_cut(c)).sum();
    let elems: usize = cuts.iter().flatten().sum();
    let padded = full.len();
    if packed.len() != want || elems != padded {
        return Err(EngineError::Plan(format!(
            "unit `{}`{} gathered {} packed bytes, not the {want} of its layout's {padded} elements: did every rank build the same model?",
            what.0,
            what.1,
            packed.len(),
        )));
    }
    // The ranks' packed shards laid end to end are one buffer cut at all
    // of their cuts.
    quant::dequantize_cut(packed, &cuts.concat(), full)?;
    Ok(())
}

/// What a gather announces: one for backward, or any other.
fn gather_kind(st: &State) -> Kind {
    match st.prog.in_backward() || st.prog.in_autograd {
        true => Kind::BackwardGather,
        false => Kind::Gather,
    }
}

/// With `fill`, makes the gathered `full` the memory of `flat` (`padded`
/// elements; no copy, it goes back to `pool` when the storage is freed);
/// without, returns it to the pool. `what` names the flat for an error:
/// (unit, which part of it).
fn install<T: Copy + Send + 'static>(
    what: (&str, &str),
    flat: &Tensor,
    padded: usize,
    full: Vec<T>,
    fill: bool,
    pool: &Arc<Pool<T>>,
) -> Result<(), EngineError> {
    if !fill {
        pool.give(full);
        return Ok(());
    }
    if full.len() != padded {
        return Err(EngineError::Plan(format!(
            "unit `{}`{} gathered {} elements but the layout has {padded}: did every rank build the same model?",
            what.0,
            what.1,
            full.len(),
        )));
    }
    let pool = pool.clone();
    glue::adopt_storage(flat, full, move |v| pool.give(v))?;
    Ok(())
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Issues the unit-order check and the gather of unit `i`'s shard:
    /// packed as int8 under `zero_quantized_weights` unless `exact`
    /// (`with_full_params` and `unshard` hand out the true values).
    pub(in crate::engine) fn issue_gather(
        &self,
        st: &mut State,
        i: usize,
        exact: bool,
    ) -> Result<Prefetch, EngineError> {
        let quantized = self.cfg.config.zero.zero_quantized_weights;
        // hpZ: a unit with a secondary copy is gathered inside the (smaller,
        // closer) hpZ group from it (not for `exact`: under qwZ the copy
        // holds values unpacked from int8).
        let secondary = match (&self.hpz, exact && quantized) {
            (Some(h), false) => st.secondary[i].take().map(|sec| (h, sec)),
            _ => None,
        };
        if let Some((h, sec)) = secondary {
            st.prog.counts.hpz_gathers += 1;
            self.delay();
            let kind = gather_kind(st);
            let ids = UnitIds::issue(h, kind, i);
            self.delay();
            let u = &st.units[i];
            let data = sec.unit.gather(h, u.layout.padded, &self.pools);
            let frozen = match (sec.frozen, &u.frozen) {
                (Some(f), Some(p)) => Some((f.gather(h, p.padded(), &self.pools), false)),
                // No copy of it kept: from the shard, over the whole group.
                _ => self.issue_frozen(st, i)?,
            };
            return Ok(Prefetch {
                ids,
                kind,
                data,
                secondary: true,
                frozen,
            });
        }
        // Name the unit to the peers first: units run in different orders
        // would otherwise gather same-sized buffers into silent garbage.
        self.delay();
        let kind = gather_kind(st);
        let ids = UnitIds::issue(&self.group, kind, i);
        let padded = st.units[i].layout.padded;
        // The swap reads ahead the unit gathered after this one.
        let next = st.prog.order.after(i, !st.prog.in_backward());
        let sh = &mut st.shards[i];
        self.page_in(sh, i, ReadAhead::Gather(next))?;
        self.delay();
        let g = &self.group;
        let data = if quantized && !exact {
            st.prog.counts.quantized_gathers += 1;
            // The shard stays: what goes out is its packed copy, cut at its
            // parameters' bounds (every rank knows every rank's cuts).
            let cuts = st.units[i].layout.shard_segments();
            let mine = cuts.get(g.rank()).map_or(&[][..], |c| c);
            let mine = match &sh.copy {
                CopyShard::Bf16(v) => pack(v, mine)?,
                CopyShard::F16(v) => pack(v, mine)?,
                CopyShard::None => pack(&sh.master, mine)?,
            };
            Fetch::Packed(g.all_gather_v(mine, Vec::new()), cuts)
        } else {
            match &mut sh.copy {
                CopyShard::Bf16(v) => Fetch::Bf16(
                    g.all_gather(std::mem::take(v), self.pools.bf16.take(padded, bf16::ZERO)),
                ),
                CopyShard::F16(v) => Fetch::F16(
                    g.all_gather(std::mem::take(v), self.pools.f16.take(padded, f16::ZERO)),
                ),
                CopyShard::None => Fetch::F32(g.all_gather(
                    std::mem::take(&mut sh.master),
                    self.pools.f32.take(padded, 0.0),
                )),
            }
        };
        Ok(Prefetch {
            ids,
            kind,
            data,
            secondary: false,
            frozen: self.issue_frozen(st, i)?,
        })
    }

    /// Issues the gather of unit `i`'s sharded frozen parameters, if it has
    /// any (their shard goes with it and comes back in `finish_gather`).
    fn issue_frozen(&self, st: &mut State, i: usize) -> Result<Option<(Fetch, bool)>, EngineError> {
        let Some(p) = st.units[i].frozen.as_mut() else {
            return Ok(None);
        };
        let ahead = self.pswap.as_ref().and_then(|ps| ps.frozen_ahead(i));
        st.prog.counts.frozen_read_ahead += u64::from(ahead.is_some());
        self.delay();
        Ok(Some(p.gather(&self.group, &self.pools, ahead)?))
    }

    /// hpZ: before unit `i` is freed after forward, keeps this rank's part
    /// of it for the hpZ group's backward gather.
    pub(in crate::engine) fn keep_secondary(&self, st: &mut State, i: usize) {
        let Some(h) = &self.hpz else {
            return;
        };
        let u = &st.units[i];
        let part = |padded: usize| {
            let n = padded / h.size();
            h.rank() * n..(h.rank() + 1) * n
        };
        let keep = |flat: &Tensor, padded: usize| {
            // SAFETY: the unit is gathered (its flat tensors hold their
            // padded elements of the compute dtype), under the state lock.
            unsafe { Elems::of_flat(flat, padded, self.compute, part(padded)) }
        };
        st.secondary[i] = Some(Secondary {
            unit: keep(&u.flat, u.layout.padded),
            frozen: u.frozen.as_ref().map(|p| keep(&p.flat, p.padded())),
        });
    }

    /// Completes a gather of unit `i`: checks the order, gives the shard
    /// back to the unit and, with `fill`, makes its parameters the gathered
    /// values.
    pub(in crate::engine) fn finish_gather(
        &self,
        st: &mut State,
        i: usize,
        p: Prefetch,
        fill: bool,
    ) -> Result<(), EngineError> {
        let t = std::time::Instant::now();
        if let Some(d) = p.ids.disagree(p.kind, i, |x| unit_name(&st.units, x))? {
            return Err(d.error(EngineError::UnitOrder, |names, reduced| {
                explain_uneven(&names, &without_gradient(st, reduced))
            }));
        }
        let (u, sh) = (&mut st.units[i], &mut st.shards[i]);
        let (pools, compute) = (&self.pools, self.compute);
        if let (Some((f, from_shard)), Some(part)) = (p.frozen, u.frozen.as_mut()) {
            let what = (u.name.as_str(), "'s frozen parameters");
            let to = (&part.flat, part.layout.padded);
            if let (Some(mine), true) = (f.land(what, to, fill, pools, compute)?, from_shard) {
                part.give_back(mine);
            }
        }
        let what = (u.name.as_str(), "");
        // Unpacked values: gathered packed, or re-gathered (hpZ) from the
        // secondary copy of a unit forward gathered packed.
        let packed = matches!(p.data, Fetch::Packed(..))
            || (p.secondary && self.cfg.config.zero.zero_quantized_weights);
        // With `fill`, the gathered buffer becomes the unit's storage: no
        // copy, and it returns to the pool when the unit is freed.
        let mine = p
            .data
            .land(what, (&u.flat, u.layout.padded), fill, pools, compute)?;
        match mine {
            _ if p.secondary => {}
            Some(Elems::F32(v)) => sh.master = v,
            Some(Elems::Bf16(v)) => sh.copy = CopyShard::Bf16(v),
            Some(Elems::F16(v)) => sh.copy = CopyShard::F16(v),
            None => {}
        }
        if fill {
            st.quantized[i] = packed;
        }
        let sh = &mut st.shards[i];
        self.page_out(sh, i, false)?;
        st.timing.waited(t.elapsed());
        Ok(())
    }

    /// Stage 3: gathers unit `i` (from its prefetch if one was issued);
    /// `exact`: with its true values, never packed as int8 (a unit that
    /// holds unpacked ones is gathered again).
    pub(in crate::engine) fn gather(
        &self,
        st: &mut State,
        i: usize,
        exact: bool,
    ) -> Result<(), EngineError> {
        if exact && st.quantized[i] {
            self.release(st, i)?;
        }
        if st.gathered[i] {
            return Ok(());
        }
        let p = match st.prog.prefetch[i].take() {
            Some(p) if exact && matches!(p.data, Fetch::Packed(..)) => {
                st.prog.counts.unused += 1;
                self.finish_gather(st, i, p, false)?;
                st.prog.counts.on_demand += 1;
                self.issue_gather(st, i, true)?
            }
            Some(p) => {
                st.prog.counts.prefetched += 1;
                p
            }
            None => {
                st.prog.counts.on_demand += 1;
                self.issue_gather(st, i, exact)?
            }
        };
        self.finish_gather(st, i, p, true)?;
        st.gathered[i] = true;
        Ok(())
    }

    /// When `unit` is needed, issues the gather of the unit needed after it
    /// ([`super::RunOrder::after`]), within the prefetch bounds of the config.
    pub(in crate::engine) fn prefetch_after(
        &self,
        st: &mut State,
        unit: usize,
        forward: bool,
    ) -> Result<(), EngineError> {
        let Some(next) = st.prog.order.after(unit, forward) else {
            return Ok(());
        };
        if next >= st.units.len()
            || stays_gathered(st, next)
            || st.gathered[next]
            || st.prog.prefetch[next].is_some()
        {
            return Ok(());
        }
        let z = &self.cfg.config.zero;
        let bucket = z.stage3_prefetch_bucket_size.value().unwrap_or(0) as usize;
        let live: usize = (0..st.units.len())
            .filter(|&k| st.gathered[k] || st.prog.prefetch[k].is_some())
            .map(|k| st.units[k].gathered_len())
            .sum();
        let (u, size) = (&st.units[next], st.units[next].gathered_len());
        if u.layout.numel + u.frozen.as_ref().map_or(0, |p| p.layout.numel) > bucket
            || (live + size) as u64 > z.stage3_max_live_parameters
        {
            return Ok(());
        }
        st.prog.prefetch[next] = Some(self.issue_gather(st, next, false)?);
        Ok(())
    }

    /// Completes every gather issued ahead and not used (the shards go
    /// back to their units), before anything reads the shards.
    pub(in crate::engine) fn drain_prefetch(&self, st: &mut State) -> Result<(), EngineError> {
        for i in 0..st.units.len() {
            if let Some(p) = st.prog.prefetch[i].take() {
                st.prog.counts.unused += 1;
                self.finish_gather(st, i, p, false)?;
            }
        }
        Ok(())
    }
}

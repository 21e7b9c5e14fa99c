//! LAMB's step (`optimizer.type: "Lamb"`, DeepSpeed's `FusedLamb`): each
//! parameter's update is scaled by its trust ratio, the norm of the whole
//! parameter over the norm of its update. A shard cuts parameters, so no
//! rank can take those norms alone. Every unit's first pass updates m and
//! v and writes the update into a scratch buffer; each rank sums, per
//! parameter, the squares of the pieces it holds; one all-reduce over the
//! shard group (f64, in rank order: the same bits on every backend and
//! every rank) gives every rank the whole parameters' sums; the second
//! pass computes each update again (to the same bits) and applies it
//! scaled, writing the compute copy. Stage 0 holds every parameter whole
//! and needs no all-reduce; under hybrid sharding the replicas compute
//! alike. The only scratch is one fp32 buffer as long as the largest piece
//! of a parameter this rank holds, reused.
//!
//! Both passes walk the state wherever it lives (`Inner::each_state`):
//! with the NVMe swaps each streams every unit's state through the swap
//! once, so a LAMB step reads the swap file twice (Adam's: once) and
//! writes what each pass changed: the moments after the first, the
//! master (swapped under bf16/fp16; none in fp32) after the second, as
//! much in all as Adam's one write. The swap's chunks cut parameters,
//! and a piece's sums are then added chunk by chunk, in another order
//! than in memory: like the stages, LAMB with the swaps agrees with LAMB
//! in memory within rounding, not to the bit.

use std::ops::Range;

use zrt_collectives::{ProcessGroup, ReduceOp};
use zrt_kernels::{lamb_moments, lamb_update, reduce, ComputeCopy, LambConfig};

use super::offload::{StateRange, Writes};
use super::{groups, Inner, State, Unit, Update};
use crate::EngineError;

/// `c`'s elements `r`, reborrowed.
pub(super) fn sub_copy<'b>(c: &'b mut ComputeCopy<'_>, r: Range<usize>) -> ComputeCopy<'b> {
    match c {
        ComputeCopy::None => ComputeCopy::None,
        ComputeCopy::Bf16(d) => ComputeCopy::Bf16(&mut d[r]),
        ComputeCopy::F16(d) => ComputeCopy::F16(&mut d[r]),
    }
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// This step's LAMB settings for a parameter treated as `setting` says
    /// (its weight decay, its learning-rate scale).
    fn lamb_config(&self, up: &Update<'_>, setting: groups::Setting) -> LambConfig {
        let o = &self.cfg.config.optimizer;
        LambConfig {
            adam: setting.adam(up.adam),
            max_coeff: o.max_coeff,
            min_coeff: o.min_coeff,
            eps_inside_sqrt: o.eps_inside_sqrt,
        }
    }

    /// The parameters of unit `u` that this rank's optimizer range holds
    /// a piece of: (the parameter's index in the unit, its setting, the
    /// piece's elements in the range). LAMB's and Muon's steps walk them.
    pub(super) fn own_pieces(&self, u: &Unit) -> Vec<(usize, groups::Setting, Range<usize>)> {
        let whole = self.whole(u, 0..self.own_range(u).len());
        (u.layout.indexed_pieces(whole))
            .map(|(j, s, _, dst)| (j, self.settings.get(&s.name), dst))
            .collect()
    }

    /// One LAMB step over every unit (see the module doc).
    pub(super) fn lamb_step(
        &self,
        st: &mut State,
        up: &Update<'_>,
        stage1: bool,
    ) -> Result<(), EngineError> {
        // Each unit's first parameter's place in `sums` (two per parameter).
        let first: Vec<usize> = (st.units.iter())
            .scan(0, |at, u| {
                let here = *at;
                *at += u.layout.slots.len();
                Some(here)
            })
            .collect();
        let total = st.units.iter().map(|u| u.layout.slots.len()).sum::<usize>();
        let mut sums = vec![0f64; 2 * total];
        let pieces: Vec<_> = st.units.iter().map(|u| self.own_pieces(u)).collect();
        let longest = (pieces.iter().flatten())
            .map(|(_, _, d)| d.len())
            .max()
            .unwrap_or(0);
        let mut scratch = vec![0f32; longest];
        // Pass one: new moments, and each parameter's sums over this
        // rank's pieces. Padding and alignment gaps are no parameter's:
        // their m and v stay zero.
        let moments = Writes {
            params: false,
            moments: true,
        };
        self.each_state(st, stage1, moments, |k, u, r, s, copy| {
            let StateRange {
                p: master, g, m, v, ..
            } = s;
            let (p, _) = self.target(u, r.clone(), master, copy);
            for (j, setting, d) in within(&pieces[k], &r) {
                let cfg = self.lamb_config(up, setting);
                let upd = &mut scratch[..d.len()];
                let (pd, md, vd) = (&mut p[d.clone()], &mut m[d.clone()], &mut v[d.clone()]);
                lamb_moments(
                    &self.threads,
                    &cfg,
                    up.scale,
                    pd,
                    &g[d.clone()],
                    md,
                    vd,
                    upd,
                )?;
                let at = 2 * (first[k] + j);
                sums[at] += reduce::sum_of_squares(&self.threads, pd);
                sums[at + 1] += reduce::sum_of_squares(&self.threads, upd);
            }
            Ok(())
        })?;
        if self.stage > 0 {
            // Every rank's pieces of every parameter, added in rank order.
            sums = self.group.all_reduce(sums, ReduceOp::Sum).wait()?;
        }
        // Pass two: each update again, scaled by its parameter's trust
        // ratio, into the parameters and their compute copy.
        let params = Writes {
            params: true,
            moments: false,
        };
        self.each_state(st, stage1, params, |k, u, r, s, copy| {
            let StateRange {
                p: master, m, v, ..
            } = s;
            let (p, mut copy) = self.target(u, r.clone(), master, copy);
            for (j, setting, d) in within(&pieces[k], &r) {
                let cfg = self.lamb_config(up, setting);
                let at = 2 * (first[k] + j);
                let step = cfg.step_size(up.step) * cfg.trust(sums[at], sums[at + 1]);
                // The update pass one summed, computed again to its bits
                // and applied in the same pass.
                let (pd, md, vd) = (&mut p[d.clone()], &m[d.clone()], &mut v[d.clone()]);
                let copy = sub_copy(&mut copy, d.clone());
                lamb_update(&self.threads, &cfg, step, pd, md, vd, copy)?;
            }
            Ok(())
        })
    }
}

/// The parts of `pieces` (a unit's, as [`Inner::own_pieces`] gives them)
/// within elements `r` of the optimizer range, as offsets from `r.start`:
/// the swap streams a unit in chunks that may cut a piece.
pub(super) fn within<'p>(
    pieces: &'p [(usize, groups::Setting, Range<usize>)],
    r: &Range<usize>,
) -> impl Iterator<Item = (usize, groups::Setting, Range<usize>)> + 'p {
    let r = r.clone();
    pieces.iter().filter_map(move |(j, setting, d)| {
        let (lo, hi) = (d.start.max(r.start), d.end.min(r.end));
        (lo < hi).then(|| (*j, *setting, lo - r.start..hi - r.start))
    })
}

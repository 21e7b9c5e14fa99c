//! Muon's step (`optimizer.type: "Muon"`, DeepSpeed's `MuonWithAuxAdam`
//! with `torch.optim.Muon`'s update): the parameters the plan gives Muon
//! (the hidden 2-D weights, [`ShardPlan::use_muon`]) step by their
//! momentum orthogonalized over the whole matrix; the others by AdamW.
//!
//! A shard cuts matrices, and the orthogonalization (a Newton-Schulz
//! iteration of matrix products) needs each one whole. Three parts, as
//! DeepSpeed's and Moonlight's distributed Muon do it:
//!
//! 1. every rank updates the momentum of the Muon pieces it holds and
//!    writes what the iteration runs on (Nesterov's mix) in the place of
//!    their gradient, spent once read, element by element
//!    (`zrt_kernels::muon_momentum`);
//! 2. per unit, each matrix has one owner in the shard group
//!    ([`owners`]: each unit split as evenly as its sizes allow, units of
//!    one matrix taking turns); an all-gather of each matrix's pieces
//!    (`all_gather_v`, one matrix at a time) gives the owner the matrix
//!    whole (the other ranks drop it at once); the owners run the
//!    iteration through libtorch in bf16, as torch does; then each
//!    result is broadcast from its owner and every rank copies its piece
//!    into the gradient's place: exact, the same bits on every rank and
//!    every backend;
//! 3. every rank applies its shard: Muon's pieces by decay and the
//!    orthogonalized update (`zrt_kernels::muon_apply`), the others by
//!    AdamW (its rate `adam_lr`, kept in ratio to the schedule's).
//!
//! Stage 0 holds every matrix whole: no gathers, its owners split the
//! iterations as well, and the broadcasts hand out the results, as Keller
//! Jordan's DDP Muon splits them; under hybrid sharding the replicas
//! compute alike. The iteration's cost is that of a few forward passes
//! through the matrices (five iterations, each three matrix products);
//! the owners split it across the shard group.
//!
//! Both element-wise passes walk the state wherever it lives
//! (`Inner::each_state`): with the NVMe swaps, the first writes back the
//! moments only, the second everything. Beyond the state, the step holds
//! a rank's owned matrices of one unit (whole, then their results) and
//! one matrix in flight, fp32: the gradient buffers carry the rest. (A
//! first version gathered whole units and reduce-scattered a unit-long
//! buffer of results: about two and a half units of fp32 per rank, 6
//! blocks of `checkpoint_memory`'s 16-block GPT over two ranks where
//! this holds 2, for the same step time. Issuing the
//! next unit's gather before this unit's iterations, so that a rank with
//! less of a unit goes on rather than waits, was measured 7% faster on
//! the base GPT, at two more units in flight: not kept.)
//! The matrices keep no `v`: in memory each unit's `v` is packed, AdamW's
//! pieces alone ([`VLayout`]), as DeepSpeed's Muon keeps none for them;
//! checkpoints and the NVMe swap keep the whole range, zeros there (the
//! swap's streams neither read nor write a chunk's `v` that only
//! matrices fill: `VLayout::covers`).
//!
//! [`VLayout`]: super::v_layout::VLayout
//!
//! [`ShardPlan::use_muon`]: crate::ShardPlan::use_muon

use std::ops::Range;

use tch::{Kind, Tensor};
use zrt_collectives::ProcessGroup;
use zrt_kernels::{adam_step, muon_apply, muon_momentum, AdamShard, MuonConfig};

use super::lamb::{sub_copy, within};
use super::offload::{StateRange, Writes};
use super::{out_of_step, Inner, State, Unit, Update};
use crate::EngineError;

/// What the iteration clamps the matrix's norm to from below before
/// dividing by it (torch's `eps`).
const NS_EPS: f64 = 1e-7;

/// The matrix Muon sees of a parameter of `shape`: its first dimension by
/// the rest (a convolution's filters flattened, as DeepSpeed does).
pub(super) fn matrix(shape: &[i64]) -> (i64, i64) {
    let rows = shape.first().copied().unwrap_or(1);
    (rows, shape.iter().skip(1).product())
}

/// The orthogonalization of the `rows` x `cols` matrix `u` (row-major):
/// `steps` Newton-Schulz iterations of the quintic `(a, b, c)` in bf16,
/// libtorch's operations in
/// `torch.optim.Muon`'s order (a wide matrix's form; a tall one is
/// transposed in and out), returned in fp32.
pub(super) fn orthogonalize(
    u: &[f32],
    rows: i64,
    cols: i64,
    steps: u32,
    (a, b, c): (f64, f64, f64),
) -> Result<Vec<f32>, EngineError> {
    let torch =
        |e: tch::TchError| EngineError::Torch(format!("Muon's Newton-Schulz iteration: {e}"));
    let g = Tensor::f_from_slice(u).map_err(torch)?;
    let g = g.f_view([rows, cols]).map_err(torch)?;
    let mut x = g.f_to_kind(Kind::BFloat16).map_err(torch)?;
    let tall = rows > cols;
    if tall {
        x = x.f_tr().map_err(torch)?;
    }
    let norm = x
        .f_norm()
        .map_err(torch)?
        .f_clamp_min(NS_EPS)
        .map_err(torch)?;
    x = x.f_div(&norm).map_err(torch)?;
    for _ in 0..steps {
        // addmm's beta and alpha, through the batched form tch exposes.
        let x3 = x.f_unsqueeze(0).map_err(torch)?;
        let gram = x3
            .f_matmul(&x3.f_transpose(1, 2).map_err(torch)?)
            .map_err(torch)?;
        let poly = gram.f_baddbmm(&gram, &gram, b, c).map_err(torch)?;
        x = (x3.f_baddbmm(&poly, &x3, a, 1.0).map_err(torch)?)
            .f_squeeze_dim(0)
            .map_err(torch)?;
    }
    if tall {
        x = x.f_tr().map_err(torch)?;
    }
    let out = x
        .f_to_kind(Kind::Float)
        .map_err(torch)?
        .f_contiguous()
        .map_err(torch)?;
    let mut v = vec![0f32; u.len()];
    out.f_copy_data(&mut v, u.len()).map_err(torch)?;
    Ok(v)
}

/// Which of `ranks` ranks orthogonalizes each matrix of each unit, given
/// each one's cost: unit by unit, the costliest first, each to the rank
/// with the least of that unit's work so far, then the least over the
/// units before (then the lower rank); the same answer on every rank.
/// Balanced within each unit, because a unit's results are handed out
/// before the next unit's matrices begin (a rank with less of a unit waits for
/// the others there); across units, so that units of one matrix each
/// take turns.
pub(super) fn owners(units: &[Vec<f64>], ranks: usize) -> Vec<Vec<usize>> {
    let mut total = vec![0f64; ranks.max(1)];
    (units.iter())
        .map(|costs| {
            let mut order: Vec<usize> = (0..costs.len()).collect();
            order.sort_by(|&i, &j| costs[j].total_cmp(&costs[i]).then(i.cmp(&j)));
            let (mut here, mut owner) = (vec![0f64; total.len()], vec![0; costs.len()]);
            for i in order {
                let key = |r: usize| (here[r], total[r], r);
                let r = (0..here.len())
                    .min_by(|&a, &b| {
                        let (x, y) = (key(a), key(b));
                        x.0.total_cmp(&y.0)
                            .then(x.1.total_cmp(&y.1))
                            .then(x.2.cmp(&y.2))
                    })
                    .unwrap_or(0);
                here[r] += costs[i];
                total[r] += costs[i];
                owner[i] = r;
            }
            owner
        })
        .collect()
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// What Muon multiplies a matrix's rate by (torch's `adjust_lr_fn`).
    fn muon_adjust(&self, rows: i64, cols: i64) -> f64 {
        let (r, c) = (rows as f64, cols as f64);
        match self.cfg.config.optimizer.match_rms_adamw {
            true => 0.2 * r.max(c).sqrt(),
            false => (r / c).max(1.0).sqrt(),
        }
    }

    /// What the AdamW half's rate is to the schedule's (Muon's).
    fn adam_ratio(&self) -> f64 {
        let o = &self.cfg.config.optimizer;
        let base = o.lr.value().unwrap_or(1e-3);
        match o.adam_lr {
            Some(r) if base > 0.0 => r / base,
            Some(_) => 0.0,
            None => 1.0,
        }
    }

    /// Unit `u`'s Muon parameters: (index in the unit, its elements in the
    /// unit's flat buffer, its matrix), in layout order. Every rank sees
    /// the same list, whichever pieces it holds.
    pub(super) fn muon_matrices(&self, u: &Unit) -> Vec<(usize, Range<usize>, (i64, i64))> {
        (u.layout.slots.iter().enumerate())
            .filter(|(_, s)| s.numel > 0 && self.settings.get(&s.name).muon)
            .map(|(j, s)| (j, s.offset..s.offset + s.numel, matrix(&s.shape)))
            .collect()
    }

    /// Part two of the step for unit `k` (`u`): `g` holds this rank's
    /// range `here` of the unit's flat buffer (Nesterov's mix over the
    /// matrices' pieces); each matrix of `ms` is gathered whole on its
    /// owner (`owner`, an all-gather of the pieces over the shard group:
    /// the others drop it), the owners orthogonalize theirs, and each
    /// result is broadcast from its owner, every rank taking its piece
    /// into `g`. Stage 0 holds every matrix whole and skips the gathers.
    fn orthogonalize_unit(
        &self,
        k: usize,
        u: &Unit,
        g: &mut [f32],
        here: Range<usize>,
        ms: &[(usize, Range<usize>, (i64, i64))],
        owner: &[usize],
    ) -> Result<(), EngineError> {
        let (ranks, me) = (self.group.size(), self.group.rank());
        let o = &self.cfg.config.optimizer;
        let (steps, abc) = (o.ns_steps, o.ns_coefficients);
        let name = |j: usize| u.layout.slots[j].name.as_str();
        // This rank's piece of matrix `e` (maybe none): where it lies in
        // `g`, and in the matrix.
        let piece = |e: &Range<usize>| {
            let (lo, hi) = (e.start.max(here.start), e.end.min(here.end));
            match lo < hi {
                true => (lo - here.start..hi - here.start, lo - e.start..hi - e.start),
                false => (0..0, 0..0),
            }
        };
        // Stage 0, and a group of one, hold every matrix whole on every
        // rank (the same answer on every rank: each gathers, or none).
        let gather = self.stage > 0 && ranks > 1;
        // The owned matrices whole (a copy only where they were gathered),
        // then their results.
        let mut mine: Vec<Option<Vec<f32>>> = vec![None; ms.len()];
        // What came back of matrix `e` is the matrix, or a peer made
        // another call here.
        let whole = |got: Vec<f32>, e: &Range<usize>, what: &dyn Fn() -> String| {
            if got.len() == e.len() {
                return Ok(got);
            }
            let why = format!("{} and got {}", what(), got.len());
            Err(EngineError::OutOfStep(why))
        };
        let gathered = ms.iter().zip(owner).enumerate().filter(|_| gather);
        for (i, ((j, e, _), &who)) in gathered {
            let (local, _) = piece(e);
            let what = || {
                format!(
                    "this rank gathered unit {k}'s Muon matrix `{}` ({} elements)",
                    name(*j),
                    e.len()
                )
            };
            let (_, got) = (self.group.all_gather_v(g[local].to_vec(), Vec::new()))
                .wait()
                .map_err(|err| out_of_step(err, what))?;
            let got = whole(got, e, &what)?;
            if who == me {
                mine[i] = Some(got);
            }
        }
        for (i, ((_, e, (rows, cols)), &who)) in ms.iter().zip(owner).enumerate() {
            if who == me {
                let x = match &mine[i] {
                    Some(m) => orthogonalize(m, *rows, *cols, steps, abc)?,
                    None => orthogonalize(&g[piece(e).0], *rows, *cols, steps, abc)?,
                };
                mine[i] = Some(x);
            }
        }
        for (i, ((j, e, _), &who)) in ms.iter().zip(owner).enumerate() {
            let (local, within) = piece(e);
            let result = match (ranks, mine[i].take()) {
                (1, Some(x)) => x,
                (_, x) => {
                    let what = || {
                        format!(
                            "this rank took unit {k}'s Muon update of `{}` ({} elements) from rank {who}",
                            name(*j),
                            e.len()
                        )
                    };
                    let buf = x.unwrap_or_else(|| vec![0f32; e.len()]);
                    let got = (self.group.broadcast(buf, who).wait())
                        .map_err(|err| out_of_step(err, what))?;
                    whole(got, e, &what)?
                }
            };
            g[local].copy_from_slice(&result[within]);
        }
        Ok(())
    }

    /// One Muon step over every unit (see the module doc).
    pub(super) fn muon_step(
        &self,
        st: &mut State,
        up: &Update<'_>,
        stage1: bool,
    ) -> Result<(), EngineError> {
        let o = &self.cfg.config.optimizer;
        let momentum = MuonConfig {
            momentum: o.momentum,
            nesterov: o.nesterov,
        };
        let pieces: Vec<_> = st.units.iter().map(|u| self.own_pieces(u)).collect();
        let matrices: Vec<_> = st.units.iter().map(|u| self.muon_matrices(u)).collect();
        // Part one: the momentum, and in the gradient's place what the
        // iteration runs on, over this rank's pieces of the matrices.
        let moments = Writes {
            params: false,
            moments: true,
        };
        self.each_state(st, stage1, moments, |k, _, r, s, _| {
            let StateRange { g, m, .. } = s;
            for (_, setting, d) in within(&pieces[k], &r) {
                if setting.muon {
                    muon_momentum(&momentum, up.scale, &mut g[d.clone()], &mut m[d])?;
                }
            }
            Ok(())
        })?;
        // Part two: each matrix whole on its owner, orthogonalized there,
        // and every rank's piece of the result back in the gradient's
        // place; a unit at a time, one matrix's buffers at a time beyond
        // the owner's share of the unit.
        let ranks = self.group.size();
        // A matrix's iterations cost its elements times its smaller side.
        let costs: Vec<Vec<f64>> = (matrices.iter())
            .map(|ms| (ms.iter()).map(|(_, e, (r, c))| e.len() as f64 * (*r).min(*c) as f64))
            .map(Iterator::collect)
            .collect();
        let owner = owners(&costs, ranks);
        for (k, u) in st.units.iter().enumerate() {
            let sh = &mut st.shards[k];
            let g = if stage1 { &mut sh.reduced } else { &mut sh.g };
            let here = self.whole(u, 0..self.own_range(u).len());
            self.orthogonalize_unit(k, u, g, here, &matrices[k], &owner[k])?;
        }
        // Part three: every piece's update, into the parameters and their
        // compute copy: the matrices' from the gradient's place, AdamW's
        // from the gradient.
        let ratio = self.adam_ratio();
        self.each_state(st, stage1, Writes::ALL, |k, u, r, s, copy| {
            let StateRange {
                p: master,
                g,
                m,
                v,
                v_layout,
            } = s;
            let (p, mut copy) = self.target(u, r.clone(), master, copy);
            for (j, setting, d) in within(&pieces[k], &r) {
                let cfg = setting.adam(up.adam);
                let cp = sub_copy(&mut copy, d.clone());
                if setting.muon {
                    let (rows, cols) = matrix(&u.layout.slots[j].shape);
                    let adjusted = cfg.lr * self.muon_adjust(rows, cols);
                    muon_apply(
                        cfg.lr,
                        cfg.weight_decay,
                        adjusted,
                        &mut p[d.clone()],
                        &g[d],
                        cp,
                    )?;
                } else {
                    let adam = zrt_kernels::AdamConfig {
                        lr: cfg.lr * ratio,
                        ..cfg
                    };
                    let shard = AdamShard {
                        p: &mut p[d.clone()],
                        g: &g[d.clone()],
                        m: &mut m[d.clone()],
                        v: &mut v[v_layout.at(d)],
                    };
                    adam_step(&self.threads, &adam, up.step, up.scale, shard, cp)?;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_balance_each_unit_and_take_turns_across_units() {
        let one = |costs: &[f64], ranks| owners(&[costs.to_vec()], ranks).remove(0);
        assert_eq!(one(&[1.0, 5.0, 3.0, 3.0], 2), vec![0, 0, 1, 1]);
        assert_eq!(one(&[2.0, 2.0, 2.0], 1), vec![0, 0, 0]);
        assert_eq!(one(&[], 3), Vec::<usize>::new());
        assert_eq!(one(&[4.0, 1.0, 1.0, 1.0, 1.0], 2), vec![0, 1, 1, 1, 1]);
        // One matrix a unit: turns.
        let singles = vec![vec![2.0]; 4];
        assert_eq!(
            owners(&singles, 2),
            vec![vec![0], vec![1], vec![0], vec![1]]
        );
        // A GPT block (fc, out, proj, qkv): each unit split as evenly as
        // its sizes allow, the odd share alternating.
        let block = vec![4.0, 4.0, 1.0, 3.0];
        let got = owners(&[block.clone(), block], 2);
        assert_eq!(got, vec![vec![0, 1, 1, 0], vec![1, 0, 0, 1]]);
    }

    #[test]
    fn convolutions_flatten_to_their_first_dimension_by_the_rest() {
        assert_eq!(matrix(&[8, 3, 3, 3]), (8, 27));
        assert_eq!(matrix(&[4, 6]), (4, 6));
    }

    #[test]
    fn the_iteration_makes_a_matrix_nearly_orthogonal_either_way_round() {
        // A wide and a tall matrix: singular values near 1 afterwards
        // (the quintic leaves them in about [0.7, 1.2]).
        for (rows, cols) in [(6i64, 10i64), (10, 6)] {
            let u: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    ((i * 37 % 29) as f32 - 14.0) * 0.1
                        + if i % (cols + 1) == 0 { 2.0 } else { 0.0 }
                })
                .collect();
            let x = orthogonalize(&u, rows, cols, 5, crate::config::NS_COEFFICIENTS).unwrap();
            let t = Tensor::from_slice(&x)
                .view([rows, cols])
                .to_kind(Kind::Double);
            // The singular values: roots of the smaller Gram matrix's
            // eigenvalues.
            let gram = match rows <= cols {
                true => t.matmul(&t.tr()),
                false => t.tr().matmul(&t),
            };
            let ev: Vec<f64> = Vec::try_from(&gram.linalg_eigvalsh("L")).unwrap();
            assert_eq!(ev.len() as i64, rows.min(cols));
            for s in ev.into_iter().map(f64::sqrt) {
                assert!(
                    (0.6..1.3).contains(&s),
                    "singular value {s} of {rows}x{cols}"
                );
            }
        }
    }
}

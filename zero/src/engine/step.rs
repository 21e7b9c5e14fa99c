//! The optimizer step at a gradient-accumulation boundary
//! ([`Engine::step`]), in its order: stage 1's reduction of the
//! accumulated gradients (unless the boundary's backward reduced them),
//! the overflow check every rank agrees on, the
//! global norm and clipping, this step's hyperparameters, the optimizer
//! over each rank's ranges (Adam and the element-wise optimizers here,
//! range by range; LAMB and Muon whole, in `lamb` and `muon`), and the
//! updated shards shared with the ranks that need them.

use half::{bf16, f16};
use zrt_collectives::{ProcessGroup, ReduceOp};
use zrt_kernels::{
    adagrad_step, adam_step, lion_step, reduce, rmsprop_step, sgd_step, AdagradConfig, AdamConfig,
    AdamShard, ComputeCopy, RmspropConfig, SgdConfig,
};

use super::{
    elems, gather_into, groups, overlap, Compute, CopyShard, Engine, Inner, Shard, State, Unit,
    Update, Writes,
};
use crate::config::{ConfigError, OptimizerKind, Precision, Setting};
use crate::schedule::{betas_at, lr_at};
use crate::EngineError;

/// The gradients the optimizer reads from shard `sh`: stage 1's reduced
/// shard, or the accumulated gradients (full at stage 0, a shard above).
fn grads(sh: &Shard, stage1: bool) -> &[f32] {
    if stage1 {
        &sh.reduced
    } else {
        &sh.g
    }
}

impl<G: ProcessGroup + 'static> Engine<G> {
    /// [`Engine::step`], its errors as they come.
    pub(super) fn step_inner(&self) -> Result<bool, EngineError> {
        let i = &*self.inner;
        let started = std::time::Instant::now();
        let mut guard = i.st.lock();
        // A bare `loss.backward()` ran: finish it as `backward` would have.
        self.settle(&mut guard, true)?;
        guard.step_called_at = guard.micro;
        i.drain_prefetch(&mut guard)?;
        if guard.micro == 0
            || guard.micro % i.cfg.batch.gas != 0
            || guard.boundary_at == guard.micro
        {
            guard.timing.call_ends();
            return Ok(false);
        }
        let log = i.cfg.config.wall_clock_breakdown;
        guard.boundary_at = guard.micro;
        let st = &mut *guard;
        let reduced = std::mem::take(&mut st.reduced_in_backward);
        if i.stage == 1 && !reduced {
            i.reduce_stage1(st)?;
        }
        let stage1 = i.stage == 1;
        let Some(loss_scale) = i.skip_on_overflow(st, started, log, stage1)? else {
            return Ok(false);
        };
        let norm = i.global_norm(st, loss_scale, stage1)?;
        let clip = i.cfg.config.gradient_clipping;
        let coef = if clip > 0.0 {
            (clip / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        let adam = i.hyperparameters(st)?;
        let up = Update {
            adam: &adam,
            step: st.opt_step,
            scale: (coef / loss_scale) as f32,
        };
        match i.cfg.config.optimizer.kind {
            OptimizerKind::Lamb => i.lamb_step(st, &up, stage1)?,
            OptimizerKind::Muon => i.muon_step(st, &up, stage1)?,
            _ => i.each_state(st, stage1, Writes::ALL, |_, u, r, s, copy| {
                i.adam_on(u, r, s.adam(), copy, &up)
            })?,
        }
        let t = std::time::Instant::now();
        i.share_shards(st)?;
        st.timing.waited(t.elapsed());
        for sh in st.shards.iter_mut() {
            sh.g.fill(0.0);
            sh.reduced = Vec::new();
        }
        let step = st.step;
        st.timing.step_ends(started, log, step);
        i.flops_step_ended(st);
        let loss = st.loss_sum.take().map(|(sum, n)| sum / n as f64);
        i.report_progress(st, Some(norm), loss);
        Ok(true)
    }
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Stage 1 reduces the accumulated full gradients now, into each
    /// shard's `reduced`, when the boundary's backward did not (the first
    /// step's, before the ranks agreed an order; or a load replaced the
    /// sums since): unit by unit, in the units' order.
    fn reduce_stage1(&self, st: &mut State) -> Result<(), EngineError> {
        for (sh, u) in st.shards.iter_mut().zip(&st.units) {
            self.delay();
            let full = std::mem::take(&mut sh.g);
            let n = full.len();
            let mut reduced = vec![0.0; n / self.group.size()];
            // The accumulation buffer comes back from a single fp32
            // reduce-scatter: reuse it rather than allocate it per step.
            let mut spare = None;
            for (range, r) in self.reduce_in_buckets(full, false, &u.layout)? {
                let red = r.wait()?;
                reduced[range].copy_from_slice(&self.across_replicas(&red)?);
                spare = Some(red.buf).filter(|v| v.len() == n);
            }
            sh.g = match spare {
                Some(mut v) => {
                    v.fill(0.0);
                    v
                }
                None => vec![0.0; n],
            };
            sh.reduced = reduced;
        }
        Ok(())
    }

    /// fp16 (and bf16 with `check_grad_overflow`): any rank's overflow
    /// skips the step everywhere. Returns the loss scale the gradients
    /// were made with (1 without one), or `None` when this step is skipped
    /// (its gradients dropped, the skip counted and reported). The
    /// gradients are divided by the scale before this step's update
    /// (DeepSpeed divides by the updated one, so a step that doubles the
    /// scale halves its gradients: deepspeedai/DeepSpeed#8588).
    fn skip_on_overflow(
        &self,
        st: &mut State,
        started: std::time::Instant,
        log: bool,
        stage1: bool,
    ) -> Result<Option<f64>, EngineError> {
        let check = st.scaler.is_some()
            || matches!(
                self.cfg.config.precision,
                Precision::Bf16 {
                    check_grad_overflow: true
                }
            );
        if !check {
            return Ok(Some(1.0));
        }
        let local =
            (st.shards.iter()).any(|sh| reduce::has_inf_or_nan(&self.threads, grads(sh, stage1)));
        let any = self
            .group
            .all_reduce(vec![u8::from(local)], ReduceOp::Max)
            .wait()?[0]
            != 0;
        let mut loss_scale = 1.0;
        let mut updated = Ok(());
        if let Some(scaler) = st.scaler.as_mut() {
            loss_scale = scaler.scale;
            updated = scaler.update(any);
        }
        if !any {
            return Ok(Some(loss_scale));
        }
        for sh in st.shards.iter_mut() {
            sh.g.fill(0.0);
            sh.reduced = Vec::new();
        }
        st.skipped += 1;
        let step = st.step;
        st.timing.step_ends(started, log, step);
        self.flops_step_ended(st);
        // Every rank saw the same overflow: all fail together here.
        updated?;
        tracing::warn!(
            scale = st.scaler.as_ref().map(|s| s.scale),
            "gradient overflow (inf/NaN): step skipped on every rank"
        );
        let loss = st.loss_sum.take().map(|(sum, n)| sum / n as f64);
        self.report_progress(st, None, loss);
        Ok(None)
    }

    /// The global norm of the true (unscaled) gradients, before clipping
    /// (the shards are disjoint: their squares add up across ranks);
    /// recorded for [`Engine::global_grad_norm`].
    fn global_norm(
        &self,
        st: &mut State,
        loss_scale: f64,
        stage1: bool,
    ) -> Result<f64, EngineError> {
        let mut sq: f64 = (st.shards.iter())
            .map(|sh| reduce::sum_of_squares(&self.threads, grads(sh, stage1)))
            .sum();
        if self.stage > 0 {
            sq = self.group.all_reduce(vec![sq], ReduceOp::Sum).wait()?[0];
        }
        let norm = sq.sqrt() / loss_scale;
        st.norm = Some(norm);
        if !norm.is_finite() {
            // fp16 skipped such a step above; bf16 and fp32 apply it, as
            // DeepSpeed and PyTorch do, but the parameters become NaN.
            tracing::warn!(
                step = st.step + 1,
                "the gradient norm is {norm}: this step writes inf or NaN into the parameters; look for inf/NaN in the loss or the inputs, or lower the learning rate"
            );
        }
        Ok(norm)
    }

    /// This step's learning rate and betas (the schedule's, or the
    /// program's `set_lr`), with the step counted.
    fn hyperparameters(&self, st: &mut State) -> Result<AdamConfig, EngineError> {
        let c = &self.cfg.config;
        let base = c.optimizer.lr.value().unwrap_or(1e-3);
        let (beta1, beta2) = betas_at(c.scheduler.as_ref(), c.optimizer.betas, st.step);
        if !(0.0..1.0).contains(&beta1) {
            // Only OneCycle's momentum decay moves beta1 out of [0, 1) (the
            // config refuses such betas otherwise); every rank stops here.
            return Err(ConfigError {
                problems: vec![format!(
                    "OneCycle's `scheduler.params.decay_mom_rate` has moved beta1 to {beta1} at step {}: {} needs beta1 in [0, 1); lower decay_mom_rate, raise decay_step_size, or set decay_mom_rate to 0",
                    st.step + 1,
                    c.optimizer.kind.name(),
                )],
                ..Default::default()
            }
            .into());
        }
        st.lr = st
            .lr_set
            .unwrap_or_else(|| lr_at(c.scheduler.as_ref(), base, st.step));
        st.step += 1;
        st.opt_step += 1;
        Ok(AdamConfig {
            lr: st.lr,
            beta1,
            beta2,
            eps: c.optimizer.eps,
            weight_decay: match c.optimizer.weight_decay {
                Setting::Value(w) => w,
                Setting::Auto => 0.0,
            },
            adam_w_mode: c.optimizer.adam_w_mode,
            bias_correction: c.optimizer.bias_correction,
        })
    }

    /// Elements `r` of unit `u`'s optimizer range as offsets in its whole
    /// flat buffer (the shard's start added above stage 0).
    pub(super) fn whole(&self, u: &Unit, r: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let base = if self.stage == 0 {
            0
        } else {
            self.shard_range(u).start
        };
        base + r.start..base + r.end
    }

    /// What the optimizer updates for elements `r` of unit `u`'s optimizer
    /// range, and where the compute copy of those elements goes: the flat
    /// tensor itself in fp32 at stages 0-2 (no copy), else `master` (the
    /// fp32 master of those elements), copied into the flat tensor's range
    /// (stages 0-2) or the range of the shard the next forward gathers (3).
    pub(super) fn target<'a>(
        &self,
        u: &'a Unit,
        r: std::ops::Range<usize>,
        master: &'a mut [f32],
        copy: &'a mut CopyShard,
    ) -> (&'a mut [f32], ComputeCopy<'a>) {
        let padded = u.layout.padded;
        let whole = self.whole(u, r.clone());
        // SAFETY: the engine's flat tensors of the compute dtype, under the
        // state lock; no forward or backward runs during a step.
        match (self.compute, self.stage) {
            (Compute::F32, 0..=2) => (
                &mut (unsafe { elems::<f32>(&u.flat, padded) })[whole.clone()],
                ComputeCopy::None,
            ),
            (Compute::F32, _) => (master, ComputeCopy::None),
            (_, 3) => match copy {
                CopyShard::Bf16(c) => (master, ComputeCopy::Bf16(&mut c[r])),
                CopyShard::F16(c) => (master, ComputeCopy::F16(&mut c[r])),
                CopyShard::None => (master, ComputeCopy::None),
            },
            (Compute::Bf16, _) => (
                master,
                ComputeCopy::Bf16(&mut (unsafe { elems::<bf16>(&u.flat, padded) })[whole.clone()]),
            ),
            (Compute::F16, _) => (
                master,
                ComputeCopy::F16(&mut (unsafe { elems::<f16>(&u.flat, padded) })[whole.clone()]),
            ),
        }
    }

    /// Adam over elements `r` of this rank's optimizer range of unit `u`
    /// (its shard; the whole buffer at stage 0). `s.p` is the fp32 master of
    /// those elements wherever it lives (empty when the flat tensor is the
    /// master: fp32, stages 0-2); `s.g`, `s.m`, `s.v` are those elements.
    /// The compute copy written is the flat tensor's range (stages 0-2) or
    /// the range of the shard the next forward gathers (3).
    pub(super) fn adam_on(
        &self,
        u: &Unit,
        r: std::ops::Range<usize>,
        s: AdamShard<'_>,
        copy: &mut CopyShard,
        up: &Update<'_>,
    ) -> Result<(), EngineError> {
        let whole = self.whole(u, r.clone());
        let AdamShard { p: master, g, m, v } = s;
        let (p, copy) = self.target(u, r, master, copy);
        if u.special.is_empty() {
            return self.optimizer_step(up, up.adam, AdamShard { p, g, m, v }, copy);
        }
        // Parameters left out of weight decay or with a scaled learning
        // rate: one kernel call per run of elements treated alike.
        let (mut p, mut g, mut m, mut v, mut copy) = (p, g, m, v, copy);
        for (len, setting) in groups::runs(whole, &u.special) {
            let (p1, p2) = std::mem::take(&mut p).split_at_mut(len);
            let (g1, g2) = g.split_at(len);
            // Lion's and SGD's `v` is empty, and so is the `m` of SGD
            // without momentum: nothing to split.
            let moments = self.moments();
            let (m1, m2) = match moments >= 1 {
                true => std::mem::take(&mut m).split_at_mut(len),
                false => (&mut [][..], &mut [][..]),
            };
            let (v1, v2) = match moments == 2 {
                true => std::mem::take(&mut v).split_at_mut(len),
                false => (&mut [][..], &mut [][..]),
            };
            let (c1, c2) = groups::split_copy(std::mem::take(&mut copy), len);
            (p, g, m, v, copy) = (p2, g2, m2, v2, c2);
            let shard = AdamShard {
                p: p1,
                g: g1,
                m: m1,
                v: v1,
            };
            self.optimizer_step(up, &setting.adam(up.adam), shard, c1)?;
        }
        Ok(())
    }

    /// The config's optimizer over one run of elements treated alike
    /// (`cfg`: this step's settings as those parameters get them).
    pub(super) fn optimizer_step(
        &self,
        up: &Update<'_>,
        cfg: &AdamConfig,
        s: AdamShard<'_>,
        copy: ComputeCopy<'_>,
    ) -> Result<(), EngineError> {
        match self.cfg.config.optimizer.kind {
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                adam_step(&self.threads, cfg, up.step, up.scale, s, copy)?
            }
            OptimizerKind::Lion => lion_step(&self.threads, cfg, up.scale, s, copy)?,
            OptimizerKind::Sgd => {
                let o = &self.cfg.config.optimizer;
                let sgd = SgdConfig {
                    lr: cfg.lr,
                    momentum: o.momentum,
                    dampening: o.dampening,
                    weight_decay: cfg.weight_decay,
                    nesterov: o.nesterov,
                    maximize: o.maximize,
                };
                sgd_step(&self.threads, &sgd, up.step == 1, up.scale, s, copy)?
            }
            OptimizerKind::Adagrad => {
                let o = &self.cfg.config.optimizer;
                let adagrad = AdagradConfig {
                    lr: cfg.lr,
                    lr_decay: o.lr_decay,
                    weight_decay: cfg.weight_decay,
                    eps: cfg.eps,
                    maximize: o.maximize,
                };
                adagrad_step(&self.threads, &adagrad, up.step, up.scale, s, copy)?
            }
            OptimizerKind::Rmsprop => {
                let o = &self.cfg.config.optimizer;
                let rmsprop = RmspropConfig {
                    lr: cfg.lr,
                    alpha: o.alpha,
                    eps: cfg.eps,
                    weight_decay: cfg.weight_decay,
                    momentum: o.momentum,
                    centered: o.centered,
                    maximize: o.maximize,
                };
                rmsprop_step(&self.threads, &rmsprop, up.scale, s, copy)?
            }
            // Its trust ratios need every unit's first pass and an
            // all-reduce before any update: `Inner::lamb_step` runs it whole.
            OptimizerKind::Lamb => {
                return Err(EngineError::Unsupported(
                    "LAMB steps through the engine's lamb_step (lamb.rs), not one range at a time"
                        .into(),
                ))
            }
            // Its orthogonalization needs every matrix whole.
            OptimizerKind::Muon => {
                return Err(EngineError::Unsupported(
                    "Muon steps through the engine's muon_step (muon.rs), not one range at a time"
                        .into(),
                ))
            }
        }
        Ok(())
    }

    /// After the optimizer (or a checkpoint load) wrote this rank's shards:
    /// stages 1-2 all-gather the updated ranges into every flat tensor,
    /// stage 3 refills the root from the shards and frees any other unit
    /// still gathered. Stage 0 has nothing to share.
    pub(super) fn share_shards(&self, st: &mut State) -> Result<(), EngineError> {
        let n = st.units.len();
        for k in 0..n {
            match self.stage {
                0 => {}
                1 | 2 => {
                    let u = &st.units[k];
                    let (padded, range) = (u.layout.padded, self.shard_range(u));
                    self.delay();
                    // SAFETY: the unit's flat tensor of the compute dtype, under
                    // the state lock (no forward or backward runs).
                    match self.compute {
                        Compute::F32 => drop(gather_into(
                            &self.group,
                            unsafe { elems::<f32>(&u.flat, padded) }[range].to_vec(),
                            &u.flat,
                            padded,
                        )?),
                        Compute::Bf16 => drop(gather_into(
                            &self.group,
                            unsafe { elems::<bf16>(&u.flat, padded) }[range].to_vec(),
                            &u.flat,
                            padded,
                        )?),
                        Compute::F16 => drop(gather_into(
                            &self.group,
                            unsafe { elems::<f16>(&u.flat, padded) }[range].to_vec(),
                            &u.flat,
                            padded,
                        )?),
                    }
                }
                _ if overlap::stays_gathered(st, k) => {
                    // The root and persistent units stay gathered: rebuild
                    // them from the updated shards now.
                    self.fill_from_shards(st, k)?;
                }
                _ => {
                    if st.gathered[k] {
                        self.release(st, k)?;
                    }
                }
            }
        }
        Ok(())
    }
}

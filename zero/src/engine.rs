//! The engine: a model's units as flat buffers sharded across a group, and
//! the training step of ZeRO stages 0-3 (DESIGN.md, "One training step").
//!
//! What this build does, per stage (fp32 compute):
//!
//! | stage | between steps, per rank | each micro-step | at the boundary |
//! |---|---|---|---|
//! | 0 | full params, m, v, grads | all_reduce(avg) grads | Adam on everything |
//! | 1 | full params and grads, shard of m, v | accumulate grads locally | reduce_scatter grads, Adam on the shard, all_gather params |
//! | 2 | full params, shard of grads, m, v | reduce_scatter(avg) into the grad shard | Adam on the shard, all_gather params |
//! | 3 | shard of params, grads, m, v | reduce_scatter(avg) into the grad shard | Adam on the shard, free the gathered params |
//!
//! Each unit's parameters are views (`set_data`) into one flat fp32 tensor,
//! so for stages 0-2 this rank's master shard is its slice of that tensor
//! (no copy). Stage 3 gathers a unit right before its forward (through
//! [`crate::ShardedModule`]) and frees the storage after the step (the glue's
//! in-place free), so between steps a rank holds 16 Psi / N bytes of model
//! state. The root unit (parameters outside every wrapped module) stays
//! gathered, as FSDP2's root does. Gradients are copied out of `.grad` and
//! `.grad` is dropped, so they are never held twice.
//!
//! Not in this build yet (see the engine issue): bf16/fp16 compute, the
//! backward hooks that free gathered units after forward and re-gather them
//! before backward (so in stage 3 the gathered units stay live through
//! backward), overlap of communication with compute, hybrid sharding.

use std::sync::Arc;

use parking_lot::Mutex;
use tch::{nn, Device, Kind, Tensor};
use zrt_collectives::{ProcessGroup, ReduceOp};
use zrt_kernels::{adam_step, reduce, AdamConfig, AdamShard, ComputeCopy, Threads};

use crate::config::{Precision, Setting};
use crate::flat::FlatLayout;
use crate::plan::{check_prefixes, ShardPlan, UnitHook};
use crate::schedule::lr_at;
use crate::{glue, AutoHints, Config, EngineError, Resolved};

/// One unit: its layout, its parameters (views into `flat`), the flat tensor.
struct Unit {
    name: String,
    layout: FlatLayout,
    params: Vec<Tensor>,
    flat: Tensor,
}

/// This rank's optimizer-side buffers of one unit.
#[derive(Default)]
struct Shard {
    /// Stage 3 only: the fp32 master shard (stages 0-2 use the flat tensor).
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// Accumulated gradients: full (stages 0, 1) or this rank's shard.
    g: Vec<f32>,
}

struct State {
    units: Vec<Unit>,
    shards: Vec<Shard>,
    gathered: Vec<bool>,
    micro: u64,
    step: u64,
    norm: Option<f64>,
    lr: f64,
    /// The first error a forward hook hit; the next engine call returns it.
    error: Option<EngineError>,
}

struct Inner<G> {
    group: G,
    cfg: Resolved,
    stage: u8,
    threads: Threads,
    st: Mutex<State>,
    /// Test knob: sleep a random 0-2 ms before every collective (0: off).
    delays: Mutex<u64>,
}

/// The training engine of one rank. See the module docs for what each
/// stage keeps where.
pub struct Engine<G: ProcessGroup + 'static> {
    inner: Arc<Inner<G>>,
}

/// `n` f32s at `t`'s data (contiguous, CPU, at least `n` elements).
///
/// # Safety
/// The caller must ensure nothing else reads or writes the memory for the
/// slice's lifetime (the engine holds its state lock).
#[allow(clippy::mut_from_ref)]
unsafe fn f32s(t: &Tensor, n: usize) -> &mut [f32] {
    std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n)
}

impl<G: ProcessGroup + 'static> Inner<G> {
    fn delay(&self) {
        let mut s = self.delays.lock();
        if *s != 0 {
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
            std::thread::sleep(std::time::Duration::from_micros(*s % 2000));
        }
    }

    fn shard_range(&self, u: &Unit) -> std::ops::Range<usize> {
        u.layout.shard(self.group.rank())
    }

    /// Stage 3: makes unit `i`'s parameters hold the gathered values.
    fn gather(&self, st: &mut State, i: usize) -> Result<(), EngineError> {
        if st.gathered[i] {
            return Ok(());
        }
        // Name the unit to the peers first: units run in different orders
        // would otherwise gather same-sized buffers into silent garbage.
        self.delay();
        let ids = self.group.all_gather(vec![i as i64], Vec::new()).wait()?.1;
        if ids.iter().any(|&x| x != i as i64) {
            let names: Vec<String> = ids
                .iter()
                .enumerate()
                .map(|(r, &x)| {
                    format!(
                        "rank {r} runs `{}`",
                        st.units.get(x as usize).map_or("?", |u| u.name.as_str())
                    )
                })
                .collect();
            return Err(EngineError::UnitOrder(names.join(", ")));
        }
        self.delay();
        let shard = std::mem::take(&mut st.shards[i].p);
        let (shard, full) = self.group.all_gather(shard, Vec::new()).wait()?;
        st.shards[i].p = shard;
        let u = &st.units[i];
        glue::realloc_storage(&u.flat, u.layout.padded * 4)?;
        // SAFETY: the flat tensor is the engine's, contiguous, `padded` long.
        unsafe { f32s(&u.flat, u.layout.padded) }.copy_from_slice(&full);
        st.gathered[i] = true;
        Ok(())
    }

    fn release(&self, st: &mut State, i: usize) -> Result<(), EngineError> {
        glue::free_storage(&st.units[i].flat)?;
        st.gathered[i] = false;
        Ok(())
    }
}

impl<G: ProcessGroup + 'static> UnitHook for Inner<G> {
    fn before_forward(&self, unit: usize) {
        if self.stage != 3 {
            return;
        }
        let mut st = self.st.lock();
        if st.gathered[unit] {
            return;
        }
        let failed = match st.error.is_some() {
            // After an error the ranks are out of step: no more collectives.
            true => None,
            false => self.gather(&mut st, unit).err(),
        };
        if st.gathered[unit] {
            return;
        }
        // Forward cannot return an error: keep it for the next engine call,
        // and give the parameters zeroed memory so this forward computes
        // garbage instead of reading freed storage.
        let u = &st.units[unit];
        if glue::realloc_storage(&u.flat, u.layout.padded * 4).is_ok() {
            let _ = u.flat.shallow_clone().f_zero_();
        }
        st.gathered[unit] = true;
        if let Some(e) = failed {
            st.error = Some(e);
        }
    }
}

impl<G: ProcessGroup + 'static> Engine<G> {
    /// Builds the engine for the trainable parameters of `vs`, grouped into
    /// the units of `plan`, trained as `config` says over `group` (the
    /// data-parallel world). Rank 0's parameter values become everyone's.
    pub fn new(
        vs: &nn::VarStore,
        plan: &ShardPlan,
        config: &Config,
        group: G,
        hints: &AutoHints,
    ) -> Result<Self, EngineError> {
        let cfg = config.resolve(group.size() as u64, hints)?;
        let c = &cfg.config;
        if c.precision != Precision::Fp32 {
            return Err(EngineError::Unsupported(format!(
                "{:?} compute: this build trains in fp32 only; disable fp16/bf16",
                c.precision
            )));
        }
        if c.zero
            .mics_shard_size
            .is_some_and(|s| s != group.size() as u64)
            || c.zero.zero_hpz_partition_size > 1
        {
            return Err(EngineError::Unsupported(
                "hybrid sharding (mics_shard_size, zero_hpz_partition_size)".into(),
            ));
        }
        if vs.device() != Device::Cpu {
            return Err(EngineError::Unsupported(
                "CUDA devices: this build trains on CPU".into(),
            ));
        }
        let stage = c.zero.stage;
        if plan
            .inner
            .claimed
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(EngineError::Plan(
                "this plan already drives another engine: build one plan per model".into(),
            ));
        }
        let prefixes = plan.units();
        check_prefixes(&prefixes)?;
        let mut groups: Vec<Vec<(String, Tensor)>> =
            (0..=prefixes.len()).map(|_| Vec::new()).collect();
        for (name, t) in vs.variables() {
            if !t.requires_grad() {
                continue; // frozen: replicated as it is, no optimizer state
            }
            let unit = prefixes
                .iter()
                .position(|p| name.starts_with(&format!("{p}.")))
                .unwrap_or(prefixes.len());
            groups[unit].push((name, t));
        }
        if let Some(i) = groups[..prefixes.len()].iter().position(Vec::is_empty) {
            return Err(EngineError::Plan(format!(
                "unit `{}` has no trainable parameters under its VarStore path: wrap the module with the path its parameters were created under",
                prefixes[i]
            )));
        }
        let world = group.size();
        let mut units = Vec::new();
        for (i, params) in groups.into_iter().enumerate() {
            if params.is_empty() {
                continue; // an empty root
            }
            let name = prefixes.get(i).cloned().unwrap_or_else(|| "<root>".into());
            let layout = FlatLayout::new(
                params.iter().map(|(n, t)| (n.clone(), t.size())).collect(),
                world,
            );
            let by_name: std::collections::HashMap<String, Tensor> = params.into_iter().collect();
            let flat = Tensor::f_zeros([layout.padded as i64], (Kind::Float, Device::Cpu))?;
            let mut ts = Vec::new();
            for s in &layout.slots {
                let mut t = by_name[&s.name].shallow_clone();
                if t.kind() != Kind::Float {
                    return Err(EngineError::Unsupported(format!(
                        "parameter `{}` is {:?}; this build trains fp32 parameters",
                        s.name,
                        t.kind()
                    )));
                }
                let view = flat
                    .f_narrow(0, s.offset as i64, s.numel as i64)?
                    .f_view(s.shape.as_slice())?;
                tch::no_grad(|| view.shallow_clone().f_copy_(&t))?;
                t.set_data(&view);
                ts.push(t);
            }
            units.push(Unit {
                name,
                layout,
                params: ts,
                flat,
            });
        }
        // Rank 0's values are everyone's (as DDP and DeepSpeed do at start).
        for u in &units {
            // SAFETY: the engine's own tensor, not yet shared with autograd.
            let full = unsafe { f32s(&u.flat, u.layout.padded) }.to_vec();
            let got = group.broadcast(full, 0).wait()?;
            unsafe { f32s(&u.flat, u.layout.padded) }.copy_from_slice(&got);
        }
        let rank = group.rank();
        let mut shards = Vec::new();
        for u in &units {
            let (full, part) = (u.layout.padded, u.layout.shard_len());
            let sh = match stage {
                0 => Shard {
                    p: Vec::new(),
                    m: vec![0.0; full],
                    v: vec![0.0; full],
                    g: vec![0.0; full],
                },
                1 => Shard {
                    p: Vec::new(),
                    m: vec![0.0; part],
                    v: vec![0.0; part],
                    g: vec![0.0; full],
                },
                2 => Shard {
                    p: Vec::new(),
                    m: vec![0.0; part],
                    v: vec![0.0; part],
                    g: vec![0.0; part],
                },
                _ => Shard {
                    // SAFETY: as above.
                    p: (unsafe { f32s(&u.flat, full) })[u.layout.shard(rank)].to_vec(),
                    m: vec![0.0; part],
                    v: vec![0.0; part],
                    g: vec![0.0; part],
                },
            };
            shards.push(sh);
        }
        let n = units.len();
        let lr = cfg.config.optimizer.lr.value().unwrap_or(1e-3);
        let inner = Arc::new(Inner {
            group,
            stage,
            threads: Threads::new(0)?,
            st: Mutex::new(State {
                units,
                shards,
                gathered: vec![true; n],
                micro: 0,
                step: 0,
                norm: None,
                lr,
                error: None,
            }),
            delays: Mutex::new(0),
            cfg,
        });
        if stage == 3 {
            let mut st = inner.st.lock();
            // Between steps only shards exist; the root stays gathered.
            for i in 0..n.saturating_sub(usize::from(prefixes.len() < n)) {
                inner.release(&mut st, i)?;
            }
        }
        let hook: Arc<dyn UnitHook> = inner.clone();
        if plan.inner.hook.set(hook).is_err() {
            return Err(EngineError::Plan(
                "this plan already drives another engine: build one plan per model".into(),
            ));
        }
        Ok(Self { inner })
    }

    fn take_error(&self, st: &mut State) -> Result<(), EngineError> {
        match st.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Backward of one micro-step: `loss` is this rank's mean loss on its
    /// micro-batch. Gradients are averaged over the world and the
    /// accumulation steps, as DeepSpeed does.
    pub fn backward(&self, loss: &Tensor) -> Result<(), EngineError> {
        let i = &*self.inner;
        let mut st = i.st.lock();
        self.take_error(&mut st)?;
        let gas = i.cfg.batch.gas as f64;
        loss.f_div_scalar(gas)?.f_backward()?;
        for k in 0..st.units.len() {
            let padded = st.units[k].layout.padded;
            let mut full = vec![0f32; padded];
            for (slot, t) in st.units[k].layout.slots.iter().zip(&st.units[k].params) {
                let g = t.grad();
                if g.defined() {
                    let g = g.f_contiguous()?;
                    // SAFETY: a contiguous f32 gradient of `numel` elements.
                    full[slot.offset..slot.offset + slot.numel]
                        .copy_from_slice(unsafe { f32s(&g, slot.numel) });
                }
                glue::clear_grad(t)?;
            }
            match i.stage {
                0 => {
                    i.delay();
                    let r = i.group.all_reduce(full, ReduceOp::Avg).wait()?;
                    reduce::accumulate(&i.threads, &mut st.shards[k].g, &r)?;
                }
                1 => reduce::accumulate(&i.threads, &mut st.shards[k].g, &full)?,
                _ => {
                    i.delay();
                    let (_, part) = i
                        .group
                        .reduce_scatter(full, Vec::new(), ReduceOp::Avg)
                        .wait()?;
                    reduce::accumulate(&i.threads, &mut st.shards[k].g, &part)?;
                }
            }
        }
        st.micro += 1;
        Ok(())
    }

    /// The optimizer step, at the accumulation boundary only (DeepSpeed's
    /// `engine.step()` contract: call it after every `backward`). Returns
    /// whether a step was taken.
    pub fn step(&self) -> Result<bool, EngineError> {
        let i = &*self.inner;
        let mut st = i.st.lock();
        self.take_error(&mut st)?;
        if st.micro == 0 || st.micro % i.cfg.batch.gas != 0 {
            return Ok(false);
        }
        let st = &mut *st;
        let rank = i.group.rank();
        // Stage 1 reduces the accumulated full gradients only now.
        if i.stage == 1 {
            for sh in st.shards.iter_mut() {
                let full = std::mem::take(&mut sh.g);
                i.delay();
                let (mut full, part) = i
                    .group
                    .reduce_scatter(full, Vec::new(), ReduceOp::Avg)
                    .wait()?;
                full.fill(0.0);
                sh.p = part; // the reduced shard, for this step only
                sh.g = full;
            }
        }
        let grad = |sh: &Shard| -> Vec<f32> {
            if i.stage == 1 {
                sh.p.clone()
            } else {
                sh.g.clone()
            }
        };
        // Global norm, before clipping: the shards are disjoint.
        let mut sq: f64 = st
            .shards
            .iter()
            .map(|sh| reduce::sum_of_squares(&i.threads, &grad(sh)))
            .sum();
        if i.stage > 0 {
            sq = i.group.all_reduce(vec![sq], ReduceOp::Sum).wait()?[0];
        }
        let norm = sq.sqrt();
        st.norm = Some(norm);
        let c = &i.cfg.config;
        let clip = c.gradient_clipping;
        let coef = if clip > 0.0 {
            (clip / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        let base = c.optimizer.lr.value().unwrap_or(1e-3);
        st.lr = lr_at(c.scheduler.as_ref(), base, st.step);
        st.step += 1;
        let adam = AdamConfig {
            lr: st.lr,
            beta1: c.optimizer.betas.0,
            beta2: c.optimizer.betas.1,
            eps: c.optimizer.eps,
            weight_decay: match c.optimizer.weight_decay {
                Setting::Value(w) => w,
                Setting::Auto => 0.0,
            },
            adam_w_mode: c.optimizer.adam_w_mode,
            bias_correction: c.optimizer.bias_correction,
        };
        for (u, sh) in st.units.iter().zip(st.shards.iter_mut()) {
            let g = grad(sh);
            let (padded, range) = (u.layout.padded, i.shard_range(u));
            let p: &mut [f32] = match i.stage {
                // SAFETY: the engine's flat tensor; no forward or backward runs during step.
                0 => unsafe { f32s(&u.flat, padded) },
                1 | 2 => &mut (unsafe { f32s(&u.flat, padded) })[range],
                _ => &mut sh.p,
            };
            let shard = AdamShard {
                p,
                g: &g,
                m: &mut sh.m,
                v: &mut sh.v,
            };
            adam_step(
                &i.threads,
                &adam,
                st.step,
                coef as f32,
                shard,
                ComputeCopy::None,
            )?;
        }
        // Share the updated shards.
        let root_kept = st.units.last().is_some_and(|u| u.name == "<root>");
        let n = st.units.len();
        for k in 0..n {
            match i.stage {
                0 => {}
                1 | 2 => {
                    let u = &st.units[k];
                    let range = i.shard_range(u);
                    // SAFETY: as above.
                    let mine = (unsafe { f32s(&u.flat, u.layout.padded) })[range].to_vec();
                    i.delay();
                    let (_, full) = i.group.all_gather(mine, Vec::new()).wait()?;
                    unsafe { f32s(&u.flat, u.layout.padded) }.copy_from_slice(&full);
                }
                _ => {
                    let is_root = root_kept && k == n - 1;
                    if is_root {
                        st.gathered[k] = false;
                        // Keep the root gathered: its forward is not wrapped.
                        // Rebuild it from the updated shards now.
                        let (shard, full) = i
                            .group
                            .all_gather(std::mem::take(&mut st.shards[k].p), Vec::new())
                            .wait()?;
                        st.shards[k].p = shard;
                        let u = &st.units[k];
                        // SAFETY: as above; the root's storage was never freed.
                        unsafe { f32s(&u.flat, u.layout.padded) }.copy_from_slice(&full);
                        st.gathered[k] = true;
                    } else if st.gathered[k] {
                        i.release(st, k)?;
                    }
                }
            }
            let _ = rank;
        }
        for sh in st.shards.iter_mut() {
            sh.g.fill(0.0);
            if i.stage == 1 {
                sh.p = Vec::new();
            }
        }
        Ok(true)
    }

    /// For tests: sleep a pseudo-random 0-2 ms (from `seed`; 0 turns it off)
    /// before every collective, to show results do not depend on timing.
    pub fn inject_delays(&self, seed: u64) {
        *self.inner.delays.lock() = seed;
    }

    /// The global gradient norm of the last step, *before* clipping.
    pub fn global_grad_norm(&self) -> Option<f64> {
        self.inner.st.lock().norm
    }
    /// The learning rate the last step used.
    pub fn lr(&self) -> f64 {
        self.inner.st.lock().lr
    }
    /// Optimizer steps taken.
    pub fn global_step(&self) -> u64 {
        self.inner.st.lock().step
    }
    /// Micro-steps taken (`backward` calls).
    pub fn micro_steps(&self) -> u64 {
        self.inner.st.lock().micro
    }
    /// The resolved config the engine runs with.
    pub fn config(&self) -> &Resolved {
        &self.inner.cfg
    }
    /// The group the engine shards over.
    pub fn group(&self) -> &G {
        &self.inner.group
    }

    /// Model-state bytes this rank holds now, as the engine allocated them:
    /// parameters (flat tensors with storage), fp32 master (stage 3), Adam's
    /// m and v, accumulated gradients. Compare with DESIGN.md's table.
    pub fn model_state_bytes(&self) -> Result<usize, EngineError> {
        let st = self.inner.st.lock();
        let mut b = 0;
        for (u, sh) in st.units.iter().zip(&st.shards) {
            b += glue::storage_nbytes(&u.flat)?;
            b += 4 * (sh.p.len() + sh.m.len() + sh.v.len() + sh.g.len());
        }
        Ok(b)
    }

    /// Elements of real parameters (without padding) in every unit.
    pub fn num_params(&self) -> usize {
        self.inner
            .st
            .lock()
            .units
            .iter()
            .map(|u| u.layout.numel)
            .sum()
    }

    /// This rank's fp32 master shard of unit `unit` and its range in the
    /// unit's flat buffer (for tests and checkpoints).
    pub fn master_shard(&self, unit: usize) -> Option<(Vec<f32>, std::ops::Range<usize>)> {
        let i = &*self.inner;
        let st = i.st.lock();
        let u = st.units.get(unit)?;
        let range = i.shard_range(u);
        Some(match i.stage {
            3 => (st.shards[unit].p.clone(), range),
            // SAFETY: read-only copy under the lock.
            _ => (
                (unsafe { f32s(&u.flat, u.layout.padded) })[range.clone()].to_vec(),
                range,
            ),
        })
    }

    /// This rank's accumulated gradient buffer of unit `unit` (full for
    /// stages 0-1, the shard for 2-3), for tests.
    pub fn grad_buffer(&self, unit: usize) -> Option<Vec<f32>> {
        self.inner.st.lock().shards.get(unit).map(|s| s.g.clone())
    }

    /// The units' names in flat order (the root, if any, last).
    pub fn unit_names(&self) -> Vec<String> {
        self.inner
            .st
            .lock()
            .units
            .iter()
            .map(|u| u.name.clone())
            .collect()
    }

    /// The full current parameters of every unit, gathered (a collective:
    /// every rank must call it), as (name, values) in flat order.
    pub fn gathered_params(&self) -> Result<Vec<(String, Vec<f32>)>, EngineError> {
        let i = &*self.inner;
        let st = i.st.lock();
        let mut out = Vec::new();
        for (u, sh) in st.units.iter().zip(&st.shards) {
            let mine = match i.stage {
                3 => sh.p.clone(),
                // SAFETY: read-only copy under the lock.
                _ => (unsafe { f32s(&u.flat, u.layout.padded) })[i.shard_range(u)].to_vec(),
            };
            let (_, full) = i.group.all_gather(mine, Vec::new()).wait()?;
            for s in &u.layout.slots {
                out.push((s.name.clone(), full[s.offset..s.offset + s.numel].to_vec()));
            }
        }
        Ok(out)
    }
}

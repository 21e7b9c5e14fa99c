//! Building an engine ([`Engine::build`], behind `Engine::new` and its
//! siblings), in the order its steps must run: the ranks' agreement, then
//! every check a user can mend (nothing is laid out yet, so a refused
//! build leaves the model and its plan as they were), then each unit's
//! flat buffer with its parameters as views into it and this rank's
//! shards of its optimizer state, one unit at a time (stage 3 frees each
//! as it goes, so building holds the model and one unit), stage 3's
//! frozen shards, the swaps, and the hooks that reduce a unit's
//! gradients as soon as they are all in. Ranks that built their model
//! under `ShardPlan::weights_on_first_rank_only` hold no weights until
//! this gives them rank 0's.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use half::{bf16, f16};
use parking_lot::Mutex;
use tch::{nn, Device, Kind, Tensor};
use zrt_collectives::ProcessGroup;
use zrt_kernels::Threads;

use super::loss_scale::Scaler;
use super::{
    agree, comms_log, elems, foreign, frozen, frozen_shards, groups, is_first_rank, offload,
    overlap, pool, rank0_flat, segments, timing, v_layout, Compute, CopyShard, Engine, Hook, Inner,
    Shard, Source, State, Unit,
};
use crate::config::{OptimizerKind, Precision};
use crate::flat::FlatLayout;
use crate::plan::{check_prefixes, ShardPlan, UnitHook};
use crate::schedule::lr_at;
use crate::{glue, AutoHints, Config, EngineError};

/// A trained parameter: its VarStore name and its tensor.
type Named = (String, Tensor);

impl<G: ProcessGroup + 'static> Engine<G> {
    /// The engine over `group` (and, for hybrid sharding, `replicate`;
    /// for ZeRO++ hpZ, `hpz`): see [`Engine::new`]. A collective.
    pub(super) fn build(
        vs: &nn::VarStore,
        plan: &ShardPlan,
        config: &Config,
        group: G,
        replicate: Option<G>,
        hpz: Option<G>,
        hints: &AutoHints,
    ) -> Result<Self, EngineError> {
        let replicas = replicate.as_ref().map_or(1, |r| r.size());
        let cfg = config.resolve((group.size() * replicas) as u64, hints)?;
        // The plan's optimizer rules, asked once per parameter: the ranks
        // agree on the answers the layout and checkpoints then use.
        let muon = config.optimizer.kind == OptimizerKind::Muon;
        let settings = groups::Settings::of(plan, vs, muon);
        // First, so that the checks below, which a config that differs on
        // one rank fails there alone, meet ranks that agree; and before
        // the plan is claimed, so an engine refused here leaves it for the
        // next try.
        agree::check(
            &agree::Terms::of(&cfg, plan, vs, |name: &str| settings.get(name)),
            &group,
            replicate.as_ref(),
        )?;
        // After the agreement: ranks that agree on the scales fail alike.
        settings.check()?;
        let first = is_first_rank(&group, replicate.as_ref());
        // `memory_breakdown` logs libtorch's allocations beside the
        // resident set: the count must begin before the first forward.
        if cfg.config.memory_breakdown {
            if let Err(e) = crate::glue::track_allocations() {
                tracing::warn!("memory_breakdown: libtorch's allocations will not be counted: {e}");
            }
        }
        if muon && first {
            log_muon_split(vs, &settings);
        }
        // The first rank writes the monitors; opened before the plan is
        // claimed, so a bad output_path fails before anything is laid out.
        let monitor = match first {
            true => crate::monitor::Monitor::open(&cfg.config.monitor)?,
            false => None,
        };
        let c = &cfg.config;
        let compute = compute_of(c);
        // `communication_data_type` bf16/fp16: reduce in the 16-bit compute
        // dtype (half the bytes); accumulation stays fp32.
        let reduce_16 = !c.fp32_grad_reduce && compute != Compute::F32;
        if !c.fp32_grad_reduce && compute == Compute::F32 {
            tracing::warn!("a 16-bit communication_data_type with fp32 compute: zrt reduces gradients in fp32 (enable bf16 or fp16 to reduce in 16 bits)");
        }
        check_groups(c, &group, hpz.as_ref())?;
        if vs.device() != Device::Cpu {
            return Err(EngineError::Unsupported(
                "CUDA devices: this build trains on CPU".into(),
            ));
        }
        let stage = c.zero.stage;
        offload::check(&cfg, stage)?;
        if stage == 0 && cfg.batch.gas > 1 && cfg.world > 1 && first {
            // Where zrt parts from DeepSpeed without an error to show it
            // (docs/choices.md, "Stage 0 reduces every micro-step").
            tracing::info!(
                "stage 0 all-reduces each micro-step's gradients during backward ({} a step); DeepSpeed's stage 0 reduces once, at the accumulation boundary, as zrt's stage 1 does",
                cfg.batch.gas
            );
        }
        let prefixes = plan.units();
        check_prefixes(&prefixes)?;
        // Stage 3, `stage3_param_persistence_threshold`: parameters of at
        // most that many elements stay gathered (DeepSpeed's rule, per
        // parameter: `ds_numel <= param_threshold`).
        let threshold = (c.zero.stage3_param_persistence_threshold.value()).unwrap_or(0) as usize;
        let mut by_unit = trained_by_unit(vs, &prefixes)?;
        let root_of_moved = match stage == 3 && threshold > 0 {
            true => move_small_to_root(&mut by_unit, threshold),
            false => None,
        };
        check_kinds(&by_unit, compute)?;
        frozen::check_dtypes(vs)?;
        // The checks a user can mend are behind: from here the parameters
        // are laid out. A build that fails later (a peer that died, a full
        // drive) leaves the plan free again when the claim drops, and the
        // parameters rank 0's values in the compute dtype; but for stage
        // 3's units without an NVMe swap, which the layout frees as it
        // goes (a peer that died is all that fails there, and ends the
        // job).
        let Some(claim) = plan.inner.claim() else {
            return Err(EngineError::Plan(
                "this plan already drives another engine: drop that one first (after engine.unshard() at stage 3, so that the parameters hold their values), or build one plan per model".into(),
            ));
        };
        // What the model made after its last block (a final norm, a
        // head), so that the layout's buffers add to one unit on ranks
        // that hold no weights.
        plan.inner.release_made_so_far();
        // `weights_from_file`: no rank's values are read; the file is
        // loaded once the engine is built.
        let file = plan.inner.weights_file();
        // `weights_on_disk_while_built`'s file, on the first rank.
        let spill = plan.inner.spill();
        let fresh = plan.inner.fresh_rule();
        let source = match file {
            Some(_) => Source::File(fresh.as_deref()),
            None => Source::FirstRank(spill.as_deref()),
        };
        // Muon's matrices keep no `v` in memory (the NVMe swap's arrays
        // keep every element's).
        let pack_muon = muon && !offload::swaps_optimizer(&cfg);
        let shard_of = |u: &Unit, master: Vec<f32>| {
            let (rank, c) = (group.rank(), &cfg.config);
            new_shard(u, master, c, compute, rank, pack_muon, &settings)
        };
        let (mut units, mut shards) = lay_out(
            vs,
            by_unit,
            &prefixes,
            &settings,
            compute,
            (&group, replicate.as_ref()),
            source,
            // Not with an NVMe swap: a drive too full fails the build
            // after the layout, and the next try must find every value.
            (stage == 3 && !offload::swaps_any(&cfg)).then_some(threshold),
            shard_of,
        )?;
        log_rules(&settings, &units);
        settle_uneven(&mut units, root_of_moved, stage);
        let frozen_part = FrozenPart {
            threshold,
            compute,
            quantize: c.zero.zero_quantized_nontrainable_weights,
            source,
        };
        let Unsharded {
            whole,
            params,
            persistent,
        } = frozen_part.shard(vs, &mut units, stage, &group, replicate.as_ref())?;
        let owners = owners_of(&units)?;
        // Muon's matrices' `v`, zeros the NVMe swap need not move.
        let zero_v: Vec<_> = match muon {
            true => (units.iter())
                .map(|u| muon_holes(u, stage, group.rank(), &settings))
                .collect(),
            false => Vec::new(),
        };
        let swap = offload::swap_out(&cfg, compute, group.rank(), &mut shards, &zero_v)?;
        let pswap = offload::params_out(&cfg, group.rank(), &mut shards, &mut units)?;
        let n = units.len();
        // What the first step will use (a warm-up's start, not the base).
        let lr = lr_at(
            cfg.config.scheduler.as_ref(),
            cfg.config.optimizer.lr.value().unwrap_or(1e-3),
            0,
        );
        let scaler = match &cfg.config.precision {
            Precision::Fp16(l) => Some(Scaler::new(l)),
            _ => None,
        };
        // The tensors that do not train: world rank 0's everywhere too.
        let sharded = units
            .iter()
            .flat_map(|u| {
                u.frozen
                    .iter()
                    .flat_map(|p| p.layout.slots.iter().zip(&p.saved))
            })
            .map(|(s, d)| (s.name.clone(), s.shape.clone(), *d))
            .collect();
        let frozen = frozen::Frozen::of(whole, sharded, &params, compute.kind())?;
        frozen.sync(&group, replicate.as_ref(), source)?;
        // Every value is read: the spill's disk space goes back.
        drop(spill);
        plan.inner.drop_spill();
        let inner = Arc::new(Inner {
            group,
            replicate,
            stage,
            compute,
            // As many kernel threads as libtorch's intra-op pool: ranks that
            // share cores set that to their share (1 when as many ranks as
            // cores), and a pool sized to every core would oversubscribe
            // them (its idle workers spin on the other rank's core; measured
            // 1-5% slower stage-3 steps on 2 ranks x 2 cores).
            threads: Threads::new(tch::get_num_threads().max(1) as usize)?,
            st: Mutex::new(State {
                units,
                shards,
                gathered: vec![true; n],
                micro: 0,
                boundary_at: 0,
                step_called_at: 0,
                step: 0,
                opt_step: 0,
                skipped: 0,
                norm: None,
                lr,
                lr_set: None,
                scaler,
                loss_sum: None,
                error: None,
                broken: None,
                reduced_in_backward: false,
                prog: overlap::Progress::new(n),
                timing: timing::Timing::new(),
                persistent,
                quantized: vec![false; n],
                secondary: (0..n).map(|_| None).collect(),
                checked: vec![false; n],
                zeroed: 0,
                held: None,
                frozen,
            }),
            input_grads: super::input_grads::InputGrads::new(n),
            delays: Mutex::new(0),
            swap,
            pswap,
            reduce_16,
            hpz,
            settings,
            monitor: Mutex::new(monitor),
            owners,
            pools: pool::Pools::new(),
            cfg,
            id: foreign::new_id(),
            backwards: Default::default(),
            told_foreign: Default::default(),
            told_untouched: Default::default(),
            segments: segments::Segments::new(n, root_of_moved),
            flops: Mutex::new(None),
        });
        {
            let mut st = inner.st.lock();
            // Stage 3: between steps only shards exist; the root and the
            // units under the persistence threshold stay gathered.
            for i in 0..n {
                inner.free_if_gathered(&mut st, i)?;
            }
            if inner.cfg.config.memory_breakdown && first {
                inner.log_memory(&st, "after building the engine");
            }
            // `flops_profiler.profile_step` 0: the first step.
            inner.flops_step_ended(&st);
            if inner.cfg.config.dump_state && first {
                for line in inner.state_lines(&st) {
                    tracing::info!("{line}");
                }
            }
        }
        hook_gradients(&inner)?;
        let hook: Arc<dyn UnitHook> = Arc::new(Hook {
            inner: Arc::downgrade(&inner),
        });
        // The claim above admits one engine per plan at a time.
        claim.set_hook(hook);
        // The engine owns its groups (they drop with it):
        // their observers need no removing.
        let c = &inner.cfg.config.comms_logger;
        if c.enabled && c.verbose && inner.first_rank() {
            comms_log::observe(&inner.comm_groups(), c);
        }
        let engine = Self {
            inner,
            _plan: claim,
        };
        if let Some(file) = file {
            engine.load_weights_except(&file, fresh.as_deref())?;
        }
        Ok(engine)
    }
}

/// Which half of Muon takes what: the rule's answers, shown once.
fn log_muon_split(vs: &nn::VarStore, settings: &groups::Settings) {
    let (mut by_muon, mut by_adam) = ((0, 0), (0, 0));
    for (name, t) in vs.variables() {
        if t.requires_grad() {
            let half = match settings.get(&name).muon {
                true => &mut by_muon,
                false => &mut by_adam,
            };
            *half = (half.0 + 1, half.1 + t.numel());
        }
    }
    tracing::info!(
        "Muon steps {} parameter(s) ({} elements), AdamW the other {} ({} elements); ShardPlan::use_muon chooses otherwise",
        by_muon.0, by_muon.1, by_adam.0, by_adam.1
    );
}

/// The dtype the config computes in (with a warning for fp16 on CPU).
fn compute_of(c: &Config) -> Compute {
    let compute = match c.precision {
        Precision::Fp32 => Compute::F32,
        Precision::Bf16 { .. } => Compute::Bf16,
        Precision::Fp16(_) => Compute::F16,
    };
    if compute == Compute::F16 {
        // Measured with torch 2.13 on an AVX-512 EPYC: a 1024x256 by
        // 256x768 matmul takes 160 ms in fp16, 4 ms in fp32, 0.8 in bf16.
        // Users coming from GPUs reach for fp16 by habit.
        tracing::warn!("fp16 compute on CPU: libtorch's CPU fp16 matmul is very slow on CPUs without AVX512-FP16 (40x slower than fp32 on an AVX-512 EPYC); on CPU use `\"bf16\": {{\"enabled\": true}}` instead, which needs no loss scaling");
    }
    compute
}

/// Refuses groups the config's `mics_shard_size` or
/// `zero_hpz_partition_size` does not describe, naming the constructor
/// that builds the right ones.
fn check_groups<G: ProcessGroup>(
    c: &Config,
    group: &G,
    hpz: Option<&G>,
) -> Result<(), EngineError> {
    if let Some(s) = c.zero.mics_shard_size.filter(|&s| s != group.size() as u64) {
        return Err(EngineError::Plan(format!(
            "mics_shard_size is {s} but the engine shards over {} ranks: build it with Engine::new_hybrid(.., dist.mesh({s})?, ..) (or remove mics_shard_size)",
            group.size()
        )));
    }
    let hpz_size = c.zero.zero_hpz_partition_size.max(1) as usize;
    match hpz {
        None if hpz_size > 1 => Err(EngineError::Plan(format!(
            "zero_hpz_partition_size is {hpz_size}: build the engine with Engine::new_hpz(.., world, hpz_group, ..) where hpz_group holds {hpz_size} ranks (or remove the key)"
        ))),
        Some(h) if h.size() != hpz_size || c.zero.stage != 3 || group.size() % h.size() != 0 => {
            Err(EngineError::Plan(format!(
                "hpZ needs ZeRO stage 3, zero_hpz_partition_size equal to the hpZ group's size ({}, config says {hpz_size}) and a world ({}) it divides",
                h.size(),
                group.size()
            )))
        }
        _ => Ok(()),
    }
}

/// The trained parameters of `vs` by unit: one list per prefix, then the
/// root's (every parameter under no prefix). A unit whose path holds no
/// parameter at all, trained or frozen, is an error: a module wrapped
/// under another path than its parameters'.
fn trained_by_unit(vs: &nn::VarStore, prefixes: &[String]) -> Result<Vec<Vec<Named>>, EngineError> {
    let mut by_unit: Vec<Vec<Named>> = (0..=prefixes.len()).map(|_| Vec::new()).collect();
    for (name, t) in vs.variables() {
        if !t.requires_grad() {
            continue; // frozen: replicated as it is, no optimizer state
        }
        let unit = prefixes
            .iter()
            .position(|p| name.starts_with(&format!("{p}.")))
            .unwrap_or(prefixes.len());
        by_unit[unit].push((name, t));
    }
    // A unit of frozen parameters only (a LoRA model's frozen embedding)
    // has an empty trainable part: stage 3 shards its frozen one.
    if let Some(i) = by_unit[..prefixes.len()].iter().position(Vec::is_empty) {
        let p = &prefixes[i];
        let frozen = vs
            .variables()
            .keys()
            .any(|n| n.starts_with(&format!("{p}.")));
        if !frozen {
            return Err(EngineError::Plan(format!("unit `{p}` has no parameters under its VarStore path: wrap the module with the path its parameters were created under")));
        }
    }
    Ok(by_unit)
}

/// Stage 3's persistence threshold: a unit made only of parameters of at
/// most `threshold` elements stays gathered whole; from a unit that also
/// has larger ones they move to the root (the last list), which stays
/// gathered. Returns the root when it took any.
fn move_small_to_root(by_unit: &mut [Vec<Named>], threshold: usize) -> Option<usize> {
    let small = |t: &Tensor| t.numel() <= threshold;
    let root = by_unit.len() - 1;
    let mut root_of_moved = None;
    for g in 0..root {
        if by_unit[g].iter().all(|(_, t)| small(t)) {
            continue;
        }
        let (keep, moved): (Vec<_>, Vec<_>) = std::mem::take(&mut by_unit[g])
            .into_iter()
            .partition(|(_, t)| !small(t));
        by_unit[g] = keep;
        if moved.iter().any(|(_, t)| t.requires_grad()) {
            root_of_moved = Some(root);
        }
        by_unit[root].extend(moved);
    }
    root_of_moved
}

/// Refuses a trained parameter neither fp32 nor the compute dtype.
fn check_kinds(by_unit: &[Vec<Named>], compute: Compute) -> Result<(), EngineError> {
    for (name, t) in by_unit.iter().flatten() {
        // Widened to the fp32 master exactly. A model the last engine
        // on it left in the compute dtype builds again; one in another
        // 16-bit dtype than the config's is a config that forgot its
        // `bf16` or `fp16` block, or a model to cast back first.
        let kind = t.kind();
        if kind != Kind::Float && kind != compute.kind() {
            let fix = match kind {
                Kind::BFloat16 => "enable `\"bf16\": {\"enabled\": true}` in the config, or ",
                Kind::Half => "enable `\"fp16\": {\"enabled\": true}` in the config, or ",
                _ => "",
            };
            return Err(EngineError::Plan(format!(
                "parameter `{name}` is {kind:?} and the config computes in {:?}: {fix}make the model fp32 (`vs.float()`; the engine keeps an fp32 master and casts to the compute dtype)",
                compute.kind()
            )));
        }
    }
    Ok(())
}

/// Each unit laid out flat, its parameters made views of its flat
/// tensor, with world rank 0's values (a collective); and each unit's
/// optimizer-side shard, `shard_of` its fp32 values.
///
/// One unit at a time, so that building holds the model plus one unit,
/// not two copies of it: each unit's whole fp32 values are cut to this
/// rank's shard before the next unit is laid out, and at stage 3
/// (`stage3_threshold` given) a unit the stage frees between steps is
/// freed at once. Until 2026-12-01 every unit's whole fp32 values and
/// gathered buffer were held to the end of the build: 2.2 times the
/// model's bytes at its peak on every rank (`docs/status.md`).
#[allow(clippy::too_many_arguments)]
fn lay_out<G: ProcessGroup>(
    vs: &nn::VarStore,
    by_unit: Vec<Vec<Named>>,
    prefixes: &[String],
    settings: &groups::Settings,
    compute: Compute,
    (group, replicate): (&G, Option<&G>),
    source: Source<'_>,
    stage3_threshold: Option<usize>,
    shard_of: impl Fn(&Unit, Vec<f32>) -> Shard,
) -> Result<(Vec<Unit>, Vec<Shard>), EngineError> {
    let setting = |name: &str| settings.get(name);
    // Frozen variables some ranks may not use.
    let frozen_declared: Vec<String> = (vs.variables().into_iter())
        .filter(|(n, t)| !t.requires_grad() && setting(n).uneven)
        .map(|(n, _)| n)
        .collect();
    let mut units = Vec::new();
    let mut shards = Vec::new();
    for (i, params) in by_unit.into_iter().enumerate() {
        if params.is_empty() && i == prefixes.len() {
            continue; // an empty root
        }
        let name = prefixes.get(i).cloned().unwrap_or_else(|| "<root>".into());
        let layout = FlatLayout::new(
            params.iter().map(|(n, t)| (n.clone(), t.size())).collect(),
            group.size(),
        );
        let by_name: HashMap<String, Tensor> = params.into_iter().collect();
        let (master, flat, ts) =
            rank0_flat(&layout, &by_name, compute, (group, replicate), source)?;
        let special = groups::special_ranges(&layout, setting);
        // Its frozen variables count too (stage 3 gathers them with
        // it); the root holds no frozen part.
        let frozen_uneven = i < prefixes.len()
            && frozen_declared
                .iter()
                .any(|n| n.starts_with(&format!("{name}.")));
        let uneven = frozen_uneven || layout.slots.iter().any(|s| setting(&s.name).uneven);
        let partial = !uneven && layout.slots.iter().any(|s| setting(&s.name).partial);
        let unit = Unit {
            name,
            special,
            uneven,
            partial,
            layout,
            params: ts,
            flat,
            frozen: None,
        };
        shards.push(shard_of(&unit, master));
        if stage3_threshold.is_some_and(|t| freed_between_steps(&unit, i == prefixes.len(), t)) {
            glue::free_storage(&unit.flat)?;
            crate::first_rank::give_back_to_the_system();
        }
        units.push(unit);
    }
    Ok((units, shards))
}

/// Whether stage 3 surely frees unit `u` between steps, whatever its
/// frozen part: not the root, not one some ranks may skip, and holding a
/// parameter above the persistence threshold `threshold` (a subset of
/// what [`FrozenPart::shard`] decides, which the build checks).
fn freed_between_steps(u: &Unit, root: bool, threshold: usize) -> bool {
    !root && !u.uneven && u.layout.slots.iter().any(|s| s.numel > threshold)
}

/// Says how many parameters the plan's weight-decay and learning-rate
/// rules name.
fn log_rules(settings: &groups::Settings, units: &[Unit]) {
    let left_out = settings.excluded().len();
    let scaled = settings.lr_scales().len();
    let all: usize = units.iter().map(|u| u.layout.slots.len()).sum();
    if left_out > 0 {
        tracing::info!(
            "weight decay leaves out {left_out} of {all} trained parameters (ShardPlan::exclude_from_weight_decay)"
        );
    }
    if scaled > 0 {
        tracing::info!(
            "the learning rate of {scaled} of {all} trained parameters is scaled (ShardPlan::scale_learning_rate)"
        );
    }
}

/// Settles which units some ranks' losses leave out (in whole or in
/// part) and how each is reduced, and says so.
fn settle_uneven(units: &mut [Unit], root_of_moved: Option<usize>, stage: u8) {
    // Every checkpointed segment holds the root of moved parameters
    // (see `segments`), so a segment some ranks skip would hold it on
    // some ranks only: it is reduced at the end of backward too.
    if let Some(root) = root_of_moved.filter(|_| units.iter().any(|u| u.uneven)) {
        if let Some(u) = units.get_mut(root) {
            u.uneven = true;
            u.partial = false;
        }
    }
    // Below stage 3 a unit every rank runs but some ranks' losses use
    // only part of is reduced as one some ranks skip: backward gathers
    // nothing there, so the agreed order serves it as well.
    for u in units.iter_mut().filter(|u| u.partial && stage != 3) {
        (u.uneven, u.partial) = (true, false);
    }
    let partial: Vec<&str> = (units.iter())
        .filter(|u| u.partial)
        .map(|u| u.name.as_str())
        .collect();
    if !partial.is_empty() {
        tracing::info!(
            "units {} are gathered and freed like the others and reduced when the backward of the unit before each begins (ShardPlan::partly_unused_on_some_ranks)",
            partial.join(", ")
        );
    }
    let uneven: Vec<&str> = (units.iter())
        .filter(|u| u.uneven)
        .map(|u| u.name.as_str())
        .collect();
    if !uneven.is_empty() && stage != 1 {
        let when = match stage {
            3 => "at the end of each backward and stay gathered",
            _ => "in one order the ranks agree at the end of the first backward (at its end until then)",
        };
        tracing::info!(
            "units {} are reduced {when} (ShardPlan::unused_on_some_ranks)",
            uneven.join(", ")
        );
    }
}

/// This rank's optimizer-side buffers of unit `u`, from its fp32 values
/// `master` (the whole unit). `pack_muon`: Muon's matrices keep no `v`
/// here (in memory; the NVMe swap's arrays keep the whole range).
fn new_shard(
    u: &Unit,
    master: Vec<f32>,
    c: &Config,
    compute: Compute,
    rank: usize,
    pack_muon: bool,
    settings: &groups::Settings,
) -> Shard {
    let stage = c.zero.stage;
    let (full, part, range) = (u.layout.padded, u.layout.shard_len(), u.layout.shard(rank));
    let opt_len = if stage == 0 { full } else { part };
    let master = match (compute, stage) {
        (Compute::F32, 0..=2) => Vec::new(),
        (_, 0) => master,
        _ => master[range.clone()].to_vec(),
    };
    let copy = match (compute, stage) {
        // SAFETY: the flat tensor was just filled with this dtype.
        (Compute::Bf16, 3) => {
            CopyShard::Bf16(unsafe { elems::<bf16>(&u.flat, full) }[range.clone()].to_vec())
        }
        (Compute::F16, 3) => {
            CopyShard::F16(unsafe { elems::<f16>(&u.flat, full) }[range.clone()].to_vec())
        }
        _ => CopyShard::None,
    };
    let g_len = if stage <= 1 { full } else { part };
    // Lion and SGD keep no second moment: their `v` stays empty
    // everywhere, and SGD without momentum keeps no `m` either.
    let len_of = |held: bool| if held { opt_len } else { 0 };
    let moments = c.optimizer.moments();
    let v_layout = match pack_muon {
        true => muon_holes(u, stage, rank, settings),
        false => v_layout::VLayout::default(),
    };
    let v_len = v_layout.kept(len_of(moments == 2));
    Shard {
        master,
        // Adagrad's sum starts at its initial_accumulator_value.
        m: vec![c.optimizer.initial_m(); len_of(moments >= 1)],
        v: vec![0.0; v_len],
        v_layout,
        g: vec![0.0; g_len],
        reduced: Vec::new(),
        copy,
    }
}

/// The pieces of unit `u`'s optimizer range on `rank` that Muon steps
/// (its matrices: no second moment), as holes of a `v`.
fn muon_holes(u: &Unit, stage: u8, rank: usize, settings: &groups::Settings) -> v_layout::VLayout {
    let opt = match stage {
        0 => 0..u.layout.padded,
        _ => u.layout.shard(rank),
    };
    v_layout::VLayout::without(
        (u.layout.indexed_pieces(opt))
            .filter(|(_, s, _, _)| settings.get(&s.name).muon)
            .map(|(_, _, _, dst)| dst),
    )
}

/// How stage 3 shards the frozen parameters of its units.
struct FrozenPart<'a> {
    /// `stage3_param_persistence_threshold`: parameters of at most this
    /// many elements stay whole.
    threshold: usize,
    compute: Compute,
    /// `zero_quantized_nontrainable_weights`: kept as int8.
    quantize: bool,
    /// Where the values come from.
    source: Source<'a>,
}

impl FrozenPart<'_> {
    /// Stage 3 shards the frozen parameters of its units too (not the
    /// root's): fp32 or compute-dtype ones of more than `threshold`
    /// elements, each into its unit's frozen part (a collective).
    fn shard<G: ProcessGroup>(
        &self,
        vs: &nn::VarStore,
        units: &mut [Unit],
        stage: u8,
        group: &G,
        replicate: Option<&G>,
    ) -> Result<Unsharded, EngineError> {
        let threshold = self.threshold;
        let params: HashSet<usize> = vs
            .trainable_variables()
            .iter()
            .map(glue::tensor_impl)
            .collect::<Result<_, _>>()?;
        let mut all_vars = vs.variables();
        let mut frozen_of: Vec<Vec<String>> = units.iter().map(|_| Vec::new()).collect();
        for (name, t) in all_vars.iter().filter(|_| stage == 3) {
            if t.requires_grad()
                || !frozen_shards::shardable(t, self.compute.kind(), threshold)
                || !params.contains(&glue::tensor_impl(t)?)
            {
                continue;
            }
            let unit = units
                .iter()
                .position(|u| u.name != "<root>" && name.starts_with(&format!("{}.", u.name)));
            // A unit some ranks may not run stays gathered whole.
            if let Some(k) = unit.filter(|&k| !units[k].uneven) {
                frozen_of[k].push(name.clone());
            }
        }
        frozen_of.iter_mut().for_each(|f| f.sort());
        // A unit stays gathered when all it would shard is small (a LoRA
        // block's adapters under the threshold do not keep its frozen base
        // gathered), and when some ranks may not run it: its forward must
        // not gather, or the ranks that skip it would meet the others'
        // gather with their next unit's.
        let persistent: Vec<bool> = units
            .iter()
            .zip(&frozen_of)
            .map(|(u, f)| {
                let small = u.layout.slots.iter().all(|s| s.numel <= threshold);
                stage == 3 && (u.name == "<root>" || u.uneven || (small && f.is_empty()))
            })
            .collect();
        // `lay_out` freed at once the units it was sure of: all of them
        // are freed between steps.
        debug_assert!(units.iter().zip(&persistent).all(|(u, &keep)| {
            !(stage == 3 && keep && freed_between_steps(u, u.name == "<root>", threshold))
        }));
        for ((u, take), &keep) in units.iter_mut().zip(frozen_of).zip(&persistent) {
            if take.is_empty() {
                continue;
            }
            let vars = take
                .iter()
                .filter_map(|n| all_vars.remove_entry(n))
                .collect();
            let part = frozen_shards::Part::new(
                &u.name,
                vars,
                self.compute,
                self.source,
                group,
                replicate,
                self.quantize,
            )?;
            // One unit's frozen buffer at a time, as `lay_out` does.
            if !keep {
                glue::free_storage(&part.flat)?;
            }
            u.frozen = Some(part);
        }
        if stage == 3 && self.quantize && units.iter().all(|u| u.frozen.is_none()) {
            tracing::warn!("`zero_optimization.zero_quantized_nontrainable_weights` = true, but no frozen parameter is sharded, so none is quantized: stage 3 shards frozen fp32 or compute-dtype parameters of more than `stage3_param_persistence_threshold` elements inside wrapped blocks that every rank runs (not the root's)");
        }
        Ok(Unsharded {
            whole: all_vars,
            params,
            persistent,
        })
    }
}

/// What [`FrozenPart::shard`] leaves for the engine.
struct Unsharded {
    /// The variables left whole (replicated, rank 0's values).
    whole: HashMap<String, Tensor>,
    /// The TensorImpls of the VarStore's parameters, trainable or frozen
    /// (not its buffers).
    params: HashSet<usize>,
    /// Which units stay gathered (stage 3).
    persistent: Vec<bool>,
}

/// Every parameter of the units, trained or in a frozen part, by its
/// TensorImpl address: (unit, name).
fn owners_of(units: &[Unit]) -> Result<HashMap<usize, (usize, String)>, EngineError> {
    let mut owners = HashMap::new();
    for (k, u) in units.iter().enumerate() {
        let frozen = u
            .frozen
            .iter()
            .flat_map(|p| p.layout.slots.iter().zip(&p.params));
        for (slot, t) in u.layout.slots.iter().zip(&u.params).chain(frozen) {
            owners.insert(glue::tensor_impl(t)?, (k, slot.name.clone()));
        }
    }
    Ok(owners)
}

/// Hooks every trained parameter so that each unit's gradients are
/// reduced as soon as they are all in.
fn hook_gradients<G: ProcessGroup + 'static>(inner: &Arc<Inner<G>>) -> Result<(), EngineError> {
    let st = inner.st.lock();
    for (k, u) in st.units.iter().enumerate() {
        for (j, t) in u.params.iter().enumerate() {
            let weak = Arc::downgrade(inner);
            glue::on_grad_accumulated(t, move || {
                if let Some(i) = weak.upgrade() {
                    i.grad_accumulated(k, j);
                }
            })?;
        }
    }
    Ok(())
}

//! The engine: a model's units as flat buffers sharded across a group, and
//! the training step of ZeRO stages 0-3 (DESIGN.md, "One training step").
//!
//! What this build does, per stage:
//!
//! | stage | between steps, per rank | each micro-step | at the boundary |
//! |---|---|---|---|
//! | 0 | full params, master, m, v, grads | all_reduce(avg) grads | Adam on everything |
//! | 1 | full params and grads, shard of master, m, v | accumulate grads locally; the boundary's backward reduce_scatters the sums | Adam on the shard, all_gather params |
//! | 2 | full params, shard of master, grads, m, v | reduce_scatter(avg) into the grad shard | Adam on the shard, all_gather params |
//! | 3 | shard of master, grads, m, v | reduce_scatter(avg) into the grad shard | Adam on the shard, free the gathered params |
//!
//! Each unit's parameters are views (`set_data`) into one flat tensor of the
//! compute dtype. In fp32 training that tensor is the master copy, so for
//! stages 0-2 this rank's master shard is its slice of it (no copy). With
//! bf16 or fp16 compute an fp32 master (full for stage 0, a shard otherwise)
//! is kept beside it, the optimizer writes the compute-dtype copy in the same
//! pass, and stages 1-3 gather 16-bit shards (half the bytes). Gradients are
//! widened to fp32 before they are reduced (unless the config's
//! `communication_data_type` asks for the 16-bit compute dtype) and always
//! accumulated in fp32 (DESIGN.md, "Numerics"). fp16 uses DeepSpeed's dynamic
//! loss scaling: an overflow on any rank skips the step on every rank.
//!
//! Stage 3 gathers a unit right before its forward (through
//! [`crate::ShardedModule`]), frees its storage right after (the glue's
//! in-place free), re-gathers it from a hook on its output's gradient just
//! before its backward, and frees it again once its gradients are reduced,
//! so between steps a rank holds only shards. The root unit (parameters
//! outside every wrapped module, and those under
//! `stage3_param_persistence_threshold`) stays gathered, as FSDP2's root
//! does. Gradients are copied out of `.grad` and `.grad` is dropped, so they
//! are never held twice; a sparse one (`embedding(.., sparse = true)`'s
//! rows) is added into the unit's gradient buffer row by row, and a unit
//! is freed before that buffer is taken, so the pool hands its gathered
//! buffer over as the gradient buffer. A unit is gathered straight into a buffer that then
//! becomes its storage (the glue's adopt, no copy); freeing the unit hands
//! the buffer to a small pool the next gather (or gradient buffer) of that
//! size takes it from, already paged in.
//!
//! Submodules: `build` (an engine's construction: the checks, the
//! layout, the shards, the hooks), `step` (the optimizer step at the
//! boundary: overflow, norm, hyperparameters, the optimizer range by
//! range, the updated shards shared), `agree` (the ranks' check, at build,
//! that they train the same model with the same config), `overlap` (reductions issued from
//! gradient hooks during backward, prefetched gathers, reduce buckets, hpZ
//! re-gathers), `pool` (the reused gather and gradient buffers),
//! `checkpoint` (save and load), `frozen` (the variables that do not train:
//! synced from rank 0, saved and exported), `frozen_shards` (stage 3's
//! frozen parameters, sharded and gathered with their unit), `offload` (NVMe
//! swaps of optimizer state and stage-3 parameters), `timing`
//! (`wall_clock_breakdown`). Hybrid
//! sharding ([`Engine::new_hybrid`]) shards inside a mesh's shard groups and
//! averages gradient shards across its replicate groups.

use std::sync::Arc;

use half::{bf16, f16};
use parking_lot::Mutex;
use tch::{nn, Kind, Tensor};
use zrt_collectives::{CommError, DeviceMesh, Element, Groups, ProcessGroup, ReduceOp, Work};
use zrt_kernels::{AdamConfig, Threads};

use crate::config::{ConfigError, OptimizerKind};
use crate::flat::FlatLayout;
use crate::plan::{ShardPlan, UnitHook};
use crate::schedule::betas_at;
use crate::{glue, AutoHints, Config, EngineError, Resolved};
use loss_scale::Scaler;
use offload::{ReadAhead, Writes};

mod agree;
mod build;
mod checkpoint;
mod comms_log;
mod elems;
mod flops;
mod foreign;
mod frozen;
mod frozen_shards;
mod full_params;
mod groups;
mod input_grads;
mod lamb;
mod launch_order;
mod loss_scale;
mod memory;
pub use memory::resident_bytes;
mod muon;
mod offload;
mod overlap;
mod pool;
mod progress;
mod segments;
mod state_dump;
mod step;
mod timing;
mod v_layout;
mod weights;

pub use comms_log::{CommsRow, CommsSummary};
pub use overlap::OverlapCounts;
pub use timing::StepBreakdown;
pub use weights::LoadedWeights;

/// The dtype of the parameters forward and backward run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compute {
    F32,
    Bf16,
    F16,
}

impl Compute {
    fn kind(self) -> Kind {
        match self {
            Compute::F32 => Kind::Float,
            Compute::Bf16 => Kind::BFloat16,
            Compute::F16 => Kind::Half,
        }
    }
    fn bytes(self) -> usize {
        if self == Compute::F32 {
            4
        } else {
            2
        }
    }
}

/// One unit: its layout, its parameters (views into `flat`), the flat
/// tensor, and at stage 3 its sharded frozen parameters.
struct Unit {
    name: String,
    layout: FlatLayout,
    /// The ranges of the flat buffer the optimizer does not treat plainly
    /// ([`ShardPlan::exclude_from_weight_decay`],
    /// [`ShardPlan::scale_learning_rate`]).
    special: Vec<(std::ops::Range<usize>, groups::Setting)>,
    /// Some ranks' losses may not use some of its parameters, trainable
    /// or frozen ([`ShardPlan::unused_on_some_ranks`]): at stages 0 and 2
    /// reduced in the order the ranks agree (see `launch_order`), at the
    /// end of the first backward until there is one; at stage 3 at the
    /// end of backward, gathered throughout and left out of the run order
    /// (stage 1, which communicates nothing in backward, takes it as any
    /// unit).
    uneven: bool,
    /// Stage 3 only: some ranks' losses may not use some of its trainable
    /// parameters, but every rank runs it
    /// ([`ShardPlan::partly_unused_on_some_ranks`]; other stages take such
    /// a unit as `uneven`): gathered and freed like any unit, reduced when
    /// the backward of the unit before it begins (see
    /// `overlap::Inner::reduce_partial_units`), or at the end of backward.
    partial: bool,
    params: Vec<Tensor>,
    flat: Tensor,
    frozen: Option<frozen_shards::Part>,
}

impl Unit {
    /// The VarStore name of its trained parameter `j` ("?" past the last).
    fn param_name(&self, j: usize) -> &str {
        self.layout.slots.get(j).map_or("?", |s| s.name.as_str())
    }

    /// Elements a gather of the unit brings in (trainable and frozen).
    fn gathered_len(&self) -> usize {
        self.layout.padded + self.frozen.as_ref().map_or(0, |p| p.padded())
    }
}

/// This rank's compute-dtype shard (stage 3 with 16-bit compute): what the
/// next forward gathers.
enum CopyShard {
    None,
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

/// This rank's optimizer-side buffers of one unit.
struct Shard {
    /// The fp32 master: empty when the flat tensor is the master (fp32,
    /// stages 0-2); the full buffer (16-bit stage 0) or this rank's shard.
    master: Vec<f32>,
    m: Vec<f32>,
    /// The second moment, packed as `v_layout` says (Muon's matrices'
    /// left out, in memory).
    v: Vec<f32>,
    v_layout: v_layout::VLayout,
    /// Accumulated gradients: full (stages 0, 1) or this rank's shard.
    g: Vec<f32>,
    /// Stage 1: this step's reduced gradient shard.
    reduced: Vec<f32>,
    copy: CopyShard,
}

/// This rank's optimizer state over its shard of one unit (borrowed from
/// memory, or read from the swap).
struct ShardState<'a> {
    master: std::borrow::Cow<'a, [f32]>,
    m: std::borrow::Cow<'a, [f32]>,
    v: std::borrow::Cow<'a, [f32]>,
}

/// One unit's optimizer state over a rank's range, owned: what a
/// checkpoint load or a write-back of changed parameters installs.
struct OwnedState {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl OwnedState {
    /// `master` with the moments of an optimizer keeping `moments` of
    /// them as a new one starts them: `m` at `initial_m` (Adagrad's
    /// `initial_accumulator_value`, else 0), `v` at 0; the `v` of one
    /// keeping one moment and both of one keeping none are empty.
    fn afresh(master: Vec<f32>, moments: usize, initial_m: f32) -> Self {
        let n = master.len();
        Self {
            master,
            m: vec![initial_m; if moments >= 1 { n } else { 0 }],
            v: vec![0.0; if moments == 2 { n } else { 0 }],
        }
    }
}

/// What one optimizer step applies to every range it updates.
struct Update<'a> {
    adam: &'a AdamConfig,
    step: u64,
    scale: f32,
}

struct State {
    units: Vec<Unit>,
    shards: Vec<Shard>,
    gathered: Vec<bool>,
    micro: u64,
    /// The micro-step count at the last boundary handled: a second `step()`
    /// without a new `backward` must not step again.
    boundary_at: u64,
    /// The micro-step count at the last `step()` call (boundary or not): a
    /// backward since then belongs to the micro-step in progress
    /// (`Engine::is_gradient_accumulation_boundary`).
    step_called_at: u64,
    step: u64,
    /// Steps applied since the optimizer's state started: in a new engine,
    /// or at a module-only load, which starts the moments afresh. Adam's
    /// and LAMB's bias correction, SGD's first step and Adagrad's rate
    /// decay count from it, as torch's optimizers count a fresh state's
    /// `step`; the schedules go on from `step`. A full load restores it.
    opt_step: u64,
    skipped: u64,
    norm: Option<f64>,
    lr: f64,
    /// The learning rate the program set (`Engine::set_lr`), which steps
    /// use instead of the config's until it sets another.
    lr_set: Option<f64>,
    scaler: Option<Scaler>,
    /// With a monitor open: the sum and count of the losses this step's
    /// `Engine::backward` calls saw (their mean is the monitors' train loss).
    loss_sum: Option<(f64, u64)>,
    /// The first error a forward hook hit; the next engine call returns it.
    error: Option<EngineError>,
    /// Why this engine's accumulated gradients cannot be trusted (a
    /// backward failed after some of its reductions were added to them):
    /// every call that checks pending errors returns it (all but a load,
    /// which replaces them, and the weight-only reads).
    broken: Option<String>,
    /// Stage 1: the boundary's backward reduced the step's accumulated
    /// gradients into the shards' `reduced` (see
    /// `Inner::stage1_reduces_now`), so `step()` does not reduce them
    /// again. Cleared by the step and by a load, which replaces them.
    reduced_in_backward: bool,
    /// Reductions and gathers in flight (see `overlap`).
    prog: overlap::Progress,
    /// Where the current step's time goes.
    timing: timing::Timing,
    /// Stage 3: units kept gathered (the root, which also holds the small
    /// parameters moved out of larger units, and units made only of
    /// parameters of at most `stage3_param_persistence_threshold` elements).
    persistent: Vec<bool>,
    /// Stage 3, `zero_quantized_weights`: units whose gathered values were
    /// unpacked from int8 (not the true ones `with_full_params` gives).
    quantized: Vec<bool>,
    /// hpZ secondary copies, per unit, between its forward and backward.
    secondary: Vec<Option<overlap::Secondary>>,
    /// Units whose first forward has been checked for parameters of other
    /// units (stage 3).
    checked: Vec<bool>,
    /// Stage 3: units freed to storage that reads as zeros after their
    /// first forward (see `after_forward`), not yet moved to a guard.
    zeroed: usize,
    /// Stage 3: the unit whose first forward ended last, kept gathered
    /// until another unit's first forward ends (see `after_forward`).
    held: Option<usize>,
    /// The model's tensors that do not train (not sharded).
    frozen: frozen::Frozen,
}

struct Inner<G> {
    /// The group parameters are sharded over (the whole data-parallel world
    /// unless the engine was built on a hybrid mesh).
    group: G,
    /// Hybrid sharding: the ranks holding the same shard in the other shard
    /// groups, across which gradient shards are averaged.
    replicate: Option<G>,
    cfg: Resolved,
    stage: u8,
    compute: Compute,
    threads: Threads,
    st: Mutex<State>,
    /// Stage 3: forwards whose input gradient backward has yet to compute
    /// (see `input_grad_ready`).
    input_grads: Arc<input_grads::InputGrads>,
    /// Test knob: sleep a random 0-2 ms before every collective (0: off).
    delays: Mutex<u64>,
    /// NVMe offload: this rank's optimizer state (m, v, and the fp32 master
    /// when the compute dtype is 16-bit) lives in this swap file.
    swap: Option<zrt_offload::Swap>,
    /// Stage-3 parameter offload: the units' gather sources live here.
    pswap: Option<offload::ParamSwap>,
    /// Reduce gradients in the 16-bit compute dtype (the config's
    /// `communication_data_type`), not fp32.
    reduce_16: bool,
    /// ZeRO++ hpZ: the group backward re-gathers stage-3 units in, from
    /// secondary copies kept after forward.
    hpz: Option<G>,
    /// How the optimizer treats each trained parameter the plan's rules
    /// name (weight decay, learning-rate scale), asked once at build;
    /// checkpoints record it.
    settings: groups::Settings,
    /// The job's first rank's `csv_monitor` and `tensorboard` writers,
    /// when the config enables any (see [`crate::monitor`]).
    monitor: Mutex<Option<crate::monitor::Monitor>>,
    /// Every trainable parameter by its TensorImpl address: (unit, name).
    owners: std::collections::HashMap<usize, (usize, String)>,
    /// Stage 3's gather buffers (they become unit storage and come back
    /// here when the unit is freed) and whole-unit gradient buffers.
    pools: pool::Pools,
    /// This engine among the process's (see [`foreign`]).
    id: u64,
    /// `backward` calls so far: with `id`, names each backward to the
    /// other engines' hooks.
    backwards: std::sync::atomic::AtomicU64,
    /// Whether this engine has said that it dropped gradients another
    /// engine's backward sent through its parameters (said once).
    told_foreign: std::sync::atomic::AtomicBool,
    /// Whether it warned of a backward that reached none of its parameters.
    told_untouched: std::sync::atomic::AtomicBool,
    /// The checkpointed segments each unit's reduction waits for.
    segments: segments::Segments,
    /// `flops_profiler`, on the first rank: the profile of the step under
    /// way, while it is profiled (taken after `st`, never before it).
    flops: Mutex<Option<flops::FlopsProfile>>,
}

/// The training engine of one rank. See the module docs for what each
/// stage keeps where.
pub struct Engine<G: ProcessGroup + 'static> {
    inner: Arc<Inner<G>>,
    /// Its hold on the plan it was built from. Dropping it leaves the plan
    /// to the next engine built from it (a new config, a phase of
    /// training, a sweep: `unshard()` first at stage 3, so the parameters
    /// hold their values).
    _plan: crate::plan::Claim,
}

/// `n` elements of T at `t`'s data (contiguous, CPU, of T's dtype).
///
/// # Safety
/// `t` must be contiguous with at least `n` elements of exactly T's layout,
/// and nothing else may read or write the memory for the slice's lifetime
/// (the engine holds its state lock; no forward or backward runs).
#[allow(clippy::mut_from_ref)]
unsafe fn elems<T>(t: &Tensor, n: usize) -> &mut [T] {
    if n == 0 {
        // An empty tensor's data pointer may be null, which no slice may
        // have (a unit of frozen parameters only has an empty flat).
        return &mut [];
    }
    std::slice::from_raw_parts_mut(t.data_ptr() as *mut T, n)
}

/// Where an engine's build takes the weights' values from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// World rank 0's variables, everyone's (`sync_module_states`); read
    /// back from its spill first where it wrote them there
    /// (`ShardPlan::weights_on_disk_while_built`).
    FirstRank(Option<&'a crate::spill::Spill>),
    /// No rank's: the layout holds zeros until the build ends by loading
    /// `ShardPlan::weights_from_file`'s file; but for the variables
    /// `ShardPlan::fresh_weights` names (the rule), which the file does
    /// not hold: world rank 0's, as [`Source::FirstRank`]'s.
    File(Option<&'a crate::plan::NameRule>),
}

impl Source<'_> {
    /// Whether the variable `name` of `shape` takes world rank 0's values
    /// (every variable but those a file will fill).
    fn takes_rank0(&self, name: &str, shape: &[i64]) -> bool {
        match self {
            Source::FirstRank(_) => true,
            Source::File(fresh) => fresh.is_some_and(|f| f(name, shape)),
        }
    }
}

/// The fp32 values of `vars` (fp32 tensors) laid out flat over `layout`,
/// world rank 0's on every rank: across replicas first, then inside the
/// shard group (whose rank 0 then holds them); zeros, with no
/// collective, from [`Source::File`] (but for its fresh variables: a
/// unit holding one is world rank 0's, the rest zeros). Returns them, a
/// new flat tensor of `compute`'s dtype holding them (from a file with
/// no fresh variable: its slots unwritten, the file's load writes them),
/// and the variables made views (`set_data`) of their slots, in slot
/// order. A collective.
fn rank0_flat<G: ProcessGroup>(
    layout: &FlatLayout,
    vars: &std::collections::HashMap<String, Tensor>,
    compute: Compute,
    (group, replicate): (&G, Option<&G>),
    source: Source<'_>,
) -> Result<(Vec<f32>, Tensor, Vec<Tensor>), EngineError> {
    let var = |name: &str| {
        vars.get(name)
            .ok_or_else(|| EngineError::Plan(format!("no variable `{name}` to lay out")))
    };
    let mut values = vec![0f32; layout.padded];
    // Every other rank's values are replaced by world rank 0's below: a
    // variable released while the model was built
    // (`ShardPlan::weights_on_first_rank_only`) is not read there (the
    // first rank's must be: a freed one there stops the process, saying
    // why, as any read of a freed weight does).
    let wanted = |s: &crate::flat::Slot| source.takes_rank0(&s.name, &s.shape);
    // Agreed on every rank without a word: the rule sees names and shapes.
    let broadcast = layout.slots.iter().any(wanted);
    let root = is_first_rank(group, replicate) && broadcast;
    for s in &layout.slots {
        let t = var(&s.name)?;
        // A file's variable stays zero here: the file fills it.
        if !wanted(s) || (!root && glue::is_freed(t)?) {
            continue;
        }
        let slot = &mut values[s.offset..s.offset + s.numel];
        if let (true, Source::FirstRank(Some(spill))) = (root, source) {
            // Straight into the layout: the view below is its memory.
            if spill.read_f32(&s.name, slot)? {
                continue;
            }
        }
        let v = Vec::<f32>::try_from(&t.detach().f_contiguous()?.f_flatten(0, -1)?)?;
        slot.copy_from_slice(&v);
    }
    let values = match (replicate, broadcast) {
        (Some(r), true) => r.broadcast(values, 0).wait()?,
        _ => values,
    };
    let values = match broadcast {
        true => group.broadcast(values, 0).wait()?,
        false => values,
    };
    let flat = match (source, broadcast) {
        // A file fills every variable of the unit: memory it will write,
        // not a copy of zeros (see `unwritten_flat`).
        (Source::File(_), false) => unwritten_flat(layout, compute)?,
        // One copy of the unit beside `values` (to_kind keeps an fp32
        // tensor as it is), where zeros filled from a copy were two.
        _ => tch::no_grad(|| Tensor::f_from_slice(&values)?.f_to_kind(compute.kind()))?,
    };
    let mut views = Vec::with_capacity(layout.slots.len());
    for s in &layout.slots {
        let mut t = var(&s.name)?.shallow_clone();
        let view = flat
            .f_narrow(0, s.offset as i64, s.numel as i64)?
            .f_view(s.shape.as_slice())?;
        t.set_data(&view);
        views.push(t);
    }
    Ok((values, flat, views))
}

/// A flat tensor of `compute`'s dtype over `layout` whose variables'
/// slots are left unwritten (a file's values fill them before the build
/// returns) and whose gaps between them and tail are zeros. Large blocks
/// come fresh from the system, so pages nothing writes take no memory: a
/// stage-3 unit freed as soon as it is laid out (its shard cut from the
/// zeros `values`, not from this) costs none while built. Before, its
/// zeros were copied in from `values` (and cast, in 16-bit compute): a
/// 32000 x 768 embedding held 94 MiB a rank in fp32, 141 MiB in bf16.
fn unwritten_flat(layout: &FlatLayout, compute: Compute) -> Result<Tensor, EngineError> {
    let flat = Tensor::f_empty([layout.padded as i64], (compute.kind(), tch::Device::Cpu))?;
    let mut end = 0;
    let zero = |from: usize, to: usize| -> Result<(), EngineError> {
        if to > from {
            let gap = flat.f_narrow(0, from as i64, (to - from) as i64)?;
            drop(tch::no_grad(|| gap.shallow_clone().f_zero_())?);
        }
        Ok(())
    };
    for s in &layout.slots {
        zero(end, s.offset)?;
        end = s.offset + s.numel;
    }
    zero(end, layout.padded)?;
    Ok(flat)
}

/// All-gathers `mine` into the whole of `flat` (`padded` elements of T);
/// returns `mine` for reuse.
fn gather_into<T: Element, G: ProcessGroup>(
    group: &G,
    mine: Vec<T>,
    flat: &Tensor,
    padded: usize,
) -> Result<Vec<T>, EngineError> {
    let (mine, full) = gather_whole(group, mine, padded)?;
    // SAFETY: `flat` is the engine's contiguous tensor of T with `padded` elements.
    unsafe { elems::<T>(flat, padded) }.copy_from_slice(&full);
    Ok(mine)
}

/// All-gathers `mine` into a unit's whole `padded` elements: (`mine`
/// back, the whole). A peer's different call here is
/// [`EngineError::OutOfStep`] (see [`out_of_step`]); parts that do not
/// add up to `padded` (a shard of the wrong size on every rank) an error
/// too, not a short buffer for the caller to copy from.
pub(super) fn gather_whole<T: Element, G: ProcessGroup>(
    group: &G,
    mine: Vec<T>,
    padded: usize,
) -> Result<(Vec<T>, Vec<T>), EngineError> {
    let what = || format!("this rank gathered a unit's {padded} elements");
    let (mine, full) = group
        .all_gather(mine, Vec::new())
        .wait()
        .map_err(|e| out_of_step(e, what))?;
    if full.len() != padded {
        return Err(EngineError::OutOfStep(format!(
            "{} and got {}",
            what(),
            full.len()
        )));
    }
    Ok((mine, full))
}

/// The error for collective `e`, met while this rank did `what`: a
/// mismatch means a peer made another engine call here (all_gather parts
/// must agree in length, so a peer's different gather cannot match
/// this one), which is [`EngineError::OutOfStep`]. A peer's checkpoint
/// agreement stays [`EngineError::Comm`] for `checkpoint_on_a_peer`.
pub(super) fn out_of_step(e: CommError, what: impl FnOnce() -> String) -> EngineError {
    match e {
        c @ CommError::Mismatch { .. } if !meets_checkpoint(&c) => EngineError::OutOfStep(format!(
            "{}, and another rank made a different collective call here (with_full_params, a checkpoint, set_lr, a forward only some ranks ran): {c}",
            what()
        )),
        c => EngineError::Comm(c),
    }
}

/// Whether this rank is rank 0 of its shard group `group` and of its
/// replicate group, if any: the job's first rank.
fn is_first_rank<G: ProcessGroup>(group: &G, replicate: Option<&G>) -> bool {
    group.rank() == 0 && replicate.is_none_or(|r| r.rank() == 0)
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

    /// Under hybrid sharding, issues the average of `values` (a reduced
    /// gradient shard) across the replicate group; `None` otherwise, where
    /// the values are already the average.
    fn replicate_average(&self, values: &[f32]) -> Option<Work<Vec<f32>>> {
        let r = self.replicate.as_ref().filter(|r| r.size() > 1)?;
        self.delay();
        Some(r.all_reduce(values.to_vec(), ReduceOp::Avg))
    }

    /// Averages a reduced gradient (shard) across the replicate group, under
    /// hybrid sharding, waiting for it; the values as they are otherwise.
    fn across_replicas<'a>(
        &self,
        red: &'a overlap::Reduced,
    ) -> Result<std::borrow::Cow<'a, [f32]>, EngineError> {
        match self.replicate_average(red.values()) {
            Some(w) => Ok(std::borrow::Cow::Owned(w.wait()?)),
            None => Ok(std::borrow::Cow::Borrowed(red.values())),
        }
    }

    /// Whether this is the job's first rank (rank 0 of the shard group and
    /// of the replicate group): the one that logs what every rank would.
    fn first_rank(&self) -> bool {
        is_first_rank(&self.group, self.replicate.as_ref())
    }

    /// [`Engine::model_state_bytes`] of state `st`.
    fn state_bytes(&self, st: &State) -> Result<usize, EngineError> {
        let mut b = self.swap.as_ref().map_or(0, |s| s.resident_bytes()) + self.pswap_resident();
        for (u, sh) in st.units.iter().zip(&st.shards) {
            b += glue::storage_nbytes(&u.flat)?;
            if let Some(p) = &u.frozen {
                b += p.bytes()?;
            }
            b += 4 * (sh.master.len() + sh.m.len() + sh.v.len() + sh.g.len());
            b += match &sh.copy {
                CopyShard::None => 0,
                CopyShard::Bf16(c) => 2 * c.len(),
                CopyShard::F16(c) => 2 * c.len(),
            };
        }
        Ok(b)
    }

    /// `memory_breakdown`: logs what this rank holds `when` (the caller
    /// is the first rank).
    fn log_memory(&self, st: &State, when: &str) {
        match self.state_bytes(st) {
            Ok(b) => {
                let torch = crate::glue::allocated();
                tracing::info!("{}", memory::line(when, b, self.pools.bytes(), torch))
            }
            Err(e) => tracing::warn!("memory_breakdown: cannot count the model state: {e}"),
        }
    }

    /// The groups the engine communicates on, by role (`comms_logger`).
    fn comm_groups(&self) -> Vec<(&'static str, &G)> {
        comms_log::groups(&self.group, self.replicate.as_ref(), self.hpz.as_ref())
    }

    /// `steps_per_print`: the progress line, logged by the first rank of
    /// the job only (rank 0 of the shard group and of the replicate group),
    /// as DeepSpeed's `_report_progress` is. `norm` is this boundary's
    /// gradient norm, `None` if the step was skipped. Also writes the
    /// boundary's scalars to the monitors, if any (`loss`: the step's mean
    /// loss, when `Engine::backward` saw its losses).
    fn report_progress(&self, st: &State, norm: Option<f64>, loss: Option<f64>) {
        if !self.first_rank() {
            return;
        }
        let c = &self.cfg.config;
        let p = progress::Progress {
            boundaries: st.step + st.skipped,
            skipped: st.skipped,
            lr: st.lr,
            // The betas of the last applied step, as `Engine::betas` says.
            betas: betas_at(
                c.scheduler.as_ref(),
                c.optimizer.betas,
                st.step.saturating_sub(1),
            ),
            momentum: match c.optimizer.kind {
                OptimizerKind::Sgd | OptimizerKind::Rmsprop => Some(c.optimizer.momentum),
                OptimizerKind::Adagrad => Some(0.0),
                _ => None,
            },
            norm,
            loss_scale: st.scaler.as_ref().map(|s| s.scale),
        };
        if let Some(line) = progress::line(c.steps_per_print, &p) {
            tracing::info!("{line}");
            if c.memory_breakdown {
                self.log_memory(st, &format!("at step {}", p.boundaries));
            }
        }
        if let Some(m) = self.monitor.lock().as_mut() {
            let samples = self.global_samples(st);
            let mut events = Vec::new();
            if let Some(loss) = loss {
                events.push(("Train/Samples/train_loss", loss, samples));
            }
            events.push(("Train/Samples/lr", p.lr, samples));
            if let Some(scale) = p.loss_scale {
                events.push(("Train/Samples/loss_scale", scale, samples));
            }
            if let (true, Some(b)) = (c.wall_clock_breakdown, st.timing.last) {
                for (tag, d) in [
                    ("Train/Samples/elapsed_time_ms_forward", b.forward),
                    ("Train/Samples/elapsed_time_ms_backward", b.backward),
                    ("Train/Samples/elapsed_time_ms_step", b.optimizer),
                ] {
                    events.push((tag, d.as_secs_f64() * 1e3, samples));
                }
            }
            m.write(&events);
        }
    }

    /// DeepSpeed's `global_samples`: boundaries so far, skipped ones
    /// included, times `train_batch_size`.
    fn global_samples(&self, st: &State) -> u64 {
        (st.step + st.skipped) * self.cfg.batch.train
    }

    /// How many fp32 moments per element of its range the optimizer keeps:
    /// Adam's and LAMB's m and v, RMSprop's square average and momentum
    /// buffer (2), Lion's m, Adagrad's sum, SGD's momentum buffer or
    /// RMSprop's square average without momentum (1; every `v` stays
    /// empty), none for SGD without momentum (`m` empty too).
    fn moments(&self) -> usize {
        self.cfg.config.optimizer.moments()
    }

    fn shard_range(&self, u: &Unit) -> std::ops::Range<usize> {
        u.layout.shard(self.group.rank())
    }

    /// The mesh as (replicas, shard group size): 1 replica without hybrid
    /// sharding.
    fn mesh(&self) -> (usize, usize) {
        let replicas = self.replicate.as_ref().map_or(1, |r| r.size());
        (replicas, self.group.size())
    }

    /// This rank's replica: its rank in the replicate group (0 without
    /// hybrid sharding).
    fn replica(&self) -> usize {
        self.replicate.as_ref().map_or(0, |r| r.rank())
    }

    /// The range of unit `u`'s flat buffer this rank keeps optimizer state
    /// for: its shard, everything at stage 0 (which steps the whole buffer
    /// on every rank).
    fn own_range(&self, u: &Unit) -> std::ops::Range<usize> {
        match self.stage {
            0 => 0..u.layout.padded,
            _ => self.shard_range(u),
        }
    }

    /// Fills unit `i`'s whole flat tensor from every rank's shard of it
    /// (compute dtype; the fp32 master in fp32 training).
    fn fill_from_shards(&self, st: &mut State, i: usize) -> Result<(), EngineError> {
        let (u, sh) = (&st.units[i], &mut st.shards[i]);
        let padded = u.layout.padded;
        self.page_in(sh, i, ReadAhead::Update)?;
        self.delay();
        match &mut sh.copy {
            CopyShard::Bf16(v) => {
                *v = gather_into(&self.group, std::mem::take(v), &u.flat, padded)?
            }
            CopyShard::F16(v) => *v = gather_into(&self.group, std::mem::take(v), &u.flat, padded)?,
            CopyShard::None => {
                sh.master =
                    gather_into(&self.group, std::mem::take(&mut sh.master), &u.flat, padded)?
            }
        }
        self.page_out(sh, i, false)
    }

    /// This rank's fp32 master, m and v over its shard of unit `k`,
    /// wherever they live (the flat tensor, the shard buffers, the swap).
    fn shard_state<'a>(&self, st: &'a State, k: usize) -> Result<ShardState<'a>, EngineError> {
        use std::borrow::Cow;
        let (u, sh) = (&st.units[k], &st.shards[k]);
        let range = self.shard_range(u);
        let mut swapped = match &self.swap {
            Some(s) => Some(self.swapped_state(s, k)?),
            None => None,
        };
        let master = match (
            self.compute,
            self.stage,
            swapped.as_mut().and_then(|s| s.master.take()),
        ) {
            (_, _, Some(m)) => Cow::Owned(m),
            // SAFETY: a read of the fp32 flat tensor under the state lock.
            (Compute::F32, 0..=2, None) => {
                Cow::Borrowed(&(unsafe { elems::<f32>(&u.flat, u.layout.padded) })[range.clone()])
            }
            (_, 0, None) => Cow::Borrowed(&sh.master[range.clone()]),
            // Paged out to the parameter swap (stage 3, fp32).
            (Compute::F32, _, None) if sh.master.is_empty() && self.pswap.is_some() => {
                Cow::Owned(self.paged_master(k)?)
            }
            _ => Cow::Borrowed(sh.master.as_slice()),
        };
        let (m, v) = match swapped {
            Some(s) => (Cow::Owned(s.m), Cow::Owned(s.v)),
            None => {
                // Stage 0 keeps the whole unit's moments: this rank's range
                // of them. Lion's and SGD's `v` is empty, whatever the
                // range, and so is the `m` of SGD without momentum.
                let mine = match self.stage {
                    0 => range.clone(),
                    _ => 0..self.own_range(u).len(),
                };
                let moments = self.moments();
                let m = match moments >= 1 {
                    true => Cow::Borrowed(&sh.m[mine.clone()]),
                    false => Cow::Borrowed(&[][..]),
                };
                // Muon's packed `v` unpacked, zeros where its matrices lie.
                let v = match (moments == 2, sh.v_layout.unpack(&sh.v, mine.clone())) {
                    (false, _) => Cow::Borrowed(&[][..]),
                    (true, Some(v)) => Cow::Owned(v),
                    (true, None) => Cow::Borrowed(&sh.v[mine]),
                };
                (m, v)
            }
        };
        Ok(ShardState { master, m, v })
    }

    /// Stage 3: frees unit `k` when it is gathered and is not one the stage
    /// keeps gathered (see `overlap::stays_gathered`); a no-op otherwise.
    fn free_if_gathered(&self, st: &mut State, k: usize) -> Result<(), EngineError> {
        if self.stage == 3 && st.gathered[k] && !overlap::stays_gathered(st, k) {
            self.release(st, k)?;
        }
        Ok(())
    }

    fn release(&self, st: &mut State, i: usize) -> Result<(), EngineError> {
        glue::free_storage(&st.units[i].flat)?;
        if let Some(p) = &st.units[i].frozen {
            glue::free_storage(&p.flat)?;
        }
        st.gathered[i] = false;
        st.quantized[i] = false;
        Ok(())
    }

    /// As `release`, to storage that reads as zeros (a unit's first
    /// forward: see `after_forward`) until `reguard`.
    fn release_to_zeros(&self, st: &mut State, i: usize) -> Result<(), EngineError> {
        glue::free_storage_to_zeros(&st.units[i].flat)?;
        if let Some(p) = &st.units[i].frozen {
            glue::free_storage_to_zeros(&p.flat)?;
        }
        st.gathered[i] = false;
        st.quantized[i] = false;
        st.zeroed += 1;
        Ok(())
    }

    /// Stage 3: frees `unit` after its forward, keeping its hpZ secondary
    /// copy when its backward follows (its output needs a gradient). A
    /// unit's first forward frees to zeros: a later unit of that forward
    /// that uses one of its parameters (a tied weight) computes on zeros
    /// rather than stop the process, and `check_foreign_params` names the
    /// parameter. Nothing stays gathered for that, so the first step peaks
    /// no higher than the others.
    fn free_after_forward(&self, st: &mut State, unit: usize, backward_follows: bool, first: bool) {
        if backward_follows {
            self.keep_secondary(st, unit);
        }
        let freed = match first {
            true => self.release_to_zeros(st, unit),
            false => self.release(st, unit),
        };
        if let Err(e) = freed {
            st.error.get_or_insert(e);
        }
    }

    /// Moves the units `release_to_zeros` freed (and nothing has gathered
    /// since) to an inaccessible guard: a read then stops the process with
    /// an explanation instead of returning zeros.
    fn reguard(&self, st: &mut State) -> Result<(), EngineError> {
        // `held` belongs to the forward that is ending: a unit's first
        // forward later on must not free what this one left gathered.
        st.held = None;
        if st.zeroed == 0 {
            return Ok(());
        }
        st.zeroed = 0;
        let freed: Vec<usize> = (0..st.units.len()).filter(|&k| !st.gathered[k]).collect();
        for k in freed {
            self.release(st, k)?;
        }
        Ok(())
    }
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Stage 3: unit `unit`'s forward (from `x` to `y`) must not have used
    /// a parameter of another unit that is freed after its own forward.
    fn check_foreign_params(
        &self,
        st: &State,
        unit: usize,
        x: &Tensor,
        y: &Tensor,
    ) -> Result<(), EngineError> {
        for leaf in glue::graph_leaves(y, Some(x))? {
            if let Some((owner, name)) = self.owners.get(&leaf) {
                if *owner != unit && !overlap::stays_gathered(st, *owner) {
                    return Err(EngineError::Plan(format!(
                        "parameter `{name}` belongs to unit `{}` but unit `{}` uses it too (tied weights?): ZeRO-3 frees a unit's parameters after its own forward. Wrap the modules that share it in one ShardedModule, or leave it outside every wrapped module (the root keeps its parameters gathered)",
                        st.units[*owner].name, st.units[unit].name
                    )));
                }
            }
        }
        Ok(())
    }

    /// Stage 3: backward has computed the gradient of an input of `unit`,
    /// so that forward's backward through it is done: free it once every
    /// forward's is (a unit run twice in one forward needs its parameters
    /// until the first run's backward) when nothing else will. The gradient
    /// hooks of a unit's trained parameters free it after they reduce; a
    /// unit of frozen parameters only has none, and neither does any unit
    /// in a backward that accumulates no parameter gradient
    /// (`torch.autograd.grad(loss, x)`: saliency, adversarial examples).
    /// A backward that keeps its graph frees nothing here: another
    /// backward through the unit (a gradient penalty's) reads its
    /// parameters again; the end of the backward frees them. A unit with
    /// frozen parameters is freed here and not by its reduction (see
    /// `launch_reduce`): its last gradient may come before the gradient
    /// of its input, which its frozen matrices compute (a LoRA block's
    /// adapters on the query and value projections are done before the
    /// frozen key projection's input gradient).
    fn input_grad_ready(&self, ticket: &input_grads::Ticket) {
        let mut st = self.st.lock();
        match glue::graph_kept() {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                st.error.get_or_insert(e.into());
                return;
            }
        }
        let unit = ticket.unit();
        let left = self.input_grads.arrived(ticket);
        // Gradients still to come: their reduction frees the unit (it
        // finds no input gradient waiting then). Not when it has already
        // taken them: it left the unit gathered for this gradient (a LoRA
        // block's adapters are reduced before its frozen matrices compute
        // its input's gradient), and nothing else would free it before
        // the end of backward, every such block of the model gathered by
        // then.
        let pending = match st.prog.reduced(unit) {
            true => Ok(false),
            false => glue::will_accumulate_any(&st.units[unit].params),
        };
        match pending {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                st.error.get_or_insert(e.into());
                return;
            }
        }
        if left == 0 && st.error.is_none() && st.gathered[unit] {
            if let Err(e) = self.release(&mut st, unit) {
                st.error = Some(e);
            }
        }
    }

    /// Stage 3: makes unit `unit` usable for a forward or a backward. On an
    /// error (kept for the next engine call) the parameters get zeroed
    /// memory, so autograd computes garbage instead of reading freed storage.
    fn make_live(&self, unit: usize, forward: bool) {
        let in_autograd = !forward || matches!(glue::backward_id(), Ok(Some(_)));
        let mut st = self.st.lock();
        if st.units[unit].uneven {
            // Gathered throughout, and not in the run order: whether it
            // runs differs across ranks, and the prefetches that follow the
            // order must not.
            return;
        }
        // A recompute inside a backward is not the model's run order.
        if forward && !st.prog.in_backward() && !in_autograd {
            st.prog.order.forward_starts(unit);
        }
        if !forward && st.error.is_none() {
            // Backward has begun: no forward reads a freed unit any more.
            // (After a tie was found, a bare loss.backward() still runs the
            // using unit's backward on the zeros, and step() names the tie.)
            if let Err(e) = self.reguard(&mut st) {
                st.error.get_or_insert(e);
            }
        }
        if !forward && st.error.is_none() {
            // Before this unit's gather, as every rank does.
            self.reduce_partial_units(&mut st, unit);
        }
        // `gather` does nothing for a unit still gathered (the first
        // forward, or the unit forward ran last); the next unit's prefetch
        // starts all the same.
        st.prog.in_autograd = in_autograd;
        let failed = match st.error.is_some() {
            // After an error the ranks are out of step: no more collectives.
            true => None,
            false => self
                .gather(&mut st, unit, false)
                .and_then(|()| self.prefetch_after(&mut st, unit, forward))
                .err()
                .map(|e| self.explain_failure(&mut st, e)),
        };
        st.prog.in_autograd = false;
        if !st.gathered[unit] {
            let u = &st.units[unit];
            if glue::realloc_storage(&u.flat, u.layout.padded * self.compute.bytes()).is_ok() {
                let _ = u.flat.shallow_clone().f_zero_();
            }
            if let Some(p) = &u.frozen {
                p.zero_fill();
            }
            st.gathered[unit] = true;
        }
        if let Some(e) = failed {
            st.error = Some(e);
        }
    }
}

/// A rank's fp32 master shard of one unit and its range in the unit's flat
/// buffer.
pub type MasterShard = (Vec<f32>, std::ops::Range<usize>);

/// The plan's view of the engine (weak: the plan must not keep it alive).
struct Hook<G> {
    inner: std::sync::Weak<Inner<G>>,
}

impl<G: ProcessGroup + 'static> UnitHook for Hook<G> {
    fn segment_begins(&self, units: &[usize]) {
        if let Some(i) = self.inner.upgrade() {
            i.segments.hold(units);
        }
    }

    fn segment_recomputed(&self, units: &[usize]) -> bool {
        self.inner
            .upgrade()
            .is_none_or(|i| i.segment_recomputed(units))
    }

    fn segment_dropped(&self, units: &[usize]) {
        if let Some(i) = self.inner.upgrade() {
            i.segments.release(units);
        }
    }

    fn before_forward(&self, unit: usize) {
        let Some(i) = self.inner.upgrade() else {
            return;
        };
        i.flops_unit(unit, true);
        if i.stage == 3 {
            i.make_live(unit, true);
        }
    }

    fn after_forward(&self, unit: usize, x: &Tensor, y: &Tensor) {
        let Some(i) = self.inner.upgrade() else {
            return;
        };
        i.flops_unit(unit, false);
        if i.stage != 3 {
            return;
        }
        let mut st = i.st.lock();
        if !y.requires_grad() && !st.prog.in_backward() {
            st.prog.order.without_backward(unit);
        }
        // Not a recompute (inside a backward): that is the same run's.
        if st.units[unit].partial && y.requires_grad() && matches!(glue::backward_id(), Ok(None)) {
            i.partial_forward(&mut st, unit);
            // Its backward would begin at its input's gradient, elsewhere
            // than on a rank where it computed something: say so here
            // rather than let the ranks' gathers go out of step.
            let same = glue::tensor_impl(x).and_then(|a| Ok(a == glue::tensor_impl(y)?));
            match same {
                Ok(false) => {}
                Ok(true) => {
                    let e = EngineError::Plan(format!(
                        "unit `{}` (declared with ShardPlan::partly_unused_on_some_ranks) returned its input itself: its backward must begin at the same point on every rank, at its own output's gradient. Return a new tensor that depends on the input (`x + y`, `y` zeros when no expert ran), or declare its parameters with ShardPlan::unused_on_some_ranks if some ranks skip it",
                        st.units[unit].name
                    ));
                    st.error.get_or_insert(e);
                }
                Err(e) => {
                    st.error.get_or_insert(e.into());
                }
            }
        }
        // The first forward through a unit checks which parameters it
        // used: one owned by another unit (tied weights) is read after its
        // owner freed it, which is why a first forward frees to zeros.
        let first = y.requires_grad() && !st.checked[unit];
        if first {
            st.checked[unit] = true;
            if let Err(e) = i.check_foreign_params(&st, unit, x, y) {
                st.error.get_or_insert(e);
            }
        }
        if y.requires_grad() && x.requires_grad() && !overlap::stays_gathered(&st, unit) {
            // When no parameter gradient will say the unit's backward is
            // done (see `input_grad_ready`), the gradient of its input does
            // (it sums every consumer of the input, this unit's backward
            // too).
            // The ticket lives in the hook, which autograd drops with the
            // graph: a forward whose backward never runs (evaluation with
            // autograd on) stops counting when its graph goes.
            let ticket = i.input_grads.expect(unit);
            let weak = self.inner.clone();
            if let Err(e) = glue::on_grad(x, move || {
                if let Some(i) = weak.upgrade() {
                    i.input_grad_ready(&ticket);
                }
            }) {
                st.error.get_or_insert(e.into());
            }
        }
        if y.requires_grad() {
            // Re-gather just before this unit's backward: the hook fires
            // when the gradient of its output is ready, before the nodes
            // that consume it (the unit's own backward) run.
            let weak = self.inner.clone();
            if let Err(e) = glue::on_grad(y, move || {
                if let Some(i) = weak.upgrade() {
                    i.make_live(unit, false);
                }
            }) {
                st.error.get_or_insert(e.into());
                return; // keep the parameters: backward will need them
            }
        }
        // Reshard after forward: autograd's saved views keep the storage
        // object, the glue frees its bytes. The unit that ran last in
        // forward is the first one backward needs, right after the loss:
        // freeing it would gather it again at once, with nothing to overlap
        // the gather. A first forward does not know yet which unit runs
        // last, so it keeps the latest and frees the one before. Not a
        // unit some ranks may not run: the ranks would free at different
        // points, and gather again at different points.
        if first && !st.units[unit].uneven {
            if let Some(prev) = st.held.take().filter(|&p| st.gathered[p]) {
                i.free_after_forward(&mut st, prev, true, true);
            }
        }
        let live: usize = (0..st.units.len())
            .filter(|&k| st.gathered[k])
            .map(|k| st.units[k].gathered_len())
            .sum();
        let runs_last = y.requires_grad() && st.prog.order.runs_last(unit);
        let keep =
            (first || runs_last) && live as u64 <= i.cfg.config.zero.stage3_max_live_parameters;
        let stays = overlap::stays_gathered(&st, unit);
        if keep && first && !stays {
            st.held = Some(unit);
        }
        if !keep && !stays {
            i.free_after_forward(&mut st, unit, y.requires_grad(), first);
        }
        // Once every unit has been through its check, the zeros have done
        // their work: from here a read of a freed unit stops the process
        // with an explanation (backward and every engine call do the same).
        let all_checked =
            (0..st.units.len()).all(|k| st.checked[k] || overlap::stays_gathered(&st, k));
        if first && all_checked && st.error.is_none() {
            if let Err(e) = i.reguard(&mut st) {
                st.error.get_or_insert(e);
            }
        }
    }
}

/// A backward of micro-step `micro` ended with `e`. When it had already
/// added some units' reductions to the accumulated gradients, those hold
/// part of a micro-batch (DeepSpeed goes on with them: the next step would
/// apply it, silently), so the engine refuses to go on until a checkpoint
/// load replaces them.
fn backward_failed(st: &mut State, micro: u64, e: &EngineError) {
    if st.broken.is_some() {
        return;
    }
    if let Some(units) = st.prog.added_to_shards(&st.units) {
        st.broken = Some(format!(
            "the backward of micro-step {micro} failed ({e}) after the gradients of {units} had been reduced and added to the step's accumulated gradients, which cannot be taken out again; load a checkpoint (`load_checkpoint`, which replaces them) or build a new engine"
        ));
    }
}

impl<G: ProcessGroup + 'static> Engine<G> {
    /// Builds the engine `config` asks for, making its groups from
    /// `groups` (the [`Dist`](zrt_collectives::Dist) of `init_from_env`, or
    /// a [`LocalRank`](zrt_collectives::local::LocalRank)), as DeepSpeed's
    /// `initialize` does: `mics_shard_size` S below the world shards inside
    /// groups of S ranks ([`Engine::new_hybrid`]), `zero_hpz_partition_size`
    /// S re-gathers backward inside groups of S neighbouring ranks
    /// ([`Engine::new_hpz`]), and otherwise it shards over every rank
    /// ([`Engine::new`]). Every rank calls it (it makes groups).
    pub fn from_config<S: Groups<Group = G>>(
        vs: &nn::VarStore,
        plan: &ShardPlan,
        config: &Config,
        groups: &mut S,
        hints: &AutoHints,
    ) -> Result<Self, EngineError> {
        let world = groups.world_size();
        let mics = config.zero.mics_shard_size.map(|s| s as usize);
        let hpz = config.zero.zero_hpz_partition_size as usize;
        // The config key whose size the mesh could not be cut by.
        let must_divide = |key: &'static str, s: usize| {
            move |e| {
                EngineError::Plan(format!(
                    "{key} {s} on a world of {world} ranks: it must divide the world ({e})"
                ))
            }
        };
        match (mics.filter(|&s| s != world), hpz > 1) {
            (Some(_), true) => Err(EngineError::Plan(
                "mics_shard_size and zero_hpz_partition_size together: zrt builds one or the other (in DeepSpeed they are different optimizers, MiCS and ZeRO++); remove one".into(),
            )),
            (Some(s), false) => {
                let mesh = groups.mesh(s).map_err(must_divide("mics_shard_size", s))?;
                Self::new_hybrid(vs, plan, config, mesh, hints)
            }
            (None, true) => {
                let all = groups.everyone()?;
                let (near, _) = groups
                    .mesh(hpz)
                    .map_err(must_divide("zero_hpz_partition_size", hpz))?
                    .into_groups();
                Self::new_hpz(vs, plan, config, all, near, hints)
            }
            (None, false) => Self::new(vs, plan, config, groups.everyone()?, hints),
        }
    }

    /// Builds the engine for the trainable parameters of `vs` (created in
    /// fp32), grouped into the units of `plan`, trained as `config` says over
    /// `group` (the data-parallel world). Rank 0's parameter values become
    /// everyone's. With bf16/fp16 in the config the parameters become views
    /// of a 16-bit buffer: the model then runs in that dtype. Variables with
    /// `requires_grad` false (frozen parameters, buffers) have no optimizer
    /// state and take rank 0's values. Stage 3 shards the fp32 frozen
    /// parameters of the units it frees with the unit (in the compute
    /// dtype: bf16 training makes them bf16, as DeepSpeed does); buffers,
    /// the root's frozen parameters and all of them at stages 0-2 stay
    /// whole on every rank. Checkpoints and model exports include them all.
    ///
    /// A collective: every rank of `group` builds its engine, from the same
    /// model and config, or each gets [`EngineError::RanksDiffer`] naming
    /// what differs (checked first, before anything else can refuse).
    pub fn new(
        vs: &nn::VarStore,
        plan: &ShardPlan,
        config: &Config,
        group: G,
        hints: &AutoHints,
    ) -> Result<Self, EngineError> {
        Self::build(vs, plan, config, group, None, None, hints)
    }

    /// As [`Engine::new`], sharding inside the mesh's shard groups and
    /// averaging gradient shards across its replicate groups: hybrid
    /// sharding (DeepSpeed's MiCS with `mics_shard_size`, PyTorch's HSDP).
    /// Every rank of the world is a data-parallel rank. Build the mesh with
    /// `dist.mesh(S)` (or `LocalRank::mesh`).
    pub fn new_hybrid(
        vs: &nn::VarStore,
        plan: &ShardPlan,
        config: &Config,
        mesh: DeviceMesh<G>,
        hints: &AutoHints,
    ) -> Result<Self, EngineError> {
        let (shard, replicate) = mesh.into_groups();
        Self::build(vs, plan, config, shard, Some(replicate), None, hints)
    }

    /// As [`Engine::new`] over `world`, with ZeRO++ hpZ
    /// (`zero_hpz_partition_size` = S): stage 3 shards over the world, and
    /// after a unit's forward each rank keeps 1/S of the unit's parameters
    /// so that its backward re-gather runs inside `hpz`, a group of S ranks
    /// (typically one node: `dist.mesh(S)?.into_groups().0`), instead of
    /// across the world. Memory: 1/S of each unit between its forward and
    /// its backward.
    pub fn new_hpz(
        vs: &nn::VarStore,
        plan: &ShardPlan,
        config: &Config,
        world: G,
        hpz: G,
        hints: &AutoHints,
    ) -> Result<Self, EngineError> {
        Self::build(vs, plan, config, world, None, Some(hpz), hints)
    }

    fn take_error(&self, st: &mut State) -> Result<(), EngineError> {
        // Every engine call ends a first forward's zeros (see
        // `after_forward`), an error's too: nothing reads them after it.
        let reguarded = self.inner.reguard(st);
        match st.error.take() {
            Some(e) => Err(overlap::named_after_backward(st, e)),
            None => match &st.broken {
                Some(why) => Err(EngineError::GradientsLost(why.clone())),
                None => reguarded,
            },
        }
    }

    /// Returns the error a hook recorded, and ends the program's own
    /// `loss.backward()` if one ran since the last engine call (`free`:
    /// stage 3 frees the units it re-gathered). Either failing while such
    /// a backward is open marks its micro-step failed: part of its
    /// gradient may be in the step's already (see `backward_failed`).
    fn settle(&self, st: &mut State, free: bool) -> Result<(), EngineError> {
        let (bare, micro) = (st.prog.bare, st.micro);
        let ended = self.take_error(st).and_then(|()| match bare {
            true => self.inner.end_backward(st, free),
            false => Ok(()),
        });
        if let (true, Err(e)) = (bare, &ended) {
            backward_failed(st, micro, e);
        }
        ended
    }

    /// Backward of one micro-step: `loss` is this rank's mean loss on its
    /// micro-batch. Gradients are averaged over the world and the
    /// accumulation steps, as DeepSpeed does (fp16: of the scaled loss).
    ///
    /// A plain `loss.backward()` works too (as with FSDP): the gradient
    /// hooks reduce each unit the same way and the next `step()` finishes
    /// the micro-step; gradients are then divided by the accumulation steps
    /// after the backward instead of before it (a rounding apart). fp16
    /// needs this call, which applies the loss scale.
    pub fn backward(&self, loss: &Tensor) -> Result<(), EngineError> {
        self.backward_inner(loss).map_err(checkpoint_on_a_peer)
    }

    fn backward_inner(&self, loss: &Tensor) -> Result<(), EngineError> {
        let i = &*self.inner;
        // libtorch's own errors for these do not say where to look.
        if loss.numel() != 1 {
            return Err(EngineError::BadArgument(format!(
                "backward of a loss of shape {:?}: it needs one number, this rank's mean loss (reduce it with .mean(Kind::Float))",
                loss.size()
            )));
        }
        if !loss.requires_grad() {
            return Err(EngineError::BadArgument(
                "backward of a loss that does not require grad: it was computed under tch::no_grad (an evaluation's), from detached tensors, or with every parameter it uses frozen; compute it with autograd on from the model's output".into(),
            ));
        }
        let scale = {
            let mut st = i.st.lock();
            // A `loss.backward()` of the program's own that ran since the
            // last engine call ends here, so that it counts as its
            // micro-step and this backward's hooks do not take it for a bare
            // one (dividing its gradients by the accumulation steps again).
            // This backward's forward has run: free nothing.
            self.settle(&mut st, false)?;
            // DeepSpeed would add this micro-batch's gradients to the
            // previous step's, which nobody applied: a forgotten `step()`
            // silently doubles the next update.
            let gas = i.cfg.batch.gas;
            if st.micro > 0 && st.micro % gas == 0 && st.boundary_at != st.micro {
                return Err(EngineError::CallOrder(format!(
                    "backward after micro-step {} reached an accumulation boundary (gradient_accumulation_steps {gas}) that no step() handled; call engine.step() after every backward (it steps only at the boundary)",
                    st.micro
                )));
            }
            if i.monitor.lock().is_some() {
                // DeepSpeed's `train_loss`: the mean of the step's losses.
                let l = loss.f_detach()?.f_mean(Kind::Double)?.f_double_value(&[])?;
                let (sum, n) = st.loss_sum.get_or_insert((0.0, 0));
                (*sum, *n) = (*sum + l, *n + 1);
            }
            st.scaler.as_ref().map_or(1.0, |s| s.scale)
        };
        // Not under the state lock: the hooks take it to re-gather units
        // (stage 3) and to reduce each unit's gradients as soon as they are
        // all there (see `overlap`).
        let started = {
            let mut st = i.st.lock();
            i.begin_backward(&mut st);
            if let Err(e) = i.skip_unreached(&mut st, loss) {
                // Disarm, so later hooks are not taken for this backward's.
                i.abort_backward(&mut st);
                return Err(e);
            }
            i.flops_phase(false);
            st.timing.backward_starts()
        };
        let ran = {
            // Other engines' hooks this backward reaches drop their
            // gradients (see `foreign`).
            let seq = i
                .backwards
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _running = foreign::running(i.id, seq);
            loss.f_mul_scalar(scale / i.cfg.batch.gas as f64)
                .and_then(|l| l.f_backward())
        };
        let mut st = i.st.lock();
        let micro = st.micro;
        let ended = match ran {
            Err(e) => {
                // Disarm, so later hooks are not taken for this backward's.
                i.abort_backward(&mut st);
                Err(e.into())
            }
            Ok(()) => self.take_error(&mut st).and_then(|()| {
                i.warn_if_untouched(&st);
                i.end_backward(&mut st, true)
            }),
        };
        if let Err(e) = &ended {
            backward_failed(&mut st, micro, e);
        }
        ended?;
        st.timing.backward_ends(started);
        i.flops_phase(true);
        Ok(())
    }

    /// The optimizer step, at the accumulation boundary only (DeepSpeed's
    /// `engine.step()` contract: call it after every `backward`). Returns
    /// whether the optimizer stepped: `false` off the boundary, and on an
    /// fp16 overflow (the step is skipped on every rank, the loss scale
    /// drops, and [`Engine::skipped_steps`] counts it; bf16 with
    /// `check_grad_overflow` skips such a step too). An fp16 overflow with
    /// the scale at `min_loss_scale` is [`EngineError::LossScaleAtMinimum`].
    pub fn step(&self) -> Result<bool, EngineError> {
        self.step_inner().map_err(checkpoint_on_a_peer)
    }

    /// The error a forward hit since the last engine call, if any. A
    /// stage-3 gather that fails (a rank gone, a timeout) cannot fail the
    /// forward itself: the unit's parameters are zeros for it, and its
    /// results are not to be trusted. Training learns of it at the next
    /// `backward` or `step`; a program that only runs forwards
    /// (evaluation, generation) calls this after them. This rank's
    /// record alone: no collective.
    pub fn pending_error(&self) -> Result<(), EngineError> {
        let mut st = self.inner.st.lock();
        self.take_error(&mut st)
    }

    /// For tests: sleep a pseudo-random 0-2 ms (from `seed`; 0 turns it off)
    /// before every collective, to show results do not depend on timing.
    pub fn inject_delays(&self, seed: u64) {
        *self.inner.delays.lock() = seed;
    }

    /// The global gradient norm of the last step, *before* clipping (and
    /// after removing the fp16 loss scale).
    pub fn global_grad_norm(&self) -> Option<f64> {
        self.inner.st.lock().norm
    }
    /// The learning rate the last step used (before the first step: the
    /// one it will use, a warm-up's first; after [`Engine::set_lr`], the
    /// one set): the schedule's, which a parameter whose rate the plan
    /// scales ([`ShardPlan::scale_learning_rate`]) got times its scale.
    pub fn lr(&self) -> f64 {
        self.inner.st.lock().lr
    }

    /// Sets the learning rate of the steps from the next one on, until it
    /// is set again: the program's own schedule (nanoGPT's `get_lr(it)`,
    /// which DeepSpeed programs write into the optimizer's `param_groups`).
    /// [`Engine::lr`] returns it from here; a parameter whose rate the plan
    /// scales gets it times its scale; checkpoints keep it. A collective:
    /// every rank calls it with the same value, or each is told the
    /// ranks' values (replicas that stepped with different rates would
    /// drift apart silently). Refused under a config `scheduler`, which
    /// sets the rate at every step.
    pub fn set_lr(&self, lr: f64) -> Result<(), EngineError> {
        let i = &*self.inner;
        if i.cfg.config.scheduler.is_some() {
            return Err(ConfigError {
                problems: vec![format!(
                    "set_lr({lr}) under the config's `scheduler`, which sets the learning rate at every step: remove the `scheduler` block to set it from the program, or keep the scheduler and drop the set_lr calls"
                )],
                ..Default::default()
            }
            .into());
        }
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(EngineError::BadArgument(format!(
                "set_lr({lr}): a learning rate is a finite number >= 0"
            )));
        }
        let what = || format!("set_lr({lr}) exchanged the learning rate");
        let all = agree::world_gather(&i.group, i.replicate.as_ref(), vec![lr], false, what)?;
        if all.iter().any(|&x| x.to_bits() != lr.to_bits()) {
            let each: Vec<String> = all
                .iter()
                .enumerate()
                .map(|(r, x)| format!("rank {r} {x}"))
                .collect();
            return Err(EngineError::ValuesDiffer(format!(
                "set_lr got {}: every rank must set the same learning rate (compute it from engine.global_step(), which every rank shares)",
                each.join(", ")
            )));
        }
        let mut st = i.st.lock();
        st.lr_set = Some(lr);
        st.lr = lr;
        Ok(())
    }
    /// Adam's (beta1, beta2) the last step used (before the first step:
    /// the ones it will use): the configured betas, or under OneCycle with
    /// `cycle_momentum` the cycled beta1 and 0.99 (DeepSpeed's `get_mom`).
    /// Under SGD, which has no betas, the config's (unused) betas: its
    /// momentum is `Config::optimizer.momentum`, which no schedule moves.
    pub fn betas(&self) -> (f64, f64) {
        let step = self.inner.st.lock().step;
        let c = &self.inner.cfg.config;
        betas_at(
            c.scheduler.as_ref(),
            c.optimizer.betas,
            step.saturating_sub(1),
        )
    }
    /// Optimizer steps taken (skipped fp16 steps not counted).
    pub fn global_step(&self) -> u64 {
        self.inner.st.lock().step
    }
    /// Steps skipped on a gradient overflow (fp16, or bf16 with
    /// `check_grad_overflow`).
    pub fn skipped_steps(&self) -> u64 {
        self.inner.st.lock().skipped
    }
    /// The current fp16 loss scale (`None` without fp16).
    pub fn loss_scale(&self) -> Option<f64> {
        self.inner.st.lock().scaler.as_ref().map(|s| s.scale)
    }
    /// Micro-steps taken (`backward` calls).
    pub fn micro_steps(&self) -> u64 {
        self.inner.st.lock().micro
    }
    /// Whether the micro-step in progress is the last of its accumulation,
    /// so that the `step()` that ends it updates the parameters
    /// (DeepSpeed's `is_gradient_accumulation_boundary`: log, clip or set
    /// the learning rate only then). The micro-step in progress is the one
    /// whose backward ran since the last `step()` call (a plain
    /// `loss.backward()` counts), or else the next one; after a checkpoint
    /// load, the one after the last saved.
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        let st = self.inner.st.lock();
        let done = st.micro + u64::from(st.prog.bare);
        let current = match done > st.step_called_at {
            true => done,
            false => done + 1,
        };
        current % self.inner.cfg.batch.gas == 0
    }
    /// Where the last optimizer step's time went (forward, backward,
    /// communication wait, optimizer), summed over its micro-steps; logged
    /// through `tracing` at every step when the config has
    /// `"wall_clock_breakdown": true`.
    pub fn last_step_breakdown(&self) -> Option<StepBreakdown> {
        self.inner.st.lock().timing.last
    }
    /// How much communication overlapped compute so far: gathers served by
    /// a prefetch, reductions issued while backward was still running.
    pub fn overlap_counts(&self) -> OverlapCounts {
        self.inner.st.lock().prog.counts
    }
    /// Writes scalars of the program's own (`(tag, value, x)`, e.g. a
    /// validation loss as `("Eval/Samples/eval_loss", loss, samples)`) to
    /// the monitors the config enables (`csv_monitor`, `tensorboard`),
    /// beside the engine's: DeepSpeed's `engine.monitor.write_events`. The
    /// job's first rank writes them; on the other ranks, and with no
    /// monitor, this does nothing. It is no collective: any rank may call
    /// it any time.
    pub fn write_monitor_events(&self, events: &[(&str, f64, u64)]) {
        if let Some(m) = self.inner.monitor.lock().as_mut() {
            m.write(events);
        }
    }

    /// What the engine's collectives cost on this rank since its groups
    /// were made, per group, operation and message size (calls, time,
    /// bandwidths; see [`CommsSummary`]). With `comms_logger` enabled, only
    /// the operations it selects (`prof_all`, `prof_ops`); the counts are
    /// kept whatever the config says. No collective: any rank, any time.
    pub fn comms_summary(&self) -> CommsSummary {
        let c = &self.inner.cfg.config.comms_logger;
        comms_log::summary(&self.inner.comm_groups(), |op| !c.enabled || c.logs(op))
    }

    /// DeepSpeed's `deepspeed.comm.log_summary()`: with `comms_logger`
    /// enabled, the job's first rank logs [`Engine::comms_summary`] as a
    /// table (at info, through `tracing`); other ranks log nothing. Without
    /// it, says so at info. No collective: call it at the end of
    /// training, an epoch, every N steps.
    pub fn log_comms_summary(&self) {
        if !self.inner.first_rank() {
            return;
        }
        match self.inner.cfg.config.comms_logger.enabled {
            true => tracing::info!("comms_logger: this rank's collectives so far (the job's first rank; the others' times differ by their waits):\n{}", self.comms_summary()),
            false => tracing::info!("no communication summary: `comms_logger` is not enabled in the config (Engine::comms_summary gives the counts anyway)"),
        }
    }
    /// Samples trained so far: accumulation boundaries (skipped fp16
    /// steps included) times `train_batch_size`, as DeepSpeed's
    /// `global_samples` counts them; the x of the monitors' scalars.
    pub fn global_samples(&self) -> u64 {
        self.inner.global_samples(&self.inner.st.lock())
    }
    /// The resolved config the engine runs with.
    pub fn config(&self) -> &Resolved {
        &self.inner.cfg
    }
    /// The group the engine shards over.
    pub fn group(&self) -> &G {
        &self.inner.group
    }

    /// Model-state bytes this rank holds in memory now, as the engine
    /// allocated them: parameters in the compute dtype (flat tensors with
    /// storage), fp32 master, Adam's m and v, accumulated gradients, stage
    /// 3's 16-bit shard and its sharded frozen parameters, and under NVMe
    /// offload the swap's buffers (not the state on disk: see
    /// [`Engine::offloaded_bytes`]). Compare with DESIGN.md's table, which
    /// counts trainable parameters only.
    pub fn model_state_bytes(&self) -> Result<usize, EngineError> {
        self.inner.state_bytes(&self.inner.st.lock())
    }

    /// Bytes of gather and gradient buffers kept for reuse (at most two per
    /// dtype): memory held between uses so the next gather or reduction
    /// does not page-fault a fresh buffer in. Counted in RSS, not in model
    /// state.
    pub fn pooled_bytes(&self) -> usize {
        self.inner.pools.bytes()
    }

    /// Bytes of model state in this rank's NVMe swap files (optimizer
    /// state, stage-3 parameter shards; 0 without offload).
    pub fn offloaded_bytes(&self) -> u64 {
        self.inner.swap.as_ref().map_or(0, |s| s.file_bytes()) + self.inner.pswap_bytes()
    }

    /// Bytes this rank's optimizer swap file has been read and written so
    /// far (`None` without NVMe optimizer offload): the I/O a step costs,
    /// for benchmarks and tests.
    pub fn optimizer_swap_io(&self) -> Option<(u64, u64)> {
        self.inner.swap.as_ref().map(|s| s.io_bytes())
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

    /// Elements of the parameters Muon steps (0 under any other
    /// optimizer): their second moment is not kept in memory, 4 bytes
    /// each less than AdamW's state.
    pub fn num_muon_params(&self) -> usize {
        let i = &*self.inner;
        let st = i.st.lock();
        (st.units.iter())
            .flat_map(|u| i.muon_matrices(u))
            .map(|(_, elems, _)| elems.len())
            .sum()
    }

    /// This rank's fp32 master shard of unit `unit` and its range in the
    /// unit's flat buffer (for tests and checkpoints); `None` past the last
    /// unit. Reads the swap file under NVMe offload.
    pub fn master_shard(&self, unit: usize) -> Result<Option<MasterShard>, EngineError> {
        let i = &*self.inner;
        let mut st = i.st.lock();
        i.drain_prefetch(&mut st)?;
        let Some(u) = st.units.get(unit) else {
            return Ok(None);
        };
        let range = i.shard_range(u);
        let master = match &i.swap {
            // The master sits in the optimizer swap beside m and v: read it
            // alone (a third of the I/O of the whole unit state).
            Some(s) if offload::swaps_master(i.compute) => {
                let mut m = vec![0f32; s.region_len(unit)];
                s.read_array(unit, 0, &mut m)?;
                m
            }
            _ => i.shard_state(&st, unit)?.master.into_owned(),
        };
        Ok(Some((master, range)))
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

    /// The full fp32 master parameters of every unit, gathered (a
    /// collective: every rank must call it), as (name, values) in flat order.
    pub fn gathered_params(&self) -> Result<Vec<(String, Vec<f32>)>, EngineError> {
        let n = self.inner.st.lock().units.len();
        let mut out = Vec::new();
        for k in 0..n {
            let Some(full) = self.whole_master(k)? else {
                continue;
            };
            let st = self.inner.st.lock();
            for s in &st.units[k].layout.slots {
                out.push((s.name.clone(), full[s.offset..s.offset + s.numel].to_vec()));
            }
        }
        Ok(out)
    }

    /// Unit `k`'s whole fp32 master, gathered from every rank's shard (a
    /// collective); `None` where [`Engine::master_shard`] has none.
    pub(super) fn whole_master(&self, k: usize) -> Result<Option<Vec<f32>>, EngineError> {
        let Some((mine, _)) = self.master_shard(k)? else {
            return Ok(None);
        };
        let padded = self.inner.st.lock().units[k].layout.padded;
        Ok(Some(gather_whole(&self.inner.group, mine, padded)?.1))
    }
}

/// The signature of the collective every checkpoint save and load issues
/// first on the engine's group (the ranks' agreement on their outcomes),
/// which training never issues.
pub(crate) const CHECKPOINT_AGREEMENT: &str = "all_gather(u8 x 1)";

/// A training collective that met a peer's checkpoint agreement means that
/// peer is saving or loading while this rank trains (a save under `if rank
/// == 0`): say that, since the two calls' names mean nothing to the user
/// and the bare mismatch would not say what the peer is doing.
fn checkpoint_on_a_peer(e: EngineError) -> EngineError {
    match &e {
        EngineError::Comm(c) if meets_checkpoint(c) => EngineError::CallOrder(format!(
            "another rank is saving or loading a checkpoint while this one trains: save_checkpoint and load_checkpoint are collectives, which every rank calls at the same point (not only under `if rank == 0`). The collectives said: {c}"
        )),
        _ => e,
    }
}

/// Whether `c` is a mismatch one side of which is a checkpoint agreement
/// (by the call's own description, not a search of the message, which
/// names the group and could hold anything).
pub(crate) fn meets_checkpoint(c: &zrt_collectives::CommError) -> bool {
    matches!(
        c,
        zrt_collectives::CommError::Mismatch { call_a, call_b, .. }
            if call_a == CHECKPOINT_AGREEMENT || call_b == CHECKPOINT_AGREEMENT
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_unit_gathered_against_another_call_or_to_another_length_is_an_error() {
        let mut ranks = zrt_collectives::local::world(2).into_iter();
        let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
        // Rank 1 makes another call.
        let other = std::thread::spawn(move || {
            let g = r1.new_group(&[0, 1]).unwrap();
            let e = g.all_gather(vec![0f32; 3], Vec::new()).wait();
            // Shards of one size on both ranks, adding up to 6, not 5.
            let g = r1.new_group(&[0, 1]).unwrap();
            let ok = g.all_gather(vec![0f32; 3], Vec::new()).wait();
            (e.is_err(), ok.is_ok())
        });
        let g = r0.new_group(&[0, 1]).unwrap();
        let e = gather_whole(&g, vec![1f32; 2], 4).unwrap_err().to_string();
        let g = r0.new_group(&[0, 1]).unwrap();
        let short = gather_whole(&g, vec![1f32; 3], 5).unwrap_err().to_string();
        assert_eq!(other.join().unwrap(), (true, true));
        assert!(
            e.starts_with("ranks out of step: this rank gathered a unit's 4 elements, and another rank made a different collective call here")
                && e.contains("rank 0 called all_gather(f32 x 2) but rank 1 called all_gather(f32 x 3)"),
            "{e}"
        );
        assert_eq!(
            short,
            "ranks out of step: this rank gathered a unit's 5 elements and got 6; every rank must make the same engine calls in the same order"
        );
    }

    #[test]
    fn a_peers_checkpoint_agreement_is_left_to_the_checkpoint_explanation() {
        let m = |call_b: &str| CommError::Mismatch {
            group: "world".into(),
            seq: 3,
            rank_a: 0,
            call_a: "all_gather(f32 x 2)".into(),
            rank_b: 1,
            call_b: call_b.into(),
        };
        let what = || "here".to_string();
        assert!(matches!(
            out_of_step(m(CHECKPOINT_AGREEMENT), what),
            EngineError::Comm(CommError::Mismatch { .. })
        ));
        assert!(matches!(
            out_of_step(m("all_gather(f32 x 3)"), what),
            EngineError::OutOfStep(_)
        ));
        let died = CommError::RankDied {
            group: "world".into(),
            rank: 1,
            call: "all_gather(f32 x 2)".into(),
        };
        assert!(matches!(
            out_of_step(died, what),
            EngineError::Comm(CommError::RankDied { .. })
        ));
    }
}

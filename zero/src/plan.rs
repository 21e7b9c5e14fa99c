//! Which parameters form which unit: [`ShardPlan`] and [`ShardedModule`].
//!
//! As FSDP wraps modules, a user wraps each block of an ordinary tch model
//! in a [`ShardedModule`] registered with a [`ShardPlan`]; parameters under
//! a wrapped module's VarStore path form its unit, and every other trainable
//! parameter (embeddings, final norm, head) forms the root unit. The engine
//! built from the plan then sees each unit's forward (stage 3 gathers the
//! unit's parameters right before it).

use std::sync::{Arc, Mutex, RwLock};

use tch::{nn, Tensor};

use crate::checkpoint::weights_files::{CopiesRule, NameRules, Rename, TransposeRule};
use crate::first_rank::{Release, Values};
use crate::running::Running;
use crate::EngineError;

/// What a unit's forward asks of the engine.
pub(crate) trait UnitHook: Send + Sync {
    /// Makes unit `unit`'s parameters usable (stage 3: gathers them). An
    /// error is kept by the engine and returned by its next call.
    fn before_forward(&self, unit: usize);
    /// After unit `unit`'s forward turned `input` into `output` (stage 3:
    /// frees the gathered parameters and arranges their re-gathering before
    /// the unit's backward).
    fn after_forward(&self, unit: usize, input: &Tensor, output: &Tensor);
    /// A checkpointed segment that may touch `units` made a graph whose
    /// backward will recompute it (see [`crate::running`]): their
    /// reductions wait until it ends.
    fn segment_begins(&self, units: &[usize]);
    /// A backward recomputed that segment and accumulated its gradients:
    /// whether that ends it (not while the backward keeps its graph,
    /// which another backward may recompute again).
    fn segment_recomputed(&self, units: &[usize]) -> bool;
    /// The segment's graph was dropped before a recompute ended it. Runs
    /// wherever the last tensor of that graph is dropped, the engine's own
    /// code included: it must take none of the engine's locks.
    fn segment_dropped(&self, units: &[usize]);
}

/// A program's yes-or-no rule over parameters, given each one's VarStore
/// name and shape (which trainable ones weight decay leaves out, which
/// ones some ranks may not use).
pub(crate) type NameRule = dyn Fn(&str, &[i64]) -> bool + Send + Sync;

/// The program's rule for what each trainable parameter's learning rate is
/// multiplied by, given its VarStore name and shape.
pub(crate) type LrRule = dyn Fn(&str, &[i64]) -> f64 + Send + Sync;

#[derive(Default)]
pub(crate) struct PlanInner {
    pub(crate) prefixes: Mutex<Vec<String>>,
    /// The engine's hook while one is built from this plan.
    pub(crate) hook: RwLock<Option<Arc<dyn UnitHook>>>,
    /// Set by the engine built from this plan, before it touches the
    /// parameters, until it drops: a second engine must not re-lay-out
    /// tensors the first owns.
    pub(crate) claimed: std::sync::atomic::AtomicBool,
    /// Set by [`ShardPlan::exclude_from_weight_decay`].
    pub(crate) no_decay: Mutex<Option<Arc<NameRule>>>,
    /// Set by [`ShardPlan::scale_learning_rate`].
    pub(crate) lr_scale: Mutex<Option<Arc<LrRule>>>,
    /// Set by [`ShardPlan::unused_on_some_ranks`].
    pub(crate) uneven: Mutex<Option<Arc<NameRule>>>,
    /// Set by [`ShardPlan::partly_unused_on_some_ranks`].
    pub(crate) partial: Mutex<Option<Arc<NameRule>>>,
    /// Set by [`ShardPlan::use_muon`].
    pub(crate) muon: Mutex<Option<Arc<NameRule>>>,
    /// Set by [`ShardPlan::weights_on_first_rank_only`] on the other
    /// ranks, by [`ShardPlan::weights_from_file`] and
    /// [`ShardPlan::weights_on_disk_while_built`] on every rank.
    pub(crate) release: Mutex<Option<Release>>,
    /// Set by [`ShardPlan::rename_weights`].
    pub(crate) rename: Mutex<Option<Arc<Rename>>>,
    /// Set by [`ShardPlan::transpose_weights`].
    pub(crate) transpose: Mutex<Option<Arc<TransposeRule>>>,
    /// Set by [`ShardPlan::weight_copies`].
    pub(crate) copies: Mutex<Option<Arc<CopiesRule>>>,
    /// Set by [`ShardPlan::fresh_weights`].
    pub(crate) fresh: Mutex<Option<Arc<NameRule>>>,
}

impl PlanInner {
    /// On a rank other than the first of a plan under
    /// [`ShardPlan::weights_on_first_rank_only`], and on every rank under
    /// `weights_from_file` and `weights_on_disk_while_built`, releases
    /// every variable made so far; a no-op otherwise.
    pub(crate) fn release_made_so_far(&self) {
        let fresh = self.fresh_rule();
        if let Ok(r) = self.release.lock() {
            if let Some(r) = r.as_ref() {
                r.release_made_so_far(fresh.as_deref());
            }
        }
    }

    /// The rule [`ShardPlan::fresh_weights`] set, if any.
    pub(crate) fn fresh_rule(&self) -> Option<Arc<NameRule>> {
        self.fresh.lock().ok().and_then(|r| r.clone())
    }

    /// The file [`ShardPlan::weights_from_file`] named, if it was called.
    pub(crate) fn weights_file(&self) -> Option<std::path::PathBuf> {
        let r = self.release.lock().ok()?;
        match &r.as_ref()?.values {
            Values::File(f) => Some(f.clone()),
            _ => None,
        }
    }

    /// The first rank's file under
    /// [`ShardPlan::weights_on_disk_while_built`], if it has one.
    pub(crate) fn spill(&self) -> Option<Arc<crate::spill::Spill>> {
        let r = self.release.lock().ok()?;
        match &r.as_ref()?.values {
            Values::Spill(s) => Some(s.clone()),
            _ => None,
        }
    }

    /// Closes the first rank's file under
    /// [`ShardPlan::weights_on_disk_while_built`] (the engine is built,
    /// and no longer reads it): its disk space goes back.
    pub(crate) fn drop_spill(&self) {
        if let Ok(mut r) = self.release.lock() {
            if let Some(r) = r.as_mut().filter(|r| matches!(r.values, Values::Spill(_))) {
                r.values = Values::FirstRank;
            }
        }
    }

    /// The hook of the engine built from this plan, if one is (cloned, so
    /// that no lock is held while it gathers or frees).
    fn engine_hook(&self) -> Option<Arc<dyn UnitHook>> {
        self.hook.read().ok().and_then(|h| h.clone())
    }

    /// Claims the plan for an engine being built, or `None` when another
    /// engine holds it.
    pub(crate) fn claim(self: &Arc<Self>) -> Option<Claim> {
        let taken = self.claimed.swap(true, std::sync::atomic::Ordering::SeqCst);
        (!taken).then(|| Claim(self.clone()))
    }
}

/// An engine's hold on its plan: one engine lays out a model's parameters
/// at a time. Dropping it clears the hook and leaves the plan to the next
/// engine: when the engine drops, and when a build fails after claiming
/// (a drive too full for the swap file), so that it may be tried again on
/// the same model.
pub(crate) struct Claim(Arc<PlanInner>);

impl Drop for Claim {
    fn drop(&mut self) {
        if let Ok(mut h) = self.0.hook.write() {
            *h = None;
        }
        self.0
            .claimed
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Claim {
    /// The rules [`ShardPlan::rename_weights`] and
    /// [`ShardPlan::transpose_weights`] set.
    pub(crate) fn weight_rules(&self) -> NameRules {
        NameRules {
            rename: self.0.rename.lock().ok().and_then(|r| r.clone()),
            transpose: self.0.transpose.lock().ok().and_then(|r| r.clone()),
            copies: self.0.copies.lock().ok().and_then(|r| r.clone()),
        }
    }

    /// Installs the hook of the engine that holds the claim.
    pub(crate) fn set_hook(&self, hook: Arc<dyn UnitHook>) {
        if let Ok(mut h) = self.0.hook.write() {
            *h = Some(hook);
        }
    }
}

/// The list of units of a model, filled by [`ShardedModule::new`] and read by
/// the engine. Cheap to clone; every clone is the same plan.
#[derive(Clone, Default)]
pub struct ShardPlan {
    pub(crate) inner: Arc<PlanInner>,
}

impl ShardPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leaves out of weight decay every trainable parameter for which
    /// `exclude(name, shape)` is true (`name` as the VarStore has it,
    /// `h.0.ln1.weight`): they get no decoupled decay with AdamW and no
    /// L2 term with Adam; the others get `optimizer.params.weight_decay`.
    ///
    /// DeepSpeed and PyTorch take this from the program's parameter groups
    /// (`[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]`);
    /// Hugging Face's Trainer and nanoGPT leave out biases and norm weights,
    /// the parameters of fewer than two dimensions:
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// plan.exclude_from_weight_decay(|_name, shape| shape.len() < 2)?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// Call it before building the engine, on every rank alike (the engine
    /// checks that ranks agree). Without it every trainable parameter
    /// decays, as with `torch.optim.AdamW(model.parameters())`. The rule is
    /// the program's, not the checkpoint's: a run resumed from a checkpoint
    /// decays what its own plan says.
    pub fn exclude_from_weight_decay(
        &self,
        exclude: impl Fn(&str, &[i64]) -> bool + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        self.set_rule(
            "exclude_from_weight_decay",
            &self.inner.no_decay,
            Arc::new(exclude),
        )
    }

    /// Whether weight decay leaves out the parameter `name` of `shape`
    /// ([`Self::exclude_from_weight_decay`]; none is left out without it).
    pub fn excluded_from_weight_decay(&self, name: &str, shape: &[i64]) -> bool {
        self.decay_rule().is_some_and(|r| r(name, shape))
    }

    /// Multiplies the learning rate of every trainable parameter by
    /// `scale(name, shape)` (`name` as the VarStore has it): at every step
    /// the parameter gets the schedule's rate (`optimizer.params.lr`, or
    /// what `scheduler` made of it) times its scale, weight decay
    /// included, as AdamW's decoupled decay is proportional to the rate.
    /// 1 leaves a parameter at the schedule's rate; 0 stops its updates
    /// (Adam's moments still follow its gradient); a scale that is negative
    /// or not finite is refused when the engine is built, naming the
    /// parameter.
    ///
    /// PyTorch takes this from parameter groups with their own `lr`, which
    /// a `LambdaLR` then multiplies alike; the usual uses are layer-wise
    /// learning-rate decay in fine-tuning (each block's rate a power of a
    /// factor below one, the blocks nearest the output fastest) and a
    /// slower embedding.
    /// Layer-wise decay over blocks `h.0` to `h.7`:
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// plan.scale_learning_rate(|name, _shape| {
    ///     let block = name.strip_prefix("h.").and_then(|r| r.split('.').next());
    ///     match block.and_then(|b| b.parse::<i32>().ok()) {
    ///         Some(i) => 0.8f64.powi(7 - i),
    ///         None => 1.0,
    ///     }
    /// })?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// Call it before building the engine, on every rank alike (the engine
    /// checks that ranks agree). The rule is the program's, not the
    /// checkpoint's: a resumed run scales as its own plan says, and a
    /// full load warns when that differs from the checkpoint's run. The
    /// rate `Engine::lr` returns and the progress line logs is the
    /// schedule's, unscaled.
    pub fn scale_learning_rate(
        &self,
        scale: impl Fn(&str, &[i64]) -> f64 + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        self.set_rule("scale_learning_rate", &self.inner.lr_scale, Arc::new(scale))
    }

    /// What the learning rate of the parameter `name` of `shape` is
    /// multiplied by ([`Self::scale_learning_rate`]; 1 without it).
    pub fn learning_rate_scale(&self, name: &str, shape: &[i64]) -> f64 {
        self.lr_rule().map_or(1.0, |r| r(name, shape))
    }

    /// Declares the parameters for which `may_be_unused(name, shape)` is
    /// true as ones that some ranks' losses may leave out while others use
    /// them (trainable ones, and frozen ones, which stage 3 gathers with
    /// their unit): a block that rank-dependent LayerDrop skips, a head
    /// only some ranks' batches train (for experts a rank's tokens never
    /// reach, in a layer every rank runs,
    /// [`Self::partly_unused_on_some_ranks`] keeps stage 3's memory). The
    /// units holding them are reduced with zeros for
    /// the gradients a rank's loss did not reach, and every rank reduces
    /// the units in the same order. At stages 0 and 2 that is one order
    /// the ranks agree at the end of the first backward (the order they
    /// found units whole in), each unit reduced during backward once it
    /// and those before it in that order are whole, and a unit counted
    /// whole at once when a walk of the autograd graph from the loss
    /// (`engine.backward(loss)`) does not reach its missing parameters, as
    /// DDP's `find_unused_parameters=True` does; in the first backward,
    /// and at stage 3 (whose backward gathers too) always, declared units
    /// are reduced at the end of backward.
    ///
    /// Without it each unit is reduced as soon as all its parameters have
    /// their gradients, so such a parameter completes its unit at
    /// different points of backward on different ranks, and the ranks'
    /// reductions go out of step: the engine stops with an error naming
    /// the parameter (never mixing one unit's gradients with another's).
    /// Stage 1 accumulates locally during backward and needs it not.
    ///
    /// What it costs: a unit a rank never finds whole holds back the
    /// units after it in the order until the end of backward, on that
    /// rank (a parameter its loss reaches yet gives no gradient; one a
    /// checkpointed segment hides from the walk until its recompute; in a
    /// bare `loss.backward()`, which has no loss to walk from, any its
    /// loss left out). At stage 3 a declared unit is reduced after
    /// backward, with nothing to overlap, and stays gathered, as the root
    /// does (its forward must not gather: a rank that skips it would meet
    /// the others' gather with its next unit's), so its parameters take
    /// the memory stage 2 gives them. Declare the parameters that need
    /// it, not all.
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// // Blocks h.4 to h.7 are skipped at random, differently per rank.
    /// plan.unused_on_some_ranks(|name, _shape| {
    ///     let block = name.strip_prefix("h.").and_then(|r| r.split('.').next());
    ///     block.and_then(|b| b.parse::<u32>().ok()).is_some_and(|i| i >= 4)
    /// })?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// Call it before building the engine, on every rank alike (the engine
    /// checks that ranks agree).
    pub fn unused_on_some_ranks(
        &self,
        may_be_unused: impl Fn(&str, &[i64]) -> bool + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        self.set_rule(
            "unused_on_some_ranks",
            &self.inner.uneven,
            Arc::new(may_be_unused),
        )
    }

    /// Whether [`Self::unused_on_some_ranks`] declared the parameter `name`
    /// of `shape` (none is without it).
    pub fn is_unused_on_some_ranks(&self, name: &str, shape: &[i64]) -> bool {
        self.uneven_rule().is_some_and(|r| r(name, shape))
    }

    /// Declares the trainable parameters for which `may_be_unused(name,
    /// shape)` is true as ones some ranks' losses may leave out **in units
    /// every rank runs**: the experts of a mixture-of-experts layer that
    /// some ranks' tokens never reach, where the layer (router and experts
    /// in one [`ShardedModule`]) runs on every rank and an expert without
    /// tokens is skipped. Stages 0-2 treat them as
    /// [`Self::unused_on_some_ranks`] does. Stage 3 gathers and frees such a
    /// unit like any other (its forward and the gathers of its backward
    /// happen on every rank, at the same point) and reduces it, with zeros
    /// for the gradients this rank's loss did not reach, at a point every
    /// rank reaches at the same place: when the backward of the unit
    /// before it in forward order begins (or at the end of backward, for
    /// the first unit). Its parameters then take stage 3's memory, where
    /// [`Self::unused_on_some_ranks`] keeps the whole unit gathered.
    ///
    /// That point is sound because libtorch's autograd engine runs a
    /// parameter's gradient accumulation before any node that was created
    /// earlier in forward: by the time the backward of the unit before
    /// begins, every gradient this unit's backward gives has been
    /// accumulated (a unit run more than once in one forward is reduced
    /// after its first run's backward). A gradient that still arrives
    /// later (another unit's forward used its parameter, say) stops the
    /// engine with [`EngineError::GradientsLost`] rather than being
    /// dropped.
    ///
    /// A rank that skips such a unit altogether (its forward does not run)
    /// breaks the contract: the ranks' gathers then differ, and the engine
    /// stops naming the unit each rank gathers. Declare those with
    /// [`Self::unused_on_some_ranks`]. So does a forward that returns its
    /// input itself, or an output that needs no gradient, on some ranks
    /// only (all tokens dropped): its backward then begins at another
    /// point, or not at all, there. Return a new tensor that depends on
    /// the input (`x + y`, `y` the experts' sum, zeros when none ran).
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// // Every rank runs moe.0 and moe.1; the experts some ranks' tokens
    /// // never reach get no gradient there.
    /// plan.partly_unused_on_some_ranks(|name, _shape| name.contains(".experts."))?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// Call it before building the engine, on every rank alike (the engine
    /// checks that ranks agree). A parameter both rules name is taken as
    /// [`Self::unused_on_some_ranks`] declares it.
    pub fn partly_unused_on_some_ranks(
        &self,
        may_be_unused: impl Fn(&str, &[i64]) -> bool + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        self.set_rule(
            "partly_unused_on_some_ranks",
            &self.inner.partial,
            Arc::new(may_be_unused),
        )
    }

    /// Whether [`Self::partly_unused_on_some_ranks`] declared the parameter
    /// `name` of `shape` (none is without it).
    pub fn is_partly_unused_on_some_ranks(&self, name: &str, shape: &[i64]) -> bool {
        self.partial_rule().is_some_and(|r| r(name, shape))
    }

    /// Puts `rule` in `slot`, unless an engine was already built from the
    /// plan (it read the rules then): `what` names the caller.
    fn set_rule<R: ?Sized>(
        &self,
        what: &str,
        slot: &Mutex<Option<Arc<R>>>,
        rule: Arc<R>,
    ) -> Result<(), EngineError> {
        self.set_rule_slot(what, slot, Some(rule))
    }

    /// Sets `slot` to `value` unless an engine was built from the plan.
    fn set_rule_slot<R>(
        &self,
        what: &str,
        slot: &Mutex<Option<R>>,
        value: Option<R>,
    ) -> Result<(), EngineError> {
        if self.inner.claimed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(EngineError::Plan(format!(
                "{what} was called after the engine was built from this plan: call it before Engine::from_config (or new, new_hybrid, new_hpz)"
            )));
        }
        let mut slot = slot
            .lock()
            .map_err(|_| EngineError::Plan("the plan's lock was poisoned".into()))?;
        *slot = value;
        Ok(())
    }

    /// The rule [`Self::exclude_from_weight_decay`] set, if any: the engine
    /// reads it once, so its agreement check and its layout see one rule.
    pub(crate) fn decay_rule(&self) -> Option<Arc<NameRule>> {
        self.inner.no_decay.lock().ok().and_then(|r| r.clone())
    }

    /// The rule [`Self::scale_learning_rate`] set, if any (read once, as
    /// [`Self::decay_rule`]).
    pub(crate) fn lr_rule(&self) -> Option<Arc<LrRule>> {
        self.inner.lr_scale.lock().ok().and_then(|r| r.clone())
    }

    /// The rule [`Self::unused_on_some_ranks`] set, if any (read once, as
    /// [`Self::decay_rule`]).
    pub(crate) fn uneven_rule(&self) -> Option<Arc<NameRule>> {
        self.inner.uneven.lock().ok().and_then(|r| r.clone())
    }

    /// The rule [`Self::partly_unused_on_some_ranks`] set, if any (read
    /// once, as [`Self::decay_rule`]).
    pub(crate) fn partial_rule(&self) -> Option<Arc<NameRule>> {
        self.inner.partial.lock().ok().and_then(|r| r.clone())
    }

    /// Chooses which trainable parameters Muon's half of
    /// `optimizer.type: "Muon"` steps (the rest step by its AdamW):
    /// those for which `muon(name, shape)` is true, DeepSpeed's
    /// `param.use_muon`. Each must have at least two dimensions, refused
    /// when the engine is built otherwise. One of more is taken as the
    /// matrix `[shape[0], the rest]`, right for a convolution's filters;
    /// experts stacked in one parameter (`[experts, out, in]`) would be
    /// orthogonalized as one matrix, not each apart (DeepSpeed's expert
    /// groups): leave those to AdamW, or keep each expert a parameter.
    ///
    /// Without it Muon takes the hidden weight matrices, by name as most
    /// Muon recipes choose them: every parameter of two or more
    /// dimensions except the embeddings and the head (a part of the name
    /// that contains `embed`, or is `wte`, `wpe`, `head` or `lm_head`);
    /// those, norms and biases go to AdamW, as Muon's authors split them.
    /// A model that names them otherwise says so:
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// // Llama's: `tok_embeddings` is caught by `embed`, `output` is not.
    /// plan.use_muon(|name, shape| {
    ///     shape.len() >= 2 && !name.contains("embed") && !name.starts_with("output.")
    /// })?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// The engine logs how many parameters each half takes when it is
    /// built.
    ///
    /// Call it before building the engine, on every rank alike (the engine
    /// checks that ranks agree). Any other optimizer ignores it. The rule
    /// is the program's and the checkpoint's both: a checkpoint records
    /// which parameters Muon stepped, and a full load into a run whose
    /// rule differs is refused (their momentum is not AdamW's).
    pub fn use_muon(
        &self,
        muon: impl Fn(&str, &[i64]) -> bool + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        self.set_rule("use_muon", &self.inner.muon, Arc::new(muon))
    }

    /// The rule [`Self::use_muon`] set, if any (read once, as
    /// [`Self::decay_rule`]).
    pub(crate) fn muon_rule(&self) -> Option<Arc<NameRule>> {
        self.inner.muon.lock().ok().and_then(|r| r.clone())
    }

    /// Makes every rank but the first hold no memory for the model's
    /// weights while it is built: on those ranks each
    /// [`ShardedModule::new`] gives back the memory of every variable of
    /// `vs` made so far (the block just built, and what came before it),
    /// and the engine, once built, gives each rank world rank 0's values
    /// (which it does anyway: the first rank's weights are the model's).
    /// Building then holds one block on those ranks instead of the whole
    /// model, so N ranks on one host hold one model while they build
    /// rather than N (FSDP's meta-device initialisation with
    /// `sync_module_states`; Accelerate's `cpu_ram_efficient_loading`).
    ///
    /// `rank` is this process's world rank (`dist.world().rank()`, RANK
    /// in the environment); on rank 0 this does nothing. An engine built
    /// over a group of some ranks (`Engine::new`) takes the weights of
    /// that group's first rank: pass the rank in that group. Call it on
    /// every rank before the model is built:
    ///
    /// ```no_run
    /// # use zrt_collectives::ProcessGroup;
    /// # fn f(dist: &zrt_collectives::Dist) -> Result<(), zrt_zero::EngineError> {
    /// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    /// let plan = zrt_zero::ShardPlan::new();
    /// plan.weights_on_first_rank_only(&vs, dist.world().rank())?;
    /// // build the model into `vs`, its blocks in ShardedModule::new;
    /// // pretrained weights are loaded on rank 0 only
    /// # Ok(()) }
    /// ```
    ///
    /// Until the engine is built the other ranks' weights have no memory:
    /// reading or writing one there (a forward, `vs.load`, printing a
    /// weight) stops the process with an explanation rather than
    /// computing on nothing. Load pretrained weights on rank 0 only. The
    /// ranks' results are the bits of a run without it.
    pub fn weights_on_first_rank_only(
        &self,
        vs: &nn::VarStore,
        rank: usize,
    ) -> Result<(), EngineError> {
        let release = (rank != 0).then(|| Release::of(vs, Values::FirstRank));
        self.set_rule_slot("weights_on_first_rank_only", &self.inner.release, release)
    }

    /// As [`Self::weights_on_first_rank_only`], and the first rank holds
    /// no weights either: as each block is wrapped it writes the
    /// variables made so far to a file in `dir` and gives their memory
    /// back, and the engine's build reads each unit's back from there
    /// just before it spreads them. Building then holds about one block
    /// on every rank, never the model: a fresh model too big for any one
    /// rank's memory is built (DeepSpeed's `zero.Init` with
    /// `remote_device="nvme"`). The cost is writing the model to `dir`
    /// once and reading it once, on the first rank.
    ///
    /// `rank` is this process's world rank, as for
    /// `weights_on_first_rank_only` (on the other ranks this is that
    /// rule; `dir` is not touched there). `dir` must exist and be
    /// writable by the first rank, on a disk with room for the model's
    /// weights in the dtypes they are made in (a tmpfs holds its files
    /// in memory, which defeats the purpose). The file has no name from
    /// the moment it is made, so a run that stops, however it stops,
    /// leaves nothing in `dir`; it closes once the engine is built. A
    /// write that fails (a full disk) is said once, and from then on the
    /// first rank keeps what the model makes, as under
    /// `weights_on_first_rank_only`. Until the engine is built no weight
    /// has memory on any rank: reading or writing one (a forward,
    /// `vs.load`) stops the process with an explanation; to start from
    /// pretrained weights use [`Self::weights_from_file`]. The ranks'
    /// results are the bits of a run without it.
    pub fn weights_on_disk_while_built(
        &self,
        vs: &nn::VarStore,
        rank: usize,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<(), EngineError> {
        let release = match rank {
            0 => {
                let spill = crate::spill::Spill::create(dir.as_ref())?;
                Release::of(vs, Values::Spill(Arc::new(spill)))
            }
            _ => Release::of(vs, Values::FirstRank),
        };
        let rule = "weights_on_disk_while_built";
        self.set_rule_slot(rule, &self.inner.release, Some(release))
    }

    /// Makes no rank hold the model's weights, the first included: each
    /// [`ShardedModule::new`] gives back the memory of every variable of
    /// `vs` made so far, the engine lays the model out without reading a
    /// value, and once built loads `file` into itself
    /// ([`Engine::load_weights`](crate::Engine::load_weights), strict),
    /// each rank reading only its own range. Building and loading then
    /// hold one block and this rank's shards, never the model: a model
    /// too big for any one rank's memory is built and loaded (DeepSpeed's
    /// `zero.Init` with a checkpoint loaded into it; FSDP2's meta-device
    /// initialisation with `set_model_state_dict` from a full state dict,
    /// `broadcast_from_rank0` not needed).
    ///
    /// `file` is a safetensors file of every variable under the model's
    /// VarStore names ([`Engine::save_16bit_model`](crate::Engine::save_16bit_model)'s,
    /// `zrt ckpt consolidate`'s, tch's `VarStore::save`), or a model in
    /// several files as `load_weights` takes one (a sharded checkpoint's
    /// index, or its directory), which every rank must see; every rank
    /// calls this, with the same file (the
    /// engine's build refuses ranks that differ). The initial values the
    /// model's layers draw are never used. Until the engine is built no
    /// weight has memory on any rank: reading or writing one (a forward,
    /// `vs.load`) stops the process with an explanation. A file that does
    /// not hold every variable, in its shape, fails the engine's build
    /// naming what differs; so does a file only some ranks can read.
    /// Variables the file cannot hold (a LoRA model's adapters over a
    /// pretrained base, a new head) are named by [`Self::fresh_weights`].
    pub fn weights_from_file(
        &self,
        vs: &nn::VarStore,
        file: impl AsRef<std::path::Path>,
    ) -> Result<(), EngineError> {
        let release = Release::of(vs, Values::File(file.as_ref().to_path_buf()));
        self.set_rule_slot("weights_from_file", &self.inner.release, Some(release))
    }

    /// Names the variables [`Self::weights_from_file`]'s file does not
    /// hold, which start from the values the model drew instead (world
    /// rank 0's, on every rank, as without a file): `rule(name, shape)`
    /// is true of such a variable, given its VarStore name. A LoRA
    /// model's adapters over a pretrained base, or a new head:
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// plan.fresh_weights(|name, _| name.contains(".lora_"))?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// They keep their memory while the model is built (the rest is
    /// released), and the build's load is strict about every other
    /// variable: one the rule names that the file does hold takes the
    /// file's values. Without `weights_from_file` the rule changes
    /// nothing. Call it before the first [`ShardedModule::new`], on every
    /// rank alike.
    pub fn fresh_weights(
        &self,
        rule: impl Fn(&str, &[i64]) -> bool + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        let rule: Arc<NameRule> = Arc::new(rule);
        self.set_rule_slot("fresh_weights", &self.inner.fresh, Some(rule))
    }

    /// Names the tensors of weights files in this model, for
    /// [`Engine::load_weights`](crate::Engine::load_weights) and
    /// [`Self::weights_from_file`]: `rule(name in the file)` is the
    /// VarStore name the tensor loads into, or `None` to leave the tensor
    /// out (as if the file did not hold it). A checkpoint whose names are
    /// not the model's, Hugging Face's `model.` prefix, say, loads
    /// without being rewritten:
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// plan.rename_weights(|name| {
    ///     let name = name.strip_prefix("model.").unwrap_or(name);
    ///     (!name.starts_with("lm_head.")).then(|| name.to_string())
    /// })?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// A strict load still wants every variable of the model, now by the
    /// names the rule gives, and refuses tensors whose names the rule
    /// gives that the model lacks; two tensors given one name are
    /// refused. Call it before building the engine, on every rank alike:
    /// a load on ranks whose rules name different tensors is refused as
    /// one of different files. Shapes and dtypes are the file's; a matrix
    /// stored transposed loads under [`Self::transpose_weights`].
    pub fn rename_weights(
        &self,
        rule: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        let rule: Arc<Rename> = Arc::new(rule);
        self.set_rule_slot("rename_weights", &self.inner.rename, Some(rule))
    }

    /// Puts `before` in front of the rename rule already set (or of none):
    /// each name in a weights file goes through `before`, then through
    /// that rule. For names with something in front of a layout's own,
    /// which the layout's rule then reads as it is: PEFT's adapter files
    /// put `base_model.model.` before every name, and a LoRA model reads
    /// its base's file and its adapter's with one rule:
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// plan.rename_weights(|name| Some(name.to_string()))?; // the layout's
    /// plan.rename_weights_before(|name| {
    ///     name.strip_prefix("base_model.model.").unwrap_or(name).to_string()
    /// })?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    pub fn rename_weights_before(
        &self,
        before: impl Fn(&str) -> String + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        let then = self
            .inner
            .rename
            .lock()
            .map_err(|_| EngineError::Plan("the plan's lock was poisoned".into()))?
            .clone();
        self.rename_weights(move |name| {
            let name = before(name);
            match &then {
                Some(rule) => rule(&name),
                None => Some(name),
            }
        })
    }

    /// Says which matrices of weights files are stored transposed, for
    /// [`Engine::load_weights`](crate::Engine::load_weights) and
    /// [`Self::weights_from_file`]: `rule(name)`, given a tensor's name in
    /// the model (after [`Self::rename_weights`]' rule), is true for a
    /// tensor the file holds as `[cols, rows]` where the model's variable
    /// is `[rows, cols]`. Hugging Face's GPT-2 keeps its attention and MLP
    /// weights so (its Conv1D is `[in, out]`, a tch `nn::linear`'s weight
    /// `[out, in]`):
    ///
    /// ```no_run
    /// # let plan = zrt_zero::ShardPlan::new();
    /// plan.transpose_weights(|name| {
    ///     ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]
    ///         .iter()
    ///         .any(|w| name.ends_with(w))
    /// })?;
    /// # Ok::<(), zrt_zero::EngineError>(())
    /// ```
    ///
    /// Each rank reads its own range of such a matrix element by element
    /// from the mapped file, as it reads any other's (no rank makes a
    /// transposed copy of a parameter; a frozen variable every rank holds
    /// whole is transposed as it is copied in). A tensor the rule names
    /// must be a matrix in the file, or the load is refused naming it. Call
    /// it before building the engine, on every rank alike: ranks whose
    /// rules differ are refused as ranks reading different files (a
    /// square matrix read transposed on one rank only would have every
    /// shape right).
    pub fn transpose_weights(
        &self,
        rule: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        let rule: Arc<TransposeRule> = Arc::new(rule);
        self.set_rule_slot("transpose_weights", &self.inner.transpose, Some(rule))
    }

    /// Says which of the model's tensors weights files may hold several
    /// copies of, for [`Engine::load_weights`](crate::Engine::load_weights)
    /// and [`Self::weights_from_file`]: `rule(name)`, given a tensor's
    /// name in the model (after [`Self::rename_weights`]' rule), is true
    /// for a tensor several of the file's tensors may be named, the copies
    /// `transformers` ties into one parameter (Zamba's shared block, which
    /// a file may hold under any of the layers that use it). Of such
    /// copies the one whose name in the file sorts first is read, on
    /// every rank alike, and the others are left out; any other name given
    /// twice is still refused. Call it before building the engine, on
    /// every rank alike.
    pub fn weight_copies(
        &self,
        rule: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Result<(), EngineError> {
        let rule: Arc<CopiesRule> = Arc::new(rule);
        self.set_rule_slot("weight_copies", &self.inner.copies, Some(rule))
    }

    /// The units' VarStore prefixes, in registration order.
    pub fn units(&self) -> Vec<String> {
        self.inner
            .prefixes
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default()
    }
}

/// A tch module whose parameters (those under `path`) form one unit.
pub struct ShardedModule<M> {
    inner: M,
    plan: Arc<PlanInner>,
    unit: usize,
}

impl<M> std::fmt::Debug for ShardedModule<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModule")
            .field("unit", &self.unit)
            .finish()
    }
}

impl<M> ShardedModule<M> {
    /// Wraps `inner`, whose parameters live under `path`, as the next unit
    /// of `plan`. Wrap in the order the units run in forward.
    pub fn new(plan: &ShardPlan, path: &nn::Path, inner: M) -> Self {
        let prefix = path.components().collect::<Vec<_>>().join(".");
        plan.inner.release_made_so_far();
        let unit = match plan.inner.prefixes.lock() {
            Ok(mut p) => {
                p.push(prefix);
                p.len() - 1
            }
            Err(_) => 0,
        };
        Self {
            inner,
            plan: plan.inner.clone(),
            unit,
        }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// Before the wrapped module's forward; the unit counts as running
    /// (for checkpointed segments inside it) while the result lives.
    fn before(&self) -> Option<Running> {
        let h = self.plan.engine_hook()?;
        h.before_forward(self.unit);
        Some(Running::enter(h, self.unit))
    }

    /// `f` of the wrapped module in place of its forward, with the unit's
    /// parameters made usable first, `x` its input and the result its
    /// output as the engine sees them: for a unit whose output is not
    /// its module's forward (a language model's head that returns the
    /// loss itself, [`glue::linear_cross_entropy`](crate::glue::linear_cross_entropy)).
    /// As for any unit, its backward must begin at the result's gradient
    /// and end at `x`'s.
    pub fn forward_with(&self, x: &Tensor, f: impl FnOnce(&M) -> Tensor) -> Tensor {
        let _running = self.before();
        let y = f(&self.inner);
        self.after(x, &y);
        y
    }

    fn after(&self, x: &Tensor, y: &Tensor) {
        if let Some(h) = self.plan.engine_hook() {
            h.after_forward(self.unit, x, y);
        }
    }
}

impl<M: nn::Module> nn::Module for ShardedModule<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.forward_with(xs, |m| m.forward(xs))
    }
}

impl<M: nn::ModuleT> ShardedModule<M> {
    /// `forward_t` of the wrapped module, with the unit's parameters made
    /// usable first (tch gives every `Module` a `ModuleT`; this covers
    /// modules that only implement `ModuleT`, such as ones with dropout).
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.forward_with(xs, |m| m.forward_t(xs, train))
    }
}

/// Why a plan cannot be used.
pub(crate) fn check_prefixes(prefixes: &[String]) -> Result<(), EngineError> {
    for (i, a) in prefixes.iter().enumerate() {
        for b in &prefixes[i + 1..] {
            let nested =
                b.starts_with(&format!("{a}.")) || a.starts_with(&format!("{b}.")) || a == b;
            if nested {
                return Err(EngineError::Plan(format!(
                    "units `{a}` and `{b}` overlap: wrap each block once, and not a block inside another wrapped block"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_prefixes, ShardPlan};

    #[test]
    fn a_rule_put_before_the_rename_rule_runs_first_and_keeps_it() {
        let named = |plan: &ShardPlan, n: &str| {
            let rule = plan.inner.rename.lock().unwrap().clone().unwrap();
            rule(n)
        };
        let strip = |n: &str| n.strip_prefix("base_model.model.").unwrap_or(n).to_string();
        // Alone, it renames.
        let plan = ShardPlan::new();
        plan.rename_weights_before(strip).unwrap();
        assert_eq!(named(&plan, "base_model.model.a.w").as_deref(), Some("a.w"));
        // Before a layout's rule, which still drops what it drops.
        let plan = ShardPlan::new();
        plan.rename_weights(|n| (!n.ends_with("inv_freq")).then(|| format!("m.{n}")))
            .unwrap();
        plan.rename_weights_before(strip).unwrap();
        for (file, model) in [
            ("base_model.model.a.w", Some("m.a.w")),
            ("a.w", Some("m.a.w")),
            ("base_model.model.rotary.inv_freq", None),
        ] {
            assert_eq!(named(&plan, file).as_deref(), model, "{file}");
        }
    }

    #[test]
    fn units_that_overlap_are_refused_by_name() {
        let check =
            |v: &[&str]| check_prefixes(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        // Siblings, even where one name begins with another's ("h.1", "h.10").
        assert!(check(&["h.0", "h.1", "h.10", "lm_head"]).is_ok());
        for (v, a, b) in [
            (["h.0", "h.0.mlp"], "h.0", "h.0.mlp"),
            (["h.0.mlp", "h.0"], "h.0.mlp", "h.0"),
            (["h.1", "h.1"], "h.1", "h.1"),
        ] {
            let e = check(&v).unwrap_err().to_string();
            assert!(e.contains(&format!("units `{a}` and `{b}` overlap")), "{e}");
        }
    }
}

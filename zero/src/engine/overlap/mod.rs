//! Communication overlapped with compute (DESIGN.md, "One training step").
//!
//! * **Reduce during backward.** Every trainable parameter carries a
//!   post-accumulate-grad hook. When the last parameter of a unit has its
//!   gradient, the unit's gradients are copied out (widened to fp32) and its
//!   reduction (stage 0: all-reduce; stages 2-3: reduce-scatter) is issued
//!   *asynchronously* on the group's worker, while autograd goes on with
//!   earlier units; stage 3 frees the unit's gathered parameters at once.
//!   `Engine::backward` waits for the reductions at its end, in issue order.
//!   Every parameter in use produces its gradient through nodes that have
//!   all run when its accumulation hook fires, so freeing then is safe.
//!   When the program declared units some ranks may not use
//!   ([`crate::ShardPlan::unused_on_some_ranks`]), stages 0 and 2 reduce
//!   every unit in one order the ranks agree ([`LaunchOrder`]), each once
//!   it and those before it are whole, a unit the walk from the loss does
//!   not reach counting as whole at once; until that order is agreed
//!   (the first backward), and at stage 3, declared units wait for the
//!   end of backward instead, where every rank reduces them in unit order
//!   (and stage 3 frees them). Stage 3 reduces a unit every rank runs
//!   but some ranks' losses use only part of
//!   ([`crate::ShardPlan::partly_unused_on_some_ranks`]) when the
//!   backward of the unit before it begins
//!   ([`Inner::reduce_partial_units`]).
//! * **Prefetch (stage 3).** When a unit is needed, the gather of the next
//!   one (forward) or the previous one (backward), in the order the last
//!   forward ran them ([`RunOrder`]), is issued right away and only waited
//!   for when that unit is needed, bounded by
//!   `stage3_prefetch_bucket_size` (elements of the unit prefetched) and
//!   `stage3_max_live_parameters` (elements gathered or in flight).
//!
//! Collectives run in issue order on one worker per group, and every rank
//! issues the same sequence (the same model runs the same autograd graph),
//! so overlapping changes no bit of the result.
//!
//! This module follows a backward (its hooks, the units some ranks skip,
//! the run order); `reductions` issues and retires the gradient
//! reductions, `gather` stage 3's gathers and prefetches, `announce` the
//! check before each unit's collective that every rank reached the same
//! one.

use tch::Tensor;
use zrt_collectives::{ProcessGroup, Work};

pub(super) use super::launch_order::LaunchOrder;
use super::timing::waiting;
use super::{foreign, Inner, State, Unit};
use crate::{glue, EngineError};

mod announce;
mod gather;
mod reductions;

pub(super) use announce::named_after_backward;
use announce::{unit_name, UnitIds};
use gather::Prefetch;
pub(super) use gather::{pack, unpack_all, Fetch, Secondary};
pub(super) use reductions::Reduced;
use reductions::{drop_reductions, Reduce};

/// What the current backward has done, and gathers issued ahead.
pub(super) struct Progress {
    /// Parameters of each unit whose gradient this backward still owes.
    ready: Vec<usize>,
    /// Per unit, which of its parameters this backward has accumulated
    /// (a checkpointed segment's recompute may accumulate one again).
    seen: Vec<Vec<bool>>,
    /// Units whose gradients this backward has taken (all true outside an
    /// engine backward, so hooks of a bare `loss.backward()` do nothing).
    launched: Vec<bool>,
    /// The order every rank reduces the units in, once agreed (see
    /// [`LaunchOrder`]).
    pub(super) order_agreed: Option<LaunchOrder>,
    /// Units with their whole gradient this backward, waiting for their
    /// turn in the agreed order.
    complete: Vec<bool>,
    /// Units in the order their gradients became whole this backward
    /// (what the ranks agree the launch order from).
    completed: Vec<usize>,
    /// Per unit, the parameters the walk from the loss did not reach,
    /// counted as having their (zero) gradient before backward ran.
    unreached: Vec<Vec<usize>>,
    /// Reductions in issue order: (unit, range of its gradient buffer the
    /// result adds to, the reduction, elements of the buffer it holds).
    inflight: Vec<(usize, std::ops::Range<usize>, Reduce, usize)>,
    /// The elements `inflight` holds (see `launch_reduce`).
    inflight_elems: usize,
    /// Hybrid sharding: replicate-group averages issued for reductions that
    /// completed, waited for one retired unit later (or at the end of
    /// backward), so backward does not stop for each one: (unit, range of
    /// its gradient shard, the average).
    replicating: Vec<(usize, std::ops::Range<usize>, Work<Vec<f32>>)>,
    /// Units whose reductions this backward already added to their
    /// gradient shards (stage 1 adds at launch, the others when a unit is
    /// retired): a backward that fails after that leaves part of its
    /// gradient in them.
    added: Vec<usize>,
    /// Each reduced unit's index as every rank of the group (and of the
    /// replicate group) named it, in issue order, checked before any
    /// reduction is used.
    reduce_ids: Vec<(usize, Vec<UnitIds>)>,
    /// Gathers issued ahead, per unit.
    prefetch: Vec<Option<Prefetch>>,
    /// What overlapped so far (for tests and benchmarks).
    pub(super) counts: OverlapCounts,
    /// The hooks are driving a backward the program started itself
    /// (`loss.backward()` instead of `Engine::backward`); `step()` ends it.
    pub(super) bare: bool,
    /// The libtorch backward that last accumulated a gradient here
    /// ([`glue::backward_id`]).
    backward_id: Option<i64>,
    /// The order forward runs the units in, which prefetch follows.
    pub(super) order: RunOrder,
    /// The other engine's backward (id, count) whose gradients through
    /// this engine's parameters the hooks are dropping ([`foreign`]).
    foreign_of: Option<(u64, u64)>,
    /// Per unit, the parameters whose gradient that backward still owes.
    foreign_ready: Vec<usize>,
    /// The gather under way is for a libtorch backward running on this
    /// thread (a unit re-gathered from its output's gradient hook, or a
    /// checkpointed segment's recompute): a backward's gather even before
    /// the first parameter gradient has told the engine that a backward
    /// the program started with `loss.backward()` is under way (ranks
    /// that skip different units learn that at different points).
    pub(super) in_autograd: bool,
    /// `overlap_comm: false`: reductions a hook found announced unevenly
    /// (the ranks' names for it, the units some rank reduced), named when
    /// the error is returned, after backward ran on (see
    /// [`announce::uneven_after_backward`]).
    uneven_later: Option<(String, Vec<usize>)>,
    /// Stage 3, units every rank runs that some ranks' losses use only
    /// part of ([`crate::ShardPlan::partly_unused_on_some_ranks`]): per
    /// unit, the runs of forwards since the last backward whose backward
    /// is still to come (a unit run twice is reduced after its first run's
    /// backward, the last).
    partial_runs: Vec<usize>,
    /// Such units whose last backward has begun, with that backward's id
    /// ([`glue::backward_id`]), reduced when the next unit's backward
    /// begins (see [`Inner::reduce_partial_units`]); one of a backward
    /// that ended since is dropped (that end reduced it).
    partial_due: Vec<(usize, Option<i64>)>,
}

/// The order the units' forwards ran in, recorded as they run (FSDP2
/// records its first iteration's order the same way): a model's units need
/// not run in the order they were wrapped (a GPT's token embedding and its
/// head are wrapped after the blocks but run first and last), and
/// prefetching by index then gathers a unit nobody needs next while the one
/// needed waits. Every rank runs the same forward, so every rank records the
/// same order and issues the same prefetches.
#[derive(Debug, Default)]
pub(super) struct RunOrder {
    /// The forward under way: distinct units in the order they started.
    current: Vec<usize>,
    /// The last forward that completed (empty before the first).
    last: Vec<usize>,
    /// Units of `current` whose output needed no gradient (a frozen
    /// prefix: frozen units before the first trainable one): backward
    /// never reaches them.
    current_skipped: Vec<usize>,
    /// The same for `last`: backward's prefetch passes them over.
    last_skipped: Vec<usize>,
}

impl RunOrder {
    /// Unit `k`'s forward starts. A unit already seen means a new forward
    /// began without a backward in between (evaluation): the one before is
    /// complete.
    pub(super) fn forward_starts(&mut self, k: usize) {
        if self.current.contains(&k) {
            self.complete();
        }
        self.current.push(k);
    }

    /// Unit `k`'s forward, under way, gave an output that needs no
    /// gradient: it has no backward.
    pub(super) fn without_backward(&mut self, k: usize) {
        if self.current.contains(&k) && !self.current_skipped.contains(&k) {
            self.current_skipped.push(k);
        }
    }

    /// A forward is complete (its backward begins).
    pub(super) fn complete(&mut self) {
        if !self.current.is_empty() {
            self.last = std::mem::take(&mut self.current);
            self.last_skipped = std::mem::take(&mut self.current_skipped);
        }
    }

    /// The unit that runs after `k` in forward (`forward`) or backward
    /// order: by the last complete forward, or by index before one
    /// completed (or for a unit it did not run). Backward passes over the
    /// units it never reaches ([`RunOrder::without_backward`]): gathering
    /// them would be traffic nothing uses.
    pub(super) fn after(&self, k: usize, forward: bool) -> Option<usize> {
        match self.last.iter().position(|&u| u == k) {
            Some(at) if forward => self.last.get(at + 1).copied(),
            Some(at) => self.last[..at]
                .iter()
                .rev()
                .find(|u| !self.last_skipped.contains(u))
                .copied(),
            None if forward => Some(k + 1),
            None => k.checked_sub(1),
        }
    }

    /// Whether `k` ran last in the last complete forward: its backward runs
    /// first, right after the loss.
    pub(super) fn runs_last(&self, k: usize) -> bool {
        self.last.last() == Some(&k)
    }
}

/// How much communication overlapped compute since the engine was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OverlapCounts {
    /// Unit gathers that were issued ahead and found in flight or done
    /// when the unit was needed (stage 3).
    pub prefetched: u64,
    /// Unit reductions issued from a gradient hook while backward was
    /// still running (as opposed to after it).
    pub during_backward: u64,
    /// ZeRO++ hpZ: backward re-gathers served inside the hpZ group from the
    /// secondary copies.
    pub hpz_gathers: u64,
    /// Unit gathers issued only when the unit was needed (stage 3): compute
    /// waited for the whole gather.
    pub on_demand: u64,
    /// Gathers issued ahead that nothing used (stage 3): wasted traffic.
    pub unused: u64,
    /// ZeRO++ qwZ: unit gathers sent as int8 codes and scales
    /// (`zero_quantized_weights`).
    pub quantized_gathers: u64,
    /// ZeRO++ qgZ: gradient buckets reduced as int8 codes and scales
    /// through an all_to_all (`zero_quantized_gradients`).
    pub quantized_reductions: u64,
    /// `offload_param`: sharded frozen parameters the parameter swap had
    /// read ahead when their unit's gather was issued (rather than read
    /// then).
    pub frozen_read_ahead: u64,
}

impl Progress {
    /// The units this backward added to their gradient shards, named for
    /// an error, if any.
    pub(super) fn added_to_shards(&self, units: &[Unit]) -> Option<String> {
        let mut added = self.added.clone();
        added.sort_unstable();
        added.dedup();
        let names: Vec<String> = added
            .iter()
            .map(|&k| format!("`{}`", unit_name(units, k)))
            .collect();
        match names.len() {
            0 => None,
            1 => Some(format!("unit {}", names[0])),
            _ => Some(format!("units {}", names.join(", "))),
        }
    }

    /// Unit `k`, of `params` trained parameters, owes a reduction once
    /// each of them has its gradient (a unit of frozen parameters only has
    /// nothing to reduce).
    fn arm(&mut self, k: usize, params: usize) {
        self.ready[k] = params;
        self.seen[k].clear();
        self.seen[k].resize(params, false);
        self.launched[k] = params == 0;
        self.complete[k] = false;
        self.unreached[k].clear();
    }

    /// Parameter `j` of unit `k` accumulated its gradient: whether each of
    /// the unit's parameters has now.
    fn see(&mut self, k: usize, j: usize) -> bool {
        if let Some(seen) = self.seen[k].get_mut(j) {
            if !*seen {
                *seen = true;
                self.ready[k] = self.ready[k].saturating_sub(1);
            }
        }
        self.ready[k] == 0
    }

    /// Whether this backward has taken unit `k`'s gradients for their
    /// reduction (true outside a backward, and for a unit with nothing to
    /// reduce).
    pub(super) fn reduced(&self, k: usize) -> bool {
        self.launched[k]
    }

    /// Whether an engine backward is under way (forwards run inside it
    /// recompute activations; they are not the model's run order).
    pub(super) fn in_backward(&self) -> bool {
        self.launched.iter().any(|&l| !l)
    }

    pub(super) fn new(units: usize) -> Self {
        Self {
            ready: vec![0; units],
            seen: vec![Vec::new(); units],
            launched: vec![true; units],
            order_agreed: None,
            complete: vec![false; units],
            completed: Vec::new(),
            unreached: vec![Vec::new(); units],
            inflight: Vec::new(),
            inflight_elems: 0,
            replicating: Vec::new(),
            added: Vec::new(),
            reduce_ids: Vec::new(),
            prefetch: (0..units).map(|_| None).collect(),
            counts: OverlapCounts::default(),
            bare: false,
            backward_id: None,
            order: RunOrder::default(),
            uneven_later: None,
            partial_runs: vec![0; units],
            partial_due: Vec::new(),
            in_autograd: false,
            foreign_of: None,
            foreign_ready: Vec::new(),
        }
    }
}

/// Whether stage 3 keeps unit `k` gathered: the root (its forward is not
/// wrapped), and units of parameters no larger than
/// `stage3_param_persistence_threshold`.
pub(super) fn stays_gathered(st: &State, k: usize) -> bool {
    st.persistent.get(k).copied().unwrap_or(false)
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Arms the hooks for one backward.
    pub(super) fn begin_backward(&self, st: &mut State) {
        st.prog.order.complete();
        st.prog.added.clear();
        st.prog.uneven_later = None;
        st.prog.completed.clear();
        if let Some(o) = &mut st.prog.order_agreed {
            o.next = 0;
        }
        for (k, u) in st.units.iter().enumerate() {
            st.prog.arm(k, u.params.len());
        }
    }

    /// Warns (once) when the backward that just ran reached none of this
    /// engine's trained parameters: a loss of another model's, or computed
    /// from detached tensors. Its micro-step's gradient is zero, and
    /// nothing else would say so.
    pub(super) fn warn_if_untouched(&self, st: &State) {
        let mut trained = st
            .units
            .iter()
            .enumerate()
            .filter(|(_, u)| !u.params.is_empty())
            .peekable();
        if trained.peek().is_none() {
            return; // every parameter frozen: nothing to reach
        }
        // A unit launched because the walk from the loss reached none of
        // its parameters (see `skip_unreached`) was not reached.
        let reached = trained.any(|(k, u)| {
            let walked_past = st.prog.unreached[k].len() == u.params.len();
            (st.prog.launched[k] && !walked_past) || u.params.iter().any(|t| t.grad().defined())
        });
        if !reached
            && !self
                .told_untouched
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                micro_step = st.micro,
                "engine.backward(loss): the loss reached none of this engine's trained parameters, so this micro-step's gradient is zero; was it computed from another engine's model, or from detached tensors? (said once)"
            );
        }
    }

    /// Disarms the hooks after a backward that failed in libtorch. The
    /// reductions it issued are dropped unwaited (the worker still runs
    /// them; if a peer never matches one, the next collective times out
    /// naming it rather than this call blocking).
    pub(super) fn abort_backward(&self, st: &mut State) {
        st.prog.launched.fill(true);
        st.prog.partial_runs.fill(0);
        st.prog.partial_due.clear();
        st.prog.unreached.iter_mut().for_each(Vec::clear);
        drop_reductions(st);
    }

    /// Parameter `j` of unit `k` has its gradient (the hook's entry point).
    pub(super) fn grad_accumulated(&self, k: usize, j: usize) {
        let mut st = self.st.lock();
        if st.error.is_some() || k >= st.prog.launched.len() {
            return;
        }
        if let Some(other) = foreign::other_than(self.id) {
            if let Err(e) = self.drop_foreign(&mut st, other, k, j) {
                st.error = Some(e);
            }
            return;
        }
        let id = match glue::backward_id() {
            Ok(id) => id,
            Err(e) => {
                st.error = Some(e.into());
                return;
            }
        };
        if st.prog.unreached[k].contains(&j) {
            // Not reached from the loss, yet here: the unit may have been
            // reduced with zeros already. Only a graph built during
            // backward (a checkpoint other than zrt's, whose segments hold
            // their units) could do this; stop rather than lose it.
            let name = st.units[k].param_name(j);
            st.error = Some(EngineError::GradientsLost(format!(
                "parameter `{name}` of unit `{}` received a gradient that the walk of the autograd graph from the loss did not find, so its unit (declared with ShardPlan::unused_on_some_ranks) may have been reduced without it; checkpoint with zrt's Checkpointed, which the engine knows to wait for",
                st.units[k].name
            )));
            return;
        }
        let again = id.is_some() && id == st.prog.backward_id;
        st.prog.backward_id = id;
        if st.prog.launched[k] && again && st.units[k].partial {
            // Reduced when the backward of the unit before it began: every
            // gradient of its backward should have been accumulated by then.
            let name = st.units[k].param_name(j);
            st.error = Some(EngineError::GradientsLost(format!(
                "parameter `{name}` of unit `{}` (declared with ShardPlan::partly_unused_on_some_ranks) received a gradient after the unit was reduced, when the backward of the unit before it began (does another unit's forward use this parameter too, or did the unit's forward run inside a backward?); declare it with ShardPlan::unused_on_some_ranks instead, whose units are reduced at the end of backward",
                st.units[k].name
            )));
            return;
        }
        if st.prog.launched[k] && again {
            // This backward already took the unit's gradients: a
            // checkpointed unit run more than once in one forward, whose
            // runs' recomputes each accumulate their part (in a backward of
            // their own; without checkpoints libtorch sums the parts and
            // accumulates once). Reduce this part too, once it is whole.
            let params = st.units[k].params.len();
            st.prog.arm(k, params);
        } else if st.prog.launched[k] {
            // Outside `Engine::backward`: the program ran `loss.backward()`
            // itself. The hooks drive it the same way; `step()` (or the
            // next such backward) ends it.
            if let Err(e) = self.begin_bare(&mut st) {
                st.error = Some(e);
                return;
            }
        }
        // Complete once each parameter has its gradient and no
        // checkpointed segment that may add to one is still to be
        // recomputed (a unit run twice, part of it checkpointed).
        if st.prog.see(k, j) && self.segments.held(k) == 0 {
            self.launch_complete(&mut st, k);
        }
    }

    /// Unit `k` has its whole gradient for this backward: issue its
    /// reduction (and at stage 3 free it), waiting for it under
    /// `overlap_comm: false`. Once the ranks agreed a launch order (see
    /// [`LaunchOrder`]) it waits for its turn in it. Before that, a unit
    /// some ranks may not use waits for the end of backward
    /// ([`Self::end_backward`] reduces it there): on a rank whose loss left
    /// part of it out it is complete only then, and every rank must reduce
    /// it at the same point. Not at stage 1, whose first backward only
    /// adds to local sums, in any order (it reduces in `step()`, see
    /// `stage1_reduces_now`).
    fn launch_complete(&self, st: &mut State, k: usize) {
        if st.prog.order_agreed.is_some() {
            st.prog.complete[k] = true;
            self.launch_in_turn(st);
            return;
        }
        // What this rank brings to the order the ranks will agree (only
        // an engine that agrees one needs it).
        if self.agrees_launch_order(st) && !st.prog.completed.contains(&k) {
            st.prog.completed.push(k);
        }
        if (st.units[k].uneven || st.units[k].partial) && self.stage != 1 {
            return;
        }
        self.launch_now(st, k);
    }

    /// Stage 3: unit `k`, one every rank runs that some ranks' losses use
    /// only part of, ran a forward whose output needs a gradient (outside
    /// backward: not a recompute): one more backward of it to come before
    /// it is reduced.
    pub(super) fn partial_forward(&self, st: &mut State, k: usize) {
        st.prog.partial_runs[k] += 1;
    }

    /// Stage 3: the backward of `unit` begins (its output's gradient is
    /// ready, before its gather). Units every rank runs that some ranks'
    /// losses use only part of, whose last backward began before, are
    /// reduced now: every rank reaches this point at the same place in
    /// its collectives (stage 3 runs the same units in the same order on
    /// every rank), and libtorch has accumulated every gradient their
    /// backward gives by now (its autograd engine runs the nodes created
    /// later in forward, and gradient accumulations, before this unit's).
    /// Where one rank's loss reached only part of such a unit, the rest
    /// counts as zeros. Not one a checkpointed segment still holds (its
    /// recompute may add to it; the ranks' segments are alike): a later
    /// unit's backward, or the end of backward, reduces it.
    pub(super) fn reduce_partial_units(&self, st: &mut State, unit: usize) {
        if st.prog.partial_due.is_empty() && !st.units[unit].partial {
            return; // (every backward of a model without such units)
        }
        if foreign::other_than(self.id).is_some() {
            return; // another engine's backward: these gradients are dropped
        }
        let now = match glue::backward_id() {
            Ok(id) => id,
            Err(e) => {
                st.error = Some(e.into());
                return;
            }
        };
        st.prog.partial_due.retain(|&(_, id)| id == now);
        let due: Vec<usize> = (st.prog.partial_due.iter())
            .map(|&(k, _)| k)
            .filter(|&k| k != unit && self.segments.held(k) == 0)
            .collect();
        st.prog.partial_due.retain(|(k, _)| !due.contains(k));
        if due.iter().any(|&k| st.prog.launched[k]) {
            // Not armed: a bare `loss.backward()` whose loss reached no
            // parameter of the units backward went through so far on this
            // rank (where another rank's may have, and reduces them now).
            // It begins here, as a gradient would have begun it; unless it
            // accumulates into no parameter at all
            // (`torch.autograd.grad(loss, x)`), which reduces nothing.
            let params = st.units.iter().flat_map(|u| &u.params);
            let begun = match glue::will_accumulate_any(params) {
                Ok(true) => self.begin_bare(st).map(|()| true),
                Ok(false) => Ok(false),
                Err(e) => Err(e.into()),
            };
            match begun {
                Ok(true) => st.prog.backward_id = now,
                Ok(false) => {}
                Err(e) => {
                    st.error = Some(e);
                    return;
                }
            }
        }
        for k in due {
            if !st.prog.launched[k] && st.error.is_none() {
                self.launch_now(st, k);
            }
        }
        if st.units[unit].partial {
            let left = st.prog.partial_runs[unit].saturating_sub(1);
            st.prog.partial_runs[unit] = left;
            if left == 0 && !st.prog.partial_due.iter().any(|&(k, _)| k == unit) {
                st.prog.partial_due.push((unit, now));
            }
        }
    }

    /// Launches the units whose turn in the agreed order has come and
    /// whose gradients are whole, up to the first that is not.
    fn launch_in_turn(&self, st: &mut State) {
        while st.error.is_none() {
            let Some(o) = &st.prog.order_agreed else {
                return;
            };
            let Some(&k) = o.order.get(o.next) else {
                return;
            };
            if !st.prog.launched[k] {
                if !st.prog.complete[k] {
                    return;
                }
                self.launch_now(st, k);
            }
            if let Some(o) = &mut st.prog.order_agreed {
                o.next += 1;
            }
        }
    }

    /// Parameters of units some ranks may not use that backward from
    /// `loss` will not reach count as having their (zero) gradient before
    /// it runs, so such units are reduced in their turn instead of at the
    /// end (DDP's `find_unused_parameters` walks the graph the same way).
    /// Only once the launch order is agreed (every rank reduces in it,
    /// whenever each finds a unit whole), and not for units a checkpointed
    /// segment holds: its recompute builds the graph that reaches them
    /// during backward.
    pub(super) fn skip_unreached(&self, st: &mut State, loss: &Tensor) -> Result<(), EngineError> {
        if st.prog.order_agreed.is_none() {
            return Ok(());
        }
        let reached: std::collections::HashSet<usize> =
            glue::graph_leaves(loss, None)?.into_iter().collect();
        for k in 0..st.units.len() {
            if !st.units[k].uneven || st.prog.launched[k] || self.segments.held(k) > 0 {
                continue;
            }
            for j in 0..st.units[k].params.len() {
                if !reached.contains(&glue::tensor_impl(&st.units[k].params[j])?) {
                    st.prog.unreached[k].push(j);
                    st.prog.see(k, j);
                }
            }
            if st.prog.ready[k] == 0 {
                self.launch_complete(st, k);
            }
        }
        Ok(())
    }

    /// Issues unit `k`'s reduction from backward (see
    /// [`Self::launch_complete`]).
    fn launch_now(&self, st: &mut State, k: usize) {
        st.prog.counts.during_backward += 1;
        let overlap = self.cfg.config.zero.overlap_comm;
        let done = self
            .launch_reduce(st, k, true)
            .and_then(|()| match overlap {
                true => Ok(()),
                false => self.wait_for_reductions(st),
            });
        if let Err(e) = done {
            st.error = Some(e);
        }
    }

    /// A checkpointed segment that may touch `units` was recomputed by a
    /// backward, which accumulated its gradients: it holds them no longer
    /// unless that backward keeps its graph (see `segments`). Units it
    /// was the last to hold and whose parameters all have their gradients
    /// are reduced now. Whether it ended.
    pub(super) fn segment_recomputed(&self, units: &[usize]) -> bool {
        match glue::graph_kept() {
            Ok(false) => {}
            Ok(true) => return false,
            Err(e) => {
                self.st.lock().error.get_or_insert(e.into());
                return false;
            }
        }
        let held = self.segments.release(units);
        let mut st = self.st.lock();
        if st.error.is_some() || foreign::other_than(self.id).is_some() {
            return true;
        }
        for k in held {
            let armed = st.prog.launched.get(k) == Some(&false);
            if armed && st.prog.ready[k] == 0 && self.segments.held(k) == 0 {
                self.launch_complete(&mut st, k);
            }
        }
        true
    }

    /// Drops the gradient another engine's backward (`other`: its id and
    /// backward count) sent through parameter `j` of unit `k`, as
    /// `zero_grad()` would before this engine's own step, and reduces
    /// nothing (see [`foreign`]). Stage 3 frees the unit once all its
    /// parameters' gradients have come, as after its own backward: that
    /// backward re-gathered it.
    fn drop_foreign(
        &self,
        st: &mut State,
        other: (u64, u64),
        k: usize,
        j: usize,
    ) -> Result<(), EngineError> {
        if st.prog.foreign_of != Some(other) {
            st.prog.foreign_of = Some(other);
            st.prog.foreign_ready = st.units.iter().map(|u| u.params.len()).collect();
        }
        if let Some(t) = st.units[k].params.get(j) {
            glue::clear_grad(t)?;
        }
        if !self
            .told_foreign
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                "unit `{}`: another engine's backward sent gradients through this engine's parameters; they are dropped: engine.backward(loss) trains that engine only, as zero_grad() before this engine's own step would clear them. To train both engines from one loss, call loss.backward() and then step() on each (said once)",
                st.units[k].name
            );
        }
        let left = &mut st.prog.foreign_ready[k];
        *left = left.saturating_sub(1);
        if *left == 0 {
            self.free_if_gathered(st, k)?;
        }
        Ok(())
    }

    /// Starts a backward the program began with `loss.backward()`, ending
    /// the previous one first if `step()` was not called in between.
    fn begin_bare(&self, st: &mut State) -> Result<(), EngineError> {
        if st.scaler.is_some() {
            return Err(EngineError::Plan(
                "fp16 loss scaling needs the loss to go through the engine: call engine.backward(&loss) instead of loss.backward()".into(),
            ));
        }
        if st.prog.bare {
            // Units may already be gathered for the backward now starting:
            // finish the reductions, free nothing. Its forward's runs were
            // counted before, and its first units' backward may have begun.
            let runs = st.prog.partial_runs.clone();
            self.end_backward(st, false)?;
            st.prog.partial_runs = runs;
        }
        self.begin_backward(st);
        st.prog.bare = true;
        Ok(())
    }

    /// Ends a backward: reduces units no hook completed (parameters without
    /// a gradient this time), waits for every reduction in issue order and
    /// accumulates the results. With `free`, stage 3 frees what the backward
    /// gathered (not when a new backward is already under way).
    pub(super) fn end_backward(&self, st: &mut State, free: bool) -> Result<(), EngineError> {
        // In the agreed order once there is one (units no hook completed
        // come after the others), by index before.
        let order: Vec<usize> = match &st.prog.order_agreed {
            Some(o) => o.order.clone(),
            None => (0..st.units.len()).collect(),
        };
        let left: Vec<usize> = order
            .into_iter()
            .filter(|&k| !st.prog.launched[k])
            .collect();
        // Parameters left without a gradient, for the error below (named
        // before any launch clears the gradients).
        let without: Vec<(String, String)> = (left.iter().map(|&k| &st.units[k]))
            .flat_map(|u| {
                (u.layout.slots.iter().zip(&u.params))
                    .filter(|(_, t)| !t.grad().defined())
                    .map(|(s, _)| (s.name.clone(), u.name.clone()))
            })
            .collect();
        st.prog.unreached.iter_mut().for_each(Vec::clear);
        for k in left {
            self.launch_reduce(st, k, free)?;
            // As a hook does under `overlap_comm: false` (`launch_now`):
            // under hybrid sharding a unit's replicate-group average is
            // issued when its reduction is waited for, so a unit one
            // replica reduces from a hook and another here must be waited
            // for at the same point in both, or the replicate group's
            // calls interleave differently.
            if !self.cfg.config.zero.overlap_comm {
                self.settle_reductions(st, &without)?;
            }
        }
        self.settle_reductions(st, &without)?;
        // Asked before the order is agreed below: the first backward, which
        // agrees it, reduced nothing.
        st.reduced_in_backward = self.stage1_reduces_now(st);
        self.drain_prefetch(st)?;
        // hpZ copies serve one backward (the parameters change at the step).
        st.secondary.iter_mut().for_each(|s| *s = None);
        if free {
            // Stage 3: units re-gathered for backward go back to shards; the
            // root stays.
            for k in 0..st.units.len() {
                self.free_if_gathered(st, k)?;
            }
        }
        if st.prog.order_agreed.is_none() && self.agrees_launch_order(st) {
            self.agree_launch_order(st)?;
        }
        // Forwards whose graph outlives this backward count no more.
        self.input_grads.reset();
        // (`partial_due` is kept: the hooks of a bare backward that this
        // end was called from may have filled it already; what is left of
        // this one is dropped when next read.)
        st.prog.partial_runs.fill(0);
        st.prog.bare = false;
        st.micro += 1;
        Ok(())
    }

    /// Whether this engine reduces in an order the ranks agree (see
    /// [`LaunchOrder`]): stage 1 always (its boundary backward reduces in
    /// that order, whatever each rank's loss reached: nothing declares the
    /// parameters some ranks leave out, as stage 1 never needed it while
    /// it reduced in `step()`), stages 0 and 2 when some units are
    /// declared unused on some ranks (their backward issues no collective
    /// but reductions; stage 3's backward gathers too, whose places among
    /// the reductions would still differ, so it reduces such units at the
    /// end of backward).
    fn agrees_launch_order(&self, st: &State) -> bool {
        self.stage == 1 || (matches!(self.stage, 0 | 2) && st.units.iter().any(|u| u.uneven))
    }

    /// Agrees the launch order from the order each rank found units whole
    /// in this backward: gathered over the group, then (hybrid sharding)
    /// over the replicate group, so every rank of the world merges the
    /// same sequences.
    fn agree_launch_order(&self, st: &mut State) -> Result<(), EngineError> {
        let units = st.units.len();
        let mine = LaunchOrder::encode(&st.prog.completed, units);
        let gather = |st: &mut State, g: &G, v: Vec<i64>| {
            waiting(&mut st.timing, || g.all_gather(v, Vec::new()).wait()).map(|(_, all)| all)
        };
        let mut all = gather(st, &self.group, mine)?;
        if let Some(r) = &self.replicate {
            all = gather(st, r, all)?;
        }
        let agreed = LaunchOrder::merge(&LaunchOrder::decode(&all, units), units);
        let names: Vec<&str> = agreed
            .order
            .iter()
            .map(|&k| st.units[k].name.as_str())
            .collect();
        tracing::debug!(
            "units declared unused on some ranks: from here every rank reduces the units in the order {}",
            names.join(", ")
        );
        st.prog.order_agreed = Some(agreed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::RunOrder;

    #[test]
    fn run_order_follows_the_last_complete_forward() {
        let mut o = RunOrder::default();
        // Nothing recorded yet: by index.
        assert_eq!((o.after(3, true), o.after(3, false)), (Some(4), Some(2)));
        assert_eq!(o.after(0, false), None);
        // Wrapped 0, 1, 2 but run 2, 0, 1 (embedding wrapped last, run first).
        for k in [2, 0, 1] {
            o.forward_starts(k);
        }
        // Not complete until its backward begins.
        assert_eq!(o.after(2, true), Some(3));
        o.complete();
        assert_eq!(
            [o.after(2, true), o.after(0, true), o.after(1, true)],
            [Some(0), Some(1), None]
        );
        assert_eq!(
            [o.after(1, false), o.after(0, false), o.after(2, false)],
            [Some(0), Some(2), None]
        );
        assert!(o.runs_last(1) && !o.runs_last(2));
        // Forwards without a backward (evaluation): a unit seen again starts
        // the next forward, which completes the one before.
        for k in [1, 0, 1] {
            o.forward_starts(k);
        }
        assert_eq!(o.after(1, true), Some(0));
        assert!(o.runs_last(0));
        // A unit the last forward did not run falls back to index order.
        assert_eq!(o.after(2, true), Some(3));
        // Run 3, 0, 1, 2 with 3 and 0 frozen (no gradient out of them):
        // forward still goes through them, backward stops after 1.
        o.complete();
        for k in [3, 0, 1, 2] {
            o.forward_starts(k);
            if k == 3 || k == 0 {
                o.without_backward(k);
            }
        }
        o.complete();
        assert_eq!([o.after(3, true), o.after(0, true)], [Some(0), Some(1)]);
        assert_eq!([o.after(2, false), o.after(1, false)], [Some(1), None]);
        // The next forward records afresh: nothing skipped in it.
        for k in [3, 0, 1, 2] {
            o.forward_starts(k);
        }
        o.complete();
        assert_eq!(o.after(1, false), Some(0));
    }
}

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

use std::sync::Arc;

use half::{bf16, f16};
use tch::Tensor;
use zrt_collectives::{chunk_range, ProcessGroup, ReduceOp, Work};
use zrt_kernels::{cast, quant, reduce};

use super::elems::Elems;
pub(super) use super::launch_order::LaunchOrder;
use super::offload::ReadAhead;
use super::pool::{Pool, Pools};
use super::timing::waiting;
use super::{elems, foreign, Compute, CopyShard, Inner, State, Unit};
use crate::flat::FlatLayout;
use crate::{glue, EngineError};

/// A reduction in flight.
pub(super) enum Reduce {
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
pub(super) struct Reduced {
    /// The buffer holding the result (for a reduce-scatter in place, the
    /// whole input: the caller may reuse it).
    pub(super) buf: Vec<f32>,
    range: std::ops::Range<usize>,
}

impl Reduced {
    /// The reduced values.
    pub(super) fn values(&self) -> &[f32] {
        &self.buf[self.range.clone()]
    }
}

impl Reduce {
    /// Waits and returns the result in fp32.
    pub(super) fn wait(self) -> Result<Reduced, EngineError> {
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

/// A gather in flight, with the unit-order check issued before it.
pub(super) struct Prefetch {
    ids: UnitIds,
    /// What `ids` announced: a gather in forward or in backward.
    kind: Kind,
    data: Fetch,
    /// Gathered from the hpZ secondary copies (dropped after), not the
    /// shards.
    secondary: bool,
    /// The unit's sharded frozen parameters, and whether from the shard
    /// (which then comes back) rather than a secondary copy.
    frozen: Option<(Fetch, bool)>,
}

/// ZeRO++ hpZ: the part of a unit's gathered parameters (and of its
/// sharded frozen ones) this rank keeps after forward for its hpZ group's
/// backward gather.
pub(super) struct Secondary {
    unit: Elems,
    frozen: Option<Elems>,
}

/// An all-gather in flight: (this rank's part back, the whole).
pub(super) enum Fetch {
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
pub(super) fn pack<T: quant::Quantizable>(
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
pub(super) fn unpack_all<T: quant::Quantizable>(
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

/// What every rank of a group announced before a unit's collective (an
/// all_gather of [`Kind`], unit index), and the group's size.
pub(super) struct UnitIds {
    work: Work<(Vec<i64>, Vec<i64>)>,
    ranks: usize,
}

/// The kind of collective a rank announces with a unit's index: a gather
/// and a reduction of units of the same size would otherwise match.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    /// A gather outside backward (a forward, with_full_params...).
    Gather = 0,
    Reduce = 1,
    /// A gather for backward: met by a peer's reduction, it means both
    /// ranks are in backward and one finished a unit's gradients early.
    BackwardGather = 2,
}

impl UnitIds {
    /// Announces `kind` of unit `unit` to the group.
    fn issue(g: &impl ProcessGroup, kind: Kind, unit: usize) -> Self {
        Self {
            work: g.all_gather(vec![kind as i64, unit as i64], Vec::new()),
            ranks: g.size(),
        }
    }

    /// Whether every rank's announcement is in (waiting will not block).
    fn done(&self) -> bool {
        self.work.is_done()
    }

    /// Waits for every rank's announcement: `None` when all are this
    /// rank's (`kind`, `unit`), else what each rank announced (`name`
    /// names a unit index). [`EngineError::OutOfStep`] when a peer's call
    /// was not an announcement (see [`super::out_of_step`]).
    fn disagree(
        self,
        kind: Kind,
        unit: usize,
        name: impl Fn(usize) -> String,
    ) -> Result<Option<Disagreement>, EngineError> {
        let mine = [kind as i64, unit as i64];
        let what = || {
            format!(
                "this rank announced {} unit `{}` to its {} ranks",
                match kind {
                    Kind::Gather | Kind::BackwardGather => "the gather of",
                    Kind::Reduce => "the gradient reduction of",
                },
                name(unit),
                self.ranks,
            )
        };
        let all = self.work.wait().map_err(|e| super::out_of_step(e, what))?.1;
        if all.chunks(2).all(|c| c == mine) {
            return Ok(None);
        }
        let kinds = |k: Kind| all.chunks(2).any(|c| c[0] == k as i64);
        let why = match (
            kinds(Kind::Gather),
            kinds(Kind::BackwardGather),
            kinds(Kind::Reduce),
        ) {
            // Every rank in backward, some reducing a unit the others have
            // not finished.
            (false, true, true) => Why::Uneven,
            (true, true, _) | (true, _, true) => Why::DifferentCalls,
            _ => Why::SameKind,
        };
        let names: Vec<String> = all
            .chunks(2)
            .enumerate()
            .map(|(r, c)| {
                let u = usize::try_from(c[1]).map_or("?".into(), &name);
                let verb = match c[0] {
                    x if x == Kind::Reduce as i64 => "reduces",
                    x if x == Kind::BackwardGather as i64 => "runs the backward of",
                    _ => "runs",
                };
                format!("rank {r} {verb} `{u}`")
            })
            .collect();
        let reduced = all
            .chunks(2)
            .filter(|c| c[0] == Kind::Reduce as i64)
            .filter_map(|c| usize::try_from(c[1]).ok())
            .collect();
        Ok(Some(Disagreement {
            names: names.join(", "),
            why,
            reduced,
        }))
    }
}

/// Ranks that announced different collectives at the same point.
#[derive(Debug, PartialEq)]
struct Disagreement {
    /// "rank r runs `unit`" / "rank r reduces `unit`", for every rank.
    names: String,
    /// What the mix of kinds means.
    why: Why,
    /// Units some rank announced the reduction of.
    reduced: Vec<usize>,
}

/// What announcements of different kinds at one point mean.
#[derive(Debug, PartialEq)]
enum Why {
    /// All gathers, or all reductions, of different units: `same_kind`.
    SameKind,
    /// A gather outside backward met a reduction or a backward's gather:
    /// the ranks made different engine calls.
    DifferentCalls,
    /// Reductions met backward's gathers: every rank is in backward, and
    /// some finished a unit's gradients that others have not (a parameter
    /// only some ranks' losses use).
    Uneven,
}

impl Disagreement {
    /// The error: a gather outside backward met by anything else means
    /// different engine calls; reductions met by backward's gathers mean
    /// uneven gradients (`uneven` gets the names and the units some rank
    /// reduced); otherwise `same_kind` explains it.
    fn error(
        self,
        same_kind: impl FnOnce(String) -> EngineError,
        uneven: impl FnOnce(String, &[usize]) -> EngineError,
    ) -> EngineError {
        match self.why {
            Why::DifferentCalls => EngineError::OutOfStep(format!(
                "{}: one rank gathers a unit's parameters while another reduces gradients or runs a backward, so the ranks made different engine calls (a backward on some, with_full_params, a checkpoint or a forward on others)",
                self.names
            )),
            Why::Uneven => uneven(self.names, &self.reduced),
            Why::SameKind => same_kind(self.names),
        }
    }
}

/// Unit `x`'s name, `?` past the last.
fn unit_name(units: &[Unit], x: usize) -> String {
    units.get(x).map_or("?", |u| u.name.as_str()).to_string()
}

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
    /// [`uneven_after_backward`]).
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

    /// Whether an engine backward is under way (forwards run inside it
    /// recompute activations; they are not the model's run order).
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
    /// it at the same point. Not at stage 1, whose backward only adds to
    /// local sums, in any order.
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

    /// Takes unit `k`'s gradients and issues their reduction.
    pub(super) fn launch_reduce(
        &self,
        st: &mut State,
        k: usize,
        free: bool,
    ) -> Result<(), EngineError> {
        let u = &st.units[k];
        // A kept buffer (already paged in) with stale contents: every element
        // is written below, gradients where they exist and zeros elsewhere.
        let mut full = self.pools.f32.take(u.layout.padded, 0.0);
        let mut written = 0;
        for (slot, t) in u.layout.slots.iter().zip(&u.params) {
            full[written..slot.offset].fill(0.0);
            let dst = &mut full[slot.offset..slot.offset + slot.numel];
            let g = t.grad();
            if g.defined() {
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
            self.pools.f32.give(full);
        } else {
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
        }
        st.prog.launched[k] = true;
        if free {
            self.free_if_gathered(st, k)?;
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
    fn wait_for_reductions(&self, st: &mut State) -> Result<(), EngineError> {
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
            None => {
                reduce::accumulate(&self.threads, &mut st.shards[k].g[range], red.values())?;
                st.prog.added.push(k);
            }
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
            reduce::accumulate(&self.threads, &mut st.shards[k].g[range], &v)?;
            st.prog.added.push(k);
        }
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
    pub(super) fn reduce_in_buckets(
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
    pub(super) fn issue_reduce(
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
        // Forwards whose backward did not run (evaluation with autograd on)
        // count no more.
        st.awaiting_input_grad.fill(0);
        // (`partial_due` is kept: the hooks of a bare backward that this
        // end was called from may have filled it already; what is left of
        // this one is dropped when next read.)
        st.prog.partial_runs.fill(0);
        st.prog.bare = false;
        st.micro += 1;
        Ok(())
    }

    /// Waits for every reduction issued so far, in issue order, and adds
    /// them to the gradient shards (under hybrid sharding through their
    /// replicate-group averages). `without` names the parameters this rank
    /// has no gradient for, for the error when the ranks announced
    /// different units.
    fn settle_reductions(
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

    /// Whether this engine reduces in an order the ranks agree (see
    /// [`LaunchOrder`]): some units are declared unused on some ranks, and
    /// backward issues no collective but reductions (stages 0 and 2;
    /// stage 3's backward gathers too, whose places among the reductions
    /// would still differ, so it reduces such units at the end of backward;
    /// stage 1 communicates nothing in backward).
    fn agrees_launch_order(&self, st: &State) -> bool {
        matches!(self.stage, 0 | 2) && st.units.iter().any(|u| u.uneven)
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

    /// A collective of this backward failed with `e`. When a reduction this
    /// rank announced before it shows the ranks disagreeing, that is the
    /// cause (the failure is the collective that followed the
    /// announcement: a reduction on one rank met a gather on another), and
    /// the error says so; otherwise `e`. Only announcements already
    /// answered are read: explaining waits for nothing.
    pub(super) fn explain_failure(&self, st: &mut State, e: EngineError) -> EngineError {
        // A plain `loss.backward()` stays open until the next engine call:
        // the forward after it may be what meets the failure.
        if !st.prog.in_backward() && !st.prog.bare {
            return e;
        }
        for (k, works) in std::mem::take(&mut st.prog.reduce_ids) {
            for w in works.into_iter().take_while(UnitIds::done) {
                let units = &st.units;
                let Ok(Some(d)) = w.disagree(Kind::Reduce, k, |x| unit_name(units, x)) else {
                    continue;
                };
                return uneven_now(st, d);
            }
        }
        e
    }

    /// Issues the unit-order check and the gather of unit `i`'s shard:
    /// packed as int8 under `zero_quantized_weights` unless `exact`
    /// (`with_full_params` and `unshard` hand out the true values).
    pub(super) fn issue_gather(
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
    pub(super) fn keep_secondary(&self, st: &mut State, i: usize) {
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
    pub(super) fn finish_gather(
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
    pub(super) fn gather(&self, st: &mut State, i: usize, exact: bool) -> Result<(), EngineError> {
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
    /// ([`RunOrder::after`]), within the prefetch bounds of the config.
    pub(super) fn prefetch_after(
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
    pub(super) fn drain_prefetch(&self, st: &mut State) -> Result<(), EngineError> {
        for i in 0..st.units.len() {
            if let Some(p) = st.prog.prefetch[i].take() {
                st.prog.counts.unused += 1;
                self.finish_gather(st, i, p, false)?;
            }
        }
        Ok(())
    }
}

/// The error for reductions announced differently mid-backward: the
/// parameters without a gradient so far are those of the units some rank
/// reduced and this one has not.
fn uneven_now(st: &State, d: Disagreement) -> EngineError {
    let reduced = d.reduced.clone();
    let uneven =
        |names: String, reduced: &[usize]| explain_uneven(&names, &without_gradient(st, reduced));
    d.error(|names| uneven(names, &reduced), uneven)
}

/// [`uneven_now`] for a hook that waits for its own unit's reduction
/// (`overlap_comm: false`). A rank ahead of its peers is still in that
/// hook: the units before it in forward have no gradients yet, and naming
/// them as the cause would be wrong. So the error names the parameters
/// without a gradient when it is returned ([`named_after_backward`]),
/// after backward ran on with the hooks disarmed by the error.
fn uneven_after_backward(st: &mut State, d: Disagreement) -> EngineError {
    let reduced = d.reduced.clone();
    // The error stands in for the one returned later, and names no
    // parameter; `kept` is set unless the ranks made different calls.
    let kept = std::cell::Cell::new(None);
    let keep = |names: String| {
        let e = explain_uneven(&names, &[]);
        kept.set(Some(names));
        e
    };
    let e = d.error(keep, |names, _| keep(names));
    if let Some(names) = kept.take() {
        st.prog.uneven_later = Some((names, reduced));
    }
    e
}

/// A collective failed (`e`) while a hook waited for its reductions
/// (`overlap_comm: false`). A gather this rank issued ahead for backward
/// may have met a peer's reduction at its announcement, and the failure is
/// the data collectives that followed (a reduce-scatter against an
/// all-gather): an announcement already answered that shows the ranks
/// disagreeing is the cause, named as [`uneven_after_backward`] names it.
/// Otherwise `e`. Reads only announcements that are done: waits for
/// nothing.
fn explain_by_prefetches(st: &mut State, e: EngineError) -> EngineError {
    for i in 0..st.prog.prefetch.len() {
        if !st.prog.prefetch[i].as_ref().is_some_and(|p| p.ids.done()) {
            continue;
        }
        let Some(p) = st.prog.prefetch[i].take() else {
            continue;
        };
        let units = &st.units;
        if let Ok(Some(d)) = p.ids.disagree(p.kind, i, |x| unit_name(units, x)) {
            return uneven_after_backward(st, d);
        }
    }
    e
}

/// The error a backward's hook kept, as the engine call returns it: an
/// uneven reduction found by a hook that waited for it
/// ([`uneven_after_backward`]) names this rank's parameters without a
/// gradient now, when backward has run.
pub(super) fn named_after_backward(st: &mut State, e: EngineError) -> EngineError {
    match st.prog.uneven_later.take() {
        Some((names, reduced)) => explain_uneven(&names, &without_gradient(st, &reduced)),
        None => e,
    }
}

/// Waits for unit `k`'s reduction announcements (`works`, on the group and
/// the replicate group). Where the ranks disagree nothing of this backward
/// is used: its reductions are dropped unwaited (the workers still run
/// them) and `explain` makes the error.
fn check_announced(
    st: &mut State,
    k: usize,
    works: Vec<UnitIds>,
    explain: impl FnOnce(&mut State, Disagreement) -> EngineError,
) -> Result<(), EngineError> {
    for w in works {
        let units = &st.units;
        let seen = waiting(&mut st.timing, || {
            w.disagree(Kind::Reduce, k, |x| unit_name(units, x))
        });
        let e = match seen {
            Ok(None) => continue,
            Ok(Some(d)) => explain(st, d),
            Err(e) => e,
        };
        drop_reductions(st);
        return Err(e);
    }
    Ok(())
}

/// Drops this backward's reductions unwaited (the workers still run them).
fn drop_reductions(st: &mut State) {
    st.prog.inflight.clear();
    st.prog.replicating.clear();
    st.prog.inflight_elems = 0;
    st.prog.reduce_ids.clear();
}

/// What a gather announces: one for backward, or any other.
fn gather_kind(st: &State) -> Kind {
    match st.prog.in_backward() || st.prog.in_autograd {
        true => Kind::BackwardGather,
        false => Kind::Gather,
    }
}

/// The parameters of `units` without a gradient on this rank (so far in
/// this backward), named for [`explain_uneven`]. A unit this rank has
/// reduced had all of them (and its gradients have moved to its buffer).
fn without_gradient(st: &State, units: &[usize]) -> Vec<(String, String)> {
    let mut seen = std::collections::BTreeSet::new();
    units
        .iter()
        .filter(|&&k| seen.insert(k) && !st.prog.launched.get(k).copied().unwrap_or(true))
        .filter_map(|&k| st.units.get(k))
        .flat_map(|u| {
            u.layout
                .slots
                .iter()
                .zip(&u.params)
                .filter(|(_, t)| !t.grad().defined())
                .map(|(s, _)| (s.name.clone(), u.name.clone()))
        })
        .collect()
}

/// [`EngineError::UnevenGradients`]: `what` the ranks did, why, and this
/// rank's parameters without a gradient (`without`). Each unit is reduced
/// as soon as all its parameters have gradients, so when a parameter some
/// ranks' losses use and others' do not leaves a unit incomplete on some
/// ranks, those ranks reduce it only at the end of backward: the ranks
/// announce their reductions in different orders.
fn explain_uneven(what: &str, without: &[(String, String)]) -> EngineError {
    let here = if without.is_empty() {
        "every parameter got a gradient on this rank; the other ranks' errors name theirs"
            .to_string()
    } else {
        let named: Vec<String> = (without.iter())
            .map(|(p, u)| format!("`{p}` (unit `{u}`)"))
            .collect();
        format!(
            "on this rank no gradient reached {} (to declare them: `{}`)",
            named.join(", "),
            declaration(without)
        )
    };
    EngineError::UnevenGradients(format!(
        "{what}. A unit's gradients are reduced as soon as all its parameters have one, so a parameter that some ranks' losses use and others' do not puts the reductions in different orders: {here}. Declare such parameters with ShardPlan::unused_on_some_ranks (every rank then reduces the units in one agreed order, or at stage 3 at the end of backward) or, when every rank runs their unit and only some of its parameters get no gradient (experts some ranks' tokens never reach), with ShardPlan::partly_unused_on_some_ranks (at stage 3 the unit is then sharded as the others are), freeze them, or run what uses them on every rank, its output times zero where it must not count (adding 0.0 * p.sum() to the loss instead gives a zero gradient at another point of backward, which can leave the order as uneven)"
    ))
}

/// The `ShardPlan::unused_on_some_ranks` call that declares the
/// parameters `without` (name, unit): a wrapped unit by its prefix, the
/// root's parameters by name.
fn declaration(without: &[(String, String)]) -> String {
    let mut tests: Vec<String> = Vec::new();
    for (p, u) in without {
        let test = match u.as_str() {
            "<root>" => format!("name == \"{p}\""),
            _ => format!("name.starts_with(\"{u}.\")"),
        };
        if !tests.contains(&test) {
            tests.push(test);
        }
    }
    format!(
        "plan.unused_on_some_ranks(|name, _| {})?",
        tests.join(" || ")
    )
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

#[cfg(test)]
mod tests {
    use super::{declaration, Disagreement, Kind, RunOrder, UnitIds, Why};
    use zrt_collectives::{local, ProcessGroup};

    /// Each of two ranks announces (kind, unit); what rank 0 makes of it.
    fn announce(a: (Kind, usize), b: (Kind, usize)) -> Result<Option<Disagreement>, String> {
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = local::world(2)
                .into_iter()
                .zip([a, b])
                .map(|(r, (kind, unit))| {
                    s.spawn(move || {
                        let g = r.new_group(&[0, 1]).map_err(|e| e.to_string())?;
                        let name = |x: usize| ["a", "b"].get(x).unwrap_or(&"?").to_string();
                        UnitIds::issue(&g, kind, unit)
                            .disagree(kind, unit, name)
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        out.into_iter().next().unwrap()
    }

    #[test]
    fn announcements_name_what_each_rank_does() {
        assert_eq!(announce((Kind::Gather, 1), (Kind::Gather, 1)), Ok(None));
        let d = |names: &str, why, reduced: &[usize]| {
            Ok(Some(Disagreement {
                names: names.into(),
                why,
                reduced: reduced.to_vec(),
            }))
        };
        assert_eq!(
            announce((Kind::Gather, 0), (Kind::Gather, 1)),
            d("rank 0 runs `a`, rank 1 runs `b`", Why::SameKind, &[])
        );
        assert_eq!(
            announce((Kind::Reduce, 1), (Kind::Reduce, 0)),
            d(
                "rank 0 reduces `b`, rank 1 reduces `a`",
                Why::SameKind,
                &[1, 0]
            )
        );
        // Same unit, same size: only the kind tells a gather from a
        // reduction.
        let mixed = announce((Kind::Reduce, 1), (Kind::Gather, 1));
        assert_eq!(
            mixed,
            d(
                "rank 0 reduces `b`, rank 1 runs `b`",
                Why::DifferentCalls,
                &[1]
            )
        );
        let e = mixed
            .unwrap()
            .unwrap()
            .error(|_| unreachable!(), |_, _| unreachable!())
            .to_string();
        assert!(
            e.contains("one rank gathers a unit's parameters while another reduces gradients or runs a backward, so the ranks made different engine calls"),
            "{e}"
        );
        // A gather outside backward against one for backward: different
        // calls too.
        assert_eq!(
            announce((Kind::Gather, 0), (Kind::BackwardGather, 0))
                .unwrap()
                .unwrap()
                .why,
            Why::DifferentCalls
        );
        // A reduction against a backward's gather: both ranks are in
        // backward, one reduces a unit the other has not finished.
        let uneven = announce((Kind::BackwardGather, 0), (Kind::Reduce, 1));
        assert_eq!(
            uneven,
            d(
                "rank 0 runs the backward of `a`, rank 1 reduces `b`",
                Why::Uneven,
                &[1]
            )
        );
        let e = uneven
            .unwrap()
            .unwrap()
            .error(
                |_| unreachable!(),
                |names, reduced| {
                    assert_eq!(reduced, [1]);
                    crate::EngineError::UnevenGradients(names)
                },
            )
            .to_string();
        assert!(e.contains("rank 1 reduces `b`"), "{e}");
    }

    #[test]
    fn an_announcement_met_by_another_all_gather_is_an_error() {
        // Both are all_gathers of i64: only their lengths differ.
        let mut ranks = local::world(2).into_iter();
        let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
        let other = std::thread::spawn(move || {
            let g = r1.new_group(&[0, 1]).unwrap();
            g.all_gather(vec![7i64; 3], Vec::new()).wait().unwrap_err()
        });
        let g = r0.new_group(&[0, 1]).unwrap();
        let e = UnitIds::issue(&g, Kind::Reduce, 0)
            .disagree(Kind::Reduce, 0, |_| "a".into())
            .unwrap_err()
            .to_string();
        other.join().unwrap();
        assert!(
            e.starts_with("ranks out of step: this rank announced the gradient reduction of unit `a` to its 2 ranks, and another rank made a different collective call here")
                && e.contains("rank 0 called all_gather(i64 x 2) but rank 1 called all_gather(i64 x 3)"),
            "{e}"
        );
    }

    #[test]
    fn the_declaration_suggested_names_wrapped_units_by_prefix_and_the_roots_parameters_by_name() {
        let without = [("ln_f.bias", "<root>"), ("h.0.a", "h.0"), ("h.0.b", "h.0")]
            .map(|(p, u)| (p.to_string(), u.to_string()));
        assert_eq!(
            declaration(&without),
            r#"plan.unused_on_some_ranks(|name, _| name == "ln_f.bias" || name.starts_with("h.0."))?"#
        );
    }

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

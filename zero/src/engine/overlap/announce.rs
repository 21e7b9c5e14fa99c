//! The unit-order check: before each unit's collective every rank
//! announces (kind, unit), so ranks that reach different collectives
//! (different engine calls, or a parameter only some ranks' losses use)
//! get an error naming what each rank does, and the parameters a
//! declaration would name, instead of a reduction of mismatched units.

use zrt_collectives::{ProcessGroup, Work};

use crate::engine::timing::waiting;
use crate::engine::{Inner, State, Unit};
use crate::EngineError;

use super::reductions::drop_reductions;

/// What every rank of a group announced before a unit's collective (an
/// all_gather of [`Kind`], unit index), and the group's size.
pub(in crate::engine) struct UnitIds {
    pub(super) work: Work<(Vec<i64>, Vec<i64>)>,
    pub(super) ranks: usize,
}

/// The kind of collective a rank announces with a unit's index: a gather
/// and a reduction of units of the same size would otherwise match.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(in crate::engine) enum Kind {
    /// A gather outside backward (a forward, with_full_params...).
    Gather = 0,
    Reduce = 1,
    /// A gather for backward: met by a peer's reduction, it means both
    /// ranks are in backward and one finished a unit's gradients early.
    BackwardGather = 2,
}

impl UnitIds {
    /// Announces `kind` of unit `unit` to the group.
    pub(super) fn issue(g: &impl ProcessGroup, kind: Kind, unit: usize) -> Self {
        Self {
            work: g.all_gather(vec![kind as i64, unit as i64], Vec::new()),
            ranks: g.size(),
        }
    }

    /// Whether every rank's announcement is in (waiting will not block).
    pub(super) fn done(&self) -> bool {
        self.work.is_done()
    }

    /// Waits for every rank's announcement: `None` when all are this
    /// rank's (`kind`, `unit`), else what each rank announced (`name`
    /// names a unit index). [`EngineError::OutOfStep`] when a peer's call
    /// was not an announcement (see [`crate::engine::out_of_step`]).
    pub(super) fn disagree(
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
        let all = self
            .work
            .wait()
            .map_err(|e| crate::engine::out_of_step(e, what))?
            .1;
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
pub(super) struct Disagreement {
    /// "rank r runs `unit`" / "rank r reduces `unit`", for every rank.
    pub(super) names: String,
    /// What the mix of kinds means.
    why: Why,
    /// Units some rank announced the reduction of.
    pub(super) reduced: Vec<usize>,
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
    pub(super) fn error(
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
pub(super) fn unit_name(units: &[Unit], x: usize) -> String {
    units.get(x).map_or("?", |u| u.name.as_str()).to_string()
}

/// The error for reductions announced differently mid-backward: the
/// parameters without a gradient so far are those of the units some rank
/// reduced and this one has not.
pub(super) fn uneven_now(st: &State, d: Disagreement) -> EngineError {
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
pub(super) fn uneven_after_backward(st: &mut State, d: Disagreement) -> EngineError {
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
pub(super) fn explain_by_prefetches(st: &mut State, e: EngineError) -> EngineError {
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
pub(in crate::engine) fn named_after_backward(st: &mut State, e: EngineError) -> EngineError {
    match st.prog.uneven_later.take() {
        Some((names, reduced)) => explain_uneven(&names, &without_gradient(st, &reduced)),
        None => e,
    }
}

/// Waits for unit `k`'s reduction announcements (`works`, on the group and
/// the replicate group). Where the ranks disagree nothing of this backward
/// is used: its reductions are dropped unwaited (the workers still run
/// them) and `explain` makes the error.
pub(super) fn check_announced(
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

/// The parameters of `units` without a gradient on this rank (so far in
/// this backward), named for [`explain_uneven`]. A unit this rank has
/// reduced had all of them (and its gradients have moved to its buffer).
pub(super) fn without_gradient(st: &State, units: &[usize]) -> Vec<(String, String)> {
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
pub(super) fn explain_uneven(what: &str, without: &[(String, String)]) -> EngineError {
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

impl<G: ProcessGroup + 'static> Inner<G> {
    /// A collective of this backward failed with `e`. When a reduction this
    /// rank announced before it shows the ranks disagreeing, that is the
    /// cause (the failure is the collective that followed the
    /// announcement: a reduction on one rank met a gather on another), and
    /// the error says so; otherwise `e`. Only announcements already
    /// answered are read: explaining waits for nothing.
    pub(in crate::engine) fn explain_failure(&self, st: &mut State, e: EngineError) -> EngineError {
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
}

#[cfg(test)]
mod tests {
    use super::{declaration, Disagreement, Kind, UnitIds, Why};
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
}

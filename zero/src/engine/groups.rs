//! Settings by parameter: which parameters the program left out of weight
//! decay ([`ShardPlan::exclude_from_weight_decay`]), whose learning rate it
//! scales ([`ShardPlan::scale_learning_rate`]), which ones some ranks
//! may not use ([`ShardPlan::unused_on_some_ranks`]) and which Muon steps
//! ([`ShardPlan::use_muon`]); where the optimizer's
//! lie in a unit's flat buffer, and how a range of the buffer splits into
//! runs of elements the optimizer treats alike.
//!
//! DeepSpeed and PyTorch get this from the optimizer's parameter groups. A
//! flat buffer mixes parameters of every group, so the Adam kernel runs
//! once per run, each with its own weight decay and learning rate; a model
//! whose parameters are all treated alike runs it once per range, as
//! before.
//!
//! [`ShardPlan::exclude_from_weight_decay`]: crate::ShardPlan::exclude_from_weight_decay
//! [`ShardPlan::scale_learning_rate`]: crate::ShardPlan::scale_learning_rate
//! [`ShardPlan::unused_on_some_ranks`]: crate::ShardPlan::unused_on_some_ranks
//! [`ShardPlan::use_muon`]: crate::ShardPlan::use_muon

use std::collections::BTreeMap;
use std::ops::Range;

use zrt_kernels::{AdamConfig, ComputeCopy};

use crate::flat::FlatLayout;
use crate::{EngineError, ShardPlan};

/// How the optimizer (and the gradients' reduction) treats one parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Setting {
    /// Whether `optimizer.params.weight_decay` applies to it.
    pub(super) decays: bool,
    /// What the schedule's learning rate is multiplied by for it.
    pub(super) lr_scale: f64,
    /// Some ranks' losses may not use it: its unit is reduced at the end
    /// of backward.
    pub(super) uneven: bool,
    /// Some ranks' losses may not use it, in a unit every rank runs
    /// ([`ShardPlan::partly_unused_on_some_ranks`]).
    ///
    /// [`ShardPlan::partly_unused_on_some_ranks`]: crate::ShardPlan::partly_unused_on_some_ranks
    pub(super) partial: bool,
    /// Muon's half steps it (`optimizer.type: "Muon"`,
    /// [`ShardPlan::use_muon`]); false under every other optimizer.
    ///
    /// [`ShardPlan::use_muon`]: crate::ShardPlan::use_muon
    pub(super) muon: bool,
}

impl Setting {
    /// What a parameter no rule names gets: decay, the schedule's rate,
    /// used by every rank.
    pub(super) const PLAIN: Setting = Setting {
        decays: true,
        lr_scale: 1.0,
        uneven: false,
        partial: false,
        muon: false,
    };

    /// What of it the optimizer sees (the reduction's part left plain).
    fn optimizer(self) -> Setting {
        Setting {
            uneven: false,
            partial: false,
            ..self
        }
    }

    /// `base` (this step's settings) as this parameter gets them.
    pub(super) fn adam(&self, base: &AdamConfig) -> AdamConfig {
        AdamConfig {
            lr: base.lr * self.lr_scale,
            weight_decay: if self.decays { base.weight_decay } else { 0.0 },
            ..*base
        }
    }

    /// How the ranks' agreement check describes a trained parameter.
    pub(super) fn role(&self) -> String {
        let mut role = "trained".to_string();
        if !self.decays {
            role.push_str(", no weight decay");
        }
        if self.lr_scale != 1.0 {
            role.push_str(&format!(", learning rate x{}", self.lr_scale));
        }
        if self.muon {
            role.push_str(", Muon");
        }
        if self.uneven {
            role.push_str(", unused on some ranks");
        } else if self.partial {
            role.push_str(", unused on some ranks in a unit every rank runs");
        }
        role
    }
}

/// How the optimizer treats each trainable parameter that a rule of the
/// plan names, by VarStore name, and which frozen ones some ranks may not
/// use (stage 3 gathers a unit's frozen part too). Built once when the
/// engine is built, each rule asked once per parameter, so the ranks'
/// agreement check, the layout and checkpoints see the same answers.
/// Beside them, the parameters of fewer than two dimensions the Muon rule
/// chose, with their shapes, for [`Settings::check`] to refuse.
#[derive(Debug, Default)]
pub(super) struct Settings(BTreeMap<String, Setting>, Vec<(String, Vec<i64>)>);

impl Settings {
    /// The settings `plan`'s rules give the variables of `vs` (the frozen
    /// ones are asked [`ShardPlan::unused_on_some_ranks`]'s rule only);
    /// with `muon` (the optimizer is Muon) also which ones Muon steps:
    /// [`ShardPlan::use_muon`]'s, else [`hidden_matrix`]'s.
    ///
    /// [`ShardPlan::unused_on_some_ranks`]: crate::ShardPlan::unused_on_some_ranks
    /// [`ShardPlan::use_muon`]: crate::ShardPlan::use_muon
    pub(super) fn of(plan: &ShardPlan, vs: &tch::nn::VarStore, muon: bool) -> Self {
        let (no_decay, lr_scale) = (plan.decay_rule(), plan.lr_rule());
        let (uneven, partial) = (plan.uneven_rule(), plan.partial_rule());
        let muon_rule = plan.muon_rule();
        let mut out = BTreeMap::new();
        let mut flat = Vec::new();
        for (name, t) in vs.variables() {
            let shape = t.size();
            if !t.requires_grad() {
                if uneven.as_ref().is_some_and(|r| r(&name, &shape)) {
                    let this = Setting {
                        uneven: true,
                        ..Setting::PLAIN
                    };
                    out.insert(name, this);
                }
                continue;
            }
            let this = Setting {
                decays: !no_decay.as_ref().is_some_and(|r| r(&name, &shape)),
                lr_scale: lr_scale.as_ref().map_or(1.0, |r| r(&name, &shape)),
                uneven: uneven.as_ref().is_some_and(|r| r(&name, &shape)),
                partial: partial.as_ref().is_some_and(|r| r(&name, &shape)),
                muon: muon
                    && match &muon_rule {
                        Some(r) => r(&name, &shape),
                        None => hidden_matrix(&name, &shape),
                    },
            };
            if this.muon && shape.len() < 2 {
                flat.push((name.clone(), shape.clone()));
            }
            if this != Setting::PLAIN {
                out.insert(name, this);
            }
        }
        Self(out, flat)
    }

    /// The parameters Muon steps, sorted (what a checkpoint records).
    pub(super) fn muon(&self) -> Vec<String> {
        (self.0.iter())
            .filter(|(_, s)| s.muon)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// How the optimizer treats the parameter `name`.
    pub(super) fn get(&self, name: &str) -> Setting {
        self.0.get(name).copied().unwrap_or(Setting::PLAIN)
    }

    /// The parameters weight decay leaves out, sorted (what a checkpoint
    /// records).
    pub(super) fn excluded(&self) -> Vec<String> {
        // A BTreeMap's keys come sorted.
        (self.0.iter())
            .filter(|(_, s)| !s.decays)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The parameters whose learning rate is scaled, with their scales
    /// (what a checkpoint records).
    pub(super) fn lr_scales(&self) -> BTreeMap<String, f64> {
        (self.0.iter())
            .filter(|(_, s)| s.lr_scale != 1.0)
            .map(|(n, s)| (n.clone(), s.lr_scale))
            .collect()
    }

    /// Refuses a Muon parameter of fewer than two dimensions, and a
    /// learning-rate scale that is not a finite number of at least zero,
    /// naming the first parameter (by name) given one.
    pub(super) fn check(&self) -> Result<(), EngineError> {
        if let Some((name, shape)) = self.1.first() {
            return Err(EngineError::Plan(format!(
                "ShardPlan::use_muon chose `{name}` of shape {shape:?} for Muon, which orthogonalizes matrices: a Muon parameter needs at least two dimensions; leave it to the AdamW half (the rule's answer false)"
            )));
        }
        for (name, s) in &self.0 {
            let s = s.lr_scale;
            if !(s.is_finite() && s >= 0.0) {
                return Err(EngineError::Plan(format!(
                    "ShardPlan::scale_learning_rate gave `{name}` the scale {s}: a scale multiplies the schedule's learning rate and must be a finite number of at least 0 (1 leaves the parameter at the schedule's rate)"
                )));
            }
        }
        Ok(())
    }
}

/// Muon's default choice ([`ShardPlan::use_muon`] says it): a parameter
/// of two or more dimensions that is not an embedding or the head, by
/// the names models give those (a part of the name containing `embed`,
/// or one that is `wte`, `wpe`, `head` or `lm_head`), the split Muon's
/// authors, nanochat and most Muon recipes make by name.
///
/// [`ShardPlan::use_muon`]: crate::ShardPlan::use_muon
pub(super) fn hidden_matrix(name: &str, shape: &[i64]) -> bool {
    let outer = |part: &str| {
        part.to_ascii_lowercase().contains("embed")
            || ["wte", "wpe", "head", "lm_head"].contains(&part)
    };
    shape.len() >= 2 && !name.split('.').any(outer)
}

/// The element ranges of `layout`'s flat buffer whose parameters are not
/// treated plainly (`setting(name)`), in order, adjacent ones of one
/// setting merged. A range runs on over the alignment padding after
/// its parameter (zeros, which every setting leaves at zero), so that
/// neighbours treated alike make one range.
pub(super) fn special_ranges(
    layout: &FlatLayout,
    setting: impl Fn(&str) -> Setting,
) -> Vec<(Range<usize>, Setting)> {
    let mut slots: Vec<_> = layout.slots.iter().collect();
    slots.sort_by_key(|s| s.offset);
    let mut out: Vec<(Range<usize>, Setting)> = Vec::new();
    for (i, s) in slots.iter().enumerate() {
        let this = setting(&s.name).optimizer();
        let end = slots.get(i + 1).map_or(layout.padded, |n| n.offset);
        // A parameter of no elements shares its offset with the next.
        if this == Setting::PLAIN || end == s.offset {
            continue;
        }
        match out.last_mut() {
            Some((last, was)) if last.end == s.offset && *was == this => last.end = end,
            _ => out.push((s.offset..end, this)),
        }
    }
    out
}

/// Up to five names in backticks, then how many more.
fn some_of(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    match names.len() {
        0 => "none".to_string(),
        n if n > 5 => format!("{} and {} more", shown.join(", "), n - 5),
        _ => shown.join(", "),
    }
}

/// What a resumed run changes in weight decay: `None` when the parameters
/// the checkpoint's run left out (`saved`) are the ones this engine
/// leaves out (`now`, both sorted), else the warning to log. Changing the
/// rule on resume is allowed, as changing `weight_decay` in the config
/// is, but never silent.
pub(super) fn changed(saved: &[String], now: &[String]) -> Option<String> {
    if saved == now {
        return None;
    }
    Some(format!(
        "the checkpoint's run left {} parameter(s) out of weight decay, this engine's plan leaves out {}: from here on weight decay follows the plan (now left out: {}; now decayed: {}). If that is not meant, give the plan the rule the run had (ShardPlan::exclude_from_weight_decay)",
        saved.len(),
        now.len(),
        some_of(&only_in(now, saved)),
        some_of(&only_in(saved, now)),
    ))
}

/// The names of `names` not in `other` (sorted), each in backticks.
fn only_in(names: &[String], other: &[String]) -> Vec<String> {
    (names.iter())
        .filter(|n| other.binary_search(n).is_err())
        .map(|n| format!("`{n}`"))
        .collect()
}

/// Why a Muon checkpoint's state does not fit this engine's: `None` when
/// Muon stepped the same parameters in the checkpoint's run (`saved`) as
/// in this one (`now`, both sorted), else what differs, naming them. A
/// Muon parameter's `m` is its momentum buffer and its `v` zero; AdamW's
/// are its moments: one read as the other would train on the wrong
/// state, so a full load refuses it.
pub(super) fn muon_changed(saved: &[String], now: &[String]) -> Option<String> {
    if saved == now {
        return None;
    }
    Some(format!(
        "Muon stepped {} parameter(s) in the checkpoint's run and steps {} in this one (Muon's now, AdamW's then: {}; AdamW's now, Muon's then: {})",
        saved.len(),
        now.len(),
        some_of(&only_in(now, saved)),
        some_of(&only_in(saved, now)),
    ))
}

/// What a resumed run changes in learning-rate scales: `None` when every
/// parameter has the scale it had in the checkpoint's run (`saved`; a
/// parameter absent has scale 1), else the warning to log, naming each
/// parameter whose scale changed, with both scales.
pub(super) fn lr_changed(
    saved: &BTreeMap<String, f64>,
    now: &BTreeMap<String, f64>,
) -> Option<String> {
    let scale = |m: &BTreeMap<String, f64>, n: &str| m.get(n).copied().unwrap_or(1.0);
    let mut names: Vec<&String> = saved.keys().chain(now.keys()).collect();
    names.sort();
    names.dedup();
    let moved: Vec<String> = names
        .into_iter()
        .filter(|n| scale(saved, n) != scale(now, n))
        .map(|n| format!("`{n}` x{} -> x{}", scale(saved, n), scale(now, n)))
        .collect();
    if moved.is_empty() {
        return None;
    }
    Some(format!(
        "the checkpoint's run scaled the learning rate of {} parameter(s), this engine's plan scales {}: from here on the plan's scales apply ({} changed: {}). If that is not meant, give the plan the rule the run had (ShardPlan::scale_learning_rate)",
        saved.values().filter(|s| **s != 1.0).count(),
        now.values().filter(|s| **s != 1.0).count(),
        moved.len(),
        some_of(&moved),
    ))
}

/// `whole` (a range of the flat buffer) cut where it enters or leaves a
/// `special` range: `(length, setting)` for each run, in order, none
/// empty, lengths summing to `whole`'s.
pub(super) fn runs(
    whole: Range<usize>,
    special: &[(Range<usize>, Setting)],
) -> Vec<(usize, Setting)> {
    let mut out = Vec::new();
    let mut at = whole.start;
    for (e, setting) in special {
        if e.end <= at {
            continue;
        }
        if e.start >= whole.end {
            break;
        }
        if e.start > at {
            out.push((e.start - at, Setting::PLAIN));
            at = e.start;
        }
        let end = e.end.min(whole.end);
        out.push((end - at, *setting));
        at = end;
    }
    if at < whole.end {
        out.push((whole.end - at, Setting::PLAIN));
    }
    out
}

/// Splits a compute copy destination at `mid`, as `split_at_mut` does.
pub(super) fn split_copy(c: ComputeCopy<'_>, mid: usize) -> (ComputeCopy<'_>, ComputeCopy<'_>) {
    match c {
        ComputeCopy::None => (ComputeCopy::None, ComputeCopy::None),
        ComputeCopy::Bf16(d) => {
            let (a, b) = d.split_at_mut(mid);
            (ComputeCopy::Bf16(a), ComputeCopy::Bf16(b))
        }
        ComputeCopy::F16(d) => {
            let (a, b) = d.split_at_mut(mid);
            (ComputeCopy::F16(a), ComputeCopy::F16(b))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn muon_by_default_takes_matrices_but_not_embeddings_or_heads() {
        for (name, shape, muon) in [
            ("h.0.qkv.weight", &[96i64, 32][..], true),
            ("layers.3.conv.weight", &[8, 3, 3, 3], true),
            ("h.0.ln1.weight", &[32], false),
            ("h.0.qkv.bias", &[96], false),
            ("wte.weight", &[64, 32], false),
            ("wpe.weight", &[16, 32], false),
            ("head.weight", &[64, 32], false),
            ("lm_head.weight", &[64, 32], false),
            ("model.embed_tokens.weight", &[64, 32], false),
            ("bert.embeddings.word_embeddings.weight", &[64, 32], false),
            ("tok_Embeddings.weight", &[64, 32], false),
            // A head of attention is no model head.
            ("h.0.attn.heads.weight", &[32, 32], true),
        ] {
            assert_eq!(hidden_matrix(name, shape), muon, "{name}");
        }
    }

    #[test]
    fn a_changed_rule_names_what_is_now_left_out_and_now_decayed() {
        let same = names(&["a.bias", "b.bias"]);
        assert_eq!(changed(&same, &same), None);
        let w = changed(&names(&["a.bias", "b.bias"]), &names(&["b.bias", "c.bias"])).unwrap();
        assert!(
            w.starts_with("the checkpoint's run left 2 parameter(s) out of weight decay, this engine's plan leaves out 2: from here on weight decay follows the plan (now left out: `c.bias`; now decayed: `a.bias`)"),
            "{w}"
        );
        // Five are listed whole, a sixth is counted.
        let five = names(&["p1", "p2", "p3", "p4", "p5"]);
        let w = changed(&five, &[]).unwrap();
        assert!(
            w.contains("(now left out: none; now decayed: `p1`, `p2`, `p3`, `p4`, `p5`)"),
            "{w}"
        );
        let six = names(&["p1", "p2", "p3", "p4", "p5", "p6"]);
        let w = changed(&[], &six).unwrap();
        assert!(
            w.contains(
                "(now left out: `p1`, `p2`, `p3`, `p4`, `p5` and 1 more; now decayed: none)"
            ),
            "{w}"
        );
    }

    /// Left out of weight decay, at the schedule's rate.
    const OUT: Setting = Setting {
        decays: false,
        lr_scale: 1.0,
        ..Setting::PLAIN
    };

    /// `runs` with each run's setting as whether it decays.
    fn decays(whole: Range<usize>, ex: &[Range<usize>]) -> Vec<(usize, bool)> {
        let special: Vec<_> = ex.iter().map(|r| (r.clone(), OUT)).collect();
        runs(whole, &special)
            .into_iter()
            .map(|(n, s)| (n, s.decays))
            .collect()
    }

    #[test]
    fn a_range_is_cut_where_it_enters_and_leaves_the_excluded_ranges() {
        let ex = [2..4, 6..7, 9..12];
        assert_eq!(
            decays(0..12, &ex),
            [
                (2, true),
                (2, false),
                (2, true),
                (1, false),
                (2, true),
                (3, false)
            ]
        );
        // Ranges cut by a shard's bounds.
        assert_eq!(
            decays(3..10, &ex),
            [(1, false), (2, true), (1, false), (2, true), (1, false)]
        );
        assert_eq!(decays(4..6, &ex), [(2, true)]);
        // No empty runs where a range starts or ends with an excluded one.
        assert_eq!(decays(2..7, &ex), [(2, false), (2, true), (1, false)]);
        assert_eq!(decays(10..11, &ex), [(1, false)]);
        assert_eq!(decays(0..12, &[]), [(12, true)]);
        assert_eq!(decays(5..5, &ex), []);
        assert_eq!(decays(12..20, &ex), [(8, true)]);
    }

    #[test]
    fn neighbouring_ranges_of_different_settings_make_separate_runs() {
        let half = Setting {
            decays: true,
            lr_scale: 0.5,
            ..Setting::PLAIN
        };
        let special = [(2..4, OUT), (4..6, half), (8..9, half)];
        assert_eq!(
            runs(0..10, &special),
            [
                (2, Setting::PLAIN),
                (2, OUT),
                (2, half),
                (2, Setting::PLAIN),
                (1, half),
                (1, Setting::PLAIN)
            ]
        );
        assert_eq!(runs(3..5, &special), [(1, OUT), (1, half)]);
    }

    #[test]
    fn a_setting_scales_the_rate_and_drops_the_decay_it_names() {
        let base = AdamConfig {
            lr: 0.25,
            weight_decay: 0.1,
            ..AdamConfig::default()
        };
        let both = Setting {
            decays: false,
            lr_scale: 0.5,
            ..Setting::PLAIN
        };
        let a = both.adam(&base);
        assert_eq!((a.lr, a.weight_decay, a.beta2), (0.125, 0.0, base.beta2));
        let a = Setting::PLAIN.adam(&base);
        assert_eq!((a.lr, a.weight_decay), (0.25, 0.1));
        assert_eq!(Setting::PLAIN.role(), "trained");
        assert_eq!(both.role(), "trained, no weight decay, learning rate x0.5");
    }

    /// A VarStore of trained vectors `names` and a frozen one, `frozen`.
    fn store(names: &[&str]) -> tch::nn::VarStore {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        for n in names {
            let _ = vs.root().zeros(n, &[2]);
        }
        let _ = vs.root().zeros_no_train("frozen", &[3]);
        vs
    }

    #[test]
    fn settings_hold_what_the_rules_give_each_trained_parameter() {
        let plan = ShardPlan::new();
        let vs = store(&["a", "b", "c"]);
        assert!(Settings::of(&plan, &vs, false).0.is_empty());
        plan.exclude_from_weight_decay(|name, shape| name != "a" && shape == [2])
            .unwrap();
        plan.scale_learning_rate(|name, _| if name == "c" { 0.5 } else { 1.0 })
            .unwrap();
        let s = Settings::of(&plan, &vs, false);
        // Plain ones are not kept; frozen ones are not asked about.
        assert_eq!(s.0.keys().collect::<Vec<_>>(), ["b", "c"]);
        assert_eq!(s.get("a"), Setting::PLAIN);
        assert_eq!(s.get("b"), OUT);
        let c = Setting {
            decays: false,
            lr_scale: 0.5,
            ..Setting::PLAIN
        };
        assert_eq!((s.get("c"), s.get("frozen")), (c, Setting::PLAIN));
    }

    #[test]
    fn a_parameter_unused_on_some_ranks_is_named_so_and_left_plain_for_the_optimizer() {
        let plan = ShardPlan::new();
        plan.unused_on_some_ranks(|name, _| name == "b" || name == "frozen")
            .unwrap();
        plan.scale_learning_rate(|name, _| if name == "c" { 0.5 } else { 1.0 })
            .unwrap();
        let s = Settings::of(&plan, &store(&["a", "b", "c"]), false);
        let b = s.get("b");
        assert!(b.uneven && !s.get("a").uneven && !s.get("c").uneven);
        assert_eq!(b.role(), "trained, unused on some ranks");
        // Frozen ones are asked too: stage 3 gathers them with their unit.
        assert!(s.get("frozen").uneven);
        // The optimizer treats it plainly: no run of its own.
        let layout = FlatLayout::new(
            vec![
                ("a".into(), vec![2]),
                ("b".into(), vec![2]),
                ("c".into(), vec![2]),
            ],
            1,
        );
        let special = special_ranges(&layout, |n| s.get(n));
        assert_eq!(special.len(), 1, "{special:?}");
        assert_eq!(special[0].1.lr_scale, 0.5);
    }

    #[test]
    fn a_scale_that_is_negative_or_not_finite_is_refused_by_name() {
        let plan = ShardPlan::new();
        plan.scale_learning_rate(|name, _| match name {
            "a" | "frozen" => f64::NAN,
            "b" => -0.5,
            "c" => 0.0,
            _ => 1.0,
        })
        .unwrap();
        assert!(Settings::of(&plan, &store(&["c", "d"]), false)
            .check()
            .is_ok());
        let e = Settings::of(&plan, &store(&["b", "c"]), false)
            .check()
            .unwrap_err();
        assert!(
            e.to_string().contains(
                "ShardPlan::scale_learning_rate gave `b` the scale -0.5: a scale multiplies the schedule's learning rate and must be a finite number of at least 0"
            ),
            "{e}"
        );
        let e = Settings::of(&plan, &store(&["b", "a"]), false)
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("gave `a` the scale NaN"), "{e}");
    }

    #[test]
    fn a_changed_scale_names_the_parameter_and_both_scales() {
        let map = |v: &[(&str, f64)]| -> BTreeMap<String, f64> {
            v.iter().map(|(n, s)| (n.to_string(), *s)).collect()
        };
        let saved = map(&[("a", 0.5), ("b", 2.0)]);
        assert_eq!(lr_changed(&saved, &saved), None);
        // A scale of 1 written out is a scale of 1 left out.
        assert_eq!(
            lr_changed(&saved, &map(&[("a", 0.5), ("b", 2.0), ("c", 1.0)])),
            None
        );
        let w = lr_changed(&saved, &map(&[("a", 0.25), ("c", 3.0)])).unwrap();
        assert!(
            w.starts_with("the checkpoint's run scaled the learning rate of 2 parameter(s), this engine's plan scales 2: from here on the plan's scales apply (3 changed: `a` x0.5 -> x0.25, `b` x2 -> x1, `c` x1 -> x3)"),
            "{w}"
        );
        let six = map(&[
            ("p1", 2.0),
            ("p2", 2.0),
            ("p3", 2.0),
            ("p4", 2.0),
            ("p5", 2.0),
            ("p6", 2.0),
        ]);
        let w = lr_changed(&BTreeMap::new(), &six).unwrap();
        assert!(w.contains("(6 changed: `p1` x1 -> x2, `p2` x1 -> x2, `p3` x1 -> x2, `p4` x1 -> x2, `p5` x1 -> x2 and 1 more)"), "{w}");
    }

    #[test]
    fn parameters_not_treated_plainly_become_merged_ranges_of_the_flat_buffer() {
        let layout = FlatLayout::new(
            vec![
                ("w1".into(), vec![3, 2]),
                ("b1".into(), vec![3]),
                ("g1".into(), vec![2]),
                ("w2".into(), vec![2, 2]),
                ("b2".into(), vec![5]),
            ],
            2,
        );
        // Slots go by name, each aligned: b1 b2 g1 w1 w2.
        let at = |n: &str| layout.slots.iter().find(|s| s.name == n).unwrap().offset;
        let names = ["b1", "b2", "g1", "w1", "w2"];
        assert!(names.windows(2).all(|w| at(w[0]) < at(w[1])));
        let out = |yes: bool| if yes { OUT } else { Setting::PLAIN };
        // The vectors are next to each other: one range, to w1.
        let ex = special_ranges(&layout, |n| out(n != "w1" && n != "w2"));
        assert_eq!(ex, vec![(0..at("w1"), OUT)]);
        assert!(special_ranges(&layout, |_| Setting::PLAIN).is_empty());
        assert_eq!(
            special_ranges(&layout, |n| out(n == "w1")),
            vec![(at("w1")..at("w2"), OUT)]
        );
        // The last runs on to the end of the buffer.
        assert_eq!(
            special_ranges(&layout, |n| out(n.starts_with('b') || n == "w2")),
            [(0..at("g1"), OUT), (at("w2")..layout.padded, OUT)]
        );
        assert!(layout.padded > at("w2") + 4);
        // Neighbours of different settings are not merged.
        let half = Setting {
            decays: false,
            lr_scale: 0.5,
            ..Setting::PLAIN
        };
        assert_eq!(
            special_ranges(&layout, |n| match n {
                "b1" => OUT,
                "b2" | "g1" => half,
                _ => Setting::PLAIN,
            }),
            [(0..at("b2"), OUT), (at("b2")..at("w1"), half)]
        );
    }

    #[test]
    fn a_parameter_of_no_elements_makes_no_range() {
        let layout = FlatLayout::new(vec![("a".into(), vec![0]), ("b".into(), vec![3])], 2);
        assert_eq!(layout.slots[0].offset, layout.slots[1].offset);
        let out = |n: &str| if n == "a" { OUT } else { Setting::PLAIN };
        assert!(special_ranges(&layout, out).is_empty());
    }

    #[test]
    fn checkpoints_record_the_left_out_names_and_the_scales() {
        let half = Setting {
            decays: false,
            lr_scale: 0.5,
            ..Setting::PLAIN
        };
        let faster = Setting {
            decays: true,
            lr_scale: 2.0,
            ..Setting::PLAIN
        };
        let s = Settings(
            [("z", OUT), ("y", half), ("x", faster)]
                .map(|(n, s)| (n.to_string(), s))
                .into(),
            Vec::new(),
        );
        assert_eq!(s.excluded(), ["y", "z"]);
        assert_eq!(
            s.lr_scales().into_iter().collect::<Vec<_>>(),
            [("x".to_string(), 2.0), ("y".to_string(), 0.5)]
        );
    }

    #[test]
    fn a_compute_copy_splits_like_a_slice() {
        let mut d = vec![half::bf16::ZERO; 5];
        let (a, b) = split_copy(ComputeCopy::Bf16(&mut d), 2);
        match (a, b) {
            (ComputeCopy::Bf16(a), ComputeCopy::Bf16(b)) => assert_eq!((a.len(), b.len()), (2, 3)),
            _ => panic!("not bf16"),
        }
        assert!(matches!(
            split_copy(ComputeCopy::None, 0),
            (ComputeCopy::None, ComputeCopy::None)
        ));
    }
}

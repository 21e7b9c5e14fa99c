//! Weight decay by parameter: which elements of a unit's flat buffer the
//! program left out of it ([`ShardPlan::exclude_from_weight_decay`]), and
//! how a range of the buffer splits into runs that decay and runs that do
//! not.
//!
//! DeepSpeed gets this from the optimizer's parameter groups. A flat buffer
//! mixes both kinds, so the Adam kernel runs once per run, each with its own
//! weight decay; a model that leaves none out runs it once per range, as
//! before.
//!
//! [`ShardPlan::exclude_from_weight_decay`]: crate::ShardPlan::exclude_from_weight_decay

use std::ops::Range;

use zrt_kernels::ComputeCopy;

use crate::flat::FlatLayout;

/// The element ranges of `layout`'s flat buffer that weight decay leaves
/// out (`excluded(name, shape)`), in order, adjacent ones merged. A range
/// runs on over the alignment padding after its parameter (zeros, which
/// decay or not alike), so that neighbours left out make one range.
pub(super) fn excluded_ranges(
    layout: &FlatLayout,
    excluded: impl Fn(&str, &[i64]) -> bool,
) -> Vec<Range<usize>> {
    let mut slots: Vec<_> = layout.slots.iter().collect();
    slots.sort_by_key(|s| s.offset);
    let mut out: Vec<Range<usize>> = Vec::new();
    for (i, s) in slots.iter().enumerate() {
        if !excluded(&s.name, &s.shape) {
            continue;
        }
        let end = slots.get(i + 1).map_or(layout.padded, |n| n.offset);
        match out.last_mut() {
            Some(last) if last.end == s.offset => last.end = end,
            _ => out.push(s.offset..end),
        }
    }
    out
}

/// The names of the parameters weight decay leaves out, over every unit,
/// sorted (what a checkpoint records).
pub(super) fn excluded_names(units: &[super::Unit]) -> Vec<String> {
    let mut names: Vec<String> = units
        .iter()
        .flat_map(|u| u.no_decay_names.iter().cloned())
        .collect();
    names.sort();
    names
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
    let list = |names: Vec<&String>| {
        let shown: Vec<String> = names.iter().take(5).map(|n| format!("`{n}`")).collect();
        match names.len() {
            0 => "none".to_string(),
            n if n > 5 => format!("{} and {} more", shown.join(", "), n - 5),
            _ => shown.join(", "),
        }
    };
    let added: Vec<&String> = now
        .iter()
        .filter(|n| saved.binary_search(n).is_err())
        .collect();
    let dropped: Vec<&String> = saved
        .iter()
        .filter(|n| now.binary_search(n).is_err())
        .collect();
    Some(format!(
        "the checkpoint's run left {} parameter(s) out of weight decay, this engine's plan leaves out {}: from here on weight decay follows the plan (now left out: {}; now decayed: {}). If that is not meant, give the plan the rule the run had (ShardPlan::exclude_from_weight_decay)",
        saved.len(),
        now.len(),
        list(added),
        list(dropped),
    ))
}

/// `whole` (a range of the flat buffer) cut where it enters or leaves an
/// `excluded` range: `(length, decays)` for each run, in order, none empty,
/// lengths summing to `whole`'s.
pub(super) fn runs(whole: Range<usize>, excluded: &[Range<usize>]) -> Vec<(usize, bool)> {
    let mut out = Vec::new();
    let mut at = whole.start;
    for e in excluded {
        if e.end <= at {
            continue;
        }
        if e.start >= whole.end {
            break;
        }
        if e.start > at {
            out.push((e.start - at, true));
            at = e.start;
        }
        let end = e.end.min(whole.end);
        out.push((end - at, false));
        at = end;
    }
    if at < whole.end {
        out.push((whole.end - at, true));
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

    #[test]
    fn a_range_is_cut_where_it_enters_and_leaves_the_excluded_ranges() {
        let ex = [2..4, 6..7, 9..12];
        assert_eq!(
            runs(0..12, &ex),
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
            runs(3..10, &ex),
            [(1, false), (2, true), (1, false), (2, true), (1, false)]
        );
        assert_eq!(runs(4..6, &ex), [(2, true)]);
        // No empty runs where a range starts or ends with an excluded one.
        assert_eq!(runs(2..7, &ex), [(2, false), (2, true), (1, false)]);
        assert_eq!(runs(10..11, &ex), [(1, false)]);
        assert_eq!(runs(0..12, &[]), [(12, true)]);
        assert_eq!(runs(5..5, &ex), []);
        assert_eq!(runs(12..20, &ex), [(8, true)]);
    }

    #[test]
    fn excluded_parameters_become_merged_ranges_of_the_flat_buffer() {
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
        // The vectors are next to each other: one range, to w1.
        let ex = excluded_ranges(&layout, |_, shape| shape.len() < 2);
        assert_eq!(ex, vec![0..at("w1")]);
        assert!(excluded_ranges(&layout, |_, _| false).is_empty());
        assert_eq!(
            excluded_ranges(&layout, |n, _| n == "w1"),
            vec![at("w1")..at("w2")]
        );
        // The last runs on to the end of the buffer.
        assert_eq!(
            excluded_ranges(&layout, |n, _| n.starts_with('b') || n == "w2"),
            [0..at("g1"), at("w2")..layout.padded]
        );
        assert!(layout.padded > at("w2") + 4);
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

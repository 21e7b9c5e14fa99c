//! The order every rank reduces the units in when some ranks' losses may
//! leave some out ([`crate::ShardPlan::unused_on_some_ranks`]), and at
//! stage 1 always (its boundary backward reduces in it, declared units or
//! not).
//!
//! Each unit is reduced from a hook once its gradients are whole, so its
//! reduction overlaps the backward of the units before it. That is safe as
//! long as every rank finds the units whole in the same order, which a
//! unit some ranks skip breaks: it is whole at once there (nothing reaches
//! it) and only after its backward elsewhere. PyTorch's DDP solves this
//! with buckets reduced in one fixed order, rebuilt after the first
//! iteration from the order gradients came in and broadcast from rank 0,
//! each bucket launched once it and those before it are ready. zrt does
//! the same per unit: the first backward reduces such units at its end
//! (the order is not known yet) and records the order each rank found
//! units whole in; its end agrees one order from every rank's; from then
//! on each unit is reduced once it and every unit before it in that order
//! are whole. A unit a rank never finds whole holds back the ones after
//! it until the end of backward, on that rank only: the order, the one
//! thing the ranks must share, stays the same.

/// The agreed order and this backward's place in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LaunchOrder {
    /// Every unit, in the order they are reduced.
    pub(super) order: Vec<usize>,
    /// How many of `order` this backward has passed (launched, or found
    /// launched already).
    pub(super) next: usize,
}

impl LaunchOrder {
    /// The order from each rank's: the units as `seqs[0]` found them
    /// whole; a unit only a later rank found whole goes right after the
    /// unit that rank found whole before it (first if none did); units no
    /// rank found whole go last, by index. Every rank computes it from the
    /// same gathered sequences, so every rank gets the same order.
    pub(super) fn merge(seqs: &[Vec<usize>], units: usize) -> Self {
        let mut order: Vec<usize> = Vec::with_capacity(units);
        for seq in seqs {
            let mut at = 0;
            for &k in seq.iter().filter(|&&k| k < units) {
                match order.iter().position(|&x| x == k) {
                    Some(p) => at = p + 1,
                    None => {
                        order.insert(at, k);
                        at += 1;
                    }
                }
            }
        }
        for k in 0..units {
            if !order.contains(&k) {
                order.push(k);
            }
        }
        Self { order, next: 0 }
    }

    /// One rank's sequence for the gather: `units` slots, unused ones -1.
    pub(super) fn encode(seq: &[usize], units: usize) -> Vec<i64> {
        let mut out = vec![-1; units];
        for (slot, &k) in out.iter_mut().zip(seq) {
            *slot = i64::try_from(k).unwrap_or(-1);
        }
        out
    }

    /// Every rank's sequence back from the gathered slots.
    pub(super) fn decode(all: &[i64], units: usize) -> Vec<Vec<usize>> {
        all.chunks(units.max(1))
            .map(|c| c.iter().filter_map(|&x| usize::try_from(x).ok()).collect())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_ranks_order_stands_and_units_only_others_found_go_after_their_predecessor() {
        // Blocks 0-5 then the embedding (6) run forward; backward finds
        // them whole in reverse. Rank 0 skipped block 3, rank 1 block 5;
        // the root (7) no rank found whole (a parameter no loss used).
        let r0 = vec![5, 4, 2, 1, 0, 6];
        let r1 = vec![4, 3, 2, 1, 0, 6];
        let o = LaunchOrder::merge(&[r0.clone(), r1], 8);
        assert_eq!(o.order, [5, 4, 3, 2, 1, 0, 6, 7]);
        // A unit only a later rank found first goes first.
        let o = LaunchOrder::merge(&[vec![1, 0], vec![2, 1, 0]], 3);
        assert_eq!(o.order, [2, 1, 0]);
        // One rank: its own order, then the rest by index.
        assert_eq!(LaunchOrder::merge(&[r0], 8).order, [5, 4, 2, 1, 0, 6, 3, 7]);
        assert_eq!(o.next, 0);
    }

    #[test]
    fn sequences_survive_the_gather_encoding() {
        let seqs = vec![vec![2, 0], vec![], vec![1, 2, 0]];
        let all: Vec<i64> = seqs
            .iter()
            .flat_map(|s| LaunchOrder::encode(s, 3))
            .collect();
        assert_eq!(all, [2, 0, -1, -1, -1, -1, 1, 2, 0]);
        assert_eq!(LaunchOrder::decode(&all, 3), seqs);
    }
}

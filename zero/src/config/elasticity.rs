//! DeepSpeed's `elasticity` block (its version 0.1): one global batch
//! that stays the same on every world size in a range, so that a job
//! whose nodes come and go (`zrt launch --nnodes MIN:MAX`) trains with
//! the same batch, and so the same schedule, on each.
//!
//! The batch is chosen as DeepSpeed chooses it. Each allowed micro-batch,
//! and their least common multiple, is scaled by the largest of the
//! smallest highly composite numbers that keeps it within
//! `max_train_batch_size`; of those candidates, the one that the most
//! world sizes in `[min_gpus, max_gpus]` can split evenly (into a whole
//! number of allowed micro-batches per rank) wins, ties going to the
//! larger (`prefer_larger_batch`) or the smaller. On a given world the
//! micro-batch is the largest allowed one that divides its share, and the
//! accumulation steps make up the rest.

use super::Batch;

/// The smallest highly composite numbers (each has more divisors than any
/// smaller number), which DeepSpeed scales its candidate batches by: they
/// split among the most world sizes.
const HIGHLY_COMPOSITE: [u64; 38] = [
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
    10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
    332640, 498960, 554400, 665280, 720720,
];

/// `elasticity`, when `enabled`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticityConfig {
    /// `max_train_batch_size` (DeepSpeed's default 2000).
    pub max_train_batch_size: u64,
    /// `micro_batch_sizes` (default `[2, 4, 6]`).
    pub micro_batch_sizes: Vec<u64>,
    /// `min_gpus` (default 1): the smallest world the batch must suit.
    pub min_gpus: u64,
    /// `max_gpus` (default 10000): the largest.
    pub max_gpus: u64,
    /// `prefer_larger_batch` (default true): of two batches that suit as
    /// many worlds, the larger.
    pub prefer_larger_batch: bool,
    /// `ignore_non_elastic_batch_info` (default false): batch keys given
    /// outside the block are ignored rather than refused.
    pub ignore_non_elastic_batch_info: bool,
}

fn gcd(a: u64, b: u64) -> u64 {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

impl ElasticityConfig {
    /// The global batch chosen, and the world sizes it suits (ascending).
    pub fn global_batch(&self) -> (u64, Vec<u64>) {
        let max = self.max_train_batch_size;
        let lcm = self
            .micro_batch_sizes
            .iter()
            .fold(1u64, |l, &m| (l / gcd(l, m)).saturating_mul(m));
        let mut candidates: Vec<u64> = self
            .micro_batch_sizes
            .iter()
            .copied()
            .chain([lcm])
            .map(|base| {
                // A base above the cap stays as it is, as in DeepSpeed.
                HIGHLY_COMPOSITE
                    .iter()
                    .map(|h| base.saturating_mul(*h))
                    .take_while(|&b| b <= max)
                    .last()
                    .unwrap_or(base)
            })
            .collect();
        candidates.sort_unstable();
        candidates.dedup();
        // (worlds suited, batch): the most worlds, then the larger or
        // smaller batch; the smallest micro-batch with no world suited.
        let smallest = self.micro_batch_sizes.iter().copied().min().unwrap_or(1);
        let mut best = (smallest, Vec::new());
        for b in candidates {
            let worlds = self.worlds_for(b);
            let better = worlds.len() > best.1.len()
                || (worlds.len() == best.1.len()
                    && match self.prefer_larger_batch {
                        true => b > best.0,
                        false => b < best.0,
                    });
            if better {
                best = (b, worlds);
            }
        }
        best
    }

    /// The world sizes in `[min_gpus, max_gpus]` that split `batch` into
    /// a whole number of some allowed micro-batch per rank.
    fn worlds_for(&self, batch: u64) -> Vec<u64> {
        let mut worlds = Vec::new();
        for &m in &self.micro_batch_sizes {
            if batch % m != 0 {
                continue;
            }
            let most = batch / m;
            worlds.extend((1..=most).filter(|w| most % w == 0));
        }
        worlds.retain(|w| (self.min_gpus..=self.max_gpus).contains(w));
        worlds.sort_unstable();
        worlds.dedup();
        worlds
    }

    /// The batch on a world of `world` ranks: the global batch, the
    /// largest allowed micro-batch that divides each rank's share, and the
    /// accumulation steps; or what is wrong, naming the worlds that suit.
    pub fn batch_for(&self, world: u64) -> Result<Batch, String> {
        let (train, worlds) = self.global_batch();
        if !worlds.contains(&world) {
            return Err(format!(
                "`elasticity` gives a global batch of {train}, which a world of {world} rank(s) cannot split into the allowed `micro_batch_sizes` {:?}; the worlds it suits: {worlds:?} (change `max_train_batch_size`, `micro_batch_sizes`, `min_gpus` or `max_gpus`, or run on one of those)",
                self.micro_batch_sizes
            ));
        }
        let share = train / world;
        let mut allowed = self.micro_batch_sizes.clone();
        allowed.sort_unstable_by(|a, b| b.cmp(a));
        match allowed.into_iter().find(|m| share % m == 0) {
            Some(micro) => Ok(Batch {
                train,
                micro,
                gas: share / micro,
            }),
            None => Err(format!(
                "`elasticity`: no allowed micro-batch divides {share}, each rank's share of {train}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(
        max: u64,
        micro: &[u64],
        min_gpus: u64,
        max_gpus: u64,
        larger: bool,
    ) -> ElasticityConfig {
        ElasticityConfig {
            max_train_batch_size: max,
            micro_batch_sizes: micro.to_vec(),
            min_gpus,
            max_gpus,
            prefer_larger_batch: larger,
            ignore_non_elastic_batch_info: false,
        }
    }

    fn divisors(n: u64) -> Vec<u64> {
        (1..=n).filter(|d| n % d == 0).collect()
    }

    #[test]
    fn deepspeeds_defaults_choose_1680_for_the_divisors_of_840() {
        // Worked by hand: the candidates are 2 x 840 = 1680 and 4 x 360 =
        // 6 x 240 = 12 x 120 = 1440; 1680 splits into micro-batches of 2,
        // 4 or 6 on every divisor of 840 (32 worlds), 1440 on those of 720
        // (30).
        let c = cfg(2000, &[2, 4, 6], 1, 10000, true);
        let (train, worlds) = c.global_batch();
        assert_eq!(train, 1680);
        assert_eq!(worlds, divisors(840));
        // Each rank's share split by the largest micro-batch that divides it.
        for (world, micro, gas) in [
            (1, 6, 280),
            (7, 6, 40),
            (8, 6, 35),
            (16, 0, 0),
            (105, 4, 4),
            (840, 2, 1),
        ] {
            match c.batch_for(world) {
                Ok(b) => assert_eq!((b.train, b.micro, b.gas), (1680, micro, gas), "{world}"),
                Err(e) => {
                    assert_eq!(micro, 0, "{world}: {e}");
                    assert!(e.contains("a world of 16 rank(s) cannot split"), "{e}");
                    assert!(
                        e.contains("the worlds it suits: [1, 2, 3, 4, 5, 6, 7, 8, 10, 12"),
                        "{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn bounds_and_the_tie_rule_choose_among_candidates() {
        // Micro-batch 4 alone under 100: candidates 4 x 24 = 96 (and the
        // same as the lcm): worlds dividing 24.
        let c = cfg(100, &[4], 1, 10000, true);
        assert_eq!(c.global_batch(), (96, divisors(24)));
        // Worlds capped at 4: 96 suits 1, 2, 3, 4.
        let c = cfg(100, &[4], 1, 4, true);
        assert_eq!(c.global_batch(), (96, vec![1, 2, 3, 4]));
        // [2, 3] under 10: 2 x 4 = 8 (worlds 1, 2, 4), 3 x 2 = 6 (1, 2, 3
        // by 2s; 1, 2 by 3s), lcm 6 x 1 = 6. A tie of three worlds each:
        // the larger batch wins, or the smaller.
        let larger = cfg(10, &[2, 3], 1, 100, true);
        assert_eq!(larger.global_batch(), (8, vec![1, 2, 4]));
        let smaller = cfg(10, &[2, 3], 1, 100, false);
        assert_eq!(smaller.global_batch(), (6, vec![1, 2, 3]));
        assert_eq!(
            smaller.batch_for(2),
            Ok(Batch {
                train: 6,
                micro: 3,
                gas: 1
            })
        );
    }
}

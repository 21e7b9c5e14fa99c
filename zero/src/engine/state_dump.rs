//! DeepSpeed's `dump_state`: the first rank logs, once the engine is
//! built, what it runs with. DeepSpeed prints its engine's attributes;
//! what a zrt user needs to see is the world it shards over, the resolved
//! batch and optimizer, and how each unit was laid out and cut.

use zrt_collectives::ProcessGroup;

use super::{Compute, Inner, State};

impl<G: ProcessGroup + 'static> Inner<G> {
    /// The lines `dump_state` logs: the engine, then one per unit.
    pub(super) fn state_lines(&self, st: &State) -> Vec<String> {
        let c = &self.cfg.config;
        let b = &self.cfg.batch;
        let replicas = self.replicate.as_ref().map_or(1, |r| r.size());
        let hpz = match &self.hpz {
            Some(h) => format!(", hpZ groups of {}", h.size()),
            None => String::new(),
        };
        let compute = match self.compute {
            Compute::F32 => "fp32",
            Compute::Bf16 => "bf16",
            Compute::F16 => "fp16",
        };
        let mut lines = vec![format!(
            "engine state: ZeRO stage {}, {replicas} replica(s) x shard groups of {}{hpz}, {compute} compute; batch {} = {} per rank x {} accumulation x {} ranks; optimizer {} at lr {}; {} unit(s)",
            self.stage,
            self.group.size(),
            b.train,
            b.micro,
            b.gas,
            self.cfg.world,
            c.optimizer.kind.name(),
            c.optimizer.lr.value().unwrap_or(f64::NAN),
            st.units.len(),
        )];
        let rank = self.group.rank();
        for (k, u) in st.units.iter().enumerate() {
            let l = &u.layout;
            let kept = match (self.stage, st.persistent.get(k).copied().unwrap_or(false)) {
                (3, true) => "; stays gathered between steps",
                (3, false) => "; freed between steps",
                _ => "",
            };
            let frozen = match &u.frozen {
                Some(p) => format!(
                    "; frozen part {} parameter(s), {} elements, sharded",
                    p.layout.slots.len(),
                    p.layout.numel
                ),
                None => String::new(),
            };
            let shard = l.shard(rank);
            lines.push(format!(
                "unit `{}`: {} parameter(s), {} elements, flat {} padded; this rank's shard {}..{}{kept}{frozen}",
                u.name,
                l.slots.len(),
                l.numel,
                l.padded,
                shard.start,
                shard.end,
            ));
        }
        lines
    }
}

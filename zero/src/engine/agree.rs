//! The ranks' agreement, at build, on what they train: the model's layout
//! and the config.
//!
//! Ranks that build their engines from different models or configs either
//! fail later with a collective mismatch that names no cause (a different
//! stage or dtype: the first gather or reduction of another size or type)
//! or, worse, train apart without any error (`gradient_clipping` or the
//! learning rate set on some ranks only: every collective still lines up).
//! PyTorch's DDP checks the parameters' shapes across ranks when it is
//! built for the same reason. Here each rank writes down its [`Terms`] (the
//! units, every variable's shape, dtype and whether it trains, and the
//! config's values), the ranks exchange a CRC-32 of them, and only when
//! those differ the terms themselves, so every rank's error names the
//! differences. Where each rank keeps its own state and what it logs may
//! differ (`offload_optimizer`, `offload_param`, `aio`, `steps_per_print`,
//! `wall_clock_breakdown`, the monitors, which the first rank alone
//! writes, and `comms_logger`): nothing another rank does depends on them.

use std::fmt::Debug;

use tch::nn;
use zrt_collectives::{Element, ProcessGroup};

use crate::config::{Precision, Setting};
use crate::{EngineError, Resolved, ShardPlan};

/// Marks the first word of the exchange, so a peer's other call of the same
/// shape is told apart.
const TAG: i64 = 0x7a72_7462; // "zrtb"

/// Differences shown per rank before "and N more".
const SHOWN: usize = 6;

/// What every rank must build alike, as (what, value) pairs in a fixed
/// order: the config's keys by their DeepSpeed names, then the units and
/// each variable.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Terms(Vec<(String, String)>);

impl Terms {
    /// The terms of an engine built from `cfg` over `plan`'s units (its
    /// prefixes, in its order) of the variables in `vs`, with
    /// `treated` how the optimizer treats each trained one.
    pub(super) fn of(
        cfg: &Resolved,
        plan: &ShardPlan,
        vs: &nn::VarStore,
        treated: impl Fn(&str) -> super::groups::Setting,
    ) -> Self {
        let (c, z, o) = (&cfg.config, &cfg.config.zero, &cfg.config.optimizer);
        let mut t = Vec::new();
        let mut put = |what: &str, value: String| t.push((what.to_string(), value));
        put("train_batch_size", cfg.batch.train.to_string());
        put(
            "train_micro_batch_size_per_gpu",
            cfg.batch.micro.to_string(),
        );
        put("gradient_accumulation_steps", cfg.batch.gas.to_string());
        put("optimizer.type", format!("{:?}", o.kind));
        put("optimizer.params.lr", setting(&o.lr));
        put("optimizer.params.betas", format!("{:?}", o.betas));
        put("optimizer.params.eps", format!("{:?}", o.eps));
        put("optimizer.params.weight_decay", setting(&o.weight_decay));
        put("optimizer.params.adam_w_mode", o.adam_w_mode.to_string());
        put(
            "optimizer.params.bias_correction",
            o.bias_correction.to_string(),
        );
        // SGD's (momentum RMSprop's too): whether a rank keeps a momentum
        // buffer hangs on them.
        put("optimizer.params.momentum", format!("{:?}", o.momentum));
        put("optimizer.params.dampening", format!("{:?}", o.dampening));
        put("optimizer.params.nesterov", o.nesterov.to_string());
        put("optimizer.params.maximize", o.maximize.to_string());
        // LAMB's.
        put("optimizer.params.max_coeff", format!("{:?}", o.max_coeff));
        put("optimizer.params.min_coeff", format!("{:?}", o.min_coeff));
        put(
            "optimizer.params.eps_inside_sqrt",
            o.eps_inside_sqrt.to_string(),
        );
        // Adagrad's.
        put("optimizer.params.lr_decay", format!("{:?}", o.lr_decay));
        put(
            "optimizer.params.initial_accumulator_value",
            format!("{:?}", o.initial_accumulator_value),
        );
        // RMSprop's.
        put("optimizer.params.alpha", format!("{:?}", o.alpha));
        put("optimizer.params.centered", o.centered.to_string());
        // Muon's.
        put("optimizer.params.adam_lr", format!("{:?}", o.adam_lr));
        put("optimizer.params.ns_steps", o.ns_steps.to_string());
        put(
            "optimizer.params.ns_coefficients",
            format!("{:?}", o.ns_coefficients),
        );
        put(
            "optimizer.params.adjust_lr_fn",
            match o.match_rms_adamw {
                true => "match_rms_adamw".into(),
                false => "original".to_string(),
            },
        );
        put(
            "scheduler",
            c.scheduler
                .as_ref()
                .map_or("none".into(), |s| format!("{s:?}")),
        );
        put(
            "fp16 / bf16",
            match &c.precision {
                Precision::Fp32 => "neither (fp32)".into(),
                Precision::Bf16 { check_grad_overflow } => {
                    format!("bf16 (check_grad_overflow {check_grad_overflow})")
                }
                Precision::Fp16(l) => format!(
                    "fp16 (loss_scale {}, initial_scale_power {}, loss_scale_window {}, hysteresis {}, consecutive_hysteresis {}, min_loss_scale {})",
                    l.loss_scale,
                    l.initial_scale_power,
                    l.loss_scale_window,
                    l.hysteresis,
                    l.consecutive_hysteresis,
                    l.min_loss_scale
                ),
            },
        );
        put("gradient_clipping", format!("{:?}", c.gradient_clipping));
        put(
            "communication_data_type",
            match c.fp32_grad_reduce {
                true => "fp32".into(),
                false => "the compute dtype".into(),
            },
        );
        let zero = |k: &str| format!("zero_optimization.{k}");
        put(&zero("stage"), z.stage.to_string());
        put(&zero("reduce_bucket_size"), setting(&z.reduce_bucket_size));
        put(
            &zero("allgather_bucket_size"),
            z.allgather_bucket_size.to_string(),
        );
        put(&zero("overlap_comm"), z.overlap_comm.to_string());
        put(
            &zero("contiguous_gradients"),
            z.contiguous_gradients.to_string(),
        );
        put(
            &zero("stage3_prefetch_bucket_size"),
            setting(&z.stage3_prefetch_bucket_size),
        );
        put(
            &zero("stage3_param_persistence_threshold"),
            setting(&z.stage3_param_persistence_threshold),
        );
        put(
            &zero("stage3_max_live_parameters"),
            z.stage3_max_live_parameters.to_string(),
        );
        put(
            &zero("stage3_max_reuse_distance"),
            z.stage3_max_reuse_distance.to_string(),
        );
        put(&zero("mics_shard_size"), format!("{:?}", z.mics_shard_size));
        put(
            &zero("zero_hpz_partition_size"),
            z.zero_hpz_partition_size.to_string(),
        );
        put(
            &zero("zero_quantized_weights"),
            z.zero_quantized_weights.to_string(),
        );
        put(
            &zero("zero_quantized_gradients"),
            z.zero_quantized_gradients.to_string(),
        );
        put(
            &zero("zero_quantized_nontrainable_weights"),
            z.zero_quantized_nontrainable_weights.to_string(),
        );
        put("units (ShardPlan)", plan.units().join(", "));
        // Every rank loads a file, or none does (they would lay the model
        // out with different collectives). Not its path: nodes may hold
        // identical copies at their own paths, and the load checks that
        // the ranks read the same file.
        let file = plan.inner.weights_file().is_some();
        put(
            "ShardPlan::weights_from_file",
            match file {
                true => "a file to load".into(),
                false => "no file".into(),
            },
        );
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, v) in vars {
            let role = match (v.requires_grad(), treated(&name)) {
                (false, s) if s.uneven => "frozen, unused on some ranks".to_string(),
                (false, _) => "frozen".to_string(),
                (true, s) => s.role(),
            };
            put(
                &format!("variable `{name}`"),
                format!("{:?} {:?} ({role})", v.size(), v.kind()),
            );
        }
        Self(t)
    }

    /// One line per term, `what` and value split by a tab.
    fn bytes(&self) -> Vec<u8> {
        let mut s = String::new();
        for (what, value) in &self.0 {
            s.push_str(what);
            s.push('\t');
            s.push_str(value);
            s.push('\n');
        }
        s.into_bytes()
    }

    /// The terms [`Terms::bytes`] wrote (a peer's).
    fn parse(b: &[u8]) -> Self {
        let s = String::from_utf8_lossy(b);
        Self(
            s.lines()
                .map(|l| match l.split_once('\t') {
                    Some((w, v)) => (w.to_string(), v.to_string()),
                    None => (l.to_string(), String::new()),
                })
                .collect(),
        )
    }

    /// Where `self` (on rank `r`) differs from `base` (on rank `b`), one
    /// phrase per term, in `base`'s order, then terms only `self` has.
    fn differences(&self, r: usize, base: &Terms, b: usize) -> Vec<String> {
        let find = |t: &Terms, w: &str| t.0.iter().find(|(x, _)| x == w).map(|(_, v)| v.clone());
        let none = || "none".to_string();
        let mut out = Vec::new();
        for (w, v) in &base.0 {
            match find(self, w) {
                Some(mine) if &mine == v => {}
                mine => out.push(format!(
                    "{w}: rank {r} has {}, rank {b} has {v}",
                    mine.unwrap_or_else(none)
                )),
            }
        }
        for (w, v) in &self.0 {
            if find(base, w).is_none() {
                out.push(format!("{w}: rank {r} has {v}, rank {b} has none"));
            }
        }
        out
    }
}

/// `"auto"` or the resolved value.
fn setting<T: Copy + Debug>(s: &Setting<T>) -> String {
    s.value().map_or("auto".into(), |v| format!("{v:?}"))
}

/// Checks that every rank of the world (`group`, and across `replicate`
/// for hybrid sharding) built from the same [`Terms`]: one exchange of 4
/// words per rank, and the terms themselves only when those differ. Every
/// rank returns the same error, which names each rank that differs from
/// world rank 0 and how.
pub(super) fn check<G: ProcessGroup>(
    terms: &Terms,
    group: &G,
    replicate: Option<&G>,
) -> Result<(), EngineError> {
    let bytes = terms.bytes();
    let mut crc = crc32fast::Hasher::new();
    crc.update(&bytes);
    let me = group.world_ranks().get(group.rank()).copied().unwrap_or(0);
    let mine = vec![
        TAG,
        me as i64,
        i64::from(crc.finalize()),
        bytes.len() as i64,
    ];
    let what = || "this rank compared its model and config with the other ranks'".to_string();
    let all = world_gather(group, replicate, mine, false, what)?;
    // Each rank's (world rank, crc, length), in world order.
    let mut ranks = Vec::new();
    for c in all.chunks(4) {
        match c {
            [TAG, r, crc, len] => ranks.push((*r as usize, *crc, *len as usize)),
            _ => {
                return Err(EngineError::OutOfStep(format!(
                    "{}, and another rank made a different collective call of the same shape here: {all:?}",
                    what()
                )))
            }
        }
    }
    if ranks.iter().all(|x| x.1 == ranks[0].1) {
        return Ok(());
    }
    // Every rank saw the same words, so every rank is here.
    let lens: Vec<usize> = ranks.iter().map(|x| x.2).collect();
    let parts = world_parts(group, replicate, bytes, &lens, what)?;
    let mut each: Vec<_> = ranks
        .iter()
        .zip(&parts)
        .map(|(x, part)| (x.0, Terms::parse(part)))
        .collect();
    each.sort_by_key(|x| x.0);
    Err(EngineError::RanksDiffer(describe(&each)))
}

/// The differences from the lowest rank of `each` (rank, terms), ranks
/// with the same terms named together.
fn describe(each: &[(usize, Terms)]) -> String {
    let Some((base_rank, base)) = each.first() else {
        return String::new();
    };
    let mut seen: Vec<(Vec<usize>, &Terms)> = Vec::new();
    for (r, t) in &each[1..] {
        if t == base {
            continue;
        }
        match seen.iter_mut().find(|(_, s)| *s == t) {
            Some((rs, _)) => rs.push(*r),
            None => seen.push((vec![*r], t)),
        }
    }
    let parts: Vec<String> = seen
        .iter()
        .map(|(rs, t)| {
            let d = t.differences(rs[0], base, *base_rank);
            let more = match d.len().saturating_sub(SHOWN) {
                0 => String::new(),
                n => format!("; and {n} more"),
            };
            let also = match &rs[1..] {
                [] => String::new(),
                others => format!(
                    " (as on rank{} {})",
                    if others.len() > 1 { "s" } else { "" },
                    others
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            format!(
                "rank {} differs from rank {base_rank}{also} in {}{more}",
                rs[0],
                d[..d.len().min(SHOWN)].join("; ")
            )
        })
        .collect();
    match parts.is_empty() {
        // Different CRCs of terms that read alike: only bytes the parse
        // does not keep (invalid UTF-8) can do that.
        true => "their terms differ in bytes that do not print (please report this)".into(),
        false => parts.join(". "),
    }
}

/// `mine` from every rank of the world, in world order (the shard group's
/// ranks inside each replica): an all_gather on `group`, then one of its
/// result on `replicate`. With `v`, parts may differ in length
/// ([`ProcessGroup::all_gather_v`]). A mismatch is
/// [`EngineError::OutOfStep`], saying `what` this rank did.
pub(super) fn world_gather<T: Element, G: ProcessGroup>(
    group: &G,
    replicate: Option<&G>,
    mine: Vec<T>,
    v: bool,
    what: impl Fn() -> String,
) -> Result<Vec<T>, EngineError> {
    let gather = |g: &G, part: Vec<T>| {
        let w = match v {
            true => g.all_gather_v(part, Vec::new()),
            false => g.all_gather(part, Vec::new()),
        };
        w.wait()
            .map(|x| x.1)
            .map_err(|e| super::out_of_step(e, &what))
    };
    let inside = gather(group, mine)?;
    match replicate {
        Some(r) => gather(r, inside),
        None => Ok(inside),
    }
}

/// Every rank's `mine` (bytes of any length), in world order, split
/// into one part per rank by `lens`, the lengths the ranks exchanged
/// before (see [`world_gather`]).
pub(super) fn world_parts<G: ProcessGroup>(
    group: &G,
    replicate: Option<&G>,
    mine: Vec<u8>,
    lens: &[usize],
    what: impl Fn() -> String,
) -> Result<Vec<Vec<u8>>, EngineError> {
    let all = world_gather(group, replicate, mine, true, what)?;
    let mut at = 0;
    Ok(lens
        .iter()
        .map(|&len| {
            let part = all.get(at..at + len).unwrap_or_default().to_vec();
            at += len;
            part
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(t: &[(&str, &str)]) -> Terms {
        Terms(
            t.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        )
    }

    #[test]
    fn terms_round_trip_through_their_bytes() {
        let t = terms(&[
            ("a", "1"),
            ("variable `x.w`", "[5, 3] Float, trained"),
            ("e", ""),
        ]);
        assert_eq!(Terms::parse(&t.bytes()), t);
    }

    #[test]
    fn differences_name_each_term_its_values_and_the_ranks() {
        let base = terms(&[("stage", "2"), ("lr", "0.01"), ("variable `a`", "[5]")]);
        let one = terms(&[("stage", "3"), ("lr", "0.01"), ("variable `b`", "[5]")]);
        let two = terms(&[("stage", "2"), ("lr", "0.02"), ("variable `a`", "[5]")]);
        let each = vec![
            (0, base.clone()),
            (1, one.clone()),
            (2, base),
            (3, two),
            (5, one),
        ];
        assert_eq!(
            describe(&each),
            "rank 1 differs from rank 0 (as on rank 5) in stage: rank 1 has 3, rank 0 has 2; \
             variable `a`: rank 1 has none, rank 0 has [5]; \
             variable `b`: rank 1 has [5], rank 0 has none. \
             rank 3 differs from rank 0 in lr: rank 3 has 0.02, rank 0 has 0.01"
        );
    }

    #[test]
    fn terms_that_read_alike_still_make_an_error_that_says_something() {
        let t = terms(&[("a", "1")]);
        let d = describe(&[(0, t.clone()), (1, t)]);
        assert_eq!(
            d,
            "their terms differ in bytes that do not print (please report this)"
        );
    }

    #[test]
    fn past_six_differences_the_rest_are_counted() {
        let base = terms(&[("a", "1"), ("b", "1"), ("c", "1"), ("d", "1")]);
        let other = terms(&[
            ("a", "2"),
            ("b", "2"),
            ("c", "2"),
            ("d", "2"),
            ("e", "2"),
            ("f", "2"),
            ("g", "2"),
            ("h", "2"),
        ]);
        let d = describe(&[(0, base), (1, other.clone()), (2, other)]);
        assert!(
            d.starts_with(
                "rank 1 differs from rank 0 (as on rank 2) in a: rank 1 has 2, rank 0 has 1"
            ),
            "{d}"
        );
        assert!(
            d.ends_with("f: rank 1 has 2, rank 0 has none; and 2 more"),
            "{d}"
        );
    }
}

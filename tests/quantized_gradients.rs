//! ZeRO++ qgZ (`zero_quantized_gradients`): stage 3 reduce-scatters each
//! gradient bucket as every rank's piece of it packed into int8 codes with
//! a scale per 2048 elements or fewer (cut at every parameter's bounds),
//! sent by one all_to_all; each rank unpacks
//! the pieces of its shard and averages them in fp32, in rank order. The
//! reduced shard is pinned exactly (per bucket); training tracks the
//! unquantized run, alone and with qwZ, hpZ and MiCS.

use crate::common;

use common::{config_zero, engine_of, model, on_ranks, seeded, train_losses, Params};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use zrt::kernels::quant;
use zrt::zero::{Config, ShardPlan, ShardedModule};

const QGZ: &str = r#""zero_quantized_gradients": true, "stage3_param_persistence_threshold": 0,"#;
const PLAIN: &str = r#""stage3_param_persistence_threshold": 0,"#;

/// Elements of the probe's weight: on 2 ranks a shard spans a whole
/// quantization group and part of another, and ends in padding.
const N: usize = 5000;

/// A unit of one weight whose loss is `sum(x * w)`: its gradient is `x`.
#[derive(Debug)]
struct Probe {
    w: Tensor,
}

impl Module for Probe {
    fn forward(&self, x: &Tensor) -> Tensor {
        (x * &self.w).sum(Kind::Float)
    }
}

/// Rank `r`'s input, hence its gradient: magnitudes that differ by group
/// and by rank, so every piece's scales are its own.
fn grad_of(r: usize) -> Vec<f32> {
    (0..N)
        .map(|i| ((i as f32 * 0.37 + r as f32).sin()) * (1.0 + (i / 1000) as f32) * (r + 1) as f32)
        .collect()
}

/// The gradient shard rank `me` of `ranks` holds after one backward:
/// every rank's gradient padded to equal shards (a multiple of 16 elements
/// each, the flat layout's rule), the shard cut in buckets of `per`
/// elements (`reduce_bucket_size` / ranks), each rank's piece of a bucket
/// packed on its own, unpacked, summed in rank order and divided by the
/// ranks.
fn reduced(me: usize, ranks: usize, per: usize) -> Vec<f32> {
    let n = N.div_ceil(16 * ranks) * 16;
    let pieces: Vec<Vec<f32>> = (0..ranks)
        .map(|q| {
            let mut g = grad_of(q);
            g.resize(n * ranks, 0.0);
            g[me * n..(me + 1) * n].to_vec()
        })
        .collect();
    let mut out = vec![0f32; n];
    for a in (0..n).step_by(per) {
        let r = a..(a + per).min(n);
        for piece in &pieces {
            let mut packed = vec![0u8; quant::packed_len(r.len())];
            quant::quantize(&piece[r.clone()], &mut packed).unwrap();
            let mut back = vec![0f32; r.len()];
            quant::dequantize(&packed, &mut back).unwrap();
            out[r.clone()]
                .iter_mut()
                .zip(&back)
                .for_each(|(o, b)| *o += b);
        }
    }
    out.iter_mut().for_each(|o| *o /= ranks as f32);
    out
}

#[test]
fn a_reduced_shard_is_each_ranks_piece_packed_in_int8_and_averaged() {
    // One bucket per unit, then buckets of 1000 elements (500 of each
    // rank's shard: each packed on its own, groups restarting at each).
    for (bucket, per) in [("", usize::MAX), (r#""reduce_bucket_size": 1000,"#, 500)] {
        let cfg = config_zero(3, 1, 0.0, "", &format!("{QGZ} {bucket}"));
        let out = on_ranks(2, |r| {
            let (vs, plan, unit) = seeded(|| {
                let vs = nn::VarStore::new(Device::Cpu);
                let plan = ShardPlan::new();
                let p = vs.root() / "probe";
                let w = p.var_copy("w", &Tensor::zeros([N as i64], (Kind::Float, Device::Cpu)));
                let unit = ShardedModule::new(&plan, &p, Probe { w });
                (vs, plan, unit)
            });
            let engine = engine_of(&vs, &plan, &cfg, &r);
            let x = Tensor::from_slice(&grad_of(r.rank()));
            engine.backward(&unit.forward(&x)).unwrap();
            let c = engine.overlap_counts();
            (engine.grad_buffer(0).unwrap(), c.quantized_reductions)
        });
        for (me, (shard, count)) in out.into_iter().enumerate() {
            let want = reduced(me, 2, per);
            assert_eq!(shard, want, "rank {me}, bucket {bucket:?}");
            let buckets = want.len().div_ceil(per) as u64;
            assert_eq!(count, buckets, "rank {me}: packed reductions");
            // Not the unquantized average (which rounding cannot give).
            let n = want.len();
            let exact: Vec<f32> = (0..n)
                .map(|i| {
                    let at = me * n + i;
                    let g = |q: usize| grad_of(q).get(at).copied().unwrap_or(0.0);
                    (g(0) + g(1)) / 2.0
                })
                .collect();
            assert_ne!(shard, exact, "rank {me}: the packed path must be taken");
            let err = shard.iter().zip(&exact).map(|(a, b)| (a - b).abs());
            // Each rank's piece is off by at most half a code step of its
            // group's scale; |g| <= 5 x 2 makes that at most 5 / 127, and
            // the average of two such at most as much.
            let worst = err.fold(0f32, f32::max);
            assert!(worst <= 5.0 / 127.0 + 1e-6, "rank {me}: off by {worst}");
        }
    }
}

/// Rank 0's losses, the final master parameters and rank 0's count of
/// packed reductions, training the test GPT at stage 3 under `zero` (with
/// `extra` at the top level) on 2 ranks.
fn gpt_run(extra: &str, zero: &str) -> (Vec<f64>, Params, u64) {
    let cfg = config_zero(3, 1, 0.5, extra, zero);
    let (losses, params, counts) = common::train_world(&cfg, &[], 5);
    (losses, params, counts.quantized_reductions)
}

/// Each step's loss within 1% of the unquantized run's.
fn assert_tracks(losses: &[f64], plain: &[f64], what: &str) {
    assert_eq!(losses.len(), plain.len());
    for (s, (a, b)) in losses.iter().zip(plain).enumerate() {
        assert!(
            (a - b).abs() <= 1e-2 * b.abs(),
            "{what} step {s}: {a} vs {b}"
        );
    }
}

#[test]
fn stage_3_with_packed_reductions_tracks_the_unquantized_run() {
    let bf16 = r#""bf16": {"enabled": true},"#;
    let bf16_comm = r#""bf16": {"enabled": true}, "communication_data_type": "bf16","#;
    // fp16: the gradients are packed loss-scaled (an overflow's inf
    // unpacks as NaN, which the overflow check sees).
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 8},"#;
    for extra in ["", bf16, bf16_comm, fp16] {
        let (plain_losses, plain, none) = gpt_run(extra, PLAIN);
        let (losses, params, packed) = gpt_run(extra, QGZ);
        assert_eq!(none, 0, "{extra}");
        // Every unit's gradient, every step (the root's too: it is
        // reduce-scattered like the others).
        assert!(packed >= 5 * 4, "{extra}: {packed} packed reductions");
        assert_ne!(params, plain, "{extra}: the packed path must be taken");
        assert_tracks(&losses, &plain_losses, extra);
        // Packing depends on the buckets only, not on when the
        // reductions are waited for.
        let late = r#""overlap_comm": false, "stage3_prefetch_bucket_size": 0,"#;
        let (l, p, _) = gpt_run(extra, &format!("{QGZ} {late}"));
        assert_eq!((l, p), (losses, params), "{extra}: other settings");
    }
    // ZeRO++ whole: packed gathers and packed reductions.
    let (plain_losses, _, _) = gpt_run("", PLAIN);
    let both = format!(r#"{QGZ} "zero_quantized_weights": true,"#);
    let (losses, _, packed) = gpt_run("", &both);
    assert!(packed > 0);
    assert_tracks(&losses, &plain_losses, "qwZ + qgZ");
}

#[test]
fn an_overflow_packed_into_a_reduction_still_skips_the_step() {
    // A loss scale of 2^40 overflows fp16 gradients: inf packs into a
    // group whose scale and values unpack as NaN, so the packed run skips
    // the same steps as the unquantized one (and lowers the scale alike).
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 40, "hysteresis": 1},"#;
    let skipped = |zero: &str| {
        let cfg = config_zero(3, 1, 0.0, fp16, zero);
        let out = on_ranks(2, |r| {
            let (vs, plan, gpt) = model();
            let e = engine_of(&vs, &plan, &cfg, &r);
            train_losses(&gpt, &e, r.rank(), 4);
            (
                e.skipped_steps(),
                e.loss_scale(),
                e.overlap_counts().quantized_reductions,
            )
        });
        out.into_iter().next().unwrap()
    };
    let (plain, plain_scale, _) = skipped(PLAIN);
    let (packed, scale, count) = skipped(QGZ);
    assert!(plain > 0 && count > 0, "{plain} skipped, {count} packed");
    assert_eq!((packed, scale), (plain, plain_scale));
}

/// Rank 0's losses and rank 0's count of packed reductions, training the
/// test GPT on 4 ranks at stage 3 under `zero`.
fn four_ranks(zero: &str) -> (Vec<f64>, u64) {
    let cfg = config_zero(3, 1, 0.5, "", zero);
    let (losses, _, counts) = common::train_grouped(4, &cfg, 3);
    (losses, counts.quantized_reductions)
}

#[test]
fn hybrid_groups_pack_their_shard_groups_reductions() {
    // MiCS: each pair reduce-scatters packed, then averages across pairs
    // unpacked; hpZ: the whole world reduce-scatters packed.
    for layout in [
        r#""mics_shard_size": 2,"#,
        r#""zero_hpz_partition_size": 2,"#,
    ] {
        let (plain, none) = four_ranks(&format!("{PLAIN} {layout}"));
        let (losses, packed) = four_ranks(&format!("{QGZ} {layout}"));
        assert_eq!(none, 0, "{layout}");
        assert!(packed > 0, "{layout}");
        assert_tracks(&losses, &plain, layout);
    }
}

#[test]
fn the_key_is_warned_about_below_stage_3_and_ranks_must_agree_on_it() {
    let parse = |stage: u8, extra: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, {extra} "zero_optimization": {{"stage": {stage}, "zero_quantized_gradients": true}}}}"#
        ))
        .unwrap()
    };
    for stage in [1u8, 2] {
        let c = parse(stage, "");
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("zero_quantized_gradients")
                    && w.contains(&format!("stage {stage}"))),
            "{:?}",
            c.warnings
        );
    }
    let c = parse(3, "");
    assert!(
        !c.warnings.iter().any(|w| w.contains("quantized")),
        "{:?}",
        c.warnings
    );
    assert!(c.zero.zero_quantized_gradients);
    // A 16-bit reduction dtype has nothing left to set.
    let c = parse(
        3,
        r#""bf16": {"enabled": true}, "communication_data_type": "bf16","#,
    );
    let said = "`communication_data_type` \"bf16\" has no effect with `zero_optimization.zero_quantized_gradients`: stage 3's gradients are reduced as int8 codes and summed in fp32";
    assert!(c.warnings.iter().any(|w| w == said), "{:?}", c.warnings);
    // One rank packing its reductions and one not would issue different
    // collectives: refused at build, naming the key.
    common::refused_unless_agreed([QGZ, PLAIN], "zero_quantized_gradients", |_| {
        let (vs, plan, _) = model();
        (vs, plan)
    });
}

/// A unit of a large parameter (`a`: 100 elements near 1, its gradient
/// 100) beside a small one (`b`: 3000 elements near 0.01, its gradient
/// the input, near 0.01): the forward records `b` as it computes with it.
#[derive(Debug)]
struct Pair {
    a: Tensor,
    b: Tensor,
    seen: std::sync::Arc<std::sync::Mutex<Vec<f32>>>,
}

impl Module for Pair {
    fn forward(&self, x: &Tensor) -> Tensor {
        *self.seen.lock().unwrap() = Vec::<f32>::try_from(&self.b).unwrap();
        (&self.a * 100.0).sum(Kind::Float) + (x * &self.b).sum(Kind::Float)
    }
}

/// Small values: `scale` x a pattern in [-1, 1], shifted by `r`.
fn small(r: usize, scale: f32) -> Vec<f32> {
    (0..3000)
        .map(|i| ((i as f32 * 0.13 + r as f32).sin()) * scale)
        .collect()
}

#[test]
fn a_small_parameter_beside_a_large_one_keeps_its_own_scales() {
    // Groups are cut at every parameter's bounds, gathers (qwZ) and
    // reductions (qgZ) alike: `b` is packed with scales of its own, so it
    // comes back within half a step of its own largest value. Sharing a
    // group with `a` (as when groups ran over the flat buffer), its values
    // would round to a step of 1 / 127 (weights) or 100 / 127 (gradients).
    let both = format!(r#"{QGZ} "zero_quantized_weights": true,"#);
    let cfg = config_zero(3, 1, 0.0, "", &both);
    let out = on_ranks(2, |r| {
        let (vs, plan, unit, seen) = seeded(|| {
            let vs = nn::VarStore::new(Device::Cpu);
            let plan = ShardPlan::new();
            let p = vs.root() / "pair";
            let a = p.var_copy("a", &Tensor::ones([100], (Kind::Float, Device::Cpu)));
            let b = p.var_copy("b", &Tensor::from_slice(&small(9, 0.01)));
            let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let unit = ShardedModule::new(
                &plan,
                &p,
                Pair {
                    a,
                    b,
                    seen: seen.clone(),
                },
            );
            (vs, plan, unit, seen)
        });
        let engine = engine_of(&vs, &plan, &cfg, &r);
        let x = Tensor::from_slice(&small(r.rank(), 0.01));
        engine.backward(&unit.forward(&x)).unwrap();
        let forward = seen.lock().unwrap().clone();
        (forward, engine.grad_buffer(0).unwrap())
    });
    // Layout: a at 0..100, b at 112..3112 (aligned to 16), shards of 1568.
    let (shard, b_at) = (1568, 112);
    let truth = small(9, 0.01);
    for (me, (forward, grads)) in out.into_iter().enumerate() {
        let worst = forward.iter().zip(&truth).map(|(a, b)| (a - b).abs());
        let worst = worst.fold(0f32, f32::max);
        assert!(
            worst <= 0.01 / 254.0 * 1.001,
            "rank {me}: b off by {worst} in forward"
        );
        assert_ne!(forward, truth, "rank {me}: b must be packed");
        // This rank's part of b's gradient against the true average.
        let mut worst = 0f32;
        for (k, g) in grads.iter().enumerate() {
            let at = me * shard + k;
            if (b_at..b_at + 3000).contains(&at) {
                let i = at - b_at;
                let avg = (small(0, 0.01)[i] + small(1, 0.01)[i]) / 2.0;
                worst = worst.max((g - avg).abs());
            }
        }
        assert!(
            worst <= 0.01 / 254.0 * 1.001,
            "rank {me}: b's gradient off by {worst}"
        );
    }
}

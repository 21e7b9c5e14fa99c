//! ZeRO++ qwZ (`zero_quantized_weights`): stage 3 gathers each unit for
//! forward and backward as every rank's shard packed into int8 codes with
//! a scale per 2048 elements or fewer (groups also restart at every
//! parameter's bounds: `quantized_gradients.rs` tests that with a unit of
//! two parameters). What a forward computes with is pinned
//! exactly (each rank's shard packed and unpacked, in rank order); the
//! fp32 master, `with_full_params` and checkpoints keep the true values;
//! training tracks the unquantized run; hpZ's re-gathers from the
//! secondary copies give the same bits as packed gathers from the shards.

use std::sync::{Arc, Mutex};

use crate::common;

use common::{config_zero, engine_of, model, on_ranks, seeded, Params};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use zrt::kernels::quant;
use zrt::zero::{Config, ShardPlan, ShardedModule};

const QWZ: &str = r#""zero_quantized_weights": true, "stage3_param_persistence_threshold": 0,"#;
const PLAIN: &str = r#""stage3_param_persistence_threshold": 0,"#;

/// Elements of the probe's weight: with 2 ranks each shard spans a whole
/// group and part of another, so the group boundaries and the padding
/// both matter.
const N: i64 = 5000;

/// A unit of one weight that records the values it computes with.
#[derive(Debug)]
struct Probe {
    w: Tensor,
    seen: Seen,
}

impl Module for Probe {
    fn forward(&self, x: &Tensor) -> Tensor {
        let w = self.w.to_kind(Kind::Float);
        *self.seen.lock().unwrap() = Vec::<f32>::try_from(&w).unwrap();
        (x * w.slice(0, 0, 8, 1)).sum(Kind::Float)
    }
}

/// The probe's weight: magnitudes that differ by group, so each group's
/// scale is its own.
fn weight() -> Vec<f32> {
    (0..N as usize)
        .map(|i| ((i as f32 * 0.37).sin()) * (1.0 + (i / 1000) as f32))
        .collect()
}

/// What a gather packed as int8 gives back: the weight padded to equal
/// shards of a multiple of 16 elements each (the flat layout's rule),
/// each shard rounded to bf16 first when `bf16` (the compute copy stage 3
/// gathers from) and packed on its own.
fn unpacked(w: &[f32], ranks: usize, bf16: bool) -> Vec<f32> {
    let n = w.len().div_ceil(16 * ranks) * 16;
    let mut padded = w.to_vec();
    padded.resize(n * ranks, 0.0);
    let mut out = Vec::new();
    for shard in padded.chunks(n) {
        let mut packed = vec![0u8; quant::packed_len(n)];
        let mut back = vec![0f32; n];
        if bf16 {
            let h: Vec<half::bf16> = shard.iter().map(|&x| half::bf16::from_f32(x)).collect();
            quant::quantize(&h, &mut packed).unwrap();
            let mut hb = vec![half::bf16::ZERO; n];
            quant::dequantize(&packed, &mut hb).unwrap();
            back = hb.iter().map(|x| x.to_f32()).collect();
        } else {
            quant::quantize(shard, &mut packed).unwrap();
            quant::dequantize(&packed, &mut back).unwrap();
        }
        out.extend(back);
    }
    out.truncate(w.len());
    out
}

/// What the probe's forwards saw last.
type Seen = Arc<Mutex<Vec<f32>>>;

/// The probe as a one-unit model: its VarStore, plan, unit and what it
/// saw.
fn probe() -> (nn::VarStore, ShardPlan, ShardedModule<Probe>, Seen) {
    seeded(|| {
        let vs = nn::VarStore::new(Device::Cpu);
        let plan = ShardPlan::new();
        let p = vs.root() / "probe";
        let w = p.var_copy("w", &Tensor::from_slice(&weight()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let probe = Probe {
            w,
            seen: seen.clone(),
        };
        let unit = ShardedModule::new(&plan, &p, probe);
        (vs, plan, unit, seen)
    })
}

#[test]
fn a_forward_computes_with_each_ranks_shard_packed_in_int8() {
    for bf16 in [false, true] {
        let extra = if bf16 {
            r#""bf16": {"enabled": true},"#
        } else {
            ""
        };
        let cfg = config_zero(3, 1, 0.0, extra, QWZ);
        let out = on_ranks(2, |r| {
            let (vs, plan, unit, seen) = probe();
            let engine = engine_of(&vs, &plan, &cfg, &r);
            let x = Tensor::ones([8], (Kind::Float, Device::Cpu)).to_kind(match bf16 {
                true => Kind::BFloat16,
                false => Kind::Float,
            });
            let y = unit.forward(&x);
            let forward = seen.lock().unwrap().clone();
            engine.backward(&y.to_kind(Kind::Float)).unwrap();
            // Inside with_full_params: the true values, gathered again,
            // and a forward there computes with them (were it to gather
            // packed, the unit's values would look changed when `f`
            // returns, and be written back into the master).
            let mut whole = Vec::new();
            engine
                .with_full_params(|| {
                    whole = Vec::<f32>::try_from(vs.variables()["probe.w"].to_kind(Kind::Float))
                        .unwrap();
                    tch::no_grad(|| drop(unit.forward(&x)));
                })
                .unwrap();
            let inside = seen.lock().unwrap().clone();
            let master = engine.gathered_params().unwrap();
            let counts = engine.overlap_counts();
            (forward, inside, whole, master, counts.quantized_gathers)
        });
        let w = weight();
        let want = unpacked(&w, 2, bf16);
        let rounded: Vec<f32> = match bf16 {
            true => w
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect(),
            false => w.clone(),
        };
        for (rank, (forward, inside, whole, master, quantized)) in out.into_iter().enumerate() {
            let what = format!("rank {rank}, bf16 {bf16}");
            assert_eq!(forward, want, "{what}: forward's weight");
            assert_eq!(inside, whole, "{what}: a forward inside with_full_params");
            assert_ne!(
                forward, rounded,
                "{what}: the packed values differ from the true ones"
            );
            assert_eq!(
                whole, rounded,
                "{what}: with_full_params gives the true values"
            );
            assert_eq!(
                master,
                vec![("probe.w".to_string(), w.clone())],
                "{what}: master"
            );
            assert_eq!(quantized, 1, "{what}: one packed gather");
        }
    }
}

/// Rank 0's losses, the final master parameters and rank 0's count of
/// packed gathers, training the test GPT at stage 3 under `zero` (with
/// `extra` at the top level) on 2 ranks, the variables under `frozen`
/// frozen.
fn gpt_run(extra: &str, zero: &str, frozen: &[&str]) -> (Vec<f64>, Params, u64) {
    let cfg = config_zero(3, 1, 0.5, extra, zero);
    let (losses, params, counts) = common::train_world(&cfg, frozen, 5);
    (losses, params, counts.quantized_gathers)
}

#[test]
fn stage_3_with_packed_gathers_tracks_the_unquantized_run() {
    let bf16 = r#""bf16": {"enabled": true},"#;
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 8},"#;
    // The last: a unit of frozen parameters only (packs nothing; its
    // frozen part is gathered unpacked).
    for (extra, frozen) in [("", &[][..]), (bf16, &[]), (fp16, &[]), ("", &["h.1."])] {
        let (plain_losses, plain, none) = gpt_run(extra, PLAIN, frozen);
        let (losses, params, packed) = gpt_run(extra, QWZ, frozen);
        assert_eq!(none, 0, "{extra}");
        // Every unit but the root, in each forward and each backward that
        // re-gathers it: at least one per unit per step.
        assert!(packed >= 5 * 3, "{extra}: {packed} packed gathers");
        assert_ne!(params, plain, "{extra}: the packed path must be taken");
        for (s, (a, b)) in losses.iter().zip(&plain_losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-2 * b.abs(),
                "{extra} step {s}: {a} vs {b}"
            );
        }
        // The gather sources paged in from NVMe: packed alike.
        let swap = std::env::temp_dir().join(format!("zrt-qwz-{}", std::process::id()));
        std::fs::create_dir_all(&swap).unwrap();
        let swapped = gpt_run(
            extra,
            &format!("{QWZ} {}", common::nvme_params(&swap)),
            frozen,
        );
        let _ = std::fs::remove_dir_all(&swap);
        assert_eq!(
            swapped,
            (losses.clone(), params.clone(), packed),
            "{extra}: offload_param"
        );
        // Packing depends on the shards only: not on when the gathers go
        // out (no prefetch, gradients waited for in small buckets).
        let late = r#""overlap_comm": false, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 0,"#;
        let (l, p, _) = gpt_run(extra, &format!("{QWZ} {late}"), frozen);
        assert_eq!((l, p), (losses, params), "{extra}: other settings");
    }
}

/// Rank 0's losses, the final master parameters and rank 0's (hpZ
/// re-gathers, packed gathers), training the test GPT on 4 ranks at stage
/// 3 under `zero`.
fn four_ranks(zero: &str) -> (Vec<f64>, Params, (u64, u64)) {
    let cfg = config_zero(3, 1, 0.5, "", zero);
    let (losses, params, c) = common::train_grouped(4, &cfg, 3);
    (losses, params, (c.hpz_gathers, c.quantized_gathers))
}

#[test]
fn hpz_regathers_what_a_packed_gather_would_give() {
    // hpZ keeps each rank's part of the unpacked unit after forward and
    // re-gathers it in its pair for backward: the values a packed gather
    // of the shards would give again, so the two train to the same bits.
    let (_, packed, (hpz0, q0)) = four_ranks(QWZ);
    let hpz_cfg = format!(r#"{QWZ} "zero_hpz_partition_size": 2,"#);
    let (_, with_hpz, (hpz1, q1)) = four_ranks(&hpz_cfg);
    assert_eq!(hpz0, 0);
    assert!(
        hpz1 > 0 && q1 < q0,
        "hpZ serves backward: {hpz1} / {q1} vs {q0}"
    );
    assert_eq!(with_hpz, packed);
}

#[test]
fn mics_groups_pack_their_own_shards() {
    // Under MiCS each pair shards (and packs) the unit on its own: the
    // run tracks MiCS unpacked, and packs.
    let mics = r#""mics_shard_size": 2,"#;
    let (plain_losses, plain, (_, none)) = four_ranks(&format!("{PLAIN} {mics}"));
    let (losses, params, (_, packed)) = four_ranks(&format!("{QWZ} {mics}"));
    assert_eq!(none, 0);
    assert!(packed > 0);
    assert_ne!(params, plain, "the packed path must be taken");
    for (s, (a, b)) in losses.iter().zip(&plain_losses).enumerate() {
        assert!((a - b).abs() <= 1e-2 * b.abs(), "step {s}: {a} vs {b}");
    }
}

#[test]
fn the_key_is_warned_about_below_stage_3_and_ranks_must_agree_on_it() {
    for stage in [1u8, 2] {
        let c = Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": {stage}, "zero_quantized_weights": true}}}}"#
        ))
        .unwrap();
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("zero_quantized_weights")
                    && w.contains(&format!("stage {stage}"))),
            "{:?}",
            c.warnings
        );
    }
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_quantized_weights": true}}"#,
    )
    .unwrap();
    assert!(
        !c.warnings.iter().any(|w| w.contains("quantized")),
        "{:?}",
        c.warnings
    );
    assert!(c.zero.zero_quantized_weights);
    // One rank packing its gathers and one not would exchange buffers of
    // different sizes: refused at build, naming the key.
    common::refused_unless_agreed([QWZ, PLAIN], "zero_quantized_weights", |_| {
        let (vs, plan, _) = model();
        (vs, plan)
    });
}

//! zrt-kernels against libtorch itself: Adam/AdamW against tch's optimizers
//! (libtorch's `torch::optim::Adam` / `AdamW`), Adagrad against libtorch's
//! own operations in torch.optim.Adagrad's order, RMSprop against tch's
//! (libtorch's `torch::optim::RMSprop`), and the casts against
//! `Tensor::to_kind`, bit for bit.

use crate::common;
use half::{bf16, f16};
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
use zrt::kernels::{
    adagrad_step, adam_step, cast, rmsprop_step, AdagradConfig, AdamConfig, AdamShard, ComputeCopy,
    RmspropConfig, Threads,
};

fn init(n: usize, seed: u64) -> Vec<f32> {
    // A small LCG: deterministic, no dependency.
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// 10 steps of libtorch's optimizer with gradients `grads[t]`.
fn torch_adam(cfg: &AdamConfig, p0: &[f32], grads: &[Vec<f32>]) -> Vec<f32> {
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root().var_copy("p", &Tensor::from_slice(p0));
    let mut opt = if cfg.adam_w_mode {
        nn::AdamW {
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            wd: cfg.weight_decay,
            eps: cfg.eps,
            amsgrad: false,
        }
        .build(&vs, cfg.lr)
        .unwrap()
    } else {
        nn::Adam {
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            wd: cfg.weight_decay,
            eps: cfg.eps,
            amsgrad: false,
        }
        .build(&vs, cfg.lr)
        .unwrap()
    };
    for g in grads {
        opt.zero_grad();
        // d/dp sum(p * g) = g exactly.
        (&p * Tensor::from_slice(g)).sum(Kind::Float).backward();
        opt.step();
    }
    Vec::<f32>::try_from(&p.detach()).unwrap()
}

fn zrt_adam(threads: usize, cfg: &AdamConfig, p0: &[f32], grads: &[Vec<f32>]) -> Vec<f32> {
    let pool = Threads::new(threads).unwrap();
    let n = p0.len();
    let (mut p, mut m, mut v) = (p0.to_vec(), vec![0.0; n], vec![0.0; n]);
    for (t, g) in grads.iter().enumerate() {
        let shard = AdamShard {
            p: &mut p,
            g,
            m: &mut m,
            v: &mut v,
        };
        adam_step(&pool, cfg, t as u64 + 1, 1.0, shard, ComputeCopy::None).unwrap();
    }
    p
}

#[test]
fn adam_and_adamw_match_libtorch_over_ten_steps() {
    // Sizes that are not multiples of the vector width, the cache block or
    // the thread count; the largest runs multi-threaded.
    for &n in &[1usize, 17, 1_000, 100_003] {
        for adam_w_mode in [true, false] {
            for weight_decay in [0.0, 0.1] {
                let cfg = AdamConfig {
                    lr: 1e-2,
                    weight_decay,
                    adam_w_mode,
                    ..Default::default()
                };
                let p0 = init(n, 1);
                let grads: Vec<Vec<f32>> = (0..10).map(|t| init(n, 100 + t)).collect();
                let want = torch_adam(&cfg, &p0, &grads);
                // Per element, 1e-6 of the larger of its start and its end
                // wherever that is not near zero: the steps' rounding accrues
                // in ulps of the values it passed through (an element that
                // ended at 0.013 ended 1.2e-8 apart, 0.91 of 1e-6 of its end
                // alone). Near zero, where one ulp of an intermediate is a
                // large fraction of the value, 1e-6 of the parameters'
                // scale (their largest magnitude, before or after).
                let scale = want
                    .iter()
                    .chain(&p0)
                    .fold(0f64, |s, &b| s.max(b.abs() as f64));
                for threads in [1, 2] {
                    let got = zrt_adam(threads, &cfg, &p0, &grads);
                    let mut closest = common::Closest::default();
                    for i in 0..n {
                        let (a, b) = (got[i] as f64, want[i] as f64);
                        let moved = b.abs().max(p0[i].abs() as f64);
                        let tol = if moved >= 1e-2 {
                            1e-6 * moved
                        } else {
                            1e-6 * scale
                        };
                        assert!(
                            closest.see((a - b).abs(), tol),
                            "n={n} adamw={adam_w_mode} wd={weight_decay} threads={threads} i={i}: zrt {a} torch {b}"
                        );
                    }
                    closest.record(&format!(
                        "Adam against libtorch: n={n} adamw={adam_w_mode} wd={weight_decay} threads={threads}"
                    ));
                }
            }
        }
    }
}

/// torch.optim.Adagrad's single-tensor steps (the path it takes on CPU)
/// with gradients `grads[t]`, through libtorch's operations: `sum.addcmul_
/// (g, g)`, `std = sum.sqrt() + eps`, `p.addcdiv_(g, std, value = -clr)`
/// (tch's addcdiv_ takes no value: `-clr * g` is passed, the product
/// libtorch's kernel forms first). No weight decay: torch adds it with
/// `add(p, alpha)`, which tch cannot call. The parameters and the sums.
fn torch_adagrad(cfg: &AdagradConfig, p0: &[f32], grads: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>) {
    let mut p = Tensor::from_slice(p0);
    let mut sum = p.zeros_like();
    for (t, g) in grads.iter().enumerate() {
        let g = Tensor::from_slice(g);
        let _ = sum.addcmul_(&g, &g);
        let std = sum.sqrt() + cfg.eps;
        let _ = p.addcdiv_(&(&g * -cfg.step_lr(t as u64 + 1)), &std);
    }
    let v = |t: &Tensor| Vec::<f32>::try_from(t).unwrap();
    (v(&p), v(&sum))
}

#[test]
fn adagrad_matches_libtorchs_operations() {
    // The sums to the bit (addcmul_ is one fused multiply-add in libtorch
    // too). The parameters within 1e-6: libtorch's f32 `sqrt` on CPU is
    // not correctly rounded (one ulp off for about 0.5% of inputs here,
    // measured against the f64 root rounded once), where zrt's is IEEE's,
    // the same bits on every machine and dispatch level.
    let cfg = AdagradConfig {
        lr: 0.05,
        lr_decay: 0.1,
        eps: 1e-6,
        ..Default::default()
    };
    for &n in &[1usize, 17, 1_000, 100_003] {
        let p0 = init(n, 2);
        let grads: Vec<Vec<f32>> = (0..10).map(|t| init(n, 200 + t)).collect();
        let (want, want_sum) = torch_adagrad(&cfg, &p0, &grads);
        for threads in [1, 2] {
            let pool = Threads::new(threads).unwrap();
            let (mut p, mut sum) = (p0.clone(), vec![0.0; n]);
            for (t, g) in grads.iter().enumerate() {
                let shard = AdamShard {
                    p: &mut p,
                    g,
                    m: &mut sum,
                    v: &mut [],
                };
                adagrad_step(&pool, &cfg, t as u64 + 1, 1.0, shard, ComputeCopy::None).unwrap();
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&sum), bits(&want_sum), "n={n} threads={threads}");
            let mut closest = common::Closest::default();
            for i in 0..n {
                let (a, b) = (p[i] as f64, want[i] as f64);
                assert!(
                    closest.see((a - b).abs(), 1e-6 * b.abs().max(0.1)),
                    "n={n} threads={threads} i={i}: zrt {a} torch {b}"
                );
            }
            closest.record(&format!(
                "Adagrad against libtorch: n={n} threads={threads}"
            ));
        }
    }
}

#[test]
fn rmsprop_matches_libtorchs_rmsprop() {
    // Within 1e-6 (absolute below 1), as Adagrad: libtorch's CPU `sqrt` is
    // one ulp off for some inputs, and with momentum those ulps add up in
    // the buffer over the steps (measured: about 1% of the elements differ,
    // by at most 2.5e-7). (Its square averages equal zrt's to the bit; tch
    // does not show an optimizer's state, so the kernel's own tests check
    // how they round.) A slip in the formula misses by far more.
    let cases = [
        (0.0, 0.0, 0.99, false),
        (0.9, 0.01, 0.9, false),
        (0.0, 0.01, 0.99, true),
    ];
    for (momentum, weight_decay, alpha, centered) in cases {
        let cfg = RmspropConfig {
            lr: 0.01,
            alpha,
            eps: 1e-6,
            weight_decay,
            momentum,
            centered,
            maximize: false,
        };
        for &n in &[1usize, 17, 1_000, 100_003] {
            let p0 = init(n, 3);
            let grads: Vec<Vec<f32>> = (0..10).map(|t| init(n, 300 + t)).collect();
            let vs = nn::VarStore::new(Device::Cpu);
            let p = vs.root().var_copy("p", &Tensor::from_slice(&p0));
            let mut opt = nn::RmsProp {
                alpha,
                eps: cfg.eps,
                wd: weight_decay,
                momentum,
                centered,
            }
            .build(&vs, cfg.lr)
            .unwrap();
            for g in &grads {
                opt.zero_grad();
                (&p * Tensor::from_slice(g)).sum(Kind::Float).backward();
                opt.step();
            }
            let want = Vec::<f32>::try_from(&p.detach()).unwrap();
            for threads in [1, 2] {
                let pool = Threads::new(threads).unwrap();
                let (mut p, mut s) = (p0.clone(), vec![0.0; n]);
                let mut b = vec![0.0; if momentum > 0.0 || centered { n } else { 0 }];
                for g in &grads {
                    let shard = AdamShard {
                        p: &mut p,
                        g,
                        m: &mut s,
                        v: &mut b,
                    };
                    rmsprop_step(&pool, &cfg, 1.0, shard, ComputeCopy::None).unwrap();
                }
                let mut closest = common::Closest::default();
                for i in 0..n {
                    let (a, b) = (p[i] as f64, want[i] as f64);
                    assert!(
                        closest.see((a - b).abs(), 1e-6 * b.abs().max(1.0)),
                        "{cfg:?} n={n} threads={threads} i={i}: zrt {a} torch {b}"
                    );
                }
                let how = format!(
                    "momentum {} centered {} weight decay {}",
                    cfg.momentum, cfg.centered, cfg.weight_decay
                );
                closest.record(&format!(
                    "RMSprop against libtorch: {how} n={n} threads={threads}"
                ));
            }
        }
    }
}

/// f32 bit patterns that exercise every rule: NaNs of both signs and several
/// payloads, infinities, zeros, subnormals, ties in both directions, values
/// that round to the max finite or overflow, and the smallest f16 subnormal.
fn edge_cases() -> Vec<u32> {
    let mut v = vec![
        0x7FC0_0000,
        0xFFC0_0000,
        0x7F80_0001,
        0x7FA0_0000,
        0xFF81_2345,
        0x7FFF_FFFF, // NaN
        0x7F80_0000,
        0xFF80_0000,
        0x0000_0000,
        0x8000_0000, // inf, zero
        0x0000_0001,
        0x8000_0001,
        0x007F_FFFF,
        0x0040_0000, // f32 subnormals
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_C000,
        0x3F80_7FFF, // bf16 ties and near-ties
        0x3F80_1000,
        0x3F80_3000,
        0x3F80_1001, // f16 ties and near-ties
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F7F_8000,
        0x7F7F_7FFF, // bf16 max finite / overflow
        0x477F_E000,
        0x477F_F000,
        0x477F_EFFF,
        0xC77F_F000, // f16 max finite / overflow
        0x3880_0000,
        0x387F_E000,
        0x3380_0000,
        0x3300_0000,
        0x3300_0001,
        0x3280_0000, // f16 subnormals, ties to 0
    ];
    // Plus a deterministic spray of random patterns.
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..20_000 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.push(s as u32);
    }
    v
}

fn torch_bits(x: &Tensor) -> Vec<u16> {
    Vec::<i16>::try_from(&x.view_dtype(Kind::Int16))
        .unwrap()
        .into_iter()
        .map(|b| b as u16)
        .collect()
}

#[test]
fn f32_to_bf16_and_f16_are_bit_identical_to_libtorch() {
    let bits = edge_cases();
    let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let t = Tensor::from_slice(&x);
    // Both the scalar tail and the vectorized body of libtorch's kernel.
    for len in [1, 7, 33, x.len()] {
        let xs = &x[..len];
        let tb = torch_bits(&t.narrow(0, 0, len as i64).to_kind(Kind::BFloat16));
        let th = torch_bits(&t.narrow(0, 0, len as i64).to_kind(Kind::Half));
        let mut zb = vec![bf16::ZERO; len];
        let mut zh = vec![f16::ZERO; len];
        cast::f32_to_bf16(xs, &mut zb).unwrap();
        cast::f32_to_f16(xs, &mut zh).unwrap();
        for i in 0..len {
            assert_eq!(zb[i].to_bits(), tb[i], "bf16 of {:#010x}", bits[i]);
            assert_eq!(zh[i].to_bits(), th[i], "f16 of {:#010x}", bits[i]);
        }
    }
}

#[test]
fn bf16_and_f16_to_f32_are_bit_identical_to_libtorch_for_every_pattern() {
    let all: Vec<i16> = (0..=u16::MAX).map(|b| b as i16).collect();
    let t = Tensor::from_slice(&all);
    let hb: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let hh: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let tb = Vec::<f32>::try_from(&t.view_dtype(Kind::BFloat16).to_kind(Kind::Float)).unwrap();
    let th = Vec::<f32>::try_from(&t.view_dtype(Kind::Half).to_kind(Kind::Float)).unwrap();
    let mut zb = vec![0f32; hb.len()];
    let mut zh = vec![0f32; hh.len()];
    cast::bf16_to_f32(&hb, &mut zb).unwrap();
    cast::f16_to_f32(&hh, &mut zh).unwrap();
    for i in 0..all.len() {
        assert_eq!(zb[i].to_bits(), tb[i].to_bits(), "bf16 {i:#06x}");
        assert_eq!(zh[i].to_bits(), th[i].to_bits(), "f16 {i:#06x}");
    }
}

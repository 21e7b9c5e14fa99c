//! `zero_quantized_nontrainable_weights`: stage 3 holds each rank's shard
//! of its units' frozen parameters as int8 codes and scales, groups cut at
//! every parameter's bounds, and gathers them so. Asserted: a run trains to
//! the same bits as a replicated (stage 0) model whose frozen base was
//! replaced by exactly what each rank's shard packs and unpacks to (fp32,
//! bf16 training of an fp32 base, a bf16 base; with the parameter swap;
//! under hpZ and MiCS), the bytes a rank holds, checkpoints that hold the
//! unpacked values and resume to the same bits, a change made in
//! `with_full_params` packed again, the key's warnings (below stage 3;
//! nothing to pack) and the ranks' agreement on it. Run one at a time
//! ([`common::serial`]), as [`crate::frozen_shards`]'s tests.

use crate::common;
use crate::frozen_shards::{
    cfg, frozen_model_in, gathered_base, is_frozen, run_in, run_model, unit_shards, values,
};

use std::collections::HashMap;

use common::{
    config_zero, model, nvme_params, on_ranks, serial, tokens, train_losses, BF16, WORLD,
};
use tch::{Kind, Tensor};
use zrt::kernels::quant;
use zrt::zero::checkpoint::{consolidate, inspect, ExportDtype, Meta, ROUNDED_KEY};
use zrt::zero::flat::FlatLayout;
use zrt::zero::{AutoHints, Config, Engine};

const KEY: &str = r#""zero_quantized_nontrainable_weights": true,"#;

/// The `__metadata__` of safetensors file `path` (its header's JSON).
fn metadata(path: &std::path::Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    header["__metadata__"].clone()
}

/// The frozen base as stage 3 holds it with the key over a shard group of
/// `ranks`: per unit, its frozen parameters (of the base cast to `base`)
/// laid out flat as the engine lays them out, each rank's shard packed
/// with its cuts at the parameters' bounds and unpacked; by name, in fp32.
fn packed_base(ranks: usize, base: Kind) -> HashMap<String, Vec<f32>> {
    let (vs, _, _) = model();
    let of_base = vs
        .variables()
        .into_iter()
        .filter(|(n, _)| is_frozen(n))
        .map(|(n, t)| (n, values(&t.to_kind(base))))
        .collect();
    packed(&of_base, ranks)
}

/// `frozen` (every frozen parameter's values, by name) as stage 3 holds it
/// with the key over a shard group of `ranks` (see [`packed_base`]).
fn packed(frozen: &HashMap<String, Vec<f32>>, ranks: usize) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for layout in frozen_layouts(ranks) {
        let mut flat = vec![0f32; layout.padded];
        for s in &layout.slots {
            flat[s.offset..s.offset + s.numel].copy_from_slice(&frozen[&s.name]);
        }
        let mut back = vec![0f32; layout.padded];
        for r in 0..ranks {
            let range = layout.shard(r);
            let cuts = layout.segments(range.clone());
            let mut packed = vec![0u8; quant::packed_len_cut(&cuts)];
            quant::quantize_cut(&flat[range.clone()], &cuts, &mut packed).unwrap();
            quant::dequantize_cut(&packed, &cuts, &mut back[range]).unwrap();
        }
        for s in &layout.slots {
            let v = back[s.offset..s.offset + s.numel].to_vec();
            out.insert(s.name.clone(), v);
        }
    }
    assert!(!out.is_empty());
    out
}

/// Each unit's frozen parameters laid out flat over a shard group of
/// `ranks`, as the engine lays them out (units without any left out).
fn frozen_layouts(ranks: usize) -> Vec<FlatLayout> {
    let (vs, plan, _) = model();
    let vars = vs.variables();
    plan.units()
        .iter()
        .map(|unit| {
            vars.iter()
                .filter(|(n, _)| is_frozen(n) && n.starts_with(&format!("{unit}.")))
                .map(|(n, t)| (n.clone(), t.size()))
                .collect::<Vec<_>>()
        })
        .filter(|names| !names.is_empty())
        .map(|names| FlatLayout::new(names, ranks))
        .collect()
}

/// The test GPT with its frozen base replaced by `base` (fp32) on every
/// rank.
fn model_with_base(
    base: &HashMap<String, Vec<f32>>,
) -> (tch::nn::VarStore, zrt::zero::ShardPlan, zrt::gpt::Gpt) {
    let (vs, plan, gpt) = frozen_model_in(0, is_frozen, Kind::Float);
    for (name, t) in vs.variables() {
        if let Some(v) = base.get(&name) {
            tch::no_grad(|| {
                t.shallow_clone()
                    .copy_(&Tensor::from_slice(v).view(&t.size()[..]))
            });
        }
    }
    (vs, plan, gpt)
}

/// Every rank's gathered base is `want` in the compute dtype `kind`.
fn assert_bases(
    bases: &[HashMap<String, (Kind, Vec<f32>)>],
    want: &HashMap<String, Vec<f32>>,
    kind: Kind,
    what: &str,
) {
    for b in bases {
        assert_eq!(b.len(), want.len(), "{what}");
        for (n, (k, v)) in b {
            assert_eq!(*k, kind, "{what}: {n}");
            let w = values(&Tensor::from_slice(&want[n]).to_kind(kind));
            assert_eq!(v, &w, "{what}: {n} holds its unpacked values");
        }
    }
}

#[test]
fn packed_frozen_shards_train_as_a_replicated_base_of_their_unpacked_values() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("zrt-qfrozen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let nvme = nvme_params(&dir);
    let cases = [
        ("", Kind::Float, Kind::Float),
        (BF16, Kind::BFloat16, Kind::Float),
        (BF16, Kind::BFloat16, Kind::BFloat16),
    ];
    for (extra, kind, base_kind) in cases {
        let unpacked = packed_base(WORLD, base_kind);
        // Packing changed the base's matrices (the test would pass
        // unquantized too otherwise).
        let (vs, _, _) = model();
        let vars = vs.variables();
        for n in unpacked.keys().filter(|n| vars[*n].numel() > 1000) {
            let exact = values(&vars[n].to_kind(base_kind));
            assert_ne!(exact, unpacked[n], "{n} is rounded");
        }
        let reference = run_model(&cfg(0, extra, ""), WORLD, is_frozen, |_| {
            model_with_base(&unpacked)
        });
        for zero in [KEY.to_string(), format!("{KEY} {nvme}")] {
            let what = format!("{extra} base {base_kind:?} {zero}");
            let got = run_in(&cfg(3, extra, &zero), WORLD, is_frozen, base_kind);
            assert_eq!(got.params, reference.params, "{what}");
            assert_eq!(got.losses, reference.losses, "{what}");
            assert_bases(&got.bases, &unpacked, kind, &what);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn under_hpz_and_mics_each_shard_group_packs_its_own_shards() {
    let _serial = serial();
    // 4 ranks: the world's shards (hpZ only re-gathers the unpacked values
    // inside pairs) or MiCS pairs' shards, packed with their own cuts;
    // against the same sharding of an unpacked base of those values (MiCS
    // averages its gradients across pairs: not stage 0's bits).
    for (zero, ranks) in [
        ("", 4),
        (r#""zero_hpz_partition_size": 2,"#, 4),
        (r#""mics_shard_size": 2,"#, 2),
    ] {
        let unpacked = packed_base(ranks, Kind::Float);
        let reference = run_model(&cfg(3, "", zero), 4, is_frozen, |_| {
            model_with_base(&unpacked)
        });
        let got = run_in(
            &cfg(3, "", &format!("{KEY} {zero}")),
            4,
            is_frozen,
            Kind::Float,
        );
        assert_eq!(got.params, reference.params, "{zero}");
        assert_eq!(got.losses, reference.losses, "{zero}");
        assert_bases(&got.bases, &unpacked, Kind::Float, zero);
    }
}

#[test]
fn a_frozen_weight_changed_in_with_full_params_is_packed_again() {
    let _serial = serial();
    let mut want = packed_base(WORLD, Kind::Float);
    let n = "h.0.fc.weight";
    let doubled: Vec<f32> = want[n].iter().map(|v| 2.0 * v + 0.001).collect();
    want.insert(n.to_string(), doubled.clone());
    // The unit's other frozen weight (`h.0.out.weight`) packs again from
    // its unpacked values to the same bytes.
    let want = packed(&want, WORLD);
    assert_ne!(want[n], doubled, "the change is rounded");
    on_ranks(WORLD, |r| {
        let (vs, plan, _) = frozen_model_in(r.rank(), is_frozen, Kind::Float);
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg(3, "", KEY), g, &AutoHints::default()).unwrap();
        let t = vs.variables()[n].shallow_clone();
        let new = Tensor::from_slice(&doubled).view(&t.size()[..]);
        e.with_full_params(|| tch::no_grad(|| t.shallow_clone().copy_(&new)))
            .unwrap();
        assert_bases(
            &[gathered_base(&e, &vs, is_frozen)],
            &want,
            Kind::Float,
            "after",
        );
    });
}

#[test]
fn a_rank_holds_its_frozen_shards_as_codes_and_scales() {
    let _serial = serial();
    for (extra, word) in [("", 4), (BF16, 2)] {
        on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = frozen_model_in(r.rank(), is_frozen, Kind::Float);
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &cfg(3, extra, KEY), g, &AutoHints::default()).unwrap();
            e.backward(&gpt.loss(&tokens(0, 0, r.rank(), 1))).unwrap();
            e.step().unwrap();
            // As `between_steps_a_rank_holds_its_shard_of_the_frozen_base_
            // and_nothing_more`, but a frozen shard holds this rank's
            // packed bytes: a scale (4 bytes) per 2048 elements or fewer
            // of one parameter and a byte an element.
            let packed: usize = frozen_layouts(WORLD)
                .iter()
                .map(|l| quant::packed_len_cut(&l.shard_segments()[r.rank()]))
                .sum();
            let units = unit_shards(&e, &vs);
            let exact: usize = units.iter().map(|u| word * u.2).sum();
            // Per element of a trainable shard: fp32 master, m, v and
            // gradient (16 bytes; in bf16 its 16-bit copy besides: 18);
            // the root stays gathered.
            let trainable: usize = units
                .iter()
                .map(|&(root, t, _)| (20 - word) * t + if root { word * t * WORLD } else { 0 })
                .sum();
            let held = e.model_state_bytes().unwrap();
            assert_eq!(held, trainable + packed, "{extra}");
            // A quarter of fp32's bytes, half of bf16's, and the scales.
            assert!(
                packed * word < exact * 11 / 10 && packed * word > exact,
                "{packed} vs {exact}"
            );
        });
    }
}

#[test]
fn a_packed_frozen_base_checkpoints_its_unpacked_values_and_resumes_to_the_same_bits() {
    let _serial = serial();
    // An fp32 base (saved in fp32) under fp32 and bf16 training, and a
    // 16-bit base (saved so) under training in its dtype.
    let fp16 = r#""fp16": {"enabled": true},"#;
    let cases = [
        ("", Kind::Float, Kind::Float),
        (BF16, Kind::BFloat16, Kind::Float),
        (BF16, Kind::BFloat16, Kind::BFloat16),
        (fp16, Kind::Half, Kind::Half),
    ];
    for (extra, kind, base_kind) in cases {
        let what = format!("{extra} base {base_kind:?}");
        let dir = std::env::temp_dir().join(format!(
            "zrt-qfrozen-ckpt-{}-{kind:?}-{base_kind:?}",
            std::process::id(),
        ));
        let unpacked = packed_base(WORLD, base_kind);
        let at3 = cfg(3, extra, KEY);
        let straight = on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = frozen_model_in(r.rank(), is_frozen, base_kind);
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &at3, g, &AutoHints::default()).unwrap();
            train_losses(&gpt, &e, r.rank(), 1);
            e.save_checkpoint(&dir, "mid").unwrap();
            e.save_16bit_model(dir.join("model.safetensors")).unwrap();
            let loss = gpt.loss(&tokens(1, 0, r.rank(), 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
            (loss.double_value(&[]), e.gathered_params().unwrap())
        });
        // The checkpoint holds the unpacked values, in the dtype the model
        // made the base in.
        let saved: HashMap<String, Tensor> =
            Tensor::read_safetensors(dir.join("mid").join("frozen.safetensors"))
                .unwrap()
                .into_iter()
                .collect();
        for (n, v) in &unpacked {
            assert_eq!(saved[n].kind(), base_kind, "{what}: {n}");
            let want = values(&Tensor::from_slice(v).to_kind(base_kind));
            assert_eq!(values(&saved[n]), want, "{what}: {n} saved unpacked");
        }
        // Its meta marks them, and `zrt ckpt inspect` says so.
        let meta = Meta::read(&dir.join("mid")).unwrap();
        let frozen = meta.frozen.unwrap();
        let marked: Vec<&str> = frozen
            .iter()
            .filter(|f| f.quantized)
            .map(|f| f.name.as_str())
            .collect();
        assert_eq!(marked.len(), unpacked.len(), "{what}: {marked:?}");
        assert!(marked.iter().all(|n| unpacked.contains_key(*n)));
        let text = inspect(&dir, Some("mid")).unwrap();
        let line = format!("{} of them unpacked from int8", unpacked.len());
        assert!(text.contains(&line), "{text}");
        // So do the model exports' metadata: the engine's and one
        // consolidated from the checkpoint.
        let out = dir.join("consolidated.safetensors");
        consolidate(&dir, Some("mid"), &out, ExportDtype::F32).unwrap();
        let mut names: Vec<&str> = unpacked.keys().map(String::as_str).collect();
        names.sort_unstable();
        for file in [dir.join("model.safetensors"), out] {
            let marked = metadata(&file)[ROUNDED_KEY].as_str().map(str::to_string);
            assert_eq!(marked, Some(names.join(",")), "{what}: {}", file.display());
        }
        // Loaded into another base: packing the saved values again gives
        // the same codes and scales, so the next step is the same. (fp32:
        // `max / 127` survives `127 * scale / 127`; a 16-bit base's largest
        // magnitude is a value of its dtype, which its unpacked 127 codes
        // give back exactly, and the other codes are off by at most a
        // quarter.)
        let resumed = on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = frozen_model_in(1, is_frozen, base_kind);
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &at3, g, &AutoHints::default()).unwrap();
            // A run that packs them too resumes quietly.
            let (_, logs) = common::with_logs(|| e.load_checkpoint(&dir, Some("mid")).unwrap());
            assert!(!logs.contains("unpacked from int8"), "{logs}");
            let loss = gpt.loss(&tokens(1, 0, r.rank(), 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
            (loss.double_value(&[]), e.gathered_params().unwrap())
        });
        assert_eq!(resumed, straight, "{what}");
        // Stage 2 (replicated, nothing packed) loads the unpacked values.
        on_ranks(WORLD, |r| {
            let (vs, plan, _) = frozen_model_in(1, is_frozen, base_kind);
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &cfg(2, extra, ""), g, &AutoHints::default()).unwrap();
            // Rounded values into parameters held exactly: said, once.
            let (_, logs) = common::with_logs(|| e.load_checkpoint(&dir, Some("mid")).unwrap());
            let said = format!("{} frozen parameter(s) in checkpoint", unpacked.len());
            assert!(
                logs.contains(&said) && logs.contains("unpacked from int8"),
                "{logs}"
            );
            assert_eq!(logs.matches("unpacked from int8").count(), 1, "{logs}");
            let base = gathered_base(&e, &vs, is_frozen);
            assert_bases(&[base], &unpacked, kind, &format!("stage 2, {what}"));
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_key_is_warned_about_below_stage_3_and_ranks_must_agree_on_it() {
    let parse = |stage: u8| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": {stage}, {KEY} "stage3_param_persistence_threshold": 0}}}}"#
        ))
        .unwrap()
    };
    for stage in [1u8, 2] {
        let c = parse(stage);
        let said = c.warnings.iter().any(|w| {
            w.contains("zero_quantized_nontrainable_weights")
                && w.contains(&format!("stage {stage}"))
        });
        assert!(said, "{:?}", c.warnings);
    }
    let c = parse(3);
    let quiet = !c.warnings.iter().any(|w| w.contains("quantized"));
    assert!(quiet, "{:?}", c.warnings);
    assert!(c.zero.zero_quantized_nontrainable_weights);
    // One rank holding its frozen shards packed and one not would gather
    // different lengths: refused at build, naming the key.
    let key = "zero_quantized_nontrainable_weights";
    common::refused_unless_agreed([KEY, ""], key, |rank| {
        let (vs, plan, _) = frozen_model_in(rank, is_frozen, Kind::Float);
        (vs, plan)
    });
    // With nothing to pack (DeepSpeed's persistence threshold keeps every
    // frozen parameter of the test GPT whole; nothing frozen at all), the
    // build says so; with something packed, it does not.
    let nothing = "no frozen parameter is sharded, so none is quantized";
    for (zero, frozen, warned) in [
        ("", true, true),
        (r#""stage3_param_persistence_threshold": 0,"#, false, true),
        (r#""stage3_param_persistence_threshold": 0,"#, true, false),
    ] {
        let logs = on_ranks(WORLD, |r| {
            let (vs, plan, _) = match frozen {
                true => frozen_model_in(r.rank(), is_frozen, Kind::Float),
                false => model(),
            };
            let cfg = config_zero(3, 1, 0.0, "", &format!("{KEY} {zero}"));
            let g = r.new_group(&[0, 1]).unwrap();
            common::with_logs(|| Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap()).1
        });
        for log in logs {
            assert_eq!(
                log.contains(nothing),
                warned,
                "{zero} frozen {frozen}: {log}"
            );
        }
    }
}

//! Stage 3 shards frozen parameters with their unit (a LoRA-style frozen
//! base): exact memory, training identical to the unsharded reference in
//! fp32 and bf16, with the parameter swap, hpZ and hybrid sharding,
//! checkpoints that move between stage 3 (sharded) and stage 2
//! (replicated) and refuse another model's frozen variables, and a forward
//! whose gathers fail running on zeroed memory. 2 or 4 ranks
//! (threads). The tests run one at a time ([`common::serial`]): loading a
//! checkpoint puts libtorch's process-global RNG state back, which can land
//! between another test's seeding and its model's first draws.

use crate::common;

use std::collections::HashMap;

use common::{
    config_zero, model, nvme_params, on_ranks, serial, tokens, train_losses, Params, WORLD,
};
use tch::{nn, Kind, Tensor};
use zrt::collectives::local::LocalRank;
use zrt::collectives::ProcessGroup;
use zrt::zero::flat::FlatLayout;
use zrt::zero::{glue, AutoHints, Config, Engine};

/// The frozen base: the token embedding (a unit with nothing else to
/// train), all of the last block (a frozen unit backward passes through)
/// and every other block's `fc` and `out` weights (the biggest tensors of
/// the GPT; the rest trains, as LoRA adapters would).
pub(crate) fn is_frozen(name: &str) -> bool {
    let mlp = name.ends_with(".fc.weight") || name.ends_with(".out.weight");
    name.starts_with("wte.") || name.starts_with("h.1.") || (name.starts_with("h.") && mlp)
}

/// The test GPT with its frozen base; rank 1's base is scrambled before
/// the engine is built (the engine must give it rank 0's).
fn frozen_model(rank: usize) -> (nn::VarStore, zrt::zero::ShardPlan, zrt::gpt::Gpt) {
    frozen_model_by(rank, is_frozen)
}

/// As [`frozen_model`], freezing what `frozen` names.
fn frozen_model_by(
    rank: usize,
    frozen: fn(&str) -> bool,
) -> (nn::VarStore, zrt::zero::ShardPlan, zrt::gpt::Gpt) {
    frozen_model_in(rank, frozen, Kind::Float)
}

/// As [`frozen_model_by`], the frozen base cast to `base` first (a LoRA
/// base loaded in bf16).
pub(crate) fn frozen_model_in(
    rank: usize,
    frozen: fn(&str) -> bool,
    base: Kind,
) -> (nn::VarStore, zrt::zero::ShardPlan, zrt::gpt::Gpt) {
    let (vs, plan, gpt) = model();
    for (name, mut t) in vs.variables() {
        if frozen(&name) {
            let _ = t.set_requires_grad(false);
            t.set_data(&t.to_kind(base));
            if rank == 1 {
                let _ = tch::no_grad(|| t.shallow_clone().fill_(0.25));
            }
        }
    }
    (vs, plan, gpt)
}

/// The frozen base as the model created it (fp32), by name.
fn base() -> HashMap<String, Vec<f32>> {
    let (vs, _, _) = model();
    vs.variables()
        .into_iter()
        .filter(|(n, _)| is_frozen(n))
        .map(|(n, t)| (n, values(&t)))
        .collect()
}

pub(crate) fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

/// The frozen base as the engine holds it, gathered (a collective).
pub(crate) fn gathered_base<G: ProcessGroup + 'static>(
    e: &Engine<G>,
    vs: &nn::VarStore,
    frozen: fn(&str) -> bool,
) -> HashMap<String, (Kind, Vec<f32>)> {
    e.with_full_params(|| {
        vs.variables()
            .into_iter()
            .filter(|(n, _)| frozen(n))
            .map(|(n, t)| (n, (t.kind(), values(&t))))
            .collect()
    })
    .unwrap()
}

/// What a run left: rank 0's trained parameters and losses, and every
/// rank's gathered frozen base.
pub(crate) struct Run {
    pub(crate) params: Params,
    pub(crate) losses: Vec<f64>,
    pub(crate) bases: Vec<HashMap<String, (Kind, Vec<f32>)>>,
    /// Bytes rank 0 sent in all-gathers over the engine's group in training.
    pub(crate) world_gathered: u64,
}

/// Trains 3 steps on `world` ranks under `cfg` (`from_config`, so hpZ
/// keys make their groups).
fn run(cfg: &Config, world: usize) -> Run {
    run_by(cfg, world, is_frozen)
}

/// As [`run`], freezing what `frozen` names.
fn run_by(cfg: &Config, world: usize, frozen: fn(&str) -> bool) -> Run {
    run_in(cfg, world, frozen, Kind::Float)
}

/// As [`run_by`], the frozen base cast to `base` first.
pub(crate) fn run_in(cfg: &Config, world: usize, frozen: fn(&str) -> bool, base: Kind) -> Run {
    run_model(cfg, world, frozen, |rank| {
        frozen_model_in(rank, frozen, base)
    })
}

/// As [`run_in`], each rank's model made by `make` (given the rank).
pub(crate) fn run_model(
    cfg: &Config,
    world: usize,
    frozen: fn(&str) -> bool,
    make: impl Fn(usize) -> (nn::VarStore, zrt::zero::ShardPlan, zrt::gpt::Gpt) + Sync,
) -> Run {
    let out = on_ranks(world, |mut r: LocalRank| {
        let (vs, plan, gpt) = make(r.rank());
        let e = Engine::from_config(&vs, &plan, cfg, &mut r, &AutoHints::default()).unwrap();
        let losses = train_losses(&gpt, &e, r.rank(), 3);
        let gathered = e
            .group()
            .stats()
            .snapshot()
            .iter()
            .filter(|o| o.op == "all_gather")
            .map(|o| o.bytes_sent)
            .sum();
        (
            e.gathered_params().unwrap(),
            losses,
            gathered_base(&e, &vs, frozen),
            gathered,
        )
    });
    let bases = out.iter().map(|o| o.2.clone()).collect();
    let (params, losses, _, world_gathered) = out.into_iter().next().unwrap();
    Run {
        params,
        losses,
        bases,
        world_gathered,
    }
}

pub(crate) fn cfg(stage: u8, extra: &str, zero: &str) -> Config {
    let zero = format!(r#"{zero} "stage3_param_persistence_threshold": 0,"#);
    config_zero(stage, 1, 0.5, extra, &zero)
}

#[test]
fn a_sharded_frozen_base_trains_exactly_as_a_replicated_one() {
    let _serial = serial();
    let want = base();
    let dir = std::env::temp_dir().join(format!("zrt-frozen-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bf16 = r#""bf16": {"enabled": true},"#;
    // The third: a base loaded in bf16 for bf16 training is sharded as it
    // is, and trains to the same bits as an fp32 base the engine casts.
    let cases = [
        ("", Kind::Float, Kind::Float),
        (bf16, Kind::BFloat16, Kind::Float),
        (bf16, Kind::BFloat16, Kind::BFloat16),
    ];
    for (extra, kind, base_kind) in cases {
        // Stage 0 keeps the base whole on every rank: the reference (of
        // the fp32 base).
        let reference = run(&cfg(0, extra, ""), WORLD);
        assert!(
            !reference.params.iter().any(|(n, _)| is_frozen(n)),
            "a frozen parameter has no master copy"
        );
        let nvme = nvme_params(&dir);
        for (stage, zero) in [(0u8, ""), (1, ""), (2, ""), (3, ""), (3, nvme.as_str())] {
            let what = format!("stage {stage} {extra} {zero} base {base_kind:?}");
            let got = run_in(&cfg(stage, extra, zero), WORLD, is_frozen, base_kind);
            assert_eq!(got.params, reference.params, "{what}");
            assert_eq!(got.losses, reference.losses, "{what}");
            for b in got.bases.iter().chain(&reference.bases) {
                assert_eq!(b.len(), want.len());
                for (n, (k, v)) in b {
                    // fp32 values as rank 0 created them; bf16 training
                    // casts them as DeepSpeed's module.bfloat16() does.
                    assert_eq!(*k, kind, "{what}: {n}");
                    let w = Tensor::from_slice(&want[n]).to_kind(kind);
                    assert_eq!(v, &values(&w), "{what}: {n} is rank 0's, untouched");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each block's attention frozen, its first norm too, the MLP training:
/// a block's last trained gradient (its second norm's) comes before
/// backward runs the frozen attention for the block's input gradient.
fn is_attention(name: &str) -> bool {
    [".ln1.", ".qkv.", ".proj."]
        .iter()
        .any(|p| name.contains(p))
}

#[test]
fn a_unit_stays_gathered_until_its_frozen_matrices_gave_its_input_gradient() {
    let _serial = serial();
    // Freed at its last trained gradient, the block's frozen attention
    // was read freed, stopping the process; now stage 3 trains as stage 0.
    let reference = run_by(&cfg(0, "", ""), WORLD, is_attention);
    let got = run_by(&cfg(3, "", ""), WORLD, is_attention);
    assert!(reference.params.iter().all(|(n, _)| !is_attention(n)));
    assert_eq!(got.params, reference.params);
    assert_eq!(got.losses, reference.losses);
}

#[test]
fn an_evaluation_forward_with_autograd_on_leaves_the_next_backward_freeing_frozen_units() {
    let _serial = serial();
    // `h.1` is frozen whole: backward frees it at its input's gradient,
    // before `h.0`'s gradients. A forward whose graph was dropped without
    // a backward (an evaluation that forgot no_grad) once left a count of
    // input gradients to wait for, and `h.1` stayed gathered through the
    // next backward: the whole frozen base gathered at once.
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = frozen_model(r.rank());
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg(3, "", ""), g, &AutoHints::default()).unwrap();
        let vars = vs.variables();
        let frozen = vars["h.1.fc.weight"].shallow_clone();
        for step in 0..3 {
            if step > 0 {
                // Evaluation with autograd on: the loss and its graph are
                // dropped unused.
                let _ = gpt.loss(&tokens(step, 1, r.rank(), 1)).double_value(&[]);
            }
            let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let seen2 = seen.clone();
            let probe = frozen.shallow_clone();
            glue::on_grad(&vars["h.0.qkv.weight"], move || {
                seen2
                    .lock()
                    .unwrap()
                    .push(glue::storage_nbytes(&probe).unwrap());
            })
            .unwrap();
            e.backward(&gpt.loss(&tokens(step, 0, r.rank(), 1)))
                .unwrap();
            e.step().unwrap();
            // (Earlier steps' probes stay registered, filling their own lists.)
            let seen = seen.lock().unwrap().clone();
            assert_eq!(seen.last(), Some(&0), "step {step}: {seen:?}");
        }
    });
}

#[test]
fn hpz_regathers_a_sharded_frozen_base_with_the_same_results() {
    let _serial = serial();
    let plain = run(&cfg(3, "", ""), 4);
    let hpz = run(&cfg(3, "", r#""zero_hpz_partition_size": 2,"#), 4);
    assert_eq!(hpz.params, plain.params);
    assert_eq!(hpz.losses, plain.losses);
    // Backward re-gathers frozen parts inside the pairs too, from the
    // copies forward kept: the world's all-gathers carry 66% of the plain
    // run's bytes (94% when only the trainable part is re-gathered so).
    // Byte counts, not timings: deterministic.
    assert!(
        hpz.world_gathered * 10 < plain.world_gathered * 7,
        "world all-gather bytes: hpZ {} vs plain {}",
        hpz.world_gathered,
        plain.world_gathered
    );
}

/// Elements of each rank's shard of a flat buffer over `names` (shapes
/// from `vs`) on `world` ranks.
fn shard_len(vs: &nn::VarStore, names: &[String], world: usize) -> usize {
    let vars = vs.variables();
    let layout = FlatLayout::new(
        names.iter().map(|n| (n.clone(), vars[n].size())).collect(),
        world,
    );
    layout.shard_len()
}

/// Per unit of `e`: whether it is the root, and the elements of each
/// rank's shard of its trainable and of its frozen parameters on
/// [`WORLD`] ranks (the root has no frozen ones: asserted).
pub(crate) fn unit_shards<G: ProcessGroup + 'static>(
    e: &Engine<G>,
    vs: &nn::VarStore,
) -> Vec<(bool, usize, usize)> {
    let names: Vec<String> = vs.variables().keys().cloned().collect();
    let units = e.unit_names();
    units
        .iter()
        .map(|unit| {
            let under = |n: &String| match unit.as_str() {
                "<root>" => !units.iter().any(|u| n.starts_with(&format!("{u}."))),
                u => n.starts_with(&format!("{u}.")),
            };
            let (frozen, trained): (Vec<String>, Vec<String>) = names
                .iter()
                .filter(|n| under(n))
                .cloned()
                .partition(|n| is_frozen(n));
            let root = unit == "<root>";
            assert!(!root || frozen.is_empty(), "{frozen:?}");
            (
                root,
                shard_len(vs, &trained, WORLD),
                shard_len(vs, &frozen, WORLD),
            )
        })
        .collect()
}

#[test]
fn between_steps_a_rank_holds_its_shard_of_the_frozen_base_and_nothing_more() {
    let _serial = serial();
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = frozen_model(r.rank());
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg(3, "", ""), g, &AutoHints::default()).unwrap();
        let loss = gpt.loss(&tokens(0, 0, r.rank(), 1));
        e.backward(&loss).unwrap();
        e.step().unwrap();
        let vars = vs.variables();
        // fp32 stage 3, per unit: master, m, v and gradient shards of the
        // trainable parameters (16 bytes an element of the shard), and the
        // frozen ones' shard (4 bytes); the root stays gathered besides.
        let units = unit_shards(&e, &vs);
        let want: usize = units
            .iter()
            .map(|&(root, t, f)| 16 * t + if root { 4 * t * WORLD } else { 4 * f })
            .sum();
        assert_eq!(e.model_state_bytes().unwrap(), want);
        // In 16 bits the trainable shards add their 16-bit copy (2 bytes),
        // and the frozen shards and the gathered root hold 2 bytes an element.
        for precision in ["bf16", "fp16"] {
            let (vs16, plan16, gpt16) = frozen_model(r.rank());
            let on = format!(r#""{precision}": {{"enabled": true}},"#);
            let g = r.new_group(&[0, 1]).unwrap();
            let e16 =
                Engine::new(&vs16, &plan16, &cfg(3, &on, ""), g, &AutoHints::default()).unwrap();
            e16.backward(&gpt16.loss(&tokens(0, 0, r.rank(), 1)))
                .unwrap();
            e16.step().unwrap();
            let want16: usize = units
                .iter()
                .map(|&(root, t, f)| 18 * t + if root { 2 * t * WORLD } else { 2 * f })
                .sum();
            assert_eq!(e16.model_state_bytes().unwrap(), want16, "{precision}");
        }
        for n in vars.keys().filter(|n| is_frozen(n)) {
            assert_eq!(glue::storage_nbytes(&vars[n]).unwrap(), 0, "{n} is freed");
        }
        // Gathered, every unit's whole buffers, trainable and frozen, are
        // counted too.
        let gathered: usize = units
            .iter()
            .filter(|u| !u.0)
            .map(|&(_, t, f)| 4 * WORLD * (t + f))
            .sum();
        let inside = e.with_full_params(|| e.model_state_bytes()).unwrap();
        assert_eq!(inside.unwrap(), want + gathered);
        // Gathered, it has its memory back; freed again after.
        let n = "h.0.fc.weight";
        let held = e
            .with_full_params(|| glue::storage_nbytes(&vars[n]).unwrap())
            .unwrap();
        assert_eq!(
            held,
            shard_len(&vs, &[n.into(), "h.0.out.weight".into()], WORLD) * WORLD * 4
        );
        assert_eq!(glue::storage_nbytes(&vars[n]).unwrap(), 0);
    });
}

#[test]
fn a_checkpoint_moves_the_frozen_base_between_sharded_and_replicated() {
    let _serial = serial();
    let bf16 = r#""bf16": {"enabled": true},"#;
    // fp32, and a bf16 base under bf16 training (sharded as bf16, saved
    // as bf16: as a replicated bf16 base is).
    for (extra, base_kind) in [("", Kind::Float), (bf16, Kind::BFloat16)] {
        checkpoint_round_trip(extra, base_kind);
    }
}

fn checkpoint_round_trip(extra: &str, base_kind: Kind) {
    let dir = std::env::temp_dir().join(format!(
        "zrt-frozen-ckpt-{}-{base_kind:?}",
        std::process::id()
    ));
    let want: HashMap<String, Vec<f32>> = base()
        .into_iter()
        .map(|(n, v)| (n, values(&Tensor::from_slice(&v).to_kind(base_kind))))
        .collect();
    let export = dir.join("model.safetensors");
    let swap_dir = dir.join("swap");
    std::fs::create_dir_all(&swap_dir).unwrap();
    // Stage 3 keeps its frozen shards in a swap file (`offload_param`):
    // saved from it, loaded into it.
    let at = |stage: u8| match stage {
        3 => cfg(3, extra, &nvme_params(&swap_dir)),
        s => cfg(s, extra, ""),
    };
    for (from, to) in [(3u8, 2u8), (2, 3)] {
        let tag = format!("from{from}");
        on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = frozen_model_in(r.rank(), is_frozen, base_kind);
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &at(from), g, &AutoHints::default()).unwrap();
            if from == 3 && r.rank() == 0 {
                // Sharded: freed between steps, whatever its dtype.
                assert_eq!(
                    glue::storage_nbytes(&vs.variables()["h.0.fc.weight"]).unwrap(),
                    0
                );
            }
            let loss = gpt.loss(&tokens(0, 0, r.rank(), 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
            e.save_checkpoint(&dir, &tag).unwrap();
            e.save_16bit_model(&export).unwrap();
        });
        // The checkpoint holds the base in the dtype the model created it
        // in, whether it was sharded or not.
        let saved: HashMap<String, Tensor> =
            Tensor::read_safetensors(dir.join(&tag).join("frozen.safetensors"))
                .unwrap()
                .into_iter()
                .collect();
        for n in want.keys() {
            assert_eq!(saved[n].kind(), base_kind, "stage {from}: {n}");
        }
        let consolidated = dir.join("consolidated.safetensors");
        zrt::zero::checkpoint::consolidate(
            &dir,
            Some(&tag),
            &consolidated,
            zrt::zero::checkpoint::ExportDtype::F32,
        )
        .unwrap();
        // Exported in bf16, an fp32 base is cast and a bf16 one kept.
        let in_bf16 = dir.join("consolidated-bf16.safetensors");
        zrt::zero::checkpoint::consolidate(
            &dir,
            Some(&tag),
            &in_bf16,
            zrt::zero::checkpoint::ExportDtype::Bf16,
        )
        .unwrap();
        let file: HashMap<String, Tensor> = Tensor::read_safetensors(&in_bf16)
            .unwrap()
            .into_iter()
            .collect();
        for (n, v) in &want {
            assert_eq!(file[n].kind(), Kind::BFloat16, "stage {from}: {n}");
            let cast = values(&Tensor::from_slice(v).to_kind(Kind::BFloat16));
            assert_eq!(values(&file[n]), cast, "stage {from}: bf16 export of {n}");
        }
        for f in [&export, &consolidated] {
            let file: HashMap<String, Tensor> =
                Tensor::read_safetensors(f).unwrap().into_iter().collect();
            for (n, v) in &want {
                assert_eq!(
                    &values(&file[n]),
                    v,
                    "stage {from}: {} holds {n}",
                    f.display()
                );
            }
        }
        on_ranks(WORLD, |r| {
            // Another base everywhere: the load must replace it.
            let (vs, plan, _) = frozen_model_in(1, is_frozen, base_kind);
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &at(to), g, &AutoHints::default()).unwrap();
            assert_ne!(
                gathered_base(&e, &vs, is_frozen)["h.0.fc.weight"].1,
                want["h.0.fc.weight"]
            );
            e.load_checkpoint(&dir, Some(&tag)).unwrap();
            for (n, (_, v)) in gathered_base(&e, &vs, is_frozen) {
                assert_eq!(v, want[&n], "stage {from} -> {to}: {n}");
            }
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// LoRA's shape under DeepSpeed's default threshold: every big block weight
/// frozen, so what trains in a block (biases, norms) is all under
/// `stage3_param_persistence_threshold`.
fn is_big_block_weight(name: &str) -> bool {
    name.starts_with("h.") && name.ends_with(".weight") && !name.contains(".ln")
}

#[test]
fn small_trainable_parameters_do_not_keep_a_large_frozen_base_gathered() {
    let _serial = serial();
    let zero = r#""stage3_param_persistence_threshold": 1000,"#;
    // No clipping: the threshold moves parameters between units at stage 3
    // only, which changes the order the global norm sums in.
    let at3 = config_zero(3, 1, 0.0, "", zero);
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = frozen_model_by(r.rank(), is_big_block_weight);
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &at3, g, &AutoHints::default()).unwrap();
        e.backward(&gpt.loss(&tokens(0, 0, r.rank(), 1))).unwrap();
        e.step().unwrap();
        let vars = vs.variables();
        let bytes = |n: &str| glue::storage_nbytes(&vars[n]).unwrap();
        // The blocks are units still: their frozen weights and their small
        // trainable ones are freed between steps.
        assert!(e.unit_names().contains(&"h.0".to_string()));
        for n in [
            "h.0.fc.weight",
            "h.0.qkv.weight",
            "h.0.proj.weight",
            "h.0.fc.bias",
        ] {
            assert_eq!(bytes(n), 0, "{n}");
        }
    });
    // And it trains as the replicated reference does (the threshold moves
    // `head.bias` to the root: compare by name).
    let by_name = |cfg: &Config| {
        let mut p = run_by(cfg, WORLD, is_big_block_weight).params;
        p.sort_by(|a, b| a.0.cmp(&b.0));
        p
    };
    assert_eq!(by_name(&at3), by_name(&config_zero(0, 1, 0.0, "", zero)));
}

#[test]
fn offload_param_keeps_the_frozen_shards_in_a_swap_file_read_ahead_in_run_order() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("zrt-frozen-nvme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let swaps = || {
        std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".swap"))
            .count()
    };
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = frozen_model(r.rank());
        let g = r.new_group(&[0, 1]).unwrap();
        // 4 KiB chunks: each swap's 2 buffers hold 8 KiB.
        let at3 = cfg(3, r#""aio": {"block_size": 4096},"#, &nvme_params(&dir));
        let e = Engine::new(&vs, &plan, &at3, g, &AutoHints::default()).unwrap();
        let mut read_ahead = Vec::new();
        for step in 0..2 {
            e.backward(&gpt.loss(&tokens(step, 0, r.rank(), 1)))
                .unwrap();
            e.step().unwrap();
            read_ahead.push(e.overlap_counts().frozen_read_ahead);
        }
        // Once the first forward has shown the units' order, the swap reads
        // each unit's frozen shard ahead with its trainable one, in the
        // order they run: forward's h.0 (while wte is gathered) and h.1,
        // backward's h.0 (while h.1 is). Not wte first in forward, nor h.1
        // right after the head in backward: nothing comes before them; nor
        // wte in backward, which never reaches it (its output needs no
        // gradient), so it is not gathered there at all. (Guessed by
        // index, as in the first step, forward finds only h.1's.)
        assert_eq!(read_ahead[1] - read_ahead[0], 3, "{read_ahead:?}");
        // In memory: the trainable parameters' m, v and gradient shards
        // (their fp32 master, the gather source, is in the swap), the
        // root's gathered buffer and the two swaps' buffers; of the frozen
        // base, at most one unit's shard read ahead and not gathered yet.
        let units = unit_shards(&e, &vs);
        let want: usize = units
            .iter()
            .map(|&(root, t, _)| 12 * t + if root { 4 * t * WORLD } else { 0 })
            .sum::<usize>()
            + 2 * 2 * 4096;
        let held = e.model_state_bytes().unwrap() as i64 - want as i64;
        assert!(
            held == 0 || units.iter().any(|u| 4 * u.2 as i64 == held),
            "{held} bytes more than the trainable state and the buffers; frozen shards {units:?}"
        );
        let barrier = || drop(e.group().all_gather(vec![0u8], Vec::new()).wait().unwrap());
        barrier();
        // Per rank: the trainable gather sources' file and the frozen one
        // (training from them is in `a_sharded_frozen_base_trains_...`).
        assert_eq!(swaps(), 2 * WORLD);
        barrier();
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_forward_whose_gathers_fail_runs_on_zeros_and_the_next_call_names_the_dead_rank() {
    let _serial = serial();
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = frozen_model(r.rank());
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg(3, "", ""), g, &AutoHints::default()).unwrap();
        e.backward(&gpt.loss(&tokens(0, 0, r.rank(), 1))).unwrap();
        e.step().unwrap();
        if r.rank() == 1 {
            // Leaves: its engine and group drop as the thread ends.
            return;
        }
        // Rank 0's next forward cannot gather. Its units get zeroed memory
        // (frozen and trainable), not freed memory a read would stop the
        // process on: the forward runs to a loss, and the error waits for
        // the next engine call.
        let t = std::time::Instant::now();
        let loss = gpt.loss(&tokens(1, 0, 0, 1));
        assert!(loss.double_value(&[]).is_finite());
        let err = e.backward(&loss).unwrap_err().to_string();
        // The collectives' own error, not an explanation for another
        // cause (a peer checkpointing also fails a training collective).
        assert!(
            err.starts_with("rank 1 of group") && err.contains("died or left the group"),
            "{err}"
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(30));
    });
}

/// The frozen base and the root's position embedding (a frozen parameter
/// every rank keeps whole at stage 3 too).
fn is_frozen_or_wpe(name: &str) -> bool {
    is_frozen(name) || name.starts_with("wpe.")
}

#[test]
fn under_hybrid_sharding_every_rank_takes_world_rank_0s_frozen_values() {
    let _serial = serial();
    let (vs, _, _) = model();
    let want: HashMap<String, Vec<f32>> = vs
        .variables()
        .into_iter()
        .filter(|(n, _)| is_frozen_or_wpe(n))
        .map(|(n, t)| (n, values(&t)))
        .collect();
    // World 4, mics_shard_size 2: shard groups {0, 1} and {2, 3}, replicas
    // {0, 2} and {1, 3}. Every rank but world rank 0 starts from values of
    // its own.
    let at3 = cfg(3, "", r#""mics_shard_size": 2,"#);
    let bases = on_ranks(4, |mut r| {
        let (vs, plan, _) = model();
        for (name, t) in vs.variables() {
            if is_frozen_or_wpe(&name) {
                let _ = t.set_requires_grad(false);
                if r.rank() > 0 {
                    let _ = tch::no_grad(|| t.shallow_clone().fill_(r.rank() as f64));
                }
            }
        }
        let e = Engine::from_config(&vs, &plan, &at3, &mut r, &AutoHints::default()).unwrap();
        gathered_base(&e, &vs, is_frozen_or_wpe)
    });
    for (rank, base) in bases.iter().enumerate() {
        assert_eq!(base.len(), want.len());
        for (n, (_, v)) in base {
            assert_eq!(v, &want[n], "world rank {rank}: {n} is world rank 0's");
        }
    }
}

#[test]
fn a_checkpoint_with_a_frozen_variable_this_model_lacks_is_refused_naming_it() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("zrt-frozen-extra-{}", std::process::id()));
    // The loading model has frozen variables of both kinds (sharded in its
    // blocks, replicated at the root: `wpe`), the saving one a buffer more.
    let at3 = cfg(3, "", "");
    let errs = [true, false].map(|saver| {
        on_ranks(WORLD, |r| {
            let (vs, plan, _) = frozen_model_by(r.rank(), is_frozen_or_wpe);
            if saver {
                let _ = vs.root().zeros_no_train("extra", &[4]);
            }
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &at3, g, &AutoHints::default()).unwrap();
            if saver {
                e.save_checkpoint(&dir, "t").unwrap();
                return String::new();
            }
            e.load_checkpoint(&dir, Some("t")).unwrap_err().to_string()
        })
    });
    for (rank, err) in errs[1].iter().enumerate() {
        assert!(
            err.contains("the checkpoint is of another model: unexpected 1: extra;"),
            "rank {rank}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

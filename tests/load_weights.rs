//! `Engine::load_weights`: a whole-model safetensors file loaded into a
//! built engine, each rank reading its own range. A run that loads it so
//! must end with the bits of a run whose VarStore held the same values
//! before its engine was built, on any stage and world size; what the
//! file does not match is refused on every rank, naming it, and changes
//! nothing. `ShardPlan::weights_from_file` builds the model on no rank
//! and loads the file as the engine is built: the same bits again.

use std::path::{Path, PathBuf};

use crate::common;

use common::{config_zero, freeze, model, on_ranks, scratch, train_losses};
use common::{Params, BF16, SHARD_ALL};
use tch::{Kind, Tensor};
use zrt::collectives::local::LocalGroup;
use zrt::zero::{Config, Engine, LoadedWeights};

/// Frozen: `wpe` stays whole in the root, `h.1.fc` is a unit's frozen
/// part at stage 3.
const FROZEN: &[&str] = &["wpe", "h.1.fc"];

/// The engine of the test GPT (seed 0, `FROZEN` frozen) on `world` ranks.
fn gpt_engine(
    r: &zrt::collectives::local::LocalRank,
    world: usize,
    cfg: &Config,
    before: impl FnOnce(&mut tch::nn::VarStore),
) -> (Engine<LocalGroup>, zrt::gpt::Gpt) {
    let (mut vs, plan, gpt) = model();
    before(&mut vs);
    freeze(&vs, FROZEN);
    let group = r.new_group(&(0..world).collect::<Vec<_>>()).unwrap();
    let hints = zrt::zero::AutoHints::default();
    (Engine::new(&vs, &plan, cfg, group, &hints).unwrap(), gpt)
}

/// A file of the test GPT's weights after 2 steps at stage 3 on 2 ranks
/// (fp32, or bf16 values with `BF16`), frozen variables included: every
/// variable set to known values first, so that none is what seed 0 gives
/// it (the frozen ones do not train).
fn trained_file(dir: &Path, extra: &str) -> PathBuf {
    let file = dir.join(format!("trained{}.safetensors", extra.len()));
    let cfg = config_zero(3, 1, 1.0, extra, SHARD_ALL);
    on_ranks(2, |r| {
        let (e, gpt) = gpt_engine(&r, 2, &cfg, |vs| common::known_values(vs, 0.3, 0.1));
        train_losses(&gpt, &e, r.rank(), 2);
        e.save_16bit_model(&file).unwrap();
    });
    file
}

/// The file's tensors by name, widened to f32.
fn file_values(file: &Path) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Vec<f32>)> = (Tensor::read_safetensors(file).unwrap().into_iter())
        .map(|(n, t)| {
            let w = t.to_kind(Kind::Float).flatten(0, -1);
            (n, Vec::<f32>::try_from(&w).unwrap())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The reference of a load: on `world` ranks, the VarStore takes `file`
/// before the engine is built, which trains `steps` steps; each rank's
/// losses and parameters.
fn loaded_before(file: &Path, world: usize, cfg: &Config, steps: usize) -> Vec<(Vec<f64>, Params)> {
    on_ranks(world, |r| {
        let (e, gpt) = gpt_engine(&r, world, cfg, |vs| vs.load(file).unwrap());
        let losses = train_losses(&gpt, &e, r.rank(), steps);
        (losses, e.gathered_params().unwrap())
    })
}

/// Asserts every parameter of `params` holds the file's values exactly.
fn holds_the_file(params: &Params, file: &[(String, Vec<f32>)], what: &str) {
    for (name, v) in params {
        let (_, w) = (file.iter().find(|(n, _)| n == name))
            .unwrap_or_else(|| panic!("{what}: `{name}` not in the file"));
        assert!(
            common::bits_equal(v, w),
            "{what}: `{name}` does not hold the file's values"
        );
    }
}

#[test]
fn a_file_loaded_into_a_built_engine_trains_as_one_loaded_into_the_model_before_it() {
    let dir = scratch("load-weights-parity");
    let file = trained_file(&dir, "");
    let values = file_values(&file);
    let steps = 3;
    // Stage 3 with the optimizer's and the parameters' swaps on NVMe: in
    // bf16 the swap holds the master, in fp32 the parameter swap does.
    let swaps = dir.join("swaps");
    std::fs::create_dir_all(&swaps).unwrap();
    let (aio, off) = common::nvme(&swaps);
    let swapped = format!("{SHARD_ALL} {off} {}", common::nvme_params(&swaps));
    let bf16_aio = format!("{BF16} {aio}");
    for (stage, world, extra, zero) in [
        (0, 3, "", SHARD_ALL),
        (1, 2, "", SHARD_ALL),
        (2, 3, "", SHARD_ALL),
        (3, 3, "", SHARD_ALL),
        (3, 2, BF16, SHARD_ALL),
        (3, 2, &aio[..], &swapped[..]),
        (3, 3, &bf16_aio[..], &swapped[..]),
    ] {
        let what = format!("stage {stage} on {world} ranks {extra} {zero}");
        let cfg = config_zero(stage, 1, 1.0, extra, zero);
        let want = loaded_before(&file, world, &cfg, steps);
        // Loaded after 2 steps of its own: the optimizer starts afresh.
        let got = on_ranks(world, |r| {
            let (e, gpt) = gpt_engine(&r, world, &cfg, |_| {});
            train_losses(&gpt, &e, r.rank(), 2);
            let report = e.load_weights(&file, true).unwrap();
            let loaded = e.gathered_params().unwrap();
            let losses = train_losses(&gpt, &e, r.rank(), steps);
            (report, loaded, losses, e.gathered_params().unwrap())
        });
        for (rank, ((report, loaded, losses, params), (want_losses, want_params))) in
            got.into_iter().zip(want).enumerate()
        {
            let what = format!("{what}, rank {rank}");
            // Every variable of the model, trainable and frozen.
            assert_eq!(
                report,
                LoadedWeights {
                    loaded: values.len(),
                    missing: vec![],
                    unexpected: vec![],
                },
                "{what}"
            );
            if !extra.contains("bf16") {
                holds_the_file(&loaded, &values, &what);
            }
            assert_eq!(losses, want_losses, "{what}");
            common::assert_bits(&what, &params, &want_params);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_16_bit_export_loads_widened_and_a_file_tch_wrote_loads_without_a_checksum() {
    let dir = scratch("load-weights-kinds");
    let bf16 = trained_file(&dir, BF16);
    let values = file_values(&bf16);
    // tch's own writer: no zrt_crc32 in the header.
    let plain = dir.join("tch.safetensors");
    let (vs, _, _) = model();
    common::known_values(&vs, 0.5, 0.25);
    vs.save(&plain).unwrap();
    let tch_values = file_values(&plain);
    let cfg = config_zero(2, 1, 1.0, "", "");
    let got = on_ranks(2, |r| {
        let (e, _) = gpt_engine(&r, 2, &cfg, |_| {});
        e.load_weights(&bf16, true).unwrap();
        let from_bf16 = e.gathered_params().unwrap();
        e.load_weights(&plain, true).unwrap();
        (from_bf16, e.gathered_params().unwrap())
    });
    for (from_bf16, from_tch) in got {
        // Every value a bf16 one, read exactly.
        holds_the_file(&from_bf16, &values, "bf16 export");
        assert!(values
            .iter()
            .all(|(_, v)| v.iter().all(|x| x.to_bits() & 0xffff == 0)));
        holds_the_file(&from_tch, &tch_values, "tch's file");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes `tensors` as a safetensors file `dir/name`.
fn write(dir: &Path, name: &str, tensors: &[(String, Tensor)]) -> PathBuf {
    let path = dir.join(name);
    Tensor::write_safetensors(tensors, &path).unwrap();
    path
}

/// The test GPT's variables, as its VarStore names them, sorted.
fn gpt_tensors() -> Vec<(String, Tensor)> {
    let (vs, _, _) = model();
    let mut v: Vec<(String, Tensor)> = (vs.variables().into_iter())
        .map(|(n, t)| (n, t.detach().copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Another handle on each of `v`'s tensors (their storage shared).
fn handles(v: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    v.iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect()
}

/// Loads `file` (rank r: `files[r]`) under `cfg` on 2 ranks: each rank's
/// error text, and whether its parameters are still those it was built
/// with.
fn refusals(cfg: &Config, files: [&Path; 2], strict: bool) -> Vec<(String, bool)> {
    on_ranks(2, |r| {
        let (e, _) = gpt_engine(&r, 2, cfg, |_| {});
        let before = e.gathered_params().unwrap();
        let err = e.load_weights(files[r.rank()], strict).unwrap_err();
        (err.to_string(), e.gathered_params().unwrap() == before)
    })
}

#[test]
fn what_the_file_does_not_match_is_refused_on_every_rank_and_changes_nothing() {
    let dir = scratch("load-weights-refused");
    let all = gpt_tensors();
    let names: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
    let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
    let lacking = write(&dir, "lacking.safetensors", &all[1..]);
    let mut more = handles(&all);
    more.push((
        "extra.bias".into(),
        Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)),
    ));
    let more = write(&dir, "more.safetensors", &more);
    // `names[1]` is h.0.fc's weight (2-D), `names[2]` a layer norm's bias.
    let mut wrong = handles(&all);
    wrong[1].1 = wrong[1].1.flatten(0, -1);
    wrong[2].1 = wrong[2].1.to_kind(Kind::Int64);
    let wrong = write(&dir, "wrong.safetensors", &wrong);
    let none = write(
        &dir,
        "none.safetensors",
        &[(
            "x".into(),
            Tensor::ones([1], (Kind::Float, tch::Device::Cpu)),
        )],
    );
    let absent = dir.join("absent.safetensors");
    let other = write(&dir, "other.safetensors", &all);
    let mut shifted = handles(&all);
    shifted[0].1 = &shifted[0].1 + 1.0;
    let shifted = write(&dir, "shifted.safetensors", &shifted);
    // A stage-3 unit's frozen part (h.1.fc's weight and bias) half there.
    let half_frozen: Vec<(String, Tensor)> = (handles(&all).into_iter())
        .filter(|(n, _)| n != "h.1.fc.bias")
        .collect();
    let half_frozen = write(&dir, "half-frozen.safetensors", &half_frozen);
    let cases: Vec<([&Path; 2], bool, Vec<String>)> = vec![
        (
            [&lacking, &lacking],
            true,
            vec![
                format!(
                    "the weights file {} does not match the model: missing 1: {}",
                    lacking.display(),
                    names[0]
                ),
                "load it with strict = false".into(),
            ],
        ),
        (
            [&more, &more],
            true,
            vec![
                "unexpected 1: extra.bias".into(),
                "load it with strict = false".into(),
            ],
        ),
        (
            [&wrong, &wrong],
            false,
            vec![
                format!(
                    "mis-shaped 2: {}: file F32 [4096], model Float [128, 32]",
                    names[1]
                ),
                format!("{}: file I64 [32], model Float [32]", names[2]),
                "is another model's".into(),
            ],
        ),
        ([&none, &none], false, vec!["unexpected 1: x".into()]),
        (
            [&half_frozen, &half_frozen],
            false,
            vec!["it lacks frozen h.1.fc.bias of unit `h.1`".into()],
        ),
    ];
    for (files, strict, wants) in cases {
        for (rank, (err, unchanged)) in refusals(&cfg, files, strict).into_iter().enumerate() {
            for want in &wants {
                assert!(
                    err.contains(want.as_str()),
                    "rank {rank}: {err}\nwants: {want}"
                );
            }
            assert!(unchanged, "rank {rank} changed: {err}");
        }
    }
    // A byte of zrt's own file flipped: its checksum, on every rank.
    let flipped = trained_file(&dir, "");
    let mut bytes = std::fs::read(&flipped).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 1;
    std::fs::write(&flipped, bytes).unwrap();
    for (err, unchanged) in refusals(&cfg, [&flipped, &flipped], true) {
        let want = format!("checksum mismatch in {}", flipped.display());
        assert!(err.contains(&want), "{err}");
        assert!(unchanged, "{err}");
    }
    // A rank without the file: it says why, the other that it failed.
    let each = refusals(&cfg, [&other, &absent], true);
    assert!(
        each[0].0.starts_with("rank(s) [1] failed to load the weights file (their own errors say why); nothing was loaded"),
        "{}",
        each[0].0
    );
    assert!(
        each[1].0.contains(&format!(
            "cannot load weights from {}: no such file",
            absent.display()
        )),
        "{}",
        each[1].0
    );
    // Ranks given different files, each loadable alone.
    let each = refusals(&cfg, [&other, &shifted], true);
    let len = std::fs::metadata(&other).unwrap().len();
    for (err, unchanged) in each {
        let want = format!(
            "ranks read different weights files: rank 0 read {} ({len} bytes); rank 1 read {} ({len} bytes); nothing was loaded",
            other.display(),
            shifted.display()
        );
        assert!(err.contains(&want), "{err}");
        assert!(unchanged, "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_partial_load_keeps_what_the_file_lacks_and_skips_what_the_model_lacks() {
    let dir = scratch("load-weights-partial");
    let file = trained_file(&dir, "");
    let values = file_values(&file);
    // The file without its first variable, with one the model lacks.
    let (gone, _) = values[0].clone();
    let mut part: Vec<(String, Tensor)> = (values[1..].iter())
        .map(|(n, v)| (n.clone(), Tensor::from_slice(v)))
        .collect();
    let shapes = gpt_tensors();
    for (n, t) in &mut part {
        let (_, s) = shapes.iter().find(|(m, _)| m == n).unwrap();
        *t = t.view(s.size().as_slice());
    }
    part.push((
        "head.extra".into(),
        Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)),
    ));
    let part = write(&dir, "part.safetensors", &part);
    // In memory, and with the bf16 run's master in the optimizer's swap.
    let (aio, off) = common::nvme(&dir);
    for cfg in [
        config_zero(3, 1, 1.0, "", SHARD_ALL),
        config_zero(2, 1, 1.0, &format!("{BF16} {aio}"), &off),
    ] {
        partly_loaded(&cfg, &part, &values, &gone);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn under_hybrid_sharding_every_replica_reads_its_own_shard() {
    let dir = scratch("load-weights-hybrid");
    let file = trained_file(&dir, "");
    let values = file_values(&file);
    let cfg = config_zero(
        3,
        1,
        1.0,
        "",
        &format!(r#"{SHARD_ALL} "mics_shard_size": 2,"#),
    );
    let ranks = on_ranks(4, |mut r| {
        let (vs, plan, _) = model();
        freeze(&vs, FROZEN);
        let hints = zrt::zero::AutoHints::default();
        let e = Engine::from_config(&vs, &plan, &cfg, &mut r, &hints).unwrap();
        e.load_weights(&file, true).unwrap();
        e.gathered_params().unwrap()
    });
    for (rank, params) in ranks.iter().enumerate() {
        holds_the_file(params, &values, &format!("rank {rank}"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Loads `part` (the file's `values` but `gone`, and one tensor the model
/// lacks) under `cfg` on 2 ranks, not strictly: `gone` keeps its value,
/// every other parameter takes the file's.
fn partly_loaded(cfg: &Config, part: &Path, values: &[(String, Vec<f32>)], gone: &str) {
    let ranks = on_ranks(2, |r| {
        let (e, _) = gpt_engine(&r, 2, cfg, |_| {});
        let before = e.gathered_params().unwrap();
        let (report, logs) = common::with_logs(|| e.load_weights(part, false).unwrap());
        (report, logs, before, e.gathered_params().unwrap())
    });
    for (rank, (report, logs, before, after)) in ranks.into_iter().enumerate() {
        assert_eq!(
            report,
            LoadedWeights {
                loaded: values.len() - 1,
                missing: vec![gone.to_string()],
                unexpected: vec!["head.extra".into()],
            },
            "rank {rank}"
        );
        if rank == 0 {
            assert!(
                logs.contains(&format!("missing 1: {gone}; unexpected 1: head.extra")),
                "{logs}"
            );
        }
        for (name, v) in &after {
            let want = match name == gone {
                true => &before.iter().find(|(n, _)| n == name).unwrap().1,
                false => &values.iter().find(|(n, _)| n == name).unwrap().1,
            };
            assert!(v == want, "rank {rank}: `{name}`");
        }
    }
}

/// The test GPT built under `ShardPlan::weights_from_file(file)` (seed 0,
/// which the file's values replace): each variable's bytes held once it
/// is built, by name.
fn built_from_file(
    file: &Path,
) -> (
    tch::nn::VarStore,
    zrt::zero::ShardPlan,
    zrt::gpt::Gpt,
    Vec<(String, usize)>,
) {
    let (vs, plan, gpt) = common::seeded(|| {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let plan = zrt::zero::ShardPlan::new();
        plan.weights_from_file(&vs, file).unwrap();
        let gpt = zrt::gpt::Gpt::new(&vs.root(), &plan, &common::GPT);
        (vs, plan, gpt)
    });
    let held = (vs.variables().into_iter())
        .map(|(n, t)| (n, zrt::zero::glue::storage_nbytes(&t).unwrap()))
        .collect();
    (vs, plan, gpt, held)
}

#[test]
fn a_model_built_from_a_file_is_held_by_no_rank_and_trains_as_one_loaded_before() {
    let dir = scratch("weights-from-file");
    let file = trained_file(&dir, "");
    let steps = 3;
    for (stage, world, extra, zero) in [
        (0, 2, "", SHARD_ALL),
        (2, 3, "", SHARD_ALL),
        (3, 3, "", SHARD_ALL),
        (3, 2, BF16, SHARD_ALL),
    ] {
        let what = format!("stage {stage} on {world} ranks {extra}");
        let cfg = config_zero(stage, 1, 1.0, extra, zero);
        let want = loaded_before(&file, world, &cfg, steps);
        let got = on_ranks(world, |r| {
            let (vs, plan, gpt, held) = built_from_file(&file);
            freeze(&vs, FROZEN);
            let group = r.new_group(&(0..world).collect::<Vec<_>>()).unwrap();
            let hints = zrt::zero::AutoHints::default();
            let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
            let losses = train_losses(&gpt, &e, r.rank(), steps);
            (held, losses, e.gathered_params().unwrap())
        });
        for (rank, ((held, losses, params), (want_losses, want_params))) in
            got.into_iter().zip(want).enumerate()
        {
            let what = format!("{what}, rank {rank}");
            assert!(held.len() > 10, "{what}: {held:?}");
            for (name, bytes) in held {
                assert_eq!(bytes, 0, "{what}: `{name}` held while built");
            }
            assert_eq!(losses, want_losses, "{what}");
            common::assert_bits(&what, &params, &want_params);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `fresh_weights` names in the test of it: a trainable matrix of
/// block 0 and the frozen `wpe` (whole on every rank).
fn is_fresh(name: &str) -> bool {
    name.starts_with("h.0.fc.") || name == "wpe.weight"
}

#[test]
fn variables_the_file_lacks_named_fresh_start_from_rank_0s_draw_and_the_rest_from_the_file() {
    let dir = scratch("weights-from-file-fresh");
    let file = trained_file(&dir, "");
    let kept: Vec<(String, Tensor)> = (Tensor::read_safetensors(&file).unwrap().into_iter())
        .filter(|(n, _)| !is_fresh(n))
        .collect();
    assert!(kept.len() + 3 == gpt_tensors().len(), "{:?}", gpt_tensors());
    let partial = write(&dir, "partial.safetensors", &kept);
    let trainable = dir.join("trainable.safetensors");
    let steps = 3;
    for (stage, world, extra) in [(0, 2, ""), (2, 3, ""), (3, 3, ""), (3, 2, BF16)] {
        let what = format!("stage {stage} on {world} ranks {extra}");
        let cfg = config_zero(stage, 1, 1.0, extra, SHARD_ALL);
        // Seed 0's draw for the fresh variables, the file's for the rest.
        let want = on_ranks(world, |r| {
            let before = |vs: &mut tch::nn::VarStore| {
                let missing = vs.load_partial(&partial).unwrap();
                assert_eq!(missing.len(), 3, "{missing:?}");
            };
            let (e, gpt) = gpt_engine(&r, world, &cfg, before);
            let losses = train_losses(&gpt, &e, r.rank(), steps);
            (losses, e.gathered_params().unwrap())
        });
        let got = on_ranks(world, |r| {
            // Each rank draws its own values: rank 0's must win.
            let (vs, plan, gpt) = common::seeded(|| {
                tch::manual_seed(r.rank() as i64);
                let vs = tch::nn::VarStore::new(tch::Device::Cpu);
                let plan = zrt::zero::ShardPlan::new();
                plan.fresh_weights(|n, _| is_fresh(n)).unwrap();
                plan.weights_from_file(&vs, &partial).unwrap();
                let gpt = zrt::gpt::Gpt::new(&vs.root(), &plan, &common::GPT);
                (vs, plan, gpt)
            });
            let held: Vec<(String, bool)> = (vs.variables().into_iter())
                .map(|(n, t)| (n, zrt::zero::glue::storage_nbytes(&t).unwrap() > 0))
                .collect();
            freeze(&vs, FROZEN);
            let group = r.new_group(&(0..world).collect::<Vec<_>>()).unwrap();
            let hints = zrt::zero::AutoHints::default();
            let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
            let losses = train_losses(&gpt, &e, r.rank(), steps);
            // The trainable parameters alone, as a LoRA adapter's export.
            let only = zrt::zero::ExportLayout::new().trainable_only();
            e.save_16bit_model_as(&trainable, None, &only).unwrap();
            (held, losses, e.gathered_params().unwrap())
        });
        let exported = file_values(&trainable);
        for (rank, ((held, losses, params), (want_losses, want_params))) in
            got.into_iter().zip(want).enumerate()
        {
            let what = format!("{what}, rank {rank}");
            let mut names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
            names.sort();
            let written: Vec<&String> = exported.iter().map(|(n, _)| n).collect();
            assert_eq!(written, names, "{what}: the trainable-only export");
            if extra.is_empty() {
                holds_the_file(&params, &exported, &what);
            }
            for (name, has_memory) in held {
                assert_eq!(has_memory, is_fresh(&name), "{what}: `{name}` while built");
            }
            assert_eq!(losses, want_losses, "{what}");
            common::assert_bits(&what, &params, &want_params);
        }
    }
    // Without the rule the file's lack is refused, naming what it lacks.
    let refused = on_ranks(2, |r| {
        let (vs, plan, _gpt) = common::seeded(|| {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let plan = zrt::zero::ShardPlan::new();
            plan.weights_from_file(&vs, &partial).unwrap();
            let gpt = zrt::gpt::Gpt::new(&vs.root(), &plan, &common::GPT);
            (vs, plan, gpt)
        });
        let group = r.new_group(&[0, 1]).unwrap();
        let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
        let hints = zrt::zero::AutoHints::default();
        Engine::new(&vs, &plan, &cfg, group, &hints)
            .err()
            .map(|e| e.to_string())
    });
    for err in refused {
        let err = err.unwrap_or_default();
        assert!(
            err.contains("h.0.fc.weight") && err.contains("wpe.weight"),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_build_from_a_file_is_refused_where_the_file_or_a_rank_differs() {
    let dir = scratch("weights-from-file-refused");
    let all = gpt_tensors();
    let lacking = write(&dir, "lacking.safetensors", &handles(&all[1..]));
    let whole = write(&dir, "whole.safetensors", &all);
    let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
    // rank r: Some(file) under the rule, None without it.
    let build = |files: [Option<&Path>; 2]| {
        on_ranks(2, |r| {
            let (vs, plan, _) = match files[r.rank()] {
                Some(f) => {
                    let (vs, plan, gpt, _) = built_from_file(f);
                    (vs, plan, gpt)
                }
                None => model(),
            };
            let group = r.new_group(&[0, 1]).unwrap();
            let hints = zrt::zero::AutoHints::default();
            let e = Engine::new(&vs, &plan, &cfg, group, &hints);
            e.err().map(|e| e.to_string()).unwrap_or_default()
        })
    };
    for err in build([Some(&lacking), Some(&lacking)]) {
        let want = format!(
            "the weights file {} does not match the model: missing 1: {}",
            lacking.display(),
            all[0].0
        );
        assert!(err.contains(&want), "{err}");
    }
    // Identical copies at paths of their own (a node's local disk) build.
    let copy = dir.join("copy.safetensors");
    std::fs::copy(&whole, &copy).unwrap();
    assert_eq!(build([Some(&whole), Some(&copy)]), ["", ""]);
    for err in build([Some(&whole), None]) {
        assert!(
            err.contains(
                "in ShardPlan::weights_from_file: rank 1 has no file, rank 0 has a file to load"
            ),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_load_only_rank_0_calls_is_named_as_a_collective() {
    // The usual mistake: loading under `if rank == 0` while the others
    // go on training.
    let dir = scratch("load-weights-rank-0-only");
    let file = write(&dir, "whole.safetensors", &gpt_tensors());
    let cfg = config_zero(3, 1, 0.0, "", SHARD_ALL);
    let out = on_ranks(2, |r| {
        let (e, gpt) = gpt_engine(&r, 2, &cfg, |_| {});
        match r.rank() {
            0 => e.load_weights(&file, true).err().map(|e| e.to_string()),
            _ => {
                let trained = (|| {
                    e.backward(&gpt.loss(&common::tokens(0, 0, 1, 1)))?;
                    e.step()
                })();
                trained.err().map(|e| e.to_string())
            }
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (loader, trainer) = (out[0].clone().unwrap(), out[1].clone().unwrap());
    assert!(
        loader.contains("load_weights is a collective: every rank calls it"),
        "{loader}"
    );
    assert!(
        trainer.contains("another rank is saving or loading a checkpoint while this one trains"),
        "{trainer}"
    );
}

/// Writes `tensors` as a sharded checkpoint in `dir`: `parts` files
/// (`model-0000k-of-0000n.safetensors`, the tensors dealt round) and
/// their index, `model.safetensors.index.json`, with `extra` tensors in
/// the files (by file number) that the index does not place there.
fn write_sharded(
    dir: &Path,
    tensors: &[(String, Tensor)],
    parts: usize,
    extra: &[(usize, String, Tensor)],
) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let name = |k: usize| format!("model-{:05}-of-{parts:05}.safetensors", k + 1);
    let mut map = serde_json::Map::new();
    for k in 0..parts {
        let mut mine: Vec<(String, Tensor)> = (tensors.iter().enumerate())
            .filter(|(i, _)| i % parts == k)
            .map(|(_, (n, t))| (n.clone(), t.shallow_clone()))
            .collect();
        for (n, _) in &mine {
            map.insert(n.clone(), name(k).into());
        }
        (extra.iter().filter(|(f, ..)| *f == k))
            .for_each(|(_, n, t)| mine.push((n.clone(), t.shallow_clone())));
        write(dir, &name(k), &mine);
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    let path = dir.join("model.safetensors.index.json");
    std::fs::write(&path, index.to_string()).unwrap();
    path
}

#[test]
fn a_sharded_checkpoint_loads_through_its_index_or_its_directory() {
    // Hugging Face's layout for a model too big for one file: several
    // safetensors files and an index naming each tensor's file.
    let dir = scratch("load-weights-sharded");
    let file = trained_file(&dir, "");
    let values = file_values(&file);
    let mut tensors = Tensor::read_safetensors(&file).unwrap();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    // A stale copy of a tensor in a file the index does not place it in:
    // the index decides.
    let (stale, t) = &tensors[0];
    let wrong = vec![(1, stale.clone(), t.ones_like())];
    let sharded = dir.join("sharded");
    let index = write_sharded(&sharded, &tensors, 3, &wrong);
    let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
    let got = on_ranks(2, |r| {
        let (e, _) = gpt_engine(&r, 2, &cfg, |_| {});
        let by_index = e.load_weights(&index, true).unwrap();
        let from_index = e.gathered_params().unwrap();
        // A directory: its index.
        let (e2, _) = gpt_engine(&r, 2, &cfg, |_| {});
        e2.load_weights(&sharded, true).unwrap();
        (by_index, from_index, e2.gathered_params().unwrap())
    });
    for (report, from_index, from_dir) in got {
        assert_eq!((report.missing.len(), report.unexpected.len()), (0, 0));
        assert_eq!(report.loaded, values.len());
        holds_the_file(&from_index, &values, "through the index");
        holds_the_file(&from_dir, &values, "through the directory");
    }
    // Built from it by no rank, as from one file.
    let built = on_ranks(2, |r| {
        let (vs, plan, _gpt, held) = built_from_file(&sharded);
        freeze(&vs, FROZEN);
        let group = r.new_group(&[0, 1]).unwrap();
        let hints = zrt::zero::AutoHints::default();
        let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
        (held, e.gathered_params().unwrap())
    });
    for (held, params) in built {
        assert!(held.iter().all(|(_, b)| *b == 0), "{held:?}");
        holds_the_file(&params, &values, "built from the directory");
    }
    // What is refused, on every rank, naming the fault.
    let missing_part = dir.join("missing-part");
    write_sharded(&missing_part, &tensors, 2, &[]);
    std::fs::remove_file(missing_part.join("model-00002-of-00002.safetensors")).unwrap();
    let misplaced = dir.join("misplaced");
    let idx = write_sharded(&misplaced, &tensors, 2, &[]);
    let text = std::fs::read_to_string(&idx).unwrap();
    let moved = format!(r#""{stale}":"model-00002-of-00002.safetensors""#);
    assert!(text.contains(&format!(r#""{stale}":"model-00001-of-00002.safetensors""#)));
    std::fs::write(
        &idx,
        text.replace(&moved.replace("00002-of", "00001-of"), &moved),
    )
    .unwrap();
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    for (path, says) in [
        (missing_part.clone(), "model-00002-of-00002.safetensors: no such file".to_string()),
        (misplaced.clone(), format!("its weight_map places `{stale}` in model-00002-of-00002.safetensors, which does not hold it")),
        (empty.clone(), "a directory holding neither model.safetensors.index.json (a sharded checkpoint's index) nor model.safetensors".to_string()),
    ] {
        for (err, unchanged) in refusals(&cfg, [&path, &path], true) {
            assert!(err.contains(&says), "{err}");
            assert!(unchanged, "{err}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_sharded_16_bit_export_loads_as_the_single_file_does() {
    // save_16bit_model_sharded: files of at most a limit and their index
    // (one file and no index when the model fits, an earlier export's
    // files in its directory removed), read back through the
    // directory to the bits of save_16bit_model's one file.
    let dir = scratch("save-sharded");
    let cfg = config_zero(3, 1, 1.0, BF16, SHARD_ALL);
    let (one, many, fits) = (
        dir.join("one.safetensors"),
        dir.join("many"),
        dir.join("fits"),
    );
    on_ranks(2, |r| {
        let (e, gpt) = gpt_engine(&r, 2, &cfg, |vs| common::known_values(vs, 0.3, 0.1));
        train_losses(&gpt, &e, r.rank(), 1);
        e.save_16bit_model(&one).unwrap();
        e.save_16bit_model_sharded(&many, 1 << 30).unwrap();
        e.save_16bit_model_sharded(&many, 10_000).unwrap();
        // Over an export in more files: they go.
        e.save_16bit_model_sharded(&fits, 3_000).unwrap();
        e.save_16bit_model_sharded(&fits, 1 << 30).unwrap();
    });
    let values = file_values(&one);
    let mut names: Vec<String> = (std::fs::read_dir(&many).unwrap().flatten())
        .map(|f| f.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let parts = names.len() - 1;
    assert!(parts > 2, "{names:?}");
    assert_eq!(names[parts], "model.safetensors.index.json");
    for (k, name) in names[..parts].iter().enumerate() {
        assert_eq!(
            *name,
            format!("model-{:05}-of-{parts:05}.safetensors", k + 1)
        );
        // At most the limit of tensors, but a larger tensor alone.
        let t = Tensor::read_safetensors(many.join(name)).unwrap();
        let bytes: usize = t.iter().map(|(_, t)| t.numel() * 2).sum();
        assert!(bytes <= 10_000 || t.len() == 1, "{name}: {bytes} bytes");
    }
    let single: Vec<String> = (std::fs::read_dir(&fits).unwrap().flatten())
        .map(|f| f.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(single, ["model.safetensors"]);
    assert_eq!(file_values(&fits.join("model.safetensors")), values);
    let got = on_ranks(2, |r| {
        let (e, _) = gpt_engine(&r, 2, &cfg, |_| {});
        e.load_weights(&many, true).unwrap();
        e.gathered_params().unwrap()
    });
    for params in got {
        holds_the_file(&params, &values, "the sharded export");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_files_own_names_load_through_the_plans_rename_rule() {
    // Hugging Face's layout: every name under `model.`, and a tensor this
    // model has not (`lm_head.weight`), which the rule skips.
    let dir = scratch("load-weights-renamed");
    let file = trained_file(&dir, "");
    let values = file_values(&file);
    let mut theirs: Vec<(String, Tensor)> = (Tensor::read_safetensors(&file).unwrap().into_iter())
        .map(|(n, t)| (format!("model.{n}"), t))
        .collect();
    theirs.push((
        "lm_head.weight".into(),
        Tensor::ones([4, 4], (Kind::Float, tch::Device::Cpu)),
    ));
    let hf = write(&dir, "hf.safetensors", &theirs);
    let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
    let strip = |name: &str| {
        let name = name.strip_prefix("model.").unwrap_or(name);
        (!name.starts_with("lm_head.")).then(|| name.to_string())
    };
    // Into a built engine and by the build, no rank holding the model.
    let got = on_ranks(2, |r| {
        let (vs, plan, _) = model();
        plan.rename_weights(strip).unwrap();
        freeze(&vs, FROZEN);
        let group = r.new_group(&[0, 1]).unwrap();
        let hints = zrt::zero::AutoHints::default();
        let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
        let report = e.load_weights(&hf, true).unwrap();
        let into = e.gathered_params().unwrap();
        drop(e);
        let (vs, plan, _gpt) = common::seeded(|| {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let plan = zrt::zero::ShardPlan::new();
            plan.rename_weights(strip).unwrap();
            plan.weights_from_file(&vs, &hf).unwrap();
            let gpt = zrt::gpt::Gpt::new(&vs.root(), &plan, &common::GPT);
            (vs, plan, gpt)
        });
        freeze(&vs, FROZEN);
        let group = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
        (report, into, e.gathered_params().unwrap())
    });
    for (report, into, built) in got {
        assert_eq!(
            report,
            LoadedWeights {
                loaded: values.len(),
                ..Default::default()
            }
        );
        holds_the_file(&into, &values, "renamed into the engine");
        holds_the_file(&built, &values, "renamed by the build");
    }
    // Without the rule the names are another model's; a rule giving two
    // tensors one name, or ranks whose rules differ, are refused.
    let plain = refusals(&cfg, [&hf, &hf], true);
    assert!(
        plain[0]
            .0
            .contains("ShardPlan::rename_weights maps a file's own names to them"),
        "{}",
        plain[0].0
    );
    let said = on_ranks(2, |r| {
        let (vs, plan, _) = model();
        match r.rank() {
            0 => plan
                .rename_weights(|_| Some("wte.weight".to_string()))
                .unwrap(),
            _ => plan.rename_weights(strip).unwrap(),
        }
        freeze(&vs, FROZEN);
        let group = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, group, &zrt::zero::AutoHints::default()).unwrap();
        let twice = e.load_weights(&hf, true).unwrap_err().to_string();
        (twice, e.gathered_params().unwrap())
    });
    assert!(
        said[0]
            .0
            .contains("the plan's rename_weights rule names both"),
        "{}",
        said[0].0
    );
    assert!(
        said[1].0.contains("failed to load the weights file"),
        "{}",
        said[1].0
    );
    let differ = on_ranks(2, |r| {
        let (vs, plan, _) = model();
        match r.rank() {
            0 => plan.rename_weights(strip).unwrap(),
            _ => plan
                .rename_weights(move |n| strip(n).filter(|n| n != "h.0.fc.bias"))
                .unwrap(),
        }
        freeze(&vs, FROZEN);
        let group = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, group, &zrt::zero::AutoHints::default()).unwrap();
        e.load_weights(&hf, false).unwrap_err().to_string()
    });
    for err in differ {
        assert!(err.contains("read different"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Which of the test GPT's tensors a transposing checkpoint stores
/// transposed: every matrix (the square attention output's too, whose
/// shape cannot tell).
/// A file holding copies of one tensor under several names, as
/// `transformers` writes a tied parameter (Zamba's shared block under
/// each layer that uses it): under the plan's copies rule the copy whose
/// name sorts first is read on every rank, whatever the others hold;
/// without it, or for a name the rule does not cover, two tensors given
/// one name are still refused.
#[test]
fn copies_of_a_tied_tensor_load_one_through_the_plans_copies_rule() {
    let dir = scratch("load-weights-copies");
    let file = trained_file(&dir, "");
    let values = file_values(&file);
    let tied = "h.0.fc.weight";
    let mut theirs: Vec<(String, Tensor)> = Vec::new();
    for (n, t) in Tensor::read_safetensors(&file).unwrap() {
        if n == tied {
            // The first by name holds the values; the later copies not.
            theirs.push((format!("copy.a.{n}"), t.copy()));
            theirs.push((format!("copy.b.{n}"), t.ones_like()));
            theirs.push((format!("model.{n}"), t.zeros_like()));
        } else {
            theirs.push((format!("model.{n}"), t));
        }
    }
    let hf = write(&dir, "copies.safetensors", &theirs);
    let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
    let rule = |name: &str| {
        let name = name.strip_prefix("model.").unwrap_or(name);
        let name = (name
            .strip_prefix("copy.a.")
            .or(name.strip_prefix("copy.b.")))
        .unwrap_or(name);
        Some(name.to_string())
    };
    let (hf, cfg) = (&hf, &cfg);
    let load = |copies: Option<&'static str>| {
        on_ranks(2, move |r| {
            let (vs, plan, _) = model();
            plan.rename_weights(rule).unwrap();
            if let Some(c) = copies {
                plan.weight_copies(move |n| n == c).unwrap();
            }
            freeze(&vs, FROZEN);
            let group = r.new_group(&[0, 1]).unwrap();
            let hints = zrt::zero::AutoHints::default();
            let e = Engine::new(&vs, &plan, cfg, group, &hints).unwrap();
            let loaded = e.load_weights(hf, true).map_err(|e| e.to_string());
            (loaded, e.gathered_params().unwrap())
        })
    };
    // Four times: the ranks must agree whatever order each one's map of
    // the file lists the copies in (one that counted only the copies
    // it kept refused the load at random, as ranks reading different
    // files).
    for _ in 0..4 {
        for (loaded, params) in load(Some(tied)) {
            assert_eq!(loaded.unwrap().loaded, values.len());
            holds_the_file(&params, &values, "the first copy by name");
        }
    }
    for copies in [None, Some("h.0.fc.bias")] {
        for (loaded, _) in load(copies) {
            let e = loaded.unwrap_err();
            // (Which two the refusal names follows the file's order.)
            assert!(
                e.contains("the plan's rename_weights rule names both")
                    && e.contains(".h.0.fc.weight` `h.0.fc.weight`"),
                "{copies:?}: {e}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn is_matrix(name: &str) -> bool {
    name.ends_with(".weight") && !name.contains("ln")
}

#[test]
fn matrices_stored_transposed_load_through_the_plans_transpose_rule() {
    // GPT-2's layout: its Conv1D keeps `[in, out]` where a linear keeps
    // `[out, in]`. Every matrix transposed, the frozen ones too (`wpe`
    // held whole, `h.1.fc` a stage-3 unit's sharded frozen part), in fp32
    // and in bf16.
    let dir = scratch("load-weights-transposed");
    let file = trained_file(&dir, "");
    let ours = Tensor::read_safetensors(&file).unwrap();
    let square = (ours.iter())
        .filter(|(n, t)| is_matrix(n) && t.size()[0] == t.size()[1])
        .count();
    assert!(square > 0, "no square matrix to tell a transpose by value");
    // In `kind`, or its values widened to fp32 with `Kind::Float`.
    let write_as = |kind: Kind, widened: Kind, transposed: bool| {
        let v: Vec<(String, Tensor)> = (ours.iter())
            .map(|(n, t)| {
                let t = t.to_kind(kind).to_kind(widened);
                assert!(!is_matrix(n) || t.dim() == 2, "{n}");
                let t = match transposed && is_matrix(n) {
                    true => t.tr().contiguous(),
                    false => t,
                };
                (n.clone(), t)
            })
            .collect();
        write(
            &dir,
            &format!("{kind:?}{widened:?}{transposed}.safetensors"),
            &v,
        )
    };
    let steps = 2;
    let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
    let hints = zrt::zero::AutoHints::default();
    for kind in [Kind::Float, Kind::BFloat16] {
        let what = format!("{kind:?}");
        let (plain, theirs) = (
            write_as(kind, Kind::Float, false),
            write_as(kind, kind, true),
        );
        let want = loaded_before(&plain, 2, &cfg, steps);
        // Into a built engine, and by the build with no rank holding the
        // model; each trains as the plain file loaded into the VarStore.
        let got = on_ranks(2, |r| {
            let (vs, plan, gpt) = model();
            plan.transpose_weights(is_matrix).unwrap();
            freeze(&vs, FROZEN);
            let group = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
            let report = e.load_weights(&theirs, true).unwrap();
            let into = (
                train_losses(&gpt, &e, r.rank(), steps),
                e.gathered_params().unwrap(),
            );
            let wpe = Vec::<f32>::try_from(vs.variables()["wpe.weight"].flatten(0, -1));
            drop(e);
            let (vs, plan, gpt, _) = built_from_file(&theirs);
            plan.transpose_weights(is_matrix).unwrap();
            freeze(&vs, FROZEN);
            let group = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
            let built = (
                train_losses(&gpt, &e, r.rank(), steps),
                e.gathered_params().unwrap(),
            );
            (
                report.missing.len() + report.unexpected.len(),
                into,
                built,
                wpe.unwrap(),
            )
        });
        let plain_wpe = (file_values(&plain).into_iter())
            .find(|(n, _)| n == "wpe.weight")
            .unwrap()
            .1;
        for (rank, ((mismatched, into, built, wpe), (losses, params))) in
            got.into_iter().zip(want).enumerate()
        {
            let what = format!("{what}, rank {rank}");
            assert_eq!(mismatched, 0, "{what}");
            for (how, (l, p)) in [("into the engine", into), ("by the build", built)] {
                assert_eq!(l, losses, "{what} {how}");
                common::assert_bits(&format!("{what} {how}"), &p, &params);
            }
            assert!(common::bits_equal(&wpe, &plain_wpe), "{what}: frozen wpe");
        }
    }
    // Without the rule a matrix stored transposed is refused, the fix
    // named (a square one cannot be told: the file does not say); a rule
    // naming a vector is refused; ranks whose rules differ on a square
    // matrix only are refused as ranks reading different files.
    let theirs = write_as(Kind::Float, Kind::Float, true);
    let plain = refusals(&cfg, [&theirs, &theirs], true);
    for (err, unchanged) in &plain {
        assert!(
            err.contains("h.0.fc.weight: file F32 [32, 128], model Float [128, 32] (its transpose: ShardPlan::transpose_weights reads it so)"),
            "{err}"
        );
        assert!(unchanged, "{err}");
    }
    let with = |rule: fn(&str) -> bool, rank_1: fn(&str) -> bool| {
        on_ranks(2, |r| {
            let (vs, plan, _) = model();
            match r.rank() {
                0 => plan.transpose_weights(rule).unwrap(),
                _ => plan.transpose_weights(rank_1).unwrap(),
            }
            freeze(&vs, FROZEN);
            let group = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &cfg, group, &hints).unwrap();
            let before = e.gathered_params().unwrap();
            let err = e.load_weights(&theirs, true).unwrap_err().to_string();
            (err, e.gathered_params().unwrap() == before)
        })
    };
    let every: fn(&str) -> bool = |_| true;
    for (err, unchanged) in with(every, every) {
        assert!(
            err.contains("the plan's transpose_weights rule names `")
                && err.contains("only a matrix (2 dimensions) reads transposed"),
            "{err}"
        );
        assert!(unchanged, "{err}");
    }
    let not_proj: fn(&str) -> bool = |n| is_matrix(n) && !n.ends_with(".proj.weight");
    let differ = with(is_matrix, not_proj);
    for (err, unchanged) in differ {
        assert!(err.contains("read different"), "{err}");
        assert!(unchanged, "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

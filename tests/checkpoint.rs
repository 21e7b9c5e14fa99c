//! Checkpoints: exact resume (every stage, and between accumulation
//! boundaries), resharding to another world size and stage, consolidation
//! into one safetensors file, module-only loads for fine-tuning, and every
//! error the checkpoint issue names.
//! Ranks are threads with the in-process backend (processes where
//! libtorch's process-global RNG matters); each phase builds fresh models
//! and engines, as a restarted job would.

use crate::common;

use std::path::{Path, PathBuf};

use common::{
    assert_bits, config_with, config_zero, model, model_of, nvme, nvme_params, on_ranks, serial,
    solo_engine, tokens, Params, GPT,
};
use tch::{Kind, Tensor};
use zrt::collectives::local::{LocalGroup, LocalRank};
use zrt::collectives::{ProcessGroup, ReduceOp};
use zrt::gpt::{Gpt, GptConfig};
use zrt::zero::{AutoHints, CheckpointError, Config, Engine, EngineError};

/// Which micro-batch a rank trains on at global micro-step `m`.
#[derive(Clone, Copy)]
enum Batches {
    /// Two ranks, `gas` micro-steps each: `tokens(step, k, rank, gas)`.
    Two { gas: usize },
    /// One rank seeing both ranks' micro-batches of `Two { gas: 1 }` in
    /// turn (gas 2): the same global batch per step.
    OneOfTwo,
}

impl Batches {
    fn world(self) -> usize {
        match self {
            Batches::Two { .. } => 2,
            Batches::OneOfTwo => 1,
        }
    }
    fn gas(self) -> usize {
        match self {
            Batches::Two { gas } => gas,
            Batches::OneOfTwo => 2,
        }
    }
    fn batch(self, m: usize, rank: usize) -> Tensor {
        match self {
            Batches::Two { gas } => tokens(m / gas, m % gas, rank, gas),
            Batches::OneOfTwo => tokens(m / 2, 0, m % 2, 1),
        }
    }
}

/// One phase of a job.
struct Phase<'a> {
    stage: u8,
    batches: Batches,
    /// Global micro-steps to run (each followed by `step()`).
    micros: std::ops::Range<usize>,
    load: Option<(&'a Path, Option<&'a str>)>,
    save: Option<(&'a Path, &'a str)>,
    /// Spliced into the config's top level.
    extra: &'a str,
    /// Spliced into `zero_optimization`.
    zero: &'a str,
}

impl<'a> Phase<'a> {
    fn new(stage: u8, batches: Batches, micros: std::ops::Range<usize>) -> Self {
        Self {
            stage,
            batches,
            micros,
            load: None,
            save: None,
            extra: "",
            zero: "",
        }
    }
    fn load(mut self, dir: &'a Path, tag: Option<&'a str>) -> Self {
        self.load = Some((dir, tag));
        self
    }
    fn save(mut self, dir: &'a Path, tag: &'a str) -> Self {
        self.save = Some((dir, tag));
        self
    }
}

/// What rank 0 ends a phase with: the losses (global mean per micro-step)
/// and the final parameters.
struct Outcome {
    losses: Vec<f64>,
    params: Params,
    /// The rate and betas the next step would use.
    lr: f64,
    betas: (f64, f64),
}

fn run(p: &Phase<'_>) -> Outcome {
    try_run(p, &GPT).into_iter().next().unwrap().unwrap()
}

/// Runs a phase on every rank; each rank's result (loading errors are
/// returned, not panicked on).
fn try_run(p: &Phase<'_>, gpt_cfg: &GptConfig) -> Vec<Result<Outcome, EngineError>> {
    let world = p.batches.world();
    let cfg = config_zero(p.stage, p.batches.gas(), 0.5, p.extra, p.zero);
    on_ranks(world, |r| -> Result<Outcome, EngineError> {
        let (vs, plan, gpt) = model_of(gpt_cfg);
        let g = r.new_group(&(0..world).collect::<Vec<_>>()).unwrap();
        let engine = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default())?;
        if let Some((dir, tag)) = p.load {
            engine.load_checkpoint(dir, tag)?;
        }
        let mut losses = Vec::new();
        for m in p.micros.clone() {
            let loss = gpt.loss(&p.batches.batch(m, r.rank()));
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
            let all = r
                .world()
                .all_reduce(vec![loss.double_value(&[])], ReduceOp::Avg)
                .wait()
                .unwrap();
            losses.push(all[0]);
        }
        if let Some((dir, tag)) = p.save {
            engine.save_checkpoint(dir, tag)?;
        }
        let mut params = engine.gathered_params().unwrap();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Outcome {
            losses,
            params,
            lr: engine.lr(),
            betas: engine.betas(),
        })
    })
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zrt-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn assert_close(what: &str, a: &Params, b: &Params, tol: f64) {
    for ((na, x), (_, y)) in a.iter().zip(b) {
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            let (p, q) = (*p as f64, *q as f64);
            assert!(
                (p - q).abs() <= tol * q.abs().max(0.1),
                "{what}: {na}[{i}] {p} vs {q}"
            );
        }
    }
}

#[test]
fn resuming_is_bit_identical_to_training_straight_through_for_every_stage() {
    let _serial = serial();
    let two = Batches::Two { gas: 1 };
    for stage in 0..=3u8 {
        let dir = tmp(&format!("resume-{stage}"));
        let straight = run(&Phase::new(stage, two, 0..4));
        run(&Phase::new(stage, two, 0..2).save(&dir, "step2"));
        assert_eq!(
            std::fs::read_to_string(dir.join("latest")).unwrap().trim(),
            "step2"
        );
        let resumed = run(&Phase::new(stage, two, 2..4).load(&dir, None));
        assert_eq!(
            resumed.losses,
            straight.losses[2..],
            "stage {stage}: losses"
        );
        assert_bits(&format!("stage {stage}"), &resumed.params, &straight.params);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_stage_3_run_gathering_int8_resumes_to_the_same_bits() {
    // qwZ packs each rank's shard as it is at each gather: a checkpoint
    // holds the shards exactly, so a resumed run packs the same codes.
    let _serial = serial();
    let two = Batches::Two { gas: 1 };
    let plain = r#""stage3_param_persistence_threshold": 0,"#;
    let qwz = r#""stage3_param_persistence_threshold": 0, "zero_quantized_weights": true,"#;
    let phase = |zero, micros| Phase {
        zero,
        ..Phase::new(3, two, micros)
    };
    let dir = tmp("qwz");
    let straight = run(&phase(qwz, 0..4));
    run(&phase(qwz, 0..2).save(&dir, "step2"));
    let resumed = run(&phase(qwz, 2..4).load(&dir, None));
    assert_eq!(resumed.losses, straight.losses[2..]);
    assert_bits(
        "qwZ, 2 + 2 steps against 4",
        &resumed.params,
        &straight.params,
    );
    let unpacked = run(&phase(plain, 0..4));
    assert_ne!(
        unpacked.params, straight.params,
        "the packed path was taken"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_scheduled_run_resumes_where_its_schedule_was() {
    let _serial = serial();
    // OneCycle moves the rate and beta1 every step (up over 2 steps, down
    // over 2, then decaying); WarmupDecayLR the rate. A resumed run that
    // restarted its schedule, or kept the first phase's last settings,
    // would train other bits.
    let schedules = [
        r#""scheduler": {"type": "OneCycle", "params": {
            "cycle_min_lr": 0.0025, "cycle_max_lr": 0.02, "cycle_first_step_size": 2,
            "cycle_second_step_size": 2, "decay_step_size": 1, "decay_lr_rate": 0.5,
            "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}},"#,
        r#""scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 3,
            "total_num_steps": 8}},"#,
    ];
    let two = Batches::Two { gas: 1 };
    for (i, extra) in schedules.into_iter().enumerate() {
        for stage in [1u8, 3] {
            let what = format!("schedule {i}, stage {stage}");
            let dir = tmp(&format!("scheduled-{i}-{stage}"));
            let phase = |micros| Phase {
                extra,
                ..Phase::new(stage, two, micros)
            };
            let straight = run(&phase(0..6));
            let first = run(&phase(0..3).save(&dir, "step3"));
            let resumed = run(&phase(3..6).load(&dir, None));
            assert_eq!(resumed.losses, straight.losses[3..], "{what}: losses");
            assert_bits(&what, &resumed.params, &straight.params);
            assert_eq!(
                (resumed.lr, resumed.betas),
                (straight.lr, straight.betas),
                "{what}: settings after the last step"
            );
            // The schedule moved across the save, so the check can fail.
            assert_ne!(first.lr, straight.lr, "{what}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn a_checkpoint_between_accumulation_boundaries_resumes_exactly() {
    let _serial = serial();
    // gas 2: save after the first micro-step of step 1, with its gradients.
    for stage in [1u8, 3] {
        let two = Batches::Two { gas: 2 };
        let dir = tmp(&format!("mid-{stage}"));
        let straight = run(&Phase::new(stage, two, 0..6));
        run(&Phase::new(stage, two, 0..3).save(&dir, "mid"));
        let resumed = run(&Phase::new(stage, two, 3..6).load(&dir, Some("mid")));
        assert_bits(&format!("stage {stage}"), &resumed.params, &straight.params);
        // ...but it cannot be resharded: the gradients are per rank. Not
        // to another world, another stage, both, or (stage 3) other units;
        // the error says which.
        let other = if stage == 1 { 3 } else { 1 };
        let world = "saved on a mesh of 1 x 2 ranks (replicas x shard group), loading on 1 x 1";
        let mut cases = vec![
            (stage, Batches::OneOfTwo, "", world.to_string()),
            (
                other,
                two,
                "",
                format!("saved at stage {stage}, loading at stage {other}"),
            ),
            (
                0,
                Batches::OneOfTwo,
                "",
                format!("saved at stage {stage}, loading at stage 0"),
            ),
        ];
        if stage == 3 {
            // Parameters of at most 100 elements (biases, norms) move from
            // their blocks to the root unit (by default, 1e5, whole units
            // persist and nothing moves).
            let small_to_root = r#""stage3_param_persistence_threshold": 100,"#;
            cases.push((
                3,
                two,
                small_to_root,
                "another stage3_param_persistence_threshold".into(),
            ));
        }
        for (s, batches, zero, why) in cases {
            let p = Phase {
                zero,
                ..Phase::new(s, batches, 0..0).load(&dir, Some("mid"))
            };
            let err = try_run(&p, &GPT).remove(0).err().unwrap().to_string();
            assert!(
                err.contains("between accumulation boundaries") && err.contains(&why),
                "stage {stage} -> {s} {zero}: {err}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_checkpoint_loads_on_another_world_size_and_stage() {
    let _serial = serial();
    let two = Batches::Two { gas: 1 };
    let dir = tmp("reshard");
    let straight = run(&Phase::new(3, two, 0..4));
    run(&Phase::new(3, two, 0..2).save(&dir, "s3w2"));
    // Same world, other stages: the same reductions, the same bits.
    for stage in [0u8, 1, 2] {
        let r = run(&Phase::new(stage, two, 2..4).load(&dir, None));
        assert_bits(&format!("stage 3 -> {stage}"), &r.params, &straight.params);
    }
    // One rank doing both ranks' micro-batches: the same global batch,
    // summed in another order, so within fp32 tolerance.
    for stage in [0u8, 3] {
        let r = run(&Phase::new(stage, Batches::OneOfTwo, 4..8).load(&dir, None));
        assert_close(
            &format!("world 2 -> 1, stage {stage}"),
            &r.params,
            &straight.params,
            1e-4,
        );
        for (a, b) in r.losses.chunks(2).zip(&straight.losses[2..]) {
            let mean = (a[0] + a[1]) / 2.0;
            assert!((mean - b).abs() <= 1e-5 * b.abs(), "loss {mean} vs {b}");
        }
    }
    // And from one rank to two: rank 1 has no file of its own (it reads
    // its shards from rank 0's and keeps its own RNG stream).
    run(&Phase::new(3, Batches::OneOfTwo, 0..4).save(&dir, "s3w1"));
    let r = run(&Phase::new(3, two, 2..4).load(&dir, Some("s3w1")));
    assert_close("world 1 -> 2", &r.params, &straight.params, 1e-4);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bf16_and_fp16_state_round_trips() {
    let _serial = serial();
    let bf16 = r#""bf16": {"enabled": true},"#;
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 8},"#;
    for (extra, stage) in [(bf16, 3u8), (bf16, 1), (fp16, 3), (fp16, 0)] {
        let two = Batches::Two { gas: 1 };
        let dir = tmp(&format!("half-{stage}"));
        let straight = run(&Phase {
            extra,
            ..Phase::new(stage, two, 0..4)
        });
        run(&Phase {
            extra,
            ..Phase::new(stage, two, 0..2).save(&dir, "a")
        });
        let resumed = run(&Phase {
            extra,
            ..Phase::new(stage, two, 2..4).load(&dir, None)
        });
        assert_bits(
            &format!("{extra} stage {stage}"),
            &resumed.params,
            &straight.params,
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_checkpoint_of_another_model_lists_what_differs() {
    let _serial = serial();
    let dir = tmp("other-model");
    run(&Phase::new(2, Batches::Two { gas: 1 }, 0..1).save(&dir, "a"));
    let other = GptConfig {
        layers: 3,
        d_model: 48,
        ..GPT
    };
    let errs = try_run(
        &Phase::new(2, Batches::Two { gas: 1 }, 0..0).load(&dir, None),
        &other,
    );
    for e in errs {
        let e = e.err().expect("every rank refuses another model");
        let text = e.to_string();
        assert!(
            matches!(
                e,
                EngineError::Checkpoint(CheckpointError::ModelMismatch { .. })
            ),
            "{text}"
        );
        assert!(
            text.contains("missing 11: h.2.fc.bias, h.2.fc.weight"),
            "{text}"
        );
        assert!(
            text.contains("mis-shaped 27: h.0.fc.bias: checkpoint [128], model [192]"),
            "{text}"
        );
    }
    let fewer = GptConfig { layers: 1, ..GPT };
    let e = try_run(
        &Phase::new(2, Batches::Two { gas: 1 }, 0..0).load(&dir, None),
        &fewer,
    )
    .remove(0);
    let text = e.err().unwrap().to_string();
    assert!(text.contains("unexpected 11: h.1.fc.bias"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn rank_file(dir: &Path, tag: &str, rank: usize) -> PathBuf {
    dir.join(tag)
        .join(format!("rank-{rank:05}-of-00002.safetensors"))
}

#[test]
fn a_corrupted_or_truncated_shard_is_named_and_older_tags_still_load() {
    let _serial = serial();
    let two = Batches::Two { gas: 1 };
    let dir = tmp("corrupt");
    let at1 = run(&Phase::new(3, two, 0..1).save(&dir, "one"));
    run(&Phase::new(3, two, 0..2).save(&dir, "two"));
    // Flip one byte in the middle of rank 1's data.
    let f = rank_file(&dir, "two", 1);
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0x40;
    std::fs::write(&f, &bytes).unwrap();
    let load_two = || try_run(&Phase::new(3, two, 0..0).load(&dir, None), &GPT);
    for (rank, r) in load_two().into_iter().enumerate() {
        let e = r.err().expect("a corrupted shard fails every rank");
        let text = e.to_string();
        if rank == 1 {
            assert!(
                text.contains("checksum mismatch") && text.contains("rank-00001-of-00002"),
                "{text}"
            );
        } else {
            assert!(text.contains("rank(s) [1] failed to load"), "{text}");
        }
    }
    // Truncated.
    std::fs::write(&f, &bytes[..n / 2]).unwrap();
    let e = load_two().remove(1).err().unwrap().to_string();
    assert!(
        e.contains("rank-00001-of-00002") && (e.contains("truncated") || e.contains("checksum")),
        "{e}"
    );
    // The older tag is intact and loads: nothing trained after it.
    let back = run(&Phase::new(3, two, 1..1).load(&dir, Some("one")));
    assert_bits("tag one", &back.params, &at1.params);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_rank_file_fails_every_rank() {
    let _serial = serial();
    let dir = tmp("missing");
    run(&Phase::new(2, Batches::Two { gas: 1 }, 0..1).save(&dir, "a"));
    std::fs::remove_file(rank_file(&dir, "a", 1)).unwrap();
    for r in try_run(
        &Phase::new(2, Batches::Two { gas: 1 }, 0..0).load(&dir, None),
        &GPT,
    ) {
        let text = r.err().expect("every rank fails").to_string();
        assert!(
            text.contains("rank-00001-of-00002.safetensors is missing"),
            "{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_load_that_fails_in_a_later_unit_changes_nothing() {
    let _serial = serial();
    let dir = tmp("late-damage");
    let two = Batches::Two { gas: 1 };
    run(&Phase::new(3, two, 0..1).save(&dir, "a"));
    // Rank 1's file of a one-block model is a valid rank-1 file whose
    // first units match the two-block model's: only block h.1 is missing.
    let one_block = GptConfig { layers: 1, ..GPT };
    try_run(&Phase::new(3, two, 0..1).save(&dir, "b"), &one_block)
        .into_iter()
        .for_each(|r| drop(r.unwrap()));
    std::fs::copy(rank_file(&dir, "b", 1), rank_file(&dir, "a", 1)).unwrap();
    // One rank reads both files: every unit is checked before the first
    // is installed, so the engine keeps its own parameters.
    let (vs, plan, _) = model();
    let engine = solo_engine(&vs, &plan, &config_zero(3, 2, 0.5, "", "")).unwrap();
    let before = engine.gathered_params().unwrap();
    let e = engine
        .load_checkpoint(&dir, Some("a"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank-00001-of-00002") && e.contains("no tensor `h.1"),
        "{e}"
    );
    assert_bits(
        "after a failed load",
        &engine.gathered_params().unwrap(),
        &before,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Mounts a tmpfs of `size` at a fresh directory (this needs root, which
/// this project's machines and CI have); unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn new(name: &str, opts: &str) -> Option<Self> {
        let d = tmp(name);
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(&d)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("cannot mount a tmpfs (not root?): this test needs one");
        }
        ok.then_some(Self(d))
    }
    fn remount(&self, opts: &str) {
        let st = std::process::Command::new("mount")
            .args(["-o", &format!("remount,{opts}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(st.success());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_full_disk_or_read_only_directory_fails_every_rank_and_keeps_the_previous_checkpoint() {
    let _serial = serial();
    let two = Batches::Two { gas: 1 };
    // Room for one checkpoint (about 2 x 130 KiB) but not two.
    let fs = Tmpfs::new("full", "size=400k").expect("tmpfs");
    let first = run(&Phase::new(0, two, 0..1).save(&fs.0, "a"));
    for r in try_run(&Phase::new(0, two, 0..2).save(&fs.0, "b"), &GPT) {
        let text = r.err().expect("every rank fails").to_string();
        assert!(
            text.contains("No space left") || text.contains("failed to save"),
            "{text}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(fs.0.join("latest")).unwrap().trim(),
        "a"
    );
    assert!(!fs.0.join("b").exists() && !fs.0.join(".b.partial").exists());
    // A rank alone removes its staging directory as well.
    let alone = try_run(
        &Phase::new(0, Batches::OneOfTwo, 0..2).save(&fs.0, "b1"),
        &GPT,
    );
    let text = alone[0]
        .as_ref()
        .err()
        .expect("the disk is full")
        .to_string();
    assert!(text.contains("No space left"), "{text}");
    assert!(!fs.0.join(".b1.partial").exists());
    let back = run(&Phase::new(0, two, 1..1).load(&fs.0, None));
    assert_bits("after a failed save", &back.params, &first.params);
    fs.remount("ro");
    for r in try_run(&Phase::new(0, two, 0..1).save(&fs.0, "c"), &GPT) {
        let text = r.err().expect("every rank fails").to_string();
        assert!(
            text.contains("Read-only") || text.contains("failed to save"),
            "{text}"
        );
    }
    let back = run(&Phase::new(0, two, 1..1).load(&fs.0, None));
    assert_bits("read-only", &back.params, &first.params);
}

#[test]
fn consolidated_weights_load_in_tch_with_the_original_names() {
    let _serial = serial();
    let dir = tmp("consolidate");
    let trained = run(&Phase::new(3, Batches::Two { gas: 1 }, 0..2).save(&dir, "a"));
    let out = dir.join("model.safetensors");
    let n = zrt::zero::checkpoint::consolidate(
        &dir,
        None,
        &out,
        zrt::zero::checkpoint::ExportDtype::F32,
    )
    .unwrap();
    assert_eq!(n, trained.params.len());
    let (mut vs, _plan, _gpt) = model();
    vs.load(&out).unwrap();
    let mut loaded: Params = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()))
        .collect();
    loaded.sort_by(|a, b| a.0.cmp(&b.0));
    assert_bits("consolidated", &loaded, &trained.params);
    // bf16: every value is the round-to-nearest-even of the fp32 one.
    let out16 = dir.join("model-bf16.safetensors");
    zrt::zero::checkpoint::consolidate(
        &dir,
        Some("a"),
        &out16,
        zrt::zero::checkpoint::ExportDtype::Bf16,
    )
    .unwrap();
    let t = Tensor::read_safetensors(&out16).unwrap();
    let (_, wte) = t.iter().find(|(n, _)| n == "wte.weight").unwrap();
    assert_eq!(wte.kind(), Kind::BFloat16);
    let want = Tensor::from_slice(
        &trained
            .params
            .iter()
            .find(|p| p.0 == "wte.weight")
            .unwrap()
            .1,
    )
    .to_kind(Kind::BFloat16);
    assert!(wte.flatten(0, -1).equal(&want));
    let text = zrt::zero::checkpoint::inspect(&dir, None).unwrap();
    assert!(
        text.contains("world 2 (mesh 1 x 2), ZeRO stage 3, compute fp32"),
        "{text}"
    );
    assert_eq!(text.matches("checksum ok").count(), 2, "{text}");
    assert!(!text.contains("interrupted saves"), "{text}");
    // What a job killed mid-save leaves behind is pointed out.
    std::fs::create_dir(dir.join(".step9.partial")).unwrap();
    let text = zrt::zero::checkpoint::inspect(&dir, None).unwrap();
    assert!(
        text.contains(": .step9.partial (nothing loads them; delete them to free the space)"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_16bit_model_holds_the_compute_weights() {
    let _serial = serial();
    let dir = tmp("16bit");
    let bf16 = r#""bf16": {"enabled": true},"#;
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 8},"#;
    for (extra, kind) in [(bf16, Kind::BFloat16), (fp16, Kind::Half)] {
        let cfg: Config = config_with(3, 1, 0.0, extra);
        let out = dir.join("model16.safetensors");
        let got: Vec<Params> = on_ranks(2, |r| {
            let (vs, plan, gpt) = model();
            let g = r.new_group(&[0, 1]).unwrap();
            let engine = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
            engine
                .backward(&gpt.loss(&tokens(0, 0, r.rank(), 1)))
                .unwrap();
            engine.step().unwrap();
            engine.save_16bit_model(&out).unwrap();
            engine.gathered_params().unwrap()
        });
        let saved = Tensor::read_safetensors(&out).unwrap();
        assert_eq!(saved.len(), got[0].len());
        for (name, t) in saved {
            assert_eq!(t.kind(), kind, "{name}");
            let master = &got[0].iter().find(|p| p.0 == name).unwrap().1;
            let want = Tensor::from_slice(master).to_kind(kind);
            assert!(t.flatten(0, -1).equal(&want), "{kind:?} {name}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_rng_state_is_restored_and_bad_tags_are_refused() {
    let _serial = serial();
    let dir = tmp("rng");
    let cfg = config_with(1, 1, 0.0, "");
    {
        let (vs, plan, _gpt) = model();
        let engine = solo_engine(&vs, &plan, &cfg).unwrap();
        engine.save_checkpoint(&dir, "a").unwrap();
        let first = Tensor::randn([8], (Kind::Float, tch::Device::Cpu));
        let _ = Tensor::randn([100], (Kind::Float, tch::Device::Cpu));
        engine.load_checkpoint(&dir, Some("a")).unwrap();
        let again = Tensor::randn([8], (Kind::Float, tch::Device::Cpu));
        assert!(
            first.equal(&again),
            "dropout and sampling resume where they were"
        );
        for bad in ["", "../x", ".hidden", "latest"] {
            let e = engine.save_checkpoint(&dir, bad).unwrap_err();
            assert!(e.to_string().contains("invalid checkpoint tag"), "{e}");
        }
        let e = engine
            .load_checkpoint(dir.join("nowhere"), None)
            .unwrap_err();
        assert!(
            e.to_string()
                .ends_with("nowhere does not exist: pass the directory save_checkpoint wrote to"),
            "{e}"
        );
        // Tags but no `latest` (as after copying only the tag directories).
        std::fs::remove_file(dir.join("latest")).unwrap();
        let e = engine.load_checkpoint(&dir, None).unwrap_err();
        assert!(
            e.to_string().ends_with(
                "has no `latest` file naming the tag to load (a completed save writes it): \
                 pass the tag; tags there: a"
            ),
            "{e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn zrt_ckpt_consolidates_for_python_torch_and_inspects() {
    let _serial = serial();
    let dir = tmp("cli");
    let trained = run(&Phase::new(2, Batches::Two { gas: 1 }, 0..1).save(&dir, "a"));
    let zrt = env!("CARGO_BIN_EXE_zrt");
    let out = dir.join("m.safetensors");
    let o = std::process::Command::new(zrt)
        .args(["ckpt", "consolidate"])
        .arg(&dir)
        .arg(&out)
        .args(["--dtype", "bf16"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Python reads it with safetensors into torch tensors of the right names,
    // shapes and dtype; its sum matches ours.
    let want: f64 = trained
        .params
        .iter()
        .find(|p| p.0 == "h.0.fc.weight")
        .map(|p| {
            p.1.iter()
                .map(|&x| Tensor::from(x).to_kind(Kind::BFloat16).double_value(&[]))
                .sum()
        })
        .unwrap();
    let script = format!(
        "from safetensors.torch import load_file\n\
         import torch\n\
         t = load_file(r'{}')\n\
         w = t['h.0.fc.weight']\n\
         assert w.dtype == torch.bfloat16 and list(w.shape) == [128, 32], (w.dtype, w.shape)\n\
         assert len(t) == {}\n\
         print(repr(w.double().sum().item()))\n",
        out.display(),
        trained.params.len()
    );
    let got: f64 = common::python(&script).trim().parse().unwrap();
    assert!(
        (got - want).abs() <= 1e-9 * want.abs().max(1.0),
        "python sum {got}, ours {want}"
    );
    // Sharded as zero_to_fp32.py --max_shard_size writes it: Python
    // reads every tensor from the file the index names, the same bits
    // as the single file's.
    let sharded = dir.join("sharded");
    let o = std::process::Command::new(zrt)
        .args(["ckpt", "consolidate"])
        .arg(&dir)
        .arg(&sharded)
        .args(["--dtype", "bf16", "--max-shard-size", "20KB"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files = std::fs::read_dir(&sharded).unwrap().count() - 1;
    assert!(files > 2, "{said}");
    assert!(
        said.contains(&format!("tensors to {} ({files} files)", sharded.display())),
        "{said}"
    );
    let script = format!(
        "import json, os\n\
         from safetensors.torch import load_file\n\
         import torch\n\
         d = r'{}'\n\
         index = json.load(open(os.path.join(d, 'model.safetensors.index.json')))\n\
         whole = load_file(r'{}')\n\
         files = {{f: load_file(os.path.join(d, f)) for f in set(index['weight_map'].values())}}\n\
         assert sorted(index['weight_map']) == sorted(whole), 'names'\n\
         for n, f in index['weight_map'].items():\n\
         \x20   assert torch.equal(files[f][n], whole[n]), n\n\
         assert all(os.path.getsize(os.path.join(d, f)) < 20000 + 4096 for f in files)\n\
         assert index['metadata']['total_size'] == sum(t.numel() * t.element_size() for t in whole.values())\n\
         print(len(files))\n",
        sharded.display(),
        out.display(),
    );
    assert_eq!(common::python(&script).trim(), files.to_string());
    // inspect: text and a clear failure on a damaged file.
    let inspect = || {
        std::process::Command::new(zrt)
            .args(["ckpt", "inspect"])
            .arg(&dir)
            .output()
            .unwrap()
    };
    let o = inspect();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.contains("ZeRO stage 2") && !text.contains("damaged"),
        "{text}"
    );
    // A rank file that lost its tail, and what an interrupted save left
    // (a staging directory; a plain file of that name is not one), are named.
    let rank_file = dir.join("a").join("rank-00001-of-00002.safetensors");
    let len = std::fs::metadata(&rank_file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&rank_file)
        .unwrap()
        .set_len(len - 8)
        .unwrap();
    std::fs::create_dir_all(dir.join(".b.partial")).unwrap();
    std::fs::write(dir.join(".c.partial"), b"not a directory").unwrap();
    std::fs::create_dir_all(dir.join("d.partial")).unwrap();
    std::fs::create_dir_all(dir.join(".e")).unwrap();
    let o = inspect();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("1 damaged or missing file(s): this tag cannot be loaded"),
        "{text}"
    );
    assert!(
        text.contains(": .b.partial (nothing loads them; delete them to free the space)"),
        "{text}"
    );
    std::fs::write(dir.join("a").join("meta.json"), "{}").unwrap();
    let o = inspect();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("meta.json is not a readable zrt checkpoint file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `zrt launch` of the main job on 2 processes (shm backend) with `args`;
/// what it printed.
fn train_gpt(args: &[&str]) -> String {
    train_gpt_launched(&[], args)
}

/// `zrt launch LAUNCH_ARGS` of the main job on 2 processes (shm backend)
/// with `args`; what it printed.
fn train_gpt_launched(launch_args: &[&str], args: &[&str]) -> String {
    let o = common::output_elsewhere(&mut main_job(launch_args, args));
    let text = common::printed(&o);
    assert!(o.status.success(), "{text}");
    text
}

/// `zrt launch LAUNCH_ARGS` of the main job on 2 processes (shm backend),
/// a model of one small block, with `args`.
fn main_job(launch_args: &[&str], args: &[&str]) -> std::process::Command {
    main_job_on(2, launch_args, &[], args)
}

/// `zrt launch --nproc-per-node NPROC LAUNCH_ARGS -- WRAP train_gpt ARGS`:
/// the main job (a model of one small block), its ranks' program run by
/// `wrap` when given.
fn main_job_on(
    nproc: usize,
    launch_args: &[&str],
    wrap: &[&str],
    args: &[&str],
) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_zrt"));
    c.args(["launch", "--nproc-per-node", &nproc.to_string()])
        .args(launch_args)
        .arg("--")
        .args(wrap)
        .arg(common::example("train_gpt"))
        .args(["--layers", "1", "--d-model", "32", "--heads", "2"])
        .args(["--seq", "32", "--eval-every", "100"])
        .args(args);
    c
}

#[test]
fn the_main_job_stopped_by_a_signal_saves_the_step_it_ended_and_resumes_from_it() {
    // A scheduler's SIGTERM to the launcher, forwarded to each rank: the
    // ranks agree to stop after the step in progress and save it.
    let _serial = serial();
    let (dir, cwd) = (tmp("signalled"), tmp("signalled-cwd"));
    let d = dir.to_str().unwrap();
    // Signalled once training has begun.
    let (said, status) = common::signalled_when(
        main_job(&[], &["--steps", "100000", "--save-dir", d]).current_dir(&cwd),
        libc::SIGTERM,
        |said| said.contains("step    0  validation loss"),
    );
    assert_eq!(status.code(), Some(143), "{said}");
    let step: u64 = said
        .split("stopping after step ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(
        step >= 1 && said.contains(&format!("checkpoint saved to {d}/step{step} ")),
        "{said}"
    );
    let next = (step + 2).to_string();
    let again = train_gpt(&["--steps", &next, "--save-dir", d, "--resume"]);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&cwd);
    assert!(
        again.contains(&format!("resumed from {d} (tag step{step}) at step {step}")),
        "{again}"
    );
}

/// The weights of the main job's checkpoint `step4` in `d`, by name.
fn step4_weights(d: &Path) -> Params {
    // The header's metadata map has no fixed order: compare the tensors.
    let out = d.join("model.safetensors");
    zrt::zero::checkpoint::consolidate(
        d,
        Some("step4"),
        &out,
        zrt::zero::checkpoint::ExportDtype::F32,
    )
    .unwrap();
    let mut t = Tensor::read_safetensors(&out).unwrap();
    t.sort_by(|x, y| x.0.cmp(&y.0));
    t.into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()))
        .collect::<Params>()
}

/// The main job with `args` for 4 steps, and for 2 then 2 more with
/// `--resume`, in fresh processes; both runs' final weights, and what the
/// resumed run printed.
fn main_job_straight_and_resumed(name: &str, args: &[&str]) -> (Params, Params, String) {
    let dir = tmp(name);
    let (a, b) = (dir.join("straight"), dir.join("resumed"));
    let (a_s, b_s) = (a.to_str().unwrap(), b.to_str().unwrap());
    train_gpt(&[args, &["--steps", "4", "--save-dir", a_s]].concat());
    train_gpt(&[args, &["--steps", "2", "--save-dir", b_s]].concat());
    let said = train_gpt(&[args, &["--steps", "4", "--save-dir", b_s, "--resume"]].concat());
    let (straight, resumed) = (step4_weights(&a), step4_weights(&b));
    // Resumed again with nothing left to do: it says so and trains nothing.
    let again = train_gpt(&[args, &["--steps", "4", "--save-dir", b_s, "--resume"]].concat());
    assert!(
        again.contains("nothing to train: the checkpoint is at step 4, --steps is 4"),
        "{again}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    (straight, resumed, said)
}

/// What each rank left out by the main job's line that starts `what`
/// ("LayerDrop: of 4 block runs per rank, rank 0 left out 0, rank 1 left
/// out 2"); empty without the line.
fn left_out_per_rank(said: &str, what: &str) -> Vec<usize> {
    let line = said.lines().find(|l| l.contains(what));
    line.map(|l| {
        l.split("left out ")
            .skip(1)
            .filter_map(|r| r.split(',').next()?.trim().parse().ok())
            .collect()
    })
    .unwrap_or_default()
}

#[test]
fn the_main_job_with_layerdrop_on_each_rank_apart_trains_and_resumes_to_the_same_bits() {
    // Each rank leaves out its own blocks (ZeRO-3, 2 processes): the
    // declared blocks stay gathered and are reduced at the end of
    // backward; a resumed run draws the same blocks.
    let _serial = serial();
    let args = ["--layerdrop", "0.5", "--layers", "2"];
    let (straight, resumed, said) = main_job_straight_and_resumed("layerdrop", &args);
    assert_bits("2 + 2 steps with LayerDrop against 4", &straight, &resumed);
    let left_out = left_out_per_rank(&said, "LayerDrop: of 4 block runs");
    assert!(
        left_out.len() == 2 && left_out.iter().sum::<usize>() > 0,
        "{said}"
    );
}

#[test]
fn the_main_job_with_mlps_left_out_on_each_rank_apart_trains_and_resumes_to_the_same_bits() {
    // Each rank leaves out its own blocks' MLPs, the blocks running
    // (ZeRO-3, 2 processes): declared with partly_unused_on_some_ranks,
    // the blocks are gathered and freed as without it, and reduced when
    // the backward of the unit before each begins; a resumed run draws
    // the same MLPs.
    let _serial = serial();
    let args = ["--mlp-drop", "0.5", "--layers", "2"];
    let (straight, resumed, said) = main_job_straight_and_resumed("mlp-drop", &args);
    assert_bits(
        "2 + 2 steps with MLPs left out against 4",
        &straight,
        &resumed,
    );
    let left_out = left_out_per_rank(&said, "MLP drop: of 4 MLP runs");
    assert!(
        left_out.len() == 2 && left_out.iter().sum::<usize>() > 0,
        "{said}"
    );
}

#[test]
fn the_main_job_restarted_by_the_launcher_after_a_rank_fails_ends_with_the_same_bits() {
    // Rank 1 exits at the start of step 4 on the first attempt, after the
    // checkpoint of step 2; `zrt launch --max-restarts 1` starts both ranks
    // again, which resume from it and train steps 3 and 4 once more.
    let _serial = serial();
    let dir = tmp("restarted");
    let (a, b) = (dir.join("straight"), dir.join("restarted"));
    let (a_s, b_s) = (a.to_str().unwrap(), b.to_str().unwrap());
    train_gpt(&["--steps", "4", "--save-dir", a_s]);
    let said = train_gpt_launched(
        &["--max-restarts", "1"],
        &[
            "--steps",
            "4",
            "--save-every",
            "2",
            "--save-dir",
            b_s,
            "--resume",
            "--fail-at",
            "4",
        ],
    );
    for line in [
        "[rank 1] rank 1 exits at the start of step 4 on purpose (--fail-at 4",
        "zrt launch: rank 1 exited with code 3; stopping the other 1 rank(s)",
        "zrt launch: restarting every rank (restart 1 of 1",
        &format!("resumed from {b_s} (tag step2) at step 2"),
    ] {
        assert!(said.contains(line), "{line}: {said}");
    }
    assert_eq!(
        said.matches("exits at the start of step").count(),
        1,
        "{said}"
    );
    let (straight, restarted) = (step4_weights(&a), step4_weights(&b));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!straight.is_empty());
    assert_bits(
        "4 steps, rank 1 failing at the start of step 4 and the job restarted, against 4",
        &restarted,
        &straight,
    );
}

#[test]
fn the_main_job_goes_on_alone_when_an_elastic_jobs_other_node_dies() {
    // Two launchers of an elastic job (`--nnodes 1:2`), one rank each.
    // Node 1's rank exits at the start of step 4 (--fail-at 4) and kills
    // its own launcher as it goes, as a node lost outright would be: node
    // 0 restarts alone after the last call and resumes from step 2's
    // checkpoint, written by 2 ranks, on 1. Its config's `elasticity`
    // keeps the global batch at 16 (8 x 1 on 2 ranks, 8 x 2 on 1). It
    // ends with the bits of 2 steps on 2 ranks then 2 on 1.
    let _serial = serial();
    let dir = tmp("elastic");
    let (a, b) = (dir.join("reference"), dir.join("elastic"));
    let (a_s, b_s) = (a.to_str().unwrap(), b.to_str().unwrap());
    let config = dir.join("elastic.json");
    std::fs::write(
        &config,
        r#"{"elasticity": {"enabled": true, "max_train_batch_size": 16,
              "micro_batch_sizes": [4, 8], "max_gpus": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}"#,
    )
    .unwrap();
    let cfg = ["--config", config.to_str().unwrap()];
    train_gpt(&[&cfg[..], &["--steps", "2", "--save-dir", a_s]].concat());
    let o = common::output_elsewhere(&mut main_job_on(
        1,
        &[],
        &[],
        &[&cfg[..], &["--steps", "4", "--save-dir", a_s, "--resume"]].concat(),
    ));
    assert!(o.status.success(), "{}", common::printed(&o));
    let port = zrt::collectives::store::free_store_port("127.0.0.1")
        .unwrap()
        .to_string();
    let node = |rank: &str, wrap: &[&str]| {
        let elastic = [
            "--nnodes",
            "1:2",
            "--node-rank",
            rank,
            "--master-port",
            &port,
            "--last-call",
            "2",
            "--max-restarts",
            "1",
        ];
        let args = [
            "--steps",
            "4",
            "--save-every",
            "2",
            "--save-dir",
            b_s,
            "--resume",
            "--fail-at",
            "4",
        ];
        let mut c = main_job_on(1, &elastic, wrap, &[&cfg[..], &args[..]].concat());
        c.env("ZRT_TOKEN", "0123456789abcdef0123456789abcdef")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c
    };
    let cwd = tmp("elastic-cwd");
    let first = node("0", &[]).current_dir(&cwd).spawn().unwrap();
    let lost = [
        "sh",
        "-c",
        "\"$0\" \"$@\"; c=$?; [ $c = 3 ] && kill -9 $PPID; exit $c",
    ];
    let second = node("1", &lost).current_dir(&cwd).spawn().unwrap();
    let (first, second) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    let said = common::printed(&first);
    assert!(
        first.status.success(),
        "{said}\n{}",
        common::printed(&second)
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        second.status.signal(),
        Some(libc::SIGKILL),
        "{}",
        common::printed(&second)
    );
    for line in [
        "[rank 0] zrt train_gpt: 2 ranks",
        "[rank 0] batch 16 sequences of 32 bytes per step (8 per rank x 1 accumulation x 2 ranks)",
        "zrt launch: restarting every rank (restart 1 of 1",
        "[rank 0] zrt train_gpt: 1 ranks",
        "[rank 0] batch 16 sequences of 32 bytes per step (8 per rank x 2 accumulation x 1 ranks)",
        &format!("resumed from {b_s} (tag step2) at step 2"),
        "zrt launch: every rank ended well after 1 restart(s)",
    ] {
        assert!(said.contains(line), "{line}: {said}");
    }
    let (reference, elastic) = (step4_weights(&a), step4_weights(&b));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&cwd);
    assert!(!reference.is_empty());
    assert_bits(
        "2 steps on 2 ranks, then node 1 lost and 2 steps alone, against the same by hand",
        &elastic,
        &reference,
    );
}

#[test]
fn the_main_job_keeps_its_newest_checkpoints_by_step_with_keep_last() {
    // Ten saves, two kept: by step (by name `step10` would come before
    // `step9` and be removed); what is not a committed checkpoint stays.
    let _serial = serial();
    let dir = tmp("keep-last");
    let d = dir.to_str().unwrap();
    let staging = ".step99.partial-0123456789abcdef";
    for other in [staging, "notes"] {
        std::fs::create_dir_all(dir.join(other)).unwrap();
    }
    let said = train_gpt(&[
        "--steps",
        "10",
        "--save-every",
        "1",
        "--keep-last",
        "2",
        "--save-dir",
        d,
    ]);
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        [staging, "latest", "notes", "step10", "step9"],
        "{said}"
    );
    assert!(
        said.contains("removed older checkpoint(s) step8 (--keep-last)"),
        "{said}"
    );
    let again = train_gpt(&["--steps", "11", "--save-dir", d, "--resume"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(again.contains("(tag step10) at step 10"), "{again}");
}

/// The validation loss the main job printed on its line for `step`.
fn validation_at(said: &str, step: u64) -> &str {
    let line = (said.lines())
        .find(|l| l.contains(&format!("step {step:4}  ")) && l.contains("validation loss"))
        .unwrap_or_else(|| panic!("no validation at step {step}: {said}"));
    let after = line.split("validation loss ").nth(1).unwrap_or_default();
    after.split_whitespace().next().unwrap_or_default()
}

#[test]
fn the_main_job_started_from_a_consolidated_file_starts_where_its_run_ended() {
    // Trained 2 steps, consolidated, loaded by a fresh job (each rank its
    // own shard of the file, no rank the model): it starts with the
    // weights the first ended with, so its first validation loss is the
    // first's last.
    let _serial = serial();
    let dir = tmp("init-from");
    let d = dir.to_str().unwrap();
    let first = train_gpt(&["--steps", "2", "--save-dir", d]);
    let file = dir.join("model.safetensors");
    zrt::zero::checkpoint::consolidate(
        &dir,
        Some("step2"),
        &file,
        zrt::zero::checkpoint::ExportDtype::F32,
    )
    .unwrap();
    let f = file.to_str().unwrap();
    // Built holding no weights (ShardPlan::weights_from_file), and every
    // rank building the model and loading the file into the built engine.
    for how in [&[][..], &["--weights-on-every-rank"]] {
        let second = train_gpt(&[how, &["--init-from", f, "--steps", "2", "--no-save"]].concat());
        assert!(
            second.contains(&format!("initialised from {f} (")),
            "{second}"
        );
        assert_eq!(
            validation_at(&second, 0),
            validation_at(&first, 2),
            "{first}\n{second}"
        );
    }
    // The file of another model is refused on every rank, naming it.
    let o = common::output_elsewhere(&mut main_job(
        &[],
        &[
            "--init-from",
            f,
            "--d-model",
            "16",
            "--steps",
            "1",
            "--no-save",
        ],
    ));
    let said = common::printed(&o);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!o.status.success(), "{said}");
    assert!(said.contains("does not match the model"), "{said}");
}

#[test]
fn the_main_job_built_on_disk_trains_as_it_does_built_on_rank_0() {
    // `--build-on-disk DIR`: rank 0 writes the model to DIR as it is made
    // rather than holding it; the run is the run without it, and DIR is
    // left as it was.
    let _serial = serial();
    let dir = tmp("build-on-disk");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let args = ["--steps", "2", "--eval-every", "1", "--no-save"];
    let held = train_gpt(&args);
    let on_disk = train_gpt(&[&args[..], &["--build-on-disk", d]].concat());
    let left = std::fs::read_dir(&dir).unwrap().count();
    assert!(
        on_disk.contains("the first wrote them to disk as it built"),
        "{on_disk}"
    );
    for step in [0, 1, 2] {
        assert_eq!(
            validation_at(&on_disk, step),
            validation_at(&held, step),
            "{held}\n{on_disk}"
        );
    }
    // Two ways of building at once are refused, naming both.
    let o = common::output_elsewhere(&mut main_job(
        &[],
        &["--build-on-disk", d, "--weights-on-every-rank", "--no-save"],
    ));
    let said = common::printed(&o);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(left, 0);
    assert!(!o.status.success(), "{said}");
    assert!(
        said.contains(
            "--build-on-disk and --weights-on-every-rank ask for two ways of building the model"
        ),
        "{said}"
    );
}

#[test]
fn the_main_job_resumed_in_fresh_processes_ends_with_the_same_bits() {
    let _serial = serial();
    let (straight, resumed, _) = main_job_straight_and_resumed("processes", &[]);
    assert!(!straight.is_empty());
    assert_bits(
        "2 + 2 steps in fresh processes against 4",
        &resumed,
        &straight,
    );
}

#[test]
fn the_main_job_with_a_frozen_mlp_keeps_it_and_resumes_to_the_same_bits() {
    let _serial = serial();
    // Stage 3 holds the frozen MLP weights as shards in each process.
    let (straight, resumed, said) = main_job_straight_and_resumed("frozen-mlp", &["--freeze-mlp"]);
    assert!(
        said.contains("M frozen params (every block's MLP weights"),
        "{said}"
    );
    assert_bits("frozen MLP: 2 + 2 steps against 4", &resumed, &straight);
    // Checkpoints after 2 and 4 steps hold the same frozen weights, whole,
    // while the rest trains.
    let dir = tmp("frozen-mlp-kept");
    let d = dir.to_str().unwrap();
    train_gpt(&[
        "--freeze-mlp",
        "--steps",
        "4",
        "--save-every",
        "2",
        "--save-dir",
        d,
    ]);
    let at = |tag: &str| -> std::collections::HashMap<String, Vec<f32>> {
        let out = dir.join(format!("{tag}.safetensors"));
        zrt::zero::checkpoint::consolidate(
            &dir,
            Some(tag),
            &out,
            zrt::zero::checkpoint::ExportDtype::F32,
        )
        .unwrap();
        Tensor::read_safetensors(&out)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()))
            .collect()
    };
    let (two, four) = (at("step2"), at("step4"));
    let _ = std::fs::remove_dir_all(&dir);
    for n in ["h.0.fc.weight", "h.0.out.weight"] {
        assert_eq!(two[n], four[n], "{n} is frozen");
    }
    assert_ne!(
        two["h.0.qkv.weight"], four["h.0.qkv.weight"],
        "the rest trains"
    );
}

#[test]
fn the_main_job_in_fp16_resumes_after_the_steps_an_overflow_skipped() {
    let _serial = serial();
    // A loss scale of 2^20 overflows the first two steps; the next two train.
    let dir = tmp("fp16-config");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("fp16.json");
    let base = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/ds_zero3.json"
    ))
    .unwrap();
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 20, "hysteresis": 1},"#;
    std::fs::write(&cfg, base.replacen('{', &format!("{{{fp16}"), 1)).unwrap();
    let (straight, resumed, said) =
        main_job_straight_and_resumed("fp16", &["--config", cfg.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        said.matches("step skipped on every rank").count(),
        0,
        "{said}"
    );
    assert!(
        said.contains("at step 2"),
        "resumed after both skipped steps: {said}"
    );
    assert!(said.contains("fp16 compute on CPU"), "the warning: {said}");
    assert_bits(
        "fp16: 2 (both skipped) + 2 steps in fresh processes against 4",
        &resumed,
        &straight,
    );
}

#[test]
fn optimizer_state_offloaded_to_nvme_saves_and_loads_exactly() {
    let _serial = serial();
    // Saved from the swap, loaded into memory, and the other way round.
    let two = Batches::Two { gas: 1 };
    let swap_dir = tmp("swap");
    let (aio, off) = nvme(&swap_dir);
    let bf16 = r#""bf16": {"enabled": true},"#;
    let with_swap = format!("{bf16}{aio}");
    let stage3_all = format!("{off}{}", nvme_params(&swap_dir));
    for (stage, off) in [
        (2u8, off.as_str()),
        (3, off.as_str()),
        (3, stage3_all.as_str()),
    ] {
        let dir = tmp(&format!("offload-{stage}"));
        let straight = run(&Phase {
            extra: bf16,
            ..Phase::new(stage, two, 0..4)
        });
        run(&Phase {
            extra: &with_swap,
            zero: off,
            ..Phase::new(stage, two, 0..2).save(&dir, "swapped")
        });
        let resumed = run(&Phase {
            extra: bf16,
            ..Phase::new(stage, two, 2..4).load(&dir, None)
        });
        assert_bits(
            &format!("stage {stage}: swap -> memory"),
            &resumed.params,
            &straight.params,
        );
        run(&Phase {
            extra: bf16,
            ..Phase::new(stage, two, 0..2).save(&dir, "memory")
        });
        let resumed = run(&Phase {
            extra: &with_swap,
            zero: off,
            ..Phase::new(stage, two, 2..4).load(&dir, None)
        });
        assert_bits(
            &format!("stage {stage}: memory -> swap"),
            &resumed.params,
            &straight.params,
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&swap_dir);
}

/// The test GPT (its VarStore, which must outlive the engine) and its
/// engine under `cfg` on rank `r` of a 4-rank in-process world, in 2
/// replicas of shard groups of 2.
fn hybrid(cfg: &Config, r: &LocalRank) -> (tch::nn::VarStore, Gpt, Engine<LocalGroup>) {
    let (vs, plan, gpt) = model();
    let mesh = r.mesh(2).unwrap();
    let e = Engine::new_hybrid(&vs, &plan, cfg, mesh, &AutoHints::default()).unwrap();
    (vs, gpt, e)
}

#[test]
fn each_replica_of_a_hybrid_stage_1_job_resumes_its_own_accumulated_gradients() {
    let _serial = serial();
    // Stage 1 sums each rank's micro-steps locally until the boundary, so
    // the two replicas' sums differ. Until 2026-11-29 only the first
    // replica's were saved and the second resumed with them: silently
    // other parameters after the next step.
    let cfg = config_zero(1, 2, 0.5, "", r#""mics_shard_size": 2,"#);
    let dir = tmp("hybrid-mid");
    let train = |micros: std::ops::Range<usize>, load: bool, save: bool| {
        on_ranks(4, |r| {
            let (_vs, gpt, e) = hybrid(&cfg, &r);
            if load {
                e.load_checkpoint(&dir, Some("mid")).unwrap();
            }
            for m in micros.clone() {
                e.backward(&gpt.loss(&tokens(m / 2, m % 2, r.rank(), 2)))
                    .unwrap();
                e.step().unwrap();
            }
            if save {
                e.save_checkpoint(&dir, "mid").unwrap();
            }
            e.gathered_params().unwrap()
        })
        .remove(0)
    };
    let straight = train(0..6, false, false);
    // After the first micro-step of step 1.
    train(0..3, false, true);
    let own = dir
        .join("mid")
        .join("grads-replica-00001-rank-00001-of-00002.safetensors");
    assert!(own.is_file(), "{} is not there", own.display());
    let text = zrt::zero::checkpoint::inspect(&dir, Some("mid")).unwrap();
    assert!(
        text.contains("grads-replica-00001-rank-00001-of-00002.safetensors")
            && !text.contains("missing"),
        "{text}"
    );
    let resumed = train(3..6, true, false);
    assert_bits("hybrid stage 1 between boundaries", &resumed, &straight);
    // On a plain 2-rank world the second replica's sums would be lost.
    let plain = Phase::new(1, Batches::Two { gas: 2 }, 0..0).load(&dir, Some("mid"));
    let err = try_run(&plain, &GPT).remove(0).err().unwrap().to_string();
    assert!(
        err.contains("saved on a mesh of 2 x 2 ranks (replicas x shard group), loading on 1 x 2"),
        "{err}"
    );
    // A replica's file gone: every rank's load fails, naming it.
    std::fs::remove_file(&own).unwrap();
    let errs = on_ranks(4, |r| {
        let (_vs, _, e) = hybrid(&cfg, &r);
        e.load_checkpoint(&dir, Some("mid"))
            .unwrap_err()
            .to_string()
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(
            e.contains(&format!("{} is missing", own.display())),
            "rank {rank}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hybrid_sharded_checkpoint_loads_on_a_plain_world() {
    let _serial = serial();
    // Saved by 4 ranks in 2 shard groups (one group writes), loaded by 2.
    let dir = tmp("hybrid");
    let cfg = config_zero(3, 1, 0.5, "", r#""mics_shard_size": 2,"#);
    let saved: Vec<Params> = on_ranks(4, |r| {
        let (_vs, gpt, engine) = hybrid(&cfg, &r);
        for step in 0..2 {
            engine
                .backward(&gpt.loss(&tokens(step, 0, r.rank(), 1)))
                .unwrap();
            engine.step().unwrap();
        }
        // Each rank offers its own client state: world rank 0's is kept.
        let client = serde_json::json!({ "rank": r.rank() });
        engine.save_checkpoint_with(&dir, "h", &client).unwrap();
        engine.gathered_params().unwrap()
    });
    let text = zrt::zero::checkpoint::inspect(&dir, None).unwrap();
    assert!(text.contains("world 2 (mesh 2 x 2)"), "{text}");
    assert!(text.contains(r#"client state {"rank":0}"#), "{text}");
    let loaded = run(&Phase::new(3, Batches::Two { gas: 1 }, 0..0).load(&dir, None));
    let mut want = saved[0].clone();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_bits("hybrid -> plain", &loaded.params, &want);
    // The second shard group's ranks load from a directory whose tag is
    // gone: the first group's ranks, which could load, fail too, naming
    // the failed ranks by their world rank.
    let gone = tmp("hybrid-gone");
    std::fs::write(gone.join("latest"), "h\n").unwrap();
    let errs = on_ranks(4, |r| {
        let (_vs, _, engine) = hybrid(&cfg, &r);
        let from = if r.rank() < 2 { &dir } else { &gone };
        engine.load_checkpoint(from, None).unwrap_err().to_string()
    });
    for (rank, e) in errs.iter().enumerate() {
        let want = match rank {
            0 | 1 => "rank(s) [2, 3] failed to load".to_string(),
            _ => format!("{} is missing", gone.join("h").join("meta.json").display()),
        };
        assert!(e.contains(&want), "rank {rank}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&gone);
}

/// Which half of the RNG test `rng_rank_main` runs when re-executed by
/// `zrt launch`, and in which directory.
const RNG_CASE: &str = "ZRT_CKPT_RNG_CASE";
const RNG_DIR: &str = "ZRT_CKPT_RNG_DIR";

/// One rank of a real 4-process hybrid job (2 replicas of shard groups of
/// 2, shm backend), when this test binary is re-executed by the test below
/// (a no-op otherwise). `save`: each rank seeds libtorch's generator with
/// its own seed (replicas draw different dropout masks), trains a step,
/// saves, then prints its next draw. `load`: a fresh rank loads and prints
/// its next draw. libtorch's CPU generator is process-global, so only
/// processes can show that each replica resumes its own stream.
#[test]
fn rng_rank_main() {
    let (Ok(case), Ok(dir)) = (std::env::var(RNG_CASE), std::env::var(RNG_DIR)) else {
        return;
    };
    let mut dist = zrt::collectives::init_from_env().unwrap();
    let rank = dist.env().rank;
    let (vs, plan, gpt) = model();
    let cfg = config_zero(3, 1, 0.5, "", r#""mics_shard_size": 2,"#);
    let engine = Engine::new_hybrid(
        &vs,
        &plan,
        &cfg,
        dist.mesh(2).unwrap(),
        &AutoHints::default(),
    )
    .unwrap();
    if case == "save" {
        tch::manual_seed(1000 + rank as i64);
        engine.backward(&gpt.loss(&tokens(0, 0, rank, 1))).unwrap();
        engine.step().unwrap();
        engine.save_checkpoint(&dir, "rng").unwrap();
    } else {
        tch::manual_seed(7);
        engine.load_checkpoint(&dir, None).unwrap();
    }
    let draw = Vec::<f32>::try_from(&Tensor::rand([4], (Kind::Float, tch::Device::Cpu))).unwrap();
    println!("@@ {rank} {draw:?}");
}

/// `zrt launch`es 4 ranks of `rng_rank_main`; each rank's printed draw.
fn launch_rng(case: &str, dir: &Path) -> Vec<(usize, String)> {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["launch", "--nproc-per-node", "4", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "checkpoint::rng_rank_main",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(RNG_CASE, case)
        .env(RNG_DIR, dir)
        .env("ZRT_BACKEND", "shm")
        .output()
        .unwrap();
    let text = common::printed(&o);
    assert!(o.status.success(), "{text}");
    let mut draws: Vec<(usize, String)> = text
        .lines()
        .filter_map(|l| l.split_once("@@ ").map(|(_, s)| s))
        .filter_map(|s| s.split_once(' '))
        .map(|(r, d)| (r.parse().unwrap(), d.to_string()))
        .collect();
    draws.sort();
    assert_eq!(draws.len(), 4, "{text}");
    draws
}

#[test]
fn every_replica_of_a_hybrid_job_resumes_its_own_rng_stream() {
    let _serial = serial();
    let dir = tmp("replica-rng");
    let saved = launch_rng("save", &dir);
    let loaded = launch_rng("load", &dir);
    // The replicas' streams differ, so a replica given another's state
    // would draw another's numbers.
    let distinct: std::collections::HashSet<_> = saved.iter().map(|(_, d)| d).collect();
    assert_eq!(distinct.len(), 4, "{saved:?}");
    assert_eq!(loaded, saved, "each rank draws on where it left off");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model with a trained linear `lin`, a frozen parameter `emb` and a
/// buffer `stat` of `stat_len` elements (as a running statistic).
struct FrozenModel {
    vs: tch::nn::VarStore,
    plan: zrt::zero::ShardPlan,
    lin: zrt::zero::ShardedModule<tch::nn::Linear>,
    emb: Tensor,
    stat: Tensor,
}

fn frozen_model(stat_len: i64) -> FrozenModel {
    use tch::nn;
    tch::manual_seed(3);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let plan = zrt::zero::ShardPlan::new();
    let root = vs.root();
    let lin = zrt::zero::ShardedModule::new(
        &plan,
        &(&root / "lin"),
        nn::linear(&root / "lin", 4, 3, Default::default()),
    );
    let emb = root.randn_standard("emb", &[5, 4]);
    let _ = emb.set_requires_grad(false);
    let stat = root.zeros_no_train("stat", &[stat_len]);
    FrozenModel {
        vs,
        plan,
        lin,
        emb,
        stat,
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

#[test]
fn frozen_variables_are_saved_restored_and_exported() {
    use tch::nn::Module;
    let _serial = serial();
    let dir = tmp("frozen");
    let cfg = config_with(3, 1, 0.0, "");
    let m = frozen_model(3);
    let engine = solo_engine(&m.vs, &m.plan, &cfg).unwrap();
    let x = Tensor::ones([2, 5], (Kind::Float, tch::Device::Cpu));
    let loss = (m.lin.forward(&x.matmul(&m.emb)) + &m.stat)
        .square()
        .mean(Kind::Float);
    engine.backward(&loss).unwrap();
    assert!(engine.step().unwrap());
    tch::no_grad(|| {
        m.stat
            .shallow_clone()
            .copy_(&Tensor::from_slice(&[1f32, 2., 3.]))
    });
    let (emb, stat) = (values(&m.emb), values(&m.stat));
    engine.save_checkpoint(&dir, "t").unwrap();
    let exported = dir.join("model.safetensors");
    engine.save_16bit_model(&exported).unwrap();

    // A load gives the saved values back.
    tch::no_grad(|| {
        let _ = m.emb.shallow_clone().fill_(0.0);
        let _ = m.stat.shallow_clone().fill_(0.0);
    });
    engine.load_checkpoint(&dir, None).unwrap();
    assert_eq!(
        (values(&m.emb), values(&m.stat)),
        (emb.clone(), stat.clone())
    );
    let trained = engine.gathered_params().unwrap();

    // Both model files hold them, under their names.
    let consolidated = dir.join("consolidated.safetensors");
    let n = zrt::zero::checkpoint::consolidate(
        &dir,
        None,
        &consolidated,
        zrt::zero::checkpoint::ExportDtype::F32,
    )
    .unwrap();
    assert_eq!(n, 4, "lin.weight, lin.bias, emb, stat");
    for file in [&exported, &consolidated] {
        let got: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(file)
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(got.len(), 4, "{}", file.display());
        assert_eq!(values(&got["emb"]), emb, "{}", file.display());
        assert_eq!(got["emb"].size(), [5, 4]);
        assert_eq!(values(&got["stat"]), stat, "{}", file.display());
    }
    let text = zrt::zero::checkpoint::inspect(&dir, None).unwrap();
    assert!(
        text.contains("2 frozen variables, 23 elements (rank 0's, in frozen.safetensors)")
            && text.contains("frozen.safetensors  "),
        "{text}"
    );
    drop(engine);

    // Another model's buffer is named, not loaded.
    let other = frozen_model(4);
    let engine = solo_engine(&other.vs, &other.plan, &cfg).unwrap();
    let e = engine.load_checkpoint(&dir, None).unwrap_err().to_string();
    assert!(
        e.contains("the checkpoint is of another model")
            && e.contains("stat: checkpoint F32 [3], model Float [4]"),
        "{e}"
    );
    drop(engine);

    // A checkpoint written before zrt saved frozen variables loads the
    // trained parameters and leaves the frozen ones as they are, saying so.
    strip_frozen(&dir.join("t").join("meta.json"));
    let fresh = frozen_model(3);
    let engine = solo_engine(&fresh.vs, &fresh.plan, &cfg).unwrap();
    tch::no_grad(|| drop(fresh.emb.shallow_clone().fill_(0.0)));
    let (loaded, logs) = common::with_logs(|| engine.load_checkpoint(&dir, None));
    loaded.unwrap();
    assert!(
        logs.contains("the checkpoint was written before zrt saved frozen variables"),
        "{logs}"
    );
    assert_eq!(
        (values(&fresh.emb), values(&fresh.stat)),
        (vec![0.0; 20], vec![0.0; 3])
    );
    assert_eq!(engine.gathered_params().unwrap(), trained);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_without_frozen_variables_loads_a_checkpoint_from_before_them_quietly() {
    let _serial = serial();
    let dir = tmp("pre-frozen-plain");
    let (vs, plan, _) = model();
    let e = solo_engine(&vs, &plan, &config_with(3, 1, 0.0, "")).unwrap();
    e.save_checkpoint(&dir, "t").unwrap();
    strip_frozen(&dir.join("t").join("meta.json"));
    // Nothing of this model keeps old values: no warning that something does.
    let (loaded, logs) = common::with_logs(|| e.load_checkpoint(&dir, None));
    loaded.unwrap();
    assert!(!logs.contains("frozen variables"), "{logs}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rewrites a checkpoint's `meta.json` as zrt wrote it before it saved
/// frozen variables (no `frozen` field), checksum and all.
fn strip_frozen(meta: &Path) {
    strip_field(meta, "frozen");
}

/// Rewrites a checkpoint's `meta.json` without `field`, as zrt wrote it
/// before it recorded that, checksum and all.
fn strip_field(meta: &Path, field: &str) {
    let text = std::fs::read_to_string(meta).unwrap();
    let mut file: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut body = file["body"].take();
    assert!(body.as_object_mut().unwrap().remove(field).is_some());
    let body = body.to_string();
    let crc = crc32fast::hash(body.as_bytes());
    let text = format!("{{\"crc32\":\"{crc:08x}\",\"body\":{body}}}\n");
    std::fs::write(meta, text).unwrap();
}

/// Loads the latest checkpoint in `dir` into `e` (whole, or only the
/// weights) and returns what was logged meanwhile.
fn logged_load<G: zrt::collectives::ProcessGroup + 'static>(
    e: &zrt::zero::Engine<G>,
    dir: &Path,
    module_only: bool,
) -> String {
    let (loaded, logs) = common::with_logs(|| match module_only {
        true => e.load_checkpoint_module_only(dir, None).map(|_| ()),
        false => e.load_checkpoint(dir, None).map(|_| ()),
    });
    loaded.unwrap();
    logs
}

#[test]
fn a_resume_that_changes_what_weight_decay_leaves_out_is_warned_about() {
    let _serial = serial();
    let dir = tmp("decay-rule");
    let cfg = config_with(3, 1, 0.0, "");
    // Each phase builds a fresh model and engine, as a restarted job would.
    let engine = |rule: bool| {
        let (vs, plan, _) = model();
        if rule {
            plan.exclude_from_weight_decay(|_, shape| shape.len() < 2)
                .unwrap();
        }
        let vectors: Vec<String> = (vs.variables().into_iter())
            .filter(|(_, t)| t.dim() < 2)
            .map(|(name, _)| name)
            .collect();
        (solo_engine(&vs, &plan, &cfg).unwrap(), vectors, vs)
    };
    let (e, mut vectors, _vs) = engine(true);
    e.save_checkpoint(&dir, "t").unwrap();
    drop(e);
    vectors.sort();
    assert!(vectors.len() > 5, "{vectors:?}");
    let meta = std::fs::read_to_string(dir.join("t").join("meta.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    assert_eq!(
        meta["body"]["no_weight_decay"],
        serde_json::json!(vectors),
        "the checkpoint records what its run left out"
    );
    let shown = zrt::zero::checkpoint::inspect(&dir, Some("t")).unwrap();
    assert!(
        shown.contains(&format!(
            "{} parameter(s) left out of weight decay: {}",
            vectors.len(),
            vectors.join(", ")
        )),
        "{shown}"
    );
    let load = |rule: bool, module_only: bool| {
        let (e, _, _vs) = engine(rule);
        logged_load(&e, &dir, module_only)
    };
    // The same rule: quiet.
    let logs = load(true, false);
    assert!(!logs.contains("weight decay"), "{logs}");
    // No rule: every vector decays from here on, and the warning says so.
    let logs = load(false, false);
    let first = vectors
        .iter()
        .take(5)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>();
    assert!(
        logs.contains("WARN")
            && logs.contains(&format!(
                "the checkpoint's run left {} parameter(s) out of weight decay, this engine's plan leaves out 0: from here on weight decay follows the plan (now left out: none; now decayed: {} and {} more)",
                vectors.len(),
                first.join(", "),
                vectors.len() - 5
            )),
        "{logs}"
    );
    // Only the weights: no optimizer state is carried on, nothing to warn of.
    let logs = load(false, true);
    assert!(!logs.contains("weight decay"), "{logs}");
    // A checkpoint from before zrt recorded it: nothing to compare with.
    strip_field(&dir.join("t").join("meta.json"), "no_weight_decay");
    let logs = load(false, false);
    assert!(!logs.contains("weight decay"), "{logs}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_resume_that_changes_learning_rate_scales_is_warned_about() {
    let _serial = serial();
    let dir = tmp("lr-scales");
    let cfg = config_with(3, 1, 0.0, "");
    // Each phase builds a fresh model and engine, as a restarted job would:
    // block 0 at half the rate, or (`faster`) the embedding at twice it.
    let engine = |rule: Option<bool>| {
        let (vs, plan, _) = model();
        if let Some(faster) = rule {
            plan.scale_learning_rate(move |name, _| match name {
                n if n.starts_with("h.0.") => 0.5,
                "wte.weight" if faster => 2.0,
                _ => 1.0,
            })
            .unwrap();
        }
        let block0: Vec<String> = (vs.variables().into_keys())
            .filter(|n| n.starts_with("h.0."))
            .collect();
        (solo_engine(&vs, &plan, &cfg).unwrap(), block0, vs)
    };
    let (e, mut block0, _vs) = engine(Some(false));
    e.save_checkpoint(&dir, "t").unwrap();
    drop(e);
    block0.sort();
    assert!(block0.len() > 5, "{block0:?}");
    let meta = std::fs::read_to_string(dir.join("t").join("meta.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    let halves: serde_json::Map<String, serde_json::Value> =
        block0.iter().map(|n| (n.clone(), 0.5.into())).collect();
    assert_eq!(
        meta["body"]["lr_scales"],
        serde_json::Value::Object(halves),
        "the checkpoint records its run's scales"
    );
    let shown = zrt::zero::checkpoint::inspect(&dir, Some("t")).unwrap();
    let each: Vec<String> = block0.iter().map(|n| format!("{n} x0.5")).collect();
    assert!(
        shown.contains(&format!(
            "{} parameter(s) with a scaled learning rate: {}",
            block0.len(),
            each.join(", ")
        )),
        "{shown}"
    );
    let load = |rule: Option<bool>, module_only: bool| {
        let (e, _, _vs) = engine(rule);
        logged_load(&e, &dir, module_only)
    };
    // The same rule: quiet.
    let logs = load(Some(false), false);
    assert!(!logs.contains("learning rate"), "{logs}");
    // One more parameter scaled: the warning names it alone.
    let logs = load(Some(true), false);
    assert!(
        logs.contains("WARN")
            && logs.contains(&format!(
                "the checkpoint's run scaled the learning rate of {} parameter(s), this engine's plan scales {}: from here on the plan's scales apply (1 changed: `wte.weight` x1 -> x2)",
                block0.len(),
                block0.len() + 1,
            )),
        "{logs}"
    );
    // No rule: block 0 is back at the schedule's rate.
    let logs = load(None, false);
    assert!(
        logs.contains(&format!(
            "this engine's plan scales 0: from here on the plan's scales apply ({} changed: `{}` x0.5 -> x1,",
            block0.len(),
            block0[0]
        )),
        "{logs}"
    );
    // Only the weights: no optimizer state is carried on, nothing to warn of.
    let logs = load(None, true);
    assert!(!logs.contains("learning rate"), "{logs}");
    // A checkpoint from before zrt recorded scales had none: a plan that
    // scales is a change.
    strip_field(&dir.join("t").join("meta.json"), "lr_scales");
    let logs = load(None, false);
    assert!(!logs.contains("learning rate"), "{logs}");
    let logs = load(Some(false), false);
    assert!(
        logs.contains("the checkpoint's run scaled the learning rate of 0 parameter(s)"),
        "{logs}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_programs_own_state_comes_back_with_its_checkpoint() {
    let _serial = serial();
    let dir = tmp("client-state");
    let (vs, plan, _) = model();
    let e = solo_engine(&vs, &plan, &config_with(3, 1, 0.0, "")).unwrap();
    let state = serde_json::json!({"epoch": 3, "batches": [1, 2]});
    e.save_checkpoint_with(&dir, "with", &state).unwrap();
    e.save_checkpoint(&dir, "without").unwrap();
    assert_eq!(
        e.load_checkpoint_with(&dir, Some("with")).unwrap(),
        ("with".to_string(), state)
    );
    assert_eq!(
        e.load_checkpoint_with(&dir, None).unwrap(),
        ("without".to_string(), serde_json::Value::Null),
        "the latest, saved without"
    );
    let shown = zrt::zero::checkpoint::inspect(&dir, Some("with")).unwrap();
    assert!(
        shown.contains(r#"client state {"batches":[1,2],"epoch":3}"#),
        "{shown}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_given_different_tags_load_nothing_and_name_what_each_read() {
    // Each rank's load alone succeeds: before, rank 0 took its shards from
    // step 1 and rank 1 from step 2, and the model mixed them unsaid.
    let _serial = serial();
    let dir = tmp("different-tags");
    run(&Phase::new(3, Batches::Two { gas: 1 }, 0..1).save(&dir, "a"));
    run(&Phase::new(3, Batches::Two { gas: 1 }, 0..2).save(&dir, "b"));
    let cfg = config_zero(3, 1, 0.5, "", "");
    let out = on_ranks(2, |r| {
        let (vs, plan, _) = model_of(&GPT);
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
        let before = e.gathered_params().unwrap();
        let err = e
            .load_checkpoint(&dir, Some(["a", "b"][r.rank()]))
            .unwrap_err();
        (err, before == e.gathered_params().unwrap())
    });
    let d = dir.display();
    for (e, unchanged) in out {
        let text = e.to_string();
        assert!(
            matches!(e, EngineError::Checkpoint(CheckpointError::NotTheSame(_))),
            "{text}"
        );
        assert!(
            text.starts_with(&format!(
                "ranks read different checkpoints: rank 0 read {d}/a (step 1); rank 1 read {d}/b (step 2); nothing was loaded"
            )),
            "{text}"
        );
        assert!(unchanged, "a refused load changed the parameters");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_from_loads_the_latest_or_nothing_and_names_ranks_that_disagree() {
    // What a restarted program calls first: the latest checkpoint if the
    // directory has one, a fresh start if not, and an error on every rank
    // when only some ranks find one (a directory they do not share).
    let _serial = serial();
    let (dir, empty) = (tmp("resume-from"), tmp("resume-from-empty"));
    run(&Phase::new(3, Batches::Two { gas: 1 }, 0..2).save(&dir, "b"));
    let saved = run(&Phase::new(3, Batches::Two { gas: 1 }, 0..2)).params;
    // Two ranks, and 2 x 2 under hybrid sharding; the even ranks see the
    // checkpoint in the mixed case, the odd ones an empty folder.
    for (world, zero) in [(2, ""), (4, r#""mics_shard_size": 2,"#)] {
        let cfg = config_zero(3, 1, 0.5, "", zero);
        let out = on_ranks(world, |r| {
            let (vs, plan, _) = model_of(&GPT);
            let hints = AutoHints::default();
            let e = match world {
                2 => Engine::new(&vs, &plan, &cfg, r.new_group(&[0, 1]).unwrap(), &hints),
                _ => Engine::new_hybrid(&vs, &plan, &cfg, r.mesh(2).unwrap(), &hints),
            }
            .unwrap();
            let before = e.gathered_params().unwrap();
            let fresh = e.resume_from(&empty).unwrap().is_none();
            let untouched = before == e.gathered_params().unwrap();
            let mine = if r.rank() % 2 == 0 { &dir } else { &empty };
            let mixed = e.resume_from(mine).unwrap_err().to_string();
            let still = before == e.gathered_params().unwrap();
            let resumed = e.resume_from(&dir).unwrap().map(|(tag, _)| tag);
            let mut params = e.gathered_params().unwrap();
            params.sort_by(|a, b| a.0.cmp(&b.0));
            (
                fresh && untouched,
                mixed,
                still,
                resumed,
                e.global_step(),
                params,
            )
        });
        let (even, odd) = match world {
            2 => ("0", "1"),
            _ => ("0, 2", "1, 3"),
        };
        for (rank, (fresh, mixed, still, resumed, step, params)) in out.into_iter().enumerate() {
            let mine = if rank % 2 == 0 { &dir } else { &empty };
            let want = format!(
                "ranks read different checkpoints: rank(s) {even} found one; rank(s) {odd} found none (in {}, as this rank sees it); nothing was loaded",
                mine.display()
            );
            assert!(fresh, "a directory with no checkpoint loads nothing");
            assert!(mixed.starts_with(&want), "{want}\n{mixed}");
            assert!(still, "a refused resume changed the parameters");
            assert_eq!((resumed.as_deref(), step), (Some("b"), 2));
            assert_bits("resumed from the latest", &params, &saved);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&empty);
}

#[test]
fn ranks_saving_under_different_tags_write_nothing_and_name_each_tag() {
    // Before, rank 1 wrote into a staging directory of its own tag that
    // rank 0 never committed: an error about a missing directory, or, where
    // a failed save had left that staging directory behind (`.b.partial`,
    // as staging directories were named then), a file written into it and
    // rank 0's checkpoint committed without rank 1's shards.
    let _serial = serial();
    let dir = tmp("save-different-tags");
    std::fs::create_dir_all(dir.join(".b.partial")).unwrap();
    let cfg = config_zero(3, 1, 0.0, "", "");
    let out = on_ranks(2, |r| {
        let (vs, plan, _) = model();
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
        let err = e.save_checkpoint(&dir, ["a", "b"][r.rank()]).unwrap_err();
        // The engine goes on: the same tag everywhere saves.
        e.save_checkpoint(&dir, "same").unwrap();
        err
    });
    for e in out {
        let text = e.to_string();
        assert!(
            matches!(
                e,
                EngineError::Checkpoint(CheckpointError::DifferentTags(_))
            ),
            "{text}"
        );
        assert!(
            text.starts_with("ranks saved under different tags: rank 0 saved under `a`; rank 1 saved under `b`; nothing was written"),
            "{text}"
        );
    }
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, [".b.partial", "latest", "same"]);
    assert_eq!(
        std::fs::read_dir(dir.join(".b.partial")).unwrap().count(),
        0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_saving_to_different_directories_commit_nothing_and_say_so() {
    // Rank 1's directory is not rank 0's (another path; on several nodes,
    // storage that is not shared): before, it wrote into a staging folder
    // of its own directory where one was left, and rank 0 committed a
    // checkpoint without its shards, both saves returning Ok.
    let _serial = serial();
    let dirs = [tmp("save-dir-0"), tmp("save-dir-1")];
    std::fs::create_dir_all(&dirs[1]).unwrap();
    let cfg = config_zero(3, 1, 0.0, "", "");
    let out = on_ranks(2, |r| {
        let (vs, plan, _) = model();
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
        let err = e.save_checkpoint(&dirs[r.rank()], "a").unwrap_err();
        // The engine goes on: one directory saves.
        e.save_checkpoint(&dirs[0], "b").unwrap();
        err.to_string()
    });
    assert_eq!(
        out[1],
        format!("this rank does not see the staging folder rank 0 made for this save in {}: every rank must save to the same directory, on several nodes one they share; nothing was committed", dirs[1].display())
    );
    assert!(
        out[0].starts_with("rank(s) [1] failed to save the checkpoint"),
        "{}",
        out[0]
    );
    let names = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&dirs[0]), ["b", "latest"]);
    assert!(names(&dirs[1]).is_empty());
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn a_save_only_rank_0_calls_is_named_as_a_collective() {
    let _serial = serial();
    let dir = tmp("rank-0-only");
    let cfg = config_with(3, 1, 0.0, "");
    let out = on_ranks(2, |r| {
        let (vs, plan, gpt) = model();
        let world = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, world, &AutoHints::default()).unwrap();
        // The usual mistake: saving under `if rank == 0` while the others
        // go on training.
        if r.rank() == 0 {
            e.save_checkpoint(&dir, "x").err().map(|e| e.to_string())
        } else {
            let r2 = (|| {
                e.backward(&gpt.loss(&tokens(0, 0, 1, 1)))?;
                e.step()
            })();
            r2.err().map(|e| e.to_string())
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (saver, trainer) = (out[0].clone().unwrap(), out[1].clone().unwrap());
    assert!(
        saver.contains("save_checkpoint is a collective: every rank calls it")
            && saver.contains("collective mismatch"),
        "{saver}"
    );
    // Not "uneven gradients": the peer is checkpointing.
    assert!(
        trainer.contains("another rank is saving or loading a checkpoint while this one trains")
            && !trainer.contains("ShardPlan::unused_on_some_ranks"),
        "{trainer}"
    );
}

/// Where a fine-tuning run's weights come from.
#[derive(Clone, Copy)]
enum Start<'a> {
    /// Copied into the VarStore before the engine is built (pretrained
    /// weights, the README's way).
    Weights(&'a Params),
    /// `load_checkpoint_module_only` of this directory's latest tag.
    ModuleOnly(&'a Path),
    /// `load_checkpoint` of it (the whole training state).
    Resume(&'a Path),
}

/// Trains `steps` steps of stage `stage` on 2 ranks from a fresh model
/// started at `start`. Rank 0's final parameters and global step.
fn fine_tune((stage, extra, zero): (u8, &str, &str), steps: usize, start: Start) -> (Params, u64) {
    let cfg = config_zero(stage, 1, 0.5, extra, zero);
    on_ranks(2, |r| {
        let (vs, plan, gpt) = model();
        if let Start::Weights(init) = start {
            common::put_params(&vs, init);
        }
        let world = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, world, &AutoHints::default()).unwrap();
        let tag = match start {
            Start::Weights(_) => None,
            Start::ModuleOnly(dir) => Some(e.load_checkpoint_module_only(dir, None).unwrap().0),
            Start::Resume(dir) => Some(e.load_checkpoint(dir, None).unwrap()),
        };
        assert!(tag.as_deref().is_none_or(|t| t == "pre"), "{tag:?}");
        for s in 0..steps {
            e.backward(&gpt.loss(&tokens(s + 100, 0, r.rank(), 1)))
                .unwrap();
            e.step().unwrap();
        }
        let mut params = e.gathered_params().unwrap();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        (params, e.global_step())
    })
    .swap_remove(0)
}

#[test]
fn a_module_only_load_into_an_engine_that_has_stepped_starts_its_optimizer_afresh() {
    // The step after the load equals a new engine's first step from the
    // same parameters: the moments and the step count they go by start
    // again. Before, the count went on from the engine's own step: Adam's
    // bias correction of step 3 on zero moments (a tenth of the update),
    // SGD's dampened first buffer, Adagrad's rate decayed twice.
    let _serial = serial();
    let dir = tmp("module-only-stepped");
    run(&Phase::new(3, Batches::Two { gas: 1 }, 0..3).save(&dir, "pre"));
    let optimizers = [
        ("AdamW", ""),
        ("SGD", r#", "momentum": 0.9, "dampening": 0.5"#),
        ("Adagrad", r#", "lr_decay": 0.5"#),
        ("Lamb", ""),
    ];
    for (optimizer, params) in optimizers {
        let cfg = common::config_params(optimizer, params, 2, 1, 0.0, "", "");
        let after = |trained: usize| {
            on_ranks(2, |r| {
                let (vs, plan, gpt) = model();
                let e = common::engine_of(&vs, &plan, &cfg, &r);
                common::train_losses(&gpt, &e, r.rank(), trained);
                e.load_checkpoint_module_only(&dir, Some("pre")).unwrap();
                common::next_step(&e, &gpt, r.rank())
            })
        };
        assert_eq!(after(2), after(0), "{optimizer}");
    }
    // A checkpoint saved after such a load keeps the count its moments go
    // by (1 here), not the engine's (3): a full load resumes to the bit.
    let cfg = config_zero(2, 1, 0.0, "", "");
    let straight = on_ranks(2, |r| {
        let (vs, plan, gpt) = model();
        let e = common::engine_of(&vs, &plan, &cfg, &r);
        common::train_losses(&gpt, &e, r.rank(), 2);
        e.load_checkpoint_module_only(&dir, Some("pre")).unwrap();
        common::next_step(&e, &gpt, r.rank());
        e.save_checkpoint(&dir, "tuned").unwrap();
        common::next_step(&e, &gpt, r.rank())
    });
    let resumed = on_ranks(2, |r| {
        let (vs, plan, gpt) = model();
        let e = common::engine_of(&vs, &plan, &cfg, &r);
        e.load_checkpoint(&dir, Some("tuned")).unwrap();
        common::next_step(&e, &gpt, r.rank())
    });
    assert_eq!(resumed, straight);
    let shown = zrt::zero::checkpoint::inspect(&dir, Some("tuned")).unwrap();
    assert!(
        shown.contains("  step 3 (optimizer step 1), micro-step 3,"),
        "{shown}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_module_only_load_fine_tunes_like_weights_loaded_before_the_engine() {
    let _serial = serial();
    let dir = tmp("module-only");
    // "Pre-training": three steps of stage 3, saved.
    let pre = run(&Phase::new(3, Batches::Two { gas: 1 }, 0..3).save(&dir, "pre")).params;
    // Fine-tuning from it, two ways: the same bits, and the step count
    // starts again (Adam's moments and bias correction too). At stage 2;
    // and at stage 3 in bf16 with the optimizer state swapped to NVMe.
    let swap = dir.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let (aio, off) = nvme(&swap);
    let bf16 = format!(r#""bf16": {{"enabled": true}}, {aio}"#);
    let plain = (2, "", "");
    for setup in [plain, (3, bf16.as_str(), off.as_str())] {
        let (loaded, step) = fine_tune(setup, 2, Start::ModuleOnly(&dir));
        let (reference, _) = fine_tune(setup, 2, Start::Weights(&pre));
        let what = format!(
            "stage {}: module-only load vs weights loaded first",
            setup.0
        );
        assert_bits(&what, &loaded, &reference);
        assert_eq!(step, 2, "the fine-tuning engine's own step count");
    }
    // Not what a full load gives: that one carries the moments on.
    let (loaded, _) = fine_tune(plain, 2, Start::ModuleOnly(&dir));
    let (resumed, step) = fine_tune(plain, 2, Start::Resume(&dir));
    assert_eq!(step, 5);
    assert!(
        resumed.iter().zip(&loaded).any(|((_, a), (_, b))| a != b),
        "a full load and a module-only load trained alike"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

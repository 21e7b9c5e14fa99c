//! NVMe offload of the optimizer state: bit-identical to training in
//! memory, bounded resident memory, and clear errors for a missing,
//! read-only or full directory and for a swap file that lost data.

use crate::common;

use std::path::{Path, PathBuf};

use common::{
    config_zero, model, model_of, nvme, nvme_params, on_ranks, solo_engine, tokens, Params, GPT,
};
use tch::Kind;
use zrt::gpt::GptConfig;
use zrt::zero::{AutoHints, Config, Engine, EngineError};

struct Outcome {
    losses: Vec<f64>,
    params: Params,
    resident: usize,
    offloaded: u64,
}

/// Trains `steps` steps on 2 ranks (threads) with `cfg`.
fn train(cfg: &Config, gpt: &GptConfig, steps: usize) -> Vec<Result<Outcome, EngineError>> {
    on_ranks(2, |r| -> Result<Outcome, EngineError> {
        let (vs, plan, m) = model_of(gpt);
        let g = r.new_group(&[0, 1]).unwrap();
        let engine = Engine::new(&vs, &plan, cfg, g, &AutoHints::default())?;
        let mut losses = Vec::new();
        for step in 0..steps {
            let loss = m.loss(&tokens(step, 0, r.rank(), 1));
            losses.push(loss.double_value(&[]));
            engine.backward(&loss)?;
            engine.step()?;
        }
        Ok(Outcome {
            losses,
            resident: engine.model_state_bytes()?,
            offloaded: engine.offloaded_bytes(),
            params: engine.gathered_params()?,
        })
    })
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zrt-offload-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn swap_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".swap"))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn nvme_offload_is_bit_identical_to_training_in_memory() {
    let bf16 = r#""bf16": {"enabled": true},"#;
    for (precision, stage) in [("", 1u8), ("", 2), ("", 3), (bf16, 1), (bf16, 3)] {
        let dir = tmp(&format!("parity-{stage}-{}", precision.len()));
        let (aio, off) = nvme(&dir);
        let plain = config_zero(stage, 1, 0.5, precision, "");
        let swapped = config_zero(stage, 1, 0.5, &format!("{precision}{aio}"), &off);
        let a = train(&plain, &GPT, 4).remove(0).unwrap();
        let b = train(&swapped, &GPT, 4).remove(0).unwrap();
        let what = format!("stage {stage} {precision}");
        assert_eq!(a.losses, b.losses, "{what}");
        for ((n, x), (_, y)) in a.params.iter().zip(&b.params) {
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{what}: {n}"
            );
        }
        assert!(b.offloaded > 0 && a.offloaded == 0);
        assert_eq!(
            swap_files(&dir),
            0,
            "{what}: swap files are removed with the engine"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn stage_3_parameter_offload_is_bit_identical_and_moves_the_shards_out() {
    let bf16 = r#""bf16": {"enabled": true},"#;
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 8},"#;
    for precision in ["", bf16, fp16] {
        let dir = tmp(&format!("params-{}", precision.len()));
        let (aio, off) = nvme(&dir);
        let params = nvme_params(&dir);
        let plain = train(&config_zero(3, 1, 0.5, precision, ""), &GPT, 4)
            .remove(0)
            .unwrap();
        // The parameter swap's bytes, from the first run (parameters only).
        let mut params_file = 0;
        for zero in [params.clone(), format!("{params}{off}")] {
            let cfg = config_zero(3, 1, 0.5, &format!("{precision}{aio}"), &zero);
            let b = train(&cfg, &GPT, 4).remove(0).unwrap();
            let what = format!("{precision} {zero}");
            assert_eq!(plain.losses, b.losses, "{what}");
            for ((n, x), (_, y)) in plain.params.iter().zip(&b.params) {
                assert!(
                    x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{what}: {n}"
                );
            }
            // The shards (2 or 4 bytes a parameter over 2 ranks) left memory.
            let trained = plain.params.iter().map(|p| p.1.len()).sum::<usize>() / 2;
            let shard_bytes = if precision.is_empty() { 4 } else { 2 } * trained;
            assert!(
                plain.resident > b.resident + shard_bytes / 2,
                "{what}: {} -> {}",
                plain.resident,
                b.resident
            );
            // The files hold them (whole chunks a unit), and with the
            // optimizer offloaded too at least its m and v (8 bytes a
            // parameter) on top.
            if params_file == 0 {
                params_file = b.offloaded;
                assert!(params_file as usize >= shard_bytes, "{what}: {params_file}");
            } else {
                assert!(
                    b.offloaded >= params_file + 8 * trained as u64,
                    "{what}: {} with the optimizer, {params_file} without",
                    b.offloaded
                );
            }
            assert_eq!(swap_files(&dir), 0);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // Stage 3 only, as in DeepSpeed.
    let dir = tmp("params-stage");
    let e = train(&config_zero(2, 1, 0.0, "", &nvme_params(&dir)), &GPT, 0)
        .remove(0)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("offload_param needs ZeRO stage 3"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resident_optimizer_memory_stays_at_the_buffers_while_the_state_is_larger() {
    // bf16 stage 1: master, m and v (12 bytes a parameter) go to the swap.
    let big = GptConfig { d_model: 64, ..GPT };
    let dir = tmp("resident");
    let (aio, off) = nvme(&dir);
    let bf16 = r#""bf16": {"enabled": true},"#;
    let plain = train(&config_zero(1, 1, 0.0, bf16, ""), &big, 1)
        .remove(0)
        .unwrap();
    let swapped = train(
        &config_zero(1, 1, 0.0, &format!("{bf16}{aio}"), &off),
        &big,
        1,
    )
    .remove(0)
    .unwrap();
    // 3 buffers x 3 arrays x 4 KiB chunks.
    let buffers = 3 * 3 * 4096;
    let moved = plain.resident - (swapped.resident - buffers);
    assert!(
        swapped.offloaded as usize >= 8 * buffers,
        "the state ({} bytes) is several times the buffers ({buffers})",
        swapped.offloaded
    );
    // What left memory is exactly the optimizer state the swap holds (its
    // file rounds each unit up to whole chunks).
    assert!(
        moved as u64 <= swapped.offloaded && moved as u64 * 10 >= swapped.offloaded * 9,
        "moved {moved}, offloaded {}",
        swapped.offloaded
    );
    // And it is all three arrays of this rank's half: 12 bytes a
    // parameter, not m and v alone (8), which would leave the fp32 master
    // in memory.
    let params: usize = plain.params.iter().map(|p| p.1.len()).sum();
    assert!(
        moved >= 12 * params / 2,
        "moved {moved} bytes for {params} parameters over 2 ranks"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_read_only_or_full_nvme_path_is_a_clear_error() {
    let missing = std::env::temp_dir().join("zrt-offload-no-such-dir");
    let (aio, off) = nvme(&missing);
    let e = train(&config_zero(2, 1, 0.0, &aio, &off), &GPT, 0)
        .remove(0)
        .err()
        .unwrap();
    assert!(e.to_string().contains("does not exist"), "{e}");
    let (vs, plan, _) = model();
    let e = solo_engine(&vs, &plan, &config_zero(0, 1, 0.0, &aio, &off))
        .err()
        .unwrap();
    assert!(e.to_string().contains("needs ZeRO stage 1, 2 or 3"), "{e}");
    // A tmpfs too small for the swap, then read-only (needs root, which this
    // project's machines and CI have).
    let dir = tmp("small");
    let mounted = Mounted::new(&dir);
    let (aio, off) = nvme(&dir);
    let res = train(&config_zero(2, 1, 0.0, &aio, &off), &GPT, 0);
    for r in res {
        let e = r.err().expect("the swap does not fit");
        assert!(
            e.to_string()
                .contains("not enough space for the optimizer swap file"),
            "{e}"
        );
    }
    assert_eq!(swap_files(&dir), 0, "nothing half-written is left");
    mounted.remount("remount,ro,size=64m");
    let e = train(&config_zero(2, 1, 0.0, &aio, &off), &GPT, 0)
        .remove(0)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("not writable") || e.to_string().contains("Read-only"),
        "{e}"
    );
    drop(mounted);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 64 KiB tmpfs mounted on a folder (needs root, which this project's
/// machines and CI have), unmounted however the test ends: one left
/// mounted in /tmp outlives the test run.
struct Mounted<'a>(&'a Path);

impl<'a> Mounted<'a> {
    fn new(dir: &'a Path) -> Self {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "cannot mount a tmpfs on {} (not root?)", dir.display());
        Mounted(dir)
    }

    /// Mounts it again with `opts` (`remount,...`).
    fn remount(&self, opts: &str) {
        let ok = std::process::Command::new("mount")
            .args(["-o", opts])
            .arg(self.0)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mount -o {opts} {}", self.0.display());
    }
}

impl Drop for Mounted<'_> {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.0).status();
    }
}

/// On 2 ranks: a build under `cfg` that must fail with `error`; once both
/// ranks failed, rank 0 runs `mend`; then a build on the same model and
/// plan, which trains two steps. Rank 0's parameters, as the failed build
/// left them (they must still be fp32) and trained.
fn built_again(cfg: &Config, error: &str, mend: impl Fn() + Sync) -> (Params, Params) {
    let failed = std::sync::Barrier::new(2);
    let mut out = on_ranks(2, |r| {
        let (vs, plan, m) = model_of(&GPT);
        let build = || {
            let group = r.new_group(&[0, 1]).unwrap();
            Engine::new(&vs, &plan, cfg, group, &AutoHints::default())
        };
        let e = build().err().expect("the first build fails");
        assert!(e.to_string().contains(error), "{e}");
        failed.wait();
        if r.rank() == 0 {
            mend();
        }
        failed.wait();
        let left = values(&vs);
        let engine = build().unwrap();
        for step in 0..2 {
            engine
                .backward(&m.loss(&tokens(step, 0, r.rank(), 1)))
                .unwrap();
            engine.step().unwrap();
        }
        (left, engine.gathered_params().unwrap())
    });
    out.remove(0)
}

/// `vs`'s variables by name, which must be fp32.
fn values(vs: &tch::nn::VarStore) -> Params {
    let mut p: Params = Vec::new();
    for (name, t) in vs.variables() {
        assert_eq!(t.kind(), Kind::Float, "{name}");
        p.push((name, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()));
    }
    p.sort_by(|a, b| a.0.cmp(&b.0));
    p
}

#[test]
fn a_build_refused_for_a_missing_nvme_path_leaves_the_model_as_it_was() {
    // Checked before the parameters are laid out (a bf16 build left them
    // bf16, and the next build refused them), so the mended build trains
    // as a first one does.
    let dir = tmp("retry").join("swap");
    let (aio, off) = nvme(&dir);
    let bf16 = r#""bf16": {"enabled": true},"#;
    let cfg = config_zero(3, 1, 0.0, &format!("{aio}{bf16}"), &off);
    let (left, trained) = built_again(&cfg, "does not exist", || {
        std::fs::create_dir_all(&dir).unwrap();
    });
    assert_eq!(left, values(&model_of(&GPT).0));
    assert_eq!(trained, train(&cfg, &GPT, 2).remove(0).unwrap().params);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn a_build_that_fails_on_a_full_drive_leaves_the_plan_to_the_next_one() {
    // The swap file is made after the engine claimed the plan and laid out
    // the parameters: the failed build must leave the plan free (it stayed
    // claimed: "this plan already drives another engine").
    let dir = tmp("full");
    let mounted = Mounted::new(&dir);
    let (aio, off) = nvme(&dir);
    let cfg = config_zero(3, 1, 0.0, &aio, &off);
    let (left, trained) = built_again(&cfg, "not enough space", || {
        mounted.remount("remount,size=64m")
    });
    drop(mounted);
    // fp32: laid out, the parameters hold rank 0's values, which every
    // rank's fresh model has.
    assert_eq!(left, values(&model_of(&GPT).0));
    assert_eq!(trained, train(&cfg, &GPT, 2).remove(0).unwrap().params);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn swap_buffers_past_the_hosts_memory_are_refused_when_the_engine_is_built() {
    // Both aborted the process in the allocator at the first step's
    // stream ("memory allocation of ... bytes failed"), after the model was
    // built and the swap files written.
    let dir = tmp("buffers");
    let optimizer = format!(
        r#""offload_optimizer": {{"device": "nvme", "nvme_path": "{}", "buffer_count": 1e12}},"#,
        dir.display()
    );
    let params = nvme_params(&dir);
    for (stage, aio, zero) in [
        (2, r#""aio": {"block_size": 4096},"#, optimizer),
        (3, r#""aio": {"block_size": 1e15},"#, params),
    ] {
        for r in train(&config_zero(stage, 1, 0.0, aio, &zero), &GPT, 1) {
            let e = r.err().expect("the buffers cannot fit").to_string();
            assert!(
                e.contains("do not fit in the")
                    && e.contains("lower `buffer_count` or `aio.block_size`"),
                "stage {stage}: {e}"
            );
        }
        assert_eq!(swap_files(&dir), 0, "stage {stage}: no swap file made");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_swap_file_that_lost_data_fails_the_step_with_a_short_read() {
    let dir = tmp("short");
    let (aio, off) = nvme(&dir);
    let cfg = config_zero(3, 1, 0.0, &aio, &off);
    let (vs, plan, m) = model();
    let engine = solo_engine(&vs, &plan, &cfg).unwrap();
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(8192)
        .unwrap();
    engine.backward(&m.loss(&tokens(0, 0, 0, 1))).unwrap();
    let e = engine.step().unwrap_err().to_string();
    assert!(
        e.contains("short read") && e.contains(&file.display().to_string()),
        "{e}"
    );
    drop(engine);
    assert!(!file.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

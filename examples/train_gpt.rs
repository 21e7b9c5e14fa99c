//! The main job: a GPT trained byte-level on real text across ranks with
//! ZeRO, configured by a DeepSpeed JSON file.
//!
//! `cargo xtask demo` runs `zrt launch --nproc-per-node 2 -- train_gpt`
//! (shared-memory backend, ZeRO-3 from `examples/ds_zero3.json`, CPU).
//!
//! The corpus is the license texts every Debian-based system ships in
//! `/usr/share/common-licenses` (about 260 KB of English), else the system
//! Python's standard library sources; `--corpus DIR` picks another folder.
//! The last 10% of the bytes is held out for validation.
//!
//! At the end it saves a sharded checkpoint (tag `stepN`) to
//! `target/train_gpt-checkpoints` (`--save-dir DIR`, `--no-save`,
//! `--save-every N`); `--resume` first loads the latest one there and goes
//! on from its step. SIGTERM or Ctrl-C (which `zrt launch` forwards to
//! every rank) stops the job after the step in progress, every rank alike,
//! and saves that step's checkpoint. `zrt ckpt consolidate DIR
//! model.safetensors` turns one into a file of the model's weights, which
//! `--init-from model.safetensors` starts another run from (no rank
//! holding the model: `ShardPlan::weights_from_file`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use tch::{nn, Device, Tensor};
use zrt::collectives::{init_from_env, ProcessGroup, ReduceOp};
use zrt::gpt::{is_mlp_param, layerdrop, Gpt, GptConfig};
use zrt::zero::{AutoHints, Config, Engine, ShardPlan};

struct Args {
    config: PathBuf,
    corpus: Option<PathBuf>,
    steps: u64,
    eval_every: u64,
    gpt: GptConfig,
    /// Where checkpoints go (`--save-dir`; `--no-save` for none).
    save_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end).
    save_every: u64,
    /// How many of the newest checkpoints to keep (`--keep-last`; all
    /// when `None`).
    keep_last: Option<std::num::NonZeroUsize>,
    /// Load the latest checkpoint in `save_dir` first, if there is one.
    resume: bool,
    /// A whole-model weights file to start from (`--init-from`).
    init_from: Option<PathBuf>,
    /// Freeze every block's MLP weights (`--freeze-mlp`).
    freeze_mlp: bool,
    /// Recompute every block's activations in backward
    /// (`--checkpoint-activations`).
    checkpoint: bool,
    /// The chance that a block is left out of a micro-batch's forward
    /// (`--layerdrop`), drawn on each rank apart.
    layerdrop: f64,
    /// The chance that a block's MLP is left out of a micro-batch's
    /// forward, the block running (`--mlp-drop`), drawn on each rank
    /// apart: experts that a rank's tokens did not reach, as it were.
    mlp_drop: f64,
    /// The step at whose start the last rank exits on the job's first
    /// attempt (`--fail-at`), as a crashed rank would.
    fail_at: Option<u64>,
    /// Every rank builds the whole model (`--weights-on-every-rank`), as
    /// without `ShardPlan::weights_on_first_rank_only`.
    weights_on_every_rank: bool,
    /// The first rank writes the model to this directory as it is built
    /// rather than holding it (`--build-on-disk`,
    /// `ShardPlan::weights_on_disk_while_built`).
    build_on_disk: Option<PathBuf>,
}

/// The options: name, what follows it (empty for a switch), what it does.
const OPTIONS: &[(&str, &str, &str)] = &[
    (
        "--config",
        "FILE",
        "DeepSpeed JSON config (default: examples/ds_zero3.json)",
    ),
    (
        "--corpus",
        "DIR",
        "folder of text to train on (default: the license texts)",
    ),
    ("--steps", "N", "optimizer steps (default: 400)"),
    (
        "--eval-every",
        "N",
        "steps between validation losses (default: 100)",
    ),
    ("--d-model", "N", "model width (default: 256)"),
    ("--layers", "N", "transformer blocks (default: 6)"),
    (
        "--heads",
        "N",
        "attention heads, dividing --d-model (default: 8)",
    ),
    ("--seq", "N", "sequence length in bytes (default: 128)"),
    (
        "--save-dir",
        "DIR",
        "where checkpoints go (default: target/train_gpt-checkpoints)",
    ),
    (
        "--save-every",
        "N",
        "steps between checkpoints (default: 0, only at the end)",
    ),
    (
        "--keep-last",
        "N",
        "after each save, remove the checkpoints in the save directory but the N newest (default: keep all)",
    ),
    ("--no-save", "", "save no checkpoint"),
    (
        "--resume",
        "",
        "first load the latest checkpoint in the save directory",
    ),
    (
        "--init-from",
        "FILE",
        "start from the weights in FILE (safetensors under the model's names: `zrt ckpt consolidate`'s output, save_16bit_model's; or a sharded checkpoint's model.safetensors.index.json, or its directory): no rank holds the model, the engine loads each rank's shard of FILE as it is built (ShardPlan::weights_from_file; with --weights-on-every-rank, Engine::load_weights into the built engine); a checkpoint --resume finds comes after it",
    ),
    (
        "--freeze-mlp",
        "",
        "freeze every block's MLP weights, as a LoRA fine-tune freezes its base (stage 3 shards them)",
    ),
    (
        "--checkpoint-activations",
        "",
        "recompute every block's activations in backward instead of keeping them (less memory, one more block forward per step)",
    ),
    (
        "--layerdrop",
        "P",
        "leave each block out of a micro-batch's forward with chance P, drawn on each rank apart (LayerDrop; the blocks are declared with ShardPlan::unused_on_some_ranks)",
    ),
    (
        "--mlp-drop",
        "P",
        "leave each block's MLP out of a micro-batch's forward with chance P, drawn on each rank apart, the block running (as experts no token reached; declared with ShardPlan::partly_unused_on_some_ranks, which stage 3 keeps sharded)",
    ),
    (
        "--fail-at",
        "N",
        "on the job's first attempt (TORCHELASTIC_RESTART_COUNT 0 or unset), the last rank exits with code 3 at the start of step N, as a crashed rank would: to see `zrt launch --max-restarts` and --resume go on from the latest checkpoint",
    ),
    (
        "--weights-on-every-rank",
        "",
        "every rank builds the whole model, as without ShardPlan::weights_on_first_rank_only (to compare what building peaks at)",
    ),
    (
        "--build-on-disk",
        "DIR",
        "the first rank writes each block to an unnamed file in DIR as the model is built instead of holding the model, so no rank holds it while building (ShardPlan::weights_on_disk_while_built); not with --init-from, which holds none either, or --weights-on-every-rank",
    ),
    ("--help", "", "print this and exit"),
];

/// The usage text `--help` prints.
fn usage() -> String {
    let mut u = String::from(
        "train_gpt: the main job, a GPT trained byte-level with ZeRO\n\
         usage: zrt launch --nproc-per-node N -- train_gpt [OPTIONS]\n\n",
    );
    for (name, value, what) in OPTIONS {
        u.push_str(&format!("  {:<22} {what}\n", format!("{name} {value}")));
    }
    u
}

/// The command line as option -> value (`""` for a switch). An unknown
/// option or a missing value is an error, so a typo such as `--step 10`
/// does not silently train the default 400 steps.
fn options(args: &[String]) -> Result<std::collections::HashMap<&'static str, String>> {
    let mut got = std::collections::HashMap::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(&(name, value, _)) = OPTIONS.iter().find(|o| o.0 == a) else {
            let names: Vec<&str> = OPTIONS.iter().map(|o| o.0).collect();
            bail!("unknown option `{a}`; the options are {}", names.join(", "));
        };
        let v = match value.is_empty() {
            true => String::new(),
            false => it
                .next()
                .with_context(|| format!("{name} needs a value ({value})"))?
                .clone(),
        };
        got.insert(name, v);
    }
    Ok(got)
}

/// The arguments, or `None` when `--help` asked for the usage.
fn parse_args() -> Result<Option<Args>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = options(&args)?;
    if opts.contains_key("--help") {
        return Ok(None);
    }
    let get = |name: &str| opts.get(name).map(String::as_str);
    // A count of at least `min`; `d` when the option is not given.
    let num = |name: &str, d: i64, min: i64| -> Result<i64> {
        let v = get(name).map_or(Ok(d), |v| {
            v.parse()
                .with_context(|| format!("{name} takes a whole number, got `{v}`"))
        })?;
        if v < min {
            bail!("{name} must be at least {min}, got {v}");
        }
        Ok(v)
    };
    // A chance from 0 up to (not including) 1; 0 when not given.
    let chance = |name: &str| -> Result<f64> {
        match get(name) {
            None => Ok(0.0),
            Some(v) => match v.parse::<f64>() {
                Ok(p) if (0.0..1.0).contains(&p) => Ok(p),
                _ => bail!("{name} takes a chance from 0 up to (not including) 1, got `{v}`"),
            },
        }
    };
    let gpt = GptConfig {
        vocab: 256,
        d_model: num("--d-model", 256, 1)?,
        layers: num("--layers", 6, 1)?,
        heads: num("--heads", 8, 1)?,
        seq: num("--seq", 128, 1)?,
    };
    if let (Some(_), Some(other)) = (
        get("--build-on-disk"),
        ["--init-from", "--weights-on-every-rank"]
            .into_iter()
            .find(|o| opts.contains_key(*o)),
    ) {
        bail!("--build-on-disk and {other} ask for two ways of building the model: drop one (--init-from already builds with no rank holding the model)");
    }
    if gpt.d_model % gpt.heads != 0 {
        bail!(
            "--heads {} must divide --d-model {}",
            gpt.heads,
            gpt.d_model
        );
    }
    Ok(Some(Args {
        config: get("--config").map_or_else(
            || {
                PathBuf::from(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/examples/ds_zero3.json"
                ))
            },
            PathBuf::from,
        ),
        corpus: get("--corpus").map(PathBuf::from),
        steps: num("--steps", 400, 1)? as u64,
        eval_every: num("--eval-every", 100, 1)? as u64,
        gpt,
        save_dir: match opts.contains_key("--no-save") {
            true => None,
            false => Some(get("--save-dir").map_or_else(
                || {
                    PathBuf::from(concat!(
                        env!("CARGO_MANIFEST_DIR"),
                        "/target/train_gpt-checkpoints"
                    ))
                },
                PathBuf::from,
            )),
        },
        save_every: num("--save-every", 0, 0)? as u64,
        keep_last: match get("--keep-last") {
            None => None,
            Some(_) => std::num::NonZeroUsize::new(num("--keep-last", 1, 1)? as usize),
        },
        resume: opts.contains_key("--resume"),
        init_from: get("--init-from").map(PathBuf::from),
        freeze_mlp: opts.contains_key("--freeze-mlp"),
        checkpoint: opts.contains_key("--checkpoint-activations"),
        layerdrop: chance("--layerdrop")?,
        mlp_drop: chance("--mlp-drop")?,
        weights_on_every_rank: opts.contains_key("--weights-on-every-rank"),
        build_on_disk: get("--build-on-disk").map(PathBuf::from),
        fail_at: match get("--fail-at") {
            None => None,
            Some(_) => Some(num("--fail-at", 1, 1)? as u64),
        },
    }))
}

/// Every regular file under `dir` whose name passes `keep`, sorted.
fn files(dir: &Path, keep: &dyn Fn(&Path) -> bool, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() && !p.is_symlink() {
            files(&p, keep, out);
        } else if p.is_file() && keep(&p) {
            out.push(p);
        }
    }
}

fn corpus(dir: Option<&Path>) -> Result<(Vec<u8>, String)> {
    let mut candidates: Vec<(PathBuf, bool)> = Vec::new();
    match dir {
        Some(d) => candidates.push((d.to_path_buf(), false)),
        None => {
            candidates.push((PathBuf::from("/usr/share/common-licenses"), false));
            for v in ["3.13", "3.12", "3.11", "3.10"] {
                candidates.push((PathBuf::from(format!("/usr/lib/python{v}")), true));
            }
        }
    }
    for (d, py_only) in &candidates {
        let mut fs = Vec::new();
        let keep = |p: &Path| !py_only || p.extension().is_some_and(|e| e == "py");
        files(d, &keep, &mut fs);
        let mut text = Vec::new();
        for f in &fs {
            text.extend(std::fs::read(f).unwrap_or_default());
            if text.len() > 8 << 20 {
                break;
            }
        }
        if text.len() >= 64 << 10 {
            return Ok((text, d.display().to_string()));
        }
    }
    bail!(
        "no text corpus found (tried {}): pass --corpus DIR with at least 64 KiB of text",
        candidates
            .iter()
            .map(|c| c.0.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Whether this is the job's first attempt: `zrt launch --max-restarts`
/// (as torchrun) counts restarts in TORCHELASTIC_RESTART_COUNT.
fn first_attempt() -> bool {
    std::env::var("TORCHELASTIC_RESTART_COUNT").map_or(true, |c| c.trim() == "0")
}

/// `n` windows of `len` bytes from `data` (longer than `len`), chosen by
/// `seed`. A batch too large to allocate is an error naming the keys that
/// size it, not an abort in the allocator.
fn batch(data: &[u8], n: i64, len: i64, seed: u64) -> Result<Tensor> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::new();
    let tokens = n.checked_mul(len).and_then(|t| usize::try_from(t).ok());
    if tokens.is_none_or(|t| v.try_reserve_exact(t).is_err()) {
        bail!(
            "a micro-batch of {n} sequences of {len} tokens does not fit in memory: \
             lower train_micro_batch_size_per_gpu (or train_batch_size) in the config, or --seq"
        );
    }
    for _ in 0..n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let start = (s % (data.len() as u64 - len as u64)) as usize;
        v.extend(data[start..start + len as usize].iter().map(|&b| b as i64));
    }
    Ok(Tensor::from_slice(&v).view([n, len]))
}

fn main() -> Result<()> {
    zrt::init_logging();
    let Some(a) = parse_args()? else {
        print!("{}", usage());
        return Ok(());
    };
    tch::set_num_threads(1);
    // A scheduler's SIGTERM or Ctrl-C ends the job after a step, saved.
    zrt::stop::on_signals();
    let mut dist = init_from_env().context("joining the job (start ranks with `zrt launch`)")?;
    let (rank, n) = (dist.env().rank, dist.env().world_size);
    let (text, source) = corpus(a.corpus.as_deref())?;
    let split = text.len() * 9 / 10;
    let (train, val) = (&text[..split], &text[split..]);
    // Windows of seq + 1 bytes start anywhere before the end: the held-out
    // tenth must be longer than one.
    if a.gpt.seq as u64 + 1 >= val.len() as u64 {
        bail!(
            "--seq {} needs windows of {} bytes, longer than the validation text (the \
             corpus's last tenth: {} bytes of {}): give a smaller --seq or a larger --corpus",
            a.gpt.seq,
            a.gpt.seq as u64 + 1,
            val.len(),
            source
        );
    }

    tch::manual_seed(1234);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    // Ranks but the first hold no weights while the model is built (the
    // engine gives them rank 0's): N ranks on one host hold one model
    // while they build, not N. Started from a file, no rank holds them:
    // the engine loads each rank's shard of the file once it is built;
    // with --build-on-disk rank 0 holds them on disk.
    match (&a.init_from, a.weights_on_every_rank, &a.build_on_disk) {
        (_, true, _) => {}
        (Some(file), false, _) => plan.weights_from_file(&vs, file)?,
        (None, false, Some(dir)) => plan.weights_on_disk_while_built(&vs, rank, dir)?,
        (None, false, None) => plan.weights_on_first_rank_only(&vs, rank)?,
    }
    let gpt = match a.checkpoint {
        true => Gpt::new_checkpointed(&vs.root(), &plan, &a.gpt),
        false => Gpt::new(&vs.root(), &plan, &a.gpt),
    };
    let mut frozen = 0;
    if a.freeze_mlp {
        for (name, t) in vs.variables() {
            let mlp = name.ends_with(".fc.weight") || name.ends_with(".out.weight");
            if name.starts_with("h.") && mlp {
                let _ = t.set_requires_grad(false);
                frozen += t.numel();
            }
        }
    }
    if a.layerdrop > 0.0 {
        // Each rank leaves out its own blocks: every rank reduces the
        // units in one agreed order (at stage 3 the blocks at the end of
        // backward, and they stay gathered).
        plan.unused_on_some_ranks(|name, _| name.starts_with("h."))?;
    }
    if a.mlp_drop > 0.0 {
        // Each rank leaves out its own blocks' MLPs, the blocks running:
        // stage 3 gathers and frees the blocks as without it, and reduces
        // each when the backward of the unit before it begins.
        plan.partly_unused_on_some_ranks(|name, _| is_mlp_param(name))?;
    }
    let cfg = Config::from_file(&a.config)?;
    let hints = AutoHints {
        hidden_size: Some(a.gpt.d_model as u64),
        ..Default::default()
    };
    // Plain, hybrid (`mics_shard_size`) or hpZ, as the config says.
    let engine = Engine::from_config(&vs, &plan, &cfg, &mut dist, &hints)?;
    let batch_cfg = engine.config().batch;
    let micro = batch_cfg.micro as i64;
    let gas = batch_cfg.gas;
    let tokens_per_step = (batch_cfg.train * a.gpt.seq as u64) as f64;
    if rank == 0 {
        println!(
            "zrt train_gpt: {} ranks, ZeRO stage {}, {:.2}M params, corpus {} ({} KiB, {} for validation)",
            n,
            engine.config().config.zero.stage,
            engine.num_params() as f64 / 1e6,
            source,
            text.len() >> 10,
            val.len() >> 10
        );
        if frozen > 0 {
            println!(
                "{:.2}M frozen params (every block's MLP weights; stage 3 shards them too)",
                frozen as f64 / 1e6
            );
        }
        println!(
            "batch {} sequences of {} bytes per step ({} per rank x {} accumulation x {} ranks)",
            batch_cfg.train, a.gpt.seq, micro, gas, n
        );
    }
    // Losses and memory are averaged and listed over the whole world (under
    // hybrid sharding the engine's own group is one shard group).
    let world = dist.world();
    // Every rank's peak RSS so far, in MiB, as a list to print.
    let peak_rss = || -> Result<String> {
        let mine = vec![zrt::peak_rss_bytes() / (1u64 << 20) as f64];
        let each = world.all_gather(mine, Vec::new()).wait()?.1;
        Ok(each
            .iter()
            .map(|m| format!("{m:.0}"))
            .collect::<Vec<_>>()
            .join(", "))
    };
    // What building the model and the engine peaked at, before training
    // adds its own (the peak so far is the build's).
    let built_rss = peak_rss()?;
    if rank == 0 {
        let how = match (a.weights_on_every_rank, &a.init_from, &a.build_on_disk) {
            (true, _, _) => "every rank building the whole model",
            (false, Some(_), _) => "no rank holding the weights: each loaded its shard of the file",
            (false, None, Some(_)) => {
                "no rank holding the weights: the first wrote them to disk as it built"
            }
            (false, None, None) => "ranks but the first holding no weights while it is built",
        };
        println!("built: peak RSS per rank (MiB): {built_rss} ({how})");
    }
    let eval = || -> Result<f64> {
        // Each rank a share of fixed validation windows; averaged.
        let windows = batch(val, 16, a.gpt.seq + 1, 1_000_000 + rank as u64)?;
        let l = tch::no_grad(|| gpt.loss(&windows).double_value(&[]));
        // A forward alone: a failed gather would leave zeros in it, not
        // an error.
        engine.pending_error()?;
        Ok(world.all_reduce(vec![l], ReduceOp::Avg).wait()?[0])
    };

    let bar = if rank == 0 && console_is_tty() {
        let b = ProgressBar::new(a.steps);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Some(b)
    } else {
        None
    };
    match (&a.init_from, a.weights_on_every_rank) {
        (Some(file), true) => {
            // Into the built engine, each rank reading its own shard.
            let loaded = engine.load_weights(file, true)?;
            let rss = peak_rss()?;
            if rank == 0 {
                println!(
                    "initialised from {} ({} tensors, into the built engine); peak RSS per rank (MiB): {rss}",
                    file.display(),
                    loaded.loaded,
                );
            }
        }
        (Some(file), false) if rank == 0 => println!(
            "initialised from {} (while the engine was built: ShardPlan::weights_from_file)",
            file.display()
        ),
        _ => {}
    }
    let mut start = 1;
    if let (true, Some(dir)) = (a.resume, &a.save_dir) {
        // The latest checkpoint there, if any (every rank must see the same).
        if let Some((tag, saved)) = engine.resume_from(dir)? {
            // The loop's own position, saved with the checkpoint: steps an
            // fp16 overflow skipped were steps of this loop too (their
            // batches were drawn), though not optimizer steps.
            let done = saved["step"]
                .as_u64()
                .unwrap_or(engine.global_step() + engine.skipped_steps());
            start = done + 1;
            if rank == 0 {
                println!(
                    "resumed from {} (tag {tag}) at step {}",
                    dir.display(),
                    start - 1
                );
            }
        }
    }
    if start > a.steps {
        // Every rank read the same checkpoint, so every rank stops here.
        if rank == 0 {
            println!(
                "nothing to train: the checkpoint is at step {}, --steps is {}",
                start - 1,
                a.steps
            );
        }
        return Ok(());
    }
    let save = |step: u64| -> Result<()> {
        if let Some(dir) = &a.save_dir {
            let state = serde_json::json!({ "step": step });
            let path = engine.save_checkpoint_with(dir, &format!("step{step}"), &state)?;
            if rank == 0 {
                println!(
                    "checkpoint saved to {} (`zrt ckpt inspect {}`)",
                    path.display(),
                    dir.display()
                );
                // Every rank's save has returned: it is committed.
                // Pruning that fails costs disk, not the run: said, not fatal.
                match a
                    .keep_last
                    .map(|k| zrt::zero::checkpoint::keep_latest(dir, k))
                {
                    Some(Ok(removed)) if !removed.is_empty() => println!(
                        "removed older checkpoint(s) {} (--keep-last)",
                        removed.join(", ")
                    ),
                    Some(Err(e)) => eprintln!("--keep-last: {e}; training goes on"),
                    _ => {}
                }
            }
        }
        Ok(())
    };
    let stepped_before = engine.global_step();
    let v0 = eval()?;
    if rank == 0 {
        println!("step {:4}  validation loss {v0:.4}", start - 1);
    }
    let (mut first_train, mut last_train, mut last_val) = (f64::NAN, f64::NAN, v0);
    let t0 = Instant::now();
    // LayerDrop: block runs this rank left out, of those it could run;
    // MLP drop: MLPs this rank left out.
    let (mut left_out, mut runs, mut mlps_out) = (0usize, 0usize, 0usize);
    // The last step run: `a.steps`, unless a signal stopped the job.
    let mut end = a.steps;
    for step in start..=a.steps {
        if a.fail_at == Some(step) && rank + 1 == n && first_attempt() {
            eprintln!(
                "rank {rank} exits at the start of step {step} on purpose (--fail-at {step}; the job's first attempt)"
            );
            // No unwinding, no destructors: as a process that crashed.
            std::process::exit(3);
        }
        let mut sum = 0.0;
        for k in 0..gas {
            let seed = ((step * gas + k) * n as u64) + rank as u64;
            let skipped = layerdrop(a.layerdrop, a.gpt.layers, seed);
            left_out += skipped.len();
            runs += a.gpt.layers as usize;
            // Another stream than LayerDrop's (the seed's high bit).
            let mlps = layerdrop(a.mlp_drop, a.gpt.layers, seed | 1 << 63);
            gpt.leave_out_mlps(&mlps);
            mlps_out += mlps.len();
            let loss = gpt.loss_skipping(&batch(train, micro, a.gpt.seq + 1, seed)?, &skipped);
            sum += loss.double_value(&[]);
            engine.backward(&loss)?;
            engine.step()?;
            // Evaluation runs every MLP.
            gpt.leave_out_mlps(&[]);
        }
        // The step's loss, and whether a signal reached any rank: every
        // rank reads the same answer, so all of them stop after this step.
        // (`zrt::stop::any_rank` asks the same in a collective of its own.)
        let signalled = f64::from(zrt::stop::requested().is_some());
        let both = world
            .all_reduce(vec![sum / gas as f64, signalled], ReduceOp::Avg)
            .wait()?;
        let (loss, stop) = (both[0], both[1] > 0.0);
        if step == start {
            first_train = loss;
        }
        last_train = loss;
        let tps = tokens_per_step * (step + 1 - start) as f64 / t0.elapsed().as_secs_f64();
        if let Some(b) = &bar {
            b.set_position(step);
            b.set_message(format!(
                "loss {loss:.4} lr {:.2e} {tps:.0} tok/s",
                engine.lr()
            ));
        }
        if stop && step < a.steps {
            end = step;
            if rank == 0 {
                let then = match a.save_dir {
                    Some(_) => "`--resume` goes on from its checkpoint",
                    None => "--no-save: nothing is kept",
                };
                let line = format!(
                    "a signal reached the job: stopping after step {step} (train loss {loss:.4}); {then}"
                );
                match &bar {
                    Some(b) => b.println(line),
                    None => println!("{line}"),
                }
            }
            break;
        }
        if a.save_every > 0 && step % a.save_every == 0 && step != a.steps {
            save(step)?;
        }
        if step % a.eval_every == 0 || step == a.steps {
            last_val = eval()?;
            // Beside the engine's scalars, if the config enables a monitor.
            let at = engine.global_samples();
            engine.write_monitor_events(&[("Eval/Samples/eval_loss", last_val, at)]);
            if rank == 0 {
                let line = format!(
                    "step {step:4}  train loss {loss:.4}  validation loss {last_val:.4}  lr {:.2e}  grad norm {:.3}  {tps:.0} tokens/s",
                    engine.lr(),
                    engine.global_grad_norm().unwrap_or(f64::NAN)
                );
                match &bar {
                    Some(b) => b.println(line),
                    None => println!("{line}"),
                }
            }
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // What the collectives cost, if the config has a `comms_logger`.
    if engine.config().config.comms_logger.enabled {
        engine.log_comms_summary();
    }
    save(end)?;
    if end < a.steps {
        // Stopped early: the summary below is of a whole run.
        return Ok(());
    }
    let secs = t0.elapsed().as_secs_f64();
    let rss = peak_rss()?;
    let state = engine.model_state_bytes()? as f64 / (1 << 20) as f64;
    let left_out = world
        .all_gather(vec![left_out as f64], Vec::new())
        .wait()?
        .1;
    let mlps_out = world
        .all_gather(vec![mlps_out as f64], Vec::new())
        .wait()?
        .1;
    if rank == 0 {
        println!(
            "done: {} steps in {secs:.1} s, {:.0} tokens/s",
            (a.steps + 1).saturating_sub(start),
            tokens_per_step * (a.steps + 1).saturating_sub(start) as f64 / secs
        );
        println!("train loss {first_train:.4} -> {last_train:.4}; validation loss {v0:.4} -> {last_val:.4}");
        if a.layerdrop > 0.0 {
            let each: Vec<String> = (left_out.iter().enumerate())
                .map(|(r, k)| format!("rank {r} left out {k}"))
                .collect();
            println!(
                "LayerDrop: of {runs} block runs per rank, {}",
                each.join(", ")
            );
        }
        if a.mlp_drop > 0.0 {
            let each: Vec<String> = (mlps_out.iter().enumerate())
                .map(|(r, k)| format!("rank {r} left out {k}"))
                .collect();
            println!("MLP drop: of {runs} MLP runs per rank, {}", each.join(", "));
        }
        println!("peak RSS per rank (MiB): {rss}; model state on rank 0: {state:.2} MiB");
        if let Some(dir) = &engine.config().config.monitor.tensorboard {
            let logdir = (dir.parent())
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            println!(
                "scalars for TensorBoard in {} (`tensorboard --logdir {}`)",
                dir.display(),
                logdir.display()
            );
        }
        // Only steps that trained can lower it: fp16 overflows skip some.
        let trained = engine.global_step() > stepped_before;
        if last_val.is_nan() || (trained && last_val >= v0) {
            // A run of a step or two is still in the learning-rate
            // warm-up (the first step's rate is 0): say so, not just fail.
            bail!(
                "validation loss did not fall: {v0:.4} -> {last_val:.4} after {} optimizer \
                 step(s) at a last learning rate of {:.2e} (a run of a few steps may still be \
                 in the warm-up; the default is --steps 400)",
                engine.global_step() - stepped_before,
                engine.lr()
            );
        }
    }
    Ok(())
}

fn console_is_tty() -> bool {
    // SAFETY: isatty has no preconditions.
    unsafe { libc::isatty(2) == 1 }
}

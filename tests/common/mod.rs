//! What the engine tests share: a tiny GPT built the same way on every
//! rank, deterministic token batches and a DeepSpeed config.
#![allow(dead_code)] // each test binary uses its own part

use std::sync::Mutex;

use tch::{nn, Device, Kind, Tensor};
use zrt::collectives::local::{self, LocalGroup, LocalRank};
use zrt::gpt::{Gpt, GptConfig};
use zrt::zero::{AutoHints, Config, Engine, EngineError, ShardPlan};

mod python;
#[allow(unused_imports)] // binaries without a Python script
pub use python::python;

pub const GPT: GptConfig = GptConfig {
    vocab: 64,
    d_model: 32,
    layers: 2,
    heads: 2,
    seq: 16,
};
pub const MICRO: i64 = 2;
pub const WORLD: usize = 2;
/// The config block that trains in bf16.
pub const BF16: &str = r#""bf16": {"enabled": true},"#;

/// Python importing Apertus's config class as `C` and, as `M`, its
/// model class with xIELU's scalars in fp32: `transformers` builds them
/// in bf16 whatever the model's dtype, zrt in the model's.
pub const APERTUS: &str = "from transformers import ApertusConfig as C, ApertusForCausalLM
class M(ApertusForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.act_fn.float()";
/// Python importing StableLM's config class as `C` and its model class
/// as `M`, able to build StableLM 2 12B's bias-free norms of each head:
/// `transformers` 4.57 cannot from a config (its `_init_weights` zeroes
/// the bias they do not have); `from_pretrained` can, as it initialises
/// nothing it loads.
pub const STABLELM: &str = "from transformers import StableLmConfig as C, StableLmForCausalLM as M
import transformers.models.stablelm.modeling_stablelm as _s
_init = _s.StableLmPreTrainedModel._init_weights
_s.StableLmPreTrainedModel._init_weights = lambda s, m: (m.weight.data.fill_(1.0) if isinstance(m, torch.nn.LayerNorm) and m.bias is None else _init(s, m))";
/// Python importing PhiMoE's config class as `C` and, as `M`, its model
/// class built in evaluation: sparsemixer draws its experts in training,
/// and a model built from a config trains (`from_pretrained`'s evaluates).
/// The tests that draw call `m.train()` themselves.
pub const PHIMOE: &str = "from transformers import PhimoeConfig as C, PhimoeForCausalLM
class M(PhimoeForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.eval()";
/// A `zero_optimization` setting under which stage 3 shards every unit of
/// the test GPT (all are under the default persistence threshold).
pub const SHARD_ALL: &str = r#""stage3_param_persistence_threshold": 0,"#;
pub const LR: f64 = 1e-2;
pub const WD: f64 = 0.01;

/// tch's RNG is process-global: build models one at a time from one seed.
static INIT: Mutex<()> = Mutex::new(());

/// [`INIT`], for a test that seeds or draws from libtorch's RNG on its own
/// (a model of its own): every test of a binary must seed and draw under
/// this one lock, or its draws land inside another test's seeded build.
pub fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    INIT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Held for a whole test by the tests that set libtorch's process-global
/// RNG state outside [`INIT`] (loading a checkpoint, a checkpointed block's
/// recompute in backward): that can land between another test's seeding
/// and its model's first draws, and the two builds of one model differ.
static SERIAL: Mutex<()> = Mutex::new(());

/// Runs the test one at a time with the others that take it (see
/// [`SERIAL`]). Take it before [`INIT`], never inside it.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The GPT `cfg` from seed 0, its plan and its VarStore.
pub fn model_of(cfg: &GptConfig) -> (nn::VarStore, ShardPlan, Gpt) {
    built(cfg, Gpt::new)
}

/// Runs `init` under the model lock with seed 0 (and one intra-op thread):
/// tch's RNG is process-global.
pub fn seeded<T>(init: impl FnOnce() -> T) -> T {
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    tch::set_num_threads(1);
    tch::manual_seed(0);
    init()
}

/// The GPT `cfg` from seed 0, built by `new` (`Gpt::new` or
/// `Gpt::new_checkpointed`).
pub fn built(
    cfg: &GptConfig,
    new: fn(&nn::Path, &ShardPlan, &GptConfig) -> Gpt,
) -> (nn::VarStore, ShardPlan, Gpt) {
    built_on(cfg, new, None)
}

/// As [`built`]; with `released: Some(rank)`, built by world rank `rank`
/// under `ShardPlan::weights_on_first_rank_only` (a rank but the first
/// then holds no weights until its engine is built).
pub fn built_on(
    cfg: &GptConfig,
    new: fn(&nn::Path, &ShardPlan, &GptConfig) -> Gpt,
    released: Option<usize>,
) -> (nn::VarStore, ShardPlan, Gpt) {
    let Some(rank) = released else {
        let (vs, plan, gpt) = built_by(cfg, new, |_, _| {});
        as_first_built(&format!("{cfg:?} {:p}", new as *const ()), &vs);
        return (vs, plan, gpt);
    };
    built_by(cfg, new, |vs, plan| {
        plan.weights_on_first_rank_only(vs, rank).unwrap()
    })
}

/// A model's variables by name, sorted.
type Values = Vec<(String, Tensor)>;

/// Each (config, constructor)'s values as first built, by key.
static FIRST_BUILT: Mutex<Vec<(String, Values)>> = Mutex::new(Vec::new());

/// Makes `vs` hold the values the first build under `key` got, or
/// remembers them if this is the first. Why: seed 0 alone does not
/// make two builds alike. tch's RNG is process-global, and a test on
/// another thread that draws from it without [`INIT`] (a Hugging Face
/// model's random start, a LoRA's `A`, a dropout mask) may draw between
/// this build's `manual_seed(0)` and its draws; two runs a test compares
/// then start apart (seen: `stage_3_with_packed_gathers_tracks_the_unquantized_run`
/// failing at step 0 while Jamba's tests ran beside it).
fn as_first_built(key: &str, vs: &nn::VarStore) {
    let mut first = FIRST_BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let mut now: Values = vs.variables().into_iter().collect();
    now.sort_by(|a, b| a.0.cmp(&b.0));
    match first.iter().find(|(k, _)| k == key) {
        Some((_, values)) => tch::no_grad(|| {
            assert_eq!(
                now.len(),
                values.len(),
                "{key}: the same model builds the same variables"
            );
            for ((name, var), (was, value)) in now.iter_mut().zip(values) {
                assert_eq!(name, was, "{key}: the same model builds the same variables");
                var.copy_(value);
            }
        }),
        None => {
            let values = now
                .into_iter()
                .map(|(n, v)| (n, v.detach().copy()))
                .collect();
            first.push((key.to_string(), values));
        }
    }
}

/// As [`built`], with `rule` applied to the VarStore and plan before
/// the model is made (a `ShardPlan` rule on how it is built).
pub fn built_by(
    cfg: &GptConfig,
    new: fn(&nn::Path, &ShardPlan, &GptConfig) -> Gpt,
    rule: impl FnOnce(&nn::VarStore, &ShardPlan),
) -> (nn::VarStore, ShardPlan, Gpt) {
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    // One intra-op thread: libtorch's reductions then sum in one order
    // whichever thread runs them, so engine and reference see the same bits.
    tch::set_num_threads(1);
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    rule(&vs, &plan);
    let gpt = new(&vs.root(), &plan, cfg);
    (vs, plan, gpt)
}

/// Parameters by name, with their values (`Engine::gathered_params`).
pub type Params = Vec<(String, Vec<f32>)>;

/// A linear `i -> o` named `name`, wrapped as a unit of `plan`.
pub fn linear_unit(
    vs: &nn::VarStore,
    plan: &ShardPlan,
    name: &str,
    i: i64,
    o: i64,
) -> zrt::zero::ShardedModule<nn::Linear> {
    let p = vs.root() / name;
    zrt::zero::ShardedModule::new(plan, &p, nn::linear(&p, i, o, Default::default()))
}

/// Gives every variable of `vs` known values: the `k`-th by name, its
/// element `i`, `sin(i * step + k) * amplitude` (small tests' models,
/// the same on every rank without a seed).
pub fn known_values(vs: &nn::VarStore, step: f64, amplitude: f64) {
    tch::no_grad(|| {
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|x, y| x.0.cmp(&y.0));
        for (k, (_, t)) in vars.into_iter().enumerate() {
            let n = t.numel() as i64;
            let v =
                (Tensor::arange(n, (Kind::Float, Device::Cpu)) * step + k as f64).sin() * amplitude;
            t.shallow_clone().copy_(&v.view(t.size().as_slice()));
        }
    });
}

/// [`GPT`] from seed 0.
pub fn model() -> (nn::VarStore, ShardPlan, Gpt) {
    model_of(&GPT)
}

/// The micro-batch of (step, micro-step, rank) for a `WORLD`-rank job:
/// deterministic tokens.
pub fn tokens(step: usize, k: usize, rank: usize, gas: usize) -> Tensor {
    let idx = ((step * gas + k) * WORLD + rank) as u64;
    let mut s = idx.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<i64> = (0..MICRO * (GPT.seq + 1))
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % GPT.vocab as u64) as i64
        })
        .collect();
    Tensor::from_slice(&v).view([MICRO, GPT.seq + 1])
}

/// Freezes the variables of `vs` whose names start with one of `prefixes`
/// (`requires_grad` false), as fine-tuning a part of a model does.
pub fn freeze(vs: &nn::VarStore, prefixes: &[&str]) {
    for (name, t) in vs.variables() {
        if prefixes.iter().any(|p| name.starts_with(p)) {
            let _ = t.set_requires_grad(false);
        }
    }
}

/// `out` plus a gradient penalty on input `x` (WGAN-GP): the input's
/// gradient taken with `create_graph`, so that a backward of the sum runs
/// through it again.
pub fn with_gradient_penalty(out: &Tensor, x: &Tensor) -> Tensor {
    let g = Tensor::run_backward(&[out], &[x], true, true);
    out + (g[0].square().sum(Kind::Float) - 1.0).square()
}

/// A small deterministic input (4 x 3) of rank `rank` for micro-step `k`.
pub fn small_input(rank: usize, k: usize) -> Tensor {
    (Tensor::arange(12, (Kind::Float, Device::Cpu)).view([4, 3])
        * (0.1 + 0.05 * (rank * 2 + k) as f64))
        .cos()
}

/// AdamW at [`LR`], [`WD`]; `extra` is spliced into the top level (e.g. a
/// precision block).
pub fn config_with(stage: u8, gas: usize, clip: f64, extra: &str) -> Config {
    config_zero(stage, gas, clip, extra, "")
}

/// As [`config_with`]; `zero` is spliced into `zero_optimization` (e.g. an
/// `offload_optimizer` block, with a trailing comma).
pub fn config_zero(stage: u8, gas: usize, clip: f64, extra: &str, zero: &str) -> Config {
    config_of("AdamW", stage, gas, clip, extra, zero)
}

/// As [`config_zero`], with `optimizer` ("AdamW", "Lion", ...) at [`LR`],
/// [`WD`].
pub fn config_of(
    optimizer: &str,
    stage: u8,
    gas: usize,
    clip: f64,
    extra: &str,
    zero: &str,
) -> Config {
    config_params(optimizer, "", stage, gas, clip, extra, zero)
}

/// As [`config_of`], with `params` (`, "key": value` pairs) after the
/// optimizer's lr and weight decay.
pub fn config_params(
    optimizer: &str,
    params: &str,
    stage: u8,
    gas: usize,
    clip: f64,
    extra: &str,
    zero: &str,
) -> Config {
    Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": {MICRO}, "gradient_accumulation_steps": {gas},
            "optimizer": {{"type": "{optimizer}", "params": {{"lr": {LR}, "weight_decay": {WD}{params}}}}},
            {extra}
            "gradient_clipping": {clip}, "zero_optimization": {{{zero} "stage": {stage}}}}}"#
    ))
    .unwrap()
}

/// An `offload_param` NVMe block for [`config_zero`] (stage 3).
pub fn nvme_params(dir: &std::path::Path) -> String {
    format!(
        r#""offload_param": {{"device": "nvme", "nvme_path": "{}", "buffer_count": 2}},"#,
        dir.display()
    )
}

/// An NVMe offload block for [`config_zero`] swapping into `dir`, with
/// 4 KiB chunks (1024 elements) so even a tiny model streams many chunks.
pub fn nvme(dir: &std::path::Path) -> (String, String) {
    (
        r#""aio": {"block_size": 4096},"#.to_string(),
        format!(
            r#""offload_optimizer": {{"device": "nvme", "nvme_path": "{}", "buffer_count": 3}},"#,
            dir.display()
        ),
    )
}

/// Runs `f` on each rank of a fresh `n`-rank in-process world (a thread
/// each) and returns the ranks' results in rank order.
pub fn on_ranks<T: Send>(n: usize, f: impl Fn(LocalRank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = local::world(n)
            .into_iter()
            .map(|r| s.spawn(move || f(r)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Builds an engine on 2 ranks (threads), rank `r` on `make(r)`'s model
/// under `zero[r]` (stage 3 `zero_optimization` settings) and asserts
/// both builds are refused with an error naming `key`: ranks that
/// disagree on a setting that changes their collectives.
pub fn refused_unless_agreed(
    zero: [&str; 2],
    key: &str,
    make: impl Fn(usize) -> (nn::VarStore, ShardPlan) + Sync,
) {
    let cfg = |rank: usize| config_zero(3, 1, 0.0, "", zero[rank]);
    refused_on_every_rank(cfg, make, key);
}

/// Builds an engine on 2 ranks (threads), rank `r` on `make(r)`'s model
/// under `cfg(r)`, and asserts every rank's build is refused with an
/// error containing `want`.
pub fn refused_on_every_rank(
    cfg: impl Fn(usize) -> Config + Sync,
    make: impl Fn(usize) -> (nn::VarStore, ShardPlan) + Sync,
    want: &str,
) {
    let errors = on_ranks(2, |r| {
        let cfg = cfg(r.rank());
        let (vs, plan) = make(r.rank());
        let g = r.new_group(&[0, 1]).unwrap();
        Engine::new(&vs, &plan, &cfg, g, &AutoHints::default())
            .err()
            .map(|e| e.to_string())
    });
    for e in errors {
        let e = e.expect("refused");
        assert!(e.contains(want), "{e}");
    }
}

/// The test GPT's variables and plan, for [`refused_on_every_rank`].
pub fn gpt_plan(_rank: usize) -> (nn::VarStore, ShardPlan) {
    let (vs, plan, _) = model();
    (vs, plan)
}

/// The engine for `vs` and `plan` under `cfg` on rank `r`'s world group
/// (every rank of its in-process world).
pub fn engine_of(
    vs: &nn::VarStore,
    plan: &ShardPlan,
    cfg: &Config,
    r: &LocalRank,
) -> Engine<LocalGroup> {
    let group = r.new_group(&(0..WORLD).collect::<Vec<_>>()).unwrap();
    Engine::new(vs, plan, cfg, group, &AutoHints::default()).unwrap()
}

/// An engine for `vs` and `plan` on a one-rank in-process world: for tests
/// of what one rank refuses, reports or reads back.
pub fn solo_engine(
    vs: &nn::VarStore,
    plan: &ShardPlan,
    cfg: &Config,
) -> Result<Engine<LocalGroup>, EngineError> {
    let group = local::world(1).remove(0).new_group(&[0]).unwrap();
    Engine::new(vs, plan, cfg, group, &AutoHints::default())
}

/// An example program of this build. `cargo test` builds them into
/// `<target>/<profile>/examples`, beside the `deps` folder this test binary
/// runs from: found from it, not from `target/` under the sources, so a
/// `CARGO_TARGET_DIR` elsewhere works too (cargo-mutants uses one).
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(std::path::Path::parent).unwrap();
    profile.join("examples").join(name)
}

/// Records how close a comparison with a reference came to its bound:
/// `diff` of `bound`, for `what`. Each line goes to
/// `<target>/tmp/parity-margins.tsv`, which `cargo xtask test` empties
/// before the tests and summarises after them (the closest to their
/// bounds first), so that a bound tuned on one CPU shows its margin on
/// every other one before it fails there.
pub fn margin(what: &str, diff: f64, bound: f64) {
    use std::io::Write;
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("parity-margins.tsv");
    let what = what.replace(['\t', '\n'], " ");
    let line = format!("{}\t{diff:.3e}\t{bound:.3e}\t{what}\n", diff / bound);
    // One write a line, appended: the tests' threads and processes each
    // add whole lines. A margin that cannot be written is no test's
    // failure.
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path);
    if let Ok(mut f) = file {
        let _ = f.write_all(line.as_bytes());
    }
}

/// The comparison closest to its bound among many (a tensor's
/// elements), recorded once with [`margin`].
pub struct Closest {
    share: f64,
    diff: f64,
    bound: f64,
}

impl Default for Closest {
    fn default() -> Self {
        Self {
            share: -1.0,
            diff: 0.0,
            bound: 1.0,
        }
    }
}

impl Closest {
    /// Sees a comparison of `diff` against `bound`, and returns whether
    /// it is within it.
    pub fn see(&mut self, diff: f64, bound: f64) -> bool {
        if diff / bound > self.share {
            (self.share, self.diff, self.bound) = (diff / bound, diff, bound);
        }
        diff <= bound
    }

    /// Records the closest one seen as `what`'s margin (none if nothing
    /// was seen).
    pub fn record(&self, what: &str) {
        if self.share >= 0.0 {
            margin(what, self.diff, self.bound);
        }
    }
}

/// Runs `cmd` (a launch of the main job) to its end in a fresh folder,
/// removed after, so that what the job writes at relative paths (its
/// config's TensorBoard folder, `target/runs`) stays out of the checkout,
/// where it would mix with the demo's runs.
pub fn output_elsewhere(cmd: &mut std::process::Command) -> std::process::Output {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("zrt-cwd-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let o = cmd.current_dir(&dir).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    o
}

/// Runs `f` with this thread's `tracing` events (warnings and up) written
/// into a string, which it returns with `f`'s result.
pub fn with_logs<R>(f: impl FnOnce() -> R) -> (R, String) {
    with_logs_at(tracing::Level::WARN, f)
}

/// [`with_logs`] with the events at `level` and up.
pub fn with_logs_at<R>(level: tracing::Level, f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let out = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_writer(move || out.clone())
        .finish();
    let r = tracing::subscriber::with_default(sub, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    (r, text)
}

/// Runs the `zrt` binary with `args`: whether it succeeded, and what it
/// printed ([`printed`]).
pub fn zrt_cli<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> (bool, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(args)
        .output()
        .unwrap();
    (o.status.success(), printed(&o))
}

/// What a finished program printed: its stdout, then its stderr.
pub fn printed(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `cmd` (stdout and stderr piped) and sends it `sig` once what it
/// printed on stdout so far passes `ready` (not at a guessed time); its
/// output, stdout first, and how it ended.
pub fn signalled_when(
    cmd: &mut std::process::Command,
    sig: libc::c_int,
    ready: impl Fn(&str) -> bool,
) -> (String, std::process::ExitStatus) {
    use std::io::{BufRead, Read};
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut said = String::new();
    while !ready(&said) {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            break;
        }
        said.push_str(&line);
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    out.read_to_string(&mut said).unwrap();
    let o = child.wait_with_output().unwrap();
    said.push_str(&String::from_utf8_lossy(&o.stderr));
    (said, o.status)
}

/// Trains `steps` steps of the GPT on this rank's micro-batches
/// ([`tokens`], no accumulation): the losses.
pub fn train_losses<G: zrt::collectives::ProcessGroup + 'static>(
    gpt: &Gpt,
    e: &Engine<G>,
    rank: usize,
    steps: usize,
) -> Vec<f64> {
    (0..steps)
        .map(|step| {
            let loss = gpt.loss(&tokens(step, 0, rank, 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
            loss.double_value(&[])
        })
        .collect()
}

/// What a training run of the GPT ends with on rank 0: its losses, the
/// master parameters and its overlap counts.
pub type Trained = (Vec<f64>, Params, zrt::zero::OverlapCounts);

/// Trains the GPT `steps` steps under `cfg` on the in-process world of
/// [`WORLD`] ranks ([`engine_of`]), the variables under `frozen` frozen.
pub fn train_world(cfg: &Config, frozen: &[&str], steps: usize) -> Trained {
    let out = on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = model();
        freeze(&vs, frozen);
        let e = engine_of(&vs, &plan, cfg, &r);
        let losses = train_losses(&gpt, &e, r.rank(), steps);
        (losses, e.gathered_params().unwrap(), e.overlap_counts())
    });
    out.into_iter().next().unwrap()
}

/// Trains the GPT `steps` steps under `cfg` on `ranks` in-process ranks,
/// in the groups the config asks for (`Engine::from_config`: MiCS, hpZ),
/// rank r on [`WORLD`]-rank data of rank `r % WORLD` (replicas alike).
pub fn train_grouped(ranks: usize, cfg: &Config, steps: usize) -> Trained {
    let out = on_ranks(ranks, |mut r| {
        let (vs, plan, gpt) = model();
        let hints = AutoHints::default();
        let e = Engine::from_config(&vs, &plan, cfg, &mut r, &hints).unwrap();
        let losses = train_losses(&gpt, &e, r.rank() % WORLD, steps);
        (losses, e.gathered_params().unwrap(), e.overlap_counts())
    });
    out.into_iter().next().unwrap()
}

/// A fresh, empty folder `zrt-{name}-{pid}` under the temp dir for one
/// test's files.
pub fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zrt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tensor names in checkpoint `dir/tag`'s rank files.
pub fn saved_names(dir: &std::path::Path, tag: &str) -> Vec<String> {
    let mut names = Vec::new();
    for f in std::fs::read_dir(dir.join(tag)).unwrap() {
        let p = f.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("rank-") {
            names.extend(
                tch::Tensor::read_safetensors(&p)
                    .unwrap()
                    .into_iter()
                    .map(|(n, _)| n),
            );
        }
    }
    names
}

/// What rank 0 of [`WORLD`] holds after one step of the GPT under
/// `optimizer` (with `params` past lr and weight decay) at `stage`, every
/// stage-3 unit sharded, `extra` at the top of the config and `zero` in
/// `zero_optimization`: (model-state bytes, the elements of its optimizer
/// range, the optimizer swap file's bytes if one was made, the engine's
/// log at INFO).
pub fn state_held(
    optimizer: &str,
    params: &str,
    stage: u8,
    extra: &str,
    zero: &str,
) -> (usize, usize, Option<u64>, String) {
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = model();
        let zero = format!(r#""stage3_param_persistence_threshold": 0, {zero}"#);
        let cfg = config_params(optimizer, params, stage, 1, 0.0, extra, &zero);
        let (e, logs) = with_logs_at(tracing::Level::INFO, || engine_of(&vs, &plan, &cfg, &r));
        train_losses(&gpt, &e, r.rank(), 1);
        // The gradient buffers are the optimizer range at stages 0 (the
        // whole model), 2 and 3 (the shards).
        let range: usize = (0..).map_while(|u| e.grad_buffer(u)).map(|g| g.len()).sum();
        let file = logs
            .lines()
            .find(|l| l.contains("optimizer state offloaded to NVMe"))
            .and_then(|l| l.split(" bytes=").nth(1))
            .and_then(|s| s.split_whitespace().next())
            .map(|b| b.parse::<u64>().unwrap());
        (e.model_state_bytes().unwrap(), range, file, logs)
    })
    .remove(0)
}

/// One more step of the GPT on rank `rank`'s micro-batch of step 1 (no
/// accumulation): the loss, and the parameters after it. What a test that
/// resumes a checkpoint compares with the run that saved it.
pub fn next_step<G: zrt::collectives::ProcessGroup + 'static>(
    e: &Engine<G>,
    gpt: &Gpt,
    rank: usize,
) -> (f64, Params) {
    let loss = gpt.loss(&tokens(1, 0, rank, 1));
    e.backward(&loss).unwrap();
    e.step().unwrap();
    (loss.double_value(&[]), e.gathered_params().unwrap())
}

/// Trains `saved_from` two steps on [`WORLD`] ranks and saves checkpoint
/// `dir/tag`; then each config of `into` loads it on fresh ranks, whose
/// next step must equal the saving run's to the bit. The saved tensors'
/// names, for the test to check what the state held.
pub fn resumes_to_the_same_bits(
    dir: &std::path::Path,
    tag: &str,
    saved_from: &Config,
    into: &[&Config],
) -> Vec<String> {
    let straight = on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = model();
        let e = engine_of(&vs, &plan, saved_from, &r);
        train_losses(&gpt, &e, r.rank(), 2);
        e.save_checkpoint(dir, tag).unwrap();
        next_step(&e, &gpt, r.rank())
    });
    for cfg in into {
        let resumed = on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = model();
            let e = engine_of(&vs, &plan, cfg, &r);
            e.load_checkpoint(dir, Some(tag)).unwrap();
            next_step(&e, &gpt, r.rank())
        });
        assert_eq!(resumed, straight, "{tag}");
    }
    saved_names(dir, tag)
}

/// A full load of checkpoint `dir/tag` into an engine of `cfg` is refused
/// on every rank, its error holding each of `wants`; a module-only load of
/// it (the parameters alone) succeeds.
pub fn full_load_refused(dir: &std::path::Path, tag: &str, cfg: &Config, wants: &[&str]) {
    on_ranks(WORLD, |r| {
        let (vs, plan, _) = model();
        let e = engine_of(&vs, &plan, cfg, &r);
        let err = e.load_checkpoint(dir, Some(tag)).unwrap_err().to_string();
        for want in wants {
            assert!(err.contains(want), "{want:?} in {err}");
        }
        e.load_checkpoint_module_only(dir, Some(tag)).unwrap();
    });
}

/// Whether `a` and `b` hold the same values to the bit (NaNs alike).
pub fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// Asserts `a` and `b` hold the same parameters, by name and in order,
/// to the bit.
pub fn assert_bits(what: &str, a: &Params, b: &Params) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((na, x), (nb, y)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        assert!(bits_equal(x, y), "{what}: {na} differs");
    }
}

/// Copies `params` (as `Engine::gathered_params` gives them) into the
/// VarStore's variables of the same names: weights loaded before the
/// engine is built, as a program loads pretrained ones.
pub fn put_params(vs: &nn::VarStore, params: &Params) {
    let mut vars = vs.variables();
    tch::no_grad(|| {
        for (name, values) in params {
            let t = vars.get_mut(name).unwrap();
            t.f_copy_(&Tensor::from_slice(values).view(t.size().as_slice()))
                .unwrap();
        }
    });
}

/// `optimizer` with `params` past lr and weight decay, every stage-3 unit
/// sharded, 4 steps: in bf16 stages 1-3 train to the bits of stage 0; and
/// stage 3 with the optimizer and parameter swaps on NVMe (in `dir`)
/// trains to the bits of stage 3 in memory, in bf16 (the optimizer swap
/// holds the fp32 master and the moments) and in fp32 (the moments alone:
/// the master is the parameters, paged through the parameter swap).
pub fn stages_and_swaps_train_alike(optimizer: &str, params: &str, dir: &std::path::Path) {
    let steps = 4;
    let (aio, off) = nvme(dir);
    let cfg = |stage, extra: &str, zero: &str| {
        let zero = format!("{SHARD_ALL} {zero}");
        config_params(optimizer, params, stage, 1, 0.0, extra, &zero)
    };
    for (extra, stages) in [(BF16, &[0u8, 1, 2, 3][..]), ("", &[3][..])] {
        let memory = train_world(&cfg(stages[0], extra, ""), &[], steps);
        let what = format!("{optimizer}{params} {extra}");
        for &stage in &stages[1..] {
            let run = train_world(&cfg(stage, extra, ""), &[], steps);
            assert_eq!(
                (&run.0, &run.1),
                (&memory.0, &memory.1),
                "{what} stage {stage}"
            );
        }
        let swapped = format!("{off} {}", nvme_params(dir));
        let run = train_world(&cfg(3, &format!("{extra} {aio}"), &swapped), &[], steps);
        assert_eq!((&run.0, &run.1), (&memory.0, &memory.1), "{what} swapped");
    }
}

/// What a rank holds under `optimizer` with `params`, which keeps
/// `moments` fp32 moments, against AdamW's two: at stages 0, 2 and 3, 4
/// bytes less per element of its optimizer range for each moment fewer;
/// at stage 3 in bf16, an optimizer swap file (in `dir`) in proportion to
/// the arrays it holds (the master and the moments, against the master, m
/// and v).
pub fn holds_moments(optimizer: &str, params: &str, moments: usize, dir: &std::path::Path) {
    let (aio, off) = nvme(dir);
    let what = format!("{optimizer}{params}");
    for stage in [0u8, 2, 3] {
        let held = |optimizer, params, extra: &str, zero: &str| {
            state_held(optimizer, params, stage, extra, zero)
        };
        let (adam, range, ..) = held("AdamW", "", "", "");
        let (mine, ..) = held(optimizer, params, "", "");
        assert_eq!(
            adam - mine,
            4 * (2 - moments) * range,
            "{what} stage {stage}"
        );
        if stage == 3 {
            let bf16 = format!("{BF16} {aio}");
            let adam = held("AdamW", "", &bf16, &off).2.unwrap();
            let mine = held(optimizer, params, &bf16, &off).2.unwrap();
            let arrays = 1 + moments as u64;
            assert!(
                mine > 0 && arrays * adam == 3 * mine,
                "{what}: {adam} {mine}"
            );
        }
    }
}

/// Writes `dir/tokenizer.json`: a tokenizer of `n` ids, words `t0` to
/// `t{n-1}` split at spaces (`tokenizers`' WordLevel), for prompts the
/// tests' small checkpoints continue.
pub fn word_tokenizer(dir: &std::path::Path, n: usize) {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..n).map(|i| (format!("t{i}"), i.into())).collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}

/// The start of a Python script that builds `transformers`' model from
/// seed 0 (`import` gives the config class as `C` and the model's as `M`,
/// `args` the config's arguments), moves every parameter off its
/// initialisation (so that no bias or norm is at zero or one) and writes
/// it with `save_pretrained` into `dir/hf` (`save` more arguments, e.g.
/// `, max_shard_size="100KB"`): `m` is the model, `torch` and
/// `save_file` are imported.
pub fn hf_seeded_model(import: &str, args: &str, dir: &std::path::Path, save: &str) -> String {
    format!(
        r#"
import torch
{import}
from safetensors.torch import save_file
torch.manual_seed(0)
m = M(C({args}))
with torch.no_grad():
    for p in m.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    # DeepSeek-V3's and GLM-4-MoE's routing correction, a buffer, off
    # zero too.
    for n, b in m.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.add_(torch.randn_like(b) * 0.05)
m.save_pretrained("{dir}/hf"{save})
"#,
        dir = dir.display()
    )
}

/// Zamba2's classes, its model class `M` giving `save_pretrained` each
/// tensor once, under its first name (a shared block under the first
/// hybrid layer that uses it, which `from_pretrained` ties back):
/// `transformers` 4.57's refuses Zamba2's shared blocks otherwise (its
/// tied-weight patterns start `^layers.`, where the names start
/// `model.layers.`). Those patterns are kept as strings, which
/// `transformers` reads as the same patterns: PEFT 0.18 takes each as a
/// name (`rpartition`) and fails on a compiled one, on any Zamba2.
pub const ZAMBA2: &str = "from transformers import Zamba2Config as C, Zamba2ForCausalLM
class M(Zamba2ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self._tied_weights_keys = [getattr(k, 'pattern', k) for k in self._tied_weights_keys]
    def save_pretrained(self, d, **kw):
        seen, state = set(), {}
        for k, v in self.state_dict().items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                state[k] = v.detach().clone()
        super().save_pretrained(d, state_dict=state, **kw)";

/// The first Zamba's classes, its model class `M` drawing its Mamba
/// layers' selection (`x_proj_weight`) at 0.5, not its class's 0.02:
/// at that scale each head's `B` and `C` move the logits by less than
/// the cases' tolerance (taking the first head's `B` for every head
/// passed them). `from_pretrained` overwrites them.
pub const ZAMBA: &str = "from transformers import ZambaConfig as C, ZambaForCausalLM
class M(ZambaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        with torch.no_grad():
            for layer in self.model.layers:
                mamba = layer.mamba_decoder.mamba if hasattr(layer, 'mamba_decoder') else layer.mamba
                mamba.x_proj_weight.normal_(0.0, 0.5)";

/// xLSTM's classes, its model class `M` drawing its input gates'
/// biases around 0, not its class's -10: at -10 each token's input
/// reaches the memory `exp(-10)` weighted, the cell's output is all but
/// zero and its per-head norm's epsilon makes the layer's output.
/// `from_pretrained` overwrites them.
pub const XLSTM: &str = "from transformers import xLSTMConfig as C, xLSTMForCausalLM
class M(xLSTMForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        with torch.no_grad():
            for block in self.backbone.blocks:
                block.mlstm_layer.igate_preact.bias.normal_(0.0, 1.0)";

/// Doge's classes, its model class `M` starting each layer's `A` (the
/// dynamic mask's factors) spread over ±3: at the seeded ±0.05 every
/// key's bias is within 4% of 1, where bf16 ties the keys the
/// `keep_window_size` cut chooses among. `from_pretrained` overwrites
/// them. Its attention is the eager one: its `sdpa` path drops the
/// causal mask (a token sees the ones after it).
pub const DOGE: &str = "from transformers import DogeConfig as C, DogeForCausalLM
class M(DogeForCausalLM):
    def __init__(self, config):
        config._attn_implementation = 'eager'
        super().__init__(config)
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.A.uniform_(-3.0, 3.0)";

/// RecurrentGemma's class as the cases train it (a case's `python.0`,
/// importing its config class as `C` and its model class as `M`; a
/// case's config gives `use_cache=False`). `transformers`' class cannot
/// train more than a step as it is: with its default `use_cache` its
/// attention takes its keys and values through a cache written under
/// `no_grad` (`k_proj` and `v_proj` get no gradient), and without it each
/// RG-LRU keeps its last state, graph and all, for the next forward
/// (whose backward then fails: "backward through the graph a second
/// time"). `M` forgets that state before each forward, which changes no
/// number (a sequence's first token multiplies it by zero).
macro_rules! recurrent_gemma {
    () => {
        "from transformers import RecurrentGemmaConfig as C, RecurrentGemmaForCausalLM
class M(RecurrentGemmaForCausalLM):
    def forward(self, *args, **kwargs):
        for layer in self.model.layers:
            if hasattr(layer.temporal_block, 'rg_lru'):
                layer.temporal_block.rg_lru.recurrent_states = None
        return super().forward(*args, **kwargs)"
    };
}

/// RecurrentGemma's class as the cases train it ([`recurrent_gemma!`]
/// says how and why).
pub const RECURRENT_GEMMA: &str = recurrent_gemma!();

/// [`RECURRENT_GEMMA`] attending within its `attention_window_size` in
/// training: `transformers`' training mask lets every token attend to
/// all before it (only its generation's cache holds a window), which
/// zrt does not follow; this mask is the window its generation keeps.
pub const RECURRENT_GEMMA_WINDOWED: &str = concat!(
    recurrent_gemma!(),
    "
import types
def window_mask(self, attention_mask, x, cache_position):
    i, j = cache_position[:, None], torch.arange(x.shape[1])[None, :]
    ok = (j <= i) & (i - j < self.config.attention_window_size)
    mask = torch.zeros(ok.shape, dtype=x.dtype).masked_fill(~ok, torch.finfo(x.dtype).min)
    return mask[None, None].expand(x.shape[0], 1, -1, -1)
class M(M):
    def __init__(self, config):
        super().__init__(config)
        self.model._update_causal_mask = types.MethodType(window_mask, self.model)"
);

/// BitNet's classes for the cases that train it ternary (a case's
/// `python.0`, importing its config class as `C` and its model class as
/// `M`): `M` builds its decoder layers' linear layers as
/// `transformers`' `AutoBitLinear` in online mode, as `from_pretrained`
/// builds them for a config with such a `quantization_config` (the
/// class alone builds plain ones), each with its RMS norm when the
/// config's `use_rms_norm` is true. Eager: `torch.compile` off.
pub const BITNET_TERNARY: &str = "import torch._dynamo
torch._dynamo.config.disable = True
from transformers import BitNetConfig as C, BitNetForCausalLM
from transformers.integrations.bitnet import AutoBitLinear
class M(BitNetForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        qc = getattr(config, 'quantization_config', None) or {}
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        norm = dict(use_rms_norm=bool(qc.get('use_rms_norm')), rms_norm_eps=qc.get('rms_norm_eps') or 1e-6)
        for module in list(self.model.modules()):
            for name, plain in list(module.named_children()):
                if type(plain) is torch.nn.Linear:
                    q = AutoBitLinear(plain.in_features, plain.out_features, bias=plain.bias is not None, online_quant=True, **norm)
                    missing, unexpected = q.load_state_dict(plain.state_dict(), strict=False)
                    assert not unexpected and all(k == 'rms_norm.weight' for k in missing), (missing, unexpected)
                    setattr(module, name, q)";

/// Writes [`hf_seeded_model`]'s model into `dir/hf`, in one file.
pub fn write_seeded_model(import: &str, args: &str, dir: &std::path::Path) {
    python(&hf_seeded_model(import, args, dir, ""));
}

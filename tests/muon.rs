//! `optimizer.type: "Muon"`: the hidden 2-D weights step by their momentum
//! orthogonalized over the whole matrix, the rest by AdamW (DeepSpeed's
//! `MuonWithAuxAdam`, `torch.optim.Muon`'s update). Asserted here: two
//! ranks at stages 0-3 train a two-unit model (a tall and a wide matrix)
//! as Python's `torch.optim.Muon` and `torch.optim.AdamW` do on one
//! process over both ranks' batches, with Nesterov and without, with
//! both rate adjustments and a separate AdamW rate; the stages and the
//! NVMe swaps train the GPT to the bits of the in-memory run, and MiCS
//! and hpZ pairs to the bits of two ranks; the plan's rule chooses the
//! parameters, one of fewer than two dimensions is refused and ranks
//! must agree on it; the matrices keep no second moment in memory;
//! checkpoints resume to the same bits, and a full load by
//! AdamW, or by Muon over other parameters, is refused by name while a
//! module-only load takes the parameters. Checkpoint loads restore the
//! RNG, so these run one at a time ([`common::serial`]).

use crate::common;

use common::{config_params, on_ranks, serial, small_input, BF16, SHARD_ALL, WORLD};
use tch::{nn, nn::Module, Device, Kind, Tensor};
use zrt::zero::{AutoHints, Config, Engine, ShardPlan, ShardedModule};

/// Two linear units, 3 -> 8 (a tall weight) and 8 -> 6 (a wide one), with
/// known values; the loss is the mean square of `b(tanh(a(x)))`.
struct Toy {
    vs: nn::VarStore,
    plan: ShardPlan,
    a: ShardedModule<nn::Linear>,
    b: ShardedModule<nn::Linear>,
}

fn toy() -> Toy {
    let _g = common::rng_lock();
    tch::set_num_threads(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    let a = common::linear_unit(&vs, &plan, "a", 3, 8);
    let b = common::linear_unit(&vs, &plan, "b", 8, 6);
    common::known_values(&vs, 0.7, 0.5);
    Toy { vs, plan, a, b }
}

impl Toy {
    fn loss(&self, x: &Tensor) -> Tensor {
        self.b
            .forward(&self.a.forward(x).tanh())
            .square()
            .mean(Kind::Float)
    }
}

/// A float list for Python.
fn list(v: &[f32]) -> String {
    let items: Vec<String> = v.iter().map(|x| format!("{x:?}")).collect();
    format!("[{}]", items.join(", "))
}

/// The toy's parameters after `steps` steps of Python's
/// `torch.optim.Muon` (over `muon`) and `torch.optim.AdamW` (the rest) on
/// one process, the loss the mean of [`WORLD`] ranks' losses, from the
/// values `start`.
fn python_muon(
    start: &[(String, Vec<i64>, Vec<f32>)],
    muon: &[&str],
    steps: usize,
    (muon_args, adam_args, clip): (&str, &str, f64),
) -> Vec<(String, Vec<f32>)> {
    let mut script = String::from("import torch\ntorch.set_num_threads(1)\nP = {}\n");
    for (name, shape, v) in start {
        script += &format!(
            "P['{name}'] = torch.tensor({}, dtype=torch.float32).view({shape:?}).requires_grad_()\n",
            list(v)
        );
    }
    let quoted: Vec<String> = muon.iter().map(|n| format!("'{n}'")).collect();
    script += &format!(
        "muon = [{}]\n\
         o1 = torch.optim.Muon([P[n] for n in muon], {muon_args})\n\
         o2 = torch.optim.AdamW([p for n, p in P.items() if n not in muon], {adam_args})\n",
        quoted.join(", ")
    );
    script += &format!("CLIP = {clip:?}\ninputs = []\n");
    for step in 0..steps {
        let xs: Vec<String> = (0..WORLD)
            .map(|r| {
                let x = small_input(r, step);
                list(&Vec::<f32>::try_from(x.flatten(0, -1)).unwrap())
            })
            .collect();
        script += &format!("inputs.append([{}])\n", xs.join(", "));
    }
    script += "for xs in inputs:\n\
        \x20   losses = []\n\
        \x20   for x in xs:\n\
        \x20       x = torch.tensor(x).view(4, 3)\n\
        \x20       h = torch.tanh(x @ P['a.weight'].T + P['a.bias'])\n\
        \x20       y = h @ P['b.weight'].T + P['b.bias']\n\
        \x20       losses.append(y.square().mean())\n\
        \x20   loss = sum(losses) / len(losses)\n\
        \x20   o1.zero_grad(); o2.zero_grad(); loss.backward()\n\
        \x20   if CLIP > 0: torch.nn.utils.clip_grad_norm_(P.values(), CLIP)\n\
        \x20   o1.step(); o2.step()\n\
        for n, p in sorted(P.items()):\n\
        \x20   print(n, ' '.join(repr(x) for x in p.detach().flatten().tolist()))\n";
    common::python(&script)
        .lines()
        .map(|l| {
            let mut it = l.split(' ');
            let name = it.next().unwrap().to_string();
            (name, it.map(|x| x.parse::<f32>().unwrap()).collect())
        })
        .collect()
}

/// The toy trained `steps` steps by zrt on [`WORLD`] in-process ranks
/// under `cfg` (`muon`: the plan's Muon rule, if any): its starting
/// parameters and rank 0's parameters after.
#[allow(clippy::type_complexity)]
fn zrt_muon(
    cfg: &Config,
    muon: Option<fn(&str, &[i64]) -> bool>,
    steps: usize,
) -> (Vec<(String, Vec<i64>, Vec<f32>)>, Vec<(String, Vec<f32>)>) {
    on_ranks(WORLD, |r| {
        let t = toy();
        let mut start: Vec<_> = (t.vs.variables().into_iter())
            .map(|(n, v)| {
                let values = Vec::<f32>::try_from(v.flatten(0, -1)).unwrap();
                (n, v.size(), values)
            })
            .collect();
        start.sort_by(|x, y| x.0.cmp(&y.0));
        if let Some(rule) = muon {
            t.plan.use_muon(rule).unwrap();
        }
        let g = r.new_group(&(0..WORLD).collect::<Vec<_>>()).unwrap();
        let e = Engine::new(&t.vs, &t.plan, cfg, g, &AutoHints::default()).unwrap();
        for step in 0..steps {
            let loss = t.loss(&small_input(r.rank(), step));
            e.backward(&loss).unwrap();
            e.step().unwrap();
        }
        let mut params = e.gathered_params().unwrap();
        params.sort_by(|x, y| x.0.cmp(&y.0));
        (start, params)
    })
    .remove(0)
}

/// A Muon config for the toy at `stage`, `params` inside
/// `optimizer.params` (none: DeepSpeed's defaults).
fn toy_config(stage: u8, params: &str, clip: f64) -> Config {
    Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 4, "gradient_clipping": {clip},
            "optimizer": {{"type": "Muon", "params": {{{params}}}}},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    ))
    .unwrap()
}

#[test]
fn two_ranks_at_every_stage_train_as_torchs_muon_and_adamw_on_one_process() {
    let steps = 4;
    // (zrt's params, torch.optim.Muon's arguments, torch.optim.AdamW's,
    // the gradient clipping).
    let cases = [
        // DeepSpeed's defaults: Muon at 0.02, AdamW at 3e-4, betas (0.9,
        // 0.95), eps 1e-10, no decay.
        (
            "",
            "lr=0.02, weight_decay=0.0",
            "lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0",
            0.0,
        ),
        (
            r#""lr": 0.01, "weight_decay": 0.1, "momentum": 0.9, "nesterov": false"#,
            "lr=0.01, weight_decay=0.1, momentum=0.9, nesterov=False",
            "lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1",
            // Clipped: the gradients' scale reaches the momentum.
            0.02,
        ),
        (
            r#""muon_lr": 0.005, "adam_lr": 0.002, "betas": [0.8, 0.9], "eps": 1e-8, "weight_decay": 0.05, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 3"#,
            "lr=0.005, weight_decay=0.05, adjust_lr_fn='match_rms_adamw', ns_steps=3",
            "lr=0.002, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.05",
            0.0,
        ),
        // The cubic iteration of the original Newton-Schulz.
        (
            r#""ns_coefficients": [1.5, -0.5, 0.0], "ns_steps": 8"#,
            "lr=0.02, weight_decay=0.0, ns_coefficients=(1.5, -0.5, 0.0), ns_steps=8",
            "lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0",
            0.0,
        ),
    ];
    let muon = ["a.weight", "b.weight"];
    for (params, muon_args, adam_args, clip) in cases {
        let (start, _) = zrt_muon(&toy_config(0, params, clip), None, 0);
        let want = python_muon(&start, &muon, steps, (muon_args, adam_args, clip));
        let moved: f32 = (start.iter().zip(&want))
            .flat_map(|(s, w)| s.2.iter().zip(&w.1).map(|(a, b)| (a - b).abs()))
            .fold(0.0, f32::max);
        assert!(
            moved > 1e-3,
            "{params}: torch moved the toy by {moved} only"
        );
        for stage in 0..=3 {
            let (_, got) = zrt_muon(&toy_config(stage, params, clip), None, steps);
            assert_eq!(got.len(), want.len());
            for ((n, g), (wn, w)) in got.iter().zip(&want) {
                assert_eq!(n, wn);
                let worst = (g.iter().zip(w))
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                // The matrices came out bit-identical to torch's here (the
                // same bf16 products); a bound, for another CPU's kernels.
                // AdamW's rounding differs from torch's by an ulp or so.
                let bound = if muon.contains(&n.as_str()) {
                    1e-4
                } else {
                    1e-6
                };
                let what = format!("Muon and AdamW against torch's: {params} stage {stage} {n}");
                common::margin(&what, worst as f64, bound as f64);
                assert!(
                    worst < bound,
                    "{params} stage {stage}: `{n}` differs from torch's by {worst}\n{g:?}\n{w:?}"
                );
            }
        }
    }
}

/// The toy's model-state bytes under `optimizer` at `stage` (`extra`:
/// more top-level keys, `zero`: more `zero_optimization` keys), summed
/// over [`WORLD`] ranks, after a step.
fn toy_state_bytes(optimizer: &str, stage: u8, extra: &str, zero: &str) -> usize {
    let cfg = Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 4, {extra}
            "optimizer": {{"type": "{optimizer}", "params": {{}}}},
            "zero_optimization": {{{zero} "stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    ))
    .unwrap();
    (on_ranks(WORLD, |r| {
        let t = toy();
        let g = r.new_group(&(0..WORLD).collect::<Vec<_>>()).unwrap();
        let e = Engine::new(&t.vs, &t.plan, &cfg, g, &AutoHints::default()).unwrap();
        e.backward(&t.loss(&small_input(r.rank(), 0))).unwrap();
        e.step().unwrap();
        let muon = if optimizer == "Muon" { 24 + 48 } else { 0 };
        assert_eq!(e.num_muon_params(), muon, "{optimizer}");
        e.model_state_bytes().unwrap()
    }))
    .into_iter()
    .sum()
}

#[test]
fn the_matrices_keep_no_second_moment_in_memory_and_the_swap_keeps_it_whole() {
    // The toy's matrices: a.weight (8 x 3) and b.weight (6 x 8).
    let matrices = 24 + 48;
    for stage in 0..=3 {
        let (adamw, muon) = (
            toy_state_bytes("AdamW", stage, "", ""),
            toy_state_bytes("Muon", stage, "", ""),
        );
        // Stage 0 holds every matrix on every rank, the others once.
        let copies = if stage == 0 { WORLD } else { 1 };
        assert_eq!(adamw - muon, 4 * matrices * copies, "stage {stage}");
    }
    // The NVMe swap's arrays keep every element: nothing of `v` is in
    // memory under either optimizer, and the two hold alike.
    let dir = common::scratch("muon-v-swap");
    let (aio, off) = common::nvme(&dir);
    assert_eq!(
        toy_state_bytes("AdamW", 3, &aio, &off),
        toy_state_bytes("Muon", 3, &aio, &off)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_nvme_swap_moves_no_second_moment_of_chunks_only_matrices_hold() {
    let _serial = serial();
    // Stage 3 in bf16: the swap holds the master, m and v (three arrays of
    // 4 KiB per 1024-element chunk). AdamW's step streams it once, reading
    // and writing every byte; Muon's twice (its momentum, then the
    // update), leaving out the 4 KiB of `v` of every chunk that only the
    // blocks' matrices fill.
    let dir = common::scratch("muon-swap-io");
    let (aio, off) = common::nvme(&dir);
    let per_step = |optimizer: &str| {
        let cfg = config_params(
            optimizer,
            "",
            3,
            1,
            0.0,
            &format!("{BF16} {aio}"),
            &format!("{SHARD_ALL} {off}"),
        );
        on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = common::model();
            let e = common::engine_of(&vs, &plan, &cfg, &r);
            common::train_losses(&gpt, &e, r.rank(), 1);
            let before = e.optimizer_swap_io().unwrap();
            common::train_losses(&gpt, &e, r.rank(), 1);
            let (read, written) = e.optimizer_swap_io().unwrap();
            (read - before.0, written - before.1, e.offloaded_bytes())
        })
    };
    for (rank, ((read, written, file), (m_read, m_written, m_file))) in per_step("AdamW")
        .into_iter()
        .zip(per_step("Muon"))
        .enumerate()
    {
        assert_eq!((read, written), (file, file), "AdamW rank {rank}");
        assert_eq!(m_file, file, "rank {rank}");
        // Chunks the matrices fill: v's 4 KiB, twice read and once (the
        // momentum pass writes m and v back, the update all three) twice
        // written; one chunk of v in three at most.
        let skipped = 2 * file - m_read;
        assert!(
            skipped > 0 && skipped % (2 * 4096) == 0,
            "rank {rank}: {skipped}"
        );
        assert!(skipped <= 2 * file / 3, "rank {rank}: {skipped} of {file}");
        let v = file / 3;
        assert_eq!(m_written, (v * 2 + file) - skipped, "rank {rank}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Muon (`params` past lr and weight decay) for the test GPT at `stage`,
/// every stage-3 unit sharded.
fn muon(params: &str, stage: u8, extra: &str, zero: &str) -> Config {
    config_params(
        "Muon",
        params,
        stage,
        1,
        0.0,
        extra,
        &format!("{SHARD_ALL} {zero}"),
    )
}

/// Muon without Nesterov, at another AdamW rate, by Moonshot's adjustment.
const OTHER: &str = r#", "nesterov": false, "adam_lr": 0.003, "adjust_lr_fn": "match_rms_adamw""#;

#[test]
fn bf16_stages_and_the_nvme_swaps_train_the_gpt_to_the_bits_of_memory() {
    let _serial = serial();
    let dir = common::scratch("muon-swap");
    for params in ["", OTHER] {
        common::stages_and_swaps_train_alike("Muon", params, &dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_records_muons_parameters_resumes_to_the_same_bits_and_is_refused_by_others() {
    let _serial = serial();
    let dir = common::scratch("muon-ckpt");
    let swap = common::scratch("muon-ckpt-swap");
    let (aio, off) = common::nvme(&swap);
    let at3 = muon("", 3, BF16, "");
    let swapped = muon("", 3, &format!("{BF16} {aio}"), &off);
    common::resumes_to_the_same_bits(&dir, "a", &swapped, &[&at3, &swapped]);
    // From memory, where `v` is packed, into the swap and other stages.
    let (at0, at2) = (muon("", 0, BF16, ""), muon("", 2, BF16, ""));
    common::resumes_to_the_same_bits(&dir, "b", &at3, &[&swapped, &at0, &at2]);
    // From stage 0, whose packed `v` spans the whole unit, into stage 3.
    common::resumes_to_the_same_bits(&dir, "c", &at0, &[&at3]);
    // The default rule: the blocks' matrices, not the embeddings (`wte`,
    // `wpe`) nor the head, though `wte` and `head` are wrapped units, nor
    // any norm or bias.
    let meta = zrt::zero::checkpoint::Meta::read(&dir.join("a")).unwrap();
    let chosen = meta.muon.clone().unwrap();
    let (vs, _, _) = common::model();
    let want: Vec<String> = {
        let mut w: Vec<String> = (vs.variables().into_iter())
            .filter(|(n, t)| n.starts_with("h.") && t.dim() == 2)
            .map(|(n, _)| n)
            .collect();
        w.sort();
        w
    };
    assert!(want.len() >= 4 && chosen == want, "{chosen:?}");
    let text = zrt::zero::checkpoint::inspect(&dir, Some("a")).unwrap();
    let said = format!(
        "optimizer Muon ({} parameter(s) by Muon, the rest by AdamW)",
        want.len()
    );
    assert!(text.contains(&said), "{text}");
    // AdamW's moments are not Muon's momentum (nor its zero v).
    let cfg = config_params("AdamW", "", 3, 1, 0.0, BF16, SHARD_ALL);
    let wants = [
        "its run trained with Muon, whose optimizer state (two moments, m and v) is not AdamW's",
        "load_checkpoint_module_only",
        "set `optimizer.type` to \"Muon\"",
    ];
    common::full_load_refused(&dir, "a", &cfg, &wants);
    // Muon over other parameters: the first block's matrices go to AdamW.
    on_ranks(WORLD, |r| {
        let (vs, plan, _) = common::model();
        plan.use_muon(|n, s| s.len() >= 2 && n.starts_with("h.") && !n.starts_with("h.0."))
            .unwrap();
        let e = common::engine_of(&vs, &plan, &at3, &r);
        let err = e.load_checkpoint(&dir, Some("a")).unwrap_err().to_string();
        for want in [
            "AdamW's now, Muon's then: `h.0.",
            "Give ShardPlan::use_muon the saved run's rule",
            "load_checkpoint_module_only",
        ] {
            assert!(err.contains(want), "{want:?} in {err}");
        }
        e.load_checkpoint_module_only(&dir, Some("a")).unwrap();
    });
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn the_plans_rule_chooses_muons_parameters_and_ranks_must_agree_on_it() {
    // Only b's weight by Muon: a's then steps as torch's AdamW steps it.
    let cfg = toy_config(3, r#""lr": 0.01"#, 0.0);
    let (start, got) = zrt_muon(&cfg, Some(|n, _| n == "b.weight"), 3);
    let args = (
        "lr=0.01, weight_decay=0.0",
        "lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0",
        0.0,
    );
    let want = python_muon(&start, &["b.weight"], 3, args);
    for ((n, g), (_, w)) in got.iter().zip(&want) {
        let worst = (g.iter().zip(w))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        common::margin(&format!("Muon against torch's: {n}"), worst as f64, 1e-4);
        assert!(worst < 1e-4, "`{n}` differs from torch's by {worst}");
    }
    // A vector cannot be orthogonalized.
    let want =
        "ShardPlan::use_muon chose `a.bias` of shape [8] for Muon, which orthogonalizes matrices";
    let plan = |_rank| {
        let t = toy();
        t.plan.use_muon(|n, _| n.starts_with("a.")).unwrap();
        (t.vs, t.plan)
    };
    common::refused_on_every_rank(|_| toy_config(2, "", 0.0), plan, want);
    // Ranks that split the parameters differently would drift apart.
    let plan = |rank| {
        let t = toy();
        if rank == 1 {
            t.plan.use_muon(|n, _| n == "b.weight").unwrap();
        }
        (t.vs, t.plan)
    };
    let want = "rank 1 differs from rank 0 in variable `a.weight`: rank 1 has [8, 3] Float (trained), rank 0 has [8, 3] Float (trained, Muon)";
    common::refused_on_every_rank(|_| toy_config(2, "", 0.0), plan, want);
}

#[test]
fn hybrid_sharding_orthogonalizes_inside_each_shard_group() {
    // Four ranks in MiCS pairs and in hpZ pairs, replicas on the same
    // data: the two-rank run's training, to the bit.
    let _serial = serial();
    let two = common::train_world(&muon("", 3, BF16, ""), &[], 3);
    for grouping in [
        r#""mics_shard_size": 2,"#,
        r#""zero_hpz_partition_size": 2,"#,
    ] {
        let four = common::train_grouped(4, &muon("", 3, BF16, grouping), 3);
        assert_eq!((&four.0, &four.1), (&two.0, &two.1), "{grouping}");
    }
}

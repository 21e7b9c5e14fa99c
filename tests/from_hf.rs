//! Checkpoints written by Hugging Face's `transformers` (`save_pretrained`,
//! in several files through an index) load into zrt's models of their
//! layouts (`zrt::gpt2`: names under `transformer.`, Conv1D matrices
//! `[in, out]`, a tied head; `zrt::llama`: grouped-query attention,
//! rotary embeddings, tied and untied heads, biases) under ZeRO with no
//! rank holding the model while it is built, and compute what
//! `transformers` computes: the same logits, and over three AdamW steps
//! on two ranks the same losses, to float rounding (the two are different
//! code over the same libtorch). The model zrt trained, exported in the
//! layout, loads in `transformers`' `from_pretrained` with nothing
//! missing or unexpected and gives zrt's losses.

use std::path::Path;

use crate::common;

use common::{config_zero, on_ranks, scratch, LR, MICRO, SHARD_ALL, WD};
use tch::nn::VarStore;
use tch::Tensor;
use zrt::gpt2::{Gpt2, Gpt2Config};
use zrt::llama::{Llama, LlamaConfig};
use zrt::zero::{AutoHints, Engine, ExportLayout, ShardPlan};

const STEPS: i64 = 3;
const SEQ: i64 = 16;

/// A causal language model as the test runs it.
trait Lm {
    fn forward(&self, tokens: &Tensor) -> Tensor;
    fn loss(&self, tokens: &Tensor) -> Tensor;
}

impl Lm for Gpt2 {
    fn forward(&self, tokens: &Tensor) -> Tensor {
        Gpt2::forward(self, tokens)
    }
    fn loss(&self, tokens: &Tensor) -> Tensor {
        Gpt2::loss(self, tokens)
    }
}

impl Lm for Llama {
    fn forward(&self, tokens: &Tensor) -> Tensor {
        Llama::forward(self, tokens)
    }
    fn loss(&self, tokens: &Tensor) -> Tensor {
        Llama::loss(self, tokens)
    }
}

/// What builds a model of a layout: sets the plan's rules for the
/// checkpoint in `hf` and builds the model on `vs` from its config; the
/// model, and the layout of its export.
type Build = fn(&VarStore, &ShardPlan, &Path) -> (Box<dyn Lm>, ExportLayout);

/// A layout under test.
struct Case {
    name: &'static str,
    /// Python importing the config class as `C` and the model class as
    /// `M`, and the config's arguments.
    python: (&'static str, &'static str),
    build: Build,
}

fn gpt2(vs: &VarStore, plan: &ShardPlan, hf: &Path) -> (Box<dyn Lm>, ExportLayout) {
    let cfg = Gpt2Config::from_hf_dir(hf).unwrap();
    zrt::gpt2::hf_weight_rules(plan).unwrap();
    plan.weights_from_file(vs, hf).unwrap();
    let model = Gpt2::new(&vs.root(), plan, &cfg);
    (Box::new(model), zrt::gpt2::hf_export_layout(&cfg))
}

fn llama(vs: &VarStore, plan: &ShardPlan, hf: &Path) -> (Box<dyn Lm>, ExportLayout) {
    let cfg = LlamaConfig::from_hf_dir(hf).unwrap();
    zrt::llama::hf_weight_rules(plan, &cfg).unwrap();
    plan.weights_from_file(vs, hf).unwrap();
    let model = Llama::new(&vs.root(), plan, &cfg);
    (Box::new(model), zrt::llama::hf_export_layout(&cfg))
}

const CASES: &[Case] = &[
    Case {
        name: "gpt2",
        python: (
            "from transformers import GPT2Config as C, GPT2LMHeadModel as M",
            "vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0",
        ),
        build: gpt2,
    },
    // Grouped-query attention (2 key-value heads for 4), the head apart.
    Case {
        name: "llama",
        python: (
            "from transformers import LlamaConfig as C, LlamaForCausalLM as M",
            "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64",
        ),
        build: llama,
    },
    // The head tied, biases everywhere, a head_dim of its own, another theta.
    Case {
        name: "llama-tied",
        python: (
            "from transformers import LlamaConfig as C, LlamaForCausalLM as M",
            "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_theta=500000.0",
        ),
        build: llama,
    },
];

/// Writes the case's seeded model (every parameter moved off its
/// initialisation, so that no bias or norm is at zero or one) with
/// `transformers` into `dir/hf`, in several files through an index, and
/// into `dir/reference.safetensors` the tokens of each step and rank
/// (`[STEPS, 2, MICRO, SEQ]`, each step's the same, so that the losses
/// fall as it learns them), the first step's logits of each rank's batch
/// and each step's loss on each rank, as `transformers` computes them
/// while AdamW trains it on the two ranks' batches.
fn reference(case: &Case, dir: &Path) {
    let (import, args) = case.python;
    let script = format!(
        r#"
import torch
{import}
from safetensors.torch import save_file
torch.manual_seed(0)
m = M(C({args}))
with torch.no_grad():
    for p in m.parameters():
        p.add_(torch.randn_like(p) * 0.05)
m.save_pretrained("{dir}/hf", max_shard_size="100KB")
tokens = torch.randint(0, 96, (1, 2, {MICRO}, {SEQ})).repeat({STEPS}, 1, 1, 1)
opt = torch.optim.AdamW(m.parameters(), lr={LR}, weight_decay={WD})
logits, losses = [], []
for s in range({STEPS}):
    out = [m(tokens[s, r], labels=tokens[s, r]) for r in range(2)]
    if s == 0:
        logits = torch.stack([o.logits.detach() for o in out])
    losses.append(torch.stack([o.loss.detach() for o in out]))
    opt.zero_grad()
    (sum(o.loss for o in out) / 2).backward()
    opt.step()
save_file({{"tokens": tokens, "logits": logits.contiguous(),
           "losses": torch.stack(losses).double()}}, "{dir}/reference.safetensors")
"#,
        dir = dir.display()
    );
    common::python(&script);
}

/// The losses `transformers` computes on each rank's first batch with the
/// model exported at `tuned` (refusing an export with missing or
/// unexpected tensors).
fn tuned_losses(case: &Case, dir: &Path, tuned: &Path) -> Vec<f64> {
    let script = format!(
        r#"
import torch
{import}
from safetensors.torch import load_file
m, info = M.from_pretrained("{tuned}", output_loading_info=True)
bad = {{k: v for k, v in info.items() if v}}
assert not bad, bad
tokens = load_file("{dir}/reference.safetensors")["tokens"]
with torch.no_grad():
    for r in range(2):
        print(m(tokens[0, r], labels=tokens[0, r]).loss.item())
"#,
        import = case.python.0,
        tuned = tuned.display(),
        dir = dir.display()
    );
    (common::python(&script).lines())
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

/// The files of a checkpoint directory with extension `ext`.
fn count(dir: &Path, ext: &str) -> usize {
    (std::fs::read_dir(dir).unwrap())
        .filter(|f| (f.as_ref().unwrap().path().extension()).is_some_and(|e| e == ext))
        .count()
}

#[test]
fn transformers_checkpoints_load_under_zero_train_as_transformers_does_and_go_back() {
    for case in CASES {
        let dir = scratch(&format!("from-hf-{}", case.name));
        reference(case, &dir);
        let hf = dir.join("hf");
        assert!(count(&hf, "safetensors") > 1, "{}: one file", case.name);
        let want = Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap();
        let get = |n: &str| want.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
        let (tokens, logits, losses) = (get("tokens"), get("logits"), get("losses"));
        // Tensors do not cross threads: each step's and rank's tokens as
        // numbers, `[MICRO, SEQ]` again on the rank.
        let batches: Vec<Vec<Vec<i64>>> = (0..STEPS)
            .map(|s| {
                (0..2)
                    .map(|r| Vec::try_from(tokens.get(s).get(r).flatten(0, -1)).unwrap())
                    .collect()
            })
            .collect();
        for stage in [0, 3] {
            let what = format!("{} at stage {stage}", case.name);
            let ds = config_zero(stage, 1, 0.0, "", SHARD_ALL);
            let tuned = dir.join(format!("tuned{stage}"));
            let got = on_ranks(2, |r| {
                let vs = VarStore::new(tch::Device::Cpu);
                let plan = ShardPlan::new();
                let (model, layout) = (case.build)(&vs, &plan, &hf);
                let held: usize = (vs.variables().values())
                    .map(|t| zrt::zero::glue::storage_nbytes(t).unwrap())
                    .sum();
                let group = r.new_group(&[0, 1]).unwrap();
                let e = Engine::new(&vs, &plan, &ds, group, &AutoHints::default()).unwrap();
                let rank = r.rank();
                let batch =
                    |s: i64| Tensor::from_slice(&batches[s as usize][rank]).view([MICRO, SEQ]);
                let first = tch::no_grad(|| model.forward(&batch(0)));
                let first = Vec::<f32>::try_from(first.flatten(0, -1)).unwrap();
                let losses: Vec<f64> = (0..STEPS)
                    .map(|s| {
                        let loss = model.loss(&batch(s));
                        e.backward(&loss).unwrap();
                        e.step().unwrap();
                        loss.double_value(&[])
                    })
                    .collect();
                // The trained model, exported for transformers in files
                // of at most 100 kB, and its losses on the first batch.
                e.save_16bit_model_as(&tuned, Some(100_000), &layout)
                    .unwrap();
                let after = tch::no_grad(|| model.loss(&batch(0)).double_value(&[]));
                (held, first, losses, after)
            });
            for f in ["model.safetensors.index.json", "config.json"] {
                assert!(tuned.join(f).is_file(), "{what}: no {f}");
            }
            let theirs = tuned_losses(case, &dir, &tuned);
            for (rank, (held, first, got, after)) in got.into_iter().enumerate() {
                let what = format!("{what}, rank {rank}");
                assert_eq!(held, 0, "{what}: the model was held while built");
                let want_logits = logits.get(rank as i64);
                assert_eq!(first.len(), want_logits.numel(), "{what}");
                let first = Tensor::from_slice(&first).view_as(&want_logits);
                let diff = (&first - &want_logits).abs().max().double_value(&[]);
                let scale = want_logits.abs().max().double_value(&[]);
                assert!(
                    diff < 1e-5 * scale.max(1.0),
                    "{what}: logits differ by {diff} (scale {scale})"
                );
                let want: Vec<f64> = (0..STEPS)
                    .map(|s| losses.double_value(&[s, rank as i64]))
                    .collect();
                for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() < 1e-5 * w.abs(),
                        "{what}, step {s}: loss {g}, transformers {w}"
                    );
                }
                // Training moved the losses (each step's batch is the
                // same): the comparison saw AdamW's steps.
                assert!(got[STEPS as usize - 1] < got[0] - 1e-3, "{what}: {got:?}");
                let t = theirs[rank];
                assert!(
                    (after - t).abs() < 1e-5 * t.abs(),
                    "{what}: exported, transformers computes {t}, zrt {after}"
                );
                assert!(
                    (after - got[0]).abs() > 1e-3,
                    "{what}: the export is the trained model"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! A GPT-2 checkpoint written by Hugging Face's `transformers`
//! (`save_pretrained`, sharded, its Conv1D matrices `[in, out]`, its
//! names under `transformer.`, its head tied) loads into `zrt::gpt2` under
//! ZeRO-3 with no rank holding the model, and computes what `transformers`
//! computes: the same logits, and over three AdamW steps on two ranks the
//! same losses, to float rounding (the two are different code over the
//! same libtorch: `transformers`' GELU is written out in Python, its
//! attention masks where ours is causal). The model it trained, exported
//! in Hugging Face's layout, loads in `transformers` and computes zrt's
//! losses.

use std::path::Path;

use crate::common;

use common::{config_zero, on_ranks, scratch, LR, MICRO, SHARD_ALL, WD};
use tch::Tensor;
use zrt::gpt2::{hf_export_layout, hf_weight_rules, Gpt2, Gpt2Config};
use zrt::zero::{AutoHints, Engine, ShardPlan};

const STEPS: i64 = 3;
const SEQ: i64 = 16;

/// Writes a seeded GPT-2 with `transformers` into `dir/hf` (in several
/// files, through an index), and into `dir/reference.safetensors` the
/// tokens of each step and rank (`[STEPS, 2, MICRO, SEQ]`, each step's
/// the same, so that the losses fall as it learns them), the first
/// step's logits of each rank's batch and each step's loss on each rank,
/// as `transformers` computes them while AdamW trains it on the two
/// ranks' batches.
fn reference(dir: &Path) {
    let script = format!(
        r#"
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from safetensors.torch import save_file
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
m = GPT2LMHeadModel(cfg)
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
fn tuned_losses(dir: &Path, tuned: &Path) -> Vec<f64> {
    let script = format!(
        r#"
import torch
from transformers import GPT2LMHeadModel
from safetensors.torch import load_file
m, info = GPT2LMHeadModel.from_pretrained("{tuned}", output_loading_info=True)
bad = {{k: v for k, v in info.items() if v}}
assert not bad, bad
tokens = load_file("{dir}/reference.safetensors")["tokens"]
with torch.no_grad():
    for r in range(2):
        print(m(tokens[0, r], labels=tokens[0, r]).loss.item())
"#,
        tuned = tuned.display(),
        dir = dir.display()
    );
    (common::python(&script).lines())
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

#[test]
fn a_transformers_gpt2_checkpoint_loads_under_zero_3_and_trains_as_transformers_does() {
    let dir = scratch("gpt2-from-hf");
    reference(&dir);
    let hf = dir.join("hf");
    let parts = std::fs::read_dir(&hf)
        .unwrap()
        .filter(|f| {
            f.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|e| e == "safetensors")
        })
        .count();
    assert!(
        parts > 1 && hf.join("model.safetensors.index.json").is_file(),
        "{parts} files"
    );
    let want: Vec<(String, Tensor)> =
        Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap();
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
    let cfg = Gpt2Config::from_hf_dir(&hf).unwrap();
    for stage in [0, 3] {
        let ds = config_zero(stage, 1, 0.0, "", SHARD_ALL);
        let got = on_ranks(2, |r| {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let plan = ShardPlan::new();
            hf_weight_rules(&plan).unwrap();
            plan.weights_from_file(&vs, &hf).unwrap();
            let model = Gpt2::new(&vs.root(), &plan, &cfg);
            let held: usize = (vs.variables().values())
                .map(|t| zrt::zero::glue::storage_nbytes(t).unwrap())
                .sum();
            let group = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &ds, group, &AutoHints::default()).unwrap();
            let rank = r.rank() as i64;
            let batch =
                |s: i64| Tensor::from_slice(&batches[s as usize][rank as usize]).view([MICRO, SEQ]);
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
            // The trained model, exported for transformers in files of at
            // most 100 kB, and its losses on each rank's first batch.
            let tuned = dir.join(format!("tuned{stage}"));
            e.save_16bit_model_as(&tuned, Some(100_000), &hf_export_layout(&cfg))
                .unwrap();
            let after = tch::no_grad(|| model.loss(&batch(0)).double_value(&[]));
            (held, first, losses, after)
        });
        let tuned = dir.join(format!("tuned{stage}"));
        for f in ["model.safetensors.index.json", "config.json"] {
            assert!(tuned.join(f).is_file(), "stage {stage}: no {f}");
        }
        let theirs = tuned_losses(&dir, &tuned);
        for (rank, (held, first, got, after)) in got.into_iter().enumerate() {
            let what = format!("stage {stage}, rank {rank}");
            assert_eq!(held, 0, "{what}: the model was held while built");
            let want_logits = logits.get(rank as i64);
            assert_eq!(first.len() as i64, want_logits.numel() as i64, "{what}");
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
            // Training moved the losses (each step's batch is the same):
            // the comparison saw AdamW's steps.
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

//! A small GPT in tch, its blocks wrapped in [`ShardedModule`]: the model
//! of zrt's main job, benchmarks and parity tests.
//!
//! Pre-norm blocks (LayerNorm, causal self-attention with a bias-free qkv
//! projection, LayerNorm, GELU MLP),
//! learned position embeddings, an untied head. Initialization is tch's
//! defaults, so a fixed `tch::manual_seed` gives the same model everywhere.

use std::sync::atomic::{AtomicBool, Ordering};

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::blocks::{fused_causal_attention, Run};
use crate::zero::{ShardPlan, ShardedModule};

/// Whether the VarStore name `name` is a parameter of a block's MLP (what
/// [`Gpt::leave_out_mlp`] leaves out: `h.{i}.ln2`, `.fc`, `.out`): the
/// rule to declare them with [`ShardPlan::partly_unused_on_some_ranks`].
pub fn is_mlp_param(name: &str) -> bool {
    name.starts_with("h.") && [".ln2.", ".fc.", ".out."].iter().any(|m| name.contains(m))
}

/// Sizes of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary size (256 for bytes).
    pub vocab: i64,
    /// Model width.
    pub d_model: i64,
    /// Blocks.
    pub layers: i64,
    /// Attention heads (must divide `d_model`).
    pub heads: i64,
    /// Longest sequence.
    pub seq: i64,
}

/// One pre-norm transformer block.
#[derive(Debug)]
pub struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    out: nn::Linear,
    heads: i64,
    /// Whether the MLP (`ln2`, `fc`, `out`) is left out ([`Gpt::leave_out_mlp`]).
    mlp_left_out: AtomicBool,
}

impl Block {
    fn new(p: &nn::Path, c: &GptConfig) -> Self {
        let d = c.d_model;
        Self {
            ln1: nn::layer_norm(p / "ln1", vec![d], Default::default()),
            // No bias: the key bias has an identically zero gradient (softmax
            // is shift-invariant), so Adam would move it by amplified
            // rounding noise alone.
            qkv: nn::linear(
                p / "qkv",
                d,
                3 * d,
                nn::LinearConfig {
                    bias: false,
                    ..Default::default()
                },
            ),
            proj: nn::linear(p / "proj", d, d, Default::default()),
            ln2: nn::layer_norm(p / "ln2", vec![d], Default::default()),
            fc: nn::linear(p / "fc", d, 4 * d, Default::default()),
            out: nn::linear(p / "out", 4 * d, d, Default::default()),
            heads: c.heads,
            mlp_left_out: AtomicBool::new(false),
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let qkv = self.qkv.forward(&self.ln1.forward(x));
        let x = x + self
            .proj
            .forward(&fused_causal_attention(&qkv, self.heads, 0.0, None));
        if self.mlp_left_out.load(Ordering::Relaxed) {
            return x;
        }
        let m = self
            .out
            .forward(&self.fc.forward(&self.ln2.forward(&x)).gelu("none"));
        x + m
    }
}

/// The model: token and position embeddings, blocks, final norm, head.
#[derive(Debug)]
pub struct Gpt {
    wte: ShardedModule<nn::Embedding>,
    wpe: nn::Embedding,
    blocks: Vec<ShardedModule<Run<Block>>>,
    ln_f: nn::LayerNorm,
    head: ShardedModule<nn::Linear>,
    cfg: GptConfig,
}

impl Gpt {
    /// Builds the model under `p`: the token embedding (`wte`), each block
    /// (`h.0`, `h.1`, ...) and the head are units of `plan`, as FSDP wraps
    /// them (the two largest matrices must not stay gathered); the position
    /// embedding and the final norm form the root.
    pub fn new(p: &nn::Path, plan: &ShardPlan, cfg: &GptConfig) -> Self {
        Self::build(p, plan, cfg, false)
    }

    /// As [`Gpt::new`], every block's activations recomputed in backward
    /// ([`Checkpointed`](crate::zero::activation::Checkpointed) inside
    /// each block's `ShardedModule`): the same parameters and results,
    /// less memory, one more block forward per backward.
    pub fn new_checkpointed(p: &nn::Path, plan: &ShardPlan, cfg: &GptConfig) -> Self {
        Self::build(p, plan, cfg, true)
    }

    fn build(p: &nn::Path, plan: &ShardPlan, cfg: &GptConfig, checkpointed: bool) -> Self {
        let blocks = (0..cfg.layers)
            .map(|i| {
                let bp = p / "h" / i;
                let run = Run::new(Block::new(&bp, cfg), checkpointed);
                ShardedModule::new(plan, &bp, run)
            })
            .collect();
        let wte = p / "wte";
        let head = p / "head";
        Self {
            wte: ShardedModule::new(
                plan,
                &wte,
                nn::embedding(&wte, cfg.vocab, cfg.d_model, Default::default()),
            ),
            wpe: nn::embedding(p / "wpe", cfg.seq, cfg.d_model, Default::default()),
            blocks,
            ln_f: nn::layer_norm(p / "ln_f", vec![cfg.d_model], Default::default()),
            head: ShardedModule::new(
                plan,
                &head,
                nn::linear(&head, cfg.d_model, cfg.vocab, Default::default()),
            ),
            cfg: *cfg,
        }
    }

    /// Leaves the MLP of block `i` (`h.{i}.ln2`, `.fc`, `.out`) out of its
    /// forwards from now on (`true`), or puts it back: the block still
    /// runs, and its MLP's parameters get no gradient, as a
    /// mixture-of-experts layer's experts that no token reached. A rank
    /// that leaves out MLPs others run trains with them declared by
    /// [`ShardPlan::partly_unused_on_some_ranks`]. Set it while no
    /// backward is to come (a checkpointed block's recompute reads it
    /// again). Nothing for a block `i` the model lacks.
    pub fn leave_out_mlp(&self, i: usize, out: bool) {
        let Some(b) = self.blocks.get(i) else {
            return;
        };
        b.inner()
            .with_inner(|b| b.mlp_left_out.store(out, Ordering::Relaxed));
    }

    /// [`Gpt::leave_out_mlp`] for every block: the MLPs of the blocks
    /// numbered in `which` are left out, the others put back.
    pub fn leave_out_mlps(&self, which: &[usize]) {
        for i in 0..self.blocks.len() {
            self.leave_out_mlp(i, which.contains(&i));
        }
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (int64).
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        self.forward_skipping(tokens, &[])
    }

    /// As [`Gpt::forward`], the blocks numbered in `skipped` left out (their
    /// input goes on as their output), as LayerDrop does: their units do
    /// not run, and no gradient reaches them.
    pub fn forward_skipping(&self, tokens: &Tensor, skipped: &[usize]) -> Tensor {
        let t = tokens.size().get(1).copied().unwrap_or(1);
        let pos = Tensor::arange(t, (Kind::Int64, tokens.device()));
        let mut x = self.wte.forward(tokens) + self.wpe.forward(&pos);
        for (i, b) in self.blocks.iter().enumerate() {
            if !skipped.contains(&i) {
                x = b.forward(&x);
            }
        }
        self.head.forward(&self.ln_f.forward(&x))
    }

    /// Mean next-token cross-entropy of `tokens[:, :-1]` predicting
    /// `tokens[:, 1:]`, computed in fp32 whatever the model's dtype.
    pub fn loss(&self, tokens: &Tensor) -> Tensor {
        self.loss_skipping(tokens, &[])
    }

    /// As [`Gpt::loss`], through [`Gpt::forward_skipping`].
    pub fn loss_skipping(&self, tokens: &Tensor, skipped: &[usize]) -> Tensor {
        let t = tokens.size().get(1).copied().unwrap_or(2);
        let (x, y) = (tokens.narrow(1, 0, t - 1), tokens.narrow(1, 1, t - 1));
        let logits = self.forward_skipping(&x, skipped).to_kind(Kind::Float);
        logits
            .view([-1, self.cfg.vocab])
            .cross_entropy_for_logits(&y.reshape([-1]))
    }
}

/// The blocks (of `layers`) LayerDrop leaves out of the micro-batch drawn
/// from `seed`, each with chance `p`: a pure function of its arguments, so
/// a resumed run, or a peer in another language, leaves out the same ones
/// (the main job's `--layerdrop`, `zrt bench train --layerdrop`; the
/// benchmark's Python peer computes it the same way). Ranks that draw
/// from different seeds leave out different blocks: declare the blocks
/// with [`ShardPlan::unused_on_some_ranks`].
pub fn layerdrop(p: f64, layers: i64, seed: u64) -> Vec<usize> {
    (0..layers.max(0) as u64)
        .filter(|&i| {
            // splitmix64 of (seed, block): an even draw in [0, 1).
            let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i + 1);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 11) as f64 / (1u64 << 53) as f64) < p
        })
        .map(|i| i as usize)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{is_mlp_param, layerdrop};

    #[test]
    fn an_mlp_parameter_is_a_blocks_ln2_fc_or_out() {
        for name in ["h.0.ln2.weight", "h.11.fc.bias", "h.3.out.weight"] {
            assert!(is_mlp_param(name), "{name}");
        }
        for name in [
            "h.0.ln1.weight",
            "h.2.qkv.weight",
            "h.1.proj.bias",
            "head.weight",
            "ln_f.bias",
        ] {
            assert!(!is_mlp_param(name), "{name}");
        }
    }

    #[test]
    fn layerdrop_draws_the_blocks_the_python_peer_draws() {
        // Computed by bench/peers/train_peer.py's `dropped` (the same
        // splitmix64): each seed's draws for blocks 0 and 1 are
        // 0: (0.34, 0.86), 5: (0.71, 0.31), 7: (0.94, 0.92), 11: (0.01, 0.17).
        let at_half = |seed| layerdrop(0.5, 2, seed);
        assert_eq!(at_half(0), [0]);
        assert_eq!(at_half(5), [1]);
        assert_eq!(at_half(7), [] as [usize; 0]);
        assert_eq!(at_half(11), [0, 1]);
        assert_eq!(layerdrop(0.0, 8, 11), [] as [usize; 0]);
        assert_eq!(layerdrop(0.9, 2, 7), [] as [usize; 0]);
        assert_eq!(layerdrop(0.95, 2, 7), [0, 1]);
    }
}

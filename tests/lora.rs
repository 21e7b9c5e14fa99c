//! LoRA adapters on Llama, GPT-2, GPT-NeoX, Phi, Cohere, DeepSeek-V3, Apertus, DBRX, Falcon, GPT-J, CodeGen, GPT-BigCode, OPT (350m's too), GPT-Neo, MPT, BLOOM, Persimmon, BioGPT, XGLM, PhiMoE (its experts too), Granite 4.0, Jamba, Mamba, Mamba-2 and Falcon-H1 (their Mamba layers' projections; Jamba's experts too), LFM2 (its convolution layers' projections), MiniMax (its lightning layers' projections), Qwen3-Next (its DeltaNet layers' projections), RecurrentGemma (its recurrent layers' projections), LongCat-Flash (its sublayers and experts), GPT-NeoX-Japanese, CTRL, OpenAI GPT (its Conv1D matrices, DoRA too), ModernBERT-decoder (its gated `Wi` too), Doge (its dynamic mask's `dt_proj` too), RWKV (both mixers), Zamba2 and Zamba (their Mamba layers' projections; every linear layer, each shared block's once), xLSTM (its mLSTM layers' projections), DiffLlama, BitNet (trained ternary), JetMoE (its attention and MLP experts too) checkpoints, and on GPT-OSS's, Granite-MoE's and Aria's stacked experts
//! (`HfOptions::lora`): the base
//! loads from its files frozen, held by no rank while built; the
//! adapters, all that trains, start from rank 0's draw on every rank;
//! exported as PEFT's adapter directory, `peft` loads them with nothing
//! missing or unexpected, and training its own LoRA from zrt's initial
//! adapters on the same batches gives zrt's losses, step by step, and
//! zrt's trained adapters.

use std::path::Path;

use crate::common;

use common::{config_zero, on_ranks, scratch, LR, MICRO, SHARD_ALL, WD};
use tch::nn::VarStore;
use tch::Tensor;
use zrt::hf::{HfModel, HfOptions};
use zrt::lora::LoraConfig;
use zrt::zero::{AutoHints, Engine, ShardPlan};

const STEPS: usize = 3;
const SEQ: i64 = 16;

/// AdamW's `eps`, on both sides, in place of the default 1e-8. Adam's
/// first step is the learning rate times `g / (|g| + eps)`: with 1e-8
/// every gradient above rounding noise steps the whole rate, whatever
/// its size, and a gradient that is zero in exact arithmetic (a key
/// projection's bias: softmax takes no notice of a shift its query adds
/// to every score) or nearly so steps it too, in the direction the
/// rounding decides. Two trainings then part by up to twice the rate a
/// step where the CPU's kernels round otherwise (the adapters had bounds
/// of 1e-6 to 2e-4, each found on one CPU and moved on the next). With
/// 1e-4 a gradient below it steps in proportion to itself: rounding of
/// 1e-9 moves a step by 1e-7 of the rate, while the adapters' gradients
/// (1e-3 and more for B) still step nearly the whole rate.
const EPS: f64 = 1e-4;

/// How far an fp32 run's trained tensors may be from PEFT's: with
/// [`EPS`], every case but [`XLSTM`] ended within 3e-6 on the AMD EPYC
/// AVX-512 VM (2026-12-07), most within 1e-6. (The ternary BitNet's
/// with norms, 6.7e-8 alone, ended 3.6e-6 in two of seven runs among
/// the other tests: its 8-bit inputs round to a grid, so one value
/// rounded otherwise moves a step.) An update scaled 1% off fails by
/// 2.4e-4 (`adapters_on_some_layers_with_ranks_of_their_own`).
const ADAPTERS: f64 = 1e-5;

/// A layout under test: Python importing its config class as `C` and its
/// model class as `M`, the config's arguments, the adapters' targets,
/// whether they are DoRA's (targets also as a pattern, some excluded),
/// the modules trained whole
/// (`modules_to_save`), the tokens whose embedding rows train
/// (`trainable_token_indices`), and what trains: adapter tensors, saved
/// tensors, elements.
struct Case {
    python: (&'static str, &'static str),
    targets: &'static [&'static str],
    /// `target_modules` as PEFT's regular expression, and
    /// `exclude_modules`.
    pattern: Option<&'static str>,
    exclude: &'static [&'static str],
    dora: bool,
    saved: &'static [&'static str],
    tokens: &'static [i64],
    /// PEFT's dict form instead: modules and their tokens.
    token_modules: &'static [(&'static str, &'static [i64])],
    /// PEFT's `bias = "all"`: every bias trains too.
    biases: bool,
    /// PEFT's `lora_bias`: each adapter's B has a bias.
    lora_bias: bool,
    /// How far an fp32 run's trained tensors may be from PEFT's, where
    /// not [`ADAPTERS`].
    atol: Option<f64>,
    /// `layers_to_transform`, `rank_pattern` and `alpha_pattern`.
    layers: &'static [i64],
    ranks: &'static [(&'static str, i64)],
    alphas: &'static [(&'static str, f64)],
    /// `target_parameters`: stacked experts' parameters.
    parameters: &'static [&'static str],
    matrices: usize,
    whole: usize,
    elements: usize,
}

/// What a layout leaves off: plain LoRA (not DoRA), listed targets,
/// nothing saved whole, no trainable tokens. Each layout below says what
/// it has and takes the rest from here.
const OFF: Case = Case {
    python: ("", ""),
    targets: &[],
    pattern: None,
    exclude: &[],
    dora: false,
    saved: &[],
    tokens: &[],
    token_modules: &[],
    biases: false,
    lora_bias: false,
    atol: None,
    layers: &[],
    ranks: &[],
    alphas: &[],
    parameters: &[],
    matrices: 0,
    whole: 0,
    elements: 0,
};

/// A Llama with grouped-query attention, adapters on three of each
/// layer's projections (A [4, in] and B [out, 4]: q 64 -> 64, v 64 ->
/// 32, down 160 -> 64).
const LLAMA: Case = Case {
    python: (
        "from transformers import LlamaConfig as C, LlamaForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64",
    ),
    targets: &["q_proj", "v_proj", "down_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 32) + (160 + 64)),
    ..OFF
};

/// [`LLAMA`]'s adapters as DoRA's: each also a magnitude a row (q 64,
/// v 32, down 64).
const LLAMA_DORA: Case = Case {
    dora: true,
    matrices: 18,
    elements: 2 * 4 * ((64 + 64) + (64 + 32) + (160 + 64)) + 2 * (64 + 32 + 64),
    ..LLAMA
};

/// [`LLAMA`] with its head and final norm trained whole
/// (`modules_to_save`): 96 x 64 and 64 elements more.
const LLAMA_SAVED: Case = Case {
    saved: &["lm_head", "model.norm"],
    whole: 2,
    elements: LLAMA.elements + 96 * 64 + 64,
    ..LLAMA
};

/// A Llama whose head is its token embedding, the embedding trained
/// whole (PEFT's `ensure_weight_tying`: one tensor, the head too).
const LLAMA_TIED_SAVED: Case = Case {
    python: (
        "from transformers import LlamaConfig as C, LlamaForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True",
    ),
    saved: &["embed_tokens"],
    whole: 1,
    elements: LLAMA.elements + 96 * 64,
    ..LLAMA
};

/// [`LLAMA`] with three tokens' embedding rows trained (its head its
/// own: the rows change the lookup alone).
const LLAMA_TOKENS: Case = Case {
    tokens: &[3, 7, 5],
    matrices: 13,
    elements: LLAMA.elements + 3 * 64,
    ..LLAMA
};

/// [`LLAMA_TIED_SAVED`]'s model with three tokens' rows trained: the
/// tied head computes with them too.
const LLAMA_TIED_TOKENS: Case = Case {
    saved: &[],
    tokens: &[3, 7, 5],
    matrices: 13,
    whole: 0,
    elements: LLAMA.elements + 3 * 64,
    ..LLAMA_TIED_SAVED
};

/// [`LLAMA`] with adapters on its two ends too, named (PEFT's
/// `all-linear` leaves them out): the token embedding (A `[4, 96]`, B
/// `[64, 4]`) and the head (A `[4, 64]`, B `[96, 4]`).
const LLAMA_ENDS: Case = Case {
    targets: &["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"],
    matrices: 16,
    elements: LLAMA.elements + 2 * (4 * 96 + 64 * 4),
    ..LLAMA
};

/// GPT-2's Conv1D layers (`[in, out]` in the file, PEFT's
/// `fan_in_fan_out`): `c_attn` (64 -> 192) and both `c_proj`s (the
/// attention's 64 -> 64, the MLP's 256 -> 64).
const GPT2: Case = Case {
    python: (
        "from transformers import GPT2Config as C, GPT2LMHeadModel as M",
        "vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0",
    ),
    targets: &["c_attn", "c_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 192) + (64 + 64) + (256 + 64)),
    ..OFF
};

/// [`GPT2`]'s adapters as DoRA's (its Conv1D matrices' rows are their
/// file's columns): a magnitude a row (192, 64, 64).
const GPT2_DORA: Case = Case {
    dora: true,
    matrices: 18,
    elements: 2 * 4 * ((64 + 192) + (64 + 64) + (256 + 64)) + 2 * (192 + 64 + 64),
    ..GPT2
};

/// Pythia's layout: the fused query-key-value projection (64 -> 192)
/// and the MLP's second matrix (256 -> 64).
const GPT_NEOX: Case = Case {
    python: (
        "from transformers import GPTNeoXConfig as C, GPTNeoXForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64",
    ),
    targets: &["query_key_value", "dense_4h_to_h"],
    matrices: 8,
    elements: 2 * 4 * ((64 + 192) + (256 + 64)),
    ..OFF
};

/// Phi-2's layout: queries, the attention's output and the MLP's second
/// matrix, all biased (the biases stay frozen).
const PHI: Case = Case {
    python: (
        "from transformers import PhiConfig as C, PhiForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64",
    ),
    targets: &["q_proj", "dense", "fc2"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (256 + 64)),
    ..OFF
};

/// Cohere's layout (its sublayers side by side after one norm, the head
/// tied): queries (64 -> 64), values (64 -> 32) and the MLP's up
/// projection (64 -> 160).
const COHERE: Case = Case {
    python: (
        "from transformers import CohereConfig as C, CohereForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, logit_scale=0.3",
    ),
    targets: &["q_proj", "v_proj", "up_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 160)),
    ..OFF
};

/// DeepSeek-V3's latent attention: the queries' expansion (24 -> 80),
/// the latent's (16 -> 88: keys and values) and the latent itself (64 ->
/// 24), beside its grouped experts.
const DEEPSEEK: Case = Case {
    python: (
        "from transformers import DeepseekV3Config as C, DeepseekV3ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=1, attention_bias=True",
    ),
    targets: &["q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa"],
    matrices: 12,
    elements: 2 * 4 * ((24 + 80) + (16 + 88) + (64 + 24)),
    ..OFF
};

/// LongCat-Flash's two sublayers a layer: each one's queries'
/// expansion (24 -> 80), latent's expansion (16 -> 88) and dense MLP's
/// gate (48 -> 96), and each real expert's gate (48 -> 16), beside a
/// zero expert.
const LONGCAT_FLASH: Case = Case {
    python: (
        "from transformers import LongcatFlashConfig as C, LongcatFlashForCausalLM as M",
        "vocab_size=96, hidden_size=48, ffn_hidden_size=96, num_layers=2, num_attention_heads=4, max_position_embeddings=64, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, head_dim=8, v_head_dim=10, n_routed_experts=4, zero_expert_num=1, moe_topk=3, expert_ffn_hidden_size=16, routed_scaling_factor=1.5, attention_bias=True",
    ),
    targets: &["q_b_proj", "kv_b_proj", "gate_proj"],
    matrices: 40,
    elements: 2 * 4 * (2 * (24 + 80) + 2 * (16 + 88) + 2 * (48 + 96) + 4 * (48 + 16)),
    ..OFF
};

/// GPT-NeoX-Japanese's heads' queries, keys and values together (64 ->
/// 192), its attention's output (64 -> 64, the last layer's bias beside
/// it, frozen) and its MLP's up projection (64 -> 160), tied head.
const GPT_NEOX_JAPANESE: Case = Case {
    python: (
        "from transformers import GPTNeoXJapaneseConfig as C, GPTNeoXJapaneseForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_multiple_size=2.5, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5, attention_dropout=0.0",
    ),
    targets: &["query_key_value", "dense", "dense_h_to_4h"],
    matrices: 18,
    elements: 3 * 4 * ((64 + 192) + (64 + 64) + (64 + 160)),
    ..OFF
};

/// Apertus's ungated MLP (its xIELU's scalars frozen with the base,
/// held in fp32 as `tests/from_hf.rs` holds them): queries (64 -> 64),
/// the up (64 -> 128) and down (128 -> 64) projections.
const APERTUS: Case = Case {
    python: (
        common::APERTUS,
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64",
    ),
    targets: &["q_proj", "up_proj", "down_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 128) + (128 + 64)),
    ..OFF
};

/// DBRX's fused attention and router, under its own names: `Wqkv` (64
/// -> 128: 4 query heads, 2 key-value heads), `out_proj` (64 -> 64) and
/// the router's `layer` (64 -> 4 experts).
const DBRX: Case = Case {
    python: (
        "from transformers import DbrxConfig as C, DbrxForCausalLM as M",
        "vocab_size=96, d_model=64, n_heads=4, n_layers=2, max_seq_len=64, attn_config={'kv_n_heads': 2, 'clip_qkv': 8.0}, ffn_config={'ffn_hidden_size': 32, 'moe_num_experts': 4, 'moe_top_k': 2}",
    ),
    targets: &["Wqkv", "out_proj", "layer"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 128) + (64 + 64) + (64 + 4)),
    ..OFF
};

/// Falcon's new architecture under its own names (the head tied):
/// `query_key_value` (64 -> 128: 2 groups of 2 query heads, a key and a
/// value), `dense` (64 -> 64), `dense_h_to_4h` (64 -> 128) and
/// `dense_4h_to_h` (128 -> 64).
const FALCON: Case = Case {
    python: (
        "from transformers import FalconConfig as C, FalconForCausalLM as M",
        "vocab_size=96, hidden_size=64, ffn_hidden_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, new_decoder_architecture=True, num_kv_heads=2, bias=True",
    ),
    targets: &["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    matrices: 16,
    elements: 2 * 4 * ((64 + 128) + (64 + 64) + (64 + 128) + (128 + 64)),
    ..OFF
};

/// GPT-J's attention and MLP side by side: `q_proj` (64 -> 64),
/// `v_proj` (64 -> 64), `fc_in` (64 -> 128) and `fc_out` (128 -> 64).
const GPTJ: Case = Case {
    python: (
        "from transformers import GPTJConfig as C, GPTJForCausalLM as M",
        "vocab_size=96, n_embd=64, n_head=4, n_layer=2, n_positions=64, rotary_dim=8, n_inner=128",
    ),
    targets: &["q_proj", "v_proj", "fc_in", "fc_out"],
    matrices: 16,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (64 + 128) + (128 + 64)),
    ..OFF
};

/// CodeGen's blocked query-value-key matrix (PEFT's default target:
/// 64 -> 192) beside its MLP's output (128 -> 64).
const CODEGEN: Case = Case {
    python: (
        "from transformers import CodeGenConfig as C, CodeGenForCausalLM as M",
        "vocab_size=96, n_embd=64, n_head=8, n_layer=2, n_positions=64, rotary_dim=4, n_inner=128",
    ),
    targets: &["qkv_proj", "fc_out"],
    matrices: 8,
    elements: 2 * 4 * ((64 + 192) + (128 + 64)),
    ..OFF
};

/// GPT-BigCode's fused attention (PEFT's default target: 64 -> 96, the
/// queries and one key and value) beside both MLP matrices (64 -> 128,
/// 128 -> 64; `c_proj` names the attention's output too: 64 -> 64).
const GPT_BIGCODE: Case = Case {
    python: (
        "from transformers import GPTBigCodeConfig as C, GPTBigCodeForCausalLM as M",
        "vocab_size=96, n_embd=64, n_head=4, n_layer=2, n_positions=64, n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0",
    ),
    targets: &["c_attn", "c_proj", "c_fc"],
    matrices: 16,
    elements: 2 * 4 * ((64 + 96) + (64 + 64) + (128 + 64) + (64 + 128)),
    ..OFF
};

/// OPT under `model.decoder`: its queries and values (PEFT's default),
/// each 64 -> 64, and its MLP in the layer itself, `fc1` (64 -> 128).
const OPT: Case = Case {
    python: (
        "from transformers import OPTConfig as C, OPTForCausalLM as M",
        "vocab_size=96, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, dropout=0.0",
    ),
    targets: &["q_proj", "v_proj", "fc1"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (64 + 128)),
    ..OFF
};

/// OPT-350m's layout: its queries (64 -> 64) and, in the model's root,
/// the projections of its narrower embeddings in (32 -> 64) and out
/// (64 -> 32), which PEFT's `all-linear` adapts too.
const OPT_350M: Case = Case {
    python: (
        "from transformers import OPTConfig as C, OPTForCausalLM as M",
        "vocab_size=96, hidden_size=64, word_embed_proj_dim=32, do_layer_norm_before=False, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, dropout=0.0",
    ),
    targets: &["q_proj", "project_in", "project_out"],
    matrices: 8,
    elements: 2 * 4 * (64 + 64) + 2 * 4 * (32 + 64),
    ..OFF
};

/// GPT-Neo's queries and values (PEFT's default; under
/// `attn.attention`), each 64 -> 64, and its MLP's `c_proj` (128 -> 64).
const GPT_NEO: Case = Case {
    python: (
        "from transformers import GPTNeoConfig as C, GPTNeoForCausalLM as M",
        "vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64, intermediate_size=128, attention_types=[[['global', 'local'], 1]], window_size=5",
    ),
    targets: &["q_proj", "v_proj", "c_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (128 + 64)),
    ..OFF
};

/// MPT's fused attention (PEFT's default: 96 -> 288) and output (96 ->
/// 96), beside its MLP's up projection (96 -> 384).
const MPT: Case = Case {
    python: (
        "from transformers import MptConfig as C, MptForCausalLM as M",
        "vocab_size=96, d_model=96, n_heads=6, n_layers=2, max_seq_len=64",
    ),
    targets: &["Wqkv", "out_proj", "up_proj"],
    matrices: 12,
    elements: 2 * 4 * ((96 + 288) + (96 + 96) + (96 + 384)),
    ..OFF
};

/// BLOOM's fused attention (PEFT's default: 96 -> 288) beside its MLP's
/// output (384 -> 96).
const BLOOM: Case = Case {
    python: (
        "from transformers import BloomConfig as C, BloomForCausalLM as M",
        "vocab_size=96, hidden_size=96, n_layer=2, n_head=6",
    ),
    targets: &["query_key_value", "dense_4h_to_h"],
    matrices: 8,
    elements: 2 * 4 * ((96 + 288) + (384 + 96)),
    ..OFF
};

/// Persimmon's fused attention (zrt's default, PEFT having none: 64 ->
/// 192) beside its output (`dense`, 64 -> 64) and its MLP's input
/// (64 -> 128).
const PERSIMMON: Case = Case {
    python: (
        "from transformers import PersimmonConfig as C, PersimmonForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64",
    ),
    targets: &["query_key_value", "dense", "dense_h_to_4h"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 192) + (64 + 64) + (64 + 128)),
    ..OFF
};

/// BioGPT's queries and values (PEFT has no default; zrt's, Llama's
/// kin's), each 64 -> 64, and its MLP's `fc2` (128 -> 64).
const BIOGPT: Case = Case {
    python: (
        "from transformers import BioGptConfig as C, BioGptForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0",
    ),
    targets: &["q_proj", "v_proj", "fc2"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (128 + 64)),
    ..OFF
};

/// XGLM's queries and values (PEFT has no default; zrt's, Llama's
/// kin's), each 64 -> 64, and its MLP's `fc1` (64 -> 128).
const XGLM: Case = Case {
    python: (
        "from transformers import XGLMConfig as C, XGLMForCausalLM as M",
        "vocab_size=96, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0",
    ),
    targets: &["q_proj", "v_proj", "fc1"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (64 + 128)),
    ..OFF
};

/// CTRL's queries and values (PEFT has no default; zrt's, `Wq` and
/// `Wv`), each 64 -> 64, and its attention's output (`dense`, 64 -> 64).
const CTRL: Case = Case {
    python: (
        "from transformers import CTRLConfig as C, CTRLLMHeadModel as M",
        "vocab_size=96, n_embd=64, dff=128, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0",
    ),
    targets: &["Wq", "Wv", "dense"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (64 + 64)),
    ..OFF
};

/// OpenAI GPT's Conv1D matrices, as [`GPT2`]'s (PEFT has no default;
/// zrt's, GPT-2's `c_attn`): the fused query-key-value (64 -> 192), both
/// `c_proj` (64 -> 64, 256 -> 64), under norms after the residual sums.
const OPENAI_GPT: Case = Case {
    python: (
        "from transformers import OpenAIGPTConfig as C, OpenAIGPTLMHeadModel as M",
        "vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0",
    ),
    targets: &["c_attn", "c_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 192) + (64 + 64) + (256 + 64)),
    ..OFF
};

/// [`OPENAI_GPT`]'s adapters as DoRA's: a magnitude a row of each
/// Conv1D matrix, its file's columns (192, 64, 64).
const OPENAI_GPT_DORA: Case = Case {
    dora: true,
    matrices: 18,
    elements: 2 * 4 * ((64 + 192) + (64 + 64) + (256 + 64)) + 2 * (192 + 64 + 64),
    ..OPENAI_GPT
};

/// ModernBERT-decoder's queries and values (PEFT has no default; zrt's,
/// Llama's), each 64 -> 64, and its MLP's gated `Wi` (64 -> 96), in
/// three layers, the first without a norm before its attention.
const MODERNBERT_DECODER: Case = Case {
    python: (
        "from transformers import ModernBertDecoderConfig as C, ModernBertDecoderForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64, pad_token_id=95, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2",
    ),
    targets: &["q_proj", "v_proj", "Wi"],
    matrices: 18,
    elements: 3 * 4 * ((64 + 64) + (64 + 64) + (64 + 96)),
    ..OFF
};

/// RWKV's PEFT default targets, in both of a block's mixers: the time
/// mix's `key`, `value` and `receptance` (64 -> 48) and `output` (48 ->
/// 64), the channel mix's `key` (64 -> 128), `value` (128 -> 64) and
/// `receptance` (64 -> 64).
const RWKV: Case = Case {
    python: (
        "from transformers import RwkvConfig as C, RwkvForCausalLM as M",
        "vocab_size=96, hidden_size=64, attention_hidden_size=48, intermediate_size=128, num_hidden_layers=2, context_length=64, use_cache=False",
    ),
    targets: &["key", "value", "receptance", "output"],
    matrices: 28,
    elements: 2 * 4 * (3 * (64 + 48) + (48 + 64) + (64 + 128) + (128 + 64) + (64 + 64)),
    ..OFF
};

/// Zamba2's Mamba layers' projections (PEFT has no default; zrt's), the
/// hybrid layers' under `mamba_decoder` in PEFT's names.
const ZAMBA2: Case = Case {
    python: (
        common::ZAMBA2,
        "vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, layers_block_type=['mamba', 'hybrid', 'hybrid', 'mamba', 'hybrid'], num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, mamba_d_state=8, n_mamba_heads=8, chunk_size=16",
    ),
    targets: &["in_proj", "out_proj"],
    matrices: 20,
    elements: 5 * 4 * ((32 + 152) + (64 + 32)),
    ..OFF
};

/// The first Zamba's Mamba layers' projections (PEFT has no default;
/// zrt's), each layer split into two heads, its channels and gates
/// interleaved in `in_proj`'s output.
const ZAMBA: Case = Case {
    python: (
        common::ZAMBA,
        "vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, n_mamba_heads=2, mamba_d_state=8, attn_layer_period=2, attn_layer_offset=0, use_mamba_kernels=False",
    ),
    targets: &["in_proj", "out_proj"],
    matrices: 20,
    elements: 5 * 4 * ((32 + 128) + (64 + 32)),
    ..OFF
};

/// [`ZAMBA2`] with every linear layer adapted (`all-linear`), as PEFT
/// adapts them: the Mamba layers' projections (5 x 4 x (184 + 96)),
/// each hybrid layer's `linear` (3 x 4 x 64), each shared
/// block's projections once, under its first user's name, though two
/// layers use the first (2 x 4 x (3 x 128 + 96 + 160 + 96)), and the
/// hybrid layers' adapters on them, both linear layers of each (3 x 4 x
/// (6 x 68 + 36 + 132)). The adapter files hold a shared block's under
/// each user's name.
const ZAMBA2_ALL: Case = Case {
    targets: &["all-linear"],
    matrices: 2 * (10 + 3 + 12 + 24),
    elements: 5 * 4 * ((32 + 152) + (64 + 32))
        + 3 * 4 * 64
        + 2 * 4 * (3 * 128 + 96 + 160 + 96)
        + 3 * 4 * (6 * 68 + 36 + 132),
    ..ZAMBA2
};

/// [`ZAMBA2`]'s hybrid layers' Mamba layers' `in_proj` alone (2 x 4 x
/// (32 + 152)), named by a pattern on PEFT's names, under
/// `mamba_decoder`, one of the three excluded there too.
const ZAMBA2_PATTERN: Case = Case {
    targets: &[],
    pattern: Some(r"model\.layers\.\d+\.mamba_decoder\.mamba\.in_proj"),
    exclude: &["layers.2.mamba_decoder.mamba.in_proj"],
    matrices: 4,
    elements: 2 * 4 * (32 + 152),
    ..ZAMBA2
};

/// [`ZAMBA2_ALL`]'s adapters as DoRA's: a magnitude a row of each of
/// its 49 adapted layers (5 x (152 + 32) + 3 x 32 + 2 x (3 x 64 + 32 +
/// 128 + 32) + 3 x (3 x (4 + 64) + 4 + 128)), each started from its
/// matrix wherever the file holds it (a hybrid layer's Mamba layer under
/// `mamba_decoder`, a shared block under its first user).
const ZAMBA2_ALL_DORA: Case = Case {
    dora: true,
    matrices: ZAMBA2_ALL.matrices + 49,
    elements: ZAMBA2_ALL.elements
        + 5 * (152 + 32)
        + 3 * 32
        + 2 * (3 * 64 + 32 + 128 + 32)
        + 3 * (3 * (4 + 64) + 4 + 128),
    ..ZAMBA2_ALL
};

/// [`ZAMBA`] with every linear layer adapted (`all-linear`): its Mamba
/// layers' projections, its two hybrid layers' `linear` (2 x 4 x 64) and
/// the one shared block's projections once (4 x (128 + 3 x 96 + 3 x
/// 80)), as PEFT adapts them.
const ZAMBA_ALL: Case = Case {
    targets: &["all-linear"],
    matrices: 2 * (10 + 2 + 7),
    elements: ZAMBA.elements + 2 * 4 * 64 + 4 * (128 + 3 * 96 + 3 * 80),
    ..ZAMBA
};

/// xLSTM's mLSTM layers' queries (128 -> 64) and values (128 -> 128),
/// zrt's default (PEFT has none), and their output projections. Without
/// `use_cache`: `from_pretrained` leaves the model in eval mode, where
/// its class writes each layer's state into its cache in place, and
/// the reference's backward then fails. To 1e-3: its steps are chaotic
/// at the cases' learning rate (`tests/from_hf.rs`, `fp32_tolerance`):
/// its gradients move 1e-4 relative for a change of 1e-7 in the base's
/// weights (a head's small outputs through the per-head norm), so the
/// sums' rounding alone moves them, and AdamW's steps with them. The
/// first block's `out_proj` A ended 1.3e-4 from PEFT's with [`EPS`]
/// (2026-12-07, eighth session; before it, from 1.2e-6 to 5.5e-4 by
/// the CPU and the run).
const XLSTM: Case = Case {
    python: (
        common::XLSTM,
        "vocab_size=96, hidden_size=128, num_hidden_layers=2, num_heads=4, ffn_proj_factor=1.5, ffn_round_up_to_multiple_of=16, chunk_size=64, use_cache=False, pad_token_id=95, bos_token_id=None, eos_token_id=None",
    ),
    targets: &["q", "v", "out_proj"],
    matrices: 12,
    elements: 2 * 4 * ((128 + 64) + (128 + 128) + (128 + 128)),
    atol: Some(1e-3),
    ..OFF
};

/// Doge's queries and values (PEFT has no default; zrt's, Llama's),
/// 64 -> 64 and 64 -> 32, and its dynamic mask's `dt_proj` (32 -> 2),
/// whose gradient comes through each query's 6 keys of highest bias.
const DOGE: Case = Case {
    python: (
        common::DOGE,
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, keep_window_size=6",
    ),
    targets: &["q_proj", "v_proj", "dt_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 32) + (32 + 2)),
    ..OFF
};

/// PhiMoE's queries and values (PEFT has no default; zrt's, Llama's
/// kin's), 64 -> 64 and 64 -> 32, and each of its two experts' `w1`
/// (64 -> 32), weighted by sparsemixer at its default margin (at 0.3,
/// where more experts stay in play, one query's A ended 4.4e-6 from
/// PEFT's: which experts are in play jumps with the logits). Two
/// experts, so that each takes every token:
/// with four, one took none in a step, and zrt's AdamW moves an unused
/// expert by its momentum where `torch.optim.AdamW` skips a parameter
/// without a gradient (docs/choices.md).
const PHIMOE: Case = Case {
    python: (
        common::PHIMOE,
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=2, attention_bias=True",
    ),
    targets: &["q_proj", "v_proj", "w1"],
    matrices: 16,
    elements: 2 * 4 * ((64 + 64) + (64 + 32) + 2 * (64 + 32)),
    ..OFF
};

/// Granite 4.0-H's attending layer's queries (64 -> 64) and its two
/// Mamba layers' `in_proj` (64 -> 324: the gate, the convolved channels
/// and the heads' steps) and `out_proj` (128 -> 64).
const GRANITE4: Case = Case {
    python: (
        "from transformers import GraniteMoeHybridConfig as C, GraniteMoeHybridForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=5, layer_types=['mamba', 'attention', 'mamba']",
    ),
    targets: &["q_proj", "in_proj", "out_proj"],
    matrices: 10,
    elements: 4 * ((64 + 64) + 2 * (64 + 324) + 2 * (128 + 64)),
    ..OFF
};

/// Jamba's Mamba layers' `x_proj` (128 -> 20: the step's 4 and B's and
/// C's 8) and `dt_proj` (4 -> 128) in layers 0 and 2, and `gate_proj`
/// in both experts of those layers and in the dense MLPs of layers 1
/// and 3 (64 -> 32): two experts, so that every expert takes every
/// token (an expert without one is moved by zrt's AdamW's momentum,
/// skipped by torch's; docs/choices.md).
const JAMBA: Case = Case {
    python: (
        "from transformers import JambaConfig as C, JambaForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=2, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8, use_mamba_kernels=False",
    ),
    targets: &["x_proj", "dt_proj", "gate_proj"],
    matrices: 20,
    elements: 4 * (2 * (128 + 20) + 2 * (4 + 128) + 6 * (64 + 32)),
    ..OFF
};

/// Mamba's layers' `in_proj` (64 -> 256: the channels and their gate),
/// `x_proj` (128 -> 20), zrt's default for it (PEFT has none), and
/// `dt_proj` (4 -> 128), in both layers; the head tied.
const MAMBA: Case = Case {
    python: (
        "from transformers import MambaConfig as C, MambaForCausalLM as M",
        "vocab_size=96, hidden_size=64, num_hidden_layers=2, state_size=8",
    ),
    targets: &["in_proj", "x_proj", "dt_proj"],
    matrices: 12,
    elements: 4 * 2 * ((64 + 256) + (128 + 20) + (4 + 128)),
    ..OFF
};

/// Mamba-2's layers' `in_proj` (64 -> 128 + 192 + 8: the gate, the
/// convolved channels with two groups' B and C, each head's step), zrt's
/// default for it (PEFT has none), in both layers.
const MAMBA2: Case = Case {
    python: (
        "from transformers import Mamba2Config as C, Mamba2ForCausalLM as M",
        "vocab_size=96, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=5",
    ),
    targets: &["in_proj"],
    matrices: 4,
    elements: 4 * 2 * (64 + 328),
    ..OFF
};

/// Falcon-H1's queries (64 -> 64) and the `in_proj` of the Mamba layer
/// beside them (64 -> 96 + 160 + 6: the gate, the channels with two
/// groups' B and C, each head's step), in both layers; its µP
/// multipliers on.
const FALCON_H1: Case = Case {
    python: (
        "from transformers import FalconH1Config as C, FalconH1ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=5, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], key_multiplier=0.7, ssm_out_multiplier=0.6",
    ),
    targets: &["q_proj", "in_proj"],
    matrices: 8,
    elements: 4 * 2 * ((64 + 64) + (64 + 262)),
    ..OFF
};

/// LFM2's convolution layers' `in_proj` (64 -> 192: B, C and x), every
/// `out_proj` (the two convolutions' and the attention's, 64 -> 64) and
/// the MLPs' gates (`w1`, 64 -> 96), its convolutions biased.
const LFM2: Case = Case {
    python: (
        "from transformers import Lfm2Config as C, Lfm2ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=96, block_auto_adjust_ff_dim=False, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, conv_bias=True, layer_types=['conv', 'full_attention', 'conv']",
    ),
    targets: &["in_proj", "out_proj", "w1"],
    matrices: 16,
    elements: 4 * (2 * (64 + 192) + 3 * (64 + 64) + 3 * (64 + 96)),
    ..OFF
};

/// DiffLlama's queries (64 -> 64), values (64 -> 16: two groups) and
/// output projection (64 -> 64) around its differential attention.
const DIFFLLAMA: Case = Case {
    python: (
        "from transformers import DiffLlamaConfig as C, DiffLlamaForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64",
    ),
    targets: &["q_proj", "v_proj", "o_proj"],
    matrices: 12,
    elements: 4 * 2 * ((64 + 64) + (64 + 16) + (64 + 64)),
    ..OFF
};

/// BitNet trained ternary (its linear layers `transformers`'
/// `AutoBitLinear` in online mode): adapters on the queries (64 -> 64),
/// the output projection after the attention's sub norm (64 -> 64) and
/// `down_proj` after the MLP's (160 -> 64), reading their inputs
/// unrounded beside the rounded base, as PEFT's do.
const BITNET_TERNARY: Case = Case {
    python: (
        common::BITNET_TERNARY,
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, quantization_config={'quant_method': 'bitnet', 'linear_class': 'autobitlinear', 'quantization_mode': 'online'}",
    ),
    targets: &["q_proj", "o_proj", "down_proj"],
    matrices: 12,
    elements: 2 * 4 * ((64 + 64) + (64 + 64) + (160 + 64)),
    ..OFF
};

/// The same with an RMS norm before each base layer's rounding
/// (`use_rms_norm`): frozen with the base, the adapters reading the
/// input unnormalised, as PEFT's beside an `AutoBitLinear` do.
const BITNET_TERNARY_NORMED: Case = Case {
    python: (
        common::BITNET_TERNARY,
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, quantization_config={'quant_method': 'bitnet', 'linear_class': 'autobitlinear', 'quantization_mode': 'online', 'use_rms_norm': True}",
    ),
    ..BITNET_TERNARY
};

/// Qwen3-Next's DeltaNet layers' `in_proj_qkvz` (64 -> 128: queries,
/// keys, values and gates), `in_proj_ba` (64 -> 8) and `out_proj` (48 ->
/// 64), and the gated attention's `q_proj` (64 -> 128: queries and
/// gates) between them.
const QWEN3_NEXT: Case = Case {
    python: (
        "from transformers import Qwen3NextConfig as C, Qwen3NextForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, layer_types=['linear_attention', 'full_attention', 'linear_attention']",
    ),
    targets: &["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj"],
    matrices: 14,
    elements: 4 * (2 * (64 + 128) + 2 * (64 + 8) + 2 * (48 + 64) + (64 + 128)),
    ..OFF
};

/// RecurrentGemma's default targets: its recurrent layers' `linear_x`
/// and `linear_y` (64 -> 48 each, two layers) and its attending layer's
/// `q_proj` (64 -> 64) and `v_proj` (64 -> 16, one key-value head).
const RECURRENT_GEMMA: Case = Case {
    python: (
        common::RECURRENT_GEMMA,
        "vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, lru_width=48, conv1d_width=3, attention_window_size=32, use_cache=False",
    ),
    targets: &["q_proj", "v_proj", "linear_x", "linear_y"],
    matrices: 12,
    elements: 4 * (4 * (64 + 48) + (64 + 64) + (64 + 16)),
    ..OFF
};

/// MiniMax's lightning layer's `qkv_proj` (64 -> 192) and
/// `output_gate` (64 -> 64), and the queries of the two softmax layers
/// around it (64 -> 64); its residual factors on.
const MINIMAX: Case = Case {
    python: (
        "from transformers import MiniMaxConfig as C, MiniMaxForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, block_size=5, linear_attn_alpha_factor=1.3, mlp_beta_factor=0.9",
    ),
    targets: &["qkv_proj", "output_gate", "q_proj"],
    matrices: 8,
    elements: 4 * ((64 + 192) + (64 + 64) + 2 * (64 + 64)),
    ..OFF
};

/// GPT-OSS's stacked experts (`target_parameters`, PEFT's nesting of two
/// on one module), the queries beside them: `gate_up_proj` `[4, 64, 64]`
/// (A `[16, 64]`, B `[64, 16]`), `down_proj` `[4, 32, 64]` at rank 2 (A
/// `[8, 32]`, B `[64, 8]`), q 64 -> 64.
const GPT_OSS: Case = Case {
    python: (
        "from transformers import GptOssConfig as C, GptOssForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=5",
    ),
    targets: &["q_proj"],
    parameters: &["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    ranks: &[("down_proj", 2)],
    matrices: 12,
    elements: 2 * ((4 * 64 + 64 * 4) + (16 * 64 + 64 * 16) + (8 * 32 + 64 * 8)),
    ..OFF
};

/// Llama 4's stacked experts (on layers 1 and 3 of 4; the gate's
/// columns then the up's, each token's input scaled): `gate_up_proj`
/// `[4, 64, 64]` (A `[16, 64]`, B `[64, 16]`), `down_proj` `[4, 32, 64]`
/// (A `[16, 32]`, B `[64, 16]`), beside every layer's queries (PEFT
/// adds the update into the weight before multiplying, zrt multiplies
/// by the factors).
const LLAMA4: Case = Case {
    python: (
        "from transformers import Llama4TextConfig as C, Llama4ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=5, floor_scale=4, attn_scale=0.5",
    ),
    targets: &["q_proj"],
    parameters: &["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],
    matrices: 16,
    elements: 4 * (4 * 64 + 64 * 4) + 2 * ((16 * 64 + 64 * 16) + (16 * 32 + 64 * 16)),
    ..OFF
};

/// Aria's stacked experts, Llama 4's layout with each matrix a module
/// of its own (one `weight` each, so no nesting): `fc1.weight` `[4, 64,
/// 64]` (A `[16, 64]`, B `[64, 16]`), `fc2.weight` `[4, 32, 64]` (A `[16,
/// 32]`, B `[64, 16]`), beside the queries; the shared MLP (whose names
/// the patterns miss) untouched.
const ARIA_TEXT: Case = Case {
    python: (
        "from transformers import AriaTextConfig as C, AriaTextForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1",
    ),
    targets: &["q_proj"],
    parameters: &["mlp.experts.fc1.weight", "mlp.experts.fc2.weight"],
    matrices: 12,
    elements: 2 * ((4 * 64 + 64 * 4) + (16 * 64 + 64 * 16) + (16 * 32 + 64 * 16)),
    ..OFF
};

/// Granite-MoE's stacked experts, linear layers' `[out, in]` each:
/// `input_linear.weight` `[4, 64, 64]` (A `[16, 64]`, B `[64, 16]`),
/// `output_linear.weight` `[4, 64, 32]` (A `[16, 64]`, B `[32, 16]`),
/// beside the queries, under its multipliers (12 on the embeddings).
const GRANITE_MOE: Case = Case {
    python: (
        "from transformers import GraniteMoeConfig as C, GraniteMoeForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0, num_local_experts=4, num_experts_per_tok=2",
    ),
    targets: &["q_proj"],
    parameters: &["input_linear.weight", "output_linear.weight"],
    matrices: 12,
    elements: 2 * ((4 * 64 + 64 * 4) + (16 * 64 + 64 * 16) + (16 * 64 + 32 * 16)),
    ..OFF
};

/// JetMoE's `kv_proj` (64 -> 64: keys and values) and, by the names
/// Granite-MoE's experts have, both its attention experts' matrices
/// (`input_linear.weight` `[4, 32, 64]`, `output_linear.weight` `[4, 64,
/// 32]`) and its MLP experts' (`[4, 96, 64]`, `[4, 64, 48]`), as PEFT
/// adapts every parameter a name matches.
const JETMOE: Case = Case {
    python: (
        "from transformers import JetMoeConfig as C, JetMoeForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64",
    ),
    targets: &["kv_proj"],
    parameters: &["input_linear.weight", "output_linear.weight"],
    matrices: 20,
    elements: 2 * (4 * (64 + 64) + 16 * ((32 + 64) + (64 + 32) + (96 + 64) + (64 + 48))),
    ..OFF
};

/// The case's seeded model, as the parity tests build it, in `dir/hf`;
/// and each step's and rank's tokens in `dir/tokens.safetensors` (each
/// step's the same, so that the loss falls as the adapters learn them).
fn checkpoint(dir: &Path, case: &Case) {
    let (import, args) = case.python;
    let model = common::hf_seeded_model(import, args, dir, r#", max_shard_size="100KB""#);
    common::python(&format!(
        r#"{model}
tokens = torch.randint(0, 96, (1, 2, {MICRO}, {SEQ})).repeat({STEPS}, 1, 1, 1)
save_file({{"tokens": tokens}}, "{dir}/tokens.safetensors")
"#,
        dir = dir.display()
    ));
}

/// PEFT from zrt's initial adapters in `init` (checked to be what it
/// loaded), AdamW as the engine's on the two ranks' batches: each step's
/// loss on each rank, a line a step, then the trained model's on the
/// first step's batches; then `ok` when its trained adapters are the
/// ones zrt wrote to `tuned` (to `atol`, and 1e-4 relative) and
/// `tuned-merged` holds PEFT's `merge_and_unload` of them. The element
/// closest to that bound goes to the margins, as `what`'s.
fn peft_run(
    dir: &Path,
    case: &Case,
    (init, tuned): (&Path, &Path),
    atol: f64,
    what: &str,
) -> Vec<Vec<f64>> {
    let script = format!(
        r#"
import torch
# One intra-op thread, as zrt's side runs: the sums' order then stays
# the same however busy the machine is (AdamW carries their rounding).
torch.set_num_threads(1)
{import}
from peft import PeftModel, get_peft_model_state_dict
# What PEFT writes to its file, by the file's names (without the copies
# of adapted embeddings' and heads' matrices it writes by default).
named = lambda m: get_peft_model_state_dict(m, save_embedding_layers=False)
from safetensors.torch import load_file
tokens = load_file("{dir}/tokens.safetensors")["tokens"]
base = M.from_pretrained("{dir}/hf")
m = PeftModel.from_pretrained(base, "{init}", is_trainable=True)
mine = named(m)
file = load_file("{init}/adapter_model.safetensors")
cfg = m.peft_config["default"]
if cfg.use_dora or cfg.trainable_token_indices:
    # Its own start from the same base: zrt's DoRA magnitudes and
    # trainable tokens' rows.
    from peft import get_peft_model, LoraConfig
    own = named(get_peft_model(M.from_pretrained("{dir}/hf"), LoraConfig.from_pretrained("{init}")))
    for k in (k for k in file if "magnitude" in k or "trainable_tokens" in k):
        # (A bf16 run's file holds them in bf16: to its rounding.)
        rtol = 1e-2 if file[k].dtype == torch.bfloat16 else 0
        theirs = file[k].to(own[k].dtype)
        assert torch.allclose(own[k], theirs, rtol=rtol, atol=1e-6), (k, (own[k] - theirs).abs().max())
assert sorted(mine) == sorted(file), (sorted(mine), sorted(file))
for k, v in file.items():
    assert torch.equal(mine[k], v.to(mine[k].dtype)), k
trains = sorted(n for n, p in m.named_parameters() if p.requires_grad)
assert trains and all("lora_" in n or "modules_to_save" in n or "trainable_tokens" in n or (cfg.bias == "all" and "bias" in n) for n in trains), trains
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr={LR}, weight_decay={WD}, eps={EPS})
for s in range({STEPS}):
    out = [m(input_ids=tokens[s, r], labels=tokens[s, r]) for r in range(2)]
    print(*(o.loss.item() for o in out))
    opt.zero_grad()
    (sum(o.loss for o in out) / 2).backward()
    opt.step()
with torch.no_grad():
    print(*(m(input_ids=tokens[0, r], labels=tokens[0, r]).loss.item() for r in range(2)))
# PEFT's own adapter directory, for zrt to load and merge.
m.save_pretrained("{tuned}-peft")
mine = named(m)
theirs = load_file("{tuned}/adapter_model.safetensors")
assert sorted(mine) == sorted(theirs)
# The element closest to its bound (allclose's), for the margins.
closest = (0.0, 1.0, "")
for k, v in theirs.items():
    v = v.to(mine[k].dtype)
    apart, bound = (mine[k] - v).abs().flatten(), ({atol} + 1e-4 * v.abs()).flatten()
    i = (apart / bound).argmax()
    if apart[i] / bound[i] > closest[0] / closest[1]:
        closest = (apart[i].item(), bound[i].item(), k)
    assert torch.allclose(mine[k], v, rtol=1e-4, atol={atol}), (k, (mine[k] - v).abs().max().item())
merged, info = M.from_pretrained("{tuned}-merged", output_loading_info=True)
assert not any(info.values()), info
merged = merged.state_dict()
want = PeftModel.from_pretrained(M.from_pretrained("{dir}/hf"), "{tuned}").merge_and_unload().state_dict()
assert sorted(merged) == sorted(want)
for k in want:
    assert torch.allclose(merged[k], want[k], rtol=0, atol=1e-6), (k, (merged[k] - want[k]).abs().max())
print(*closest)
print("ok")
"#,
        import = case.python.0,
        atol = atol,
        dir = dir.display(),
        init = init.display(),
        tuned = tuned.display(),
    );
    let out = common::python(&script);
    let mut lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.pop(), Some("ok"), "{out}");
    let closest: Vec<&str> = (lines.pop().unwrap_or_default().split_whitespace()).collect();
    if let [apart, bound, name] = closest[..] {
        let how = format!("{what}: trained `{name}`");
        common::margin(&how, apart.parse().unwrap(), bound.parse().unwrap());
    }
    (lines.iter())
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect()
}

#[test]
fn lora_adapters_on_a_frozen_llama_train_as_peft_does_and_load_in_peft() {
    // Stage 3 also with every layer recomputed in backward.
    // And in bf16 (the frozen base held in bf16 too), and with the base's
    // shards held as int8 (`zero_quantized_nontrainable_weights`), against
    // PEFT in fp32: to their rounding.
    let runs = [
        (2, false, Held::Fp32),
        (3, false, Held::Fp32),
        (3, true, Held::Fp32),
        (3, false, Held::Bf16),
        (3, false, Held::Int8Base),
    ];
    parity("llama", &LLAMA, &runs);
}

#[test]
fn modules_saved_whole_train_beside_the_adapters_as_peft_trains_them() {
    // A head and a norm at stage 2; a tied embedding (the head too) at
    // stage 3, recomputing every layer. (One run a case: each is a
    // PyTorch process, and CI's time is bounded.)
    parity("llama-saved", &LLAMA_SAVED, &[(2, false, Held::Fp32)]);
    parity(
        "llama-tied-saved",
        &LLAMA_TIED_SAVED,
        &[(3, true, Held::Fp32)],
    );
}

#[test]
fn adapters_on_the_embedding_and_head_train_as_peft_trains_them() {
    // A Llama's embedding and head at stage 3, recomputing; GPT-2's tied
    // `wte`: the lookup adapted, the head the base's matrix.
    parity("llama-ends", &LLAMA_ENDS, &[(3, true, Held::Fp32)]);
    let gpt2 = Case {
        targets: &["c_attn", "wte"],
        matrices: 6,
        elements: 2 * 4 * (64 + 192) + 4 * 96 + 64 * 4,
        ..GPT2
    };
    parity("gpt2-wte", &gpt2, &[(3, false, Held::Fp32)]);
}

#[test]
fn targets_given_as_patterns_and_exclusions_train_as_peft_trains_them() {
    // Unsloth's way of naming them, one layer's query projection left
    // out: 10 of LLAMA's 12 matrices.
    let llama = Case {
        targets: &[],
        pattern: Some(r"model\.layers\.\d+\.(self_attn|mlp)\.(q_proj|v_proj|down_proj)"),
        exclude: &["layers.1.self_attn.q_proj"],
        matrices: 10,
        elements: LLAMA.elements - 2 * 4 * 64,
        ..LLAMA
    };
    parity("llama-pattern", &llama, &[(3, false, Held::Fp32)]);
    // GPT-2's names under `transformer.`, which the pattern matches.
    let gpt2 = Case {
        targets: &[],
        pattern: Some(r"transformer\.h\.\d+\.attn\.c_attn"),
        matrices: 4,
        elements: 2 * 4 * (64 + 192),
        ..GPT2
    };
    parity("gpt2-pattern", &gpt2, &[(3, false, Held::Fp32)]);
}

#[test]
fn adapters_on_some_layers_with_ranks_of_their_own_train_as_peft_trains_them() {
    // LLAMA's targets on its second layer only; the first key matching a
    // module gives its rank (v_proj 2, though the second names it too;
    // in sorted order, as PEFT's `save_pretrained` writes keys sorted),
    // down_proj its own alpha: q 8 x (64 + 64), v 2 x (64 + 32), down 4
    // x (160 + 64).
    let llama = Case {
        layers: &[1],
        ranks: &[(r"layers\.1\.self_attn\.v_proj", 2), (r"self_attn\..*", 8)],
        alphas: &[("down_proj", 8.0)],
        matrices: 6,
        elements: 8 * (64 + 64) + 2 * (64 + 32) + 4 * (160 + 64),
        ..LLAMA
    };
    parity("llama-layers", &llama, &[(3, false, Held::Fp32)]);
}

#[test]
fn biases_trained_with_the_adapters_train_as_peft_trains_them() {
    // PEFT's `bias = "all"` on Phi-2's layout, whose projections, norms
    // and head are biased: per layer q, k, v, dense (64 each), fc1 (256),
    // fc2 (64), the norm (64); the final norm (64), the head (96). The
    // adapted layers' biases are `...base_layer.bias` in the file.
    let phi = Case {
        biases: true,
        whole: 16,
        elements: PHI.elements + 2 * (4 * 64 + 256 + 64 + 64) + 64 + 96,
        ..PHI
    };
    parity("phi-biases", &phi, &[(3, false, Held::Fp32)]);
}

#[test]
fn adapters_whose_b_has_a_bias_train_and_merge_as_peft_does() {
    // PEFT's `lora_bias` on Phi-2's biased projections (q, dense, fc2:
    // 64 each a layer), merged into the base's biases. To 2e-5: on an
    // Intel Xeon the last layer's fc2 A ends 9.0e-6 from PEFT's (within
    // 1e-6 on an AMD EPYC). A gets no gradient while B is zero, then
    // small ones, which AdamW's steps of up to the learning rate carry
    // with their rounding.
    let phi = Case {
        lora_bias: true,
        matrices: 18,
        elements: PHI.elements + 2 * 3 * 64,
        ..PHI
    };
    parity("phi-lora-bias", &phi, &[(3, false, Held::Fp32)]);
    // GPT-2's Conv1D layers (c_attn 64 -> 192, c_fc 64 -> 256, the
    // c_projs 64 -> 64 and 256 -> 64); the keys' third of c_attn's B's
    // bias has no gradient but rounding noise (see [`EPS`]).
    let gpt2 = Case {
        targets: &["c_attn", "c_fc", "c_proj"],
        lora_bias: true,
        matrices: 24,
        elements: 2 * 4 * ((64 + 192) + (64 + 256) + (64 + 64) + (256 + 64))
            + 2 * (192 + 256 + 64 + 64),
        ..GPT2
    };
    parity("gpt2-lora-bias", &gpt2, &[(2, false, Held::Fp32)]);
    // Every bias trained too (`bias = "all"`): B's bias merges into the
    // trained one. The key projections' biases train on rounding noise
    // (see [`EPS`]).
    let both = Case {
        biases: true,
        whole: 16,
        elements: phi.elements + 2 * (4 * 64 + 256 + 64 + 64) + 64 + 96,
        ..phi
    };
    parity("phi-lora-bias-all", &both, &[(2, false, Held::Fp32)]);
}

#[test]
fn trainable_tokens_train_as_peft_trains_them() {
    // An untied Llama (the rows change the lookup) at stage 2, a tied one
    // (and the head's logits) at stage 3 recomputing; GPT-2's tied `wte`.
    parity("llama-tokens", &LLAMA_TOKENS, &[(2, false, Held::Fp32)]);
    parity(
        "llama-tied-tokens",
        &LLAMA_TIED_TOKENS,
        &[(3, true, Held::Fp32)],
    );
    // GPT-2's in PEFT's dict form, naming its embedding.
    let gpt2 = Case {
        token_modules: &[("wte", &[3, 7])],
        matrices: 13,
        elements: GPT2.elements + 2 * 64,
        ..GPT2
    };
    parity("gpt2-tokens", &gpt2, &[(3, false, Held::Fp32)]);
    // The untied Llama's head too, its own tokens' rows (PEFT's dict form
    // naming both ends): their logits come from the trained rows.
    let llama = Case {
        tokens: &[],
        token_modules: &[("embed_tokens", &[3, 7, 5]), ("lm_head", &[7, 9])],
        matrices: 14,
        elements: LLAMA.elements + 3 * 64 + 2 * 64,
        ..LLAMA_TOKENS
    };
    parity("llama-head-tokens", &llama, &[(3, false, Held::Fp32)]);
}

#[test]
fn dora_adapters_on_a_frozen_llama_and_gpt2_train_as_peft_does() {
    // Their magnitudes start at PEFT's own (the base's row norms, read
    // from its files while built), at stage 2, at stage 3 recomputing
    // every layer, and in bf16 (to its rounding); GPT-2's Conv1D matrices are
    // `[in, out]` in the file.
    parity(
        "llama-dora",
        &LLAMA_DORA,
        &[
            (2, false, Held::Fp32),
            (3, true, Held::Fp32),
            (3, false, Held::Bf16),
        ],
    );
    parity("gpt2-dora", &GPT2_DORA, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_gpt2_gpt_neox_phi_cohere_and_apertus_train_as_peft_does() {
    parity("gpt2", &GPT2, &[(3, false, Held::Fp32)]);
    parity("gpt-neox", &GPT_NEOX, &[(3, false, Held::Fp32)]);
    parity("phi", &PHI, &[(3, false, Held::Fp32)]);
    parity("cohere", &COHERE, &[(3, false, Held::Fp32)]);
    parity("apertus", &APERTUS, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_deepseek_v3s_latent_attention_train_as_peft_does() {
    parity("deepseek-v3", &DEEPSEEK, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_longcat_flashs_sublayers_and_experts_train_as_peft_does() {
    parity("longcat-flash", &LONGCAT_FLASH, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_gpt_neox_japaneses_fused_attention_train_as_peft_does() {
    parity(
        "gpt-neox-japanese",
        &GPT_NEOX_JAPANESE,
        &[(3, false, Held::Fp32)],
    );
}

#[test]
fn lora_adapters_on_dbrxs_fused_attention_and_router_train_as_peft_does() {
    parity("dbrx", &DBRX, &[(3, false, Held::Fp32)]);
}

/// DBRX's case training with its routers' load-balancing loss (weight
/// 0.5): its gradient reaches the adapters on the routers, and through
/// the routers' input, the attention's; recomputed at stage 3 too.
const DBRX_BALANCED: Case = Case {
    python: (
        "from transformers import DbrxConfig as C, DbrxForCausalLM as M",
        "vocab_size=96, d_model=64, n_heads=4, n_layers=2, max_seq_len=64, attn_config={'kv_n_heads': 2, 'clip_qkv': 8.0}, ffn_config={'ffn_hidden_size': 32, 'moe_num_experts': 4, 'moe_top_k': 2, 'moe_loss_weight': 0.5}, output_router_logits=True",
    ),
    ..DBRX
};

#[test]
fn lora_adapters_on_dbrx_train_with_its_routers_load_balancing_loss_as_peft_does() {
    parity(
        "dbrx-balanced",
        &DBRX_BALANCED,
        &[(0, false, Held::Fp32), (3, true, Held::Fp32)],
    );
}

#[test]
fn lora_adapters_on_falcons_grouped_attention_and_mlp_train_as_peft_does() {
    parity("falcon", &FALCON, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_gptjs_and_codegens_parallel_layers_train_as_peft_does() {
    parity("gptj", &GPTJ, &[(3, false, Held::Fp32)]);
    parity("codegen", &CODEGEN, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_gpt_bigcodes_fused_attention_and_mlp_train_as_peft_does() {
    parity("gpt-bigcode", &GPT_BIGCODE, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_opts_decoder_and_opt_350ms_projections_train_as_peft_does() {
    parity("opt", &OPT, &[(3, false, Held::Fp32)]);
    parity("opt-350m", &OPT_350M, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_biogpts_xglms_and_ctrls_layers_train_as_peft_does() {
    parity("biogpt", &BIOGPT, &[(3, false, Held::Fp32)]);
    parity("xglm", &XGLM, &[(3, false, Held::Fp32)]);
    parity("ctrl", &CTRL, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_modernbert_decoders_attention_and_gated_mlp_train_as_peft_does() {
    parity(
        "modernbert-decoder",
        &MODERNBERT_DECODER,
        &[(3, false, Held::Fp32)],
    );
}

#[test]
fn lora_adapters_on_zamba2s_mamba_layers_train_as_peft_does() {
    parity("zamba2", &ZAMBA2, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_zambas_headed_mamba_layers_train_as_peft_does() {
    parity("zamba", &ZAMBA, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_on_every_linear_layer_of_a_zamba_adapts_its_shared_blocks_once_as_peft_does() {
    // A shared block's adapters are one set of tensors, whichever layer
    // runs it: two users' gradients sum into them, and the files hold
    // them under each user's name (the first Zamba's base under its last
    // user's, as `save_pretrained` writes it).
    parity("zamba2-all", &ZAMBA2_ALL, &[(3, false, Held::Fp32)]);
    parity("zamba-all", &ZAMBA_ALL, &[(2, false, Held::Fp32)]);
    parity(
        "zamba2-all-dora",
        &ZAMBA2_ALL_DORA,
        &[(3, false, Held::Fp32)],
    );
    // A pattern and an exclusion naming a hybrid layer's Mamba layer as
    // PEFT names it.
    parity("zamba2-pattern", &ZAMBA2_PATTERN, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_xlstms_mlstm_layers_train_as_peft_does() {
    parity("xlstm", &XLSTM, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_rwkvs_time_and_channel_mixes_train_as_peft_does() {
    parity("rwkv", &RWKV, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_doges_attention_and_dynamic_mask_train_as_peft_does() {
    parity("doge", &DOGE, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_and_dora_adapters_on_openai_gpts_conv1d_matrices_train_and_merge_as_peft_does() {
    parity("openai-gpt", &OPENAI_GPT, &[(3, false, Held::Fp32)]);
    parity(
        "openai-gpt-dora",
        &OPENAI_GPT_DORA,
        &[(3, false, Held::Fp32)],
    );
}

#[test]
fn lora_adapters_on_gpt_neos_local_layers_train_as_peft_does() {
    parity("gpt-neo", &GPT_NEO, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_mpts_and_blooms_alibi_attention_train_as_peft_does() {
    parity("mpt", &MPT, &[(3, false, Held::Fp32)]);
    parity("bloom", &BLOOM, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_granite_4s_attention_and_mamba_layers_train_as_peft_does() {
    parity("granite4", &GRANITE4, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_jambas_selective_scan_and_experts_train_as_peft_does() {
    parity("jamba", &JAMBA, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_mambas_projections_train_as_peft_does() {
    parity("mamba", &MAMBA, &[(3, false, Held::Fp32)]);
    parity("mamba2", &MAMBA2, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_falcon_h1s_attention_and_mamba_train_as_peft_does() {
    parity("falcon-h1", &FALCON_H1, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_lfm2s_convolutions_attention_and_mlp_train_as_peft_does() {
    parity("lfm2", &LFM2, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_minimaxs_lightning_and_softmax_attention_train_as_peft_does() {
    parity("minimax", &MINIMAX, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_diffllamas_differential_attention_train_as_peft_does() {
    parity("diffllama", &DIFFLLAMA, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_a_ternary_bitnet_train_as_peft_does() {
    parity("bitnet-ternary", &BITNET_TERNARY, &[(3, false, Held::Fp32)]);
    parity(
        "bitnet-ternary-normed",
        &BITNET_TERNARY_NORMED,
        &[(3, false, Held::Fp32)],
    );
}

#[test]
fn lora_adapters_on_recurrent_gemmas_recurrences_and_attention_train_as_peft_does() {
    parity(
        "recurrent-gemma",
        &RECURRENT_GEMMA,
        &[(3, false, Held::Fp32)],
    );
}

#[test]
fn lora_adapters_on_qwen3_nexts_delta_nets_and_gated_attention_train_as_peft_does() {
    parity("qwen3-next", &QWEN3_NEXT, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_phimoes_attention_and_experts_train_as_peft_does() {
    parity("phimoe", &PHIMOE, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_persimmons_fused_attention_and_mlp_train_as_peft_does() {
    parity("persimmon", &PERSIMMON, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_jetmoes_attention_and_mlp_experts_train_as_peft_does() {
    parity("jetmoe-experts", &JETMOE, &[(3, false, Held::Fp32)]);
}

#[test]
fn lora_adapters_on_stacked_experts_train_as_peft_does() {
    // PEFT's `target_parameters`: GPT-OSS's two matrices on one module
    // (nested names; one at a rank of its own), at stage 3 and with
    // every layer recomputed, and in bf16; Granite-MoE's, transposed.
    parity(
        "gpt-oss-experts",
        &GPT_OSS,
        &[
            (3, false, Held::Fp32),
            (3, true, Held::Fp32),
            (3, false, Held::Bf16),
        ],
    );
    parity(
        "granitemoe-experts",
        &GRANITE_MOE,
        &[(3, false, Held::Fp32)],
    );
    parity("llama4-experts", &LLAMA4, &[(3, false, Held::Fp32)]);
    parity("aria-text-experts", &ARIA_TEXT, &[(3, false, Held::Fp32)]);
    // Granite-MoE-shared's shared MLP's matrices end as its experts'
    // do: a name matching both is refused (PEFT would adapt both).
    let dir = scratch("lora-granitemoeshared-experts");
    let args = GRANITE_MOE.python.1.replace(
        "intermediate_size=32,",
        "intermediate_size=32, shared_intermediate_size=48,",
    );
    common::write_seeded_model(
        "from transformers import GraniteMoeSharedConfig as C, GraniteMoeSharedForCausalLM as M",
        &args,
        &dir,
    );
    let on = |param: &str| {
        let lora = LoraConfig {
            target_parameters: vec![param.into()],
            ..LoraConfig::new(2, 4.0, &["q_proj"])
        };
        built_with(&dir.join("hf"), lora)
    };
    assert_eq!(on("block_sparse_moe.input_linear.weight"), "");
    let both = on("input_linear.weight");
    assert!(
        both.contains(
            "names `model.layers.0.shared_mlp.input_linear.weight`, a 2-dimensional parameter"
        ),
        "{both}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// How a parity run holds the model.
#[derive(Debug, Clone, Copy)]
enum Held {
    Fp32,
    /// bf16 training, the frozen base in bf16 too.
    Bf16,
    /// fp32 training, the frozen base's stage-3 shards as int8.
    Int8Base,
}

/// The case's adapters trained on 2 ranks at each of `runs` (stage,
/// recompute, how held) against PEFT's (see the module's doc).
fn parity(name: &str, case: &Case, runs: &[(u8, bool, Held)]) {
    let dir = scratch(&format!("lora-{name}"));
    checkpoint(&dir, case);
    let hf = dir.join("hf");
    let tokens = Tensor::read_safetensors(dir.join("tokens.safetensors")).unwrap();
    let tokens = &tokens[0].1;
    // Tensors do not cross threads: each step's and rank's tokens.
    let batches: Vec<Vec<Vec<i64>>> = (0..STEPS as i64)
        .map(|s| {
            (0..2)
                .map(|r| Vec::try_from(tokens.get(s).get(r).flatten(0, -1)).unwrap())
                .collect()
        })
        .collect();
    let lora = LoraConfig {
        use_dora: case.dora,
        modules_to_save: case.saved.iter().map(|m| m.to_string()).collect(),
        ensure_weight_tying: !case.saved.is_empty(),
        trainable_token_indices: case.tokens.to_vec(),
        trainable_tokens_modules: (case.token_modules.iter())
            .map(|&(m, ids)| (m.to_string(), ids.to_vec()))
            .collect(),
        train_biases: case.biases,
        lora_bias: case.lora_bias,
        target_pattern: case.pattern.map(String::from),
        exclude_modules: case.exclude.iter().map(|m| m.to_string()).collect(),
        layers_to_transform: case.layers.to_vec(),
        rank_pattern: (case.ranks.iter()).map(|&(k, r)| (k.into(), r)).collect(),
        alpha_pattern: (case.alphas.iter()).map(|&(k, a)| (k.into(), a)).collect(),
        target_parameters: case.parameters.iter().map(|p| p.to_string()).collect(),
        ..LoraConfig::new(4, 16.0, case.targets)
    };
    for &(stage, recompute, held) in runs {
        let what = format!("{name} at stage {stage}, recompute {recompute}, {held:?}");
        // Losses to float rounding, or to bf16's; adapters likewise, in
        // bf16 to twice the steps' learning rate (an update whose gradient
        // bf16 rounds through zero may go the other way: PEFT's is fp32).
        let rounded = (2e-2, 2.0 * STEPS as f64 * LR);
        let int8 = format!(r#"{SHARD_ALL} "zero_quantized_nontrainable_weights": true,"#);
        let ((tol, atol), extra, zero): ((f64, f64), &str, &str) = match held {
            Held::Fp32 => ((1e-5, case.atol.unwrap_or(ADAPTERS)), "", SHARD_ALL),
            Held::Bf16 => (rounded, common::BF16, SHARD_ALL),
            Held::Int8Base => (rounded, "", &int8),
        };
        let run = format!("{stage}{recompute}{held:?}");
        let options = HfOptions {
            lora: Some(lora.clone()),
            checkpoint_activations: recompute,
        };
        let (init, tuned) = (
            dir.join(format!("init{run}")),
            dir.join(format!("tuned{run}")),
        );
        let eps = format!(r#", "eps": {EPS}"#);
        let ds = common::config_params("AdamW", &eps, stage, 1, 0.0, extra, zero);
        let got = on_ranks(2, |r| {
            let vs = VarStore::new(tch::Device::Cpu);
            let plan = ShardPlan::new();
            // Each rank draws adapters of its own: rank 0's must win.
            let (model, layout) = common::seeded(|| {
                tch::manual_seed(10 + r.rank() as i64);
                HfModel::from_pretrained_with(&vs, &plan, &hf, &options).unwrap()
            });
            let mut held: Vec<(String, bool)> = (vs.variables().into_iter())
                .map(|(n, t)| (n, zrt::zero::glue::storage_nbytes(&t).unwrap() > 0))
                .collect();
            held.sort();
            let group = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &ds, group, &AutoHints::default()).unwrap();
            std::fs::create_dir_all(&init).unwrap();
            e.save_16bit_model_as(init.join("adapter_model.safetensors"), None, &layout)
                .unwrap();
            let rank = r.rank();
            let batch = |s: usize| Tensor::from_slice(&batches[s][rank]).view([MICRO, SEQ]);
            let losses: Vec<f64> = (0..STEPS)
                .map(|s| {
                    let loss = model.loss(&batch(s));
                    e.backward(&loss).unwrap();
                    e.step().unwrap();
                    loss.double_value(&[])
                })
                .collect();
            std::fs::create_dir_all(&tuned).unwrap();
            e.save_16bit_model_as(tuned.join("adapter_model.safetensors"), None, &layout)
                .unwrap();
            (held, losses, e.num_params())
        });
        // What trains: the adapters.
        for (rank, (held, _, params)) in got.iter().enumerate() {
            assert_eq!(*params, case.elements, "{what}, rank {rank}");
            let adapters: Vec<&String> = (held.iter())
                .filter(|(n, _)| zrt::lora::is_adapter(n))
                .map(|(n, _)| n)
                .collect();
            assert_eq!(adapters.len(), case.matrices, "{what}: {adapters:?}");
            for (name, has_memory) in held {
                assert_eq!(
                    *has_memory,
                    zrt::lora::is_adapter(name),
                    "{what}, rank {rank}: `{name}` while built"
                );
            }
        }
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(init.join("adapter_config.json")).unwrap())
                .unwrap();
        assert_eq!(config["r"], 4, "{config}");
        let merged = dir.join(format!("tuned{run}-merged"));
        let m = zrt::lora::merge(&hf, &tuned, &merged).unwrap();
        // A bias of each adapted layer took B's (a layer's A, B and B's
        // bias are three of the adapter's tensors).
        let biased = if case.lora_bias { case.matrices / 3 } else { 0 };
        assert_eq!(m.biases.len(), biased, "{what}: {:?}", m.biases);
        let mut theirs = peft_run(&dir, case, (&init, &tuned), atol, &what);
        // PEFT's own directory merges as zrt's does.
        let peft_merged = dir.join(format!("tuned{run}-peft-merged"));
        zrt::lora::merge(&hf, &dir.join(format!("tuned{run}-peft")), &peft_merged).unwrap();
        let read = |d: &Path| {
            let mut all: Vec<(String, Tensor)> = (std::fs::read_dir(d).unwrap())
                .map(|f| f.unwrap().path())
                .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
                .flat_map(|f| Tensor::read_safetensors(f).unwrap())
                .collect();
            all.sort_by(|a, b| a.0.cmp(&b.0));
            all
        };
        let (ours, peft_ours) = (read(&merged), read(&peft_merged));
        assert_eq!(ours.len(), peft_ours.len(), "{what}");
        // Adapters `atol` apart make updates `s B A` up to about the
        // largest factor `s` times that apart (A's entries are under
        // `1/sqrt(in)`, and no rank here is over `sqrt(in)`).
        let least_rank = (case.ranks.iter().map(|&(_, r)| r)).fold(lora.r, i64::min);
        let most_alpha = (case.alphas.iter().map(|&(_, a)| a)).fold(lora.alpha, f64::max);
        let updated = atol * most_alpha / least_rank as f64;
        for ((n, a), (m, b)) in ours.iter().zip(&peft_ours) {
            assert_eq!(n, m, "{what}");
            assert!(a.allclose(b, 1e-4, updated, false), "{what}: `{n}`");
        }
        let trained = theirs.pop().unwrap();
        assert_eq!(theirs.len(), STEPS, "{theirs:?}");
        // The trained adapter, loaded into a model built from its
        // directory's config: PEFT's trained model's losses.
        let reloaded = on_ranks(2, |r| {
            let vs = VarStore::new(tch::Device::Cpu);
            let plan = ShardPlan::new();
            let options = HfOptions {
                lora: Some(LoraConfig::from_adapter_dir(&tuned).unwrap()),
                ..Default::default()
            };
            let (model, _) = common::seeded(|| {
                HfModel::from_pretrained_with(&vs, &plan, &hf, &options).unwrap()
            });
            let group = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &ds, group, &AutoHints::default()).unwrap();
            let batch = Tensor::from_slice(&batches[0][r.rank()]).view([MICRO, SEQ]);
            // PEFT's own directory (with copies of the adapted ends'
            // matrices, where it adapts them), then zrt's.
            let _ = zrt::lora::load_adapter(&e, dir.join(format!("tuned{run}-peft"))).unwrap();
            let peft = tch::no_grad(|| model.loss(&batch)).double_value(&[]);
            let loaded = zrt::lora::load_adapter(&e, &tuned).unwrap();
            assert_eq!(loaded, case.matrices + case.whole);
            let loss = tch::no_grad(|| model.loss(&batch)).double_value(&[]);
            assert!(
                (peft - loss).abs() <= tol.max(1e-4) * loss.abs(),
                "{what}: {peft} {loss}"
            );
            // The base's file is no adapter: refused, naming what it lacks.
            let err = zrt::lora::load_adapter(&e, &hf).unwrap_err().to_string();
            (loss, err)
        });
        for (rank, ((loss, err), t)) in reloaded.iter().zip(&trained).enumerate() {
            let how = format!("{what}, rank {rank}: reloaded");
            common::margin(&how, (loss - t).abs(), tol.max(1e-4) * t.abs());
            assert!(
                (loss - t).abs() <= tol.max(1e-4) * t.abs(),
                "{what}, rank {rank}: reloaded {loss}, peft {t}"
            );
            assert!(err.contains("adapter_config.json"), "{err}");
        }
        for (s, step) in theirs.iter().enumerate() {
            for (rank, t) in step.iter().enumerate() {
                let g = got[rank].1[s];
                let how = format!("{what}: step {s}, rank {rank}");
                common::margin(&how, (g - t).abs(), tol * t.abs());
                assert!(
                    (g - t).abs() <= tol * t.abs(),
                    "{what}: step {s}, rank {rank}: zrt {g}, peft {t}"
                );
            }
        }
        // The adapters learnt: the loss fell (B left zero).
        assert!(got[0].1[STEPS - 1] < got[0].1[0], "{what}: {:?}", got[0].1);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The error building the checkpoint `hf` with adapters `lora` gives, or
/// nothing when it builds.
fn built_with(hf: &Path, lora: LoraConfig) -> String {
    let options = HfOptions {
        lora: Some(lora),
        ..Default::default()
    };
    let vs = VarStore::new(tch::Device::Cpu);
    let plan = ShardPlan::new();
    let _g = common::rng_lock();
    match HfModel::from_pretrained_with(&vs, &plan, hf, &options) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

/// An adapter on Mamba's `out_proj` (or through all-linear) is refused
/// as PEFT refuses it, naming the module and the fix; `in_proj` builds.
#[test]
fn lora_on_a_mambas_out_proj_is_refused_as_peft_refuses_it() {
    let dir = scratch("lora-mamba-refused");
    let model = common::hf_seeded_model(
        "from transformers import MambaConfig as C, MambaForCausalLM as M",
        "vocab_size=96, hidden_size=32, num_hidden_layers=1, state_size=4",
        &dir,
        "",
    );
    common::python(&model);
    let build = |targets: &[&str]| built_with(&dir.join("hf"), LoraConfig::new(2, 8.0, targets));
    for targets in [&["in_proj", "out_proj"][..], &["all-linear"]] {
        let err = build(targets);
        assert!(
            err.contains(r#"target_modules adapt {"out_proj"}: PEFT refuses LoRA on ["out_proj", "conv1d"] of a "mamba" model"#)
                && err.contains("name others (in_proj, x_proj, dt_proj)"),
            "{targets:?}: {err}"
        );
    }
    assert_eq!(build(&["in_proj", "dt_proj"]), "");
    let _ = std::fs::remove_dir_all(&dir);
}

/// DoRA on a BitNet trained ternary is refused naming the key and the
/// fix (PEFT's DoRA would read the weights unrounded); plain LoRA builds.
#[test]
fn dora_on_a_ternary_bitnet_is_refused_naming_it() {
    let dir = scratch("lora-bitnet-dora-refused");
    let (import, args) = BITNET_TERNARY.python;
    common::python(&common::hf_seeded_model(import, args, &dir, ""));
    let lora = LoraConfig::new(2, 8.0, &["q_proj"]);
    let dora = LoraConfig {
        use_dora: true,
        ..lora.clone()
    };
    let err = built_with(&dir.join("hf"), dora);
    assert!(
        err.contains("use_dora on a BitNet that trains ternary (quantization_config autobitlinear, online): zrt builds DoRA on full-precision linear layers only; use plain LoRA (use_dora off)"),
        "{err}"
    );
    assert_eq!(built_with(&dir.join("hf"), lora), "");
    let _ = std::fs::remove_dir_all(&dir);
}

/// PEFT adapts LFM2's and Jamba's convolutions as `nn.Conv1d`s; zrt
/// builds no such adapter, so naming one is refused, not left bare.
#[test]
fn lora_on_a_convolution_is_refused_naming_it() {
    let dir = scratch("lora-conv-refused");
    let model = common::hf_seeded_model(
        "from transformers import Lfm2Config as C, Lfm2ForCausalLM as M",
        "vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, layer_types=['conv', 'full_attention']",
        &dir,
        "",
    );
    common::python(&model);
    let build = |targets: &[&str]| built_with(&dir.join("hf"), LoraConfig::new(2, 8.0, targets));
    let err = build(&["in_proj", "conv"]);
    assert!(
        err.contains("target_modules name `model.layers.0.conv.conv` (1 convolution in all): zrt builds LoRA adapters on linear layers and embeddings, not convolutions"),
        "{err}"
    );
    // all-linear leaves it out, as PEFT's does.
    assert_eq!(build(&["all-linear"]), "");
    assert_eq!(build(&["in_proj", "out_proj"]), "");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_settings_no_adapter_can_be_built_with_are_refused() {
    let dir = scratch("lora-refused");
    let model = common::hf_seeded_model(
        "from transformers import GPT2Config as C, GPT2LMHeadModel as M",
        "vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2",
        &dir,
        "",
    );
    common::python(&model);
    let build = |lora: LoraConfig| built_with(&dir.join("hf"), lora);
    // Llama's names on GPT-2: the error names GPT-2's own.
    let none = build(LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]));
    assert!(
        none.contains(
            "match none of the model's linear layers: name some of its own (c_attn, c_fc, c_proj)"
        ),
        "{none}"
    );
    // A layer the model (of one) has not; GPT-2's layers under `h`.
    let layers = |l: &[i64], pattern: &[&str]| {
        build(LoraConfig {
            layers_to_transform: l.to_vec(),
            layers_pattern: pattern.iter().map(|p| p.to_string()).collect(),
            ..LoraConfig::new(2, 8.0, &["c_attn"])
        })
    };
    let past = layers(&[1], &[]);
    assert!(
        past.contains(
            "match none of the model's linear layers on the layers [1] (layers_to_transform"
        ),
        "{past}"
    );
    assert_eq!(layers(&[0], &["h"]), "");
    assert!(layers(&[0], &["layers"]).contains("on the layers [0]"));
    let rank = build(LoraConfig::new(0, 8.0, &["c_attn"]));
    assert!(rank.contains("rank r = 0"), "{rank}");
    assert_eq!(build(LoraConfig::new(2, 8.0, &["c_attn"])), "");
    // Parameters (`target_parameters`): stacked experts' only, which
    // GPT-2 has none of; PEFT's refusals beside them.
    let on_params = |params: &[&str], dropout: f64| {
        build(LoraConfig {
            target_parameters: params.iter().map(|p| p.to_string()).collect(),
            dropout,
            ..LoraConfig::new(2, 8.0, &["c_attn"])
        })
    };
    let matrix = on_params(&["c_attn.weight"], 0.0);
    assert!(
        matrix.contains(
            "`c_attn.weight` names `transformer.h.0.attn.c_attn.weight`, a 2-dimensional parameter"
        ) && matrix.contains("put a linear layer's module in target_modules"),
        "{matrix}"
    );
    let nothing = on_params(&["mlp.experts.gate_up_proj"], 0.0);
    assert!(
        nothing.contains("`mlp.experts.gate_up_proj` names no parameter of the model"),
        "{nothing}"
    );
    let dropped = on_params(&["mlp.experts.gate_up_proj"], 0.1);
    assert!(
        dropped.contains("with lora_dropout 0.1: PEFT's adapters on parameters take none"),
        "{dropped}"
    );
    // Modules trained whole, named as in the checkpoint (GPT-2's under
    // `transformer.`); its tied embedding, which PEFT would not tie to
    // the head (it ties `embed_tokens` only), and the tied head refused.
    let saving = |saved: &[&str]| {
        build(LoraConfig {
            modules_to_save: saved.iter().map(|m| m.to_string()).collect(),
            ensure_weight_tying: true,
            ..LoraConfig::new(2, 8.0, &["c_attn"])
        })
    };
    assert_eq!(saving(&["transformer.ln_f"]), "");
    assert_eq!(saving(&["ln_f", "h.0.mlp"]), "");
    let wte = saving(&["wte"]);
    assert!(
        wte.contains("`transformer.wte` is this model's head too (tied)")
            && wte.contains("only when it is `embed_tokens`"),
        "{wte}"
    );
    let head = saving(&["lm_head"]);
    assert!(
        head.contains("`lm_head` is the token embedding `transformer.wte` in this model"),
        "{head}"
    );
    // Trainable tokens: ids the vocabulary (96) has, each once.
    let tokens = |ids: &[i64]| {
        build(LoraConfig {
            trainable_token_indices: ids.to_vec(),
            ..LoraConfig::new(2, 8.0, &["c_attn"])
        })
    };
    assert_eq!(tokens(&[95, 0]), "");
    let past = tokens(&[3, 96]);
    assert!(
        past.contains(
            "`transformer.wte.weight`: row 96 asked for (trainable_token_indices), of 96"
        ),
        "{past}"
    );
    assert!(tokens(&[3, 3]).contains("name token 3 twice"));
    // PEFT's dict form: the input embedding's rows, or an untied head's
    // (GPT-2's is tied: no module of its own).
    let of = |module: &str| {
        build(LoraConfig {
            trainable_tokens_modules: vec![(module.into(), vec![3])],
            ..LoraConfig::new(2, 8.0, &["c_attn"])
        })
    };
    assert_eq!(of("transformer.wte"), "");
    let head = of("lm_head");
    assert!(
        head.contains(
            "{\"lm_head\": ...} names no module zrt trains tokens' rows of: the input embedding, or a head of its own"
        ),
        "{head}"
    );
    // An adapter on the tied head (the embedding), DoRA on the embedding,
    // and an adapted embedding with trainable tokens.
    let head = build(LoraConfig::new(2, 8.0, &["c_attn", "lm_head"]));
    assert!(
        head.contains("target_modules: `lm_head` is the token embedding `transformer.wte` in this model (its head is tied): target `transformer.wte`"),
        "{head}"
    );
    let dora = build(LoraConfig {
        use_dora: true,
        ..LoraConfig::new(2, 8.0, &["c_attn", "wte"])
    });
    assert!(dora.contains("DoRA on linear layers only"), "{dora}");
    let biased = build(LoraConfig {
        lora_bias: true,
        ..LoraConfig::new(2, 8.0, &["c_attn", "wte"])
    });
    assert!(
        biased.contains("`transformer.wte` is a token embedding, whose adapter has no bias"),
        "{biased}"
    );
    let dora = build(LoraConfig {
        use_dora: true,
        lora_bias: true,
        ..LoraConfig::new(2, 8.0, &["c_attn"])
    });
    assert!(dora.contains("lora_bias with use_dora"), "{dora}");
    let both = build(LoraConfig {
        trainable_token_indices: vec![3],
        ..LoraConfig::new(2, 8.0, &["c_attn", "wte"])
    });
    assert!(
        both.contains("takes a LoRA adapter and trainable tokens both"),
        "{both}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trainable_tokens_on_a_head_with_a_bias_or_an_adapter_are_refused() {
    // Phi-2's head is biased, which PEFT leaves out of the logits of a
    // head whose tokens train.
    let dir = scratch("lora-head-tokens-refused");
    common::write_seeded_model(PHI.python.0, PHI.python.1, &dir);
    let build = |lora: LoraConfig| built_with(&dir.join("hf"), lora);
    let rows = |targets: &[&str]| LoraConfig {
        trainable_tokens_modules: vec![
            ("embed_tokens".into(), vec![3]),
            ("lm_head".into(), vec![3]),
        ],
        ..LoraConfig::new(2, 8.0, targets)
    };
    let biased = build(rows(&["q_proj"]));
    assert!(
        biased.contains("`lm_head` has a bias, which PEFT leaves out of the logits"),
        "{biased}"
    );
    let adapted = build(rows(&["q_proj", "lm_head"]));
    assert!(
        adapted.contains("`lm_head` takes a LoRA adapter and trainable tokens both"),
        "{adapted}"
    );
    let embedding_only = LoraConfig {
        trainable_tokens_modules: vec![("embed_tokens".into(), vec![3])],
        ..LoraConfig::new(2, 8.0, &["q_proj"])
    };
    assert_eq!(build(embedding_only), "");
    let _ = std::fs::remove_dir_all(&dir);
}

// The example and `zrt generate` need the `tokenize` feature.
#[cfg(feature = "tokenize")]
#[test]
fn the_finetune_example_trains_adapters_peft_loads() {
    let _serial = common::serial();
    let dir = scratch("lora-finetune");
    checkpoint(&dir, &LLAMA);
    let (hf, out) = (dir.join("hf"), dir.join("adapter"));
    let ids: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u16 % 96)
        .flat_map(u16::to_le_bytes)
        .collect();
    let (data, ds) = (dir.join("train.bin"), dir.join("ds.json"));
    std::fs::write(&data, ids).unwrap();
    std::fs::write(
        &ds,
        r#"{"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}"#,
    )
    .unwrap();
    let os = std::ffi::OsStr::new;
    let args = [
        os("--model"),
        hf.as_os_str(),
        os("--data"),
        data.as_os_str(),
        os("--config"),
        ds.as_os_str(),
        os("--seq"),
        os("16"),
        os("--steps"),
        os("4"),
        os("--print-every"),
        os("1"),
        os("--lora-r"),
        os("2"),
        os("--lora-alpha"),
        os("4"),
        os("--lora-targets"),
        os("all-linear"),
        os("--out"),
        out.as_os_str(),
    ];
    common::word_tokenizer(&hf, 96);
    let (ok, said) = crate::from_hf::finetune(&args);
    assert!(ok && said.contains("step     3  loss "), "{said}");
    // Stopped after 2 steps with a checkpoint and started again: the
    // straight run's losses and adapter, to the bit.
    let (ck, split) = (dir.join("ck"), dir.join("split"));
    let steps = |n: &'static str, more: &[&std::ffi::OsStr]| {
        let mut v = args[..18].to_vec();
        v[9] = os(n);
        v.extend_from_slice(more);
        crate::from_hf::finetune(&v)
    };
    let (ok, first) = steps("2", &[os("--save-dir"), ck.as_os_str()]);
    assert!(ok && first.contains("checkpoint saved to"), "{first}");
    let (ok, then) = steps(
        "4",
        &[
            os("--save-dir"),
            ck.as_os_str(),
            os("--out"),
            split.as_os_str(),
        ],
    );
    assert!(ok && then.contains("after 2 steps"), "{then}");
    let line = |said: &str, step: u32| {
        let at = format!("step {step:>5}  loss ");
        said.lines().find(|l| l.contains(&at)).map(String::from)
    };
    for step in [2, 3] {
        assert!(line(&then, step).is_some(), "{then}");
        assert_eq!(line(&then, step), line(&said, step), "step {step}");
    }
    let adapter = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
    assert!(
        adapter(&split) == adapter(&out),
        "the resumed adapter differs"
    );
    // Two more steps from the adapter: it starts where the run ended
    // (below the first run's first loss; the optimizer starts afresh).
    let more = dir.join("more");
    let mut again = args[..12].to_vec();
    again.extend([
        os("--lora-from"),
        out.as_os_str(),
        os("--out"),
        more.as_os_str(),
    ]);
    let (ok, resumed) = crate::from_hf::finetune(&again);
    assert!(
        ok && resumed.contains("adapter: 28 tensors from"),
        "{resumed}"
    );
    let loss = |said: &str, step: usize| -> f64 {
        let at = said
            .split(&format!("step {step:>5}  loss "))
            .nth(1)
            .unwrap();
        at.split_whitespace().next().unwrap().parse().unwrap()
    };
    assert!(loss(&resumed, 0) < loss(&said, 0), "{said}\n{resumed}");
    assert!(
        more.join("adapter_model.safetensors").is_file(),
        "{resumed}"
    );
    // PEFT loads it as it is, every layer's seven projections adapted,
    // their B matrices moved off zero by the steps.
    let theirs = common::python(&format!(
        r#"
from transformers import LlamaForCausalLM
from peft import PeftModel
from safetensors.torch import load_file
base = LlamaForCausalLM.from_pretrained("{hf}")
m = PeftModel.from_pretrained(base, "{out}")
file = load_file("{out}/adapter_model.safetensors")
mine = {{k.replace(".default", ""): v for k, v in m.state_dict().items() if "lora_" in k}}
assert sorted(mine) == sorted(file), (sorted(mine), sorted(file))
print(m.peft_config["default"].r, len(file), sum(int(v.abs().sum() > 0) for k, v in file.items() if "lora_B" in k))
"#,
        hf = hf.display(),
        out = out.display()
    ));
    assert_eq!(theirs.trim(), "2 28 14", "{said}");
    // Folded into the base by `zrt lora merge`: PEFT's merge_and_unload
    // tensors, loaded by transformers with nothing missing, computing
    // the adapted model's logits.
    let merged = dir.join("merged");
    let zrt = |args: &[&std::ffi::OsStr]| {
        let merge = [os("lora"), os("merge"), os("--base"), hf.as_os_str()];
        common::zrt_cli(merge.iter().chain(args))
    };
    let (ok, said) = zrt(&[
        os("--adapter"),
        out.as_os_str(),
        os("--out"),
        merged.as_os_str(),
    ]);
    assert!(ok && said.contains("merged 14 matrices"), "{said}");
    let theirs = common::python(&format!(
        r#"
import torch
from transformers import LlamaForCausalLM
from peft import PeftModel
from safetensors.torch import load_file
tokens = load_file("{dir}/tokens.safetensors")["tokens"][0, 0]
m = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained("{hf}"), "{out}")
with torch.no_grad():
    adapted = m(tokens).logits
want = m.merge_and_unload().state_dict()
ours, info = LlamaForCausalLM.from_pretrained("{merged}", output_loading_info=True)
assert not any(info.values()), info
got = ours.state_dict()
assert sorted(got) == sorted(want)
for k in want:
    assert torch.allclose(got[k], want[k], rtol=0, atol=1e-6), (k, (got[k] - want[k]).abs().max())
with torch.no_grad():
    print((ours(tokens).logits - adapted).abs().max().item())
"#,
        dir = dir.display(),
        hf = hf.display(),
        out = out.display(),
        merged = merged.display()
    ));
    let diff: f64 = theirs.trim().parse().unwrap();
    assert!(diff < 1e-4, "{theirs}");
    // `zrt generate` with the adapter continues a prompt as with the
    // merged checkpoint.
    let generate = |model: &Path, more: &[&std::ffi::OsStr]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_zrt"))
            .args(["generate", "--model"])
            .arg(model)
            .args(["--prompt", "t5 t17 t33", "--max-new-tokens", "8"])
            .args(more)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    // Scaled up a thousand times (alpha 4000) so that the text moves.
    let loud = dir.join("loud");
    std::fs::create_dir_all(&loud).unwrap();
    std::fs::copy(
        out.join("adapter_model.safetensors"),
        loud.join("adapter_model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
    let louder = config.replace("\"lora_alpha\": 4.0", "\"lora_alpha\": 4000.0");
    assert_ne!(config, louder);
    std::fs::write(loud.join("adapter_config.json"), louder).unwrap();
    let loud_merged = dir.join("loud-merged");
    let (ok, said) = zrt(&[
        os("--adapter"),
        loud.as_os_str(),
        os("--out"),
        loud_merged.as_os_str(),
    ]);
    assert!(ok, "{said}");
    let adapted = generate(&hf, &[os("--adapter"), loud.as_os_str()]);
    assert_eq!(adapted, generate(&loud_merged, &[]));
    assert_ne!(adapted, generate(&hf, &[]));
    // An adapter of another rank than its matrices say is refused, and
    // writes nothing.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(
        out.join("adapter_model.safetensors"),
        other.join("adapter_model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
    std::fs::write(
        other.join("adapter_config.json"),
        config.replace("\"r\": 2", "\"r\": 3"),
    )
    .unwrap();
    // Nor over its base, which would be lost.
    let (ok, said) = zrt(&[
        os("--adapter"),
        out.as_os_str(),
        os("--out"),
        hf.as_os_str(),
    ]);
    assert!(!ok && said.contains("would overwrite its base"), "{said}");
    let never = dir.join("never");
    let (ok, said) = zrt(&[
        os("--adapter"),
        other.as_os_str(),
        os("--out"),
        never.as_os_str(),
    ]);
    assert!(
        !ok && said.contains("where rank 3 wants") && said.contains("an adapter of another model"),
        "{said}"
    );
    assert!(!never.exists(), "{said}");
    // The head trained whole beside the adapters, and two tokens' rows
    // of the embedding (one by its text in the tokenizer, one by id):
    // written into the adapter, merged in place of the base's, and `zrt
    // generate --adapter` computes with them as with the merged
    // checkpoint. The adapters on the second layer only.
    let saved = dir.join("saved");
    let mut with_head = args[..18].to_vec();
    with_head[9] = os("2");
    with_head.extend([
        os("--lora-modules-to-save"),
        os("lm_head"),
        os("--lora-trainable-tokens"),
        os("t5,17"),
        os("--lora-layers"),
        os("1"),
        os("--lora-bias"),
        os("all"),
        os("--out"),
        saved.as_os_str(),
    ]);
    let (ok, said) = crate::from_hf::finetune(&with_head);
    assert!(ok, "{said}");
    let config = std::fs::read_to_string(saved.join("adapter_config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["layers_to_transform"], serde_json::json!([1]));
    // Every bias trains (this Llama has none), as PEFT's `bias` says;
    // `lora_only` is refused, naming why.
    assert_eq!(config["bias"], "all");
    let mut only = args[..18].to_vec();
    only.extend([os("--lora-bias"), os("lora_only")]);
    let (ok, said) = crate::from_hf::finetune(&only);
    assert!(
        !ok && said.contains("--lora-bias lora_only: PEFT 0.18 trains the adapted layers' biases"),
        "{said}"
    );
    // Stacked experts' parameters reach the build, which finds none in
    // a Llama (stacked experts train so in `lora_adapters_on_stacked_experts_...`).
    let mut experts = args[..18].to_vec();
    experts.extend([
        os("--lora-target-parameters"),
        os("mlp.experts.gate_up_proj"),
    ]);
    let (ok, said) = crate::from_hf::finetune(&experts);
    assert!(
        !ok && said.contains("`mlp.experts.gate_up_proj` names no parameter of the model"),
        "{said}"
    );
    // B with biases (PEFT's `lora_bias`): trained and written, but this
    // Llama's projections have none to merge them into (PEFT cannot
    // either); a file without the biases its config says B has is
    // refused too.
    let biased = dir.join("biased");
    let mut with_b = args[..18].to_vec();
    with_b[9] = os("2");
    with_b.extend([os("--lora-b-bias"), os("--out"), biased.as_os_str()]);
    let (ok, said) = crate::from_hf::finetune(&with_b);
    assert!(ok, "{said}");
    let config = std::fs::read_to_string(biased.join("adapter_config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["lora_bias"], true);
    let file = biased.join("adapter_model.safetensors");
    let (b_biases, rest): (Vec<_>, Vec<_>) = (Tensor::read_safetensors(&file).unwrap())
        .into_iter()
        .partition(|(n, _)| n.ends_with(".lora_B.bias"));
    assert_eq!((b_biases.len(), rest.len()), (14, 28));
    assert!(b_biases
        .iter()
        .all(|(_, b)| b.abs().sum(None).double_value(&[]) > 0.0));
    let never = dir.join("never-biased");
    let merge_biased = || {
        let (ok, said) = zrt(&[
            os("--adapter"),
            biased.as_os_str(),
            os("--out"),
            never.as_os_str(),
        ]);
        assert!(!ok && !never.exists(), "{said}");
        said
    };
    let said = merge_biased();
    assert!(
        said.contains("the adapter's B has a bias (lora_bias) but the base's `model.layers.0.mlp.down_proj` has none to add it to"),
        "{said}"
    );
    Tensor::write_safetensors(&rest, &file).unwrap();
    let said = merge_biased();
    assert!(
        said.contains("`lora_bias` is true in its adapter_config.json but `model.layers.0.mlp.down_proj` lacks `lora_B.bias`"),
        "{said}"
    );
    let tensor = |d: &Path, name: &str| {
        let files = std::fs::read_dir(d).unwrap().map(|f| f.unwrap().path());
        (files.filter(|f| f.extension().is_some_and(|e| e == "safetensors")))
            .flat_map(|f| Tensor::read_safetensors(f).unwrap())
            .find(|(n, _)| n == name)
            .unwrap()
            .1
    };
    // The head's rows of a token too (PEFT's dict form, both ends named
    // as this Llama names them), merged in place of the head's.
    let head_tokens = dir.join("head-tokens");
    let mut with_rows = args[..18].to_vec();
    with_rows[9] = os("2");
    with_rows.extend([
        os("--lora-trainable-tokens"),
        os("t5,17"),
        os("--lora-trainable-head-tokens"),
        os("17"),
        os("--out"),
        head_tokens.as_os_str(),
    ]);
    let (ok, said) = crate::from_hf::finetune(&with_rows);
    assert!(ok, "{said}");
    let config = std::fs::read_to_string(head_tokens.join("adapter_config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(
        config["trainable_token_indices"],
        serde_json::json!({"embed_tokens": [5, 17], "lm_head": [17]})
    );
    let rows_merged = dir.join("head-tokens-merged");
    let (ok, said) = zrt(&[
        os("--adapter"),
        head_tokens.as_os_str(),
        os("--out"),
        rows_merged.as_os_str(),
    ]);
    assert!(ok && said.contains("replaced 2 tensors"), "{said}");
    let row = tensor(
        &head_tokens,
        "base_model.model.lm_head.token_adapter.trainable_tokens_delta",
    );
    let row17 = |d: &Path| tensor(d, "lm_head.weight").get(17).unsqueeze(0);
    assert!(row17(&rows_merged).equal(&row) && !row17(&hf).equal(&row));
    let saved_merged = dir.join("saved-merged");
    let (ok, said) = zrt(&[
        os("--adapter"),
        saved.as_os_str(),
        os("--out"),
        saved_merged.as_os_str(),
    ]);
    assert!(
        ok && said.contains("merged 7 matrices and replaced 2 tensors"),
        "{said}"
    );
    let head = |d: &Path| tensor(d, "lm_head.weight");
    let trained = |name: &str| tensor(&saved, &format!("base_model.model.{name}"));
    assert!(head(&saved_merged).equal(&trained("lm_head.weight")));
    assert!(!head(&saved_merged).equal(&head(&hf)));
    // The embedding: rows 5 and 17 the trained ones, moved by the steps,
    // the others the base's.
    let embed = |d: &Path| tensor(d, "model.embed_tokens.weight");
    let rows = Tensor::from_slice(&[5i64, 17]);
    let delta = trained("model.embed_tokens.token_adapter.trainable_tokens_delta");
    assert!(embed(&saved_merged).index_select(0, &rows).equal(&delta));
    assert!(!embed(&hf).index_select(0, &rows).equal(&delta));
    let others = Tensor::from_slice(&[0i64, 4, 6, 16, 18, 95]);
    let (merged_others, base_others) = (
        embed(&saved_merged).index_select(0, &others),
        embed(&hf).index_select(0, &others),
    );
    assert!(merged_others.equal(&base_others));
    let adapted = generate(&hf, &[os("--adapter"), saved.as_os_str()]);
    assert_eq!(adapted, generate(&saved_merged, &[]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// An adapter of a multimodal model's language model (what zrt trains
/// on a `gemma3` or `idefics3` checkpoint: its names the text model's)
/// merges into the multimodal base itself: each update goes into the
/// language model's matrix under the base's prefix (Gemma 3's files:
/// `language_model.model.`; Idefics3's: `model.text_model.`), the
/// vision tower is written as it was, and the merged multimodal model
/// computes the text-only logits of PEFT's merged text model.
#[test]
fn an_adapter_of_a_multimodal_models_language_model_merges_into_the_multimodal_base() {
    adapter_merges_into_the_multimodal_base(
        "gemma3",
        (
            "from transformers import Gemma3TextConfig as C, Gemma3ForCausalLM as M",
            "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5",
        ),
        (
            "Gemma3ForConditionalGeneration",
            r#"from transformers import Gemma3Config
mm = Gemma3ForConditionalGeneration(Gemma3Config(text_config=m.config.to_dict(), vision_config=vision,
    mm_tokens_per_image=4, image_token_index=95, boi_token_index=93, eoi_token_index=94))
text = {("model.language_model." + k[6:] if k.startswith("model.") else k): v
        for k, v in m.state_dict().items()}"#,
        ),
        "language_model.model.layers.",
    );
    adapter_merges_into_the_multimodal_base(
        "idefics3",
        (
            "from transformers import LlamaConfig as C, LlamaForCausalLM as M",
            "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64",
        ),
        (
            "Idefics3ForConditionalGeneration",
            r#"from transformers import Idefics3Config
mm = Idefics3ForConditionalGeneration(Idefics3Config(text_config=m.config.to_dict(),
    vision_config=vision, image_token_id=95, scale_factor=2))
text = {("model.text_model." + k[6:] if k.startswith("model.") else k): v
        for k, v in m.state_dict().items()}"#,
        ),
        "model.text_model.layers.",
    );
}

/// [`an_adapter_of_a_multimodal_models_language_model_merges_into_the_multimodal_base`]
/// for the seeded text model `(import, args)` inside `class`, which
/// `wrap` (Python) builds as `mm` around it (`vision` a tower's config)
/// and whose state it names `text`; the merged matrices are under
/// `prefix`.
fn adapter_merges_into_the_multimodal_base(
    name: &str,
    (import, args): (&str, &str),
    (class, wrap): (&str, &str),
    prefix: &str,
) {
    let dir = scratch(&format!("lora-multimodal-merge-{name}"));
    let model = common::hf_seeded_model(import, args, &dir, "");
    let said = common::python(&format!(
        r#"{model}
from transformers import {class}
from peft import LoraConfig, get_peft_model
vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)
{wrap}
mm.load_state_dict(text, strict=False)
mm.save_pretrained("{dir}/mm")
tower = {{k: v.clone() for k, v in mm.state_dict().items() if "vision" in k}}
assert tower
torch.save(tower, "{dir}/tower.pt")
peft = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                     init_lora_weights=False))
peft.save_pretrained("{dir}/adapter")
tokens = torch.randint(0, 90, (1, 12))
merged = peft.merge_and_unload().eval()
with torch.no_grad():
    want = merged(tokens).logits
torch.save((tokens, want), "{dir}/want.pt")
print("ok")
"#,
        dir = dir.display()
    ));
    assert_eq!(said.lines().last(), Some("ok"), "{said}");
    let out = dir.join("merged");
    let m = zrt::lora::merge(&dir.join("mm"), &dir.join("adapter"), &out).unwrap();
    // Two layers' q_proj, v_proj and up_proj, under the base's names.
    assert_eq!(m.matrices.len(), 6, "{:?}", m.matrices);
    assert!(
        (m.matrices.iter()).all(|n| n.starts_with(prefix)),
        "{:?}",
        m.matrices
    );
    let said = common::python(&format!(
        r#"
import torch
from transformers import {class}
m, info = {class}.from_pretrained("{out}", output_loading_info=True)
assert not any(info.values()), info
tokens, want = torch.load("{dir}/want.pt")
tower = torch.load("{dir}/tower.pt")
state = m.state_dict()
assert all(torch.equal(state[k], v) for k, v in tower.items()), "the vision tower changed"
with torch.no_grad():
    diff = (m.eval()(tokens).logits - want).abs().max().item()
assert diff < 1e-5, diff
print("ok")
"#,
        dir = dir.display(),
        out = out.display()
    ));
    assert_eq!(said.lines().last(), Some("ok"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Stage 3 frees a LoRA block's frozen base once the block's backward is
/// done, though its adapters are reduced before its frozen matrices
/// compute its input's gradient: when the first layer's adapter gets its
/// gradient, the second layer's frozen matrices hold no memory. (Before
/// 2026-12-06 every block stayed gathered to the end of backward: a
/// 1.1B-parameter Llama's LoRA run peaked at 7.9 GiB a rank, 4.6 GiB
/// since; README, Benchmarks.)
#[test]
fn a_lora_blocks_frozen_base_is_freed_once_its_backward_is_done() {
    let dir = scratch("lora-frozen-freed");
    checkpoint(&dir, &LLAMA);
    let hf = dir.join("hf");
    let ds = config_zero(3, 1, 0.0, "", SHARD_ALL);
    let got = on_ranks(2, |r| {
        let vs = VarStore::new(tch::Device::Cpu);
        let plan = ShardPlan::new();
        let options = HfOptions {
            lora: Some(LoraConfig::new(4, 16.0, &["q_proj"])),
            ..Default::default()
        };
        let (model, _) =
            common::seeded(|| HfModel::from_pretrained_with(&vs, &plan, &hf, &options).unwrap());
        let group = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &ds, group, &AutoHints::default()).unwrap();
        let vars = vs.variables();
        // What the second layer's frozen key projection holds when the
        // first layer's adapter gets its gradient, each step.
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (out, later) = (
            seen.clone(),
            vars["model.layers.1.self_attn.k_proj.weight"].shallow_clone(),
        );
        let later = std::sync::Mutex::new(later);
        let first = &vars["model.layers.0.self_attn.q_proj.lora_A.weight"];
        zrt::zero::glue::on_grad(first, move || {
            let bytes = zrt::zero::glue::storage_nbytes(&later.lock().unwrap()).unwrap();
            out.lock().unwrap().push(bytes);
        })
        .unwrap();
        for _ in 0..2 {
            let x: Vec<i64> = (0..32).map(|i| (i * 7 + r.rank() as i64) % 90).collect();
            let loss = model.loss(&Tensor::from_slice(&x).view([2, 16]));
            e.backward(&loss).unwrap();
            e.step().unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        seen
    });
    for (rank, seen) in got.into_iter().enumerate() {
        // Bytes of the second layer's base while the first's backward ran.
        assert_eq!(seen, [0, 0], "rank {rank}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Under LoRA the head is frozen, and where its logits take more than one
/// block of the fused loss, forward computes the hidden states' gradient
/// (`glue::linear_cross_entropy`) and backward only scales it by the seed
/// (here the engine's division by 2 micro-steps). At stage 3 on 2 ranks,
/// the head's unit returning that loss, the adapters take the unfused
/// loss's steps.
#[test]
fn a_frozen_head_in_blocks_takes_the_unfused_loss_step_at_stage_3() {
    let dir = scratch("lora-frozen-head-blocks");
    // 2 x 64 tokens of 70000 words: 8.96M logits, two blocks.
    let vocab = 70_000;
    let rows_seq = (MICRO, 64);
    assert!(!zrt::zero::glue::keeps_logits(
        (rows_seq.0 * rows_seq.1) as u64,
        vocab
    ));
    std::fs::write(
        dir.join("config.json"),
        format!(
            r#"{{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                "vocab_size": {vocab}, "max_position_embeddings": 128, "tie_word_embeddings": false}}"#
        ),
    )
    .unwrap();
    let c = zrt::llama::LlamaConfig::from_hf_dir(&dir).unwrap();
    let lora = LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "down_proj"]);
    let run = |fused: bool| {
        on_ranks(2, |r| {
            let (vs, plan, model) = common::seeded(|| {
                let vs = VarStore::new(tch::Device::Cpu);
                let plan = ShardPlan::new();
                let m = zrt::llama::Llama::with_lora(&vs.root(), &plan, &c, &lora, false);
                // B starts at zeros: give the adapters a product, so
                // that the gradient reaches every one of them.
                // In the names' order: the map's is drawn at random.
                let mut vars: Vec<_> = vs.variables().into_iter().collect();
                vars.sort_by(|a, b| a.0.cmp(&b.0));
                for (name, mut t) in vars {
                    if name.contains("lora_B") {
                        tch::no_grad(|| t.copy_(&(t.randn_like() * 0.1)));
                    }
                }
                (vs, plan, m)
            });
            zrt::lora::freeze_base(&vs, &lora).unwrap();
            model.set_fused_loss(fused);
            model.set_training(true);
            let group = r.new_group(&[0, 1]).unwrap();
            let ds = common::config_of("SGD", 3, 2, 0.0, "", SHARD_ALL);
            let e = Engine::new(&vs, &plan, &ds, group, &AutoHints::default()).unwrap();
            let init = e.gathered_params().unwrap();
            let mut losses = Vec::new();
            for k in 0..2 {
                let n = rows_seq.0 * rows_seq.1;
                let from = (r.rank() as i64 * 2 + k) * n;
                let x =
                    (Tensor::arange_start(from, from + n, (tch::Kind::Int64, tch::Device::Cpu))
                        * 7919)
                        .remainder(vocab as i64)
                        .view([rows_seq.0, rows_seq.1]);
                let loss = model.loss(&x);
                losses.push(loss.double_value(&[]));
                e.backward(&loss).unwrap();
                e.step().unwrap();
            }
            (losses, init, e.gathered_params().unwrap())
        })
        .remove(0)
    };
    let ((fused_losses, init, fused), (losses, _, unfused)) = (run(true), run(false));
    for (a, b) in fused_losses.iter().zip(&losses) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} against {b}");
    }
    assert_eq!(fused.len(), unfused.len());
    assert!(
        fused.iter().all(|(n, _)| n.contains("lora_")),
        "{:?}",
        fused.iter().map(|p| &p.0).collect::<Vec<_>>()
    );
    let (mut near, mut moved) = (0.0f32, 0.0f32);
    for (((name, a), (other, b)), (_, before)) in fused.iter().zip(&unfused).zip(&init) {
        assert_eq!(name, other);
        for ((x, y), z) in a.iter().zip(b).zip(before) {
            near = near.max((x - y).abs());
            moved = moved.max((y - z).abs());
        }
    }
    assert!(near < 1e-6, "the fused step is {near} off the unfused one");
    assert!(moved > 1e-4, "the adapters barely moved: {moved}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! What libtorch allocates on the CPU is counted
//! (`zrt::zero::glue::allocated`), and what a forward holds for its
//! backward is what `zrt::llama::held_for_backward` (`zrt estimate
//! --seq`) says, to the byte: the families `COUNTED` lists, in
//! fp32, bf16 and fp16, each layer's tensors saved or only its input
//! (recomputed), alone and through a stage-3 engine, the whole model
//! training or LoRA's adapters on a frozen base.
//!
//! In a test binary of its own: the count is process-wide, and other
//! tests' threads would allocate beside it. Its tests take turns.

mod common;

use std::sync::Mutex;

use common::{config_zero, seeded, solo_engine, BF16};
use tch::{nn, Device, Kind, Tensor};
use zrt::llama::{adapter_params, held_for_backward, Llama, LlamaConfig};
use zrt::zero::glue::{allocated, keeps_logits, reset_peak_allocated, track_allocations};
use zrt::zero::ShardPlan;

static TURNS: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURNS.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn libtorch_allocations_are_counted_while_they_live() {
    let _t = turn();
    track_allocations().unwrap();
    let before = allocated().now;
    let n = 3 << 20;
    let t = Tensor::zeros([n], (Kind::Float, Device::Cpu));
    assert_eq!(allocated().now - before, 4 * n as u64);
    let u = Tensor::ones([n / 3], (Kind::BFloat16, Device::Cpu));
    assert_eq!(allocated().now - before, 4 * n as u64 + 2 * (n / 3) as u64);
    drop(t);
    assert_eq!(allocated().now - before, 2 * (n / 3) as u64);
    assert!(allocated().peak >= before + 4 * n as u64 + 2 * (n / 3) as u64);
    reset_peak_allocated();
    assert_eq!(allocated().peak, allocated().now);
    // A storage grown in place goes through the count too.
    let mut g = u.view([-1]).copy();
    let grown = allocated().now;
    let _ = g.resize_([n]);
    assert_eq!(allocated().now - grown, 2 * (n - n / 3) as u64);
    drop((u, g));
    assert_eq!(allocated().now, before);
    // oneDNN takes its scratch through the raw interface, zero bytes
    // too, and frees it there (a null pointer, once a crash).
    let x = Tensor::ones([64, 256], (Kind::Float, Device::Cpu));
    let y = x.gelu("none");
    assert!((y.double_value(&[0, 0]) - 0.841345).abs() < 1e-5);
    drop((x, y));
    assert_eq!(allocated().now, before);
}

/// A directory with the `config.json` of `model_type` and the keys
/// `extra` adds: 3 layers, width 64 (4 heads over 2 key-value heads),
/// vocabulary 97.
fn config(model_type: &str, extra: &str) -> std::path::PathBuf {
    // A directory of its own for each call: tests that do not take turns
    // write configs too, and two of one type must not share one.
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "zrt-activations-{}-{model_type}-{n}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let json = format!(
        r#"{{"model_type": "{model_type}", "hidden_size": 64, "intermediate_size": 176,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
            "vocab_size": 97, "max_position_embeddings": 128, "tie_word_embeddings": false{extra}}}"#
    );
    std::fs::write(dir.join("config.json"), json).unwrap();
    dir
}

const ROWS: i64 = 2;
const SEQ: i64 = 24;

/// Each row's tokens, `[ROWS, SEQ]`.
fn tokens() -> Tensor {
    Tensor::arange(ROWS * SEQ, (Kind::Int64, Device::Cpu))
        .remainder(97)
        .view([ROWS, SEQ])
}

/// The model `c` from seed 0 (with `lora`'s adapters, its base frozen),
/// each layer `recompute`d or not, its variables in `kind`, training.
fn built(
    c: &LlamaConfig,
    kind: Kind,
    recompute: bool,
    lora: Option<&zrt::lora::LoraConfig>,
) -> (nn::VarStore, Llama) {
    let (mut vs, model) = seeded(|| {
        let vs = nn::VarStore::new(Device::Cpu);
        let (root, plan) = (vs.root(), ShardPlan::new());
        let m = match (lora, recompute) {
            (Some(l), _) => Llama::with_lora(&root, &plan, c, l, recompute),
            (None, true) => Llama::new_checkpointed(&root, &plan, c),
            (None, false) => Llama::new(&root, &plan, c),
        };
        (vs, m)
    });
    if let Some(l) = lora {
        zrt::lora::freeze_base(&vs, l).unwrap();
    }
    match kind {
        Kind::BFloat16 => vs.bfloat16(),
        Kind::Half => vs.half(),
        _ => {}
    }
    model.set_training(true);
    (vs, model)
}

/// The bytes libtorch holds after `loss` ran, beyond what it held before.
fn held_by(loss: impl FnOnce() -> Tensor) -> (u64, Tensor) {
    let before = allocated().now;
    let l = loss();
    (allocated().now - before, l)
}

/// The families the estimate counts, each with settings that change
/// what it computes: Llama with biases, Mistral's queries wider than
/// the model with a window longer than the row, and a window shorter,
/// Qwen2 (its attention's biases), Granite's multipliers, Qwen3's norms of each head's queries
/// and keys (a head 24 wide), Phi-3's fused projections and a part of
/// each head turned, SmolLM3's layer without rotary embeddings,
/// Mixtral's experts, Qwen3-MoE's beside a dense layer, OLMo 2's norms
/// after each sublayer and of the whole queries and keys (OLMo 3's in a
/// window too), Gemma's norms (times `1 + weight` in fp32) and
/// scaled embeddings, Gemma 2's and 3's norms of each sublayer's output
/// (Gemma 2 without its caps, and with them: its attention a block of
/// queries at a time, in a window shorter than the row), Ministral's windows by `layer_types`,
/// Seed-OSS's biases (its dropouts off: a dropout is not counted), and
/// EXAONE 4's norms after each sublayer and of each head's queries and
/// keys, its global layer without rotary embeddings, Arcee's ungated
/// MLP of a squared ReLU, StarCoder2's LayerNorms and ungated GELU MLP
/// (in a window shorter than the row), and Nemotron's LayerNorms of
/// `1 + weight`, half of each head turned, its MLP Arcee's; ERNIE 4.5's
/// pairs turned in fp32, Helium's in the compute dtype and its norms'
/// weights multiplied in fp32, GLM's fused gate and up and half of each
/// head turned by pairs (GLM-4 with norms of each sublayer's output),
/// Hunyuan's heads normalised after they turn, OLMo 1's LayerNorms
/// without weights in fp32 and its clamped projections, Cohere's
/// attention and MLP side by side after one fp32 LayerNorm, pairs
/// turned in fp32 (Cohere 2's in its windowed layers only), and
/// StableLM's LayerNorms and quarter-turned heads, one after the other
/// and side by side (and as 2 12B's, a LayerNorm for each head's queries
/// and keys), Command R+'s norms of each head with weights `[heads,
/// head_dim]`, and Persimmon's fused projection of each head's query,
/// key and value, each head LayerNormed before half of it turns, and its
/// squared ReLU; Qwen2-MoE's experts beside a gated shared expert, and
/// a dense layer; ERNIE 4.5's chosen with a correction, beside an
/// ungated shared expert, and Hunyuan's beside its heads normalised
/// after they turn; GLM-4-MoE's chosen within groups beside shared
/// experts, with and without norms of each head, and dots.llm1's;
/// Granite-MoE's stacked experts in Granite's layers; OLMoE's experts
/// beside its norms of the whole queries and keys, FlexOlmo's (three of
/// four a token) in OLMo 2's layers; GPT-OSS's attention beside sinks, in
/// a window shorter than the row every other layer, and its clamped,
/// biased experts; DeepSeek-V3's latent attention, its values narrower
/// than its queries and keys (padded for the fused kernel) and through
/// the queries' bottleneck, and as wide with one `q_proj`, beside its
/// grouped experts, and DeepSeek-V2's, its pairs turned in fp32, its
/// experts chosen greedily or within groups by a softmax; Llama 4's two
/// turning layers in chunks shorter than the row (sharing one mask)
/// with L2-normalised heads around one without positions whose queries
/// grow with the position, its top-1 expert beside a shared one between
/// dense MLPs of their own width, and with neither norms nor growth nor
/// chunks, two experts a token on every layer; Apertus's xIELU, its
/// trained factors and its norms of each head's queries and keys;
/// VaultGemma's (Gemma 2's soft-capped attention in a window shorter
/// than the row, without norms of each sublayer's output); and
/// Granite-MoE-shared's experts beside its shared MLP, whose gate and up
/// are one matrix; LFM2's short convolutions (of 3 and of 4 tokens,
/// biased, beside heads wider than the model) around a layer that
/// attends with norms of each head's queries and keys; and DBRX's
/// fused query-key-value projection, clipped (each clamp keeping the
/// projection's output) and not (its values a view of it), between its
/// unbiased LayerNorms, beside experts stacked as rows, their weights
/// renormalised and not; and Falcon's layers: 7B's one key and value
/// (a view of the fused projection) beside the MLP after one LayerNorm,
/// 40B's groups after two, one group after one, and one after the other
/// with biases; and OPT's LayerNorms, learned positions and ReLU, its
/// dropout off and at its 0.1, OPT-350m's norms of each residual sum
/// and narrower embeddings projected in and out, without a final norm,
/// and projected beside norms before each sublayer; GPT-BigCode's one key head and one a
/// head (unscaled), its dropouts off and at their 0.1; GPT-J's
/// attention and MLP side by side, part of each head turned in fp32,
/// its dropouts off and on, and CodeGen's fused projection in blocks;
/// GPT-Neo's global and local layers, its dropouts off and on; and
/// ALiBi's mask of every head's scores: MPT's (its projection clamped
/// and not), BLOOM's (its embeddings normalised), both with their
/// dropouts too (the attention's plain path beside the mask), and
/// Falcon-RW's; OPT's kin, BioGPT's and XGLM's, their dropouts at 0.1
/// and off; OpenAI GPT's norms of each residual sum, its dropouts off
/// and at their 0.1; BitNet's norms of the attention's output and of
/// the MLP's product (trained unrounded); DiffLlama's heads in pairs over
/// values twice as wide, two heads a key head and four; CTRL's
/// LayerNorms and ReLU under its own names, its sinusoids, its
/// dropouts at their 0.1 and off; GPT-NeoX-Japanese's one fused
/// projection a head, half of each head turned, and all of it, tied,
/// its dropouts off and on; ModernBERT-decoder's normalised
/// embeddings, its first layer's attention without a norm, its gated
/// `Wi`, windows shorter than the row every other layer, the dense layer,
/// activation and norm before its head, its dropouts off and on, tied;
/// Doge's dynamic mask (each query keeping its 6 keys of highest bias,
/// and all 24), its attention in blocks of queries, its weighted
/// residuals, in a window, biased, tied, its dropout on; Mamba's
/// selective scan, its sizes the defaults' and others (a narrower state,
/// a wider step rank, a shorter convolution without a bias, biased
/// projections, tied), and Falcon-Mamba's, each token's step, `B` and
/// `C` RMS-normalised without weights; Jamba's, those norms weighted,
/// beside a layer attending without positions (the first, or the
/// last), its MLPs dense, and experts (two of four a token, their
/// weights not renormalised) every other layer; Mamba-2's chunked scan,
/// its rows whole chunks and padded to them, its `B` and `C` in groups
/// of heads and one for all; Bamba's beside an attending layer and
/// its MLPs, and Granite 4.0's beside one, its shared MLP alone and
/// beside experts; PhiMoE's sparsemixer choosing two of four experts and
/// of six, its LayerNorms, biased and tied, in a window shorter than the
/// row, its input jittered; and Mixtral's and DBRX's routers' jitter; the
/// load-balancing loss of Mixtral's, Qwen3-MoE's (past its last layer of
/// experts too), PhiMoE's and GPT-OSS's routers; a mixture's dropouts,
/// DBRX's (its attention's, its experts' output's, its embeddings') and
/// Qwen2-MoE's attention's; Falcon's, of its parallel sublayers' sum (7B's,
/// 40B's) and of each sublayer's output (sequential, and Falcon-RW's);
/// Falcon-H1's attention beside Mamba-2's scan, every multiplier other
/// than 1, its gated norm over two groups gated after it and over one
/// gated before, and no norm, biased and tied; Aria's stacked experts
/// chosen by a softmax of the top `k` logits beside its shared MLP (of
/// one expert's width, and of two, biased, GELU-gated, its attention's
/// dropout on, tied).
const COUNTED: &[(&str, &str)] = &[
    ("llama", r#", "attention_bias": true, "mlp_bias": true"#),
    ("mistral", r#", "head_dim": 24, "sliding_window": 32"#),
    ("qwen2", ""),
    ("mistral", r#", "sliding_window": 16"#),
    (
        "granite",
        r#", "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.03, "logits_scaling": 8.0"#,
    ),
    ("qwen3", r#", "head_dim": 24"#),
    ("gemma", r#", "head_dim": 24"#),
    (
        "phi3",
        r#", "partial_rotary_factor": 0.75, "pad_token_id": 96"#,
    ),
    (
        "smollm3",
        r#", "no_rope_layer_interval": 2, "pad_token_id": 96"#,
    ),
    (
        "mixtral",
        r#", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": null"#,
    ),
    (
        "qwen3_moe",
        r#", "head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1]"#,
    ),
    (
        "gemma2",
        r#", "head_dim": 24, "sliding_window": 32, "query_pre_attn_scalar": 24, "attn_logit_softcapping": null, "final_logit_softcapping": null"#,
    ),
    (
        "gemma2",
        r#", "head_dim": 24, "sliding_window": 16, "query_pre_attn_scalar": 24"#,
    ),
    ("olmo2", r#", "pad_token_id": 96"#),
    (
        "olmo3",
        r#", "pad_token_id": 96, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]"#,
    ),
    (
        "gemma3_text",
        r#", "head_dim": 24, "sliding_window": 16, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24"#,
    ),
    (
        "ministral",
        r#", "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]"#,
    ),
    (
        "seed_oss",
        r#", "attention_dropout": 0.0, "residual_dropout": 0.0, "attention_out_bias": true"#,
    ),
    (
        "exaone4",
        r#", "head_dim": 24, "sliding_window": 16, "sliding_window_pattern": 3"#,
    ),
    ("arcee", ""),
    ("starcoder2", r#", "sliding_window": 16"#),
    ("nemotron", r#", "head_dim": 24"#),
    ("ernie4_5", r#", "use_bias": true"#),
    ("helium", r#", "attention_bias": true, "head_dim": 16"#),
    ("glm", r#", "pad_token_id": 96"#),
    ("glm4", r#", "head_dim": 24, "pad_token_id": 96"#),
    (
        "hunyuan_v1_dense",
        r#", "head_dim": 24, "pad_token_id": 96"#,
    ),
    ("olmo", r#", "clip_qkv": 0.5, "pad_token_id": 96"#),
    (
        "cohere",
        r#", "pad_token_id": 96, "bos_token_id": 95, "eos_token_id": 94"#,
    ),
    (
        "cohere2",
        r#", "pad_token_id": 96, "bos_token_id": 95, "eos_token_id": 94, "sliding_window": 16, "sliding_window_pattern": 2"#,
    ),
    ("stablelm", r#", "use_qkv_bias": true, "pad_token_id": 96"#),
    (
        "stablelm",
        r#", "use_parallel_residual": true, "pad_token_id": 96"#,
    ),
    (
        "stablelm",
        r#", "use_parallel_residual": true, "qk_layernorm": true, "pad_token_id": 96"#,
    ),
    (
        "cohere",
        r#", "use_qk_norm": true, "pad_token_id": 96, "bos_token_id": 95, "eos_token_id": 94"#,
    ),
    ("persimmon", r#", "num_key_value_heads": 4"#),
    (
        "qwen2_moe",
        r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80, "mlp_only_layers": [1]"#,
    ),
    (
        "granitemoe",
        r#", "num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.03, "logits_scaling": 8.0"#,
    ),
    (
        "ernie4_5_moe",
        r#", "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 48, "moe_num_shared_experts": 1, "pad_token_id": 96"#,
    ),
    (
        "hunyuan_v1_moe",
        r#", "head_dim": 24, "num_experts": 4, "moe_topk": 2, "pad_token_id": 96"#,
    ),
    (
        "glm4_moe",
        r#", "head_dim": 24, "partial_rotary_factor": 0.5, "attention_bias": true, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 48, "first_k_dense_replace": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5, "pad_token_id": 96"#,
    ),
    (
        "glm4_moe",
        r#", "use_qk_norm": true, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 48, "first_k_dense_replace": 0, "norm_topk_prob": false, "pad_token_id": 96"#,
    ),
    (
        "dots1",
        r#", "head_dim": 24, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 48, "first_k_dense_replace": 1, "norm_topk_prob": true, "pad_token_id": 96"#,
    ),
    (
        "olmoe",
        r#", "num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 96"#,
    ),
    (
        "flex_olmo",
        r#", "num_experts": 4, "num_experts_per_tok": 3, "pad_token_id": 96"#,
    ),
    (
        "gpt_oss",
        r#", "head_dim": 24, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16, "pad_token_id": 96"#,
    ),
    (
        "deepseek_v3",
        r#", "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 48, "first_k_dense_replace": 1, "norm_topk_prob": true, "pad_token_id": 96"#,
    ),
    (
        "deepseek_v3",
        r#", "q_lora_rank": null, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 20, "rope_interleave": false, "attention_bias": true, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 2, "moe_intermediate_size": 48, "first_k_dense_replace": 0, "norm_topk_prob": false, "pad_token_id": 96"#,
    ),
    (
        "deepseek_v2",
        r#", "q_lora_rank": null, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2, "moe_intermediate_size": 48, "first_k_dense_replace": 1, "topk_method": "greedy", "pad_token_id": 96"#,
    ),
    (
        "deepseek_v2",
        r#", "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 48, "first_k_dense_replace": 0, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5, "pad_token_id": 96"#,
    ),
    (
        "llama4_text",
        r#", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 112, "interleave_moe_layer_step": 2, "attention_chunk_size": 16, "no_rope_layers": [1, 0, 1], "floor_scale": 4, "pad_token_id": 96"#,
    ),
    ("apertus", r#", "head_dim": 16, "pad_token_id": 96"#),
    (
        "vaultgemma",
        r#", "head_dim": 24, "sliding_window": 16, "query_pre_attn_scalar": 24"#,
    ),
    (
        "lfm2",
        r#", "layer_types": ["conv", "full_attention", "conv"], "block_auto_adjust_ff_dim": false, "pad_token_id": 96"#,
    ),
    (
        "lfm2",
        r#", "layer_types": ["conv", "conv", "full_attention"], "conv_L_cache": 4, "conv_bias": true, "head_dim": 24, "pad_token_id": 96"#,
    ),
    (
        "dbrx",
        r#", "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.3}, "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}"#,
    ),
    (
        "dbrx",
        r#", "attn_config": {"kv_n_heads": 2}, "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": null}"#,
    ),
    (
        "falcon",
        r#", "multi_query": true, "parallel_attn": true, "bias": false, "alibi": false, "new_decoder_architecture": false"#,
    ),
    (
        "falcon",
        r#", "num_kv_heads": 2, "new_decoder_architecture": true, "bias": true, "alibi": false"#,
    ),
    (
        "falcon",
        r#", "num_kv_heads": 1, "new_decoder_architecture": true, "num_ln_in_parallel_attn": 1, "alibi": false"#,
    ),
    (
        "falcon",
        r#", "multi_query": false, "parallel_attn": false, "bias": true, "alibi": false, "new_decoder_architecture": false"#,
    ),
    (
        "granitemoeshared",
        r#", "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 80, "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.03, "logits_scaling": 8.0"#,
    ),
    (
        "llama4_text",
        r#", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "interleave_moe_layer_step": 1, "use_qk_norm": false, "attn_temperature_tuning": false, "no_rope_layers": [0, 1, 1], "pad_token_id": 96"#,
    ),
    ("llama", r#", "attention_dropout": 0.1"#),
    (
        "starcoder2",
        r#", "sliding_window": 16, "residual_dropout": 0.1, "embedding_dropout": 0.1, "attention_dropout": 0.1"#,
    ),
    ("seed_oss", ""),
    ("phi3", r#", "resid_pdrop": 0.1, "pad_token_id": 96"#),
    ("stablelm", r#", "hidden_dropout": 0.1, "pad_token_id": 96"#),
    (
        "opt",
        r#", "num_key_value_heads": 4, "ffn_dim": 176, "dropout": 0.0, "pad_token_id": 96"#,
    ),
    (
        "opt",
        r#", "num_key_value_heads": 4, "ffn_dim": 176, "pad_token_id": 96"#,
    ),
    (
        "opt",
        r#", "num_key_value_heads": 4, "ffn_dim": 176, "do_layer_norm_before": false, "word_embed_proj_dim": 32, "pad_token_id": 96"#,
    ),
    (
        "opt",
        r#", "num_key_value_heads": 4, "ffn_dim": 176, "_remove_final_layer_norm": true, "dropout": 0.0, "pad_token_id": 96"#,
    ),
    (
        "opt",
        r#", "num_key_value_heads": 4, "ffn_dim": 176, "word_embed_proj_dim": 32, "pad_token_id": 96"#,
    ),
    (
        "gpt_bigcode",
        r#", "n_embd": 64, "n_head": 4, "n_layer": 3, "n_positions": 128, "n_inner": 176, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0"#,
    ),
    (
        "gpt_bigcode",
        r#", "n_embd": 64, "n_head": 4, "n_layer": 3, "n_positions": 128, "n_inner": 176, "multi_query": false, "scale_attn_weights": false"#,
    ),
    (
        "gptj",
        r#", "n_embd": 64, "n_head": 4, "n_layer": 3, "n_positions": 128, "n_inner": 176, "rotary_dim": 8"#,
    ),
    (
        "gptj",
        r#", "n_embd": 64, "n_head": 4, "n_layer": 3, "n_positions": 128, "n_inner": 176, "rotary_dim": 16, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "attn_pdrop": 0.1"#,
    ),
    (
        "codegen",
        r#", "n_embd": 64, "n_head": 8, "n_layer": 3, "n_positions": 128, "n_inner": 176, "rotary_dim": 4"#,
    ),
    (
        "gpt_neo",
        r#", "num_layers": 3, "num_heads": 4, "window_size": 16, "attention_types": [[["global", "local"], 1], [["local"], 1]]"#,
    ),
    (
        "gpt_neo",
        r#", "num_layers": 3, "num_heads": 4, "window_size": 32, "attention_types": [[["local", "global", "global"], 1]], "embed_dropout": 0.1, "resid_dropout": 0.1, "attention_dropout": 0.1"#,
    ),
    ("mpt", r#", "num_key_value_heads": 4"#),
    (
        "mpt",
        r#", "num_key_value_heads": 4, "no_bias": false, "attn_config": {"clip_qkv": 0.5}"#,
    ),
    (
        "mpt",
        r#", "num_key_value_heads": 4, "attn_config": {"attn_pdrop": 0.1}"#,
    ),
    (
        "bloom",
        r#", "n_layer": 3, "n_head": 4, "num_key_value_heads": 4"#,
    ),
    (
        "bloom",
        r#", "n_layer": 3, "n_head": 4, "num_key_value_heads": 4, "attention_dropout": 0.1, "hidden_dropout": 0.1"#,
    ),
    (
        "falcon",
        r#", "num_attention_heads": 4, "multi_query": false, "parallel_attn": false, "bias": true, "alibi": true, "new_decoder_architecture": false"#,
    ),
    (
        "openai-gpt",
        r#", "n_embd": 64, "n_head": 4, "n_layer": 3, "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0"#,
    ),
    (
        "openai-gpt",
        r#", "n_embd": 64, "n_head": 4, "n_layer": 3, "n_positions": 128, "afn": "gelu""#,
    ),
    (
        "biogpt",
        r#", "num_key_value_heads": 4, "pad_token_id": 96"#,
    ),
    (
        "biogpt",
        r#", "num_key_value_heads": 4, "scale_embedding": false, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": 96"#,
    ),
    (
        "xglm",
        r#", "num_key_value_heads": 4, "ffn_dim": 176, "pad_token_id": 96"#,
    ),
    (
        "xglm",
        r#", "num_key_value_heads": 4, "ffn_dim": 176, "dropout": 0.0, "attention_dropout": 0.0, "pad_token_id": 96"#,
    ),
    ("bitnet", r#", "attention_bias": true"#),
    ("diffllama", ""),
    (
        "diffllama",
        r#", "num_attention_heads": 8, "attention_bias": true"#,
    ),
    (
        "ctrl",
        r#", "n_embd": 64, "dff": 176, "n_layer": 3, "n_head": 4, "num_key_value_heads": 4, "n_positions": 128"#,
    ),
    (
        "ctrl",
        r#", "n_embd": 64, "dff": 176, "n_layer": 3, "n_head": 4, "num_key_value_heads": 4, "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0"#,
    ),
    (
        "gpt_neox_japanese",
        r#", "intermediate_multiple_size": 2.75, "num_key_value_heads": 4, "rotary_pct": 0.5, "attention_dropout": 0.0, "hidden_dropout": 0.0"#,
    ),
    (
        "gpt_neox_japanese",
        r#", "intermediate_multiple_size": 2.75, "num_key_value_heads": 4, "attention_dropout": 0.1, "hidden_dropout": 0.1, "tie_word_embeddings": true"#,
    ),
    (
        "modernbert-decoder",
        r#", "intermediate_size": 88, "num_key_value_heads": 4, "local_attention": 8, "global_attn_every_n_layers": 2, "pad_token_id": 95, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2, "embedding_dropout": 0.0, "attention_dropout": 0.0"#,
    ),
    (
        "modernbert-decoder",
        r#", "intermediate_size": 88, "num_key_value_heads": 4, "local_attention": 8, "global_attn_every_n_layers": 2, "pad_token_id": 95, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2, "embedding_dropout": 0.1, "attention_dropout": 0.1"#,
    ),
    (
        "modernbert-decoder",
        r#", "intermediate_size": 88, "num_key_value_heads": 4, "pad_token_id": 95, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2, "tie_word_embeddings": true"#,
    ),
    ("doge", r#", "keep_window_size": 6"#),
    (
        "doge",
        r#", "keep_window_size": 30, "sliding_window": 8, "attention_bias": true, "hidden_dropout": 0.1, "tie_word_embeddings": true"#,
    ),
    ("mamba", r#", "intermediate_size": 128"#),
    (
        "mamba",
        r#", "intermediate_size": 128, "state_size": 8, "time_step_rank": 8, "conv_kernel": 2, "use_bias": true, "use_conv_bias": false, "tie_word_embeddings": true"#,
    ),
    ("falcon_mamba", r#", "intermediate_size": 128"#),
    (
        "falcon_mamba",
        r#", "intermediate_size": 128, "state_size": 8, "time_step_rank": 8, "mixer_rms_eps": 1e-3, "tie_word_embeddings": true"#,
    ),
    (
        "jamba",
        r#", "num_experts": 1, "attn_layer_period": 3, "attn_layer_offset": 0, "mamba_d_state": 16"#,
    ),
    (
        "jamba",
        r#", "num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 3, "attn_layer_offset": 2, "mamba_d_state": 8, "mamba_dt_rank": 8, "mamba_d_conv": 3, "mamba_proj_bias": true"#,
    ),
    (
        "mamba2",
        r#", "num_heads": 8, "head_dim": 16, "state_size": 12, "n_groups": 2, "chunk_size": 8"#,
    ),
    (
        "mamba2",
        r#", "num_heads": 4, "head_dim": 32, "state_size": 16, "n_groups": 1, "chunk_size": 10, "conv_kernel": 3, "use_bias": true, "use_conv_bias": false, "tie_word_embeddings": true"#,
    ),
    (
        "bamba",
        r#", "attn_layer_indices": [2], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 12, "mamba_n_groups": 2, "mamba_chunk_size": 8"#,
    ),
    (
        "granitemoehybrid",
        r#", "layer_types": ["mamba", "mamba", "attention"], "num_local_experts": 0, "shared_intermediate_size": 176, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 12, "mamba_n_groups": 2, "mamba_chunk_size": 8"#,
    ),
    (
        "granitemoehybrid",
        r#", "layer_types": ["attention", "mamba", "mamba"], "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 96, "intermediate_size": 48, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16, "position_embedding_type": "rope""#,
    ),
    (
        "phimoe",
        r#", "num_local_experts": 4, "sliding_window": null"#,
    ),
    (
        "phimoe",
        r#", "num_local_experts": 6, "attention_bias": true, "lm_head_bias": true, "sliding_window": 16, "router_jitter_noise": 0.3, "input_jitter_noise": 0.01, "tie_word_embeddings": true"#,
    ),
    (
        "mixtral",
        r#", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": null, "router_jitter_noise": 0.1"#,
    ),
    (
        "dbrx",
        r#", "attn_config": {"kv_n_heads": 2}, "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2, "moe_jitter_eps": 0.1}"#,
    ),
    (
        "mixtral",
        r#", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": null, "output_router_logits": true"#,
    ),
    (
        "qwen3_moe",
        r#", "head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": true, "mlp_only_layers": [2], "output_router_logits": true"#,
    ),
    (
        "phimoe",
        r#", "num_local_experts": 4, "output_router_logits": true"#,
    ),
    (
        "gpt_oss",
        r#", "head_dim": 24, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16, "pad_token_id": 96, "output_router_logits": true"#,
    ),
    (
        "dbrx",
        r#", "attn_config": {"kv_n_heads": 2, "attn_pdrop": 0.1, "clip_qkv": 0.3}, "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}, "resid_pdrop": 0.1, "emb_pdrop": 0.1"#,
    ),
    (
        "qwen2_moe",
        r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80, "mlp_only_layers": [1], "attention_dropout": 0.1"#,
    ),
    (
        "falcon_h1",
        r#", "intermediate_size": 128, "mamba_d_ssm": 96, "mamba_n_heads": 6, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 5, "mamba_rms_norm": true, "projectors_bias": true, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "mlp_multipliers": [0.8, 1.3], "key_multiplier": 0.7, "attention_in_multiplier": 1.2, "attention_out_multiplier": 0.9, "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.05], "ssm_in_multiplier": 1.3, "ssm_out_multiplier": 0.6"#,
    ),
    (
        "falcon_h1",
        r#", "intermediate_size": 96, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 6, "mamba_rms_norm": true, "mamba_norm_before_gate": true, "attention_bias": true, "tie_word_embeddings": true"#,
    ),
    (
        "falcon_h1",
        r#", "intermediate_size": 128, "mamba_d_ssm": 96, "mamba_n_heads": 6, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 5"#,
    ),
    (
        "aria_text",
        r#", "moe_num_experts": 4, "moe_topk": 2, "moe_intermediate_size": 48, "moe_num_shared_experts": 1"#,
    ),
    (
        "aria_text",
        r#", "moe_num_experts": 6, "moe_topk": 3, "moe_intermediate_size": 40, "moe_num_shared_experts": 2, "mlp_bias": true, "hidden_act": "gelu", "attention_dropout": 0.1, "tie_word_embeddings": true"#,
    ),
    (
        "falcon",
        r#", "multi_query": true, "parallel_attn": true, "bias": false, "alibi": false, "new_decoder_architecture": false, "hidden_dropout": 0.1, "attention_dropout": 0.1"#,
    ),
    (
        "falcon",
        r#", "num_kv_heads": 2, "new_decoder_architecture": true, "bias": true, "alibi": false, "hidden_dropout": 0.1"#,
    ),
    (
        "falcon",
        r#", "multi_query": false, "parallel_attn": false, "bias": true, "alibi": false, "new_decoder_architecture": false, "hidden_dropout": 0.1, "attention_dropout": 0.1"#,
    ),
    (
        "falcon",
        r#", "num_attention_heads": 4, "multi_query": false, "parallel_attn": false, "bias": true, "alibi": true, "new_decoder_architecture": false, "hidden_dropout": 0.1, "attention_dropout": 0.1"#,
    ),
];

#[test]
fn a_forward_holds_what_the_estimate_says_for_its_backward() {
    let _t = turn();
    track_allocations().unwrap();
    let tokens = tokens();
    for (model_type, extra) in COUNTED {
        let c = LlamaConfig::from_hf_dir(config(model_type, extra)).unwrap();
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            for recompute in [false, true] {
                let (vs, model) = built(&c, kind, recompute, None);
                let (held, loss) = held_by(|| model.loss(&tokens));
                let want =
                    held_for_backward(&c, (ROWS as u64, SEQ as u64), kind, (recompute, true), None);
                assert_eq!(
                    Some(held),
                    want,
                    "{model_type} in {kind:?}, recomputing: {recompute}"
                );
                // And the backward these tensors were kept for runs.
                loss.backward();
                assert!(vs.trainable_variables().iter().all(|v| v.grad().defined()));
            }
        }
    }
}

#[test]
fn lora_on_a_frozen_base_holds_what_the_estimate_says() {
    // The adapters' parameters are counted as the model holds them. And
    // which tensors a layer keeps follows from which need a gradient:
    // adapters on every linear layer, on the attention's alone, on the
    // MLP's alone, on one layer of three (below it nothing needs one),
    // ranks by pattern.
    let _t = turn();
    track_allocations().unwrap();
    let tokens = tokens();
    let lora = |targets: &[&str]| zrt::lora::LoraConfig::new(8, 16.0, targets);
    let on_layer_1 = zrt::lora::LoraConfig {
        layers_to_transform: vec![1],
        ..lora(&["q_proj", "down_proj"])
    };
    let ranked = zrt::lora::LoraConfig {
        rank_pattern: vec![("v_proj".into(), 3), ("up_proj".into(), 5)],
        ..lora(&["all-linear"])
    };
    // LoRA's dropout: each adapter keeps its own dropped input, and its
    // mask where the input needs a gradient (not below the first
    // adapter, on layer 1).
    let dropped = |p: f64, l: &zrt::lora::LoraConfig| zrt::lora::LoraConfig {
        dropout: p,
        ..l.clone()
    };
    let cases = [
        lora(&["all-linear"]),
        lora(&["q_proj", "v_proj"]),
        lora(&["o_proj"]),
        lora(&["gate_proj"]),
        lora(&["up_proj", "down_proj"]),
        dropped(0.1, &on_layer_1),
        on_layer_1,
        dropped(0.05, &ranked),
        ranked,
        dropped(
            0.1,
            &lora(&["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
        ),
    ];
    // The same targets under a family's own names: Phi-3's fused
    // projections, Mixtral's experts' matrices, GLM's fused gate and up,
    // StarCoder2's GPT-2 names; Arcee, Nemotron and Apertus have no gate.
    let renamed = |renames: &[(&[&str], &str)]| -> Vec<zrt::lora::LoraConfig> {
        let rename = |l: &zrt::lora::LoraConfig| {
            let mut l = l.clone();
            let modules =
                (l.target_modules.iter_mut()).chain(l.rank_pattern.iter_mut().map(|(m, _)| m));
            for m in modules {
                if let Some((_, to)) = renames.iter().find(|(from, _)| from.contains(&m.as_str())) {
                    *m = to.to_string();
                }
            }
            l.target_modules.dedup();
            l
        };
        cases.iter().map(rename).collect()
    };
    let phi3_cases = renamed(&[
        (&["q_proj", "k_proj", "v_proj"], "qkv_proj"),
        (&["gate_proj", "up_proj"], "gate_up_proj"),
    ]);
    let mixtral_cases = renamed(&[
        (&["gate_proj"], "w1"),
        (&["up_proj"], "w3"),
        (&["down_proj"], "w2"),
    ]);
    let arcee_cases = renamed(&[(&["gate_proj"], "up_proj")]);
    let glm_cases = renamed(&[(&["gate_proj", "up_proj"], "gate_up_proj")]);
    let persimmon_cases = renamed(&[
        (&["q_proj", "k_proj", "v_proj"], "query_key_value"),
        (&["o_proj"], "dense"),
        (&["gate_proj", "up_proj"], "dense_h_to_4h"),
        (&["down_proj"], "dense_4h_to_h"),
    ]);
    // GPT-OSS's MLP is its experts alone, whose matrices take adapters
    // through `target_parameters` (not counted): the MLP's targets moved
    // to the attention (Granite-MoE's too).
    let gpt_oss_cases = renamed(&[
        (&["gate_proj"], "k_proj"),
        (&["up_proj"], "v_proj"),
        (&["down_proj"], "o_proj"),
    ]);
    // Granite-MoE's experts are parameters too, its router a linear
    // layer (`router.layer`), whose adapter is not counted.
    let granite_moe_cases: Vec<_> = (gpt_oss_cases.iter().cloned())
        .chain([lora(&["layer"])])
        .collect();
    // A shared expert's first matrix alone, by a pattern of its whole
    // name, where each family has it (which no routed expert's
    // matches), beside the queries.
    let on_shared = zrt::lora::LoraConfig {
        target_pattern: Some(
            [
                r".*\.mlp\.(shared_experts?|shared_mlp)\.gate_proj",
                r".*\.feed_forward\.shared_expert\.gate_proj",
                r".*\.layers\.\d+\.shared_mlp\.input_linear",
            ]
            .join("|"),
        ),
        ..lora(&["q_proj"])
    };
    let moe_shared_cases: Vec<_> = (cases.iter().cloned()).chain([on_shared.clone()]).collect();
    // Qwen2-MoE's shared expert's gate alone, not counted either.
    let qwen2_moe_cases: Vec<_> = (moe_shared_cases.iter().cloned())
        .chain([lora(&["shared_expert_gate"])])
        .collect();
    // Granite-MoE-shared's shared MLP (`shared_mlp.input_linear`,
    // `output_linear`), not counted either.
    let granite_shared_cases: Vec<_> = (granite_moe_cases.iter().cloned())
        .chain([
            lora(&["input_linear"]),
            lora(&["output_linear"]),
            on_shared.clone(),
        ])
        .collect();
    // LFM2's layers under its own names, and its convolutions'
    // projections.
    let lfm2_cases: Vec<_> = (renamed(&[
        (&["gate_proj"], "w1"),
        (&["up_proj"], "w3"),
        (&["down_proj"], "w2"),
        (&["o_proj"], "out_proj"),
    ]))
    .into_iter()
    .chain([
        lora(&["in_proj"]),
        lora(&["in_proj", "w2"]),
        dropped(0.1, &lora(&["in_proj", "out_proj", "k_proj"])),
    ])
    .collect();
    // DBRX's attention under its own names (its MLP is experts alone,
    // stacked as rows: the MLP's targets moved to the attention), and
    // its router (`router.layer`), not counted.
    let dbrx_cases: Vec<_> = (renamed(&[
        (&["q_proj", "k_proj", "v_proj", "gate_proj"], "Wqkv"),
        (&["o_proj", "up_proj", "down_proj"], "out_proj"),
    ]))
    .into_iter()
    .chain([
        lora(&["layer"]),
        // A pattern naming the projection's path.
        zrt::lora::LoraConfig {
            rank_pattern: vec![("norm_attn_norm.attn.Wqkv".into(), 3)],
            ..lora(&["Wqkv", "out_proj"])
        },
    ])
    .collect();
    // Falcon's names are Persimmon's, its attention `self_attention`.
    let falcon_cases: Vec<_> = (persimmon_cases.iter().cloned())
        .chain([zrt::lora::LoraConfig {
            rank_pattern: vec![("self_attention.dense".into(), 3)],
            ..lora(&["query_key_value", "dense"])
        }])
        .collect();
    // ModernBERT-decoder's `Wo` (the attention's and the MLP's) and
    // `Wi`, the attention's output alone by a pattern of its path; and
    // the dense layer before its head (`lm_head.dense`), alone (its
    // adapter alone needing the logits' gradient) and beside the
    // queries.
    let modernbert_cases: Vec<_> = (renamed(&[
        (&["gate_proj", "up_proj"], "Wi"),
        (&["o_proj", "down_proj"], "Wo"),
    ]))
    .into_iter()
    .chain([
        zrt::lora::LoraConfig {
            target_pattern: Some(r"model\.layers\.\d+\.attn\.Wo".into()),
            ..lora(&[])
        },
        lora(&["dense"]),
        dropped(0.1, &lora(&["dense", "q_proj"])),
    ])
    .collect();
    // Doge's dynamic mask's `dt_proj` (reading the values), beside the
    // queries.
    let doge_cases: Vec<_> = (cases.iter().cloned())
        .chain([
            lora(&["dt_proj", "q_proj"]),
            dropped(0.1, &lora(&["q_proj", "v_proj", "dt_proj"])),
        ])
        .collect();
    // Mamba's scan's projections each alone, beside another, on one
    // layer, ranked by a pattern, under LoRA's dropout (`dt_proj`'s
    // input a part of `x_proj`'s output).
    let mamba_cases = [
        lora(&["all-linear"]),
        lora(&["in_proj"]),
        lora(&["x_proj"]),
        lora(&["dt_proj"]),
        lora(&["out_proj"]),
        lora(&["x_proj", "out_proj"]),
        zrt::lora::LoraConfig {
            layers_to_transform: vec![1],
            ..lora(&["dt_proj", "in_proj"])
        },
        zrt::lora::LoraConfig {
            rank_pattern: vec![("mixer.x_proj".into(), 3)],
            ..lora(&["x_proj", "dt_proj"])
        },
        dropped(0.1, &lora(&["all-linear"])),
        dropped(0.1, &lora(&["dt_proj", "out_proj"])),
    ];
    // Mamba-2's `in_proj` and `out_proj`, alone, together, on one layer,
    // under LoRA's dropout.
    let mamba2_cases = [
        lora(&["all-linear"]),
        lora(&["in_proj"]),
        lora(&["out_proj"]),
        zrt::lora::LoraConfig {
            layers_to_transform: vec![1],
            ..lora(&["in_proj", "out_proj"])
        },
        dropped(0.1, &lora(&["in_proj", "out_proj"])),
        dropped(0.1, &lora(&["out_proj"])),
    ];
    // Bamba's: its scan's, its attention's, its MLP's (under
    // `feed_forward`); Granite 4.0's shared MLP's (`input_linear`,
    // `output_linear`, counted where there are no experts).
    let mamba2_hybrid_cases: Vec<_> = (mamba2_cases.iter().cloned())
        .chain([
            lora(&["q_proj", "v_proj", "gate_proj", "down_proj"]),
            lora(&["input_linear", "in_proj"]),
            lora(&["output_linear", "k_proj"]),
            zrt::lora::LoraConfig {
                rank_pattern: vec![("feed_forward.up_proj".into(), 3)],
                ..lora(&["up_proj", "o_proj", "out_proj"])
            },
            dropped(
                0.1,
                &lora(&["in_proj", "k_proj", "input_linear", "up_proj"]),
            ),
            on_shared.clone(),
        ])
        .collect();
    // Falcon-H1's Mamba's beside its attention: `in_proj` and
    // `out_proj` alone, beside the attention's and the MLP's, on one
    // layer, ranked by a pattern, under LoRA's dropout.
    let falcon_h1_cases: Vec<_> = (cases.iter().cloned())
        .chain([
            lora(&["in_proj"]),
            lora(&["out_proj"]),
            lora(&["in_proj", "k_proj", "up_proj"]),
            zrt::lora::LoraConfig {
                layers_to_transform: vec![1],
                ..lora(&["out_proj", "gate_proj"])
            },
            zrt::lora::LoraConfig {
                rank_pattern: vec![("mamba.in_proj".into(), 3)],
                ..lora(&["in_proj", "out_proj", "o_proj"])
            },
            dropped(0.1, &lora(&["in_proj", "out_proj", "v_proj"])),
        ])
        .collect();
    // Jamba's: its scan's, its attention's, its MLP's (under
    // `feed_forward`, and its experts' and router, not counted).
    let jamba_cases: Vec<_> = (mamba_cases.iter().cloned())
        .chain([
            lora(&["q_proj", "v_proj", "o_proj", "gate_proj"]),
            lora(&["x_proj", "down_proj"]),
            lora(&["router", "in_proj"]),
            zrt::lora::LoraConfig {
                rank_pattern: vec![("feed_forward.up_proj".into(), 3)],
                ..lora(&["up_proj", "k_proj", "dt_proj"])
            },
            dropped(0.1, &lora(&["in_proj", "k_proj", "up_proj"])),
        ])
        .collect();
    // GPT-NeoX-Japanese's names are Persimmon's, its attention
    // `attention`.
    let neox_japanese_cases: Vec<_> = (persimmon_cases.iter().cloned())
        .chain([zrt::lora::LoraConfig {
            rank_pattern: vec![("attention.dense".into(), 3)],
            ..lora(&["query_key_value", "dense"])
        }])
        .collect();
    // Aria's router (`mlp.router`) alone.
    let aria_cases: Vec<_> = (moe_shared_cases.iter().cloned())
        .chain([lora(&["router"])])
        .collect();
    // Hunyuan's router (`gate.wg`) alone.
    let hunyuan_moe_cases: Vec<_> = (moe_shared_cases.iter().cloned())
        .chain([lora(&["wg"])])
        .collect();
    // OPT's fairseq names: `out_proj`, and `fc1` and `fc2` for the MLP.
    let opt_cases = renamed(&[
        (&["gate_proj", "up_proj"], "fc1"),
        (&["down_proj"], "fc2"),
        (&["o_proj"], "out_proj"),
    ]);
    // OPT-350m's projections in and out of the layers' width, alone
    // (the first making every layer's input need a gradient), together
    // beside a layer's, under LoRA's dropout.
    let opt_projected_cases: Vec<_> = (opt_cases.iter().cloned())
        .chain([
            lora(&["project_in"]),
            lora(&["project_out"]),
            lora(&["project_in", "project_out", "out_proj"]),
            dropped(0.1, &lora(&["project_in", "project_out", "fc1"])),
        ])
        .collect();
    // GPT-BigCode's GPT-2 names, the attention's output projection
    // alone by a pattern of its path (`c_proj` names the MLP's too).
    let bigcode_cases: Vec<_> = (renamed(&[
        (&["q_proj", "k_proj", "v_proj"], "c_attn"),
        (&["gate_proj", "up_proj"], "c_fc"),
        (&["o_proj", "down_proj"], "c_proj"),
    ]))
    .into_iter()
    .chain([zrt::lora::LoraConfig {
        target_pattern: Some(r".*\.attn\.c_proj".into()),
        ..lora(&["c_fc"])
    }])
    .collect();
    // CTRL's `Wq`, `Wk`, `Wv` and `dense`, its MLP's `ffn.0` and
    // `ffn.2`; its keys alone by a pattern of their path.
    let ctrl_cases: Vec<_> = (renamed(&[
        (&["q_proj"], "Wq"),
        (&["k_proj"], "Wk"),
        (&["v_proj"], "Wv"),
        (&["o_proj"], "dense"),
        (&["gate_proj", "up_proj"], "ffn.0"),
        (&["down_proj"], "ffn.2"),
    ]))
    .into_iter()
    .chain([zrt::lora::LoraConfig {
        target_pattern: Some(r"transformer\.h\.\d+\.multi_head_attention\.Wk".into()),
        ..lora(&[])
    }])
    .collect();
    // GPT-J's `out_proj`, `fc_in` and `fc_out`, and its keys alone by a
    // pattern of their path; CodeGen's queries, keys and values one
    // `qkv_proj`.
    let gptj_cases: Vec<_> = (renamed(&[
        (&["gate_proj", "up_proj"], "fc_in"),
        (&["down_proj"], "fc_out"),
        (&["o_proj"], "out_proj"),
    ]))
    .into_iter()
    .chain([zrt::lora::LoraConfig {
        target_pattern: Some(r"transformer\.h\.\d+\.attn\.k_proj".into()),
        ..lora(&["fc_out"])
    }])
    .collect();
    let codegen_cases = renamed(&[
        (&["q_proj", "k_proj", "v_proj"], "qkv_proj"),
        (&["gate_proj", "up_proj"], "fc_in"),
        (&["down_proj"], "fc_out"),
        (&["o_proj"], "out_proj"),
    ]);
    // MPT's `Wqkv`, `out_proj` and ungated `ffn`.
    // An adapter on the last layer's MLP alone: no layer attends with
    // a gradient, and ALiBi's mask (Llama 4's chunks', below) is held
    // all the same.
    let last_mlp = zrt::lora::LoraConfig {
        layers_to_transform: vec![2],
        ..lora(&["down_proj"])
    };
    let mpt_cases: Vec<_> = (renamed(&[
        (&["q_proj", "k_proj", "v_proj"], "Wqkv"),
        (&["gate_proj"], "up_proj"),
        (&["o_proj"], "out_proj"),
    ]))
    .into_iter()
    .chain([last_mlp.clone()])
    .collect();
    // GPT-Neo's `out_proj`, `c_fc` and `c_proj`.
    let gpt_neo_cases = renamed(&[
        (&["gate_proj", "up_proj"], "c_fc"),
        (&["down_proj"], "c_proj"),
        (&["o_proj"], "out_proj"),
    ]);
    let starcoder2_cases = renamed(&[
        (&["gate_proj", "up_proj"], "c_fc"),
        (&["down_proj"], "c_proj"),
    ]);
    // DeepSeek-V3's latent attention: the queries' bottleneck's second
    // projection and the latent's expansion in place of the queries' and
    // values', then each of its projections alone or beside another
    // reading one tensor, and the dense first layer's MLP (the others'
    // are experts, not counted); with one `q_proj`, the latent's first
    // projection in place of the values'.
    let on_layers = |layers: &[i64], targets: &[&str]| zrt::lora::LoraConfig {
        layers_to_transform: layers.to_vec(),
        ..lora(targets)
    };
    let dense_first = |targets: &[&str]| on_layers(&[0], targets);
    let latent_cases: Vec<_> = (renamed(&[(&["q_proj"], "q_b_proj"), (&["v_proj"], "kv_b_proj")]))
        .into_iter()
        .chain([
            lora(&["q_a_proj"]),
            lora(&["kv_a_proj_with_mqa"]),
            lora(&["q_a_proj", "kv_a_proj_with_mqa"]),
            dense_first(&["q_a_proj", "gate_proj", "down_proj"]),
            dropped(0.1, &lora(&["q_b_proj", "kv_b_proj", "o_proj"])),
            on_shared.clone(),
        ])
        .collect();
    let one_q_cases: Vec<_> = (renamed(&[(&["v_proj"], "kv_a_proj_with_mqa")]))
        .into_iter()
        .chain([
            lora(&["kv_b_proj"]),
            dense_first(&["up_proj", "q_proj"]),
            dropped(0.1, &lora(&["kv_b_proj", "q_proj"])),
            on_shared.clone(),
        ])
        .collect();
    // Llama 4's MLP targets in its dense layers alone (in a layer of
    // experts they name the shared expert's, not counted).
    // With the load-balancing loss, adapters past every layer of
    // experts alone: no routing needs a gradient.
    let balance_cases: Vec<_> = (cases.iter().cloned())
        .chain([on_layers(&[2], &["q_proj", "o_proj"])])
        .collect();
    let llama4_cases: Vec<_> = (cases.iter().cloned())
        .chain([
            on_layers(&[0, 2], &["gate_proj", "up_proj", "down_proj"]),
            on_layers(&[2], &["up_proj", "q_proj"]),
            last_mlp.clone(),
            // A pattern naming the module's path.
            zrt::lora::LoraConfig {
                rank_pattern: vec![("feed_forward.gate_proj".into(), 3)],
                ..on_layers(&[0, 2], &["gate_proj", "up_proj"])
            },
            dropped(
                0.1,
                &on_layers(&[0, 2], &["k_proj", "gate_proj", "down_proj"]),
            ),
            on_shared.clone(),
        ])
        .collect();
    for &(model_type, extra) in COUNTED {
        let c = LlamaConfig::from_hf_dir(config(model_type, extra)).unwrap();
        let cases = match model_type {
            "phi3" => &phi3_cases[..],
            "mixtral" | "phimoe" => &mixtral_cases[..],
            "arcee" | "nemotron" | "apertus" => &arcee_cases[..],
            "persimmon" => &persimmon_cases[..],
            "gpt_oss" => &gpt_oss_cases[..],
            "qwen3_moe" if extra.contains("output_router_logits") => &balance_cases[..],
            "qwen2_moe" => &qwen2_moe_cases[..],
            "granitemoe" => &granite_moe_cases[..],
            "granitemoeshared" => &granite_shared_cases[..],
            "hunyuan_v1_moe" => &hunyuan_moe_cases[..],
            "glm" | "glm4" => &glm_cases[..],
            "starcoder2" => &starcoder2_cases[..],
            "opt" if extra.contains("word_embed_proj_dim") => &opt_projected_cases[..],
            "opt" | "biogpt" | "xglm" => &opt_cases[..],
            "gpt_bigcode" | "openai-gpt" => &bigcode_cases[..],
            "ctrl" => &ctrl_cases[..],
            "gptj" => &gptj_cases[..],
            "codegen" => &codegen_cases[..],
            "gpt_neo" => &gpt_neo_cases[..],
            "mpt" => &mpt_cases[..],
            "deepseek_v3" | "deepseek_v2" if extra.contains(r#""q_lora_rank": null"#) => {
                &one_q_cases[..]
            }
            "deepseek_v3" | "deepseek_v2" => &latent_cases[..],
            "llama4_text" => &llama4_cases[..],
            "lfm2" => &lfm2_cases[..],
            "dbrx" => &dbrx_cases[..],
            "falcon" | "bloom" => &falcon_cases[..],
            "gpt_neox_japanese" => &neox_japanese_cases[..],
            "modernbert-decoder" => &modernbert_cases[..],
            "doge" => &doge_cases[..],
            "mamba" | "falcon_mamba" => &mamba_cases[..],
            "jamba" => &jamba_cases[..],
            "falcon_h1" => &falcon_h1_cases[..],
            "aria_text" => &aria_cases[..],
            "mamba2" => &mamba2_cases[..],
            "bamba" | "granitemoehybrid" => &mamba2_hybrid_cases[..],
            "glm4_moe" | "dots1" | "ernie4_5_moe" => &moe_shared_cases[..],
            _ => &cases[..],
        };
        for lora in cases {
            for kind in [Kind::Float, Kind::BFloat16] {
                for recompute in [false, true] {
                    let (vs, model) = built(&c, kind, recompute, Some(lora));
                    let trained = vs
                        .variables()
                        .into_iter()
                        .filter(|(_, t)| t.requires_grad());
                    let trained: Vec<(String, i64)> =
                        trained.map(|(n, t)| (n, t.numel() as i64)).collect();
                    let rows_seq = (ROWS as u64, SEQ as u64);
                    let want = held_for_backward(&c, rows_seq, kind, (recompute, true), Some(lora));
                    // Adapters on a mixture's router or experts are not
                    // counted, and said so.
                    let on_experts = (trained.iter()).any(|(n, _)| {
                        n.contains(".experts.")
                            || n.contains(".shared_expert")
                            || n.contains(".router.layer.")
                            || n.contains(".gate.wg.")
                            // (Granite 4.0's dense layers' MLP is their
                            // shared MLP.)
                            || (n.contains(".shared_mlp.") && c.moe.is_some())
                            || n.contains("_moe.gate.")
                            || n.contains(".feed_forward.router.")
                            || n.contains(".mlp.router.")
                            || n.contains("mlp.gate.lora")
                    });
                    if on_experts {
                        assert_eq!(adapter_params(&c, lora), None, "{model_type} {lora:?}");
                        assert_eq!(want, None, "{model_type} {lora:?}");
                        continue;
                    }
                    let trained: i64 = trained.iter().map(|(_, n)| n).sum();
                    assert_eq!(
                        adapter_params(&c, lora),
                        Some(trained as u64),
                        "{model_type}{extra} {lora:?}"
                    );
                    let (held, loss) = held_by(|| model.loss(&tokens));
                    assert_eq!(
                        Some(held),
                        want,
                        "{model_type} {:?} {:?} in {kind:?}, recomputing: {recompute}",
                        lora.target_modules,
                        lora.layers_to_transform
                    );
                    loss.backward();
                }
            }
        }
    }
}

/// GPT-NeoX's layers (Pythia's): side by side after a LayerNorm each,
/// a quarter of each head turned, and one after the other, all of each
/// head turned and no attention biases; the head apart, and tied; the
/// embeddings and each sublayer's output dropped out.
const GPT_NEOX: &[&str] = &[
    "",
    r#", "use_parallel_residual": false, "rotary_pct": 1.0, "attention_bias": false"#,
    r#", "rotary_pct": 0.5, "tie_word_embeddings": true"#,
    r#", "hidden_dropout": 0.1"#,
    r#", "hidden_dropout": 0.1, "attention_dropout": 0.1"#,
];

/// Phi's layers: half of each head turned over two key-value heads, and
/// a quarter of each of four, its queries and keys LayerNormed first;
/// each sublayer's output dropped out (phi-2's), and the embeddings.
const PHI: &[&str] = &[
    "",
    r#", "num_key_value_heads": 4, "partial_rotary_factor": 0.25, "qk_layernorm": true"#,
    r#", "resid_pdrop": 0.1"#,
    r#", "resid_pdrop": 0.1, "embd_pdrop": 0.1"#,
    r#", "attention_dropout": 0.1"#,
];

/// That the loss of a `$model` (a model the estimate counts apart from
/// the Llama family's) of the config `$c` holds what `$held` says, and
/// that LoRA's adapters train what `$params` says: whole, recomputed
/// and with the logits whole, in each dtype, under each of `$loras`.
macro_rules! holds_what_it_says {
    ($model:ident, ($held:path, $params:path), $c:expr, $loras:expr, $name:expr) => {{
        let (c, tokens) = ($c, tokens());
        let rows_seq = (ROWS as u64, SEQ as u64);
        for lora in $loras {
            for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
                for (recompute, fused) in [(false, true), (true, true), (false, false)] {
                    let (mut vs, model) = seeded(|| {
                        let vs = nn::VarStore::new(Device::Cpu);
                        let (root, plan) = (vs.root(), ShardPlan::new());
                        let m = match (lora, recompute) {
                            (Some(l), _) => $model::with_lora(&root, &plan, c, l, recompute),
                            (None, true) => $model::new_checkpointed(&root, &plan, c),
                            (None, false) => $model::new(&root, &plan, c),
                        };
                        (vs, m)
                    });
                    if let Some(l) = lora {
                        zrt::lora::freeze_base(&vs, l).unwrap();
                        let trained = (vs.variables().values())
                            .filter(|t| t.requires_grad())
                            .map(|t| t.numel() as u64)
                            .sum();
                        assert_eq!($params(c, l), Some(trained), "{} {l:?}", $name);
                    }
                    match kind {
                        Kind::BFloat16 => vs.bfloat16(),
                        Kind::Half => vs.half(),
                        _ => {}
                    }
                    model.set_training(true);
                    model.set_fused_loss(fused);
                    let (held, loss) = held_by(|| model.loss(&tokens));
                    assert_eq!(
                        Some(held),
                        $held(c, rows_seq, kind, (recompute, fused), lora.as_ref()),
                        "{} in {kind:?} under {:?}, recomputing: {recompute}, fused: {fused}",
                        $name,
                        lora.as_ref()
                            .map(|l| (&l.target_modules, &l.layers_to_transform))
                    );
                    loss.backward();
                }
            }
        }
    }};
}

#[test]
fn gpt_neox_holds_what_the_estimate_says() {
    // Under LoRA on every matrix, on the last alone (nothing below it
    // needs a gradient), and with dropout on one layer of three.
    use zrt::gpt_neox::{adapter_params, held_for_backward, GptNeox, GptNeoxConfig};
    use zrt::lora::LoraConfig;
    let _t = turn();
    track_allocations().unwrap();
    let every = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"];
    let loras = [
        None,
        Some(LoraConfig::new(8, 16.0, &every)),
        Some(LoraConfig::new(4, 8.0, &["dense_4h_to_h"])),
        Some(LoraConfig {
            layers_to_transform: vec![1],
            dropout: 0.1,
            ..LoraConfig::new(8, 16.0, &["query_key_value", "dense_h_to_4h"])
        }),
    ];
    let rows_seq = (ROWS as u64, SEQ as u64);
    for extra in GPT_NEOX {
        let c = GptNeoxConfig::from_hf_dir(config("gpt_neox", extra)).unwrap();
        let name = format!("gpt_neox{extra}");
        holds_what_it_says!(
            GptNeox,
            (held_for_backward, adapter_params),
            &c,
            &loras,
            name
        );
    }
    // A trained head is not a layer's adapter.
    let c = GptNeoxConfig::from_hf_dir(config("gpt_neox", "")).unwrap();
    let head = LoraConfig::new(8, 16.0, &["dense", "embed_out"]);
    let est = held_for_backward(&c, rows_seq, Kind::Float, (false, true), Some(&head));
    assert_eq!((est, adapter_params(&c, &head)), (None, None));
}

#[test]
fn phi_holds_what_the_estimate_says() {
    // Under LoRA on every matrix, on the queries and values (the MLP
    // beside them frozen), and with dropout on one layer of three.
    use zrt::lora::LoraConfig;
    use zrt::phi::{adapter_params, held_for_backward, Phi, PhiConfig};
    let _t = turn();
    track_allocations().unwrap();
    let loras = [
        None,
        Some(LoraConfig::new(8, 16.0, &["all-linear"])),
        Some(LoraConfig::new(4, 8.0, &["q_proj", "v_proj"])),
        Some(LoraConfig {
            layers_to_transform: vec![1],
            dropout: 0.1,
            ..LoraConfig::new(8, 16.0, &["k_proj", "dense", "fc2"])
        }),
    ];
    let rows_seq = (ROWS as u64, SEQ as u64);
    for extra in PHI {
        let c = PhiConfig::from_hf_dir(config("phi", extra)).unwrap();
        let name = format!("phi{extra}");
        holds_what_it_says!(Phi, (held_for_backward, adapter_params), &c, &loras, name);
    }
    // A trained head is not a layer's adapter.
    let c = PhiConfig::from_hf_dir(config("phi", "")).unwrap();
    let head = LoraConfig::new(8, 16.0, &["dense", "lm_head"]);
    let est = held_for_backward(&c, rows_seq, Kind::Float, (false, true), Some(&head));
    assert_eq!((est, adapter_params(&c, &head)), (None, None));
}

/// GPT-2's blocks 64 wide over 3 layers of 4 heads: without dropout,
/// with its own (0.1 each: the attention's weights, each block's
/// outputs, the embeddings), and with the blocks' outputs' alone and an
/// MLP 176 wide.
const GPT2: &[&str] = &[
    r#", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 128, "tie_word_embeddings": true, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0"#,
    r#", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 128, "tie_word_embeddings": true"#,
    r#", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 128, "n_inner": 176, "tie_word_embeddings": true, "embd_pdrop": 0.0, "attn_pdrop": 0.0"#,
];

#[test]
fn gpt2_holds_what_the_estimate_says() {
    // Under LoRA on every matrix, on the MLP's last alone, and with
    // LoRA's dropout on one layer of three.
    use zrt::gpt2::{adapter_params, held_for_backward, Gpt2, Gpt2Config};
    use zrt::lora::LoraConfig;
    let _t = turn();
    track_allocations().unwrap();
    let loras = [
        None,
        Some(LoraConfig::new(8, 16.0, &["c_attn", "c_proj", "c_fc"])),
        Some(LoraConfig {
            target_pattern: Some(r".*\.mlp\.c_proj".into()),
            ..LoraConfig::new(4, 8.0, &[])
        }),
        Some(LoraConfig {
            layers_to_transform: vec![1],
            dropout: 0.1,
            ..LoraConfig::new(8, 16.0, &["c_attn", "c_fc"])
        }),
    ];
    let rows_seq = (ROWS as u64, SEQ as u64);
    for extra in GPT2 {
        let c = Gpt2Config::from_hf_dir(config("gpt2", extra)).unwrap();
        let name = format!("gpt2{extra}");
        holds_what_it_says!(Gpt2, (held_for_backward, adapter_params), &c, &loras, name);
    }
    // A trained embedding (the head too) is not a block's adapter.
    let c = Gpt2Config::from_hf_dir(config("gpt2", GPT2[0])).unwrap();
    let head = LoraConfig::new(8, 16.0, &["c_attn", "wte"]);
    let est = held_for_backward(&c, rows_seq, Kind::Float, (false, true), Some(&head));
    assert_eq!((est, adapter_params(&c, &head)), (None, None));
}

#[test]
fn the_unfused_loss_keeps_its_logits_as_the_head_made_them() {
    // Taken whole, one row's predictions are a view of the head's
    // output, which the loss keeps whole; of more rows it keeps a copy
    // without each row's last position. Checked in each dtype, against
    // Gemma 2's capped logits, and beside the fused loss of one row.
    let _t = turn();
    track_allocations().unwrap();
    let capped = (COUNTED.iter())
        .find(|(t, extra)| *t == "gemma2" && !extra.contains("null"))
        .expect("a soft-capped Gemma 2 among the counted");
    for &(model_type, extra) in [&COUNTED[0], capped] {
        let c = LlamaConfig::from_hf_dir(config(model_type, extra)).unwrap();
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            for (rows, fused) in [(1, false), (ROWS, false), (1, true)] {
                let tokens = tokens().narrow(0, 0, rows);
                let (vs, model) = built(&c, kind, false, None);
                model.set_fused_loss(fused);
                let (held, loss) = held_by(|| model.loss(&tokens));
                let want =
                    held_for_backward(&c, (rows as u64, SEQ as u64), kind, (false, fused), None);
                assert_eq!(
                    Some(held),
                    want,
                    "{model_type} in {kind:?}, {rows} rows, fused {fused}"
                );
                loss.backward();
                assert!(vs.trainable_variables().iter().all(|v| v.grad().defined()));
            }
        }
    }
}

#[test]
fn the_fused_loss_keeps_its_logits_only_when_one_block_holds_them() {
    // Of 180000 words, one row's logits fit one block of the fused loss,
    // which then keeps their log-probabilities (and the soft cap's tanh)
    // for backward, as the unfused loss would; two rows' take two
    // blocks, and it keeps one number a position instead, or under LoRA
    // (the head frozen) the gradient of the head's input, which forward
    // computed.
    let _t = turn();
    track_allocations().unwrap();
    let vocab = 180_000;
    let one_row = SEQ as u64;
    assert!(keeps_logits(one_row, vocab) && !keeps_logits(ROWS as u64 * one_row, vocab));
    let capped = (COUNTED.iter())
        .find(|(t, extra)| *t == "gemma2" && !extra.contains("null"))
        .expect("a soft-capped Gemma 2 among the counted");
    for &(model_type, extra) in [&COUNTED[0], capped] {
        let extra = format!("{extra}, \"vocab_size\": {vocab}");
        let c = LlamaConfig::from_hf_dir(config(model_type, &extra)).unwrap();
        assert_eq!(
            c.vocab, vocab as i64,
            "the config's second vocab_size is read"
        );
        let lora = zrt::lora::LoraConfig::new(8, 16.0, &["all-linear"]);
        for kind in [Kind::Float, Kind::BFloat16] {
            for (rows, lora) in [
                (1, None),
                (ROWS, None),
                (1, Some(&lora)),
                (ROWS, Some(&lora)),
            ] {
                let tokens = tokens().narrow(0, 0, rows);
                let (vs, model) = built(&c, kind, false, lora);
                let (held, loss) = held_by(|| model.loss(&tokens));
                let want =
                    held_for_backward(&c, (rows as u64, SEQ as u64), kind, (false, true), lora);
                let at = format!(
                    "{model_type} in {kind:?}, {rows} rows, LoRA {}",
                    lora.is_some()
                );
                assert_eq!(Some(held), want, "{at}");
                loss.backward();
                assert!(
                    (vs.trainable_variables().iter())
                        .filter(|v| v.requires_grad())
                        .all(|v| v.grad().defined()),
                    "{at}"
                );
            }
        }
    }
}

#[test]
fn a_stage_3_engine_holds_no_more_than_the_model_alone() {
    let _t = turn();
    track_allocations().unwrap();
    let (model_type, extra) = COUNTED[0];
    let c = LlamaConfig::from_hf_dir(config(model_type, extra)).unwrap();
    let tokens = tokens();
    for (kind, dtype) in [(Kind::Float, ""), (Kind::BFloat16, BF16)] {
        let (vs, plan, model) = seeded(|| {
            let vs = nn::VarStore::new(Device::Cpu);
            let plan = ShardPlan::new();
            let m = Llama::new(&vs.root(), &plan, &c);
            (vs, plan, m)
        });
        let engine = solo_engine(&vs, &plan, &config_zero(3, 1, 0.0, dtype, "")).unwrap();
        model.set_training(true);
        for step in 0..2 {
            // Between steps the engine holds its state in its own
            // buffers; the forward's gathers are its own memory too.
            let (held, loss) = held_by(|| model.loss(&tokens));
            let want = held_for_backward(&c, (ROWS as u64, SEQ as u64), kind, (false, true), None);
            assert_eq!(Some(held), want, "{kind:?}, step {step}");
            engine.backward(&loss).unwrap();
            engine.step().unwrap();
        }
    }
}

#[test]
fn what_the_estimate_does_not_count_it_does_not_guess() {
    let c = |t: &str, extra: &str| LlamaConfig::from_hf_dir(config(t, extra)).unwrap();
    let rows_seq = (ROWS as u64, SEQ as u64);
    // Other families' layers save other tensors (Mamba-2's chunked scan
    // over a row within one chunk, where libtorch's einsum keeps views
    // in place of copies; BitNet's rounding to ternary weights and 8-bit
    // inputs); DeepSeek-V3's
    // values wider than its queries and keys take the attention that
    // keeps every score.
    let wide_values = r#", "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 20"#;
    let ternary = r#", "quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}"#;
    for (t, extra) in [
        (
            "mamba2",
            r#", "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "chunk_size": 24"#,
        ),
        ("deepseek_v3", wide_values),
        ("bitnet", ternary),
    ] {
        assert_eq!(
            held_for_backward(&c(t, extra), rows_seq, Kind::Float, (false, true), None),
            None,
            "{t}{extra}"
        );
    }
    // Doge's attention whose queries need no gradient computes its
    // scores whole, beside its dynamic mask: an adapter on the first
    // layer's values alone is not counted; with one on its queries too
    // it is.
    let doge = c("doge", r#", "keep_window_size": 6"#);
    let on_doge = |t: &[&str]| {
        let l = zrt::lora::LoraConfig::new(8, 16.0, t);
        held_for_backward(&doge, rows_seq, Kind::Float, (false, true), Some(&l))
    };
    assert_eq!(on_doge(&["v_proj"]), None);
    assert_eq!(on_doge(&["dt_proj"]), None);
    assert!(on_doge(&["q_proj", "v_proj"]).is_some());
    let llama = c("llama", "");
    let lora = zrt::lora::LoraConfig::new(8, 16.0, &["q_proj"]);
    let est = |l: &zrt::lora::LoraConfig| {
        held_for_backward(&llama, rows_seq, Kind::Float, (false, true), Some(l))
    };
    assert!(est(&lora).is_some());
    // DoRA keeps more; a trained head or token rows are not a layer's
    // adapters.
    for other in [
        zrt::lora::LoraConfig {
            use_dora: true,
            ..lora.clone()
        },
        zrt::lora::LoraConfig::new(8, 16.0, &["q_proj", "lm_head"]),
        zrt::lora::LoraConfig {
            modules_to_save: vec!["lm_head".into()],
            ..lora.clone()
        },
        zrt::lora::LoraConfig {
            trainable_token_indices: vec![3],
            ..lora.clone()
        },
    ] {
        assert_eq!(est(&other), None, "{other:?}");
        assert_eq!(adapter_params(&llama, &other), None, "{other:?}");
    }
    // An OPT's embedding under its own name (`model.decoder.`).
    let embedding = zrt::lora::LoraConfig::new(8, 16.0, &["q_proj", "embed_tokens"]);
    let opt = c("opt", r#", "num_key_value_heads": 4, "ffn_dim": 176"#);
    assert!(adapter_params(&opt, &lora).is_some());
    assert_eq!(adapter_params(&opt, &embedding), None);
    let embedding = zrt::lora::LoraConfig {
        target_pattern: Some(r"model\.decoder\.embed_tokens".into()),
        ..lora.clone()
    };
    assert_eq!(adapter_params(&opt, &embedding), None);
    // Dropouts where the count does not follow them: the weights' of an
    // attention not the fused kernel's (Gemma 2's soft-capped, GPT-OSS's
    // beside its sinks).
    for (t, dropout) in [
        (
            "gemma2",
            r#", "head_dim": 24, "query_pre_attn_scalar": 24, "attention_dropout": 0.1"#,
        ),
        (
            "gpt_oss",
            r#", "head_dim": 24, "num_local_experts": 4, "attention_dropout": 0.1"#,
        ),
    ] {
        assert_eq!(
            held_for_backward(&c(t, dropout), rows_seq, Kind::Float, (false, true), None),
            None,
            "{t}{dropout}"
        );
    }
    // Only the dtypes a model computes in.
    assert_eq!(
        held_for_backward(&llama, rows_seq, Kind::Int64, (false, true), None),
        None
    );
}

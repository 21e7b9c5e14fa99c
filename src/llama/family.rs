//! Which of Hugging Face's Llama-shaped models a checkpoint is.

use super::config::Activation;

/// Which of Hugging Face's Llama-shaped models a checkpoint is: the
/// same layers, names and matrices, told apart by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `llama` (`LlamaForCausalLM`): Llama 1-3.
    Llama,
    /// `mistral` (`MistralForCausalLM`): Llama's layers, attention in a
    /// sliding window when its config gives one.
    Mistral,
    /// `ministral` (`MinistralForCausalLM`, Ministral 8B): Mistral's
    /// layers, which of them attend in the window read from
    /// `layer_types`.
    Ministral,
    /// `qwen2` (`Qwen2ForCausalLM`): Llama's layers, biases on the query,
    /// key and value projections.
    Qwen2,
    /// `qwen3` (`Qwen3ForCausalLM`): Llama's layers, each head's queries
    /// and keys RMS-normalised before the rotation (`q_norm`, `k_norm`).
    Qwen3,
    /// `gemma` (`GemmaForCausalLM`): Llama's layers, RMSNorm weights as
    /// offsets from one (`x * (1 + w)`, in fp32), the embeddings scaled
    /// by the width's square root, a GELU-gated MLP, the head tied.
    Gemma,
    /// `gemma2` (`Gemma2ForCausalLM`): Gemma's, each sublayer's output
    /// normalised too (`post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`), every
    /// other layer in a sliding window, attention scores and logits
    /// soft-capped (`tanh(s / cap) * cap`), scores scaled by
    /// `query_pre_attn_scalar`.
    Gemma2,
    /// `vaultgemma` (`VaultGemmaForCausalLM`: Google's VaultGemma 1B,
    /// trained with differential privacy): Gemma 2's config and
    /// attention, its sublayers' outputs not normalised
    /// (`input_layernorm` and `pre_feedforward_layernorm` only).
    VaultGemma,
    /// `gemma3_text` (`Gemma3ForCausalLM`, Gemma 3 1B and 270M):
    /// Gemma 2's layers without the caps, queries and keys normalised as
    /// Qwen3's, every sixth layer global and the others in a window with
    /// rotary embeddings of their own base (`rope_local_base_freq`).
    Gemma3,
    /// `phi3` (`Phi3ForCausalLM`: Phi-3, Phi-4): Llama's layers with the
    /// query, key and value projections one matrix (`qkv_proj`) and the
    /// gate and up projections one (`gate_up_proj`), rotary embeddings
    /// on a part of each head (`partial_rotary_factor`), dropout on each
    /// sublayer's output (`resid_pdrop`).
    Phi3,
    /// `granite` (`GraniteForCausalLM`, IBM's Granite 3): Llama's layers,
    /// the embeddings, each sublayer's output, the attention scores and
    /// the logits scaled by the config's multipliers.
    Granite,
    /// `olmo2` (`Olmo2ForCausalLM`): Llama's layers normalised after
    /// each sublayer instead of before (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`), queries and keys RMS-normalised
    /// over the whole projection before the heads are split.
    Olmo2,
    /// `olmo` (`OlmoForCausalLM`: AllenAI's OLMo 1 and 1.7): Llama's
    /// layers with LayerNorms without weights or biases (in fp32, at
    /// 1e-5), the heads turned in fp32, queries, keys and values clipped
    /// at `clip_qkv`, no MLP biases.
    Olmo1,
    /// `olmo3` (`Olmo3ForCausalLM`): OLMo 2's layers, all but every
    /// fourth in a sliding window, whose rotary embeddings are unscaled.
    Olmo3,
    /// `smollm3` (`SmolLM3ForCausalLM`): Llama's layers, every fourth
    /// without rotary embeddings (`no_rope_layers`).
    SmolLm3,
    /// `mixtral` (`MixtralForCausalLM`): Mistral's layers with a sparse
    /// mixture of experts for the MLP (`block_sparse_moe`: a router,
    /// experts `w1`/`w3`/`w2`), each token through its top `k`.
    Mixtral,
    /// `olmoe` (`OlmoeForCausalLM`: OLMoE-1B-7B): Llama's layers with
    /// queries and keys RMS-normalised over the whole projection (as
    /// OLMo 2's, the norms before the sublayers as Llama's), optionally
    /// clipped with the values (`clip_qkv`), and a sparse mixture of
    /// experts for every MLP (`mlp.gate`, `mlp.experts.N`).
    Olmoe,
    /// `flex_olmo` (`FlexOlmoForCausalLM`: AllenAI's FlexOlmo-7x7B):
    /// OLMo 2's layers (outputs normalised, queries and keys over the
    /// whole projection) with OLMoE's sparse mixture of experts for every
    /// MLP.
    FlexOlmo,
    /// `qwen2_moe` (`Qwen2MoeForCausalLM`: Qwen1.5-MoE, Qwen2-57B-A14B):
    /// Qwen2's layers (`qkv_bias`) with a sparse mixture of experts for
    /// the MLP (`mlp.gate`, `mlp.experts.N`) beside a shared expert every
    /// token goes through (`mlp.shared_expert`), its output weighted by a
    /// sigmoid gate of its own (`mlp.shared_expert_gate`).
    Qwen2Moe,
    /// `qwen3_moe` (`Qwen3MoeForCausalLM`): Qwen3's layers with a sparse
    /// mixture of experts for the MLP (`mlp.gate`, `mlp.experts.N`), the
    /// top `k` weights renormalised when `norm_topk_prob`.
    Qwen3Moe,
    /// `starcoder2` (`Starcoder2ForCausalLM`, BigCode's StarCoder2):
    /// Llama's layers with LayerNorms (weights and biases) for the
    /// RMSNorms, a non-gated MLP (`mlp.c_fc`, `mlp.c_proj`), biases on
    /// every projection (`use_bias`), dropout on the embeddings and each
    /// sublayer's output.
    Starcoder2,
    /// `stablelm` (`StableLmForCausalLM`: StableLM 3B 4E1T, StableLM 2
    /// 1.6B, Zephyr 3B): Llama's layers with LayerNorms (weights and
    /// biases), rotary embeddings on a quarter of each head by default
    /// (`partial_rotary_factor`), biases on the query, key and value
    /// projections when `use_qkv_bias`, dropout on the MLP's output
    /// (`hidden_dropout`). StableLM 2 12B's too: each head's queries and
    /// keys LayerNormed (no biases) with weights of its own
    /// (`qk_layernorm`), the attention and the MLP side by side
    /// (`use_parallel_residual`).
    StableLm,
    /// `cohere` (`CohereForCausalLM`: Command R, Aya 23, Aya Expanse):
    /// Llama's projections and gated MLP side by side after one norm
    /// (`x + attn(n(x)) + mlp(n(x))`), its norms LayerNorms without
    /// biases computed in fp32, rotary embeddings turning neighbouring
    /// pairs of dimensions (in fp32), the logits times `logit_scale`,
    /// the head tied. Command R+'s too: each head's queries and keys
    /// normalised as the layer's norm is, with weights of its own
    /// (`use_qk_norm`).
    Cohere,
    /// `cohere2` (`Cohere2ForCausalLM`: Command R7B, Command A): Cohere's
    /// layers, all but every fourth (`layer_types`, or the older
    /// `sliding_window_pattern`) attending in a sliding window; only
    /// those turn their queries and keys, the global layers attend
    /// without positions.
    Cohere2,
    /// `deepseek_v3` (`DeepseekV3ForCausalLM`: DeepSeek-V3 and R1, Kimi
    /// K2, Moonlight): multi-head latent attention (queries through a
    /// low-rank bottleneck, keys and values from one compressed latent a
    /// token, the rotary dimensions apart and the keys' shared by every
    /// head) and, after the first `first_k_dense_replace` dense layers,
    /// experts routed by sigmoid scores within the best groups, beside
    /// shared experts.
    DeepseekV3,
    /// `glm` (`GlmForCausalLM`: GLM-4-9B-Chat's `-hf` checkpoints):
    /// Llama's layers with the gate and up projections one matrix
    /// (`gate_up_proj`), biases on the query, key and value projections
    /// (`attention_bias`), rotary embeddings on half of each head
    /// (`partial_rotary_factor`) turning neighbouring pairs.
    Glm,
    /// `glm4` (`Glm4ForCausalLM`: GLM-4-0414, GLM-Z1): GLM's layers with
    /// each sublayer's output normalised too (`post_self_attn_layernorm`,
    /// `post_mlp_layernorm`).
    Glm4,
    /// `glm4_moe` (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6):
    /// Llama's attention with biases on the query, key and value
    /// projections (`attention_bias`), each head's queries and keys
    /// RMS-normalised when `use_qk_norm`, half of each head turned by
    /// halves (`partial_rotary_factor`); after the first
    /// `first_k_dense_replace` dense layers, DeepSeek-V3's experts:
    /// routed by sigmoid scores within the best groups, beside shared
    /// experts.
    Glm4Moe,
    /// `gpt_oss` (`GptOssForCausalLM`: gpt-oss-20b and -120b, in bf16):
    /// Llama's attention with biases on every projection, a learned
    /// logit per head beside each query's scores in the softmax
    /// (`sinks`), every other layer in a sliding window, YaRN by
    /// default; RMSNorms multiplying their weights in fp32; on every
    /// layer experts stacked into four parameters
    /// (`mlp.experts.gate_up_proj`, its bias, `down_proj`, its bias),
    /// their gate and up columns interleaved, a clamped SwiGLU, routed
    /// by a linear layer with a bias (`mlp.router`).
    GptOss,
    /// `granitemoe` (`GraniteMoeForCausalLM`: Granite 3.0/3.1's 1B-A400M
    /// and 3B-A800M): Granite's layers and multipliers with a sparse
    /// mixture of experts for every MLP (`block_sparse_moe`), the
    /// experts stacked into two parameters (`input_linear.weight`
    /// `[experts, 2 width, d]`, the gate's rows then the up's;
    /// `output_linear.weight` `[experts, d, width]`), routed by
    /// `router.layer`.
    GraniteMoe,
    /// `granitemoeshared` (`GraniteMoeSharedForCausalLM`: IBM's MoE models
    /// with shared experts): Granite-MoE's layers with a shared MLP every
    /// token goes through beside the experts (`shared_mlp.input_linear`,
    /// the gate's rows then the up's, and `shared_mlp.output_linear`),
    /// none when `shared_intermediate_size` is 0.
    GraniteMoeShared,
    /// `deepseek_v2` (`DeepseekV2ForCausalLM`: DeepSeek-V2 and V2-Lite,
    /// DeepSeek-Coder-V2): DeepSeek-V3's multi-head latent attention
    /// (its scores unscaled by `mscale_all_dim`, as `transformers` has
    /// it) and experts after the dense first layers, routed by a softmax
    /// over all experts, greedily or within the best groups (a group's
    /// worth: its best expert), with no correction.
    DeepseekV2,
    /// `ernie4_5` (`Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B): Llama's layers,
    /// biases on every projection when `use_bias`, each head turned
    /// whole by neighbouring pairs in fp32, the head tied.
    Ernie4_5,
    /// `ernie4_5_moe` (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B,
    /// ERNIE-4.5-300B-A47B): ERNIE 4.5's layers with experts on the
    /// layers from `moe_layer_start_index` to `moe_layer_end_index`, every
    /// `moe_layer_interval`-th, beside shared experts; each token's `k`
    /// chosen by softmax score plus a fixed correction
    /// (`mlp.moe_statics.e_score_correction_bias`), weighted by their
    /// scores renormalised.
    Ernie4_5Moe,
    /// `seed_oss` (`SeedOssForCausalLM`: Seed-OSS-36B): Llama's layers
    /// with biases on the query, key and value projections
    /// (`attention_bias`, true by default) apart from the output's
    /// (`attention_out_bias`), dropout on each sublayer's output
    /// (`residual_dropout`) and the attention weights, 0.1 by default.
    SeedOss,
    /// `exaone4` (`Exaone4ForCausalLM`: EXAONE 4.0 1.2B and 32B): each
    /// sublayer's output normalised (OLMo 2's placement, Llama's norm),
    /// each head's queries and keys RMS-normalised, all but every
    /// `sliding_window_pattern`-th layer in a sliding window, the global
    /// layers without rotary embeddings (every layer turns when there is
    /// no window).
    Exaone4,
    /// `arcee` (`ArceeForCausalLM`: Arcee's AFM-4.5B): Llama's layers
    /// with an ungated MLP (`down_proj(relu2(up_proj(x)))`).
    Arcee,
    /// `nemotron` (`NemotronForCausalLM`: NVIDIA's Nemotron-4 and
    /// Minitron): Llama's attention turning half of each head by default
    /// (`partial_rotary_factor`, never scaled: its class reads no
    /// `rope_scaling`), LayerNorms whose weights are offsets from one
    /// (`LayerNorm1P`, with biases), and an ungated MLP of the squared
    /// ReLU (`down_proj(relu2(up_proj(x)))`).
    Nemotron,
    /// `helium` (`HeliumForCausalLM`: Kyutai's Helium 1 2B): Llama's
    /// layers with neighbouring pairs of each head turned, the norms'
    /// weights multiplied in fp32, and no bias on the output projection
    /// (`attention_bias` is the query's, key's and value's).
    Helium,
    /// `apertus` (`ApertusForCausalLM`: Swiss AI's Apertus 8B and 70B):
    /// Llama's attention with each head's queries and keys normalised
    /// (as Qwen3's), an ungated MLP of the xIELU activation, whose
    /// parameters it trains (`down_proj(xielu(up_proj(x)))`), the norms
    /// named `attention_layernorm` and `feedforward_layernorm`, Llama 3's
    /// rope scaling when the config leaves it out.
    Apertus,
    /// `hunyuan_v1_dense` (`HunYuanDenseV1ForCausalLM`: Tencent's
    /// Hunyuan 0.5B-7B): Llama's layers with each head's queries and keys
    /// normalised after they turn (`query_layernorm`, `key_layernorm`),
    /// no MLP biases, and its `dynamic` scaling's `alpha`
    /// ([`RopeScaling::DynamicAlpha`](super::RopeScaling::DynamicAlpha)).
    HunyuanDense,
    /// `hunyuan_v1_moe` (`HunYuanMoEV1ForCausalLM`: Tencent's
    /// Hunyuan-A13B): Hunyuan's attention with a sparse mixture of
    /// experts on every layer (`mlp.gate.wg`, a softmax's top `moe_topk`
    /// renormalised; `mlp.experts.N`) beside a shared MLP every token
    /// goes through (`mlp.shared_mlp`), all `intermediate_size` wide.
    HunyuanMoe,
    /// `dots1` (`Dots1ForCausalLM`: rednote's dots.llm1): Qwen3's
    /// attention (each head's queries and keys normalised) with
    /// DeepSeek-V3's experts (sigmoid scores plus a fixed correction,
    /// within the best groups) after the dense first layers.
    Dots1,
    /// `llama4_text` (`Llama4ForCausalLM`: Llama 4 Scout's and
    /// Maverick's language model): every fourth layer attends without
    /// positions (`no_rope_layers`) with its queries scaled up with the
    /// position (`attn_temperature_tuning`), the others turn by
    /// neighbouring pairs, L2-normalise each head's queries and keys
    /// (`use_qk_norm`) and attend within chunks (`attention_chunk_size`);
    /// experts (`feed_forward.experts`, stacked; a sigmoid of the top
    /// logits scaling each token's input) beside a shared expert on the
    /// `moe_layers`, a dense MLP (`intermediate_size_mlp` wide) on the
    /// others ([`Llama4Attention`](super::Llama4Attention)).
    Llama4,
    /// `dbrx` (`DbrxForCausalLM`: Databricks' DBRX): its own names at
    /// every level (`transformer.blocks.N.norm_attn_norm.attn.Wqkv`,
    /// `ffn.experts.mlp.w1`), its sizes in nested `attn_config` and
    /// `ffn_config`; LayerNorms without biases, one query-key-value
    /// matrix clipped at `clip_qkv`, and experts whose matrices are
    /// three parameters `[experts × width, d]` (`w1` the gate, `v1` the
    /// up, `w2` the down, multiplied from the left), the router's input
    /// jittered in training (`moe_jitter_eps`).
    Dbrx,
    /// `falcon` (`FalconForCausalLM`: TII's Falcon 7B, 40B and 180B):
    /// its own names (`transformer.h.N.self_attention.query_key_value`,
    /// `dense`, `mlp.dense_h_to_4h`), LayerNorms, one query-key-value
    /// matrix grouped by the heads sharing keys and values, an ungated
    /// GELU MLP, the attention and the MLP side by side after one norm
    /// or two, or one after the other; Falcon-RW's ALiBi in place of
    /// rotary embeddings ([`FalconLayout`](super::FalconLayout)).
    Falcon,
    /// `gptj` (`GPTJForCausalLM`: EleutherAI's GPT-J 6B): GPT-2's names
    /// for its sizes (`n_embd`, `n_head`, ...) and modules
    /// (`transformer.h.N.ln_1`), the attention (`attn.q_proj`, ...,
    /// `out_proj`, no biases) and the MLP (`mlp.fc_in`, `fc_out`, GELU's
    /// tanh form) side by side after one LayerNorm, the first
    /// `rotary_dim` dimensions of each head turned by neighbouring
    /// pairs, a head with a bias.
    GptJ,
    /// `codegen` (`CodeGenForCausalLM`: Salesforce's CodeGen 350M-16B):
    /// GPT-J's layers with one query-value-key matrix (`attn.qkv_proj`)
    /// laid out in four blocks, each the queries, values and keys of a
    /// quarter of the heads.
    CodeGen,
    /// `gpt_bigcode` (`GPTBigCodeForCausalLM`: BigCode's StarCoder,
    /// StarCoderBase and SantaCoder): GPT-2's names and layers (learned
    /// positions `wpe`, LayerNorms `ln_1`/`ln_2`, `attn.c_attn`,
    /// `c_proj`, `mlp.c_fc`, `c_proj`, biases) in `nn.Linear`'s layout,
    /// its heads sharing one key and value (`multi_query`).
    GptBigCode,
    /// `opt` (`OPTForCausalLM`: Meta's OPT 125M-66B, Galactica): its
    /// model under `model.decoder`, learned positions
    /// (`embed_positions`, two rows before position 0), LayerNorms
    /// before each sublayer (`self_attn_layer_norm`, `final_layer_norm`),
    /// an ungated ReLU MLP (`fc1`, `fc2`) in the layer itself, biases
    /// (`enable_bias`), the head tied; OPT-350m's post-norm layers and
    /// projected embeddings ([`OptLayout`](super::OptLayout)).
    Opt,
    /// `gpt_neo` (`GPTNeoForCausalLM`: EleutherAI's GPT-Neo 125M-2.7B):
    /// GPT-2's modules (learned positions `wpe`, `ln_1`/`ln_2`,
    /// `mlp.c_fc`/`c_proj`) in `nn.Linear`'s layout, its attention
    /// (`attn.attention.q_proj`, ..., `out_proj`, biased) unscaled, in a
    /// window on the layers `attention_types` makes local.
    GptNeo,
    /// `mpt` (`MptForCausalLM`: MosaicML's MPT-7B and 30B): DBRX's
    /// names (`transformer.blocks.N.norm_1`, `attn.Wqkv`, `out_proj`,
    /// `ffn.up_proj`, `down_proj`, `transformer.norm_f`), LayerNorms
    /// without biases, no biases anywhere, an ungated GELU MLP four times
    /// the width, ALiBi instead of positions.
    Mpt,
    /// `bloom` (`BloomForCausalLM`: BigScience's BLOOM 560M-176B,
    /// BLOOMZ): Falcon's module names (`self_attention.query_key_value`,
    /// each head's query, key and value together; `dense`,
    /// `mlp.dense_h_to_4h`), LayerNorms and biases everywhere, a
    /// LayerNorm on the embeddings (`word_embeddings_layernorm`), a GELU
    /// (tanh form) MLP, ALiBi instead of positions.
    Bloom,
    /// `persimmon` (`PersimmonForCausalLM`: Adept's Persimmon-8B, Fuyu's
    /// language model): Llama's names with BLOOM's modules
    /// (`self_attn.query_key_value`, each head's query, key and value
    /// together; `dense`, `mlp.dense_h_to_4h`, `dense_4h_to_h`),
    /// LayerNorms and biases everywhere, each head's queries and keys
    /// LayerNormed (`q_layernorm`, `k_layernorm`, one for every head)
    /// before half of each head turns, a squared-ReLU MLP, the final
    /// norm `final_layernorm`.
    Persimmon,
    /// `biogpt` (`BioGptForCausalLM`: Microsoft's BioGPT and
    /// BioGPT-Large): OPT's layers (`self_attn_layer_norm`, `out_proj`,
    /// `fc1`, `fc2`, `final_layer_norm`, biases) and learned positions
    /// two rows in, under `biogpt`, its token embeddings scaled by the
    /// width's square root, a GELU MLP, the head `output_projection`
    /// (tied).
    BioGpt,
    /// `xglm` (`XGLMForCausalLM`: Meta's multilingual XGLM 564M-7.5B):
    /// OPT's layers under `model` (`layers.N`, the final `layer_norm`)
    /// and its own names for its sizes (`d_model`, `num_layers`,
    /// `attention_heads`, `ffn_dim`), sinusoidal positions two rows in
    /// (computed, no parameters), its embeddings scaled by the width's
    /// square root, a GELU MLP, the head tied.
    Xglm,
    /// `phimoe` (`PhimoeForCausalLM`: Phi-3.5-MoE): Mixtral's layers
    /// (`block_sparse_moe`, experts `w1`, `w3`, `w2`) with LayerNorms
    /// (biases), biases on the attention's projections
    /// (`attention_bias`) and the head (`lm_head_bias`), two experts a
    /// token chosen by sparsemixer (Gumbel draws in training, its own
    /// gradient to the router; [`MoeConfig::sparse_mixer`](super::MoeConfig::sparse_mixer)),
    /// LongRoPE's cosines and sines times its own `short_mscale` or
    /// `long_mscale`.
    Phimoe,
    /// `granitemoehybrid` (`GraniteMoeHybridForCausalLM`: IBM's Granite
    /// 4.0, its -H models hybrid): Granite-MoE-shared's layers, each
    /// mixing its tokens with attention or with a Mamba-2 layer
    /// (`layer_types`; `mamba.in_proj`, `conv1d`, `dt_bias`, `A_log`,
    /// `D`, a gated RMSNorm `norm`, `out_proj`: [`MambaConfig`](super::MambaConfig)),
    /// rotary embeddings only with `position_embedding_type` `rope`, the
    /// shared MLP alone when `num_local_experts` is 0.
    GraniteMoeHybrid,
    /// `bamba` (`BambaForCausalLM`: IBM's Bamba 9B): Llama's MLP
    /// (`feed_forward`) after `pre_ff_layernorm`, each layer mixing its
    /// tokens with Granite 4.0's Mamba-2 layer or, at
    /// `attn_layer_indices`, attention turning half of each head (its
    /// class fixes the base at 10000, no scaling, no biases); the final
    /// norm `final_layernorm`.
    Bamba,
    /// `jamba` (`JambaForCausalLM`: AI21's Jamba): each layer mixing its
    /// tokens with attention without positions (every
    /// `attn_layer_period`-th, from `attn_layer_offset`) or with the
    /// first Mamba's selective scan (`mamba.in_proj`, `conv1d`,
    /// `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`, the step's, `B`'s
    /// and `C`'s RMSNorms: [`Mamba1Config`](super::Mamba1Config)), then
    /// Llama's MLP or, every `expert_layer_period`-th, experts
    /// (`feed_forward.router`, `experts.N.gate_proj`...) weighted by the
    /// softmax's top `k` as they are; `pre_ff_layernorm`, the final norm
    /// `final_layernorm`.
    Jamba,
    /// `mamba` (`MambaForCausalLM`: the Mamba models of state-spaces):
    /// nothing but the first Mamba's layers, each a norm (`norm`) and
    /// Jamba's selective scan without its norms (`mixer`; its sizes
    /// `state_size`, `conv_kernel`, `expand`, `time_step_rank`,
    /// `use_bias`, `use_conv_bias`), under `backbone` with `embeddings`
    /// and the final norm `norm_f`; the head tied by default.
    Mamba,
    /// `falcon_mamba` (`FalconMambaForCausalLM`: TII's Falcon-Mamba 7B):
    /// Mamba's layers, each token's step, `B` and `C` RMS-normalised
    /// without weights (at `mixer_rms_eps`).
    FalconMamba,
    /// `mamba2` (`Mamba2ForCausalLM`: the state-spaces Mamba-2 models,
    /// Mistral's Mamba-Codestral): Mamba's layout (`backbone`, each layer
    /// a `norm` and a `mixer`) with Granite 4.0's Mamba-2 layer as the
    /// mixer (its sizes `num_heads`, `head_dim`, `state_size`,
    /// `n_groups`, `expand`, `conv_kernel`, `chunk_size`, `use_bias`,
    /// `use_conv_bias`).
    Mamba2,
    /// `falcon_h1` (`FalconH1ForCausalLM`: TII's Falcon-H1): in each
    /// layer attention and a Mamba-2 layer side by side on one norm of
    /// the input (`mamba`: Granite 4.0's, its inner width `mamba_d_ssm`,
    /// its output gated plainly or through a grouped gated norm), their
    /// outputs added; Llama's MLP (`feed_forward`) after
    /// `pre_ff_layernorm`; µP multipliers on the embeddings, the
    /// attention's input, keys and output, the Mamba layer's input,
    /// projections and output, the MLP's gate and output, and the logits
    /// ([`FalconH1Multipliers`](super::FalconH1Multipliers)).
    FalconH1,
    /// `lfm2` (`Lfm2ForCausalLM`: Liquid AI's LFM2): most layers a short
    /// gated convolution (`conv`: `in_proj` to `B`, `C` and `x`, the
    /// depthwise convolution of `B x` over `conv_L_cache` tokens, gated
    /// by `C`, `out_proj`), the others (`layer_types` `full_attention`)
    /// grouped-query attention with each head's queries and keys
    /// RMS-normalised (`q_layernorm`, `k_layernorm`) and `out_proj`; each
    /// under `operator_norm`, a SiLU-gated MLP (`feed_forward.w1`, `w3`,
    /// `w2`, its width adjusted from `intermediate_size` as its class
    /// adjusts it) under `ffn_norm`; the final norm `embedding_norm`.
    Lfm2,
    /// `minimax` (`MiniMaxForCausalLM`: MiniMax-Text-01's layout): the
    /// layers `layer_types` names `linear_attention` (by default every
    /// other from the second) attend through lightning attention
    /// (`self_attn.qkv_proj`, its decayed linear attention, `norm`, the
    /// sigmoid `output_gate`, `out_proj`), the others with Llama's
    /// attention (in `sliding_window` when given); Mixtral's experts
    /// (`block_sparse_moe`) in every layer; each sublayer's residual is
    /// its input after the norm, weighted by the config's alpha and beta
    /// factors ([`ResidualFactors`](super::ResidualFactors)).
    MiniMax,
    /// `qwen3_next` (`Qwen3NextForCausalLM`: Qwen3-Next-80B-A3B): the
    /// layers `layer_types` names `linear_attention` (by default three of
    /// every four) hold a gated DeltaNet (`linear_attn`: `in_proj_qkvz`,
    /// `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, the gated `norm`,
    /// `out_proj`), the others attend with a quarter of each head turned
    /// (`partial_rotary_factor`), queries and keys normalised, and the
    /// output gated by a sigmoid of a second half of `q_proj`; Qwen2-MoE's
    /// experts with the shared expert and its gate; norms as offsets from
    /// one (Gemma's).
    Qwen3Next,
    /// `diffllama` (`DiffLlamaForCausalLM`): Llama's layers with
    /// differential attention (`self_attn.lambda_q1`, `lambda_k1`,
    /// `lambda_q2`, `lambda_k2`): the first half of the heads' attention
    /// minus a learned `lambda` times the second half's, over values twice
    /// as wide, normalised.
    DiffLlama,
    /// `bitnet` (`BitNetForCausalLM`: Microsoft's BitNet b1.58): Llama's
    /// layers with an RMS norm on the attention's output before `o_proj`
    /// (`attn_sub_norm`) and on the gated product before `down_proj`
    /// (`ffn_sub_norm`), the squared ReLU by default; under a
    /// `quantization_config` of `autobitlinear` in `online` mode
    /// ([`LlamaConfig::ternary`](super::LlamaConfig::ternary)), its
    /// linear layers train on ternary weights and 8-bit inputs.
    Bitnet,
    /// `jetmoe` (`JetMoeForCausalLM`: JetMoE-8B): a mixture of attention
    /// heads (`self_attention.experts`: each token's queries from its top
    /// `k` experts' `input_linear`, `num_key_value_heads` heads of
    /// `kv_channels` each, attending over keys and values shared by all
    /// (`kv_proj`), merged back by the same experts' `output_linear`
    /// weighted by the router, plus a bias) and Granite-MoE's experts
    /// in the MLP (`mlp.input_linear`, `mlp.output_linear`,
    /// `mlp.router.layer`) plus a bias; the layers' norms at the class's
    /// 1e-6, the final one at `rms_norm_eps`.
    JetMoe,
    /// `recurrent_gemma` (`RecurrentGemmaForCausalLM`: Google's
    /// RecurrentGemma, Griffin): the layers `block_types` names
    /// `recurrent` (by default two of every three) hold a gated linear
    /// recurrence in place of attention (`temporal_block`: `linear_x`
    /// and `linear_y`, a depthwise causal convolution `conv_1d`, the
    /// RG-LRU `rg_lru` with its per-head gates, `linear_out`), the
    /// others attend locally (`attention_window_size`) with multi-query
    /// heads, half of each turned; Gemma's norms (`temporal_pre_norm`,
    /// `channel_pre_norm`, `final_norm`) and scaled embeddings, biased
    /// MLPs half `intermediate_size` wide (`mlp_block`), capped logits.
    RecurrentGemma,
    /// `longcat_flash` (`LongcatFlashForCausalLM`: Meituan's
    /// LongCat-Flash): each of its `num_layers` layers is two sublayers
    /// (`self_attn.0` and `.1`, DeepSeek-V3's latent attention with its
    /// bottlenecks' outputs scaled by the width's ratio's root; dense
    /// `mlps.0` and `.1`; `input_layernorm.0`, ...) and a shortcut
    /// mixture of experts (`mlp`) reading the first sublayer's MLP input,
    /// its output added after the second; its router chooses among the
    /// experts and `zero_expert_num` zero-computation experts (each
    /// passing its token through unchanged) by softmax score plus a
    /// fixed correction, weighted by score times `routed_scaling_factor`.
    LongcatFlash,
    /// `gpt_neox_japanese` (`GPTNeoXJapaneseForCausalLM`: ABEJA's
    /// GPT-NeoX-Japanese): GPT-NeoX's attention (each head's query, key
    /// and value together in `query_key_value`, part of each head
    /// turned by `rotary_pct`) without biases, the last layer's output
    /// projection alone biased (`attention.dense_bias`, added before
    /// the dropout); LayerNorms before both sublayers, in turn; an
    /// ungated MLP `intermediate_multiple_size` times the width, without
    /// biases; its model under `gpt_neox_japanese`, its head `embed_out`
    /// (tied unless the config says otherwise).
    GptNeoxJapanese,
    /// `aria_text` (`AriaTextForCausalLM`: the language model of Rhymes
    /// AI's Aria): Llama's attention with a sparse mixture of experts on
    /// every layer: a router (`mlp.router`) whose top `moe_topk` logits
    /// are weighted by a softmax over them alone; the experts stacked
    /// into two parameters (`mlp.experts.fc1.weight` `[experts, d, 2
    /// width]`, the gate's columns then the up's, and `fc2.weight`),
    /// always SiLU-gated; beside them `moe_num_shared_experts` experts'
    /// width of shared MLP (`mlp.shared_experts`, `hidden_act`, biased by
    /// `mlp_bias`).
    AriaText,
    /// `ctrl` (`CTRLLMHeadModel`: Salesforce's CTRL): GPT-2's sizes' names,
    /// the tokens' embeddings (`transformer.w`) scaled by the width's
    /// square root plus sinusoidal positions of its own; LayerNorms
    /// (`layernorm1`, `layernorm2`, at a fixed 1e-6) before each
    /// sublayer; biased query, key, value and output projections
    /// (`multi_head_attention.Wq`, `Wk`, `Wv`, `dense`); a ReLU MLP
    /// (`ffn.0`, `ffn.2`) `dff` wide; a final `layernorm`; the head tied,
    /// with a bias of its own (`lm_head.bias`).
    Ctrl,
    /// `openai-gpt` (`OpenAIGPTLMHeadModel`: OpenAI's first GPT): GPT-2's
    /// sizes' names and Conv1D matrices (`[in, out]` in its files), token
    /// (`transformer.tokens_embed`) and learned position
    /// (`positions_embed`) embeddings; each layer's LayerNorms after the
    /// residual sums (`ln_1` of the input plus the attention's output,
    /// `ln_2` of that plus the MLP's), no final norm; one biased
    /// query-key-value matrix (`attn.c_attn`), a biased output
    /// (`attn.c_proj`), an MLP (`mlp.c_fc`, `mlp.c_proj`) four times the
    /// width, activated as `afn` says (its `gelu` is the tanh
    /// approximation); the head tied.
    OpenAiGpt,
    /// `modernbert-decoder` (`ModernBertDecoderForCausalLM`: the decoder
    /// of Johns Hopkins' Ettin pairs, ModernBERT's layout trained
    /// causally): the token embeddings (`model.embeddings.tok_embeddings`)
    /// normalised (`embeddings.norm`); LayerNorms without biases before
    /// each sublayer (`attn_norm`, none in the first layer; `mlp_norm`);
    /// `attn.q_proj`, `k_proj`, `v_proj` and `Wo`, every layer but each
    /// `global_attn_every_n_layers`-th (from the first) in a window of
    /// half `local_attention`; a gated MLP (`mlp.Wi`, the activated half
    /// first, then `Wo`); a final norm (`final_norm`); then a prediction
    /// head (`lm_head.dense`, the activation, `lm_head.norm`) before the
    /// vocabulary's matrix (`decoder`, tied, biased).
    ModernBertDecoder,
    /// `doge` (`DogeForCausalLM`: SmallDoge's Doge): Llama's names and
    /// gated MLP, each head's queries and keys RMS-normalised (`q_norm`,
    /// `k_norm`), and its dynamic mask: each key's score biased by
    /// `exp(A * softplus(dt_proj(v)))` of its own values (`self_attn.A`,
    /// `self_attn.dt_proj`), a query keeping the `keep_window_size` keys
    /// of highest bias past that many; each sublayer's input weighted
    /// where it joins the residual (`input_residual`,
    /// `post_attention_residual`, trained).
    Doge,
    /// `rwkv` (`RwkvForCausalLM`: RWKV-4, the Pile models and Raven):
    /// no attention; each block (`rwkv.blocks`) LayerNorms its input
    /// (`ln1`, `ln2`; the first its embeddings too, `pre_ln`) before a
    /// time mix (`attention`: each token mixed with the one before it,
    /// keys and values through the WKV recurrence, gated by the
    /// receptance, then `output`) and a channel mix (`feed_forward`:
    /// `sigmoid(receptance) * value(relu(key)^2)`); a final `ln_out`; the
    /// head (`head`) untied by default (`llama::rwkv`).
    Rwkv,
    /// `zamba2` (`Zamba2ForCausalLM`: Zyphra's Zamba2): Mamba-2 layers
    /// (`input_layernorm`, `mamba`), the hybrid ones (`mamba_decoder`)
    /// fed by one of the transformer blocks the model shares among them
    /// (`shared_transformer`, reading the hidden states beside the
    /// embeddings, with each layer's own adapters) and their own
    /// `linear` (`llama::zamba`).
    Zamba2,
    /// `zamba` (`ZambaForCausalLM`: Zyphra's Zamba 7B, the first): as
    /// Zamba2, but its Mamba layers the first Mamba's, each split into
    /// heads with their own selection (`x_proj_weight`, `dt_proj_weight`),
    /// and one shared block (`shared_transf`) with no adapters and a
    /// gated MLP of separate projections (`llama::zamba`).
    Zamba,
    /// `xlstm` (`xLSTMForCausalLM`: NX-AI's xLSTM 7B): no attention;
    /// each block (`backbone.blocks`) RMS-normalises its input
    /// (`norm_mlstm`, `norm_ffn`) before an mLSTM layer (`mlstm_layer`:
    /// a matrix memory a head, its gates exponential, each head's output
    /// layer-normalised and gated) and a SiLU-gated MLP (`ffn`); the
    /// logits soft-capped (`llama::xlstm`).
    Xlstm,
}

impl Family {
    /// Every family, in the order the docs list them.
    pub const ALL: [Family; 82] = [
        Self::Llama,
        Self::Mistral,
        Self::Ministral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Gemma,
        Self::Gemma2,
        Self::VaultGemma,
        Self::Gemma3,
        Self::Phi3,
        Self::Granite,
        Self::Olmo1,
        Self::Olmo2,
        Self::Olmo3,
        Self::SmolLm3,
        Self::Mixtral,
        Self::Olmoe,
        Self::FlexOlmo,
        Self::Qwen2Moe,
        Self::Qwen3Moe,
        Self::Starcoder2,
        Self::StableLm,
        Self::Cohere,
        Self::Cohere2,
        Self::DeepseekV3,
        Self::Glm,
        Self::Glm4,
        Self::Glm4Moe,
        Self::GptOss,
        Self::GraniteMoe,
        Self::GraniteMoeShared,
        Self::DeepseekV2,
        Self::Ernie4_5,
        Self::Ernie4_5Moe,
        Self::SeedOss,
        Self::Exaone4,
        Self::Arcee,
        Self::Nemotron,
        Self::Helium,
        Self::Apertus,
        Self::HunyuanDense,
        Self::HunyuanMoe,
        Self::Dots1,
        Self::Llama4,
        Self::Dbrx,
        Self::Falcon,
        Self::GptJ,
        Self::CodeGen,
        Self::GptBigCode,
        Self::Opt,
        Self::GptNeo,
        Self::Mpt,
        Self::Bloom,
        Self::Persimmon,
        Self::BioGpt,
        Self::Xglm,
        Self::Phimoe,
        Self::GraniteMoeHybrid,
        Self::Bamba,
        Self::Jamba,
        Self::Mamba,
        Self::FalconMamba,
        Self::Mamba2,
        Self::FalconH1,
        Self::Lfm2,
        Self::MiniMax,
        Self::Qwen3Next,
        Self::DiffLlama,
        Self::Bitnet,
        Self::JetMoe,
        Self::RecurrentGemma,
        Self::LongcatFlash,
        Self::GptNeoxJapanese,
        Self::AriaText,
        Self::Ctrl,
        Self::OpenAiGpt,
        Self::ModernBertDecoder,
        Self::Doge,
        Self::Rwkv,
        Self::Zamba2,
        Self::Zamba,
        Self::Xlstm,
    ];

    /// Every family's `model_type`, quoted, comma-separated: what an
    /// error naming another lists.
    pub fn model_types() -> String {
        let quoted: Vec<String> = (Self::ALL.iter())
            .map(|f| format!("{:?}", f.model_type()))
            .collect();
        quoted.join(", ")
    }

    /// Its `model_type`, or `None` for another.
    pub fn of(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_type() == model_type)
    }

    /// Its `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Ministral => "ministral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma => "gemma",
            Self::Gemma2 => "gemma2",
            Self::VaultGemma => "vaultgemma",
            Self::Gemma3 => "gemma3_text",
            Self::Phi3 => "phi3",
            Self::Granite => "granite",
            Self::Olmo1 => "olmo",
            Self::Olmo2 => "olmo2",
            Self::Olmo3 => "olmo3",
            Self::SmolLm3 => "smollm3",
            Self::Mixtral => "mixtral",
            Self::Olmoe => "olmoe",
            Self::FlexOlmo => "flex_olmo",
            Self::Qwen2Moe => "qwen2_moe",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Starcoder2 => "starcoder2",
            Self::StableLm => "stablelm",
            Self::Cohere => "cohere",
            Self::Cohere2 => "cohere2",
            Self::DeepseekV3 => "deepseek_v3",
            Self::Glm => "glm",
            Self::Glm4 => "glm4",
            Self::Glm4Moe => "glm4_moe",
            Self::GptOss => "gpt_oss",
            Self::GraniteMoe => "granitemoe",
            Self::GraniteMoeShared => "granitemoeshared",
            Self::DeepseekV2 => "deepseek_v2",
            Self::Ernie4_5 => "ernie4_5",
            Self::Ernie4_5Moe => "ernie4_5_moe",
            Self::SeedOss => "seed_oss",
            Self::Exaone4 => "exaone4",
            Self::Arcee => "arcee",
            Self::Nemotron => "nemotron",
            Self::Helium => "helium",
            Self::Apertus => "apertus",
            Self::HunyuanDense => "hunyuan_v1_dense",
            Self::HunyuanMoe => "hunyuan_v1_moe",
            Self::Dots1 => "dots1",
            Self::Llama4 => "llama4_text",
            Self::Dbrx => "dbrx",
            Self::Falcon => "falcon",
            Self::GptJ => "gptj",
            Self::CodeGen => "codegen",
            Self::GptBigCode => "gpt_bigcode",
            Self::Opt => "opt",
            Self::GptNeo => "gpt_neo",
            Self::Mpt => "mpt",
            Self::Bloom => "bloom",
            Self::Persimmon => "persimmon",
            Self::BioGpt => "biogpt",
            Self::Xglm => "xglm",
            Self::Phimoe => "phimoe",
            Self::GraniteMoeHybrid => "granitemoehybrid",
            Self::Bamba => "bamba",
            Self::Jamba => "jamba",
            Self::Mamba => "mamba",
            Self::FalconMamba => "falcon_mamba",
            Self::Mamba2 => "mamba2",
            Self::FalconH1 => "falcon_h1",
            Self::Lfm2 => "lfm2",
            Self::MiniMax => "minimax",
            Self::Qwen3Next => "qwen3_next",
            Self::DiffLlama => "diffllama",
            Self::Bitnet => "bitnet",
            Self::JetMoe => "jetmoe",
            Self::RecurrentGemma => "recurrent_gemma",
            Self::LongcatFlash => "longcat_flash",
            Self::GptNeoxJapanese => "gpt_neox_japanese",
            Self::AriaText => "aria_text",
            Self::Ctrl => "ctrl",
            Self::OpenAiGpt => "openai-gpt",
            Self::ModernBertDecoder => "modernbert-decoder",
            Self::Doge => "doge",
            Self::Rwkv => "rwkv",
            Self::Zamba2 => "zamba2",
            Self::Zamba => "zamba",
            Self::Xlstm => "xlstm",
        }
    }

    /// Its `transformers` class.
    pub(crate) fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Ministral => "MinistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Gemma => "GemmaForCausalLM",
            Self::Gemma2 => "Gemma2ForCausalLM",
            Self::VaultGemma => "VaultGemmaForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Phi3 => "Phi3ForCausalLM",
            Self::Granite => "GraniteForCausalLM",
            Self::Olmo1 => "OlmoForCausalLM",
            Self::Olmo2 => "Olmo2ForCausalLM",
            Self::Olmo3 => "Olmo3ForCausalLM",
            Self::SmolLm3 => "SmolLM3ForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Olmoe => "OlmoeForCausalLM",
            Self::FlexOlmo => "FlexOlmoForCausalLM",
            Self::Qwen2Moe => "Qwen2MoeForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Starcoder2 => "Starcoder2ForCausalLM",
            Self::StableLm => "StableLmForCausalLM",
            Self::Cohere => "CohereForCausalLM",
            Self::Cohere2 => "Cohere2ForCausalLM",
            Self::DeepseekV3 => "DeepseekV3ForCausalLM",
            Self::Glm => "GlmForCausalLM",
            Self::Glm4 => "Glm4ForCausalLM",
            Self::Glm4Moe => "Glm4MoeForCausalLM",
            Self::GptOss => "GptOssForCausalLM",
            Self::GraniteMoe => "GraniteMoeForCausalLM",
            Self::GraniteMoeShared => "GraniteMoeSharedForCausalLM",
            Self::DeepseekV2 => "DeepseekV2ForCausalLM",
            Self::Ernie4_5 => "Ernie4_5ForCausalLM",
            Self::Ernie4_5Moe => "Ernie4_5_MoeForCausalLM",
            Self::SeedOss => "SeedOssForCausalLM",
            Self::Exaone4 => "Exaone4ForCausalLM",
            Self::Arcee => "ArceeForCausalLM",
            Self::Nemotron => "NemotronForCausalLM",
            Self::Helium => "HeliumForCausalLM",
            Self::Apertus => "ApertusForCausalLM",
            Self::HunyuanDense => "HunYuanDenseV1ForCausalLM",
            Self::HunyuanMoe => "HunYuanMoEV1ForCausalLM",
            Self::Dots1 => "Dots1ForCausalLM",
            Self::Llama4 => "Llama4ForCausalLM",
            Self::Dbrx => "DbrxForCausalLM",
            Self::Falcon => "FalconForCausalLM",
            Self::GptJ => "GPTJForCausalLM",
            Self::CodeGen => "CodeGenForCausalLM",
            Self::GptBigCode => "GPTBigCodeForCausalLM",
            Self::Opt => "OPTForCausalLM",
            Self::GptNeo => "GPTNeoForCausalLM",
            Self::Mpt => "MptForCausalLM",
            Self::Bloom => "BloomForCausalLM",
            Self::Persimmon => "PersimmonForCausalLM",
            Self::BioGpt => "BioGptForCausalLM",
            Self::Xglm => "XGLMForCausalLM",
            Self::Phimoe => "PhimoeForCausalLM",
            Self::GraniteMoeHybrid => "GraniteMoeHybridForCausalLM",
            Self::Bamba => "BambaForCausalLM",
            Self::Jamba => "JambaForCausalLM",
            Self::Mamba => "MambaForCausalLM",
            Self::FalconMamba => "FalconMambaForCausalLM",
            Self::Mamba2 => "Mamba2ForCausalLM",
            Self::FalconH1 => "FalconH1ForCausalLM",
            Self::Lfm2 => "Lfm2ForCausalLM",
            Self::MiniMax => "MiniMaxForCausalLM",
            Self::Qwen3Next => "Qwen3NextForCausalLM",
            Self::DiffLlama => "DiffLlamaForCausalLM",
            Self::Bitnet => "BitNetForCausalLM",
            Self::JetMoe => "JetMoeForCausalLM",
            Self::RecurrentGemma => "RecurrentGemmaForCausalLM",
            Self::LongcatFlash => "LongcatFlashForCausalLM",
            Self::GptNeoxJapanese => "GPTNeoXJapaneseForCausalLM",
            Self::AriaText => "AriaTextForCausalLM",
            Self::Ctrl => "CTRLLMHeadModel",
            Self::OpenAiGpt => "OpenAIGPTLMHeadModel",
            Self::ModernBertDecoder => "ModernBertDecoderForCausalLM",
            Self::Doge => "DogeForCausalLM",
            Self::Rwkv => "RwkvForCausalLM",
            Self::Zamba2 => "Zamba2ForCausalLM",
            Self::Zamba => "ZambaForCausalLM",
            Self::Xlstm => "xLSTMForCausalLM",
        }
    }

    /// Whether its class gives the token embedding the config's
    /// `pad_token_id` as `nn.Embedding`'s `padding_idx` (the row gets no
    /// gradient from the lookup). GPT-J's, CodeGen's, GPT-BigCode's,
    /// GPT-Neo's, MPT's, BLOOM's, Falcon's, the Mambas' (1 and 2,
    /// Falcon-Mamba), CTRL's, OpenAI GPT's, RWKV's and xLSTM's do not: every row of theirs
    /// trains, the pad token's too (which a tied head's gradient always
    /// reaches).
    pub(super) fn pads_embedding(self) -> bool {
        !(self.gptj()
            || matches!(
                self,
                Self::GptBigCode
                    | Self::GptNeo
                    | Self::Mpt
                    | Self::Bloom
                    | Self::Falcon
                    | Self::Mamba
                    | Self::FalconMamba
                    | Self::Mamba2
                    | Self::Ctrl
                    | Self::OpenAiGpt
                    | Self::Rwkv
                    | Self::Xlstm
            ))
    }

    /// Zamba's and Zamba2's: Mamba layers, the hybrid ones fed by a
    /// transformer block the model shares among them (`llama::zamba`).
    pub(super) fn zamba(self) -> bool {
        matches!(self, Self::Zamba | Self::Zamba2)
    }

    /// Mamba's, Falcon-Mamba's and Mamba-2's: nothing but Mamba layers,
    /// each a norm and the scan, no attention, no MLP.
    pub(super) fn mamba_only(self) -> bool {
        matches!(self, Self::Mamba | Self::FalconMamba | Self::Mamba2)
    }

    /// Gemma's: norms as offsets from one, the embeddings scaled.
    pub(super) fn gemma(self) -> bool {
        matches!(
            self,
            Self::Gemma | Self::Gemma2 | Self::VaultGemma | Self::Gemma3
        )
    }

    /// Gemma 2's config and attention: Gemma 2's and VaultGemma's
    /// (capped scores and logits, every other layer windowed, the
    /// queries scaled by `query_pre_attn_scalar`).
    pub(super) fn gemma2(self) -> bool {
        matches!(self, Self::Gemma2 | Self::VaultGemma)
    }

    /// Each sublayer's output normalised before the residual (Gemma 2
    /// and 3), the MLP's input by a norm of its own.
    pub(super) fn sandwich(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    /// StarCoder2's, StableLM's, Nemotron's, Persimmon's, PhiMoE's and
    /// the GPT-2-era layouts': LayerNorms (with biases) where the others
    /// have RMSNorms (Nemotron's weights offsets from one).
    pub(super) fn layer_norm(self) -> bool {
        matches!(
            self,
            Self::Starcoder2
                | Self::StableLm
                | Self::Nemotron
                | Self::Persimmon
                | Self::Phimoe
                | Self::GptNeoxJapanese
                | Self::Rwkv
        ) || self.classic()
    }

    /// The GPT-2-era layouts (Falcon, GPT-J, CodeGen, GPT-BigCode, OPT,
    /// GPT-Neo, BLOOM, BioGPT, XGLM, CTRL, OpenAI GPT):
    /// LayerNorms with biases and an ungated MLP.
    pub(super) fn classic(self) -> bool {
        matches!(
            self,
            Self::Falcon
                | Self::GptJ
                | Self::CodeGen
                | Self::GptBigCode
                | Self::Opt
                | Self::GptNeo
                | Self::Bloom
                | Self::BioGpt
                | Self::Xglm
                | Self::Ctrl
                | Self::OpenAiGpt
        )
    }

    /// fairseq's heirs (OPT's, BioGPT's and XGLM's): positions two rows
    /// in, `self_attn_layer_norm` and `final_layer_norm` before the
    /// attention and the MLP, the MLP (`fc1`, `fc2`) in the layer itself,
    /// and LayerDrop's draw before each layer in training.
    pub(super) fn fairseq(self) -> bool {
        matches!(self, Self::Opt | Self::BioGpt | Self::Xglm)
    }

    /// Cohere's (1 and 2): the attention and the MLP side by side after
    /// one bias-free LayerNorm computed in fp32, neighbouring dimensions
    /// turned together, the logits scaled.
    pub(super) fn cohere(self) -> bool {
        matches!(self, Self::Cohere | Self::Cohere2)
    }

    /// Cohere's, GPT-J's and CodeGen's: the attention and the MLP side
    /// by side after one norm (StableLM's when its config says:
    /// [`LlamaConfig::parallel`](super::LlamaConfig::parallel)).
    pub(super) fn parallel(self) -> bool {
        self.cohere() || self.gptj()
    }

    /// GPT-BigCode's, GPT-Neo's, OPT's, BioGPT's and OpenAI GPT's:
    /// learned position embeddings (`transformer.wpe`,
    /// `model.decoder.embed_positions`, `transformer.positions_embed`)
    /// added to the tokens', no rotary embeddings.
    pub(super) fn learned_positions(self) -> bool {
        matches!(
            self,
            Self::GptBigCode | Self::GptNeo | Self::Opt | Self::BioGpt | Self::OpenAiGpt
        )
    }

    /// OpenAI GPT's: its attention's and MLP's matrices are Conv1D's,
    /// `[in, out]` in its files (GPT-2's layout), transposed as they are
    /// read and written back ([`crate::gpt2::is_conv1d_weight`] names
    /// them).
    pub(crate) fn conv1d(self) -> bool {
        self == Self::OpenAiGpt
    }

    /// XGLM's and CTRL's: sinusoidal position embeddings added to the
    /// tokens' (computed, no parameters), no rotary embeddings.
    pub(super) fn sinusoidal_positions(self) -> bool {
        matches!(self, Self::Xglm | Self::Ctrl)
    }

    /// MPT's and BLOOM's: ALiBi (each head's scores plus its slope times the keys'
    /// distance back) instead of positions (Falcon-RW's when its config
    /// says: [`LlamaConfig::alibi`](super::LlamaConfig::alibi)).
    pub(super) fn alibi(self) -> bool {
        matches!(self, Self::Mpt | Self::Bloom)
    }

    /// The rows its position embeddings keep before position 0 (OPT's,
    /// BioGPT's and XGLM's two).
    pub(super) fn position_offset(self) -> i64 {
        match self {
            Self::Opt | Self::BioGpt | Self::Xglm => super::opt::POSITION_OFFSET,
            _ => 0,
        }
    }

    /// GPT-J's layers (GPT-J's and CodeGen's): GPT-2's names for the
    /// sizes, `ln_1` before the attention and the MLP side by side,
    /// pairs of part of each head turned, a head with a bias.
    pub(super) fn gptj(self) -> bool {
        matches!(self, Self::GptJ | Self::CodeGen)
    }

    /// Hunyuan's (dense or with experts): heads normalised after they
    /// turn, the `dynamic` scaling's alpha, no MLP biases.
    pub(super) fn hunyuan(self) -> bool {
        matches!(self, Self::HunyuanDense | Self::HunyuanMoe)
    }

    /// Whether zrt adds the router's load-balancing loss for the family
    /// (`output_router_logits`), and its `router_aux_loss_coef` default:
    /// the families whose `transformers` class computes the Switch
    /// Transformer's `load_balancing_loss_func` on its routers' logits,
    /// as zrt's balance (`llama::balance`) does. The function counts the
    /// top `k` of the logits' softmax whatever the router chose: PhiMoE's
    /// sparsemixer and ERNIE 4.5's corrected choice are balanced so.
    pub(super) fn balance_default(self) -> Option<f64> {
        match self {
            Self::Mixtral
            | Self::Qwen2Moe
            | Self::Qwen3Moe
            | Self::MiniMax
            | Self::Qwen3Next
            | Self::Jamba
            | Self::GraniteMoe
            | Self::GraniteMoeShared
            | Self::GraniteMoeHybrid
            | Self::Phimoe
            | Self::Ernie4_5Moe => Some(0.001),
            // DBRX's `ffn_config.moe_loss_weight`.
            Self::Olmoe | Self::FlexOlmo | Self::Dbrx => Some(0.01),
            // GPT-OSS's balances its routers' scattered top-k weights.
            Self::GptOss => Some(0.9),
            _ => None,
        }
    }

    /// Granite-MoE's experts: Granite-MoE's, Granite-MoE-shared's and
    /// Granite 4.0's.
    pub(super) fn granite_moe(self) -> bool {
        matches!(
            self,
            Self::GraniteMoe | Self::GraniteMoeShared | Self::GraniteMoeHybrid
        )
    }

    /// Granite's multipliers: Granite's and Granite-MoE's.
    pub(super) fn granite(self) -> bool {
        self == Self::Granite || self.granite_moe()
    }

    /// An MLP of a gate and an up projection (all but StarCoder2's and
    /// Arcee's).
    pub(super) fn gated(self) -> bool {
        !(matches!(
            self,
            Self::Starcoder2
                | Self::Arcee
                | Self::Apertus
                | Self::Nemotron
                | Self::Mpt
                | Self::Persimmon
                | Self::GptNeoxJapanese
        ) || self.classic())
    }

    /// OLMo's: each sublayer's output normalised, not its input; the
    /// norms multiply by their weights in fp32; queries and keys
    /// normalised over the whole projection (OLMo 2's and 3's, and
    /// FlexOlmo's).
    pub(super) fn olmo(self) -> bool {
        matches!(self, Self::Olmo2 | Self::Olmo3 | Self::FlexOlmo)
    }

    /// GLM's (and GLM-4's): one gate-and-up matrix, a part of each head
    /// turned by neighbouring pairs.
    pub(super) fn glm(self) -> bool {
        matches!(self, Self::Glm | Self::Glm4)
    }

    /// DeepSeek-V3's experts (and GLM-4-MoE's, DeepSeek-V2's and
    /// dots.llm1's): chosen within the best groups, beside shared
    /// experts, after dense layers.
    pub(super) fn deepseek_experts(self) -> bool {
        matches!(
            self,
            Self::DeepseekV3 | Self::Glm4Moe | Self::DeepseekV2 | Self::Dots1
        )
    }

    /// ERNIE 4.5's (dense or with experts): biases when `use_bias`,
    /// pairs turned in fp32, no attention dropout.
    pub(super) fn ernie(self) -> bool {
        matches!(self, Self::Ernie4_5 | Self::Ernie4_5Moe)
    }

    /// Whether its files hold multi-token-prediction layers after the
    /// last, which `transformers` skips (DeepSeek-V3's, GLM-4-MoE's).
    pub(super) fn prediction_layers(self) -> bool {
        matches!(self, Self::DeepseekV3 | Self::Glm4Moe)
    }

    /// DeepSeek-V3's multi-head latent attention (DeepSeek-V2's and LongCat-Flash's too).
    pub(super) fn latent_attention(self) -> bool {
        matches!(
            self,
            Self::DeepseekV3 | Self::DeepseekV2 | Self::LongcatFlash
        )
    }

    /// Queries and keys normalised over the whole projection before the
    /// heads are split (OLMo 2 and 3, OLMoE), not over each head.
    pub(super) fn whole_qk_norm(self) -> bool {
        self.olmo() || self == Self::Olmoe
    }

    /// Queries and keys normalised over each head's width with weights
    /// of the head's own (StableLM 2 12B's `qk_layernorm`, Command R+'s
    /// `use_qk_norm`), not with one set of weights every head shares.
    pub(super) fn qk_norm_of_each_head(self) -> bool {
        matches!(self, Self::StableLm | Self::Cohere)
    }

    /// What its `transformers` config class (4.57) gives the fields a
    /// config leaves out: one table, so a family's defaults read
    /// together and are checked against the classes' own
    /// (`tests/from_hf.rs`).
    pub(super) fn defaults(self) -> Defaults {
        const LLAMA: Defaults = Defaults {
            eps: 1e-6,
            rope_theta: 10000.0,
            kv_heads: None,
            head_dim: None,
            window: None,
            tied: false,
            pad: None,
            activation: Activation::Silu,
            positions: 2048,
        };
        const GEMMA: Defaults = Defaults {
            head_dim: Some(256),
            tied: true,
            pad: Some(0),
            activation: Activation::GeluTanh,
            positions: 8192,
            ..LLAMA
        };
        match self {
            Self::Llama
            | Self::Granite
            | Self::GraniteMoe
            | Self::GraniteMoeShared
            | Self::GraniteMoeHybrid
            | Self::DeepseekV2
            | Self::Doge => LLAMA,
            Self::Mistral | Self::Ministral => Defaults {
                kv_heads: Some(8),
                window: Some(4096),
                positions: 131072,
                ..LLAMA
            },
            Self::Qwen2 => Defaults {
                kv_heads: Some(32),
                positions: 32768,
                ..LLAMA
            },
            Self::Qwen3 => Defaults {
                kv_heads: Some(32),
                head_dim: Some(128),
                positions: 32768,
                ..LLAMA
            },
            Self::Gemma => Defaults {
                kv_heads: Some(16),
                ..GEMMA
            },
            Self::Gemma2 | Self::VaultGemma => Defaults {
                kv_heads: Some(4),
                window: Some(4096),
                ..GEMMA
            },
            Self::Gemma3 => Defaults {
                rope_theta: 1e6,
                kv_heads: Some(4),
                window: Some(4096),
                positions: 131072,
                ..GEMMA
            },
            Self::Phi3 => Defaults {
                eps: 1e-5,
                pad: Some(32000),
                positions: 4096,
                ..LLAMA
            },
            Self::Olmo1 => Defaults {
                eps: 1e-5,
                pad: Some(1),
                ..LLAMA
            },
            Self::Olmo2 => Defaults {
                eps: 1e-5,
                pad: Some(1),
                ..LLAMA
            },
            Self::Olmo3 => Defaults {
                eps: 1e-5,
                window: Some(4096),
                pad: Some(1),
                ..LLAMA
            },
            Self::SmolLm3 => Defaults {
                rope_theta: 2e6,
                kv_heads: Some(4),
                tied: true,
                pad: Some(128004),
                positions: 32768,
                ..LLAMA
            },
            Self::Bamba => Defaults {
                eps: 1e-5,
                kv_heads: Some(8),
                pad: Some(0),
                positions: 262144,
                ..LLAMA
            },
            Self::Mamba2 => Defaults {
                eps: 1e-5,
                pad: Some(1),
                ..LLAMA
            },
            Self::FalconH1 => Defaults {
                eps: 1e-5,
                rope_theta: 100000.0,
                kv_heads: Some(8),
                pad: Some(0),
                positions: 8192,
                ..LLAMA
            },
            Self::MiniMax => Defaults {
                eps: 1e-5,
                rope_theta: 1_000_000.0,
                kv_heads: Some(8),
                positions: 4096 * 32,
                ..LLAMA
            },
            Self::Lfm2 => Defaults {
                eps: 1e-5,
                rope_theta: 1_000_000.0,
                kv_heads: Some(8),
                tied: true,
                pad: Some(0),
                positions: 128_000,
                ..LLAMA
            },
            Self::Mamba | Self::FalconMamba => Defaults {
                eps: 1e-5,
                tied: true,
                pad: Some(0),
                ..LLAMA
            },
            Self::Jamba => Defaults {
                kv_heads: Some(8),
                pad: Some(0),
                positions: 262144,
                ..LLAMA
            },
            Self::Mixtral | Self::Phimoe => Defaults {
                eps: 1e-5,
                rope_theta: 1e6,
                kv_heads: Some(8),
                positions: 131072,
                ..LLAMA
            },
            Self::FlexOlmo => Defaults {
                rope_theta: 500000.0,
                pad: Some(100277),
                positions: 4096,
                ..LLAMA
            },
            Self::Olmoe => Defaults {
                eps: 1e-5,
                pad: Some(1),
                positions: 4096,
                ..LLAMA
            },
            Self::Qwen2Moe => Defaults {
                kv_heads: Some(16),
                positions: 32768,
                ..LLAMA
            },
            Self::Qwen3Moe => Defaults {
                kv_heads: Some(4),
                positions: 32768,
                ..LLAMA
            },
            Self::DiffLlama => Defaults { eps: 1e-5, ..LLAMA },
            // Its heads are the width's share; its window is read as
            // `attention_window_size`.
            Self::RecurrentGemma => Defaults {
                head_dim: None,
                window: Some(2048),
                ..GEMMA
            },
            Self::LongcatFlash => Defaults {
                eps: 1e-5,
                rope_theta: 1e7,
                head_dim: Some(64),
                positions: 131072,
                ..LLAMA
            },
            Self::JetMoe => Defaults {
                kv_heads: Some(16),
                head_dim: Some(128),
                tied: true,
                positions: 4096,
                ..LLAMA
            },
            Self::Bitnet => Defaults {
                eps: 1e-5,
                rope_theta: 500000.0,
                kv_heads: Some(5),
                activation: Activation::Relu2,
                ..LLAMA
            },
            Self::Qwen3Next => Defaults {
                kv_heads: Some(2),
                head_dim: Some(256),
                positions: 32768,
                ..LLAMA
            },
            // `PretrainedConfig`'s tied head, its class setting none.
            Self::Starcoder2 => Defaults {
                eps: 1e-5,
                kv_heads: Some(2),
                tied: true,
                activation: Activation::GeluTanh,
                positions: 4096,
                ..LLAMA
            },
            Self::StableLm => Defaults {
                eps: 1e-5,
                kv_heads: Some(32),
                positions: 4096,
                ..LLAMA
            },
            Self::Cohere => Defaults {
                eps: 1e-5,
                tied: true,
                pad: Some(0),
                positions: 8192,
                ..LLAMA
            },
            Self::Glm | Self::Glm4 => Defaults {
                eps: 1.5625e-7,
                kv_heads: Some(2),
                head_dim: Some(128),
                pad: Some(151329),
                positions: 131072,
                ..LLAMA
            },
            Self::Ernie4_5 => Defaults {
                eps: 1e-5,
                rope_theta: 500000.0,
                kv_heads: Some(2),
                head_dim: Some(128),
                tied: true,
                pad: Some(0),
                positions: 131072,
                ..LLAMA
            },
            Self::Llama4 => Defaults {
                eps: 1e-5,
                rope_theta: 500000.0,
                kv_heads: Some(8),
                head_dim: Some(128),
                positions: 4096 * 32,
                ..LLAMA
            },
            Self::Dots1 => Defaults {
                kv_heads: Some(32),
                ..LLAMA
            },
            Self::ModernBertDecoder => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::Gelu,
                positions: 8192,
                pad: Some(50283),
                ..LLAMA
            },
            Self::Rwkv => Defaults {
                eps: 1e-5,
                activation: Activation::Relu,
                positions: 1024,
                ..LLAMA
            },
            Self::Xlstm => Defaults {
                eps: 1e-6,
                pad: Some(1),
                ..LLAMA
            },
            Self::Zamba2 | Self::Zamba => Defaults {
                eps: 1e-5,
                tied: true,
                pad: Some(0),
                activation: Activation::Gelu,
                positions: 4096,
                ..LLAMA
            },
            Self::OpenAiGpt => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::GeluNew,
                positions: 512,
                ..LLAMA
            },
            Self::Ctrl => Defaults {
                tied: true,
                activation: Activation::Relu,
                positions: 256,
                ..LLAMA
            },
            Self::AriaText => Defaults {
                pad: Some(2),
                ..LLAMA
            },
            Self::HunyuanDense | Self::HunyuanMoe => Defaults {
                eps: 1e-5,
                pad: Some(0),
                ..LLAMA
            },
            Self::Apertus => Defaults {
                eps: 1e-5,
                rope_theta: 12000000.0,
                pad: Some(3),
                activation: Activation::Xielu,
                positions: 65536,
                ..LLAMA
            },
            Self::Helium => Defaults {
                eps: 1e-8,
                rope_theta: 100000.0,
                kv_heads: Some(20),
                head_dim: Some(128),
                pad: Some(3),
                positions: 4096,
                ..LLAMA
            },
            Self::Xglm => Defaults {
                eps: 1e-5,
                tied: true,
                pad: Some(1),
                activation: Activation::Gelu,
                ..LLAMA
            },
            Self::BioGpt => Defaults {
                eps: 1e-5,
                tied: true,
                pad: Some(1),
                activation: Activation::Gelu,
                positions: 1024,
                ..LLAMA
            },
            Self::Bloom => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::GeluNew,
                ..LLAMA
            },
            Self::GptNeoxJapanese => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::Gelu,
                positions: 2048,
                ..LLAMA
            },
            Self::Persimmon => Defaults {
                eps: 1e-5,
                rope_theta: 25000.0,
                activation: Activation::Relu2,
                positions: 16384,
                ..LLAMA
            },
            Self::Mpt => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::Gelu,
                ..LLAMA
            },
            Self::GptNeo => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::GeluNew,
                ..LLAMA
            },
            Self::Opt => Defaults {
                eps: 1e-5,
                tied: true,
                pad: Some(1),
                activation: Activation::Relu,
                ..LLAMA
            },
            Self::GptBigCode => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::GeluTanh,
                positions: 1024,
                ..LLAMA
            },
            Self::GptJ | Self::CodeGen => Defaults {
                eps: 1e-5,
                activation: Activation::GeluNew,
                ..LLAMA
            },
            Self::Falcon => Defaults {
                eps: 1e-5,
                tied: true,
                activation: Activation::Gelu,
                ..LLAMA
            },
            // `DbrxConfig`'s, and nn.LayerNorm's epsilon (no field sets it).
            Self::Dbrx => Defaults {
                eps: 1e-5,
                kv_heads: Some(1),
                ..LLAMA
            },
            Self::Nemotron => Defaults {
                eps: 1e-5,
                activation: Activation::Relu2,
                positions: 4096,
                ..LLAMA
            },
            Self::Arcee => Defaults {
                eps: 1e-5,
                activation: Activation::Relu2,
                positions: 4096,
                ..LLAMA
            },
            Self::Exaone4 => Defaults {
                eps: 1e-5,
                kv_heads: Some(32),
                window: Some(4096),
                ..LLAMA
            },
            Self::SeedOss => Defaults {
                kv_heads: Some(8),
                head_dim: Some(128),
                pad: Some(1),
                positions: 524288,
                ..LLAMA
            },
            Self::Ernie4_5Moe => Defaults {
                eps: 1e-5,
                rope_theta: 500000.0,
                kv_heads: Some(4),
                tied: true,
                pad: Some(0),
                positions: 131072,
                ..LLAMA
            },
            Self::DeepseekV3 => Defaults {
                kv_heads: Some(128),
                positions: 4096,
                ..LLAMA
            },
            Self::Glm4Moe => Defaults {
                eps: 1e-5,
                kv_heads: Some(8),
                positions: 131072,
                ..LLAMA
            },
            Self::GptOss => Defaults {
                eps: 1e-5,
                rope_theta: 150000.0,
                kv_heads: Some(8),
                head_dim: Some(64),
                window: Some(128),
                positions: 131072,
                ..LLAMA
            },
            Self::Cohere2 => Defaults {
                eps: 1e-5,
                window: Some(4096),
                tied: true,
                pad: Some(0),
                positions: 8192,
                ..LLAMA
            },
        }
    }

    /// Where its checkpoint keeps the model's parts: the model under
    /// the head's level, the token embedding, the decoder layers and the
    /// final norm within it (Llama's `model`, `embed_tokens`, `layers`,
    /// `norm`; DBRX's `transformer`, `wte`, `blocks`, `norm_f`).
    pub(super) fn names(self) -> [&'static str; 4] {
        match self {
            Self::Dbrx | Self::Mpt => ["transformer", "wte", "blocks", "norm_f"],
            Self::Falcon | Self::Bloom => ["transformer", "word_embeddings", "h", "ln_f"],
            Self::GptJ | Self::CodeGen | Self::GptBigCode | Self::GptNeo => {
                ["transformer", "wte", "h", "ln_f"]
            }
            Self::Opt => [
                "model.decoder",
                "embed_tokens",
                "layers",
                "final_layer_norm",
            ],
            Self::Persimmon
            | Self::Bamba
            | Self::Jamba
            | Self::FalconH1
            | Self::Zamba2
            | Self::Zamba => ["model", "embed_tokens", "layers", "final_layernorm"],
            Self::BioGpt => ["biogpt", "embed_tokens", "layers", "layer_norm"],
            Self::Mamba | Self::FalconMamba | Self::Mamba2 => {
                ["backbone", "embeddings", "layers", "norm_f"]
            }
            Self::Xglm => ["model", "embed_tokens", "layers", "layer_norm"],
            Self::Ctrl => ["transformer", "w", "h", "layernorm"],
            // No final norm: its last name is never built.
            Self::OpenAiGpt => ["transformer", "tokens_embed", "h", "ln_f"],
            Self::ModernBertDecoder => {
                ["model", "embeddings.tok_embeddings", "layers", "final_norm"]
            }
            Self::RecurrentGemma => ["model", "embed_tokens", "layers", "final_norm"],
            Self::Rwkv => ["rwkv", "embeddings", "blocks", "ln_out"],
            Self::Xlstm => ["backbone", "embeddings", "blocks", "out_norm"],
            Self::Lfm2 => ["model", "embed_tokens", "layers", "embedding_norm"],
            Self::GptNeoxJapanese => [
                "gpt_neox_japanese",
                "embed_in",
                "layers",
                "final_layer_norm",
            ],
            _ => ["model", "embed_tokens", "layers", "norm"],
        }
    }

    /// Its head's checkpoint name: BioGPT's `output_projection`,
    /// GPT-NeoX-Japanese's `embed_out`, the others' `lm_head`.
    pub(crate) fn head_name(self) -> &'static str {
        match self {
            Self::BioGpt => "output_projection",
            Self::GptNeoxJapanese => "embed_out",
            Self::ModernBertDecoder => "decoder",
            Self::Rwkv => "head",
            _ => "lm_head",
        }
    }

    /// Its token embedding's checkpoint name ([`Family::names`]' first
    /// two, joined), which a tied head shares.
    pub(crate) fn embedding_path(self) -> &'static str {
        match self {
            Self::Dbrx
            | Self::GptJ
            | Self::CodeGen
            | Self::GptBigCode
            | Self::GptNeo
            | Self::Mpt => "transformer.wte",
            Self::Opt => "model.decoder.embed_tokens",
            Self::BioGpt => "biogpt.embed_tokens",
            Self::Falcon | Self::Bloom => "transformer.word_embeddings",
            Self::Mamba | Self::FalconMamba | Self::Mamba2 => "backbone.embeddings",
            Self::GptNeoxJapanese => "gpt_neox_japanese.embed_in",
            Self::Ctrl => "transformer.w",
            Self::OpenAiGpt => "transformer.tokens_embed",
            Self::ModernBertDecoder => "model.embeddings.tok_embeddings",
            Self::Rwkv => "rwkv.embeddings",
            _ => "model.embed_tokens",
        }
    }

    /// The config field of its norms' epsilon.
    pub(super) fn eps_key(self) -> &'static str {
        match self {
            Self::Starcoder2 => "norm_epsilon",
            Self::Nemotron | Self::Lfm2 | Self::ModernBertDecoder => "norm_eps",
            Self::Falcon
            | Self::GptJ
            | Self::CodeGen
            | Self::GptBigCode
            | Self::GptNeo
            | Self::Mpt
            | Self::Bloom
            | Self::Mamba
            | Self::FalconMamba
            | Self::Mamba2
            | Self::Ctrl
            | Self::OpenAiGpt
            | Self::Rwkv => "layer_norm_epsilon",
            Self::StableLm
            | Self::Cohere
            | Self::Cohere2
            | Self::Persimmon
            | Self::GptNeoxJapanese => "layer_norm_eps",
            _ => "rms_norm_eps",
        }
    }

    /// The config field naming the MLP's activation: Gemma 2 and 3 read
    /// `hidden_activation`, the others `hidden_act` (Gemma's too, in
    /// `transformers` 4.57).
    pub(super) fn activation_key(self) -> &'static str {
        match self {
            Self::Gemma2
            | Self::VaultGemma
            | Self::Gemma3
            | Self::RecurrentGemma
            | Self::ModernBertDecoder => "hidden_activation",
            Self::Falcon => "activation",
            Self::Opt | Self::JetMoe => "activation_function",
            _ => "hidden_act",
        }
    }
}

/// A [`Family`]'s config class's value for each field a config leaves
/// out (present and null is another thing: `sliding_window: null` turns
/// the window off).
#[derive(Debug, Clone, Copy)]
pub(super) struct Defaults {
    /// `rms_norm_eps`.
    pub(super) eps: f64,
    /// `rope_theta`.
    pub(super) rope_theta: f64,
    /// `num_key_value_heads`; `None`: `num_attention_heads`.
    pub(super) kv_heads: Option<i64>,
    /// `head_dim`; `None`: `hidden_size / num_attention_heads`.
    pub(super) head_dim: Option<i64>,
    /// `sliding_window`, for the families that read one.
    pub(super) window: Option<i64>,
    /// `tie_word_embeddings`.
    pub(super) tied: bool,
    /// `pad_token_id`.
    pub(super) pad: Option<i64>,
    /// `hidden_act` (Gemma 2's and 3's `hidden_activation`).
    pub(super) activation: Activation,
    /// `max_position_embeddings`.
    pub(super) positions: i64,
}

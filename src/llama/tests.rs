use super::*;
use crate::hf::HfError;

/// The parameters of every unit of `c`'s model: what its published
/// model's `transformers` count is checked against.
fn total(c: &LlamaConfig) -> u64 {
    c.unit_params().iter().map(|u| u.1).sum()
}

/// A scratch directory the config tests write configs into, removed
/// when dropped.
struct ConfigDir(std::path::PathBuf);

impl ConfigDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("zrt-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// `text` written as `config.json`, read.
    fn read(&self, text: &str) -> Result<LlamaConfig, HfError> {
        std::fs::write(self.0.join("config.json"), text).unwrap();
        LlamaConfig::from_hf_dir(&self.0)
    }

    /// `text` written as `config.json` and refused, the error saying
    /// `says`.
    fn refuses(&self, text: &str, says: &str) {
        let err = self.read(text).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }

    /// The config `given` with one field's value changed (`change`:
    /// `"key": value`, the key in `given`) is refused saying `says`.
    fn refuses_changed(&self, given: &str, change: &str, says: &str) {
        let key = change.split(':').next().unwrap();
        let at = given.find(key).unwrap();
        let end = at + given[at..].find([',', '}']).unwrap();
        self.refuses(&format!("{}{change}{}", &given[..at], &given[end..]), says);
    }

    /// The config `given` with each `(from, to)` replaced (`from` once
    /// in it) is refused saying `says`.
    fn refuses_replaced(&self, given: &str, changes: &[(&str, &str, &str)]) {
        for (from, to, says) in changes {
            assert_eq!(given.matches(from).count(), 1, "{from}");
            self.refuses(&given.replace(from, to), says);
        }
    }

    /// Each config reads back from the `config.json` it writes
    /// (`to_hf_json`) as itself.
    fn round_trips(&self, cfgs: impl IntoIterator<Item = LlamaConfig>) {
        for cfg in cfgs {
            let ours = self.0.join("ours.json");
            std::fs::write(&ours, cfg.to_hf_json()).unwrap();
            assert_eq!(LlamaConfig::from_hf_dir(&ours).unwrap(), cfg);
        }
    }
}

impl Drop for ConfigDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_checkpoints_names_are_the_models_but_what_it_does_not_hold() {
    for (name, tied, ours) in [
        ("model.layers.0.self_attn.q_proj.weight", false, true),
        ("lm_head.weight", false, true),
        ("lm_head.weight", true, false),
        ("model.layers.3.self_attn.rotary_emb.inv_freq", false, false),
    ] {
        let want = ours.then(|| name.to_string());
        assert_eq!(hf_name(name, tied), want, "{name} tied {tied}");
    }
}

#[test]
fn a_config_is_read_and_what_the_model_does_not_compute_is_refused() {
    let dir = ConfigDir::new("llama-config");
    // Llama 3.2 1B's config.json.
    let good = r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "max_position_embeddings": 131072, "tie_word_embeddings": true}"#;
    let cfg = dir.read(good).unwrap();
    let want = LlamaConfig {
        family: Family::Llama,
        vocab: 128256,
        hidden: 2048,
        intermediate: 8192,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_positions: 8192.0,
        },
        positions: 131072,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        tied: true,
        attention_dropout: 0.0,
        qk_norm: false,
        parallel: false,
        activation: Activation::Silu,
        pad_token: None,
        query_scalar: None,
        attn_softcap: None,
        final_softcap: None,
        full_every: None,
        local_rope_theta: None,
        partial_rotary: 1.0,
        resid_dropout: 0.0,
        embedding_dropout: 0.0,
        embedding_multiplier: 1.0,
        residual_multiplier: 1.0,
        attention_multiplier: None,
        logits_scaling: 1.0,
        logit_scale: 1.0,
        head_bias: false,
        mamba: None,
        mamba1: None,
        short_conv: None,
        lightning: None,
        residual_factors: None,
        delta_net: None,
        rg_lru: None,
        falcon_h1: None,
        rope_layers: None,
        moe: None,
        clip_qkv: None,
        mla: None,
        llama4: None,
        falcon: None,
        opt: None,
        local_layers: None,
        ternary: false,
        ternary_norm: None,
        z_loss: 0.0,
        keep_window: None,
        rescale_every: None,
        language_model_of: None,
        zamba: None,
        xlstm: None,
    };
    assert_eq!(cfg, want);
    dir.round_trips([cfg.clone()]);
    // Qwen2 has biases on q, k and v; Mistral a sliding window.
    let qwen = good.replace(r#""llama""#, r#""qwen2""#);
    let q = dir.read(&qwen).unwrap();
    assert_eq!(
        (q.family, q.qkv_bias, q.o_bias),
        (Family::Qwen2, true, false)
    );
    let mistral = good.replace(r#""llama""#, r#""mistral", "sliding_window": 4096"#);
    let m = dir.read(&mistral).unwrap();
    assert_eq!((m.family, m.sliding_window), (Family::Mistral, Some(4096)));
    // Qwen3 normalises queries and keys, biases only when
    // attention_bias; layer_types all full attention is every layer's.
    let full = vec![r#""full_attention""#; 16].join(", ");
    let qwen3 = good.replace(
        r#""llama""#,
        &format!(r#""qwen3", "attention_bias": true, "layer_types": [{full}]"#),
    );
    let q3 = dir.read(&qwen3).unwrap();
    assert_eq!(
        (q3.family, q3.qk_norm, q3.qkv_bias, q3.o_bias),
        (Family::Qwen3, true, true, true)
    );
    let dynamic = dir
        .read(&good.replace(
            r#""rope_scaling": {"#,
            r#""rope_scaling": {"rope_type": "dynamic", "factor": 4.0}, "was": {"#,
        ))
        .unwrap();
    assert_eq!(dynamic.rope_scaling, RopeScaling::Dynamic { factor: 4.0 });
    dir.round_trips([q, m, q3, dynamic]);
    let full_sliding = r#""full_attention", "sliding_attention""#;
    let sliding_full = r#""sliding_attention", "full_attention""#;
    for (from, to, says) in [
        (r#""llama""#, r#""gemma4""#, "model_type \"gemma4\": a Llama is one of"),
        (
            r#""high_freq_factor": 4.0, "#,
            "",
            "its `high_freq_factor` is missing",
        ),
        (
            r#""rope_scaling": {"#,
            r#""rope_scaling": {"rope_type": "ntk-by-parts"}, "was": {"#,
            "this llama computes the \"linear\", \"dynamic\", \"llama3\", \"longrope\" and \"yarn\" kinds only",
        ),
        (
            r#""llama""#,
            r#""phi3""#,
            "this phi3 computes the \"longrope\" (\"su\", \"yarn\") kinds only",
        ),
        (
            r#""rope_scaling": {"#,
            r#""rope_scaling": {"rope_type": "yarn"}, "was": {"#,
            "its `factor` is missing or not a number",
        ),
        (
            r#""llama""#,
            r#""qwen2", "use_sliding_window": true"#,
            "use_sliding_window true",
        ),
        (
            r#""llama""#,
            &format!(
                r#""qwen3", "layer_types": [{}]"#,
                [full_sliding; 8].join(", ")
            ),
            "every n-th layer's attention full",
        ),
        (
            r#""llama""#,
            &format!(
                r#""qwen3", "layer_types": [{}]"#,
                [sliding_full; 8].join(", ")
            ),
            "has sliding_attention layers and no sliding_window",
        ),
        (
            r#""llama""#,
            r#""llama", "layer_types": ["full_attention"]"#,
            "layer_types lists 1 layers, num_hidden_layers is 16",
        ),
        (r#""silu""#, r#""relu6""#, "hidden_act \"relu6\""),
        (
            r#""llama""#,
            r#""llama", "pad_token_id": 128256"#,
            "pad_token_id 128256 is not a token id",
        ),
        (
            r#""llama""#,
            r#""gemma3_text", "use_bidirectional_attention": true"#,
            "use_bidirectional_attention true",
        ),
        (
            r#""num_key_value_heads": 8"#,
            r#""num_key_value_heads": 5"#,
            "num_key_value_heads 5 does not divide num_attention_heads 32",
        ),
        (
            r#""tie_word_embeddings": true"#,
            r#""tie_word_embeddings": "yes""#,
            "`tie_word_embeddings` is \"yes\", not true or false",
        ),
    ] {
        let err = dir.read(&good.replace(from, to)).unwrap_err().to_string();
        assert!(err.contains(says) && err.contains("config.json"), "{err}");
    }
}

#[test]
fn gemma_configs_are_read_as_transformers_reads_them_and_counted() {
    let dir = ConfigDir::new("gemma-config");
    // Gemma 2 2B's and Gemma 3 1B's config.json; their parameter
    // counts are transformers' (2614341888, 999885952).
    let gemma2 = r#"{"architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000}"#;
    let gemma3 = r#"{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106], "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144}"#;
    let read = |text: &str| dir.read(text);
    let g2 = read(gemma2).unwrap();
    assert_eq!(
        (g2.family, g2.activation, g2.pad_token, g2.tied, g2.head_dim),
        (Family::Gemma2, Activation::GeluTanh, Some(0), true, 256)
    );
    assert_eq!(
        (g2.query_scalar, g2.attn_softcap, g2.final_softcap),
        (Some(256.0), Some(50.0), Some(30.0))
    );
    assert_eq!((g2.sliding_window, g2.full_every), (Some(4096), Some(2)));
    assert_eq!((g2.window(0), g2.window(1)), (Some(4096), None));
    let g3 = read(gemma3).unwrap();
    assert_eq!(
        (g3.family, g3.qk_norm, g3.attn_softcap, g3.final_softcap),
        (Family::Gemma3, true, None, None)
    );
    assert_eq!(
        (g3.rope_theta, g3.local_rope_theta, g3.full_every),
        (1e6, Some(10000.0), Some(6))
    );
    let globals: Vec<i64> = (0..26).filter(|&l| g3.window(l).is_none()).collect();
    assert_eq!(globals, [5, 11, 17, 23]);
    assert_eq!((total(&g2), total(&g3)), (2614341888, 999885952));
    // Left out: the family's defaults (Gemma: tied, head_dim 256,
    // the tanh GELU; Gemma 2: the caps, a window, every other layer).
    let bare = r#"{"model_type": "gemma2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}"#;
    let b = read(bare).unwrap();
    assert_eq!(
        (
            b.tied,
            b.head_dim,
            b.activation,
            b.sliding_window,
            b.full_every
        ),
        (true, 256, Activation::GeluTanh, Some(4096), Some(2))
    );
    assert_eq!((b.attn_softcap, b.final_softcap), (Some(50.0), Some(30.0)));
    // Gemma reads hidden_act (exact GELU in Gemma 1's releases), its
    // sequels hidden_activation (its class's 16 key-value heads would
    // not divide these 4 heads: given).
    let g1 = read(
        &bare
            .replace("gemma2", "gemma")
            .replace("{", r#"{"hidden_act": "gelu", "num_key_value_heads": 1, "#),
    )
    .unwrap();
    assert_eq!(
        (g1.activation, g1.full_every, g1.sliding_window),
        (Activation::Gelu, None, None)
    );
    // What the model writes it reads back.
    dir.round_trips([g1, g2, g3, b]);
    // Windowed layers in another order than every n-th global.
    let odd = gemma3.replace(
        r#""sliding_window_pattern": 6"#,
        r#""num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention", "full_attention"]"#,
    ).replace(r#""num_hidden_layers": 26, "#, "");
    let err = read(&odd).unwrap_err().to_string();
    assert!(err.contains("every n-th layer's attention full"), "{err}");
}

#[test]
fn a_phi3_config_is_read_as_transformers_reads_it_and_counted() {
    let dir = ConfigDir::new("phi3-config");
    // Phi-3-mini-4k-instruct's config.json; 3821079552 parameters as
    // transformers builds it.
    let phi3 = r#"{"architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32064}"#;
    let read = |text: &str| dir.read(text);
    let c = read(phi3).unwrap();
    assert_eq!(
        (
            c.family,
            c.pad_token,
            c.sliding_window,
            c.rotary_dim(),
            c.eps
        ),
        (Family::Phi3, Some(32000), Some(2047), 96, 1e-5)
    );
    let total = total(&c);
    assert_eq!(total, 3821079552);
    // Phi-4-mini's part of each head turns; its longrope is refused.
    let partial = phi3.replace(
        r#""resid_pdrop": 0.0"#,
        r#""resid_pdrop": 0.1, "partial_rotary_factor": 0.75"#,
    );
    let p = read(&partial).unwrap();
    assert_eq!((p.rotary_dim(), p.resid_dropout), (72, 0.1));
    // Phi-3.5-mini's LongRoPE (its 48 factors each), its context 32
    // times the pretrained 4096: the cosines' factor is
    // sqrt(1 + ln 32 / ln 4096). Phi-3's class reads "su" as it.
    let (short, long): (Vec<f64>, Vec<f64>) = (0..48)
        .map(|i| (1.0 + i as f64 / 100.0, 1.0 + i as f64))
        .unzip();
    let longrope = format!(
        r#""rope_scaling": {{"type": "su", "short_factor": {short:?}, "long_factor": {long:?}}}, "max_position_embeddings": 131072"#
    );
    let l = read(
        &phi3
            .replace(r#""rope_scaling": null"#, &longrope)
            .replace(r#""max_position_embeddings": 4096, "#, ""),
    )
    .unwrap();
    let want = RopeScaling::LongRope {
        short,
        long,
        original_positions: 4096,
        attention_factor: (1.0 + 32f64.ln() / 4096f64.ln()).sqrt(),
        mscales: None,
    };
    assert_eq!(l.rope_scaling, want);
    let RopeScaling::LongRope {
        attention_factor, ..
    } = want
    else {
        unreachable!()
    };
    assert!((attention_factor - 1.1902380714238083).abs() < 1e-15);
    dir.round_trips([c, p, l]);
    dir.refuses_replaced(
        phi3,
        &[
        (
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}"#,
            "its `short_factor` has 1 numbers, one for each of the 48 pairs a head turns",
        ),
        (
            r#""resid_pdrop": 0.0"#,
            r#""partial_rotary_factor": 0.7"#,
            "is 67 dimensions: rotary embeddings turn pairs",
        ),
        (
            r#""model_type": "phi3""#,
            r#""model_type": "llama", "partial_rotary_factor": 0.5"#,
            "partial_rotary_factor 0.5: this llama rotates every dimension",
        ),
        ],
    );
}

#[test]
fn granite_olmo2_and_smollm3_configs_are_read_and_counted() {
    let dir = ConfigDir::new("more-configs");
    // Granite 3 2B's, OLMo 2 1B's and SmolLM3 3B's shapes; the counts
    // are transformers' for these configs.
    let granite = r#"{"model_type": "granite", "vocab_size": 49155, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false, "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0, "pad_token_id": 0}"#;
    let olmo2 = r#"{"model_type": "olmo2", "vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 500000, "max_position_embeddings": 4096, "tie_word_embeddings": false, "attention_bias": false, "pad_token_id": 100277}"#;
    let smollm3 = r#"{"model_type": "smollm3", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 5000000.0, "max_position_embeddings": 65536, "tie_word_embeddings": true, "pad_token_id": 128004, "no_rope_layer_interval": 4, "use_sliding_window": false}"#;
    let read = |text: &str| dir.read(text);
    let g = read(granite).unwrap();
    assert_eq!(
        (g.embedding_multiplier, g.residual_multiplier),
        (12.0, 0.22)
    );
    assert_eq!(
        (g.attention_multiplier, g.logits_scaling),
        (Some(0.015625), 8.0)
    );
    let o = read(olmo2).unwrap();
    assert_eq!(
        (o.family, o.qk_norm, o.pad_token),
        (Family::Olmo2, true, Some(100277))
    );
    let sm = read(smollm3).unwrap();
    let turning: Vec<bool> = sm
        .rope_layers
        .clone()
        .unwrap()
        .into_iter()
        .take(8)
        .collect();
    assert_eq!(turning, [true, true, true, false, true, true, true, false]);
    assert_eq!(
        (total(&g), total(&o), total(&sm)),
        (2533531648, 1484916736, 3075098624)
    );
    // OLMo 3 leaves its windows to the defaults: 4096, every fourth
    // layer global, the windowed ones turning at the same base
    // unscaled.
    let o3 = read(&olmo2.replace("olmo2", "olmo3")).unwrap();
    assert_eq!(
        (o3.sliding_window, o3.full_every, o3.local_rope_theta),
        (Some(4096), Some(4), Some(500000.0))
    );
    dir.round_trips([g, o, o3, sm]);
    for (text, says) in [
        (
            smollm3.replace(
                r#""no_rope_layer_interval": 4"#,
                r#""no_rope_layers": [1, 0]"#,
            ),
            "no_rope_layers [1,0]: one 1 (turns) or 0 (does not) for each of the 36 layers",
        ),
        // Empty: SmolLM3's class keeps it and fails on the first layer
        // (Llama 4's takes the default).
        (
            smollm3.replace(r#""no_rope_layer_interval": 4"#, r#""no_rope_layers": []"#),
            "no_rope_layers []: one 1 (turns) or 0 (does not) for each of the 36 layers",
        ),
        (
            smollm3.replace(
                r#""use_sliding_window": false"#,
                r#""use_sliding_window": true"#,
            ),
            "use_sliding_window true: this Llama computes smollm3's full-attention layers only",
        ),
        (olmo2.replace(r#", "pad_token_id": 100277"#, ""), ""),
    ] {
        let got = read(&text);
        match says.is_empty() {
            // Left out, OLMo's config class pads with 1.
            true => assert_eq!(got.unwrap().pad_token, Some(1)),
            false => {
                let err = got.unwrap_err().to_string();
                assert!(err.contains(says), "{err}");
            }
        }
    }
}

#[test]
fn stablelm_configs_are_read_and_counted_the_12bs_norms_of_each_head_and_parallel_layers_too() {
    let dir = ConfigDir::new("stablelm-configs");
    // StableLM 2 1.6B's config.json; the count is transformers'.
    let two = r#"{"architectures": ["StableLmForCausalLM"], "bos_token_id": 100257, "eos_token_id": 100257, "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632, "layer_norm_eps": 1e-05, "max_position_embeddings": 4096, "model_type": "stablelm", "num_attention_heads": 32, "num_hidden_layers": 24, "num_key_value_heads": 32, "partial_rotary_factor": 0.25, "qk_layernorm": false, "rope_scaling": null, "rope_theta": 10000, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "use_parallel_residual": false, "use_qkv_bias": true, "vocab_size": 100352}"#;
    let c = dir.read(two).unwrap();
    assert_eq!(
        (c.family, c.rotary_dim(), c.qkv_bias, c.o_bias, c.mlp_bias),
        (Family::StableLm, 16, true, false, false)
    );
    assert_eq!(total(&c), 1644515328);
    // StableLM 3B 4E1T's sizes, the rest left to the class: a quarter
    // turned, no biases but the norms'.
    let three = r#"{"model_type": "stablelm", "vocab_size": 50304, "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 32, "num_attention_heads": 32}"#;
    let t = dir.read(three).unwrap();
    assert_eq!((t.rotary_dim(), t.kv_heads, t.qkv_bias), (20, 32, false));
    assert_eq!(total(&t), 2795443200);
    assert!(!c.qk_norm && !c.parallel && !t.qk_norm && !t.parallel);
    // StableLM 2 12B's sizes: a LayerNorm without a bias for each head's
    // queries and for each group's keys, one norm a layer read by the
    // attention and the MLP side by side; the count is transformers'.
    let twelve = r#"{"model_type": "stablelm", "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "partial_rotary_factor": 0.25, "qk_layernorm": true, "use_parallel_residual": true, "use_qkv_bias": false, "tie_word_embeddings": false, "max_position_embeddings": 4096}"#;
    let w = dir.read(twelve).unwrap();
    assert!(w.qk_norm && w.parallel);
    assert_eq!(total(&w), 12143185920);
    // Either one alone.
    for (key, norm, parallel) in [
        ("qk_layernorm", false, true),
        ("use_parallel_residual", true, false),
    ] {
        let one =
            dir.read(&twelve.replace(&format!(r#""{key}": true"#), &format!(r#""{key}": false"#)));
        let one = one.unwrap();
        assert_eq!((one.qk_norm, one.parallel), (norm, parallel), "{key}");
        dir.round_trips([one]);
    }
    dir.round_trips([c, t, w]);
    // Its dropout is the MLP's only.
    let d = dir.read(&two.replace(r#""hidden_dropout": 0.0"#, r#""hidden_dropout": 0.1"#));
    let d = d.unwrap();
    assert_eq!((d.resid_dropout, d.attention_output_dropout()), (0.1, 0.0));
}

#[test]
fn a_cohere_config_is_read_and_counted_and_command_r_plus_norms_of_each_head_too() {
    let dir = ConfigDir::new("cohere-configs");
    // Aya Expanse 8B's sizes; the count is transformers'.
    let aya = r#"{"model_type": "cohere", "vocab_size": 256000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "logit_scale": 0.125, "rope_theta": 10000, "max_position_embeddings": 8192, "layer_norm_eps": 1e-05, "use_qk_norm": false, "attention_bias": false, "tie_word_embeddings": true}"#;
    let c = dir.read(aya).unwrap();
    assert_eq!(
        (c.family, c.logit_scale, c.tied, c.pad_token),
        (Family::Cohere, 0.125, true, Some(0))
    );
    assert_eq!(total(&c), 8028033024);
    assert!(!c.qk_norm && c.parallel);
    // Command R+'s sizes: each head's queries and each group's keys
    // normalised with weights of their own; the count is transformers'.
    let plus = r#"{"model_type": "cohere", "vocab_size": 256000, "hidden_size": 12288, "intermediate_size": 33792, "num_hidden_layers": 64, "num_attention_heads": 96, "num_key_value_heads": 8, "logit_scale": 0.8333333333333334, "rope_theta": 75000000, "max_position_embeddings": 8192, "layer_norm_eps": 1e-05, "use_qk_norm": true}"#;
    let p = dir.read(plus).unwrap();
    assert!(p.qk_norm && p.parallel);
    assert_eq!(total(&p), 103810674688);
    dir.round_trips([c, p]);
}

#[test]
fn a_phimoe_config_is_read_and_counted_with_its_sparse_mixer_and_mscales() {
    let dir = ConfigDir::new("phimoe-configs");
    // Phi-3.5-MoE's sizes (its factors all alike here); the count is
    // transformers'.
    let moe = r#"{"model_type": "phimoe", "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2, "attention_bias": true, "lm_head_bias": true, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 131072, "input_jitter_noise": 0.01, "router_jitter_noise": 0.01, "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "long_factor": [1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5], "short_mscale": 1.243163121016122, "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096}}"#;
    let c = dir.read(moe).unwrap();
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (
            c.family,
            m.experts,
            m.top_k,
            m.normalize,
            m.sparse_mixer,
            m.jitter
        ),
        (Family::Phimoe, 16, 2, false, Some(0.01), 0.01)
    );
    assert!(c.qkv_bias && c.o_bias && c.head_bias && !c.tied);
    let RopeScaling::LongRope {
        original_positions,
        mscales,
        ..
    } = &c.rope_scaling
    else {
        panic!("{:?}", c.rope_scaling)
    };
    assert_eq!(
        (*original_positions, *mscales),
        (4096, Some((1.243163121016122, 1.243163121016122)))
    );
    assert_eq!(total(&c), 41873153344);
    // The class's defaults: no biases, sparsemixer at 0.01, no input
    // jitter, no scaling.
    let bare = r#"{"model_type": "phimoe", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8}"#;
    let b = dir.read(bare).unwrap();
    let bm = b.moe.clone().unwrap();
    assert_eq!(
        (
            b.kv_heads,
            bm.experts,
            bm.sparse_mixer,
            bm.jitter,
            b.head_bias,
            b.o_bias
        ),
        (8, 16, Some(0.01), 0.0, false, false)
    );
    assert_eq!(b.rope_scaling, RopeScaling::None);
    dir.round_trips([c, b]);
    // sparsemixer takes two experts; its scaling needs its factors and
    // its pretrained length within, and is LongRoPE's.
    dir.refuses_changed(
        moe,
        r#""num_experts_per_tok": 3"#,
        "PhiMoE's sparsemixer routes each token to 2 experts",
    );
    dir.refuses_replaced(
        moe,
        &[
            (
                r#""short_mscale": 1.243163121016122, "#,
                "",
                "its `short_mscale` is missing",
            ),
            (
                r#", "original_max_position_embeddings": 4096}}"#,
                "}}",
                "its `original_max_position_embeddings` is missing",
            ),
            (
                r#""type": "longrope""#,
                r#""type": "linear", "factor": 2.0"#,
                "PhiMoE's \"longrope\" kind only",
            ),
        ],
    );
}

#[test]
fn granite_4_configs_are_read_and_counted_with_their_mamba_layers() {
    let dir = ConfigDir::new("granite4-configs");
    // A hybrid of Granite 4.0-H's kind (sizes ours: 40 layers, every
    // tenth from the sixth attending, 72 experts beside a shared MLP, no
    // positions) and a dense one of Granite 4.0 Micro's kind (every
    // layer attending and turning, the shared MLP alone); the counts are
    // transformers'.
    let kinds: Vec<String> = (0..40)
        .map(|l| format!("\"{}\"", if l % 10 == 5 { "attention" } else { "mamba" }))
        .collect();
    let hybrid = format!(
        r#"{{"model_type": "granitemoehybrid", "vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 1536, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 72, "num_experts_per_tok": 10, "shared_intermediate_size": 8192, "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_expand": 2, "layer_types": [{}], "tie_word_embeddings": true, "position_embedding_type": "nope"}}"#,
        kinds.join(", ")
    );
    let h = dir.read(&hybrid).unwrap();
    let m = h.mamba.clone().unwrap();
    assert_eq!(
        (
            m.heads,
            m.head_dim,
            m.state,
            m.groups,
            m.conv_kernel,
            m.chunk
        ),
        (128, 64, 128, 1, 4, 256)
    );
    assert!(h.mamba_layer(0).is_some() && h.mamba_layer(5).is_none());
    assert_eq!(h.rope_layers, Some(vec![false; 40]));
    assert_eq!(total(&h), 62657985024);
    let micro = r#"{"model_type": "granitemoehybrid", "vocab_size": 100352, "hidden_size": 2560, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "num_local_experts": 0, "shared_intermediate_size": 8192, "layer_types": ["attention"], "tie_word_embeddings": true, "position_embedding_type": "rope"}"#
        .replace(r#"["attention"]"#, &format!("[{}]", vec![r#""attention""#; 40].join(", ")));
    let d = dir.read(&micro).unwrap();
    assert!(d.moe.is_none() && d.mamba_layer(0).is_none());
    assert_eq!(
        (d.intermediate, d.rope_layers.clone()),
        (8192, Some(vec![true; 40]))
    );
    assert_eq!(total(&d), 3402836480);
    dir.round_trips([h, d]);
    // What its class refuses, and positions zrt cannot tell.
    let given = &hybrid;
    dir.refuses_replaced(
        given,
        &[
            (
                r#""layer_types": ["#,
                r#""layer_types": ["conv", "#,
                "layer_types has 41 entries for num_hidden_layers 40",
            ),
            (
                r#""layer_types": ["mamba""#,
                r#""layer_types": ["conv""#,
                "layer_types entry \"conv\": Granite 4.0's layers are \"mamba\" or \"attention\"",
            ),
            (
                r#""mamba_n_heads": 128"#,
                r#""mamba_n_heads": 96"#,
                "mamba_n_heads 96 does not divide",
            ),
            (
                r#""mamba_d_head": 64"#,
                r#""mamba_d_head": 32"#,
                "mamba_d_head 32 x mamba_n_heads 128",
            ),
            (
                r#""mamba_n_groups": 1"#,
                r#""mamba_n_groups": 3"#,
                "mamba_n_groups 3 does not divide",
            ),
            (
                r#""position_embedding_type": "nope""#,
                r#""position_embedding_type": "alibi""#,
                "position_embedding_type \"alibi\"",
            ),
        ],
    );
}

#[test]
fn a_bamba_config_is_read_and_counted_with_what_its_class_fixes() {
    let dir = ConfigDir::new("bamba-configs");
    // Bamba 9B's sizes as we know them (attending at 9, 18 and 27); the
    // count is transformers'. Its class fixes the base, the scaling,
    // half of each head turned and no biases, whatever the file says.
    let nine = r#"{"model_type": "bamba", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_expand": 2, "attn_layer_indices": [9, 18, 27], "rope_theta": 500000.0, "attention_bias": true}"#;
    let b = dir.read(nine).unwrap();
    assert_eq!(
        (
            b.rope_theta,
            b.rotary_dim(),
            b.qkv_bias,
            b.o_bias,
            b.mlp_bias,
            b.pad_token
        ),
        (10000.0, 64, false, false, false, Some(0))
    );
    let attending: Vec<i64> = (0..32).filter(|&l| b.mamba_layer(l).is_none()).collect();
    assert_eq!(attending, [9, 18, 27]);
    assert_eq!(total(&b), 9780235392);
    assert_eq!(b.z_loss, 0.0);
    // Its z-loss's weight is read and written back.
    let z = dir
        .read(&nine.replace(
            r#""mamba_expand": 2"#,
            r#""mamba_expand": 2, "z_loss_coefficient": 0.001"#,
        ))
        .unwrap();
    assert_eq!(z.z_loss, 0.001);
    dir.round_trips([b, z]);
    dir.refuses_replaced(
        nine,
        &[
            (
                r#""attn_layer_indices": [9, 18, 27]"#,
                r#""attn_layer_indices": [9, 32]"#,
                "attn_layer_indices [9,32]: the numbers of the layers that attend",
            ),
            (
                r#""mamba_expand": 2"#,
                r#""mamba_expand": 2, "z_loss_coefficient": -0.001"#,
                "z_loss_coefficient -0.001: the z-loss's weight is 0 (none) or more",
            ),
        ],
    );
}

#[test]
fn a_jamba_config_is_read_and_counted_with_its_layers_where_its_periods_put_them() {
    let dir = ConfigDir::new("jamba-configs");
    // Jamba-v0.1's sizes (its step's rank "auto": 4096 / 16); the count
    // is transformers'.
    let v01 = r#"{"model_type": "jamba", "vocab_size": 65536, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_experts": 16, "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "attention_bias": true, "rope_theta": 500000.0}"#;
    let j = dir.read(v01).unwrap();
    let m = j.mamba1.clone().unwrap();
    assert_eq!(
        (m.dt_rank, m.state, m.conv_bias, m.proj_bias),
        (256, 16, true, false)
    );
    // No biases, no positions, whatever the file says.
    assert_eq!((j.qkv_bias, j.o_bias, j.mlp_bias), (false, false, false));
    assert!(j.rope_layers.as_ref().unwrap().iter().all(|&t| !t));
    let attending: Vec<i64> = (0..32).filter(|&l| j.mamba1_layer(l).is_none()).collect();
    assert_eq!(attending, [4, 12, 20, 28]);
    let experts: Vec<i64> = (0..32).filter(|&l| j.moe_layer(l)).collect();
    assert_eq!(experts, (1..32).step_by(2).collect::<Vec<i64>>());
    assert_eq!(total(&j), 51570323328);
    // One expert: every layer dense; attending every fourth from the
    // fourth; biased projections, an unbiased convolution.
    let dense = v01
        .replace(r#""num_experts": 16"#, r#""num_experts": 1"#)
        .replace(
            r#""attn_layer_period": 8, "attn_layer_offset": 4"#,
            r#""attn_layer_period": 4, "attn_layer_offset": 3"#,
        )
        .replace(
            r#""mamba_dt_rank": "auto""#,
            r#""mamba_proj_bias": true, "mamba_conv_bias": false"#,
        );
    let d = dir.read(&dense).unwrap();
    assert!(d.moe.is_none());
    let attending: Vec<i64> = (0..8).filter(|&l| d.mamba1_layer(l).is_none()).collect();
    assert_eq!(attending, [3, 7]);
    assert_eq!(total(&d), 9037523712);
    // Experts from the first layer, every third.
    let third = v01.replace(
        r#""expert_layer_period": 2, "expert_layer_offset": 1"#,
        r#""expert_layer_period": 3, "expert_layer_offset": 0"#,
    );
    let t = dir.read(&third).unwrap();
    let experts: Vec<i64> = (0..10).filter(|&l| t.moe_layer(l)).collect();
    assert_eq!(experts, [0, 3, 6, 9]);
    dir.round_trips([j, d, t]);
    dir.refuses_replaced(
        v01,
        &[
            (
                r#""attn_layer_offset": 4"#,
                r#""attn_layer_offset": 8"#,
                "attn_layer_period 8 and attn_layer_offset 8: the offset must be below the period",
            ),
            (
                r#""expert_layer_period": 2"#,
                r#""expert_layer_period": 1"#,
                "expert_layer_period 1 and expert_layer_offset 1: the offset must be below the period",
            ),
            (
                r#""mamba_d_conv": 4"#,
                r#""mamba_d_conv": 0"#,
                "mamba_d_conv",
            ),
        ],
    );
    // The routers' load-balancing loss at the class's coefficient.
    let balanced = dir
        .read(&v01.replace(
            r#""num_experts_per_tok": 2"#,
            r#""num_experts_per_tok": 2, "output_router_logits": true"#,
        ))
        .unwrap();
    assert_eq!(balanced.moe.and_then(|m| m.balance), Some(0.001));
}

#[test]
fn mamba_and_falcon_mamba_configs_are_read_by_their_own_names_and_counted() {
    let dir = ConfigDir::new("mamba-configs");
    // state-spaces/mamba-130m-hf's and mamba-2.8b-hf's sizes as
    // save_pretrained writes them; the counts are transformers'.
    let small = r#"{"model_type": "mamba", "vocab_size": 50280, "hidden_size": 768, "intermediate_size": 1536, "num_hidden_layers": 24, "state_size": 16, "time_step_rank": 48, "expand": 2, "conv_kernel": 4, "use_bias": false, "use_conv_bias": true, "layer_norm_epsilon": 1e-05, "residual_in_fp32": true}"#;
    let m = dir.read(small).unwrap();
    let s = m.mamba1.clone().unwrap();
    assert_eq!(
        (m.family, s.dt_rank, s.state, s.inner(m.hidden), s.attention),
        (Family::Mamba, 48, 16, 1536, None)
    );
    assert!((0..24).all(|l| m.mamba1_layer(l).is_some() && !m.moe_layer(l)));
    // Tied, its pad token 0 a row that trains (no `padding_idx`).
    assert_eq!(
        (m.tied, m.pad_token, m.padding_row()),
        (true, Some(0), None)
    );
    assert_eq!(total(&m), 129135360);
    let big = small
        .replace(
            r#""hidden_size": 768, "intermediate_size": 1536, "num_hidden_layers": 24"#,
            r#""hidden_size": 2560, "intermediate_size": 5120, "num_hidden_layers": 64"#,
        )
        .replace(r#""time_step_rank": 48"#, r#""time_step_rank": "auto""#);
    let b = dir.read(&big).unwrap();
    assert_eq!(b.mamba1.as_ref().map(|s| s.dt_rank), Some(160));
    assert_eq!(total(&b), 2768345600);
    // Falcon-Mamba 7B: its steps normalised without weights, untied.
    let falcon = r#"{"model_type": "falcon_mamba", "vocab_size": 65024, "hidden_size": 4096, "num_hidden_layers": 64, "mixer_rms_eps": 1e-06, "tie_word_embeddings": false}"#;
    let f = dir.read(falcon).unwrap();
    assert_eq!(
        f.mamba1.as_ref().map(|s| s.step_norms),
        Some(StepNorms::Plain(1e-6))
    );
    assert_eq!(total(&f), 7272665088);
    dir.round_trips([m, b, f]);
    dir.refuses_replaced(
        small,
        &[
            (
                r#""intermediate_size": 1536"#,
                r#""intermediate_size": 1024"#,
                "intermediate_size 1024: its class makes it expand x hidden_size (1536)",
            ),
            (r#""state_size": 16"#, r#""state_size": 0"#, "state_size"),
            (
                r#""layer_norm_epsilon": 1e-05"#,
                r#""layer_norm_epsilon": "small""#,
                "layer_norm_epsilon",
            ),
        ],
    );
}

#[test]
fn a_mamba2_config_is_read_by_its_own_names_with_pythons_infinity_and_counted() {
    let dir = ConfigDir::new("mamba2-configs");
    // Mamba-Codestral-7B's sizes, its step limit as save_pretrained
    // writes it (a bare Infinity); the count is transformers'.
    let codestral = r#"{"model_type": "mamba2", "vocab_size": 32768, "hidden_size": 4096, "num_hidden_layers": 64, "num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8, "expand": 2, "chunk_size": 256, "time_step_limit": [0.0, Infinity], "layer_norm_epsilon": 1e-05}"#;
    let c = dir.read(codestral).unwrap();
    let m = c.mamba.clone().unwrap();
    assert_eq!(
        (
            c.family,
            m.heads,
            m.head_dim,
            m.groups,
            m.state,
            c.tied,
            c.padding_row()
        ),
        (Family::Mamba2, 128, 64, 8, 128, false, None)
    );
    assert!((0..64).all(|l| c.mamba_layer(l).is_some()));
    assert_eq!(total(&c), 7285403648);
    // mamba2-130m's shape, its head tied.
    let small = codestral
        .replace(r#""vocab_size": 32768, "hidden_size": 4096, "num_hidden_layers": 64, "num_heads": 128"#, r#""vocab_size": 50288, "hidden_size": 768, "num_hidden_layers": 24, "num_heads": 24"#)
        .replace(r#""n_groups": 8"#, r#""n_groups": 1, "tie_word_embeddings": true"#);
    let s = dir.read(&small).unwrap();
    assert_eq!(total(&s), 128989632);
    dir.round_trips([c, s]);
    dir.refuses_replaced(
        codestral,
        &[
            (
                r#""time_step_limit": [0.0, Infinity]"#,
                r#""time_step_limit": [0.001, 0.1]"#,
                "time_step_limit [0.001,0.1]: zrt clamps each step to [0, Infinity]",
            ),
            (
                r#""num_heads": 128"#,
                r#""num_heads": 100"#,
                "num_heads 100 does not divide",
            ),
            (
                r#""layer_norm_epsilon": 1e-05"#,
                r#""layer_norm_epsilon": NaN"#,
                "layer_norm_epsilon",
            ),
        ],
    );
}

#[test]
fn a_falcon_h1_config_is_read_with_its_multipliers_and_counted() {
    let dir = ConfigDir::new("falcon-h1-configs");
    // Its class's defaults (sizes its own; no published model's); the
    // counts are transformers'.
    let defaults = r#"{"model_type": "falcon_h1", "vocab_size": 128000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "ssm_multipliers": [1.0, 0.5, 0.25, 0.25, 2.0], "key_multiplier": 0.5, "lm_head_multiplier": 0.125}"#;
    let f = dir.read(defaults).unwrap();
    let m = f.mamba_beside().unwrap().clone();
    assert_eq!(
        (
            m.inner(f.hidden),
            m.heads,
            m.head_dim,
            m.state,
            m.gate,
            m.out_bias()
        ),
        (1024, 128, 8, 256, MambaGate::Plain, false)
    );
    // Every layer attends, its Mamba layer beside.
    assert!((0..32).all(|l| f.mamba_layer(l).is_none()));
    let by = f.falcon_h1.clone().unwrap();
    assert_eq!(
        (by.ssm, by.key, by.mlp),
        ([1.0, 0.5, 0.25, 0.25, 2.0], 0.5, [1.0, 1.0])
    );
    assert_eq!(
        (f.logit_scale, f.rope_theta, f.kv_heads),
        (0.125, 100000.0, 8)
    );
    assert_eq!(total(&f), 8514961408);
    // The grouped gated norm, a biased output projection, the inner
    // width from expand, the head tied.
    let normed = defaults.replace(
        r#""key_multiplier": 0.5"#,
        r#""key_multiplier": 0.5, "mamba_rms_norm": true, "projectors_bias": true, "mamba_d_ssm": null, "mamba_n_heads": 64, "tie_word_embeddings": true"#,
    );
    let n = dir.read(&normed).unwrap();
    let m = n.mamba_beside().unwrap();
    assert_eq!(
        (m.inner(n.hidden), m.gate),
        (
            8192,
            MambaGate::Grouped {
                groups: 1,
                before_gate: true
            }
        )
    );
    assert_eq!(total(&n), 10802391040);
    dir.round_trips([f, n]);
    dir.refuses_replaced(
        defaults,
        &[
            (
                r#""ssm_multipliers": [1.0, 0.5, 0.25, 0.25, 2.0]"#,
                r#""ssm_multipliers": [1.0, 0.5]"#,
                "ssm_multipliers [1.0,0.5]: a list of 5 numbers",
            ),
            (
                r#""key_multiplier": 0.5"#,
                r#""key_multiplier": 0.5, "mamba_d_ssm": 1000"#,
                "mamba_n_heads 128 does not divide",
            ),
        ],
    );
}

#[test]
fn an_lfm2_config_is_read_with_its_convolution_layers_and_counted() {
    let dir = ConfigDir::new("lfm2-configs");
    // LFM2-1.2B's sizes under its original names (`block_ff_dim`); the
    // counts are transformers'.
    let kinds = r#"["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"]"#;
    let small = format!(
        r#"{{"model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2048, "block_ff_dim": 12288, "intermediate_size": 12288, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "norm_eps": 1e-05, "layer_types": {kinds}}}"#
    );
    let c = dir.read(&small).unwrap();
    // Two thirds of 12288, rounded up to 256.
    assert_eq!(
        (c.intermediate, c.tied, c.rope_theta, c.pad_token, c.qk_norm),
        (8192, true, 1e6, Some(0), true)
    );
    let conv = c.short_conv.clone().unwrap();
    assert_eq!((conv.kernel, conv.bias), (3, false));
    // Held as read; a width rounded to 0 by hand is taken as 1.
    let by_hand = MlpWidth {
        multiple_of: 0,
        ..conv.mlp.clone()
    };
    assert_eq!(
        (conv.mlp.given, conv.mlp.width(), by_hand.width()),
        (12288, 8192, 8192)
    );
    let attends: Vec<i64> = (0..16)
        .filter(|&l| c.short_conv_layer(l).is_none())
        .collect();
    assert_eq!(attends, [2, 5, 8, 10, 12, 14]);
    assert_eq!(total(&c), 1170340608);
    // Its class's defaults but for the sizes zrt asks for: every layer
    // attends.
    let d = dir
        .read(r#"{"model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 32}"#)
        .unwrap();
    assert!((0..32).all(|l| d.short_conv_layer(l).is_none()));
    assert_eq!((d.hidden, d.intermediate), (2560, 8192));
    assert_eq!(total(&d), 2705497600);
    // The attending layers by index, the MLP's width as given, biased
    // convolutions, the original names of the base and the tie.
    let other = r#"{"model_type": "lfm2", "vocab_size": 1000, "hidden_size": 1024, "intermediate_size": 4096, "block_auto_adjust_ff_dim": false, "num_hidden_layers": 6, "num_attention_heads": 16, "full_attn_idxs": [1, 4], "conv_bias": true, "tie_embedding": false, "theta": 500000.0}"#;
    let o = dir.read(other).unwrap();
    let attends: Vec<i64> = (0..6)
        .filter(|&l| o.short_conv_layer(l).is_none())
        .collect();
    assert_eq!(
        (attends, o.intermediate, o.tied, o.rope_theta),
        (vec![1, 4], 4096, false, 500000.0)
    );
    assert_eq!(total(&o), 100660480);
    dir.round_trips([c, d, o]);
    dir.refuses_replaced(
        other,
        &[
            (
                r#""full_attn_idxs": [1, 4]"#,
                r#""full_attn_idxs": [1, 6]"#,
                "full_attn_idxs [1,6]: the numbers of the layers that attend, each below num_hidden_layers 6",
            ),
            (
                r#""full_attn_idxs": [1, 4]"#,
                r#""full_attn_idxs": []"#,
                "no layer attends",
            ),
            (
                r#""full_attn_idxs": [1, 4]"#,
                r#""layer_types": ["conv", "full_attention"]"#,
                "layer_types has 2 entries for num_hidden_layers 6",
            ),
            (
                r#""full_attn_idxs": [1, 4]"#,
                r#""layer_types": ["conv", "mamba", "conv", "conv", "full_attention", "conv"]"#,
                "layer_types entry \"mamba\": LFM2's layers are \"conv\" or \"full_attention\"",
            ),
            (
                r#""block_auto_adjust_ff_dim": false"#,
                r#""block_auto_adjust_ff_dim": true, "block_ffn_dim_multiplier": -1.0"#,
                "intermediate_size 4096 adjusted (block_auto_adjust_ff_dim, block_ffn_dim_multiplier Some(-1.0)) is -2560: the MLP needs a width of at least 1",
            ),
            (
                r#""conv_bias": true"#,
                r#""conv_bias": true, "conv_L_cache": 0"#,
                "`conv_L_cache` is missing or not a positive integer",
            ),
        ],
    );
}

#[test]
fn a_diffllama_config_is_read_and_counted_with_its_lambdas() {
    let dir = ConfigDir::new("diffllama-configs");
    // Its class's defaults, given; and heads of a width of their own,
    // grouped, biased, tied. The counts are transformers'.
    let defaults = r#"{"model_type": "diffllama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32}"#;
    let d = dir.read(defaults).unwrap();
    assert_eq!(
        (d.kv_heads, d.head_dim, d.eps, d.mlp_bias),
        (32, 64, 1e-5, false)
    );
    assert_eq!(total(&d), 1204885504);
    let other = r#"{"model_type": "diffllama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 96, "attention_bias": true, "tie_word_embeddings": true}"#;
    let o = dir.read(other).unwrap();
    assert!(o.qkv_bias && o.o_bias && o.tied);
    assert_eq!(total(&o), 183833088);
    dir.round_trips([d, o]);
    dir.refuses_replaced(
        other,
        &[(
            r#""num_attention_heads": 16, "num_key_value_heads": 4"#,
            r#""num_attention_heads": 15, "num_key_value_heads": 5"#,
            "num_attention_heads 15: DiffLlama's differential attention pairs each head",
        )],
    );
}

#[test]
fn a_qwen3_next_config_is_read_with_its_delta_nets_and_counted() {
    let dir = ConfigDir::new("qwen3-next-configs");
    // Its class's defaults, given (Qwen3-Next-80B-A3B's sizes, but for
    // the unused dense width): three DeltaNets, then an attending layer;
    // 79674391296 parameters, as transformers counts them.
    let defaults = r#"{"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48, "num_attention_heads": 16}"#;
    let d = dir.read(defaults).unwrap();
    let attends: Vec<i64> = (0..48)
        .filter(|&l| d.delta_net_layer(l).is_none())
        .collect();
    assert_eq!(attends, (0..12).map(|l| 4 * l + 3).collect::<Vec<_>>());
    let g = d.delta_net.clone().unwrap();
    assert_eq!(
        (g.kernel, g.key_heads, g.value_heads, g.key_dim, g.value_dim),
        (4, 16, 32, 128, 128)
    );
    let m = d.moe.clone().unwrap();
    assert_eq!(
        (m.experts, m.top_k, m.intermediate, m.shared, m.normalize),
        (512, 10, 512, Some(512), true)
    );
    assert_eq!((d.head_dim, d.kv_heads, d.rotary_dim()), (256, 2, 64));
    assert!(d.qk_norm && d.gated_attention());
    assert_eq!(total(&d), 79674391296);
    // Smaller, every other layer attending, as transformers counts it.
    let small = r#"{"model_type": "qwen3_next", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8, "full_attention_interval": 2, "num_experts": 0}"#;
    let s = dir.read(small).unwrap();
    assert!(s.moe.is_none());
    assert_eq!(s.delta_net_layer(1), None);
    assert!(s.delta_net_layer(2).is_some());
    assert_eq!(total(&s), 212750080);
    dir.round_trips([d, s]);
    dir.refuses_replaced(
        defaults,
        &[
            (
                r#""model_type": "qwen3_next""#,
                r#""model_type": "qwen3_next", "layer_types": ["full_attention"]"#,
                "layer_types has 1 entries for num_hidden_layers 48",
            ),
            (
                r#""model_type": "qwen3_next""#,
                r#""model_type": "qwen3_next", "linear_num_value_heads": 24, "linear_num_key_heads": 16"#,
                "linear_num_value_heads 24 over linear_num_key_heads 16",
            ),
            (
                r#""model_type": "qwen3_next""#,
                r#""model_type": "qwen3_next", "full_attention_interval": 0"#,
                "`full_attention_interval` is missing or not a positive integer",
            ),
        ],
    );
    // The routers' load-balancing loss at the class's coefficient.
    let balanced = dir
        .read(&defaults.replace(
            r#""model_type": "qwen3_next""#,
            r#""model_type": "qwen3_next", "output_router_logits": true"#,
        ))
        .unwrap();
    assert_eq!(balanced.moe.and_then(|m| m.balance), Some(0.001));
}

#[test]
fn a_recurrent_gemma_config_is_read_with_its_recurrent_layers_and_counted() {
    let dir = ConfigDir::new("recurrent-gemma-configs");
    // Its class's defaults, given (zrt asks for the sizes): two recurrent
    // layers, then an attending one, repeated; 2010263040 parameters, as
    // transformers counts them.
    let defaults = r#"{"model_type": "recurrent_gemma", "vocab_size": 256000, "hidden_size": 2560, "intermediate_size": 7680, "num_hidden_layers": 26, "num_attention_heads": 10}"#;
    let d = dir.read(defaults).unwrap();
    let attends: Vec<i64> = (0..26).filter(|&l| d.rg_lru_layer(l).is_none()).collect();
    assert_eq!(attends, (0..8).map(|l| 3 * l + 2).collect::<Vec<_>>());
    let g = d.rg_lru.clone().unwrap();
    assert_eq!(
        (g.width, g.conv_width, g.intermediate_size),
        (2560, 4, 7680)
    );
    assert_eq!((d.intermediate, d.head_dim, d.kv_heads), (3840, 256, 10));
    assert_eq!(
        (d.rotary_dim(), d.sliding_window, d.window(2)),
        (128, Some(2048), Some(2048))
    );
    assert_eq!(d.final_softcap, Some(30.0));
    assert!(d.o_bias && !d.qkv_bias && d.mlp_bias && d.tied);
    assert_eq!(total(&d), 2010263040);
    // The fields RecurrentGemma-2b's config.json holds (the ones its
    // class does not read among them): 2682862080 parameters.
    let two_b = r#"{"architectures": ["RecurrentGemmaForCausalLM"], "attention_bias": false, "attention_window_size": 2048, "block_types": ["recurrent", "recurrent", "attention"], "bos_token_id": 2, "conv1d_width": 4, "embeddings_scale_by_sqrt_dim": true, "eos_token_id": 1, "final_w_init_variance_scale": 0.07692307692307693, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2560, "intermediate_size": 15360, "logits_soft_cap": 30.0, "lru_width": 2560, "model_type": "recurrent_gemma", "num_attention_heads": 10, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "torch_dtype": "float32", "use_cache": true, "vocab_size": 256000, "w_init_variance_scale": 0.01}"#;
    let two_b = dir.read(two_b).unwrap();
    assert_eq!(
        (total(&two_b), two_b.kv_heads, two_b.intermediate),
        (2682862080, 1, 7680)
    );
    // Smaller, narrower recurrences, biased attention first, an odd
    // intermediate_size (the MLP floors its half), as transformers counts it.
    let small = r#"{"model_type": "recurrent_gemma", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3001, "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 2, "lru_width": 512, "attention_bias": true, "block_types": ["attention", "recurrent"]}"#;
    let s = dir.read(small).unwrap();
    assert!(s.qkv_bias && s.rg_lru_layer(0).is_none() && s.rg_lru_layer(3).is_some());
    assert_eq!(s.intermediate, 1500);
    assert_eq!(total(&s), 67000472);
    dir.round_trips([d, s]);
    dir.refuses_replaced(
        defaults,
        &[
            (
                r#""model_type": "recurrent_gemma""#,
                r#""model_type": "recurrent_gemma", "partial_rotary_factor": 0.25"#,
                "partial_rotary_factor 0.25: RecurrentGemma's class splits each head in two",
            ),
            (
                r#""model_type": "recurrent_gemma""#,
                r#""model_type": "recurrent_gemma", "head_dim": 128"#,
                "num_attention_heads 10 x head_dim 128 is not hidden_size 2560",
            ),
            (
                r#""model_type": "recurrent_gemma""#,
                r#""model_type": "recurrent_gemma", "lru_width": 2565"#,
                "lru_width 2565 over num_attention_heads 10",
            ),
            (
                r#""model_type": "recurrent_gemma""#,
                r#""model_type": "recurrent_gemma", "block_types": ["recurrent", "mlp"]"#,
                "block_types holds \"mlp\"",
            ),
            (
                r#""model_type": "recurrent_gemma""#,
                r#""model_type": "recurrent_gemma", "block_types": []"#,
                "block_types []: a list of \"recurrent\" and \"attention\"",
            ),
            (
                r#""intermediate_size": 7680"#,
                r#""intermediate_size": 1"#,
                "intermediate_size 1: RecurrentGemma's MLP is half of it wide",
            ),
        ],
    );
}

#[test]
fn a_longcat_flash_config_is_read_with_its_sublayers_and_zero_experts_and_counted() {
    let dir = ConfigDir::new("longcat-flash-configs");
    // Its class's defaults (LongCat-Flash's sizes), the sizes zrt asks
    // for given: 28 layers of two sublayers, 512 experts and 256 zero
    // ones, 560664980480 parameters as transformers counts them (with
    // each layer's correction, a buffer there, 768 numbers).
    let defaults = r#"{"model_type": "longcat_flash", "vocab_size": 131072, "hidden_size": 6144, "num_layers": 28, "num_attention_heads": 64}"#;
    let d = dir.read(defaults).unwrap();
    assert_eq!((d.layers, d.intermediate, d.kv_heads), (28, 12288, 64));
    let m = d.mla.clone().unwrap();
    assert_eq!(
        (m.q_rank, m.kv_rank, m.nope, m.rope, m.v, m.interleave),
        (Some(1536), 512, 128, 64, 128, true)
    );
    assert_eq!(m.scales, Some((2.0, 12f64.sqrt())));
    let e = d.moe.clone().unwrap();
    assert_eq!(
        (e.experts, e.zero, e.top_k, e.intermediate, e.normalize),
        (512, 256, 12, 2048, false)
    );
    let g = e.grouped.unwrap();
    assert_eq!(
        (g.groups, g.top_groups, g.scale, g.scoring),
        (1, 1, 6.0, Scoring::Softmax)
    );
    assert_eq!((d.rope_theta, d.eps, d.rotary_dim()), (1e7, 1e-5, 64));
    assert!(!d.tied && !d.o_bias && !d.mlp_bias);
    assert_eq!(total(&d), 560664980480);
    // Smaller, tied, biased, its MLPs' width odd.
    let small = r#"{"model_type": "longcat_flash", "vocab_size": 32000, "hidden_size": 1024, "ffn_hidden_size": 3000, "num_layers": 3, "num_attention_heads": 8, "q_lora_rank": 384, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "head_dim": 32, "v_head_dim": 48, "n_routed_experts": 16, "zero_expert_num": 4, "moe_topk": 4, "expert_ffn_hidden_size": 512, "attention_bias": true, "tie_word_embeddings": true, "routed_scaling_factor": 2.5}"#;
    let s = dir.read(small).unwrap();
    assert!(s.tied && s.o_bias);
    assert_eq!(total(&s), 173284092);
    dir.round_trips([d, s]);
    dir.refuses_replaced(
        defaults,
        &[
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "router_bias": true"#,
                "router_bias true: transformers' LongCat-Flash builds a bias for its router and never adds it",
            ),
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "zero_expert_type": "zero""#,
                r#"zero_expert_type "zero": transformers' LongCat-Flash passes a token through its zero experts unchanged"#,
            ),
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "q_lora_rank": null"#,
                "q_lora_rank null: transformers' LongCat-Flash scales its queries by hidden_size over q_lora_rank",
            ),
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "num_key_value_heads": 8"#,
                "num_key_value_heads 8: LongCat-Flash's latent attention gives each of the 64 heads its own keys and values",
            ),
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "qk_head_dim": 128"#,
                "qk_head_dim 128: LongCat-Flash's queries and keys are qk_nope_head_dim + qk_rope_head_dim = 192 wide",
            ),
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "head_dim": 128"#,
                "head_dim 128: LongCat-Flash's config class turns head_dim dimensions, which must be qk_rope_head_dim 64",
            ),
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "mla_scale_kv_lora": false"#,
                "mla_scale_kv_lora false: transformers' LongCat-Flash always scales",
            ),
            (
                r#""num_layers": 28"#,
                r#""num_layers": 28, "n_routed_experts": 4, "zero_expert_num": 1, "moe_topk": 6"#,
                "moe_topk 6 is more than the 5 experts",
            ),
        ],
    );
}

#[test]
fn a_gpt_neox_japanese_config_is_read_under_its_own_names_and_counted() {
    let dir = ConfigDir::new("gpt-neox-japanese-configs");
    // Its class's defaults (GPT-NeoX-Japanese 2.7B's sizes): 2598837760
    // parameters as transformers counts them, the head tied.
    let defaults = r#"{"model_type": "gpt_neox_japanese", "vocab_size": 32000, "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 32}"#;
    let d = dir.read(defaults).unwrap();
    assert_eq!((d.intermediate, d.head_dim, d.kv_heads), (10240, 80, 32));
    assert_eq!((d.rotary_dim(), d.rope_theta, d.eps), (80, 10000.0, 1e-5));
    assert_eq!((d.attention_dropout, d.resid_dropout), (0.1, 0.0));
    assert!(d.tied && !d.o_bias && !d.qkv_bias && !d.mlp_bias);
    assert!(d.last_dense_bias(31) && !d.last_dense_bias(30));
    assert_eq!(d.activation, Activation::Gelu);
    assert_eq!(total(&d), 2598837760);
    // Untied, a quarter of each head turned at another base, an MLP
    // whose width truncates (1024 x 2.7 is 2764.8); a head_dim given, the
    // heads' own width.
    let small = r#"{"model_type": "gpt_neox_japanese", "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 5, "num_attention_heads": 8, "intermediate_multiple_size": 2.7, "rotary_pct": 0.25, "rotary_emb_base": 500, "tie_word_embeddings": false, "hidden_dropout": 0.2, "head_dim": 128}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(
        (s.intermediate, s.head_dim, s.rotary_dim()),
        (2764, 128, 32)
    );
    assert_eq!((s.rope_theta, s.resid_dropout, s.tied), (500.0, 0.2, false));
    assert_eq!(total(&s), 114834432);
    dir.round_trips([d, s]);
    dir.refuses_replaced(
        defaults,
        &[
            (
                r#""num_hidden_layers": 32"#,
                r#""num_hidden_layers": 32, "intermediate_multiple_size": 0"#,
                "intermediate_multiple_size 0: the MLP is hidden_size 2560 times it wide (truncated); give a positive number",
            ),
            (
                r#""num_hidden_layers": 32"#,
                r#""num_hidden_layers": 32, "head_dim": 64"#,
                "num_attention_heads 32 x head_dim 64 is not hidden_size 2560: GPT-NeoX-Japanese's heads are the width's share and its class fails turning them by another head_dim",
            ),
        ],
    );
}

#[test]
fn a_minimax_config_is_read_with_its_lightning_layers_and_factors_and_counted() {
    let dir = ConfigDir::new("minimax-configs");
    // Its class's defaults but for the sizes zrt asks for: every other
    // layer from the second a lightning one. The counts are
    // transformers'.
    let defaults = r#"{"model_type": "minimax", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32}"#;
    let d = dir.read(defaults).unwrap();
    let lightning: Vec<i64> = (0..32)
        .filter(|&l| d.lightning_layer(l).is_some())
        .collect();
    assert_eq!(lightning, (0..16).map(|l| 2 * l + 1).collect::<Vec<_>>());
    assert_eq!(d.lightning.as_ref().map(|g| g.block), Some(256));
    let f = d.residual_factors.unwrap();
    assert_eq!(
        (f.full, f.linear, f.mlp),
        ((1.0, 1.0), (1.0, 1.0), (1.0, 1.0))
    );
    let m = d.moe.clone().unwrap();
    assert_eq!(
        (m.experts, m.top_k, d.kv_heads, d.rope_theta),
        (8, 2, 8, 1e6)
    );
    assert_eq!(total(&d), 47373946880);
    // MiniMax-Text-01's sizes: softmax attention every eighth layer, 32
    // experts; 456B, as its model card counts them.
    let kinds: Vec<&str> = (0..80)
        .map(|l| {
            if (l + 1) % 8 == 0 {
                "\"full_attention\""
            } else {
                "\"linear_attention\""
            }
        })
        .collect();
    let text01 = format!(
        r#"{{"model_type": "minimax", "vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 9216, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 32, "num_experts_per_tok": 2, "rope_theta": 10000000.0, "layer_types": [{}], "full_attn_alpha_factor": 3.5565588200778455, "linear_attn_alpha_factor": 3.5565588200778455, "mlp_alpha_factor": 3.5565588200778455}}"#,
        kinds.join(", ")
    );
    let t = dir.read(&text01).unwrap();
    assert_eq!(t.lightning_layer(7), None);
    assert!(t.lightning_layer(6).is_some());
    assert_eq!(
        t.residual_factors.map(|f| f.mlp),
        Some((3.5565588200778455, 1.0))
    );
    assert_eq!(total(&t), 456089655296);
    // Its router's jitter, in training.
    let jittered = dir
        .read(&defaults.replace(
            r#""num_attention_heads": 32"#,
            r#""num_attention_heads": 32, "router_jitter_noise": 0.1"#,
        ))
        .unwrap();
    assert_eq!(jittered.moe.as_ref().map(|m| m.jitter), Some(0.1));
    dir.round_trips([d, t, jittered]);
    dir.refuses_replaced(
        defaults,
        &[
            (
                r#""num_attention_heads": 32"#,
                r#""num_attention_heads": 32, "layer_types": ["full_attention"]"#,
                "layer_types has 1 entries for num_hidden_layers 32",
            ),
            (
                r#""num_attention_heads": 32"#,
                r#""num_attention_heads": 32, "layer_types": "linear_attention""#,
                "layer_types \"linear_attention\": give a list",
            ),
            (
                r#""num_attention_heads": 32"#,
                r#""num_attention_heads": 32, "router_jitter_noise": -0.1"#,
                "`router_jitter_noise` is -0.1, not a dropout rate in [0, 1)",
            ),
            (
                r#""num_attention_heads": 32"#,
                r#""num_attention_heads": 32, "block_size": 0"#,
                "`block_size` is missing or not a positive integer",
            ),
        ],
    );
}

#[test]
fn a_cohere2_config_windows_and_turns_all_but_every_fourth_layer() {
    let dir = ConfigDir::new("cohere2-configs");
    // Command R7B's sizes and its older `sliding_window_pattern`; the
    // count is transformers'.
    let r7b = r#"{"model_type": "cohere2", "vocab_size": 256000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "logit_scale": 0.25, "rope_theta": 50000, "max_position_embeddings": 8192, "sliding_window": 4096, "sliding_window_pattern": 4, "layer_norm_eps": 1e-05}"#;
    let c = dir.read(r7b).unwrap();
    assert_eq!(
        (c.family, c.logit_scale, c.tied, c.pad_token, c.eps),
        (Family::Cohere2, 0.25, true, Some(0), 1e-5)
    );
    let windows: Vec<Option<i64>> = (0..8).map(|l| c.window(l)).collect();
    let w = Some(4096);
    assert_eq!(windows, [w, w, w, None, w, w, w, None]);
    // Only the windowed layers turn their queries and keys.
    let turns = c.rope_layers.clone().unwrap();
    assert_eq!(turns.len(), 32);
    assert!((0..32).all(|l| turns[l] == c.window(l as i64).is_some()));
    let total = total(&c);
    assert_eq!(total, 8028033024);
    // `layer_types` in place of the pattern, and no window: no layer
    // turns, as transformers computes it.
    let typed = r7b.replace(
        r#""sliding_window_pattern": 4"#,
        r#""layer_types": ["sliding_attention", "full_attention"]"#,
    );
    let typed = typed.replace(r#""num_hidden_layers": 32"#, r#""num_hidden_layers": 2"#);
    let t = dir.read(&typed).unwrap();
    assert_eq!((t.window(0), t.window(1)), (Some(4096), None));
    assert_eq!(t.rope_layers.clone().unwrap(), [true, false]);
    let none = r7b.replace(r#""sliding_window": 4096"#, r#""sliding_window": null"#);
    let n = dir.read(&none).unwrap();
    assert!(n.rope_layers.clone().unwrap().iter().all(|&r| !r));
    dir.round_trips([c, t, n]);
}

#[test]
fn a_deepseek_v3_config_is_read_and_counted_and_its_oddities_refused() {
    let dir = ConfigDir::new("deepseek-configs");
    // DeepSeek-V3's config as published (YaRN by its old `type` key);
    // the count is transformers' state dict's (the routers' corrections
    // included: zrt holds them as frozen parameters), the scale its
    // attention's.
    let v3 = r#"{"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": true, "max_position_embeddings": 163840, "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "tie_word_embeddings": false, "model_type": "deepseek_v3", "scoring_func": "sigmoid"}"#;
    let c = dir.read(v3).unwrap();
    let total = total(&c);
    assert_eq!(total, 671026419200);
    assert_eq!((c.head_dim, c.rotary_dim(), c.v_head_dim()), (192, 64, 128));
    let scale = c.attention_multiplier.unwrap();
    assert!((scale - 0.1352337788608801).abs() < 1e-12, "{scale}");
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (
            moe.dense_layers.len(),
            moe.shared,
            moe.grouped.map(|g| g.top_groups)
        ),
        (3, Some(2048), Some(4))
    );
    assert!((0..3).all(|l| !c.moe_layer(l)) && c.moe_layer(3));
    // Its multi-token-prediction layer (61) is not the model's.
    assert_eq!(
        [
            layer_of("model.layers.61.eh_proj.weight"),
            layer_of("model.norm.weight")
        ],
        [Some(61), None]
    );
    let plain = v3.replace(r#""q_lora_rank": 1536"#, r#""q_lora_rank": null"#);
    let p = dir.read(&plain).unwrap();
    assert_eq!(p.mla.as_ref().map(|m| m.q_rank), Some(None));
    dir.round_trips([c, p]);
    dir.refuses_replaced(
        v3,
        &[
            // Its class adds no load-balancing loss.
            (
                r#""scoring_func": "sigmoid""#,
                r#""scoring_func": "sigmoid", "output_router_logits": true"#,
                "DBRX, GPT-OSS, PhiMoE and ERNIE 4.5, as transformers does, not for deepseek_v3 (transformers' class adds none)",
            ),
            (
                r#""qk_rope_head_dim": 64"#,
                r#""qk_rope_head_dim": 64, "head_dim": 128"#,
                "head_dim 128: DeepSeek-V3's config class turns",
            ),
            (
                r#""n_group": 8"#,
                r#""n_group": 7"#,
                "n_group 7: the 256 experts must split",
            ),
            (
                r#""topk_group": 4"#,
                r#""topk_group": 9"#,
                "topk_group 9 is more than the n_group 8 groups",
            ),
            (
                r#""scoring_func": "sigmoid""#,
                r#""scoring_func": "softmax""#,
                "scoring_func Some(\"softmax\")",
            ),
        ],
    );
}

#[test]
fn glm_configs_are_read_and_counted() {
    let dir = ConfigDir::new("glm-configs");
    // GLM-4-9B-0414's sizes; the count is transformers'.
    let nine = r#"{"model_type": "glm4", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": true, "rms_norm_eps": 1e-05, "max_position_embeddings": 32768}"#;
    let c = dir.read(nine).unwrap();
    assert_eq!(
        (c.rotary_dim(), c.qkv_bias, c.o_bias, c.pad_token),
        (64, true, false, Some(151329))
    );
    assert_eq!(total(&c), 9400279040);
    // GLM's layers: the same but for GLM-4's two norms a layer more.
    let g = dir.read(&nine.replace(r#""glm4""#, r#""glm""#)).unwrap();
    assert_eq!(total(&c) - total(&g), 40 * 2 * 4096);
    dir.round_trips([c, g]);
}

#[test]
fn glm4_moe_configs_are_read_and_counted() {
    let dir = ConfigDir::new("glm4-moe-configs");
    // GLM-4.5-Air's config as published; the counts are transformers'
    // state dicts' (the routers' corrections included).
    let air = r#"{"model_type": "glm4_moe", "attention_bias": true, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5, "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "norm_topk_prob": true, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 1000000, "tie_word_embeddings": false, "use_qk_norm": false, "vocab_size": 151552, "pad_token_id": 151329}"#;
    let c = dir.read(air).unwrap();
    assert_eq!(total(&c), 106852251264);
    assert_eq!(
        (c.rotary_dim(), c.qkv_bias, c.o_bias, c.qk_norm),
        (64, true, false, false)
    );
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (moe.dense_layers, moe.shared, moe.grouped.map(|g| g.groups)),
        (vec![0], Some(1408), Some(1))
    );
    assert!(!c.moe_layer(0) && c.moe_layer(1));
    // GLM-4.5's sizes: three dense layers, each head's queries and keys
    // normalised.
    let full = air
        .replace(r#""hidden_size": 4096"#, r#""hidden_size": 5120"#)
        .replace(
            r#""intermediate_size": 10944"#,
            r#""intermediate_size": 12288"#,
        )
        .replace(
            r#""moe_intermediate_size": 1408"#,
            r#""moe_intermediate_size": 1536"#,
        )
        .replace(r#""n_routed_experts": 128"#, r#""n_routed_experts": 160"#)
        .replace(
            r#""first_k_dense_replace": 1"#,
            r#""first_k_dense_replace": 3"#,
        )
        .replace(r#""num_hidden_layers": 46"#, r#""num_hidden_layers": 92"#)
        .replace(r#""use_qk_norm": false"#, r#""use_qk_norm": true"#)
        .replace(
            r#""routed_scaling_factor": 1.0"#,
            r#""routed_scaling_factor": 2.5"#,
        );
    let f = dir.read(&full).unwrap();
    assert_eq!(total(&f), 352797829024);
    assert!(f.qk_norm && (0..3).all(|l| !f.moe_layer(l)) && f.moe_layer(3));
    dir.round_trips([c, f]);
    dir.refuses(
        &air.replace(r#""n_group": 1"#, r#""n_group": 3"#),
        "n_group 3: the 128 experts must split",
    );
}

#[test]
fn gpt_oss_configs_are_read_and_counted() {
    let dir = ConfigDir::new("gpt-oss-configs");
    // gpt-oss-20b's config as published (its `layer_types` left out:
    // every other layer full, as the default has it); the counts are
    // transformers' state dicts' in bf16.
    let published = r#"{"architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false}, "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0", "use_cache": true, "vocab_size": 201088, "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}}"#;
    let quantization = r#", "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}"#;
    let scaling = r#""rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false}"#;
    // Its weights are mxfp4 blocks and scales: refused, naming the way
    // to the bf16 ones.
    let err = dir.read(published).unwrap_err().to_string();
    assert!(
        err.contains(r#"quantization_config (quant_method "mxfp4")"#)
            && err.contains("zrt dequantize --from DIR --out DIR-bf16"),
        "{err}"
    );
    let bf16 = published.replace(quantization, "");
    let c = dir.read(&bf16).unwrap();
    assert_eq!(total(&c), 20914757184);
    assert_eq!(
        (c.window(0), c.window(1), c.qkv_bias, c.o_bias),
        (Some(128), None, true, true)
    );
    let moe = c.moe.clone().unwrap();
    assert_eq!((moe.experts, moe.top_k, moe.intermediate), (32, 4, 2880));
    // Left out, the scaling is the class's YaRN, the one published.
    let plain = dir.read(&bf16.replace(scaling, r#""rope": null"#)).unwrap();
    assert!(matches!(c.rope_scaling, RopeScaling::Yarn { .. }));
    assert_eq!(plain.rope_scaling, c.rope_scaling);
    // gpt-oss-120b's sizes.
    let big = bf16
        .replace(r#""num_hidden_layers": 24"#, r#""num_hidden_layers": 36"#)
        .replace(r#""num_local_experts": 32"#, r#""num_local_experts": 128"#);
    let b = dir.read(&big).unwrap();
    assert_eq!(total(&b), 116829156672);
    dir.round_trips([c, b, plain]);
    dir.refuses(
        &bf16.replace(r#""swiglu_limit": 7.0"#, r#""swiglu_limit": 5.0"#),
        "swiglu_limit 5: transformers' GPT-OSS clamps",
    );
}

#[test]
fn granitemoe_configs_are_read_and_counted() {
    let dir = ConfigDir::new("granitemoe-configs");
    // granite-3.0-1b-a400m's sizes and multipliers; the counts are
    // transformers' parameters (the head tied: the embedding once).
    let small = r#"{"model_type": "granitemoe", "attention_bias": false, "attention_dropout": 0.1, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 512, "logits_scaling": 6.0, "max_position_embeddings": 4096, "num_attention_heads": 16, "num_experts_per_tok": 8, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 0, "residual_multiplier": 0.22, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 10000, "tie_word_embeddings": true, "vocab_size": 49155, "attention_multiplier": 0.015625}"#;
    let c = dir.read(small).unwrap();
    assert_eq!(total(&c), 1334628352);
    assert_eq!(
        (
            c.embedding_multiplier,
            c.residual_multiplier,
            c.attention_multiplier,
            c.logits_scaling
        ),
        (12.0, 0.22, Some(0.015625), 6.0)
    );
    let moe = c.moe.clone().unwrap();
    assert_eq!((moe.experts, moe.top_k, moe.intermediate), (32, 8, 512));
    assert!((0..24).all(|l| c.moe_layer(l)));
    // granite-3.0-3b-a800m's sizes.
    let large = small
        .replace(r#""hidden_size": 1024"#, r#""hidden_size": 1536"#)
        .replace(
            r#""num_attention_heads": 16"#,
            r#""num_attention_heads": 24"#,
        )
        .replace(r#""num_hidden_layers": 24"#, r#""num_hidden_layers": 32"#)
        .replace(r#""num_local_experts": 32"#, r#""num_local_experts": 40"#);
    let l = dir.read(&large).unwrap();
    assert_eq!(total(&l), 3298793472);
    // The routers' load-balancing loss at the class's coefficient,
    // written back on export.
    let balanced = dir
        .read(&small.replace(
            r#""output_router_logits": false"#,
            r#""output_router_logits": true"#,
        ))
        .unwrap();
    assert_eq!(balanced.moe.as_ref().and_then(|m| m.balance), Some(0.001));
    // PhiMoE's too, at its class's coefficient, though its sparsemixer
    // chooses otherwise (`transformers` balances its logits' softmax).
    let phimoe = dir
        .read(
            &small
                .replace(r#""model_type": "granitemoe""#, r#""model_type": "phimoe""#)
                .replace(r#""num_experts_per_tok": 8"#, r#""num_experts_per_tok": 2"#)
                .replace(
                    r#""output_router_logits": false"#,
                    r#""output_router_logits": true"#,
                ),
        )
        .unwrap();
    assert_eq!(phimoe.moe.as_ref().and_then(|m| m.balance), Some(0.001));
    dir.round_trips([c, l, balanced, phimoe]);
}

#[test]
fn granitemoe_shared_configs_are_read_and_counted() {
    let dir = ConfigDir::new("granitemoeshared-configs");
    // The config class's defaults with a shared MLP 1024 wide, and
    // without (its default, 0: none); the counts are transformers'.
    let shared = r#"{"model_type": "granitemoeshared", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "shared_intermediate_size": 1024}"#;
    let c = dir.read(shared).unwrap();
    assert_eq!(total(&c), 37441769472);
    assert_eq!(c.moe.as_ref().and_then(|m| m.shared), Some(1024));
    let none = shared.replace(r#", "shared_intermediate_size": 1024"#, "");
    let n = dir.read(&none).unwrap();
    assert_eq!(total(&n), 37039116288);
    assert_eq!(n.moe.as_ref().and_then(|m| m.shared), None);
    dir.round_trips([c, n]);
}

#[test]
fn deepseek_v2_configs_are_read_and_counted() {
    let dir = ConfigDir::new("deepseek-v2-configs");
    // DeepSeek-V2-Lite's config as published; the counts are
    // transformers' state dicts'.
    let lite = r#"{"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": true, "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16", "use_cache": true, "v_head_dim": 128, "vocab_size": 102400}"#;
    let c = dir.read(lite).unwrap();
    assert_eq!(total(&c), 15706484224);
    let moe = c.moe.clone().unwrap();
    let g = moe.grouped.clone().unwrap();
    assert_eq!(
        (moe.top_k, moe.shared, moe.normalize, moe.dense_layers),
        (6, Some(2 * 1408), false, vec![0])
    );
    assert_eq!(
        (g.groups, g.top_groups, g.scale, g.scoring),
        (1, 1, 1.0, Scoring::Softmax)
    );
    // Its scores' scale leaves mscale_all_dim out, as transformers' does.
    assert_eq!(c.attention_multiplier, Some(192f64.powf(-0.5)));
    assert!(!c.mla.as_ref().unwrap().interleave);
    // DeepSeek-V2's sizes: the queries' bottleneck, eight groups.
    let v2 = lite
        .replace(r#""hidden_size": 2048"#, r#""hidden_size": 5120"#)
        .replace(
            r#""intermediate_size": 10944"#,
            r#""intermediate_size": 12288"#,
        )
        .replace(r#""q_lora_rank": null"#, r#""q_lora_rank": 1536"#)
        .replace(r#""num_hidden_layers": 27"#, r#""num_hidden_layers": 60"#)
        .replace(
            r#""num_attention_heads": 16"#,
            r#""num_attention_heads": 128"#,
        )
        .replace(
            r#""num_key_value_heads": 16"#,
            r#""num_key_value_heads": 128"#,
        )
        .replace(r#""n_routed_experts": 64"#, r#""n_routed_experts": 160"#)
        .replace(
            r#""moe_intermediate_size": 1408"#,
            r#""moe_intermediate_size": 1536"#,
        )
        .replace(r#""n_group": 1"#, r#""n_group": 8"#)
        .replace(r#""topk_group": 1"#, r#""topk_group": 3"#)
        .replace(
            r#""routed_scaling_factor": 1.0"#,
            r#""routed_scaling_factor": 16.0"#,
        )
        .replace(
            r#""topk_method": "greedy""#,
            r#""topk_method": "group_limited_greedy""#,
        );
    let b = dir.read(&v2).unwrap();
    assert_eq!(total(&b), 235741434880);
    let g = b.moe.clone().unwrap().grouped.unwrap();
    assert_eq!((g.groups, g.top_groups, g.scale), (8, 3, 16.0));
    dir.round_trips([c, b]);
    // What transformers' class and DeepSeek's code would compute apart,
    // or not at all, is refused naming the field.
    dir.refuses_replaced(
        lite,
        &[
            (
                r#""norm_topk_prob": false"#,
                r#""norm_topk_prob": true"#,
                "norm_topk_prob true: transformers' DeepSeek-V2 never normalises",
            ),
            (
                r#""topk_method": "greedy""#,
                r#""topk_method": "noaux_tc""#,
                r#"topk_method "noaux_tc""#,
            ),
            (
                r#""scoring_func": "softmax""#,
                r#""scoring_func": "sigmoid""#,
                r#"scoring_func Some("sigmoid")"#,
            ),
            (
                r#""moe_layer_freq": 1"#,
                r#""moe_layer_freq": 2"#,
                "moe_layer_freq 2",
            ),
            (
                r#""num_experts_per_tok": 6, "#,
                "",
                "no num_experts_per_tok: DeepSeek-V2's config class has no default",
            ),
        ],
    );
}

#[test]
fn ernie4_5_configs_are_read_and_counted() {
    let dir = ConfigDir::new("ernie4_5-configs");
    // ERNIE-4.5-0.3B's sizes; the counts are transformers' parameters
    // (the head tied), without biases and with.
    let small = r#"{"model_type": "ernie4_5", "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 131072, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 18, "pad_token_id": 0, "rms_norm_eps": 1e-05, "vocab_size": 103424, "rope_theta": 500000, "use_bias": false, "tie_word_embeddings": true, "attention_dropout": 0.1}"#;
    let c = dir.read(small).unwrap();
    assert_eq!(total(&c), 360748032);
    // Its class's attention drops nothing, whatever the config says.
    assert_eq!(c.attention_dropout, 0.0);
    let b = dir
        .read(&small.replace(r#""use_bias": false"#, r#""use_bias": true"#))
        .unwrap();
    assert_eq!(total(&b), 360941568);
    assert!(b.qkv_bias && b.o_bias && b.mlp_bias);
    dir.round_trips([c, b]);
}

#[test]
fn ernie4_5_moe_configs_are_read_and_counted() {
    let dir = ConfigDir::new("ernie4_5_moe-configs");
    // ERNIE-4.5-21B-A3B's sizes (its class's defaults); the counts are
    // transformers' parameters (the head tied, the corrections counted).
    let a3b = r#"{"model_type": "ernie4_5_moe", "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288, "max_position_embeddings": 131072, "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 28, "pad_token_id": 0, "rms_norm_eps": 1e-05, "vocab_size": 103424, "rope_theta": 500000, "tie_word_embeddings": true, "use_bias": false, "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_intermediate_size": 1536, "moe_k": 6, "moe_layer_interval": 1}"#;
    let c = dir.read(a3b).unwrap();
    assert_eq!(total(&c), 21825437888);
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (moe.experts, moe.top_k, moe.intermediate, moe.shared),
        (64, 6, 1536, Some(2 * 1536))
    );
    assert!(!c.moe_layer(0) && (1..28).all(|l| c.moe_layer(l)));
    // Every other layer from the fourth to the twenty-first, no shared
    // experts: transformers' layers 3, 5, ..., 19.
    let sparse = a3b
        .replace(r#""moe_layer_interval": 1"#, r#""moe_layer_interval": 2"#)
        .replace(
            r#""moe_layer_start_index": 1"#,
            r#""moe_layer_start_index": 3, "moe_layer_end_index": 20"#,
        )
        .replace(
            r#""moe_num_shared_experts": 2"#,
            r#""moe_num_shared_experts": 0"#,
        );
    let s = dir.read(&sparse).unwrap();
    assert_eq!(total(&s), 9294625856);
    let layers: Vec<i64> = (0..28).filter(|&l| s.moe_layer(l)).collect();
    assert_eq!(layers, (3..20).step_by(2).collect::<Vec<i64>>());
    assert_eq!(s.moe.as_ref().unwrap().shared, None);
    // Its routers' load-balancing loss, at the config's coefficient.
    let balanced = dir
        .read(&a3b.replace(
            r#""moe_k": 6"#,
            r#""moe_k": 6, "output_router_logits": true, "router_aux_loss_coef": 0.02"#,
        ))
        .unwrap();
    assert_eq!(balanced.moe.as_ref().and_then(|m| m.balance), Some(0.02));
    dir.round_trips([c, s, balanced]);
    dir.refuses_replaced(
        a3b,
        &[
            (
                r#""use_bias": false"#,
                r#""use_bias": true"#,
                "use_bias true: zrt builds ERNIE 4.5's experts and head without biases",
            ),
            (
                r#""moe_k": 6"#,
                r#""moe_k": 6, "moe_norm_min": 0.001"#,
                "moe_norm_min 0.001",
            ),
        ],
    );
}

#[test]
fn seed_oss_configs_are_read_and_counted() {
    let dir = ConfigDir::new("seed_oss-configs");
    // Seed-OSS-36B's sizes; the count is transformers' parameters.
    let big = r#"{"model_type": "seed_oss", "vocab_size": 155136, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 80, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 524288, "rope_theta": 10000000.0, "attention_bias": true, "attention_out_bias": false, "mlp_bias": false, "tie_word_embeddings": false, "rms_norm_eps": 1e-06, "pad_token_id": 1}"#;
    let c = dir.read(big).unwrap();
    assert_eq!(total(&c), 36151104512);
    // Query, key and value biases, not the output's; its class's
    // dropouts, 0.1 each, where the config leaves them out.
    assert_eq!(
        (c.qkv_bias, c.o_bias, c.attention_dropout, c.resid_dropout),
        (true, false, 0.1, 0.1)
    );
    dir.round_trips([c]);
}

#[test]
fn exaone4_configs_are_read_and_counted() {
    let dir = ConfigDir::new("exaone4-configs");
    // EXAONE 4.0 32B's sizes, its pattern spelled "LLLG" beside the
    // layer list (three windowed layers, then a global one); the counts
    // are transformers' parameters.
    let kinds = |n: usize, every: usize| {
        let k: Vec<&str> = (0..n)
            .map(|l| match (l + 1) % every {
                0 => "\"full_attention\"",
                _ => "\"sliding_attention\"",
            })
            .collect();
        format!(r#", "layer_types": [{}]}}"#, k.join(", "))
    };
    let big = r#"{"model_type": "exaone4", "vocab_size": 102400, "hidden_size": 5120, "intermediate_size": 27392, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "sliding_window": 4096, "sliding_window_pattern": "LLLG", "tie_word_embeddings": false, "rms_norm_eps": 1e-05}"#;
    let big = format!("{}{}", big.trim_end_matches('}'), kinds(64, 4));
    let c = dir.read(&big).unwrap();
    assert_eq!(total(&c), 32003216384);
    assert_eq!(
        (c.window(0), c.window(3), c.qk_norm),
        (Some(4096), None, true)
    );
    // The global layers do not turn, the windowed ones do.
    let turns = c.rope_layers.clone().unwrap();
    assert!(turns[0] && turns[2] && !turns[3] && !turns[63]);
    // EXAONE 4.0 1.2B: no window, every layer global and turning.
    let small = r#"{"model_type": "exaone4", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 4096, "num_hidden_layers": 30, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "sliding_window": null, "tie_word_embeddings": true, "rms_norm_eps": 1e-05}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 1279391488);
    assert_eq!(s.window(0), None);
    assert!(s.rope_layers.as_ref().unwrap().iter().all(|&t| t));
    dir.round_trips([c, s]);
}

#[test]
fn hunyuan_dense_configs_are_read_and_counted() {
    let dir = ConfigDir::new("hunyuan-dense-configs");
    // The class's defaults with its heads 128 wide (transformers cannot
    // build the class without a head_dim; zrt takes the width's share);
    // the count is transformers' parameters.
    let given = r#"{"model_type": "hunyuan_v1_dense", "vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 128, "mlp_bias": true, "rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 8859684864);
    assert_eq!((c.qk_norm, c.mlp_bias), (true, false));
    assert_eq!(
        c.rope_scaling,
        RopeScaling::DynamicAlpha {
            factor: 1.0,
            alpha: 1000.0
        }
    );
    // Without an alpha (or with 0), Llama's dynamic scaling.
    let plain = dir
        .read(&given.replace(r#", "alpha": 1000.0"#, r#", "alpha": 0"#))
        .unwrap();
    assert_eq!(plain.rope_scaling, RopeScaling::Dynamic { factor: 1.0 });
    dir.round_trips([c, plain]);
    dir.refuses(
        &given.replace(r#""alpha": 1000.0"#, r#""alpha": "high""#),
        "its `alpha` is missing or not a number",
    );
    // Another family's alpha is no scaling it reads.
    let llama = dir
        .read(r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "alpha": 1000.0}}"#)
        .unwrap();
    assert_eq!(llama.rope_scaling, RopeScaling::Dynamic { factor: 2.0 });
}

#[test]
fn hunyuan_moe_configs_are_read_and_counted() {
    let dir = ConfigDir::new("hunyuan-moe-configs");
    // Hunyuan-A13B's shape (64 experts, 8 a token, 32 layers 4096 wide,
    // the head tied: the 80B its card gives); the count is
    // transformers' parameters.
    let given = r#"{"model_type": "hunyuan_v1_moe", "vocab_size": 128167, "hidden_size": 4096, "intermediate_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_experts": 64, "moe_topk": 8, "tie_word_embeddings": true, "rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1000.0}}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 80393183232);
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (
            moe.experts,
            moe.top_k,
            moe.intermediate,
            moe.shared,
            moe.normalize
        ),
        (64, 8, 3072, Some(3072), true)
    );
    assert!((0..32).all(|l| c.moe_layer(l)));
    dir.round_trips([c]);
    dir.refuses(
        &given.replace(r#""moe_topk": 8"#, r#""moe_topk": [8, 8]"#),
        "moe_topk [8,8]: a count for each layer",
    );
}

#[test]
fn ctrl_configs_are_read_and_counted() {
    let dir = ConfigDir::new("ctrl-configs");
    // CTRLConfig's defaults, CTRL's own sizes (1.6B, its head tied with
    // a bias of its own); the counts are transformers' parameters.
    let c = dir.read(r#"{"model_type": "ctrl"}"#).unwrap();
    assert_eq!(total(&c), 1637964550);
    assert_eq!(
        (
            c.hidden,
            c.intermediate,
            c.layers,
            c.heads,
            c.positions,
            c.vocab
        ),
        (1280, 8192, 48, 16, 256, 246534)
    );
    assert!(c.tied && c.head_bias && c.qkv_bias && c.o_bias && c.mlp_bias);
    assert_eq!(c.activation, Activation::Relu);
    assert_eq!(c.embedding_multiplier, 1280f64.sqrt());
    assert_eq!((c.resid_dropout, c.embedding_dropout), (0.1, 0.1));
    // Small and untied.
    let small = r#"{"model_type": "ctrl", "vocab_size": 1000, "n_embd": 64, "dff": 96, "n_layer": 3, "n_head": 4, "n_positions": 128, "tie_word_embeddings": false, "resid_pdrop": 0.0}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 217160);
    assert!(!s.tied && s.head_bias);
    dir.round_trips([c, s]);
    dir.refuses_replaced(
        small,
        &[(
            "}",
            r#", "layer_norm_epsilon": 1e-5}"#,
            "layer_norm_epsilon 0.00001: CTRL's class normalises its layers at a fixed 1e-6",
        )],
    );
    // Errors name CTRL's fields.
    dir.refuses_changed(small, r#""n_head": 5"#, "n_head");
}

#[test]
fn modernbert_decoder_configs_are_read_and_counted() {
    let dir = ConfigDir::new("modernbert-decoder-configs");
    // ModernBertDecoderConfig's defaults (its sizes given), the Ettin
    // decoders' 150M shape
    // (its head tied, biased, after a prediction head); the counts are
    // transformers' parameters.
    let given = r#"{"model_type": "modernbert-decoder", "vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22, "num_attention_heads": 12}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 149655232);
    assert_eq!(
        (c.hidden, c.intermediate, c.layers, c.heads, c.vocab),
        (768, 1152, 22, 12, 50368)
    );
    assert!(c.tied && c.head_bias && !c.qkv_bias && !c.o_bias && !c.mlp_bias);
    assert_eq!(
        (c.activation, c.eps, c.rope_theta),
        (Activation::Gelu, 1e-5, 160000.0)
    );
    assert_eq!(c.pad_token, Some(50283));
    // Half of `local_attention` (128), every third layer from the first
    // global.
    let windows: Vec<Option<i64>> = (0..4).map(|l| c.window(l)).collect();
    assert_eq!(windows, [None, Some(64), Some(64), None]);
    // Small, untied, biased, its own window, its layers' kinds listed.
    let small = r#"{"model_type": "modernbert-decoder", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "tie_word_embeddings": false, "decoder_bias": false, "attention_bias": true, "mlp_bias": true, "pad_token_id": 0, "local_attention": 9, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "global_rope_theta": 5000.0}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 238592);
    assert!(!s.tied && !s.head_bias && s.o_bias && s.mlp_bias);
    let windows: Vec<Option<i64>> = (0..3).map(|l| s.window(l)).collect();
    assert_eq!(windows, [Some(4), None, Some(4)]);
    assert_eq!(s.rope_theta, 5000.0);
    dir.round_trips([c, s]);
    dir.refuses_replaced(
        small,
        &[
            (
                "}",
                r#", "norm_bias": true}"#,
                "norm_bias true: zrt builds ModernBERT-decoder's LayerNorms without biases",
            ),
            (
                "}",
                r#", "mlp_dropout": 0.1}"#,
                "mlp_dropout 0.1: zrt drops out nothing inside the MLP (set it to 0)",
            ),
            (
                "}",
                r#", "classifier_bias": true}"#,
                "classifier_bias true: zrt builds the prediction head's `lm_head.dense` without a bias",
            ),
            (
                "}",
                r#", "classifier_activation": "silu"}"#,
                r#"classifier_activation "silu": zrt activates the prediction head as the MLP (hidden_activation "gelu")"#,
            ),
            (
                r#""local_attention": 9"#,
                r#""local_attention": 1"#,
                "local_attention 1: ModernBERT-decoder's sliding layers attend within half of it",
            ),
            (
                r#""local_attention": 9"#,
                r#""local_attention": null"#,
                "local_attention null: ModernBERT-decoder's sliding layers attend within half of it",
            ),
            (
                r#""full_attention", "sliding"#,
                r#""chunked_attention", "sliding"#,
                r#"layer_types entry "chunked_attention": ModernBERT-decoder's layers are "full_attention" or "sliding_attention""#,
            ),
        ],
    );
}

#[test]
fn rwkv_configs_are_read_and_counted() {
    let dir = ConfigDir::new("rwkv-configs");
    // RWKV-4 169M (the Pile's), its widths left to the class; the
    // counts are transformers' parameters.
    let given = r#"{"model_type": "rwkv", "vocab_size": 50277, "hidden_size": 768, "num_hidden_layers": 12, "context_length": 1024, "attention_hidden_size": null, "intermediate_size": null}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 169342464);
    assert_eq!(
        (
            c.hidden,
            c.intermediate,
            c.layers,
            c.heads * c.head_dim,
            c.vocab
        ),
        (768, 3072, 12, 768, 50277)
    );
    assert!(!c.tied && !c.o_bias && !c.mlp_bias && c.pad_token.is_none());
    assert_eq!((c.eps, c.positions, c.rescale_every), (1e-5, 1024, Some(6)));
    assert!((0..12).all(|l| c.window(l).is_none()));
    // Small, tied, the time mix narrower, another epsilon, never
    // rescaled.
    let small = r#"{"model_type": "rwkv", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3, "attention_hidden_size": 48, "context_length": 128, "tie_word_embeddings": true, "layer_norm_epsilon": 1e-4, "rescale_every": 0}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 213728);
    assert_eq!((s.heads * s.head_dim, s.intermediate), (48, 256));
    assert_eq!((s.eps, s.rescale_every, s.tied), (1e-4, Some(0), true));
    // Its export's config turns the class's cache off (hidden_size wide,
    // it fails a narrower time mix).
    let written: serde_json::Value = serde_json::from_str(&s.to_hf_json()).unwrap();
    assert_eq!(written["use_cache"], false);
    assert!(c.to_hf_json().find("use_cache").is_none());
    dir.round_trips([c, s]);
    dir.refuses_replaced(
        small,
        &[
            (
                r#""rescale_every": 0"#,
                r#""rescale_every": 1.5"#,
                "rescale_every 1.5: a whole number of blocks (6 by default; 0: never)",
            ),
            (
                r#""hidden_size": 64"#,
                r#""hidden_size": 0"#,
                "`hidden_size` is missing or not a positive integer",
            ),
            (
                r#""attention_hidden_size": 48"#,
                r#""attention_hidden_size": -2"#,
                "`attention_hidden_size` is missing or not a positive integer",
            ),
        ],
    );
    // An odd time-mix width reads (nothing turns).
    let odd = dir.read(&small.replace("48", "47")).unwrap();
    assert_eq!(
        (odd.heads * odd.head_dim, total(&odd)),
        (47, 213728 - 3 * (2 + 4 * 64))
    );
}

#[test]
fn doge_configs_are_read_and_counted() {
    let dir = ConfigDir::new("doge-configs");
    // DogeConfig's defaults (its sizes given: the 320M shape, untied);
    // the counts are transformers' parameters.
    let given = r#"{"model_type": "doge", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 32, "num_attention_heads": 8}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 403055872);
    assert_eq!(
        (
            c.hidden,
            c.intermediate,
            c.layers,
            c.heads,
            c.kv_heads,
            c.vocab
        ),
        (1024, 2048, 32, 8, 8, 32768)
    );
    assert!(!c.tied && c.qk_norm && !c.o_bias && !c.mlp_bias);
    assert_eq!((c.keep_window, c.sliding_window), (Some(2048), None));
    assert_eq!((c.activation, c.eps), (Activation::Silu, 1e-6));
    // Small, tied, biased, grouped, heads narrower than the width's
    // share, in a window, dropping out.
    let small = r#"{"model_type": "doge", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": true, "attention_bias": true, "mlp_bias": true, "sliding_window": 7, "keep_window_size": 8, "hidden_dropout": 0.1, "rope_theta": 5000.0}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 139868);
    assert!(s.tied && s.qkv_bias && s.o_bias && s.mlp_bias);
    assert_eq!(
        (s.keep_window, s.window(2), s.resid_dropout),
        (Some(8), Some(7), 0.1)
    );
    assert_eq!(s.attention_output_dropout(), 0.1);
    dir.round_trips([c, s]);
    dir.refuses_replaced(
        small,
        &[
            (
                "}",
                r#", "is_moe": true}"#,
                "is_moe true: zrt builds Doge's dense MLP only, not its product-key experts (DogeCDMoE); set it to false",
            ),
            (
                r#""keep_window_size": 8"#,
                r#""keep_window_size": 0"#,
                "`keep_window_size` is missing or not a positive integer",
            ),
            (
                r#""keep_window_size": 8"#,
                r#""keep_window_size": null"#,
                "keep_window_size null: each query keeps at least one key",
            ),
        ],
    );
}

#[test]
fn openai_gpt_configs_are_read_and_counted() {
    let dir = ConfigDir::new("openai-gpt-configs");
    // OpenAIGPTConfig's defaults, OpenAI GPT's own sizes (117M, its head
    // tied); the counts are transformers' parameters.
    let c = dir.read(r#"{"model_type": "openai-gpt"}"#).unwrap();
    assert_eq!(total(&c), 116534784);
    assert_eq!(
        (
            c.hidden,
            c.intermediate,
            c.layers,
            c.heads,
            c.positions,
            c.vocab
        ),
        (768, 3072, 12, 12, 512, 40478)
    );
    assert!(c.tied && !c.head_bias && c.qkv_bias && c.o_bias && c.mlp_bias);
    assert!(!c.final_norm());
    // Its `gelu` is the tanh approximation.
    assert_eq!(c.activation, Activation::GeluNew);
    assert_eq!(c.eps, 1e-5);
    let rates = (c.resid_dropout, c.embedding_dropout, c.attention_dropout);
    assert_eq!(rates, (0.1, 0.1, 0.1));
    // Small, untied, its `swish` SiLU.
    let small = r#"{"model_type": "openai-gpt", "vocab_size": 1000, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 128, "afn": "swish", "tie_word_embeddings": false, "attn_pdrop": 0.0}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 286144);
    assert!(!s.tied);
    assert_eq!(s.activation, Activation::Silu);
    assert_eq!(s.attention_dropout, 0.0);
    dir.round_trips([c, s]);
    dir.refuses_changed(
        small,
        r#""afn": "gelu_new""#,
        r#"afn "gelu_new": OpenAI GPT's class knows ["gelu", "relu", "silu", "swish"]"#,
    );
    // Errors name OpenAI GPT's fields.
    dir.refuses_changed(small, r#""n_head": 5"#, "n_head");
}

#[test]
fn aria_text_configs_are_read_and_counted() {
    let dir = ConfigDir::new("aria-text-configs");
    // Aria's language model's shape (64 experts, 6 a token, two experts'
    // width shared, 28 layers 2560 wide: the 24.9B its card gives); the
    // counts are transformers' parameters.
    let given = r#"{"model_type": "aria_text", "vocab_size": 100352, "hidden_size": 2560, "intermediate_size": 1664, "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 20, "moe_num_experts": 64, "moe_topk": 6, "moe_num_shared_experts": 2, "max_position_embeddings": 65536, "rope_theta": 5000000.0}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 24869091840);
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (moe.experts, moe.top_k, moe.intermediate, moe.shared),
        (64, 6, 1664, Some(2 * 1664))
    );
    assert!((0..28).all(|l| c.moe_layer(l)));
    // Small, tied, biased (the shared MLP's biases too), three experts'
    // width shared.
    let small = r#"{"model_type": "aria_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_num_experts": 5, "moe_topk": 3, "moe_num_shared_experts": 3, "attention_bias": true, "mlp_bias": true, "tie_word_embeddings": true}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 214064);
    assert!(s.qkv_bias && s.o_bias && s.mlp_bias && s.tied);
    dir.round_trips([c, s]);
    dir.refuses_changed(
        given,
        r#""moe_num_shared_experts": 0"#,
        "moe_num_shared_experts 0: Aria's class always adds its shared experts' MLP",
    );
    dir.refuses_changed(
        given,
        r#""moe_topk": 65"#,
        "moe_topk 65 is more than the 64 experts",
    );
    dir.refuses_replaced(
        given,
        &[(
            "}",
            r#", "output_router_logits": true}"#,
            "output_router_logits true",
        )],
    );
}

#[test]
fn dbrx_configs_are_read_and_counted() {
    let dir = ConfigDir::new("dbrx-configs");
    // DBRX's published shape (16 experts, 4 a token, 40 layers 6144
    // wide: the 132B its card gives), its sub-configs as its files hold
    // them; the count is transformers' parameters.
    let given = r#"{"model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768, "vocab_size": 100352, "resid_pdrop": 0.0, "emb_pdrop": 0.0, "attn_config": {"attn_pdrop": 0.0, "clip_qkv": 8, "kv_n_heads": 8, "model_type": "", "rope_theta": 500000}, "ffn_config": {"ffn_hidden_size": 10752, "model_type": "", "moe_jitter_eps": 0.01, "moe_loss_weight": 0.05, "moe_num_experts": 16, "moe_top_k": 4}, "tie_word_embeddings": false, "output_router_logits": false}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 131596523520);
    assert_eq!(
        (c.hidden, c.heads, c.kv_heads, c.layers, c.positions),
        (6144, 48, 8, 40, 32768)
    );
    assert_eq!(
        (c.clip_qkv, c.rope_theta, c.eps),
        (Some(8.0), 500000.0, 1e-5)
    );
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (
            moe.experts,
            moe.top_k,
            moe.intermediate,
            moe.normalize,
            moe.jitter
        ),
        (16, 4, 10752, true, 0.01)
    );
    let units = c.unit_params();
    assert_eq!(
        (units[0].0.as_str(), units[1].0.as_str()),
        ("transformer.wte", "transformer.blocks.0")
    );
    // The class's defaults; `hidden_size` spelled as its attribute map
    // lets a config spell it, and unnormalised experts.
    let defaults = dir.read(r#"{"model_type": "dbrx"}"#).unwrap();
    assert_eq!(
        (
            defaults.hidden,
            defaults.heads,
            defaults.kv_heads,
            defaults.vocab
        ),
        (2048, 16, 1, 32000)
    );
    let spelled = dir
        .read(r#"{"model_type": "dbrx", "hidden_size": 512, "d_model": 64, "ffn_config": {"moe_normalize_expert_weights": null}}"#)
        .unwrap();
    assert_eq!(spelled.hidden, 512);
    assert!(!spelled.moe.clone().unwrap().normalize);
    // The routers' load-balancing loss, weighted by
    // `ffn_config.moe_loss_weight`, written back there.
    let balanced = dir
        .read(&given.replace(
            r#""output_router_logits": false"#,
            r#""output_router_logits": true"#,
        ))
        .unwrap();
    assert_eq!(
        [&balanced, &c].map(|c| c.moe.as_ref().and_then(|m| m.balance)),
        [Some(0.05), None]
    );
    dir.round_trips([c, defaults, spelled, balanced]);
    dir.refuses(
        &given.replace(r#""kv_n_heads": 8"#, r#""kv_n_heads": 5"#),
        "attn_config.kv_n_heads 5 does not divide n_heads 48",
    );
    dir.refuses(
        &given.replace(r#""d_model": 6144"#, r#""d_model": "wide""#),
        "`d_model` is missing or not a positive integer",
    );
    dir.refuses(
        &given.replace(r#""moe_top_k": 4"#, r#""moe_top_k": 4, "moe_top_p": 0.5"#),
        "ffn_config.moe_top_p: DbrxConfig's ffn_config has no such field",
    );
    dir.refuses(
        &given.replace(
            r#""moe_top_k": 4"#,
            r#""moe_top_k": 4, "moe_normalize_expert_weights": 2"#,
        ),
        "moe_normalize_expert_weights 2: zrt divides",
    );
    dir.refuses(
        &given.replace(r#""moe_jitter_eps": 0.01"#, r#""moe_jitter_eps": 1.5"#),
        "ffn_config.moe_jitter_eps 1.5",
    );
    dir.refuses(
        &given.replace(
            r#""moe_top_k": 4"#,
            r#""moe_top_k": 4, "ffn_act_fn": {"name": "gelu", "approximate": "tanh"}"#,
        ),
        "ffn_config.ffn_act_fn",
    );
    dir.refuses(
        &given.replace(
            r#""tie_word_embeddings": false"#,
            r#""tie_word_embeddings": true"#,
        ),
        "tie_word_embeddings true: DBRX's head is its own matrix",
    );
    dir.refuses(
        &given.replace(r#""moe_top_k": 4"#, r#""moe_top_k": 17"#),
        "ffn_config.moe_top_k 17 is more than the 16 experts",
    );
}

#[test]
fn falcon_configs_are_read_and_counted() {
    let dir = ConfigDir::new("falcon-configs");
    // Falcon 7B's published config (71 heads sharing one key and value,
    // its attention and MLP side by side after one norm, the head tied),
    // Falcon 40B's shape (the new architecture: 8 groups of 16 heads, two
    // norms) and Falcon-RW-1B's (sequential layers, every head its keys,
    // biases, ALiBi); the counts are transformers'.
    let seven = r#"{"alibi": false, "apply_residual_connection_post_layernorm": false, "architectures": ["FalconForCausalLM"], "attention_dropout": 0.0, "bias": false, "bos_token_id": 11, "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 4544, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": true, "new_decoder_architecture": false, "num_attention_heads": 71, "num_hidden_layers": 32, "parallel_attn": true, "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 65024}"#;
    let forty = r#"{"model_type": "falcon", "vocab_size": 65024, "hidden_size": 8192, "num_hidden_layers": 60, "num_attention_heads": 128, "new_decoder_architecture": true, "num_kv_heads": 8}"#;
    let rw = r#"{"model_type": "falcon", "vocab_size": 65024, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "multi_query": false, "parallel_attn": false, "bias": true, "alibi": true}"#;
    let layout = |new_arch, parallel, two_norms| FalconLayout {
        new_arch,
        parallel,
        two_norms,
        alibi: false,
    };
    let mut read = vec![];
    for (given, count, kv, want) in [
        (seven, 6921720704, 1, layout(false, true, false)),
        (forty, 41303293952, 8, layout(true, true, true)),
        (
            rw,
            1341771776,
            32,
            FalconLayout {
                alibi: true,
                ..layout(false, false, false)
            },
        ),
    ] {
        let c = dir.read(given).unwrap();
        assert_eq!(total(&c), count, "{given}");
        assert_eq!((c.kv_heads, c.falcon, c.tied), (kv, Some(want), true));
        assert_eq!((c.intermediate, c.eps), (4 * c.hidden, 1e-5));
        read.push(c);
    }
    assert!(read[2].qkv_bias && read[2].o_bias && read[2].mlp_bias);
    assert!(read[2].alibi() && !read[0].alibi() && !read[1].alibi());
    assert_eq!(read[0].unit_params()[1].0, "transformer.h.0");
    // `n_embed`, which its class takes over `hidden_size`.
    let named = dir
        .read(&forty.replace(
            r#""hidden_size": 8192"#,
            r#""hidden_size": 64, "n_embed": 256"#,
        ))
        .unwrap();
    assert_eq!((named.hidden, named.intermediate), (256, 1024));
    dir.round_trips(read);
    dir.refuses(
        &forty.replace(
            r#""num_kv_heads": 8"#,
            r#""num_kv_heads": 8, "parallel_attn": false"#,
        ),
        "new_decoder_architecture true with parallel_attn false",
    );
    dir.refuses(
        &seven.replace(
            r#""parallel_attn": true"#,
            r#""parallel_attn": true, "num_ln_in_parallel_attn": 2"#,
        ),
        "num_ln_in_parallel_attn 2 without new_decoder_architecture",
    );
    dir.refuses(
        &rw.replace(r#""bias": true"#, r#""bias": true, "num_kv_heads": 8"#),
        "num_kv_heads 8 with multi_query false and the old architecture",
    );
    dir.refuses(
        &forty.replace(r#""num_kv_heads": 8"#, r#""num_kv_heads": 48"#),
        "num_kv_heads 48 does not divide num_attention_heads 128",
    );
}

#[test]
fn gptj_configs_are_read_and_counted() {
    let dir = ConfigDir::new("gptj-configs");
    // GPT-J 6B's shape (its class's defaults: 28 layers 4096 wide, 64 of
    // each head's 256 dimensions turned); the count is transformers'
    // parameters, the head's bias among them.
    let given = r#"{"model_type": "gptj", "architectures": ["GPTJForCausalLM"], "n_embd": 4096, "n_head": 16, "n_layer": 28, "n_positions": 2048, "rotary_dim": 64, "vocab_size": 50400, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05, "tie_word_embeddings": false}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 6050882784);
    assert_eq!(
        (c.hidden, c.heads, c.kv_heads, c.layers, c.intermediate),
        (4096, 16, 16, 28, 16384)
    );
    assert_eq!((c.rotary_dim(), c.positions, c.tied), (64, 2048, false));
    assert!(c.mlp_bias && !c.qkv_bias && !c.o_bias);
    assert_eq!(c.activation, Activation::GeluNew);
    // The flat names its attribute map takes, over GPT-J's.
    let spelled = dir
        .read(r#"{"model_type": "gptj", "hidden_size": 256, "n_embd": 64, "n_head": 4, "rotary_dim": 16, "n_inner": 96}"#)
        .unwrap();
    assert_eq!(
        (spelled.hidden, spelled.intermediate, spelled.rotary_dim()),
        (256, 96, 16)
    );
    dir.round_trips([c, spelled]);
    dir.refuses(
        &given.replace(r#""rotary_dim": 64"#, r#""rotary_dim": null"#),
        "rotary_dim null: GPT-J turns that many of each head's 256 dimensions",
    );
    dir.refuses(
        &given.replace(r#""rotary_dim": 64"#, r#""rotary_dim": 512"#),
        "rotary_dim 512",
    );
    dir.refuses(
        &given.replace(r#""n_head": 16"#, r#""n_head": 0"#),
        "`n_head` is missing or not a positive integer",
    );
    dir.refuses(
        &given.replace(r#""n_positions": 2048"#, r#""n_positions": "long""#),
        "n_positions",
    );
}

#[test]
fn codegen_configs_are_read_and_counted() {
    let dir = ConfigDir::new("codegen-configs");
    // CodeGen 350M's shape (20 layers 1024 wide, 32 of each head's 64
    // dimensions turned); the count is transformers' parameters.
    let given = r#"{"model_type": "codegen", "architectures": ["CodeGenForCausalLM"], "n_embd": 1024, "n_head": 16, "n_layer": 20, "n_positions": 2048, "n_ctx": 2048, "rotary_dim": 32, "vocab_size": 51200, "activation_function": "gelu_new", "tie_word_embeddings": false}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 356712448);
    assert_eq!((c.heads, c.kv_heads, c.rotary_dim()), (16, 16, 32));
    dir.round_trips([c]);
    dir.refuses(
        &given.replace(r#""n_head": 16"#, r#""n_head": 6"#),
        "n_head 6: CodeGen's query-value-key matrix holds a quarter of the heads in each of its 4 blocks",
    );
}

#[test]
fn gpt_bigcode_configs_are_read_and_counted() {
    let dir = ConfigDir::new("gpt-bigcode-configs");
    // StarCoder's shape (40 layers 6144 wide, 48 heads sharing one key
    // and value, 8192 learned positions, the head tied); the count is
    // transformers' parameters, the positions' among them.
    let given = r#"{"model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "n_embd": 6144, "n_head": 48, "n_layer": 40, "n_positions": 8192, "n_inner": 24576, "vocab_size": 49152, "multi_query": true, "activation_function": "gelu_pytorch_tanh", "attention_softmax_in_fp32": true, "scale_attention_softmax_in_fp32": true}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 15517456384);
    assert_eq!((c.kv_heads, c.tied, c.positions), (1, true, 8192));
    assert!(c.qkv_bias && c.o_bias && c.mlp_bias);
    // The class's dropouts, 0.1 each, when left out.
    assert_eq!(
        (c.resid_dropout, c.embedding_dropout, c.attention_dropout),
        (0.1, 0.1, 0.1)
    );
    let mha = dir
        .read(&given.replace(
            r#""multi_query": true"#,
            r#""multi_query": false, "scale_attn_weights": false"#,
        ))
        .unwrap();
    assert_eq!((mha.kv_heads, mha.attention_multiplier), (48, Some(1.0)));
    dir.round_trips([c, mha]);
    dir.refuses(
        &given.replace(r#""n_head": 48"#, r#""n_head": 7"#),
        "n_head 7 does not divide n_embd 6144",
    );
}

#[test]
fn opt_configs_are_read_and_counted() {
    let dir = ConfigDir::new("opt-configs");
    // OPT-6.7B's published shape (32 layers 4096 wide, 2048 learned
    // positions two rows in, the head tied) and OPT-125m's (its class's
    // defaults); the counts are transformers' parameters.
    let given = r#"{"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 4096, "ffn_dim": 16384, "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048, "do_layer_norm_before": true, "word_embed_proj_dim": 4096, "activation_function": "relu", "dropout": 0.1, "attention_dropout": 0.0, "enable_bias": true, "layerdrop": 0.0, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "vocab_size": 50272, "_remove_final_layer_norm": false}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 6658473984);
    assert_eq!((c.tied, c.pad_token, c.resid_dropout), (true, Some(1), 0.1));
    assert_eq!(c.activation, Activation::Relu);
    assert_eq!(c.unit_params()[1].0, "model.decoder.layers.0");
    let small = dir
        .read(r#"{"model_type": "opt", "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12}"#)
        .unwrap();
    assert_eq!(total(&small), 125239296);
    // OPT-350m's published config: post-norm layers, no final norm,
    // embeddings 512 wide projected in and out of the layers' 1024.
    let post = dir
        .read(r#"{"model_type": "opt", "activation_function": "relu", "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": false, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 4096, "hidden_size": 1024, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048, "num_attention_heads": 16, "num_hidden_layers": 24, "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "use_cache": true, "vocab_size": 50272, "word_embed_proj_dim": 512}"#)
        .unwrap();
    assert_eq!(total(&post), 331196416);
    assert_eq!((post.embedding_width(), post.final_norm()), (512, false));
    assert_eq!(
        post.unit_params()[0],
        ("model.decoder.embed_tokens".into(), 50272 * 512)
    );
    // OPT-6.7B without its final norm: the flag only OPT's class reads.
    let unnormed = dir
        .read(&given.replace(
            r#""_remove_final_layer_norm": false"#,
            r#""_remove_final_layer_norm": true"#,
        ))
        .unwrap();
    assert_eq!(total(&unnormed), 6658473984 - 2 * 4096);
    dir.round_trips([c, small, post, unnormed]);
    for (change, says) in [
        (
            r#""layerdrop": 0.1"#,
            "layerdrop 0.1: zrt runs every layer every step",
        ),
        (
            r#""layer_norm_elementwise_affine": false"#,
            "layer_norm_elementwise_affine false",
        ),
    ] {
        let given = given.replace('}', r#", "layer_norm_elementwise_affine": true}"#);
        dir.refuses_changed(&given, change, says);
    }
}

#[test]
fn gpt_neo_configs_are_read_and_counted() {
    let dir = ConfigDir::new("gpt-neo-configs");
    // GPT-Neo 1.3B's shape (its class's defaults: 24 layers 2048 wide,
    // global and local by turns in windows of 256, 2048 learned
    // positions, the head tied); the count is transformers' parameters.
    let given = r#"{"model_type": "gpt_neo", "architectures": ["GPTNeoForCausalLM"], "hidden_size": 2048, "num_layers": 24, "num_heads": 16, "max_position_embeddings": 2048, "attention_types": [[["global", "local"], 12]], "window_size": 256, "activation_function": "gelu_new", "vocab_size": 50257}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 1315575808);
    assert_eq!(
        (c.window(0), c.window(1), c.window(23)),
        (None, Some(256), Some(256))
    );
    assert_eq!(
        (c.attention_multiplier, c.qkv_bias, c.o_bias),
        (Some(1.0), false, true)
    );
    let uneven = given.replace(
        r#"[[["global", "local"], 12]]"#,
        r#"[[["local"], 1], [["global", "local"], 11], [["global"], 1]]"#,
    );
    let uneven = dir.read(&uneven).unwrap();
    assert_eq!(
        (uneven.window(0), uneven.window(1), uneven.window(23)),
        (Some(256), None, None)
    );
    dir.round_trips([c, uneven]);
    dir.refuses(
        &given.replace(r#""num_layers": 24"#, r#""num_layers": 12"#),
        "gives 24 layers' kinds, not num_layers' 12",
    );
    dir.refuses(
        &given.replace(
            r#"[[["global", "local"], 12]]"#,
            r#"[[["global", "sparse"], 12]]"#,
        ),
        "attention_types [[[\"global\",\"sparse\"],12]]: a list of [kinds, times] pairs",
    );
    dir.refuses(
        &given.replace(r#""num_heads": 16"#, r#""num_heads": 0"#),
        "`num_heads` is missing or not a positive integer",
    );
}

#[test]
fn mpt_configs_are_read_and_counted() {
    let dir = ConfigDir::new("mpt-configs");
    // MPT-7B's published config (32 layers 4096 wide, ALiBi, the head
    // tied); the count is transformers' parameters.
    let given = r#"{"model_type": "mpt", "architectures": ["MPTForCausalLM"], "attn_config": {"alibi": true, "alibi_bias_max": 8, "attn_impl": "torch", "attn_pdrop": 0, "attn_type": "multihead_attention", "attn_uses_sequence_id": false, "clip_qkv": null, "prefix_lm": false, "qk_ln": false, "softmax_scale": null}, "d_model": 4096, "emb_pdrop": 0, "embedding_fraction": 1.0, "expansion_ratio": 4, "init_device": "cpu", "learned_pos_emb": true, "logit_scale": null, "max_seq_len": 2048, "n_heads": 32, "n_layers": 32, "no_bias": true, "norm_type": "low_precision_layernorm", "resid_pdrop": 0, "tokenizer_name": "EleutherAI/gpt-neox-20b", "use_cache": false, "verbose": 0, "vocab_size": 50432}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 6649286656);
    assert_eq!((c.intermediate, c.tied, c.clip_qkv), (16384, true, None));
    assert!(!c.qkv_bias && !c.o_bias && !c.mlp_bias);
    let scaled = dir
        .read(&given.replace(r#""softmax_scale": null"#, r#""softmax_scale": 0.5"#))
        .unwrap();
    assert_eq!(scaled.attention_multiplier, Some(0.5));
    dir.round_trips([c, scaled]);
    dir.refuses_replaced(
        given,
        &[
        (
            r#""expansion_ratio": 4"#,
            r#""expansion_ratio": 8"#,
            "expansion_ratio 8: transformers' MptForCausalLM computes its model as if it were 4",
        ),
        (
            r#""qk_ln": false"#,
            r#""qk_ln": true"#,
            "attn_config.qk_ln true",
        ),
        (
            r#""alibi": true"#,
            r#""alibi": false"#,
            "attn_config.alibi false",
        ),
        (
            r#""alibi_bias_max": 8"#,
            r#""alibi_bias_max": 16"#,
            "attn_config.alibi_bias_max 16",
        ),
        (
            r#""logit_scale": null"#,
            r#""logit_scale": 0.5"#,
            "logit_scale 0.5",
        ),
        (
            r#""n_heads": 32"#,
            r#""n_heads": 0"#,
            "`n_heads` is missing or not a positive integer",
        ),
        ],
    );
}

#[test]
fn bloom_configs_are_read_and_counted() {
    let dir = ConfigDir::new("bloom-configs");
    // BLOOM-560m's published config (24 layers 1024 wide, 16 heads,
    // ALiBi, the head tied); the count is transformers' parameters, its
    // embeddings' LayerNorm among them.
    let given = r#"{"model_type": "bloom", "architectures": ["BloomForCausalLM"], "apply_residual_connection_post_layernorm": false, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_dropout": 0.0, "hidden_size": 1024, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "n_head": 16, "n_inner": null, "n_layer": 24, "offset_alibi": 100, "pad_token_id": 3, "pretraining_tp": 1, "skip_bias_add": true, "skip_bias_add_qkv": false, "slow_but_exact": false, "unk_token_id": 0, "use_cache": true, "vocab_size": 250880}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 559214592);
    assert_eq!((c.intermediate, c.tied, c.pad_token), (4096, true, Some(3)));
    assert!(c.qkv_bias && c.o_bias && c.mlp_bias);
    let named = dir
        .read(&given.replace(
            r#""hidden_size": 1024"#,
            r#""hidden_size": 64, "n_embed": 256"#,
        ))
        .unwrap();
    assert_eq!((named.hidden, named.intermediate), (256, 1024));
    dir.round_trips([c, named]);
    dir.refuses(
        &given.replace(
            r#""apply_residual_connection_post_layernorm": false"#,
            r#""apply_residual_connection_post_layernorm": true"#,
        ),
        "apply_residual_connection_post_layernorm true",
    );
    dir.refuses(
        &given
            .replace(r#""pretraining_tp": 1"#, r#""pretraining_tp": 4"#)
            .replace(r#""slow_but_exact": false"#, r#""slow_but_exact": true"#),
        "slow_but_exact true with pretraining_tp above 1",
    );
    dir.refuses(
        &given.replace(r#""n_head": 16"#, r#""n_head": 7"#),
        "n_head 7 does not divide hidden_size 1024",
    );
}

#[test]
fn persimmon_configs_are_read_and_counted() {
    let dir = ConfigDir::new("persimmon-configs");
    // Persimmon-8B's shape (its class's defaults: 36 layers 4096 wide, 64
    // heads, half of each turned, queries and keys LayerNormed, a
    // squared ReLU, the head untied); the count is transformers'
    // parameters.
    let given = r#"{"model_type": "persimmon", "architectures": ["PersimmonForCausalLM"], "hidden_act": "relu2", "hidden_size": 4096, "intermediate_size": 16384, "layer_norm_eps": 1e-05, "max_position_embeddings": 16384, "num_attention_heads": 64, "num_hidden_layers": 36, "partial_rotary_factor": 0.5, "qk_layernorm": true, "rope_theta": 25000.0, "tie_word_embeddings": false, "vocab_size": 262144}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 9397175296);
    assert_eq!(
        (c.kv_heads, c.rotary_dim(), c.activation),
        (64, 32, Activation::Relu2)
    );
    assert!(c.qk_norm && c.qkv_bias && c.o_bias && c.mlp_bias && !c.tied);
    // Its class has no key-value heads' count: every head has its own,
    // whatever a file says.
    let grouped = dir
        .read(&given.replace(
            r#""num_attention_heads": 64"#,
            r#""num_attention_heads": 64, "num_key_value_heads": 8"#,
        ))
        .unwrap();
    assert_eq!(grouped, c);
    let unnormed = dir
        .read(&given.replace(r#""qk_layernorm": true"#, r#""qk_layernorm": false"#))
        .unwrap();
    assert_eq!(total(&unnormed), 9397175296 - 36 * 4 * 64);
    dir.round_trips([c, unnormed]);
}

#[test]
fn biogpt_configs_are_read_and_counted() {
    let dir = ConfigDir::new("biogpt-configs");
    // BioGPT's published shape (its class's defaults: 24 layers 1024
    // wide, 1024 learned positions two rows in, its embeddings scaled,
    // the head `output_projection`, tied); the count is transformers'
    // parameters.
    let given = r#"{"model_type": "biogpt", "architectures": ["BioGptForCausalLM"], "activation_dropout": 0.0, "attention_probs_dropout_prob": 0.1, "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096, "layer_norm_eps": 1e-12, "layerdrop": 0.0, "max_position_embeddings": 1024, "num_attention_heads": 16, "num_hidden_layers": 24, "pad_token_id": 1, "scale_embedding": true, "use_cache": true, "vocab_size": 42384}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 346763264);
    assert_eq!((c.embedding_multiplier, c.eps, c.tied), (32.0, 1e-5, true));
    assert_eq!(
        (c.resid_dropout, c.embedding_dropout, c.attention_dropout),
        (0.1, 0.1, 0.1)
    );
    let untied = dir
        .read(&given.replace(r#""use_cache": true"#, r#""tie_word_embeddings": false"#))
        .unwrap();
    assert_eq!(
        untied.unit_params()[25],
        ("output_projection".into(), 42384 * 1024)
    );
    let unscaled = dir
        .read(&given.replace(r#""scale_embedding": true"#, r#""scale_embedding": false"#))
        .unwrap();
    assert_eq!(unscaled.embedding_multiplier, 1.0);
    dir.round_trips([c, untied, unscaled]);
    for (change, says) in [
        (
            r#""layerdrop": 0.1"#,
            "layerdrop 0.1: zrt runs every layer every step",
        ),
        (
            r#""activation_dropout": 0.1"#,
            "activation_dropout 0.1: zrt drops out the MLP's output",
        ),
    ] {
        dir.refuses_changed(given, change, says);
    }
}

#[test]
fn xglm_configs_are_read_and_counted() {
    let dir = ConfigDir::new("xglm-configs");
    // XGLM-564M's shape (its class's defaults: 24 layers 1024 wide, 16
    // heads, sinusoidal positions, the embeddings scaled, the head
    // tied); the count is transformers' parameters, no positions among
    // them.
    let given = r#"{"model_type": "xglm", "architectures": ["XGLMForCausalLM"], "activation_dropout": 0.0, "activation_function": "gelu", "attention_dropout": 0.1, "attention_heads": 16, "d_model": 1024, "dropout": 0.1, "ffn_dim": 4096, "layerdrop": 0.0, "max_position_embeddings": 2048, "num_layers": 24, "pad_token_id": 1, "scale_embedding": true, "vocab_size": 256008}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 564463616);
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.intermediate),
        (1024, 24, 16, 4096)
    );
    assert_eq!(
        (c.embedding_multiplier, c.tied, c.pad_token),
        (32.0, true, Some(1))
    );
    assert_eq!(
        (c.resid_dropout, c.embedding_dropout, c.attention_dropout),
        (0.1, 0.1, 0.1)
    );
    // The attribute map's names are read too.
    let flat = dir
        .read(&given.replace(
            r#""d_model": 1024"#,
            r#""d_model": 1024, "hidden_size": 512"#,
        ))
        .unwrap();
    assert_eq!(flat.hidden, 512);
    dir.round_trips([c, flat]);
    for (change, says) in [
        (
            r#""layerdrop": 0.1"#,
            "layerdrop 0.1: zrt runs every layer every step",
        ),
        (r#""activation_dropout": 0.1"#, "activation_dropout 0.1"),
        (
            r#""attention_heads": 7"#,
            "attention_heads 7 does not divide d_model 1024",
        ),
    ] {
        dir.refuses_changed(given, change, says);
    }
}

#[test]
fn vaultgemma_configs_are_read_and_counted() {
    let dir = ConfigDir::new("vaultgemma-configs");
    // The class's defaults (Gemma 2's: 26 layers 2304 wide, the head
    // tied); the count is transformers' parameters, Gemma 2's less each
    // layer's two output norms.
    let c = dir
        .read(r#"{"model_type": "vaultgemma", "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8}"#)
        .unwrap();
    assert_eq!(total(&c), 2614222080);
    assert_eq!(
        (
            c.attn_softcap,
            c.final_softcap,
            c.query_scalar,
            c.sliding_window
        ),
        (Some(50.0), Some(30.0), Some(256.0), Some(4096))
    );
    assert!(c.window(0).is_some() && c.window(1).is_none());
    dir.round_trips([c]);
}

#[test]
fn olmo1_configs_are_read_and_counted() {
    let dir = ConfigDir::new("olmo1-configs");
    // OLMo-7B's sizes (the class's); the count is transformers'
    // parameters (its norms have none).
    let given = r#"{"model_type": "olmo", "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "clip_qkv": 8.0}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 6888095744);
    assert_eq!(
        (c.clip_qkv, c.mlp_bias, c.pad_token),
        (Some(8.0), false, Some(1))
    );
    // No epsilon written: its norms' is theirs.
    assert!(!c.to_hf_json().contains("rms_norm_eps"));
    dir.round_trips([c]);
}

#[test]
fn flex_olmo_configs_are_read_and_counted() {
    let dir = ConfigDir::new("flex-olmo-configs");
    // The class's defaults (FlexOlmo-7x7B's sizes, its docs say); the
    // count is transformers' parameters.
    let c = dir
        .read(r#"{"model_type": "flex_olmo", "vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32}"#)
        .unwrap();
    assert_eq!(total(&c), 33270665216);
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (moe.experts, moe.top_k, moe.normalize, moe.shared),
        (7, 5, false, None)
    );
    assert!(c.qk_norm && c.clip_qkv.is_none());
    dir.round_trips([c]);
}

#[test]
fn llama4_configs_are_read_and_counted() {
    let dir = ConfigDir::new("llama4-configs");
    // The class's defaults, Llama 4 Scout's language model (16 experts
    // on every layer, 48 layers 5120 wide): the count is transformers'
    // parameters (the 109B Scout holds, less its vision encoder).
    let scout = r#"{"model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40}"#;
    let c = dir.read(scout).unwrap();
    assert_eq!(total(&c), 107769861120);
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (
            moe.experts,
            moe.top_k,
            moe.intermediate,
            moe.shared,
            moe.normalize
        ),
        (16, 1, 8192, Some(8192), false)
    );
    assert_eq!((c.intermediate, c.head_dim, c.kv_heads), (16384, 128, 8));
    let a = c.llama4.clone().unwrap();
    // Every fourth layer without positions, attending the whole row;
    // the others in chunks of 8192.
    let turns = c.rope_layers.clone().unwrap();
    assert_eq!((turns[2], turns[3]), (true, false));
    assert_eq!(a.chunked, turns);
    assert_eq!(
        (a.chunk, a.qk_l2_norm, a.temperature),
        (Some(8192), true, Some((8192.0, 0.1)))
    );
    // Maverick's interleaving: experts on every other layer.
    let maverick = dir
        .read(&scout.replace(
            r#""num_attention_heads": 40"#,
            r#""num_attention_heads": 40, "interleave_moe_layer_step": 2"#,
        ))
        .unwrap();
    assert!(!maverick.moe_layer(0) && maverick.moe_layer(1));
    // `"no_rope_layers": []`, which the class takes for its default
    // (until 2026-12-07 refused); a list longer than the layers, its
    // first.
    let empty = dir
        .read(&scout.replace(
            r#""num_attention_heads": 40"#,
            r#""num_attention_heads": 40, "no_rope_layers": []"#,
        ))
        .unwrap();
    assert_eq!(empty.rope_layers, c.rope_layers);
    assert_eq!(empty.llama4.clone().unwrap().chunked, turns);
    let longer = format!("[{}]", ["1, 1, 0"; 17].join(", "));
    let longer = dir
        .read(&scout.replace(
            r#""num_attention_heads": 40"#,
            &format!(r#""num_attention_heads": 40, "no_rope_layers": {longer}"#),
        ))
        .unwrap();
    let turns = longer.rope_layers.clone().unwrap();
    assert_eq!(
        (turns.len(), turns[1], turns[2], turns[47]),
        (48, true, false, false)
    );
    // The published configs' `"attn_temperature_tuning": 4`, which the
    // class only tests (until 2026-12-07 refused as no flag); 0 is off.
    let tuned = |v: &str| {
        dir.read(&scout.replace(
            r#""num_attention_heads": 40"#,
            &format!(r#""num_attention_heads": 40, "attn_temperature_tuning": {v}"#),
        ))
        .map(|c| c.llama4.and_then(|a| a.temperature))
    };
    assert_eq!(tuned("4").unwrap(), Some((8192.0, 0.1)));
    assert_eq!(tuned("0").unwrap(), None);
    let said = tuned(r#""yes""#).unwrap_err().to_string();
    assert!(
        said.contains(r#"`attn_temperature_tuning` is "yes""#),
        "{said}"
    );
    dir.round_trips([c, maverick, empty, longer]);
    dir.refuses(
        &scout.replace(
            r#""num_attention_heads": 40"#,
            r#""num_attention_heads": 40, "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
        ),
        "Llama 4's class scales by Llama 3's",
    );
}

#[test]
fn apertus_configs_are_read_and_counted() {
    let dir = ConfigDir::new("apertus-configs");
    // The class's defaults (Apertus-8B-like, its docs say): Llama 3's
    // scaling when left out, xIELU. The count is transformers' state
    // dict's (its parameters and each layer's xIELU `beta` and `eps`
    // buffers, which zrt holds as frozen parameters).
    let given = r#"{"model_type": "apertus", "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 64}"#;
    let c = dir.read(given).unwrap();
    assert_eq!(total(&c), 6979596416);
    assert_eq!(c.activation, Activation::Xielu);
    // Its class deletes head_dim and mlp_bias: the width's share, none.
    assert_eq!((c.head_dim, c.mlp_bias, c.qk_norm), (128, false, true));
    assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    let unscaled = dir
        .read(&given.replace(r#", "head_dim": 64"#, r#", "rope_scaling": null"#))
        .unwrap();
    assert_eq!(unscaled.rope_scaling, RopeScaling::None);
    dir.round_trips([c, unscaled]);
    // xIELU is Apertus's alone: another family's MLP holds no parameters
    // for it.
    dir.refuses(
        r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_act": "xielu"}"#,
        "hidden_act \"xielu\"",
    );
}

#[test]
fn nemotron_configs_are_read_and_counted() {
    let dir = ConfigDir::new("nemotron-configs");
    // A Minitron-4B-shaped config (3072 wide, 24 heads of 128, 8 of keys
    // and values, 32 layers); the counts are transformers' parameters.
    let minitron = r#"{"model_type": "nemotron", "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 9216, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "norm_eps": 1e-05, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}"#;
    let c = dir.read(minitron).unwrap();
    assert_eq!(total(&c), 4190509056);
    // Half of each head turned, unscaled whatever the config says (its
    // class reads no rope_scaling); the squared ReLU.
    assert_eq!(
        (c.rotary_dim(), c.rope_scaling.clone(), c.activation),
        (64, RopeScaling::None, Activation::Relu2)
    );
    // The class's other sizes (Nemotron-4 15B's, its heads all keys and
    // values too).
    let big = dir
        .read(r#"{"model_type": "nemotron", "vocab_size": 256000, "hidden_size": 6144, "intermediate_size": 24576, "num_hidden_layers": 32, "num_attention_heads": 48, "num_key_value_heads": 48}"#)
        .unwrap();
    assert_eq!(total(&big), 17642041344);
    dir.round_trips([c, big]);
}

#[test]
fn helium_configs_are_read_and_counted() {
    let dir = ConfigDir::new("helium-configs");
    // The class's defaults, Helium-1-preview-2B's sizes (its docstring);
    // the count is transformers' parameters.
    let c = dir.read(r#"{"model_type": "helium", "vocab_size": 48000, "hidden_size": 2560, "intermediate_size": 7040, "num_hidden_layers": 24, "num_attention_heads": 20}"#).unwrap();
    assert_eq!(total(&c), 2172643840);
    assert_eq!(
        (c.kv_heads, c.head_dim, c.eps, c.pad_token),
        (20, 128, 1e-8, Some(3))
    );
    // Biased queries, keys and values; the output projection never.
    let biased = dir
        .read(r#"{"model_type": "helium", "vocab_size": 48000, "hidden_size": 2560, "intermediate_size": 7040, "num_hidden_layers": 24, "num_attention_heads": 20, "attention_bias": true}"#)
        .unwrap();
    assert_eq!((biased.qkv_bias, biased.o_bias), (true, false));
    assert_eq!(total(&biased), total(&c) + 24 * 3 * 2560);
    dir.round_trips([c, biased]);
    dir.refuses(
        r#"{"model_type": "helium", "vocab_size": 48000, "hidden_size": 2560, "intermediate_size": 7040, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16}"#,
        "num_attention_heads 16 x head_dim 128 is not hidden_size 2560",
    );
}

#[test]
fn bitnet_configs_are_read_counted_and_their_quantization_checked() {
    let dir = ConfigDir::new("bitnet-configs");
    // BitNet b1.58 2B4T's sizes (its 5 key-value heads the class's
    // default); the count is transformers' parameters (its sub norms'
    // too).
    let sizes = r#""model_type": "bitnet", "vocab_size": 128256, "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 30, "num_attention_heads": 20, "max_position_embeddings": 4096, "rope_theta": 500000.0, "tie_word_embeddings": true, "rms_norm_eps": 1e-05"#;
    let total = |c: &LlamaConfig| c.unit_params().iter().map(|u| u.1).sum::<u64>();
    let plain = dir.read(&format!("{{{sizes}}}")).unwrap();
    assert_eq!(total(&plain), 2412820480);
    assert_eq!(plain.activation, Activation::Relu2);
    assert!(!plain.ternary);
    assert_eq!(plain.kv_heads, 5);
    let online = r#""quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}"#;
    let qat = dir.read(&format!("{{{sizes}, {online}}}")).unwrap();
    assert!(qat.ternary);
    assert_eq!((total(&qat), qat.ternary_norm), (total(&plain), None));
    // An RMS norm before each linear layer's rounding (use_rms_norm):
    // 2413488640 parameters, as transformers counts them with its
    // AutoBitLinears built so.
    let normed = r#""quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online", "use_rms_norm": true, "rms_norm_eps": 1e-05}"#;
    let normed = dir.read(&format!("{{{sizes}, {normed}}}")).unwrap();
    assert_eq!(
        (total(&normed), normed.ternary_norm),
        (2413488640, Some(1e-5))
    );
    dir.round_trips([plain, qat, normed]);
    // What transformers does not train, or zrt does not build, is
    // refused naming the key.
    let given = format!("{{{sizes}, {online}}}");
    dir.refuses_replaced(
        &given,
        &[
            (
                r#""linear_class": "autobitlinear""#,
                r#""linear_class": "bitlinear""#,
                r#"linear_class "bitlinear": its weights are packed ternary values"#,
            ),
            (
                r#""quantization_mode": "online""#,
                r#""quantization_mode": "offline""#,
                r#"quantization_mode "offline": transformers freezes an offline AutoBitLinear"#,
            ),
            (
                r#""quant_method": "bitnet","#,
                r#""quant_method": "bitnet", "use_rms_norm": 1,"#,
                "use_rms_norm 1: true or false",
            ),
            (
                r#""quant_method": "bitnet","#,
                r#""quant_method": "bitnet", "use_rms_norm": true, "rms_norm_eps": 0,"#,
                "rms_norm_eps 0: a number above 0",
            ),
            (
                r#""quant_method": "bitnet","#,
                r#""quant_method": "bitnet", "modules_to_not_convert": ["lm_head", "o_proj"],"#,
                r#"modules_to_not_convert names "o_proj""#,
            ),
            (
                r#""num_attention_heads": 20"#,
                r#""num_attention_heads": 20, "head_dim": 64"#,
                "num_attention_heads 20 x head_dim 64 is not hidden_size 2560: BitNet normalises",
            ),
        ],
    );
    // The published packed checkpoint's quantization_config (the class's
    // defaults: bitlinear, offline).
    dir.refuses(
        &format!(r#"{{{sizes}, "quantization_config": {{"quant_method": "bitnet"}}}}"#),
        r#"quantization_config's linear_class "bitlinear""#,
    );
    // The head alone kept whole is what transformers keeps anyway.
    let head = r#""quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online", "modules_to_not_convert": ["lm_head"]}"#;
    assert!(dir.read(&format!("{{{sizes}, {head}}}")).unwrap().ternary);
}

#[test]
fn jetmoe_configs_are_read_and_counted() {
    let dir = ConfigDir::new("jetmoe-configs");
    let total = |c: &LlamaConfig| c.unit_params().iter().map(|u| u.1).sum::<u64>();
    // The class's defaults (12 layers; the sizes zrt requires given as
    // the class's) and JetMoE-8B's 24; the counts are transformers'
    // parameters.
    let sizes = r#"{"model_type": "jetmoe", "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 12, "intermediate_size": 5632}"#;
    let defaults = dir.read(sizes).unwrap();
    assert_eq!(total(&defaults), 4293888000);
    assert_eq!(
        (defaults.heads, defaults.kv_heads, defaults.head_dim),
        (32, 16, 128)
    );
    assert!(defaults.tied);
    let eight = r#"{"model_type": "jetmoe", "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 24, "num_key_value_heads": 16, "kv_channels": 128, "intermediate_size": 5632, "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 32, "activation_function": "silu", "rms_norm_eps": 1e-05}"#;
    let c = dir.read(eight).unwrap();
    assert_eq!(total(&c), 8522237952);
    dir.round_trips([defaults, c]);
    dir.refuses_replaced(
        eight,
        &[(
            r#""num_attention_heads": 32"#,
            r#""num_attention_heads": 16"#,
            "num_attention_heads 16: JetMoE's attention has num_key_value_heads 16 x num_experts_per_tok 2 = 32 heads",
        ), (
            r#""rms_norm_eps": 1e-05"#,
            r#""rms_norm_eps": 1e-05, "output_router_logits": true"#,
            "transformers' JetMoeForCausalLM never adds its routers' load-balancing loss from the config",
        )],
    );
}

#[test]
fn arcee_configs_are_read_and_counted() {
    let dir = ConfigDir::new("arcee-configs");
    // AFM-4.5B's sizes (its activation the class's default, relu2); the
    // count is transformers' parameters.
    let afm = r#"{"model_type": "arcee", "vocab_size": 128004, "hidden_size": 2560, "intermediate_size": 18432, "num_hidden_layers": 36, "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 65536, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}, "tie_word_embeddings": false, "rms_norm_eps": 1e-05}"#;
    let c = dir.read(afm).unwrap();
    assert_eq!(total(&c), 4619184640);
    assert_eq!(c.activation, Activation::Relu2);
    dir.round_trips([c]);
}

#[test]
fn dots1_configs_are_read_and_counted() {
    let dir = ConfigDir::new("dots1-configs");
    // dots.llm1's sizes (its scoring_func "noaux_tc", which the class
    // ignores); the count is transformers' state dict's (the routers'
    // corrections included).
    let llm1 = r#"{"model_type": "dots1", "vocab_size": 152064, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 32, "n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5, "rope_theta": 10000000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "tie_word_embeddings": false, "sliding_window": null, "max_window_layers": 62, "scoring_func": "noaux_tc"}"#;
    let c = dir.read(llm1).unwrap();
    assert_eq!(total(&c), 142774381696);
    assert!(c.qk_norm && c.window(0).is_none() && !c.moe_layer(0) && c.moe_layer(1));
    let g = c.moe.clone().unwrap().grouped.unwrap();
    assert_eq!((g.scale, g.scoring), (2.5, Scoring::Sigmoid));
    dir.round_trips([c]);
    // Windowed layers (from max_window_layers on) are refused.
    dir.refuses(
        &llm1
            .replace(r#""sliding_window": null"#, r#""sliding_window": 4096"#)
            .replace(r#""max_window_layers": 62"#, r#""max_window_layers": 30"#),
        "computes dots1's full-attention layers only",
    );
}

#[test]
fn yarn_is_read_as_transformers_reads_it() {
    let dir = ConfigDir::new("yarn-config");
    // Qwen3's long-context recipe: YaRN over 32768 positions, 4 times.
    let qwen3 = r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}"#;
    let read = |text: &str| dir.read(text);
    let c = read(qwen3).unwrap();
    let want = RopeScaling::Yarn {
        factor: 4.0,
        original_positions: 32768.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 0.1 * 4f64.ln() + 1.0,
    };
    assert_eq!(c.rope_scaling, want);
    // DeepSeek's mscale pair: their ratio; given, the factor itself.
    let m = read(&qwen3.replace(
        r#""factor": 4.0"#,
        r#""factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16"#,
    ))
    .unwrap();
    let RopeScaling::Yarn {
        attention_factor,
        beta_fast,
        ..
    } = m.rope_scaling.clone()
    else {
        panic!("{:?}", m.rope_scaling)
    };
    assert_eq!((attention_factor, beta_fast), (1.0, 16.0));
    let a = read(&qwen3.replace(
        r#""factor": 4.0"#,
        r#""factor": 4.0, "attention_factor": 0.8"#,
    ))
    .unwrap();
    assert!(
        matches!(a.rope_scaling, RopeScaling::Yarn { attention_factor, .. } if attention_factor == 0.8)
    );
    dir.round_trips([c, m, a]);
}

#[test]
fn mixture_of_experts_configs_are_read_and_counted() {
    let dir = ConfigDir::new("moe-config");
    // Mixtral 8x7B's and Qwen3-30B-A3B's shapes; the counts are
    // transformers' for these configs.
    let mixtral = r#"{"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": false, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": null, "output_router_logits": false, "router_aux_loss_coef": 0.02}"#;
    let qwen3_moe = r#"{"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": false, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": false}"#;
    let read = |text: &str| dir.read(text);
    let m = read(mixtral).unwrap();
    let q = read(qwen3_moe).unwrap();
    assert_eq!((total(&m), total(&q)), (46702792704, 30532122624));
    let want = MoeConfig {
        experts: 128,
        top_k: 8,
        intermediate: 768,
        normalize: true,
        sparse_step: 1,
        dense_layers: vec![],
        shared: None,
        grouped: None,
        jitter: 0.0,
        sparse_mixer: None,
        balance: None,
        zero: 0,
    };
    assert_eq!((q.moe.clone(), q.qk_norm), (Some(want), true));
    // Dense layers where Qwen3-MoE says.
    let d = read(&qwen3_moe.replace(r#""mlp_only_layers": []"#, r#""mlp_only_layers": [0, 47]"#))
        .unwrap();
    assert_eq!(
        (d.moe_layer(0), d.moe_layer(1), d.moe_layer(47)),
        (false, true, false)
    );
    // Qwen1.5-MoE-A2.7B's: 60 experts, 4 a token, unnormalised, beside a
    // shared expert; the count is transformers'.
    let qwen2_moe = r#"{"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 8192, "rope_theta": 1000000.0, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4, "use_sliding_window": false, "tie_word_embeddings": false}"#;
    let q2 = read(qwen2_moe).unwrap();
    assert_eq!(total(&q2), 14315784192);
    let want = MoeConfig {
        experts: 60,
        top_k: 4,
        intermediate: 1408,
        normalize: false,
        sparse_step: 1,
        dense_layers: vec![],
        shared: Some(5632),
        grouped: None,
        jitter: 0.0,
        sparse_mixer: None,
        balance: None,
        zero: 0,
    };
    assert_eq!(
        (q2.moe.clone(), q2.qkv_bias, q2.o_bias, q2.qk_norm),
        (Some(want), true, false, false)
    );
    let no_bias = read(&qwen2_moe.replace(
        r#""num_experts": 60"#,
        r#""num_experts": 60, "qkv_bias": false"#,
    ));
    assert!(!no_bias.as_ref().unwrap().qkv_bias);
    let windowed = qwen2_moe.replace(
        r#""use_sliding_window": false"#,
        r#""use_sliding_window": true"#,
    );
    let err = read(&windowed).unwrap_err().to_string();
    assert!(err.contains("use_sliding_window true"), "{err}");
    // OLMoE-1B-7B's: 64 experts as wide as `intermediate_size`, 8 a
    // token, every layer's; the count is transformers'.
    let olmoe = r#"{"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "clip_qkv": null, "max_position_embeddings": 4096}"#;
    let o = read(olmoe).unwrap();
    assert_eq!(total(&o), 6919161856);
    let om = o.moe.clone().unwrap();
    assert_eq!(
        (
            om.experts,
            om.top_k,
            om.intermediate,
            om.normalize,
            o.qk_norm,
            o.clip_qkv
        ),
        (64, 8, 1024, false, true, None)
    );
    let clipped = read(&olmoe.replace(r#""clip_qkv": null"#, r#""clip_qkv": 8.0"#)).unwrap();
    assert_eq!(clipped.clip_qkv, Some(8.0));
    // The routers' load-balancing loss: Mixtral's coefficient as its
    // config says, OLMoE's class default; written back on export.
    let balanced = read(&mixtral.replace(
        r#""output_router_logits": false"#,
        r#""output_router_logits": true"#,
    ))
    .unwrap();
    let o_balanced = read(&olmoe.replace(
        r#""clip_qkv": null"#,
        r#""clip_qkv": null, "output_router_logits": true"#,
    ))
    .unwrap();
    assert_eq!(
        [&balanced, &o_balanced, &m].map(|c| c.moe.as_ref().and_then(|e| e.balance)),
        [Some(0.02), Some(0.01), None]
    );
    // Mixtral's router jitter, in training.
    let jittered = read(&mixtral.replace(
        r#""router_aux_loss_coef": 0.02"#,
        r#""router_aux_loss_coef": 0.02, "router_jitter_noise": 0.1"#,
    ))
    .unwrap();
    assert_eq!(jittered.moe.as_ref().map(|e| e.jitter), Some(0.1));
    dir.round_trips([
        m,
        q,
        d,
        q2,
        no_bias.unwrap(),
        o,
        clipped,
        balanced,
        o_balanced,
        jittered,
    ]);
    // OLMoE's class jitters nothing.
    dir.refuses(
        &olmoe.replace(
            r#""clip_qkv": null"#,
            r#""clip_qkv": null, "router_jitter_noise": 0.01"#,
        ),
        "router_jitter_noise 0.01: zrt's routers take the hidden states as they are, as transformers' olmoe does",
    );
    dir.refuses_replaced(
        mixtral,
        &[
            (
                r#""router_aux_loss_coef": 0.02"#,
                r#""router_jitter_noise": 1.5"#,
                "`router_jitter_noise` is 1.5, not a dropout rate in [0, 1)",
            ),
            (
                r#""num_experts_per_tok": 2"#,
                r#""num_experts_per_tok": 9"#,
                "num_experts_per_tok 9 is more than the 8 experts",
            ),
        ],
    );
}

/// Each unit's parameters as the built model holds them (variables
/// under the unit's name; the root's those under none).
pub(crate) fn held_by_unit(vs: &nn::VarStore, units: &[(String, u64)]) -> Vec<(String, u64)> {
    let vars = vs.variables();
    let under = |v: &str, u: &str| !u.is_empty() && v.starts_with(&format!("{u}."));
    (units.iter())
        .map(|(u, _)| {
            let n = (vars.iter())
                .filter(|(v, _)| match u.is_empty() {
                    true => !units.iter().any(|(w, _)| under(v, w)),
                    false => under(v, u),
                })
                .map(|(_, t)| t.numel() as u64)
                .sum();
            (u.clone(), n)
        })
        .collect()
}

#[test]
fn unit_params_count_what_the_built_model_holds() {
    let base = LlamaConfig {
        family: Family::Llama,
        vocab: 96,
        hidden: 64,
        intermediate: 160,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        positions: 64,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        tied: false,
        attention_dropout: 0.0,
        qk_norm: false,
        parallel: false,
        activation: Activation::Silu,
        pad_token: None,
        query_scalar: None,
        attn_softcap: None,
        final_softcap: None,
        full_every: None,
        local_rope_theta: None,
        partial_rotary: 1.0,
        resid_dropout: 0.0,
        embedding_dropout: 0.0,
        embedding_multiplier: 1.0,
        residual_multiplier: 1.0,
        attention_multiplier: None,
        logits_scaling: 1.0,
        logit_scale: 1.0,
        head_bias: false,
        mamba: None,
        mamba1: None,
        short_conv: None,
        lightning: None,
        residual_factors: None,
        delta_net: None,
        rg_lru: None,
        falcon_h1: None,
        rope_layers: None,
        moe: None,
        clip_qkv: None,
        mla: None,
        llama4: None,
        falcon: None,
        opt: None,
        local_layers: None,
        ternary: false,
        ternary_norm: None,
        z_loss: 0.0,
        keep_window: None,
        rescale_every: None,
        language_model_of: None,
        zamba: None,
        xlstm: None,
    };
    let variants = [
        base.clone(),
        LlamaConfig {
            tied: true,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            head_dim: 8,
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Qwen3,
            qk_norm: true,
            tied: true,
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Gemma2,
            tied: true,
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Gemma3,
            qk_norm: true,
            tied: true,
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Phi3,
            partial_rotary: 0.75,
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Olmo2,
            qk_norm: true,
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Granite,
            tied: true,
            rope_layers: Some(vec![true, false]),
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Qwen3Moe,
            qk_norm: true,
            moe: Some(MoeConfig {
                experts: 4,
                top_k: 2,
                intermediate: 24,
                normalize: true,
                sparse_step: 1,
                dense_layers: vec![1],
                shared: None,
                grouped: None,
                jitter: 0.0,
                sparse_mixer: None,
                balance: None,
                zero: 0,
            }),
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Mixtral,
            moe: Some(MoeConfig {
                experts: 3,
                top_k: 1,
                intermediate: 40,
                normalize: true,
                sparse_step: 1,
                dense_layers: vec![],
                shared: None,
                grouped: None,
                jitter: 0.0,
                sparse_mixer: None,
                balance: None,
                zero: 0,
            }),
            ..base.clone()
        },
        LlamaConfig {
            family: Family::Starcoder2,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            ..base.clone()
        },
    ];
    // DeepSeek-V3: latent attention with and without the queries'
    // bottleneck, biases where `attention_bias` puts them, a dense first
    // layer, grouped routing beside two shared experts.
    let mla = Mla {
        q_rank: Some(24),
        kv_rank: 16,
        nope: 12,
        rope: 8,
        v: 10,
        interleave: true,
        mscale_all_dim: 0.0,
        scales: None,
    };
    let deepseek = LlamaConfig {
        family: Family::DeepseekV3,
        head_dim: 20,
        o_bias: true,
        qkv_bias: true,
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            intermediate: 24,
            normalize: true,
            sparse_step: 1,
            dense_layers: vec![0],
            shared: Some(48),
            grouped: Some(GroupRouting {
                groups: 2,
                top_groups: 1,
                scale: 2.5,
                scoring: Scoring::Sigmoid,
            }),
            jitter: 0.0,
            sparse_mixer: None,
            balance: None,
            zero: 0,
        }),
        mla: Some(mla.clone()),
        ..base.clone()
    };
    let one_q = LlamaConfig {
        o_bias: false,
        qkv_bias: false,
        mla: Some(Mla {
            q_rank: None,
            ..mla
        }),
        ..deepseek.clone()
    };
    // OPT-350m's layout: embeddings 32 wide, projected in and out in
    // the root, no final norm; and norms before, with the final one.
    let opt = |norm_before| LlamaConfig {
        family: Family::Opt,
        kv_heads: 4,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        tied: true,
        opt: Some(OptLayout {
            norm_before,
            final_norm: norm_before,
            embedding_width: 32,
        }),
        ..base.clone()
    };
    // BioGPT's head apart, under its own name.
    let biogpt = LlamaConfig {
        family: Family::BioGpt,
        kv_heads: 4,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        ..base.clone()
    };
    // XGLM's positions computed, no parameters.
    let xglm = LlamaConfig {
        family: Family::Xglm,
        ..biogpt.clone()
    };
    // Persimmon's queries and keys LayerNormed, weights and biases.
    let persimmon = LlamaConfig {
        family: Family::Persimmon,
        kv_heads: 4,
        qk_norm: true,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        partial_rotary: 0.5,
        ..base.clone()
    };
    // StableLM 2 12B's and Command R+'s queries and keys normalised
    // with weights of each head's own (StableLM's a LayerNorm a head),
    // one norm a layer.
    let twelve = LlamaConfig {
        family: Family::StableLm,
        qk_norm: true,
        parallel: true,
        partial_rotary: 0.25,
        ..base.clone()
    };
    let plus = LlamaConfig {
        family: Family::Cohere,
        qk_norm: true,
        parallel: true,
        tied: true,
        ..base.clone()
    };
    // Granite 4.0: a Mamba layer (biased projections, 2 groups) beside
    // an attending one, experts and the shared MLP; and dense, the shared
    // MLP alone.
    let mamba = MambaConfig {
        heads: 4,
        head_dim: 32,
        groups: 2,
        state: 8,
        conv_kernel: 4,
        expand: 2,
        chunk: 8,
        conv_bias: true,
        proj_bias: true,
        d_ssm: None,
        out_bias: None,
        gate: MambaGate::NormedAfter,
        layers: vec![true, false],
    };
    let granite4 = LlamaConfig {
        family: Family::GraniteMoeHybrid,
        mamba: Some(mamba.clone()),
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            intermediate: 24,
            normalize: true,
            sparse_step: 1,
            dense_layers: vec![],
            shared: Some(40),
            grouped: None,
            jitter: 0.0,
            sparse_mixer: None,
            balance: None,
            zero: 0,
        }),
        ..base.clone()
    };
    let granite4_dense = LlamaConfig {
        family: Family::GraniteMoeHybrid,
        mamba: Some(MambaConfig {
            conv_bias: false,
            proj_bias: false,
            ..mamba
        }),
        ..base.clone()
    };
    // Qwen3-Next: a DeltaNet layer (two key heads serving four value
    // heads) beside a gated attending one, experts beside the gated
    // shared expert.
    let qwen3_next = LlamaConfig {
        family: Family::Qwen3Next,
        qk_norm: true,
        partial_rotary: 0.25,
        delta_net: Some(DeltaNetConfig {
            kernel: 4,
            key_heads: 2,
            value_heads: 4,
            key_dim: 8,
            value_dim: 12,
            layers: vec![true, false],
        }),
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            intermediate: 24,
            normalize: true,
            sparse_step: 1,
            dense_layers: vec![],
            shared: Some(40),
            grouped: None,
            jitter: 0.0,
            sparse_mixer: None,
            balance: None,
            zero: 0,
        }),
        ..base.clone()
    };
    // MiniMax: its decay buffers are held beside the parameters it counts.
    let minimax = LlamaConfig {
        family: Family::MiniMax,
        lightning: Some(LightningConfig {
            block: 8,
            layers: vec![false, true],
        }),
        ..base.clone()
    };
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _model = Llama::new(&vs.root(), &ShardPlan::new(), &minimax);
    let counted: u64 = minimax.unit_params().iter().map(|(_, n)| n).sum();
    let held: u64 = vs.variables().values().map(|t| t.numel() as u64).sum();
    assert_eq!(minimax.frozen_buffers(), 4 * (1 + 2 * 8 + 8 * 8));
    assert_eq!(held, counted + minimax.frozen_buffers());
    // DiffLlama's four lambda vectors a layer.
    let diffllama = LlamaConfig {
        family: Family::DiffLlama,
        ..base.clone()
    };
    for cfg in variants.into_iter().chain([
        diffllama,
        qwen3_next,
        granite4,
        granite4_dense,
        deepseek,
        one_q,
        opt(false),
        opt(true),
        persimmon,
        biogpt,
        xglm,
        twelve,
        plus,
    ]) {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _model = Llama::new(&vs.root(), &ShardPlan::new(), &cfg);
        let units = cfg.unit_params();
        assert_eq!(held_by_unit(&vs, &units), units, "{cfg:?}");
    }
}

#[test]
fn the_routers_balance_reaches_them_only_through_the_loss_that_holds_it() {
    let dir = ConfigDir::new("balance");
    let json = r#"{"model_type": "mixtral", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 16, "output_router_logits": true, "router_aux_loss_coef": 0.5}"#;
    let balanced = dir.read(json).unwrap();
    let plain = dir
        .read(&json.replace(
            r#""output_router_logits": true"#,
            r#""output_router_logits": false"#,
        ))
        .unwrap();
    let ids: Vec<i64> = (0..16).map(|i| (i * 7 + 3) % 32).collect();
    let tokens = Tensor::from_slice(&ids).view([2, 8]);
    // The first router's gradient, back-propagating the language model's
    // loss (`Lm`), that loss after the balance was added to a copy of it
    // (`Beside`), or the sum (`Sum`).
    enum Seed {
        Lm,
        Beside,
        Sum,
    }
    // Every model gets the weights of this one: the tests of this binary
    // draw from libtorch's one generator at once, so a seed before each
    // build would not make them alike.
    let weights = nn::VarStore::new(tch::Device::Cpu);
    let _ = Llama::new(&weights.root(), &ShardPlan::new(), &plain);
    let router_grad = |cfg: &LlamaConfig, seed: Seed| -> Result<Tensor, String> {
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let model = Llama::new(&vs.root(), &ShardPlan::new(), cfg);
        vs.copy(&weights).map_err(|e| e.to_string())?;
        let lm = crate::hf::causal_lm_loss(&model.forward(&tokens), &tokens);
        let loss = match seed {
            Seed::Lm => lm,
            Seed::Beside => {
                let _sum = model.plus_aux_losses(lm.shallow_clone());
                lm
            }
            Seed::Sum => model.plus_aux_losses(lm),
        };
        loss.f_backward().map_err(|e| e.to_string())?;
        Ok(vs.variables()["model.layers.0.block_sparse_moe.gate.weight"].grad())
    };
    let unbalanced = router_grad(&plain, Seed::Lm).unwrap();
    // A loss that left the balance out gives the routers none of it.
    let left_out = router_grad(&balanced, Seed::Lm).unwrap();
    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    assert_eq!(diff(&left_out, &unbalanced), 0.0);
    let with = router_grad(&balanced, Seed::Sum).unwrap();
    assert!(diff(&with, &unbalanced) > 1e-3, "{with} {unbalanced}");
    // Back-propagating another loss than the one that took it is an
    // error, not a silently missing gradient.
    let err = router_grad(&balanced, Seed::Beside).unwrap_err();
    assert!(err.contains("reached before the loss holding it"), "{err}");
}

#[test]
fn xlstm_configs_are_read_and_counted() {
    let dir = ConfigDir::new("xlstm-configs");
    // The class's defaults (xLSTM 7B's sizes): transformers' count.
    let c = dir.read(r#"{"model_type": "xlstm"}"#).unwrap();
    assert_eq!(total(&c), 6865424896);
    let x = c.xlstm.as_ref().unwrap();
    assert_eq!((x.qk_dim(c.hidden), x.v_dim(c.hidden)), (2048, 4096));
    assert_eq!(
        (
            c.heads,
            c.head_dim,
            c.intermediate,
            c.final_softcap,
            x.gate_cap
        ),
        (8, 512, 10944, Some(30.0), Some(15.0))
    );
    assert!(!c.tied && !x.bias && c.padding_row().is_none());
    // Biased, its widths its own factors'.
    let small = r#"{"model_type": "xlstm", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 3, "num_heads": 4, "use_bias": true, "qk_dim_factor": 0.25, "v_dim_factor": 0.75, "ffn_proj_factor": 1.3, "ffn_round_up_to_multiple_of": 64, "gate_soft_cap": null, "output_logit_soft_cap": null}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 1953432);
    assert_eq!((s.intermediate, s.final_softcap), (384, None));
    assert_eq!(s.xlstm.as_ref().map(|x| x.gate_cap), Some(None));
    // Its sizes under `embedding_dim` and `num_blocks`.
    let aliased = r#"{"model_type": "xlstm", "vocab_size": 1000, "embedding_dim": 192, "hidden_size": null, "num_blocks": 2, "num_hidden_layers": null, "num_heads": 3}"#;
    let aliased = dir.read(aliased).unwrap();
    assert_eq!(total(&aliased), 1272396);
    dir.round_trips([c, s, aliased]);
    dir.refuses_replaced(
        small,
        &[
            (
                r#""use_bias": true"#,
                r#""use_bias": true, "weight_mode": "fused""#,
                "weight_mode \"fused\": transformers 4.57's class fails building a fused xLSTM",
            ),
            (
                r#""use_bias": true"#,
                r#""use_bias": true, "weight_mode": "split""#,
                r#"weight_mode "split": xLSTM's are "single" and "fused""#,
            ),
            (
                r#""use_bias": true"#,
                r#""use_bias": true, "norm_reduction_force_float32": false"#,
                "norm_reduction_force_float32 false: zrt's norms reduce in fp32 always",
            ),
            (
                r#""num_heads": 4"#,
                r#""num_heads": 5"#,
                "num_heads 5 with queries and keys 64 wide and values 192",
            ),
            (
                r#""qk_dim_factor": 0.25"#,
                r#""qk_dim_factor": 0"#,
                "qk_dim_factor 0: a width factor above 0",
            ),
        ],
    );
}

#[test]
fn zamba_configs_are_read_and_counted() {
    let dir = ConfigDir::new("zamba-configs");
    // The class's defaults (Zamba 7B's sizes, 76 layers, 13 of them
    // hybrid by its period and offset, two Mamba heads); the counts are
    // transformers' parameters, the shared block once.
    let c = dir.read(r#"{"model_type": "zamba"}"#).unwrap();
    assert_eq!(total(&c), 7232490496);
    let z = c.zamba.as_ref().unwrap();
    assert_eq!(
        z.hybrid_layers(),
        [2, 7, 13, 19, 25, 31, 37, 43, 49, 55, 61, 67, 73]
    );
    assert_eq!(
        (c.head_dim, c.intermediate, c.heads, c.kv_heads),
        (464, 14848, 16, 16)
    );
    let m = c.mamba1.as_ref().unwrap();
    assert_eq!(
        (m.heads, m.activation, m.dt_rank),
        (Some(2), Some(Activation::Silu), 232)
    );
    assert!(c.tied && z.blocks == 1 && !z.rope && !z.attention_adapters);
    assert_eq!(c.activation, Activation::Gelu);
    // Small: hybrid by a period of its own, four Mamba heads, grouped
    // keys and values, biased projections, the head untied.
    let small = r#"{"model_type": "zamba", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "n_mamba_heads": 4, "mamba_d_state": 16, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_proj_bias": true, "tie_word_embeddings": false}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 360960);
    assert_eq!(s.zamba.as_ref().unwrap().hybrid_layers(), [2, 4]);
    // Its layers listed, the block's heads 20 wide, no convolution bias.
    let listed = r#"{"model_type": "zamba", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "layers_block_type": ["mamba", "hybrid", "hybrid"], "attention_head_dim": 20, "mamba_conv_bias": false}"#;
    let listed = dir.read(listed).unwrap();
    assert_eq!(total(&listed), 224448);
    assert_eq!(listed.head_dim, 20);
    dir.round_trips([c, s, listed]);
    dir.refuses_replaced(
        small,
        &[
            (
                r#""n_mamba_heads": 4"#,
                r#""n_mamba_heads": 3"#,
                "n_mamba_heads 3 does not divide the Mamba layers' 128 channels",
            ),
            (
                r#""num_hidden_layers": 5"#,
                r#""num_hidden_layers": 2"#,
                "num_hidden_layers 2 without layers_block_type: its class's list starts with three layers",
            ),
            (
                r#""attn_layer_period": 2"#,
                r#""attn_layer_period": 0"#,
                "`attn_layer_period` is missing or not a positive integer",
            ),
            (
                r#""mamba_proj_bias": true"#,
                r#""mamba_proj_bias": true, "attention_hidden_size": 96"#,
                "attention_hidden_size 96: Zamba's shared block reads the hidden states beside the embeddings, twice hidden_size (128)",
            ),
            (
                r#""mamba_proj_bias": true"#,
                r#""mamba_proj_bias": true, "hidden_mamba_act": "tanh""#,
                "hidden_mamba_act",
            ),
            (
                r#""mamba_proj_bias": true"#,
                r#""mamba_proj_bias": true, "layers_block_type": ["mamba", "hybrid"]"#,
                "layers_block_type has 2 entries for num_hidden_layers 5: give one a layer",
            ),
        ],
    );
}

#[test]
fn zamba2_configs_are_read_and_counted() {
    let dir = ConfigDir::new("zamba2-configs");
    // The class's defaults (Zamba2 2.7B's sizes, 54 layers, 9 of them
    // hybrid, one shared block); the counts are transformers' parameters,
    // each shared block once.
    let c = dir.read(r#"{"model_type": "zamba2"}"#).unwrap();
    assert_eq!(total(&c), 2481848336);
    let z = c.zamba.as_ref().unwrap();
    assert_eq!(z.hybrid_layers(), [6, 12, 18, 24, 30, 36, 42, 47, 51]);
    assert_eq!(
        (c.head_dim, c.intermediate, c.heads, c.kv_heads),
        (160, 10240, 32, 32)
    );
    assert!(c.tied && z.blocks == 1 && !z.rope && !z.attention_adapters);
    // Small: two blocks (the first used twice), the attention adapters,
    // biases, two groups of Mamba heads, the head untied.
    let small = r#"{"model_type": "zamba2", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4, "intermediate_size": 96, "layers_block_type": ["mamba", "hybrid", "hybrid", "mamba", "hybrid"], "num_mem_blocks": 2, "use_shared_attention_adapter": true, "adapter_rank": 8, "add_bias_linear": true, "mamba_d_state": 16, "n_mamba_heads": 4, "mamba_ngroups": 2, "tie_word_embeddings": false}"#;
    let s = dir.read(small).unwrap();
    assert_eq!(total(&s), 469776);
    assert_eq!(
        s.mamba.as_ref().map(|m| m.gate),
        Some(MambaGate::Grouped {
            groups: 2,
            before_gate: false
        })
    );
    // More blocks than hybrid layers: the unused ones are held nowhere.
    let spare = r#"{"model_type": "zamba2", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 96, "layers_block_type": ["mamba", "hybrid", "mamba"], "num_mem_blocks": 3, "adapter_rank": 8, "mamba_d_state": 16, "n_mamba_heads": 4}"#;
    let spare = dir.read(spare).unwrap();
    assert_eq!(total(&spare), 229828);
    // The long context: 16384 positions, the base grown as its class
    // grows it (heads 32 wide: 8^(32/30)), the file's base written back.
    let long = small.replace(
        r#""adapter_rank": 8"#,
        r#""adapter_rank": 8, "use_mem_rope": true, "use_long_context": true, "rope_theta": 20000.0"#,
    );
    let long = dir.read(&long).unwrap();
    assert_eq!(long.positions, 16384);
    let grown = 20000.0 * 8f64.powf(32.0 / 30.0);
    assert!(
        (long.rope_theta - grown).abs() < 1e-6 * grown,
        "{}",
        long.rope_theta
    );
    assert!(long.to_hf_json().contains(r#""rope_theta": 20000.0"#));
    dir.round_trips([c, s, spare, long]);
    dir.refuses_replaced(
        small,
        &[
            (
                r#""num_hidden_layers": 5"#,
                r#""num_hidden_layers": 4"#,
                "layers_block_type has 5 entries for num_hidden_layers 4: give one a layer",
            ),
            (
                r#""hybrid", "mamba", "hybrid"]"#,
                r#""hybrid", "mamba", "attention"]"#,
                r#"layers_block_type entry "attention": Zamba2's layers are "mamba" or "hybrid""#,
            ),
            (
                r#""mamba_ngroups": 2"#,
                r#""mamba_ngroups": 2, "use_conv_bias": false"#,
                "use_conv_bias false: Zamba2's convolution has a bias whatever it says",
            ),
            (
                r#""num_attention_heads": 4"#,
                r#""num_attention_heads": 6"#,
                "num_attention_heads 6 does not divide twice hidden_size (128)",
            ),
            (
                r#""adapter_rank": 8"#,
                r#""adapter_rank": 8, "num_key_value_heads": 2"#,
                "use_shared_attention_adapter true with num_key_value_heads 2 of num_attention_heads 4",
            ),
        ],
    );
}

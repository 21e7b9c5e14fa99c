//! LoRA adapters (Hu et al., 2021) as PEFT lays them out: a frozen
//! pretrained linear layer `W` plus a trainable low-rank update `B A`,
//! `y = W x + (alpha / r) B A dropout(x)`, `A` `[r, in]` drawn as PEFT
//! draws it (uniform in `±1/sqrt(in)`), `B` `[out, r]` zeros, so a fresh
//! adapter computes the base model's outputs exactly. With
//! [`LoraConfig::use_dora`], DoRA (Liu et al., 2024) as PEFT computes
//! it: each row of `W + s B A` (its norm detached) rescaled to a trained
//! magnitude, `lora_magnitude_vector`, which starts at the base's row
//! norms (read from the checkpoint's files while the model is built).
//!
//! [`LoraConfig`] is PEFT's `LoraConfig` (the fields of its
//! `adapter_config.json` this crate computes with); the layers of
//! [`crate::llama`], [`crate::gpt2`], [`crate::gpt_neox`] and
//! [`crate::phi`] take adapters on the linear layers it targets when
//! [`crate::hf::HfOptions::lora`] asks, under PEFT's names
//! (`model.layers.0.self_attn.q_proj.lora_A.weight`): with the plan's
//! [`ShardPlan::fresh_weights`](crate::zero::ShardPlan::fresh_weights)
//! the base loads from its checkpoint and the adapters start from world
//! rank 0's draw; [`freeze_base`] leaves the adapters the only
//! parameters that train, with the modules
//! [`LoraConfig::modules_to_save`] trains whole (a head, the
//! embedding) and the embedding rows of
//! [`LoraConfig::trainable_token_indices`], which every ZeRO stage then
//! shards (stage 3 its frozen base too). [`export_layout`] writes them as PEFT's
//! `adapter_model.safetensors` and `adapter_config.json`, which
//! `PeftModel.from_pretrained(base, dir)` loads; [`merge`] folds one into
//! its base's files (PEFT's `merge_and_unload`), for `transformers` or
//! `zrt generate`. Stacked experts' parameters (GPT-OSS's,
//! Granite-MoE's) take adapters through
//! [`LoraConfig::target_parameters`], as PEFT's `ParamWrapper`.

mod embedding;
pub(crate) mod merge;
pub(crate) mod param;
mod per_module;
mod start;

pub(crate) use embedding::{EmbeddingAdapter, TrainableTokens};
pub use merge::{merge, Merged, ADAPTER_CONFIG, ADAPTER_FILE};
pub(crate) use start::init_from_checkpoint;

use std::path::Path;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::blocks::{linear, Training};
use crate::collectives::ProcessGroup;
use crate::hf::HfError;
use crate::zero::{Engine, ExportLayout};

/// PEFT's `LoraConfig`: which linear layers take adapters, of what rank,
/// scaled how.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// `r`: the adapters' rank.
    pub r: i64,
    /// `lora_alpha`: the update is scaled by `alpha / r` (by `alpha /
    /// sqrt(r)` under [`Self::use_rslora`]).
    pub alpha: f64,
    /// `lora_dropout`: the rate at which the adapter's input is dropped
    /// in training.
    pub dropout: f64,
    /// `target_modules`: the linear layers that take adapters, each a
    /// module's name or the end of one after a dot (`q_proj` is every
    /// layer's `self_attn.q_proj`), or `all-linear` alone: every linear
    /// layer of the decoder layers (the head never).
    pub target_modules: Vec<String>,
    /// `target_modules` given as a string other than `all-linear`: a
    /// regular expression, matched as PEFT matches it against each
    /// module's whole name (`re.fullmatch`), adapting the modules it
    /// matches beside [`Self::target_modules`] (Unsloth writes its
    /// adapters' targets so). Rust's `regex` syntax: Python's without
    /// look-around and backreferences, which are refused.
    pub target_pattern: Option<String>,
    /// `exclude_modules`: modules left without adapters though targeted,
    /// each a module's name or the end of one after a dot (PEFT's list).
    pub exclude_modules: Vec<String>,
    /// `exclude_modules` given as a string: a regular expression of the
    /// modules left out, matched as [`Self::target_pattern`] is.
    pub exclude_pattern: Option<String>,
    /// `use_rslora`: scale by `alpha / sqrt(r)` (rank-stabilised LoRA).
    pub use_rslora: bool,
    /// `fan_in_fan_out`: the base stores its matrices `[in, out]`
    /// (GPT-2's Conv1D), as PEFT writes it for such a model; the
    /// adapters' shapes and forward are the same, it says how a merge
    /// adds the update. [`crate::hf::HfModel::from_pretrained_with`]
    /// sets it for GPT-2.
    pub fan_in_fan_out: bool,
    /// `use_dora`: weight-decomposed LoRA (DoRA): each adapted layer's
    /// weight `W + s B A` is taken as a direction, each of its rows
    /// rescaled to a trained magnitude (`lora_magnitude_vector`, one a
    /// row, starting at the pretrained rows' norms), as PEFT computes it.
    pub use_dora: bool,
    /// `modules_to_save`: modules trained whole beside the adapters (a
    /// head, the token embedding: PEFT's `ModulesToSaveWrapper`), each
    /// matched as PEFT matches it, by the end of a module's name
    /// (`lm_head`, `embed_tokens`, `model.norm`). Their tensors load
    /// from the base, train in full and are written into the adapter's
    /// file, which then replaces them in the base on a merge.
    pub modules_to_save: Vec<String>,
    /// `ensure_weight_tying`: on a model whose head is its token
    /// embedding, a saved `embed_tokens` stays the head too (one tensor
    /// trains). zrt keeps a tied head tied, so a saved embedding of such
    /// a model needs this set (PEFT trains the two apart without it).
    pub ensure_weight_tying: bool,
    /// `trainable_token_indices` in PEFT's list form: the token ids
    /// whose rows of the (frozen) input embedding train, standing in for
    /// the matrix's (`token_adapter.trainable_tokens_delta`, starting at
    /// the pretrained rows); a head tied to the embedding computes with
    /// them too. For a chat template's new tokens.
    pub trainable_token_indices: Vec<i64>,
    /// `trainable_token_indices` in PEFT's dict form (instead of the
    /// list): each module (by the end of its name, as PEFT matches it)
    /// with its tokens whose rows train: the input embedding's, as
    /// above, and an untied head's (`lm_head`: the logits of those
    /// tokens come from their trained rows, so that the model can also
    /// write new tokens). Written and read in the order of the modules'
    /// names (a JSON object's keys are sorted).
    pub trainable_tokens_modules: Vec<(String, Vec<i64>)>,
    /// `bias = "all"` (PEFT's; `false` is its `"none"`): every variable
    /// whose name holds `bias` trains beside the adapters (the linear
    /// layers' and the norms' biases, as PEFT matches them), and is
    /// written into the adapter's file (an adapted layer's as PEFT names
    /// it, `...q_proj.base_layer.bias`), replacing the base's on a merge.
    pub train_biases: bool,
    /// `lora_bias`: each adapter's `B` has a bias of its own (zero at
    /// the start, trained, scaled with the update, `...lora_B.bias` in
    /// the adapter's file), which a merge adds to the adapted layer's
    /// bias. PEFT's use: adapters extracted from a full fine-tuning,
    /// which moved the biases too. Linear layers only, not with DoRA
    /// (as in PEFT); a layer without a bias trains with it but cannot be
    /// merged.
    pub lora_bias: bool,
    /// `layers_to_transform`: the layers whose targeted modules take
    /// adapters (by the index in their names, `model.layers.3.` being
    /// layer 3), empty for every layer. As in PEFT, it applies to
    /// modules [`Self::target_modules`] names by the end of their names
    /// (and to `all-linear`), not to a whole name listed nor to
    /// [`Self::target_pattern`] (refused beside it).
    pub layers_to_transform: Vec<i64>,
    /// `layers_pattern`: the name of the list of layers whose index
    /// [`Self::layers_to_transform`] reads (`layers`, GPT-2's `h`;
    /// regular expressions), empty for the number after any component.
    pub layers_pattern: Vec<String>,
    /// `rank_pattern`: ranks other than [`Self::r`], by module: the
    /// first key (a regular expression) matching a module's whole name
    /// or its end after a dot gives its rank (PEFT's
    /// `get_pattern_key`); in PEFT's order, which is the file's.
    pub rank_pattern: Vec<(String, i64)>,
    /// `alpha_pattern`: alphas other than [`Self::alpha`], by module,
    /// matched as [`Self::rank_pattern`] is.
    pub alpha_pattern: Vec<(String, f64)>,
    /// `target_parameters`: stacked experts' parameters that take an
    /// adapter of PEFT's `ParamWrapper` (GPT-OSS's
    /// `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, Llama 4's
    /// `feed_forward.experts.` ones,
    /// Granite-MoE's `input_linear.weight` and `output_linear.weight`),
    /// each a parameter's name or its end after a dot, as PEFT matches
    /// them (neither [`Self::layers_to_transform`] nor the exclusions
    /// apply, as in PEFT). An `[experts, p, q]` parameter's adapter is
    /// `A` `[r experts, p]`, `B` `[q, r experts]`, expert `e`'s update
    /// `s A_e^T B_e^T` `[p, q]` added to its matrix.
    pub target_parameters: Vec<String>,
}

impl LoraConfig {
    /// Rank `r`, `alpha`, no dropout, adapters on `targets`.
    pub fn new(r: i64, alpha: f64, targets: &[&str]) -> Self {
        Self {
            r,
            alpha,
            dropout: 0.0,
            target_modules: targets.iter().map(|t| t.to_string()).collect(),
            target_pattern: None,
            exclude_modules: Vec::new(),
            exclude_pattern: None,
            use_rslora: false,
            fan_in_fan_out: false,
            use_dora: false,
            modules_to_save: Vec::new(),
            ensure_weight_tying: false,
            trainable_token_indices: Vec::new(),
            trainable_tokens_modules: Vec::new(),
            train_biases: false,
            lora_bias: false,
            layers_to_transform: Vec::new(),
            layers_pattern: Vec::new(),
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            target_parameters: Vec::new(),
        }
    }

    /// The rank of the adapter on `module` (its full name):
    /// [`Self::rank_pattern`]'s, or [`Self::r`].
    pub fn rank_of(&self, module: &str) -> i64 {
        per_module::first_match(&self.rank_pattern, module).unwrap_or(self.r)
    }

    /// The factor of the update on `module`: its alpha over its rank (or
    /// the rank's square root), each [`Self::alpha_pattern`]'s and
    /// [`Self::rank_pattern`]'s where they name it.
    pub fn scale_of(&self, module: &str) -> f64 {
        let alpha = per_module::first_match(&self.alpha_pattern, module).unwrap_or(self.alpha);
        self.factor(alpha, self.rank_of(module))
    }

    /// `alpha / r`, or `alpha / sqrt(r)` under [`Self::use_rslora`].
    fn factor(&self, alpha: f64, r: i64) -> f64 {
        match self.use_rslora {
            true => alpha / (r as f64).sqrt(),
            false => alpha / r as f64,
        }
    }

    /// The [`Self::modules_to_save`] entries that name the module of
    /// the variable `name` (`lm_head.weight`) or one it is inside: empty
    /// when the variable does not train whole.
    pub fn saved_by(&self, name: &str) -> Vec<&String> {
        let modules = std::iter::successors(name.rsplit_once('.').map(|(m, _)| m), |m| {
            m.rsplit_once('.').map(|(outer, _)| outer)
        });
        let modules: Vec<&str> = modules.collect();
        (self.modules_to_save.iter())
            .filter(|t| modules.iter().any(|m| m.ends_with(t.as_str())))
            .collect()
    }

    /// The tokens whose rows of the module `module` (its full name, as
    /// the checkpoint names it) train: the dict form's entry naming it,
    /// else, for the `input_embedding`, the list form's.
    pub fn trainable_rows(&self, module: &str, input_embedding: bool) -> &[i64] {
        match (self.trainable_tokens_modules.iter()).find(|(m, _)| names(m, module)) {
            Some((_, ids)) => ids,
            None if input_embedding => &self.trainable_token_indices,
            None => &[],
        }
    }

    /// The update's factor where no pattern gives a module its own:
    /// `alpha / r`, or `alpha / sqrt(r)`.
    pub fn scale(&self) -> f64 {
        self.factor(self.alpha, self.r)
    }

    /// Whether the linear layer `module` (its full name,
    /// `model.layers.0.self_attn.q_proj`) takes an adapter: PEFT's
    /// matching of `target_modules` given as a list.
    pub fn targets(&self, module: &str) -> bool {
        let all = self.target_modules.iter().any(|t| t == "all-linear");
        (all && self.in_layers(module) && !self.excludes(module)) || self.targets_by_name(module)
    }

    /// Whether `target_modules` (or [`Self::target_pattern`]) names the
    /// module `module`, not through `all-linear`, and no exclusion
    /// leaves it out: how PEFT adapts a head or a token embedding, which
    /// `all-linear` leaves out.
    pub fn targets_by_name(&self, module: &str) -> bool {
        // PEFT: a name listed whole takes an adapter on any layer; one
        // matched by its end, on the layers of `layers_to_transform`.
        let whole = self.target_modules.iter().any(|t| t == module);
        let by_end = (self.target_modules.iter()).any(|t| names(t, module));
        let named = whole
            || (by_end && self.in_layers(module))
            || self
                .target_pattern
                .as_deref()
                .is_some_and(|p| fullmatch(p, module));
        named && !self.excludes(module)
    }

    /// Whether the parameter `name` (its full name,
    /// `model.layers.0.mlp.experts.gate_up_proj`) takes an adapter:
    /// PEFT's matching of `target_parameters`, the name or its end after
    /// a dot.
    pub fn targets_parameter(&self, name: &str) -> bool {
        self.target_parameters.iter().any(|t| names(t, name))
    }

    /// Whether `module` is in a layer of [`Self::layers_to_transform`]
    /// (every module is, when it is empty).
    fn in_layers(&self, module: &str) -> bool {
        self.layers_to_transform.is_empty()
            || per_module::layer_index(module, &self.layers_pattern)
                .is_some_and(|i| self.layers_to_transform.contains(&i))
    }

    /// Whether `exclude_modules` (a list or a pattern) leaves `module`
    /// out.
    fn excludes(&self, module: &str) -> bool {
        (self.exclude_modules.iter()).any(|t| names(t, module))
            || self
                .exclude_pattern
                .as_deref()
                .is_some_and(|p| fullmatch(p, module))
    }

    /// Refuses what no adapter can be built with: a rank below 1, a
    /// dropout rate outside `[0, 1)`, no targets, `all-linear` beside
    /// others (PEFT takes it alone, as a string). `what` names the
    /// settings' source in the error.
    pub fn check(&self, what: &str) -> Result<(), HfError> {
        let refuse = |msg: String| HfError::Lora(format!("{what}: {msg}"));
        if self.r < 1 {
            return Err(refuse(format!(
                "rank r = {}: give a rank of 1 or more",
                self.r
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(refuse(format!(
                "lora_dropout {}: a rate in [0, 1)",
                self.dropout
            )));
        }
        let all = self.target_modules.iter().any(|t| t == "all-linear");
        let none = self.target_modules.is_empty()
            && self.target_pattern.is_none()
            && self.target_parameters.is_empty();
        if none || (all && (self.target_modules.len() > 1 || self.target_pattern.is_some())) {
            return Err(refuse(format!(
                "target_modules {:?}: name the linear layers that take adapters (q_proj, v_proj, ...), or all-linear alone",
                self.target_modules
            )));
        }
        for (field, p) in [
            ("target_modules", &self.target_pattern),
            ("exclude_modules", &self.exclude_pattern),
        ] {
            if let Some(Err(e)) = p.as_deref().map(whole_pattern) {
                return Err(refuse(format!(
                    "{field} {:?} is no regular expression zrt reads (Rust's syntax: Python's without look-around or backreferences): {e}",
                    p.as_deref().unwrap_or_default()
                )));
            }
        }
        self.check_per_module(&refuse)?;
        param::check(self, &refuse)?;
        if self.lora_bias && self.use_dora {
            return Err(refuse(
                "lora_bias with use_dora: PEFT gives DoRA's B no bias; turn one of them off".into(),
            ));
        }
        if !self.trainable_token_indices.is_empty() && !self.trainable_tokens_modules.is_empty() {
            return Err(refuse(
                "trainable_token_indices given as a list and by module both: give one of them"
                    .into(),
            ));
        }
        let lists = std::iter::once(&self.trainable_token_indices)
            .chain(self.trainable_tokens_modules.iter().map(|(_, ids)| ids));
        for ids in lists {
            let mut ids = ids.clone();
            ids.sort_unstable();
            if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
                return Err(refuse(format!(
                    "trainable_token_indices name token {} twice: name each once",
                    w[0]
                )));
            }
            if let Some(i) = ids.first().filter(|&&i| i < 0) {
                return Err(refuse(format!(
                    "trainable_token_indices name token {i}: token ids are 0 or more"
                )));
            }
        }
        if let Some(m) = self.modules_to_save.iter().find(|m| m.is_empty()) {
            return Err(refuse(format!(
                "modules_to_save {:?} holds {m:?}: name the modules that train whole (lm_head, embed_tokens)",
                self.modules_to_save
            )));
        }
        Ok(())
    }

    /// Refuses per-module settings PEFT refuses or no adapter has: layers
    /// beside a pattern of targets, a layers pattern without layers, a
    /// rank below 1 or an alpha that is no number, a key that is no
    /// regular expression.
    fn check_per_module(&self, refuse: &dyn Fn(String) -> HfError) -> Result<(), HfError> {
        if !self.layers_to_transform.is_empty() && self.target_pattern.is_some() {
            return Err(refuse(format!(
                "layers_to_transform {:?} beside target_modules given as a pattern: PEFT refuses the two together; put the layers in the pattern, or list the targets",
                self.layers_to_transform
            )));
        }
        if !self.layers_pattern.is_empty() && self.layers_to_transform.is_empty() {
            return Err(refuse(format!(
                "layers_pattern {:?} without layers_to_transform: give the layers' indices too (PEFT refuses it alone)",
                self.layers_pattern
            )));
        }
        let keys = (self.rank_pattern.iter().map(|(k, _)| ("rank_pattern", k)))
            .chain(self.alpha_pattern.iter().map(|(k, _)| ("alpha_pattern", k)))
            .map(|(f, k)| (f, k, per_module::key_pattern(k).err()))
            .chain((self.layers_pattern.iter()).map(|k| {
                let re = regex::Regex::new(&format!("(?:{k})"));
                ("layers_pattern", k, re.err())
            }));
        for (field, key, err) in keys {
            if let Some(e) = err {
                return Err(refuse(format!(
                    "{field} key {key:?} is no regular expression zrt reads (Rust's syntax: Python's without look-around or backreferences): {e}"
                )));
            }
        }
        if let Some((k, r)) = self.rank_pattern.iter().find(|(_, r)| *r < 1) {
            return Err(refuse(format!(
                "rank_pattern gives {k:?} the rank {r}: give a rank of 1 or more"
            )));
        }
        if let Some((k, a)) = self.alpha_pattern.iter().find(|(_, a)| !a.is_finite()) {
            return Err(refuse(format!(
                "alpha_pattern gives {k:?} the alpha {a}: give a finite number"
            )));
        }
        Ok(())
    }

    /// PEFT's `adapter_config.json` for these adapters on the model
    /// `base` (its `base_model_name_or_path`): what
    /// `PeftModel.from_pretrained` reads.
    pub fn adapter_config_json(&self, base: &str) -> String {
        let targets = match self.target_modules.as_slice() {
            [all] if all == "all-linear" => all.as_str().into(),
            list => peft_field(list, self.target_pattern.as_deref()),
        };
        let excluded = match (self.exclude_modules.is_empty(), &self.exclude_pattern) {
            (true, None) => serde_json::Value::Null,
            _ => peft_field(&self.exclude_modules, self.exclude_pattern.as_deref()),
        };
        let json = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets,
            "exclude_modules": excluded,
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "bias": if self.train_biases { "all" } else { "none" },
            "lora_bias": self.lora_bias,
            "fan_in_fan_out": self.fan_in_fan_out,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": match self.modules_to_save.is_empty() {
                true => serde_json::Value::Null,
                false => self.modules_to_save.clone().into(),
            },
            "ensure_weight_tying": self.ensure_weight_tying,
            "trainable_token_indices": match (self.trainable_token_indices.is_empty(), self.trainable_tokens_modules.is_empty()) {
                (false, _) => self.trainable_token_indices.clone().into(),
                (true, false) => (self.trainable_tokens_modules.iter())
                    .map(|(m, ids)| (m.clone(), serde_json::json!(ids)))
                    .collect::<serde_json::Map<_, _>>()
                    .into(),
                (true, true) => serde_json::Value::Null,
            },
            "layers_to_transform": match self.layers_to_transform.is_empty() {
                true => serde_json::Value::Null,
                false => self.layers_to_transform.clone().into(),
            },
            "layers_pattern": match self.layers_pattern.is_empty() {
                true => serde_json::Value::Null,
                false => self.layers_pattern.clone().into(),
            },
            "target_parameters": match self.target_parameters.is_empty() {
                true => serde_json::Value::Null,
                false => self.target_parameters.clone().into(),
            },
        });
        // The patterns in their order (a `serde_json::Map` sorts keys).
        #[derive(serde::Serialize)]
        struct WithPatterns<'a> {
            #[serde(flatten)]
            rest: &'a serde_json::Value,
            rank_pattern: &'a per_module::Ordered<i64>,
            alpha_pattern: &'a per_module::Ordered<f64>,
        }
        let with = WithPatterns {
            rest: &json,
            rank_pattern: &per_module::Ordered(self.rank_pattern.clone()),
            alpha_pattern: &per_module::Ordered(self.alpha_pattern.clone()),
        };
        // Serializing a `Value` and two maps of plain keys cannot fail.
        let text = serde_json::to_string_pretty(&with).unwrap_or_else(|_| format!("{json:#}"));
        format!("{text}\n")
    }
}

/// Whether the list entry `target` names `module`: the name, or its end
/// after a dot (PEFT's matching of a list).
fn names(target: &str, module: &str) -> bool {
    module == target
        || module
            .strip_suffix(target)
            .is_some_and(|m| m.ends_with('.'))
}

/// The module under `p` by its name in the checkpoint (`prefix` before
/// the VarStore's: GPT-2's `transformer.`), as PEFT's targets match it.
pub(crate) fn module_name(p: &nn::Path, prefix: &str) -> String {
    format!("{prefix}{}", p.components().collect::<Vec<_>>().join("."))
}

/// A list of module names and a pattern as PEFT's one field holds them:
/// the list, the pattern, or with both one pattern matching the
/// pattern's modules and the list's names (each name, or its end after
/// a dot).
fn peft_field(list: &[String], pattern: Option<&str>) -> serde_json::Value {
    let Some(p) = pattern else {
        return list.into();
    };
    let names = list
        .iter()
        .map(|t| format!("|(?:.*\\.)?{}", regex::escape(t)));
    format!("{p}{}", names.collect::<String>()).into()
}

/// `pattern` made to match whole names only (Python's `re.fullmatch`).
fn whole_pattern(pattern: &str) -> Result<regex::Regex, regex::Error> {
    regex::Regex::new(&format!("^(?:{pattern})$"))
}

/// Whether `pattern` matches the whole of `module`; a pattern that is no
/// regular expression (refused by [`LoraConfig::check`]) matches nothing.
fn fullmatch(pattern: &str, module: &str) -> bool {
    whole_pattern(pattern).is_ok_and(|r| r.is_match(module))
}

/// The linear layers PEFT adapts in the checkpoint `dir` when its
/// config names none (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`,
/// read from its `config.json`'s `model_type`): GPT-2's `c_attn`,
/// GPT-NeoX's and Falcon's `query_key_value`, CodeGen's `qkv_proj`,
/// GPT-BigCode's `c_attn`, Phi's `q_proj`, `v_proj`, `fc1` and
/// `fc2`, RWKV's `key`, `value`, `receptance` and `output` (its time
/// and channel mixes'), the query and value projections of the Llama family; where
/// PEFT has none (Phi-3, Granite, OLMo 2 and 3, OLMoE, SmolLM3, Ministral,
/// Qwen2-MoE, Qwen3-MoE, StarCoder2, Cohere 1 and 2, GLM, GLM-4,
/// GLM-4-MoE, DeepSeek-V2 and V3, GPT-OSS, Granite-MoE, ERNIE 4.5 dense
/// and MoE, Seed-OSS, EXAONE 4, Arcee, dots.llm1, Granite-MoE-shared, Helium, Apertus, Hunyuan, Hunyuan-MoE, VaultGemma, FlexOlmo, Nemotron, OLMo 1, Llama 4, DBRX, Persimmon, BioGPT, XGLM, PhiMoE, Granite 4.0, Bamba, Jamba, Mamba, Falcon-Mamba, Mamba-2, Falcon-H1, LFM2, MiniMax, Qwen3-Next, DiffLlama, BitNet, JetMoE, RecurrentGemma, LongCat-Flash, GPT-NeoX-Japanese, Aria, CTRL, OpenAI GPT, ModernBERT-decoder, Doge), zrt's
/// choice: Phi-3's fused `qkv_proj` (DBRX's `Wqkv`, Persimmon's and
/// GPT-NeoX-Japanese's `query_key_value`; CTRL's `Wq` and `Wv`; OpenAI
/// GPT's `c_attn`, as GPT-2's), Mamba's and Falcon-Mamba's `in_proj` and
/// `x_proj` and Mamba-2's `in_proj` (of the linear layers
/// `transformers`' Mamba docs adapt, those PEFT allows: it refuses
/// `out_proj` and `conv1d` there, and so does zrt), RecurrentGemma's
/// `q_proj` and `v_proj` in its attending layers and `linear_x` and
/// `linear_y` (the recurrence's input and its gate's) in its recurrent
/// ones, DeepSeek-V2's and
/// V3's (and LongCat-Flash's, in both sublayers) projections making each head's queries (`q_b_proj`, or `q_proj` without the bottleneck)
/// and keys and values (`kv_b_proj`), JetMoE's `kv_proj` (its queries
/// come from experts, stacked parameters), the others' `q_proj` and `v_proj`
/// (GPT-OSS's and Granite-MoE's stacked experts are parameters, not
/// linear layers: [`LoraConfig::target_parameters`] adapts them, and PEFT
/// names none by default).
pub fn default_targets(dir: impl AsRef<Path>) -> Result<Vec<String>, HfError> {
    let j = crate::hf::HfJson::read(dir.as_ref(), None)?;
    let targets: &[&str] = match j.model_type().as_deref() {
        // OpenAI GPT's: GPT-2's (PEFT has none).
        Some("gpt2" | "openai-gpt") => &["c_attn"],
        Some("gpt_neox") => &["query_key_value"],
        // PEFT has none: GPT-NeoX's.
        Some("gpt_neox_japanese") => &["query_key_value"],
        Some("phi") => &["q_proj", "v_proj", "fc1", "fc2"],
        Some("phi3") => &["qkv_proj"],
        Some("dbrx" | "mpt") => &["Wqkv"],
        Some("falcon" | "bloom" | "persimmon") => &["query_key_value"],
        Some("codegen") => &["qkv_proj"],
        // PEFT has none (and refuses `out_proj`).
        Some("mamba" | "falcon_mamba") => &["in_proj", "x_proj"],
        Some("mamba2") => &["in_proj"],
        // Its Mamba layers' inputs, as Mamba-2's (PEFT has none; the
        // shared blocks take adapters when named, once a block).
        Some("zamba2" | "zamba") => &["in_proj"],
        // Its mLSTM layers' queries and values, as attention's (PEFT has
        // none).
        Some("xlstm") => &["q", "v"],
        // PEFT's: both mixers' (the time mix's and the channel mix's).
        Some("rwkv") => &["key", "value", "receptance", "output"],
        // The attending layers' queries and values, the recurrent
        // layers' two inputs (PEFT has none).
        Some("recurrent_gemma") => &["q_proj", "v_proj", "linear_x", "linear_y"],
        Some("gpt_bigcode") => &["c_attn"],
        // Its queries and values (PEFT has none).
        Some("ctrl") => &["Wq", "Wv"],
        // Its queries are its attention experts' (`target_parameters`).
        Some("jetmoe") => &["kv_proj"],
        // Null: one `q_proj` (left out: the class's bottleneck).
        // Its queries always come through the bottleneck.
        Some("longcat_flash") => &["q_b_proj", "kv_b_proj"],
        Some("deepseek_v2" | "deepseek_v3") => match j.size_or_null("q_lora_rank", Some(1536))? {
            None => &["q_proj", "kv_b_proj"],
            Some(_) => &["q_b_proj", "kv_b_proj"],
        },
        _ => &["q_proj", "v_proj"],
    };
    Ok(targets.iter().map(|t| t.to_string()).collect())
}

/// The last names of the input embedding and the head of the checkpoint
/// in `dir` (`embed_tokens` and `lm_head`; GPT-2's `wte` and `lm_head`,
/// GPT-NeoX's (and GPT-NeoX-Japanese's) `embed_in` and `embed_out`, DBRX's, GPT-J's, CodeGen's and
/// GPT-BigCode's `wte` and Falcon's
/// `word_embeddings` beside `lm_head`; BioGPT's `embed_tokens` and
/// `output_projection`; CTRL's `w` and `lm_head`; OpenAI GPT's
/// `tokens_embed` and `lm_head`; ModernBERT-decoder's `tok_embeddings`
/// and `decoder`; RWKV's `embeddings` and `head`), as the dict form of
/// [`LoraConfig::trainable_tokens_modules`] names them. A tied head is
/// no module of its own: naming it there is refused when the model is
/// built.
pub fn ends_names(dir: impl AsRef<Path>) -> Result<(String, String), HfError> {
    let j = crate::hf::HfJson::read(dir.as_ref(), None)?;
    let (embedding, head) = match j.model_type().as_deref() {
        Some("gpt2") => ("wte", "lm_head"),
        Some("gpt_neox" | "gpt_neox_japanese") => ("embed_in", "embed_out"),
        Some("dbrx" | "gptj" | "codegen" | "gpt_bigcode" | "mpt" | "gpt_neo") => ("wte", "lm_head"),
        Some("falcon" | "bloom") => ("word_embeddings", "lm_head"),
        Some("biogpt") => ("embed_tokens", "output_projection"),
        Some("ctrl") => ("w", "lm_head"),
        Some("openai-gpt") => ("tokens_embed", "lm_head"),
        Some("modernbert-decoder") => ("tok_embeddings", "decoder"),
        Some("rwkv") => ("embeddings", "head"),
        _ => ("embed_tokens", "lm_head"),
    };
    Ok((embedding.into(), head.into()))
}

/// Whether the VarStore name `name` is an adapter's (`.lora_A.`,
/// `.lora_B.`, a token embedding's `.lora_embedding_A` and `_B`, DoRA's
/// `.lora_magnitude_vector`, or trainable tokens'
/// `.token_adapter.trainable_tokens_delta`): what
/// [`freeze_base`] leaves trainable and the plan's `fresh_weights`
/// names.
pub fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.")
        || name.contains(".lora_B.")
        || name.ends_with(".lora_embedding_A")
        || name.ends_with(".lora_embedding_B")
        || name.ends_with(".lora_magnitude_vector")
        || name.ends_with(embedding::DELTA)
}

/// Whether the variable `name` is one PEFT's `bias = "all"` trains: its
/// name holds `bias` (PEFT's test, on its own names).
fn is_bias(name: &str) -> bool {
    name.contains("bias")
}

/// The module the adapter variable `name` adapts.
/// Refuses adapters on the modules of `refused` (by their last name),
/// which PEFT refuses for the `model_type` (Mamba's `out_proj` and
/// `conv1d`: the CUDA kernels it runs with read their weights
/// directly), naming them and the fix.
pub(crate) fn refuse_modules(
    vs: &nn::VarStore,
    refused: &[&str],
    model_type: &str,
) -> Result<(), HfError> {
    let mut hit = std::collections::BTreeSet::new();
    for (name, _) in vs.variables() {
        let module = adapted_module(&name);
        let last = module.rsplit('.').next().unwrap_or(module);
        if is_adapter(&name) && refused.contains(&last) {
            hit.insert(last.to_string());
        }
    }
    match hit.is_empty() {
        true => Ok(()),
        false => Err(HfError::Lora(format!(
            "target_modules adapt {hit:?}: PEFT refuses LoRA on {refused:?} of a {model_type:?} model (its CUDA kernels read their weights, bypassing an adapter), so its adapter could not be loaded; name others (in_proj, x_proj, dt_proj)"
        ))),
    }
}

/// Refuses targets that name a convolution: a module whose `weight` is
/// 3-D (Jamba's and the Mambas' `conv1d`, LFM2's `conv`). PEFT adapts
/// one as an `nn.Conv1d`; zrt builds adapters on linear layers and
/// embeddings only, and training the rest with that one left bare would
/// train another model than PEFT's. `prefix` is what the checkpoint's
/// names carry before the VarStore's.
pub(crate) fn refuse_convolutions(
    vs: &nn::VarStore,
    cfg: &LoraConfig,
    prefix: &str,
) -> Result<(), HfError> {
    let mut hit: Vec<String> = (vs.variables().into_iter())
        .filter(|(name, t)| t.dim() == 3 && !is_adapter(name))
        .filter_map(|(name, _)| name.strip_suffix(".weight").map(|m| format!("{prefix}{m}")))
        .filter(|module| cfg.targets_by_name(module))
        .collect();
    hit.sort();
    match hit.first() {
        None => Ok(()),
        Some(first) => Err(HfError::Lora(format!(
            "target_modules name `{first}` ({} convolution{} in all): zrt builds LoRA adapters on linear layers and embeddings, not convolutions (PEFT would adapt it as an nn.Conv1d); leave it out of the targets",
            hit.len(),
            if hit.len() == 1 { "" } else { "s" }
        ))),
    }
}

fn adapted_module(name: &str) -> &str {
    let delta = name
        .strip_suffix(embedding::DELTA)
        .and_then(|m| m.strip_suffix('.'));
    (name.split_once(".lora_").map(|(m, _)| m))
        .or(delta)
        .unwrap_or(name)
}

/// Freezes every variable of `vs` but the adapters and the modules
/// [`LoraConfig::modules_to_save`] names (PEFT's `bias = "none"`: the
/// base's biases and norms frozen too); returns how many adapter
/// matrices train, refusing a model with none (`targets`, the config's
/// `target_modules`, matched no linear layer), a saved module that
/// matches nothing or holds an adapter.
pub fn freeze_base(vs: &nn::VarStore, cfg: &LoraConfig) -> Result<usize, HfError> {
    freeze_base_under(vs, cfg, ("", None), &|_| false)
}

/// A model whose head is its token embedding: the two modules' names
/// in the checkpoint (`model.embed_tokens`, `lm_head`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TiedHead<'a> {
    /// The token embedding's module.
    pub(crate) embedding: &'a str,
    /// The head's module, which has no variable of its own.
    pub(crate) head: &'a str,
}

/// As [`freeze_base`], for a model whose VarStore names lack the
/// checkpoint's `prefix` (GPT-2's `transformer.`: `modules_to_save`
/// matches the checkpoint's names), whose head may be `tied` to its
/// embedding, which trains as one tensor or not at all, and whose
/// matrices `bare` names (by their modules' full names) take no adapter:
/// the error for targets that match nothing does not offer them.
pub(crate) fn freeze_base_under(
    vs: &nn::VarStore,
    cfg: &LoraConfig,
    (prefix, tied): (&str, Option<TiedHead>),
    bare: &dyn Fn(&str) -> bool,
) -> Result<usize, HfError> {
    let refuse = |msg: String| Err(HfError::Lora(format!("modules_to_save: {msg}")));
    let refuse_targets = |msg: String| Err(HfError::Lora(format!("target_modules: {msg}")));
    if let Some(t) = tied {
        refuse_on_tied(cfg, t)?;
    }
    let mut adapters = 0;
    let mut adapted = std::collections::BTreeSet::new();
    let mut saved = Vec::new();
    let mut hit = std::collections::BTreeSet::new();
    // The matrices' modules' last names, and the modules outside the
    // layers, for the errors.
    let mut linear = std::collections::BTreeSet::new();
    let mut outside = std::collections::BTreeSet::new();
    for (name, t) in vs.variables() {
        let full = format!("{prefix}{name}");
        if is_adapter(&name) {
            adapters += 1;
            adapted.insert(format!("{prefix}{}", adapted_module(&name)));
        } else if let by @ [_, ..] = cfg.saved_by(&full).as_slice() {
            hit.extend(by.iter().copied());
            saved.push(full.clone());
        } else if cfg.train_biases && is_bias(&name) {
            // Trains, as PEFT's `bias = "all"` has it.
        } else {
            drop(t.set_requires_grad(false));
        }
        let module = full.rsplit_once('.').map_or(full.as_str(), |(m, _)| m);
        // A layer's: under a numbered path (`layers.0`, `h.0`).
        let in_layer = name.split('.').any(|c| c.parse::<usize>().is_ok());
        match in_layer {
            true if t.dim() == 2 && name.ends_with(".weight") && !bare(module) => {
                linear.insert(module.rsplit('.').next().unwrap_or(module).to_string());
            }
            true => {}
            false => drop(outside.insert(module.to_string())),
        }
    }
    // Each parameter named for an adapter must be a stacked one.
    if !cfg.target_parameters.is_empty() {
        let mut variables: Vec<(String, usize)> = (vs.variables().into_iter())
            .filter(|(n, _)| !is_adapter(n))
            .map(|(n, t)| (format!("{prefix}{n}"), t.dim()))
            .collect();
        // By name: an error names the first.
        variables.sort();
        param::check_matched(cfg, variables.iter().map(|(n, d)| (n.as_str(), *d)))?;
    }
    if adapters == 0 {
        let names: Vec<String> = linear.into_iter().collect();
        let pattern = match &cfg.target_pattern {
            Some(p) => format!(" and the pattern {p:?}"),
            None => String::new(),
        };
        let layers = match cfg.layers_to_transform.as_slice() {
            [] => String::new(),
            l => format!(
                " on the layers {l:?} (layers_to_transform; the model's are numbered from 0)"
            ),
        };
        return Err(HfError::Lora(format!(
            "target_modules {:?}{pattern} match none of the model's linear layers{layers}: name some of its own ({}), or all-linear",
            cfg.target_modules,
            names.join(", ")
        )));
    }
    // A token embedding with a LoRA adapter and trainable tokens, or a
    // DoRA one (PEFT's DoRA embedding is not built here).
    let embedded = (vs.variables().into_keys())
        .find(|n| n.ends_with(".lora_embedding_A"))
        .map(|n| format!("{prefix}{}", adapted_module(&n)));
    if let Some(m) = embedded {
        if cfg.lora_bias {
            return refuse_targets(format!(
                "`{m}` is a token embedding, whose adapter has no bias (PEFT refuses lora_bias on one too): leave it out of the targets, or lora_bias off"
            ));
        }
        if cfg.use_dora {
            return refuse_targets(format!(
                "`{m}` is a token embedding, and zrt builds DoRA on linear layers only: leave it out of the targets, or use_dora off"
            ));
        }
    }
    // The modules whose rows train: none with an adapter too, nor (a
    // head) with a bias, which PEFT leaves out of such a head's logits.
    let variables = vs.variables();
    let rows_of: Vec<String> = (variables.keys())
        .filter_map(|n| n.strip_suffix(embedding::DELTA))
        .map(|m| m.trim_end_matches('.').to_string())
        .collect();
    for m in &rows_of {
        let full = format!("{prefix}{m}");
        if (variables.keys()).any(|n| n.starts_with(&format!("{m}.lora_"))) {
            return refuse_targets(format!(
                "`{full}` takes a LoRA adapter and trainable tokens both: give one of them"
            ));
        }
        if variables.contains_key(&format!("{m}.bias")) {
            return Err(HfError::Lora(format!(
                "trainable_token_indices: `{full}` has a bias, which PEFT leaves out of the logits of a head whose tokens train: zrt does not train its rows (leave it out)"
            )));
        }
    }
    // Each module the dict form names must be one whose rows train.
    let named = |key: &str| rows_of.iter().any(|m| names(key, &format!("{prefix}{m}")));
    if let Some((key, _)) = (cfg.trainable_tokens_modules.iter()).find(|(k, _)| !named(k)) {
        return Err(HfError::Lora(format!(
            "trainable_token_indices: {{{key:?}: ...}} names no module zrt trains tokens' rows of: the input embedding, or a head of its own (untied, without a bias), by the end of its name"
        )));
    }
    if let Some(s) = saved
        .iter()
        .find(|s| adapted.iter().any(|a| s.starts_with(&format!("{a}."))))
    {
        return refuse(format!(
            "`{s}` is in a module that also takes an adapter: a module trains whole or through an adapter, not both"
        ));
    }
    if let Some(m) = cfg.modules_to_save.iter().find(|m| !hit.contains(m)) {
        let names: Vec<String> = outside.into_iter().collect();
        return refuse(format!(
            "`{m}` matches no module of the model: name modules by the end of their names ({}, or a layer's)",
            names.join(", ")
        ));
    }
    Ok(adapters)
}

/// Refuses what `cfg` asks of a model whose head is tied to its
/// embedding (`t`) and zrt cannot build as PEFT would: an adapter on the
/// head, the head saved, the embedding saved but for PEFT's
/// `ensure_weight_tying` on an `embed_tokens`.
fn refuse_on_tied(cfg: &LoraConfig, t: TiedHead) -> Result<(), HfError> {
    let refuse = |msg: String| Err(HfError::Lora(format!("modules_to_save: {msg}")));
    let saves = |module: &str| !cfg.saved_by(&format!("{module}.weight")).is_empty();
    if cfg.targets_by_name(t.head) {
        return Err(HfError::Lora(format!(
            "target_modules: `{}` is the token embedding `{}` in this model (its head is tied): target `{}` for an adapter on the lookup (the tied head then computes with the base's matrix, as in PEFT)",
            t.head, t.embedding, t.embedding
        )));
    }
    if saves(t.head) {
        return refuse(format!(
            "`{}` is the token embedding `{}` in this model (its head is tied): save `{}` with ensure_weight_tying, which trains the two as one",
            t.head, t.embedding, t.embedding
        ));
    }
    let embedding_saved = saves(t.embedding);
    if embedding_saved && !t.embedding.ends_with("embed_tokens") {
        return refuse(format!(
            "`{}` is this model's head too (tied), and PEFT ties a saved embedding to its head only when it is `embed_tokens`: an adapter saving it would load in PEFT with the head left as it was; zrt does not save it",
            t.embedding
        ));
    }
    if embedding_saved && !cfg.ensure_weight_tying {
        return refuse(format!(
            "`{}` is this model's head too (tied): set ensure_weight_tying (PEFT's, finetune_hf sets it), so that the two train as one as zrt trains them; without it PEFT trains a copy of the embedding apart from the head",
            t.embedding
        ));
    }
    Ok(())
}

/// The layout of an adapters-only export for PEFT: the trainable
/// parameters only (the adapters and the saved modules, after
/// [`freeze_base`]) under PEFT's names (`base_model.model.` before the
/// model's), with `adapter_config.json` beside them. Write it with
/// `engine.save_16bit_model_as(dir.join("adapter_model.safetensors"), None, &layout)`.
pub fn export_layout(vs: &nn::VarStore, cfg: &LoraConfig, base: &Path) -> ExportLayout {
    export_layout_under(vs, cfg, base, ("", None), None)
}

/// How a model's VarStore names become its checkpoint's, beside a
/// prefix (Zamba's hybrid layers' Mamba layers under `mamba_decoder`):
/// every name a file holds the tensor under, the first the one it is
/// read by (Zamba's shared blocks under each hybrid layer using them,
/// as PEFT writes an adapter on one).
pub(crate) type FileNames = Box<dyn Fn(&str) -> Vec<String> + Send + Sync>;

/// A checkpoint's tensor or module name as the model names it, one name
/// for a module the checkpoint may hold under several (Zamba's shared
/// blocks).
pub(crate) type ModelNames = Box<dyn Fn(&str) -> String>;

/// As [`export_layout`], for a model whose VarStore names lack the
/// checkpoint's `prefix` (GPT-2's `transformer.`) or are its names as
/// `names` gives them, and whose head may be `tied` to its embedding: a
/// saved embedding is written as the head too, as PEFT's file holds it
/// (and its loader wants it).
pub(crate) fn export_layout_under(
    vs: &nn::VarStore,
    cfg: &LoraConfig,
    base: &Path,
    (prefix, names): (&str, Option<FileNames>),
    tied: Option<TiedHead>,
) -> ExportLayout {
    let config = cfg.adapter_config_json(&base.display().to_string());
    // The modules with adapters, whose trained biases PEFT names as its
    // wrapper holds them (`...q_proj.base_layer.bias`).
    let adapted: std::collections::BTreeSet<String> = (vs.variables().into_keys())
        .filter(|n| is_adapter(n))
        .map(|n| adapted_module(&n).to_string())
        .collect();
    // The embedding by its VarStore name, and the head by its file name.
    let tied = tied.map(|t| {
        let embedding = t.embedding.strip_prefix(prefix).unwrap_or(t.embedding);
        (
            format!("{embedding}.weight"),
            format!("base_model.model.{}.weight", t.head),
        )
    });
    let prefix = format!("base_model.model.{prefix}");
    // Each of the tensor's names in the file (an adapted layer's
    // trained bias by its module's).
    let file = move |name: &str| -> Vec<String> {
        let (of, end) = match name.strip_suffix(".bias") {
            Some(m) if adapted.contains(m) => (m, ".base_layer.bias"),
            _ => (name, ""),
        };
        let names = match &names {
            Some(rule) => rule(of),
            None => vec![of.to_string()],
        };
        (names.into_iter())
            .map(|n| format!("{prefix}{n}{end}"))
            .collect()
    };
    let file = std::sync::Arc::new(file);
    let first = file.clone();
    ExportLayout::new()
        .trainable_only()
        .rename(move |name| first(name).into_iter().next().unwrap_or_default())
        .also_write(move |name| {
            let mut also: Vec<String> = file(name).into_iter().skip(1).collect();
            match &tied {
                Some((embedding, head)) if name == embedding => also.push(head.clone()),
                _ => {}
            }
            also
        })
        .with_file(ADAPTER_CONFIG, config)
}

/// The name in the base checkpoint of the adapter file's tensor `name`:
/// PEFT's `base_model.model.` stripped, and a copy of an adapted
/// embedding's or head's matrix (`...embed_tokens.base_layer.weight`,
/// which PEFT writes by default when it adapts one) named as the matrix,
/// an adapted layer's trained bias (`...q_proj.base_layer.bias`) as the
/// bias.
pub(crate) fn base_name(name: &str) -> String {
    let name = name.strip_prefix("base_model.model.").unwrap_or(name);
    for end in ["weight", "bias"] {
        if let Some(m) = name.strip_suffix(&format!(".base_layer.{end}")) {
            return format!("{m}.{end}");
        }
    }
    name.to_string()
}

/// Loads the adapter directory `dir` (PEFT's, or `finetune_hf
/// --lora-r`'s `--out`) into `engine`'s adapters, every other variable
/// as it was: a model built with [`crate::hf::HfOptions::lora`] set to
/// [`LoraConfig::from_adapter_dir`]`(dir)` then goes on from the
/// adapter (PEFT's `PeftModel.from_pretrained(base, dir,
/// is_trainable=True)`; the optimizer starts afresh), or generates with
/// it. Every adapter of the model and every tensor of the modules its
/// `adapter_config.json` saves must be in the file, and nothing else
/// but copies of the matrices of an adapted embedding or head (PEFT's
/// `save_embedding_layers`), which are loaded into the base; returns how
/// many tensors it loaded. A collective.
pub fn load_adapter<G: ProcessGroup + 'static>(
    engine: &Engine<G>,
    dir: impl AsRef<Path>,
) -> Result<usize, HfError> {
    let cfg = LoraConfig::from_adapter_dir(&dir)?;
    let file = dir.as_ref().join(ADAPTER_FILE);
    // The base's matrices the file holds copies of, by their names in
    // the checkpoint (GPT-2's under `transformer.`).
    let (_, header) = merge::read_header(&file)?;
    let copies: Vec<String> = (header.keys())
        .filter(|n| n.ends_with(".base_layer.weight"))
        .map(|n| base_name(n))
        .collect();
    let copied = |name: &str| {
        (copies.iter()).any(|c| c == name || c.strip_suffix(name).is_some_and(|p| p.ends_with('.')))
    };
    let loaded = engine.load_weights_of(&file, |name, _| {
        is_adapter(name)
            || !cfg.saved_by(name).is_empty()
            || copied(name)
            || (cfg.train_biases && is_bias(name))
    })?;
    Ok(loaded.loaded)
}

/// A linear layer, with a LoRA adapter when its config targets it.
#[derive(Debug)]
pub(crate) struct Adapted {
    base: nn::Linear,
    /// Boxed: most of a model's linear layers have none, and the
    /// layouts' enums hold several `Adapted` side by side.
    adapter: Option<Box<Adapter>>,
    /// BitNet's quantization-aware training ([`Adapted::ternary`]).
    ternary: bool,
    /// The RMS norm (its weight and epsilon) the ternary base puts
    /// before its input's rounding ([`Adapted::ternary_norm`]).
    input_norm: Option<(Tensor, f64)>,
}

/// `A` `[r, in]`, `B` `[out, r]` (and its bias `[out]` under
/// `lora_bias`), DoRA's magnitudes `[out]`, the factor and the input's
/// dropout.
#[derive(Debug)]
struct Adapter {
    a: Tensor,
    b: Tensor,
    /// `B`'s bias (`lora_bias`).
    b_bias: Option<Tensor>,
    magnitude: Option<Tensor>,
    scale: f64,
    dropout: f64,
    training: Training,
}

impl Adapted {
    /// A linear layer `i -> o` under `p`, with or without bias, and an
    /// adapter (`p / "lora_A"`, `p / "lora_B"`) when `lora` targets it.
    pub(crate) fn new(
        p: &nn::Path,
        dims: (i64, i64, bool),
        lora: Option<&LoraConfig>,
        training: &Training,
    ) -> Self {
        Self::new_under(p, "", dims, lora, training)
    }

    /// As [`Adapted::new`], for a model whose VarStore names lack the
    /// checkpoint's `prefix` (GPT-2's `transformer.`), which the
    /// targets match (PEFT's names).
    pub(crate) fn new_under(
        p: &nn::Path,
        prefix: &str,
        (i, o, bias): (i64, i64, bool),
        lora: Option<&LoraConfig>,
        training: &Training,
    ) -> Self {
        Self::new_as(p, &module_name(p, prefix), (i, o, bias), lora, training)
    }

    /// As [`Adapted::new`], the targets matching `name`, PEFT's name of
    /// the module: a module several layers share is named in PEFT as its
    /// first user names it (Zamba's shared blocks, held in the root).
    pub(crate) fn new_as(
        p: &nn::Path,
        name: &str,
        (i, o, bias): (i64, i64, bool),
        lora: Option<&LoraConfig>,
        training: &Training,
    ) -> Self {
        let name = name.to_string();
        let base = linear(p, i, o, bias);
        let adapter = lora.filter(|c| c.targets(&name)).map(|c| {
            let bound = 1.0 / (i as f64).sqrt();
            let uniform = nn::Init::Uniform {
                lo: -bound,
                up: bound,
            };
            let r = c.rank_of(&name);
            Box::new(Adapter {
                a: (p / "lora_A").var("weight", &[r, i], uniform),
                b: (p / "lora_B").var("weight", &[o, r], nn::Init::Const(0.0)),
                b_bias: c
                    .lora_bias
                    .then(|| (p / "lora_B").var("bias", &[o], nn::Init::Const(0.0))),
                // Ones until the build sets the pretrained rows' norms
                // (`init_from_checkpoint`).
                magnitude: c
                    .use_dora
                    .then(|| p.var("lora_magnitude_vector", &[o], nn::Init::Const(1.0))),
                scale: c.scale_of(&name),
                dropout: c.dropout,
                training: training.clone(),
            })
        });
        Self {
            base,
            adapter,
            ternary: false,
            input_norm: None,
        }
    }

    /// The same tensors, another handle: a module several layers use
    /// (Zamba's shared blocks), one parameter each.
    pub(crate) fn share(&self) -> Self {
        let base = nn::Linear {
            ws: self.base.ws.shallow_clone(),
            bs: self.base.bs.as_ref().map(Tensor::shallow_clone),
        };
        let adapter = self.adapter.as_ref().map(|a| {
            Box::new(Adapter {
                a: a.a.shallow_clone(),
                b: a.b.shallow_clone(),
                b_bias: a.b_bias.as_ref().map(Tensor::shallow_clone),
                magnitude: a.magnitude.as_ref().map(Tensor::shallow_clone),
                scale: a.scale,
                dropout: a.dropout,
                training: a.training.clone(),
            })
        });
        let input_norm = (self.input_norm.as_ref()).map(|(w, eps)| (w.shallow_clone(), *eps));
        Self {
            base,
            adapter,
            ternary: self.ternary,
            input_norm,
        }
    }

    /// As it is, its base computing as `transformers`' `AutoBitLinear`
    /// in `online` mode when `on` (BitNet's quantization-aware
    /// training, [`crate::llama::LlamaConfig::ternary`]): on its weights
    /// rounded to -1, 0 and 1 times their mean magnitude and on its
    /// input rounded to 8 bits per token, gradients passing straight
    /// through both roundings. An adapter reads the input unrounded, as
    /// PEFT's on an `AutoBitLinear` does.
    pub(crate) fn ternary(self, on: bool) -> Self {
        Self {
            ternary: on,
            ..self
        }
    }

    /// As it is, its ternary base normalising its input first by an RMS
    /// norm of its own at `eps` (`p / "rms_norm"`'s `weight`, ones),
    /// as `AutoBitLinear` does under `use_rms_norm`
    /// ([`crate::llama::LlamaConfig::ternary_norm`]); an adapter reads
    /// the input unnormalised, as PEFT's beside that base. `None`: no
    /// norm.
    pub(crate) fn ternary_norm(self, p: &nn::Path, eps: Option<f64>) -> Self {
        let width = self.base.ws.size()[1];
        Self {
            input_norm: eps.map(|eps| ((p / "rms_norm").ones("weight", &[width]), eps)),
            ..self
        }
    }

    /// Its matrix and bias when it is a plain linear layer (no adapter,
    /// not ternary): what a fused head and loss may take in its place
    /// ([`crate::zero::glue::linear_cross_entropy`]).
    pub(crate) fn plain(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        let plain = self.adapter.is_none() && !self.ternary;
        plain.then_some((&self.base.ws, self.base.bs.as_ref()))
    }

    /// The base layer's output: its own, or under [`Adapted::ternary`]
    /// the rounded weights' on the rounded input.
    fn base(&self, x: &Tensor) -> Tensor {
        if !self.ternary {
            return self.base.forward(x);
        }
        // Llama's RMS norm: normalised in fp32, back in the input's
        // dtype, times the weight.
        let normed;
        let x = match &self.input_norm {
            None => x,
            Some((weight, eps)) => {
                normed = weight * crate::llama::rms_normalized(x, *eps).to_kind(x.kind());
                &normed
            }
        };
        let (w, x) = (ternary_weights(&self.base.ws), eight_bit_tokens(x));
        x.linear(&w, self.base.bs.as_ref())
    }
}

/// `value` (computed without a graph: nothing of it is saved for the
/// backward) in the forward pass and the identity's gradient to `x` in
/// the backward, as a straight-through estimator's `autograd.Function`
/// returns its result and its gradient unchanged: `x - x` is exactly 0,
/// so the sum is `value` to the bit (`x + (value - x).detach()` would
/// round).
fn straight_through(value: Tensor, x: &Tensor) -> Tensor {
    value + (x - x.detach())
}

/// `w` rounded as `transformers`' BitNet `WeightQuant` rounds it:
/// scaled by the reciprocal of its mean magnitude (at least 1e-5),
/// rounded to -1, 0 or 1, scaled back.
fn ternary_weights(w: &Tensor) -> Tensor {
    let scale = |f: &Tensor| f.abs().mean(Kind::Float).clamp_min(1e-5).reciprocal();
    rounded_to_grid(w, scale, (-1.0, 1.0))
}

/// `x` rounded as BitNet's `ActQuant` rounds it: each token's values
/// (the last dimension) scaled so the largest magnitude (at least 1e-5)
/// is 127, rounded within -128..=127, scaled back.
fn eight_bit_tokens(x: &Tensor) -> Tensor {
    // Python's `127 / t` is `t.reciprocal() * 127`.
    let scale = |f: &Tensor| {
        f.abs()
            .amax([-1i64].as_slice(), true)
            .clamp_min(1e-5)
            .reciprocal()
            * 127.0
    };
    rounded_to_grid(x, scale, (-128.0, 127.0))
}

/// BitNet's rounding of `t`, in fp32 as `transformers` does it: times
/// `scale` of it, rounded (half to even), clamped to `lo..=hi`, divided
/// by the scale, back in `t`'s dtype; computed without a graph and
/// passed [`straight_through`].
fn rounded_to_grid(t: &Tensor, scale: impl Fn(&Tensor) -> Tensor, (lo, hi): (f64, f64)) -> Tensor {
    let rounded = tch::no_grad(|| {
        let f = t.to_kind(Kind::Float);
        let s = scale(&f);
        ((&f * &s).round().clamp(lo, hi) / s).to_kind(t.kind())
    });
    straight_through(rounded, t)
}

impl Module for Adapted {
    fn forward(&self, x: &Tensor) -> Tensor {
        let y = self.base(x);
        let Some(a) = &self.adapter else {
            return y;
        };
        // PEFT's order: B (A (dropout x)) (plus B's bias), times the
        // factor, added.
        let dropped = a.dropout > 0.0 && a.training.on();
        let h = a.training.dropout(x.shallow_clone(), a.dropout);
        let lora = h
            .linear::<&Tensor>(&a.a, None)
            .linear(&a.b, a.b_bias.as_ref());
        let Some(m) = &a.magnitude else {
            return y + lora * a.scale;
        };
        // DoRA, as PEFT's `DoraLinearLayer`: the rows of `W + s B A`
        // (norms detached) rescaled to the magnitudes; the base's output
        // without its bias (or, its input dropped out, the base again on
        // the dropped input).
        let w = self.base.ws.to_kind(x.kind());
        let delta = tch::no_grad(|| a.b.matmul(&a.a));
        let norm = tch::no_grad(|| {
            (&w + delta * a.scale).linalg_norm(2.0, [1i64].as_slice(), false, None::<Kind>)
        });
        let factor = (m / norm).view([1, -1]);
        let base = match (dropped, &self.base.bs) {
            (true, _) => h.linear::<&Tensor>(&w, None),
            (false, Some(bias)) => &y - bias,
            (false, None) => y.shallow_clone(),
        };
        y + (&factor - 1.0) * base + factor * lora * a.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_match_as_peft_matches_a_list() {
        let c = LoraConfig::new(4, 8.0, &["q_proj", "mlp.down_proj"]);
        assert!(c.targets("model.layers.0.self_attn.q_proj"));
        assert!(c.targets("q_proj"));
        assert!(c.targets("model.layers.3.mlp.down_proj"));
        assert!(!c.targets("model.layers.0.self_attn.qq_proj"));
        assert!(!c.targets("model.layers.0.self_attn.k_proj"));
        assert!(!c.targets("model.layers.0.other.down_proj"));
        let all = LoraConfig::new(4, 8.0, &["all-linear"]);
        assert!(all.targets("model.layers.0.mlp.experts.3.w1"));
        assert_eq!(c.scale(), 2.0);
        let rs = LoraConfig {
            use_rslora: true,
            ..c.clone()
        };
        assert_eq!(rs.scale(), 4.0);
    }

    #[test]
    fn patterns_and_exclusions_match_as_peft_matches_them() {
        // Unsloth's way: one pattern, matched against whole names.
        let c = LoraConfig {
            target_pattern: Some(r"model\.layers\.\d+\.(self_attn|mlp)\.(q_proj|down_proj)".into()),
            exclude_modules: vec!["layers.1.mlp.down_proj".into()],
            ..LoraConfig::new(2, 4.0, &[])
        };
        assert!(c.check("cfg").is_ok());
        assert!(c.targets("model.layers.0.self_attn.q_proj"));
        assert!(c.targets("model.layers.12.mlp.down_proj"));
        // Whole names only: `re.fullmatch`, not `re.search`.
        assert!(!c.targets("base.model.layers.0.self_attn.q_proj"));
        assert!(!c.targets("model.layers.0.self_attn.q_proj.x"));
        assert!(!c.targets("model.layers.0.self_attn.k_proj"));
        // Excluded by the end of its name, after a dot.
        assert!(!c.targets("model.layers.1.mlp.down_proj"));
        assert!(c.targets("model.layers.11.mlp.down_proj"));
        // all-linear with an excluding pattern; a name is matched by
        // name, never by all-linear, for the ends.
        let all = LoraConfig {
            exclude_pattern: Some(r".*\.0\..*".into()),
            ..LoraConfig::new(2, 4.0, &["all-linear"])
        };
        assert!(all.targets("model.layers.1.mlp.up_proj"));
        assert!(!all.targets("model.layers.0.mlp.up_proj"));
        assert!(!all.targets_by_name("lm_head"));
        // What PEFT's config holds: the pattern as the field's string;
        // a list beside a pattern as one pattern matching the same names.
        let json: serde_json::Value = serde_json::from_str(&c.adapter_config_json("b")).unwrap();
        assert_eq!(
            json["target_modules"],
            c.target_pattern.clone().unwrap().as_str()
        );
        assert_eq!(
            json["exclude_modules"],
            serde_json::json!(["layers.1.mlp.down_proj"])
        );
        let both = LoraConfig {
            target_modules: vec!["lm_head".into()],
            ..c.clone()
        };
        let json: serde_json::Value = serde_json::from_str(&both.adapter_config_json("b")).unwrap();
        let one = LoraConfig {
            target_modules: vec![],
            target_pattern: json["target_modules"].as_str().map(String::from),
            ..c.clone()
        };
        for m in [
            "lm_head",
            "x.lm_head",
            "model.layers.3.self_attn.q_proj",
            "xlm_head",
            "model.norm",
        ] {
            assert_eq!(one.targets(m), both.targets(m), "{m}");
        }
        // Look-around, which Python's re has and Rust's regex has not,
        // and a pattern beside all-linear, are refused naming them.
        let ahead = LoraConfig {
            target_pattern: Some(r".*(?=q_proj)".into()),
            ..LoraConfig::new(2, 4.0, &[])
        };
        let err = ahead.check("cfg").unwrap_err().to_string();
        assert!(
            err.contains("target_modules \".*(?=q_proj)\" is no regular expression zrt reads"),
            "{err}"
        );
        let mixed = LoraConfig {
            target_pattern: Some("q_proj".into()),
            ..LoraConfig::new(2, 4.0, &["all-linear"])
        };
        assert!(mixed
            .check("cfg")
            .unwrap_err()
            .to_string()
            .contains("all-linear alone"));
    }

    #[test]
    fn layers_and_per_module_ranks_apply_as_peft_applies_them() {
        let c = LoraConfig {
            layers_to_transform: vec![1, 3],
            rank_pattern: vec![("v_proj".into(), 2), (r"layers\.3\..*".into(), 8)],
            alpha_pattern: vec![("q_proj".into(), 32.0)],
            ..LoraConfig::new(4, 16.0, &["q_proj", "v_proj", "embed_tokens", "lm_head"])
        };
        assert!(c.check("cfg").is_ok());
        // Names matched by their ends: on the listed layers only.
        assert!(c.targets("model.layers.1.self_attn.q_proj"));
        assert!(c.targets("model.layers.3.self_attn.v_proj"));
        assert!(!c.targets("model.layers.0.self_attn.q_proj"));
        assert!(!c.targets("model.layers.13.self_attn.q_proj"));
        // A name listed whole takes one anywhere; the embedding, matched
        // by its end, is in no layer (PEFT adapts neither otherwise).
        assert!(c.targets_by_name("lm_head"));
        assert!(!c.targets_by_name("model.embed_tokens"));
        let all = LoraConfig {
            layers_to_transform: vec![0],
            ..LoraConfig::new(4, 16.0, &["all-linear"])
        };
        assert!(all.targets("model.layers.0.mlp.up_proj"));
        assert!(!all.targets("model.layers.1.mlp.up_proj"));
        // The first matching key: v_proj's rank on layer 3 too.
        assert_eq!(c.rank_of("model.layers.3.self_attn.v_proj"), 2);
        assert_eq!(c.rank_of("model.layers.3.self_attn.q_proj"), 8);
        assert_eq!(c.rank_of("model.layers.1.self_attn.q_proj"), 4);
        assert_eq!(c.scale_of("model.layers.1.self_attn.q_proj"), 8.0);
        assert_eq!(c.scale_of("model.layers.3.self_attn.q_proj"), 4.0);
        assert_eq!(c.scale_of("model.layers.1.self_attn.v_proj"), 8.0);
        let rs = LoraConfig {
            use_rslora: true,
            ..c.clone()
        };
        assert_eq!(
            rs.scale_of("model.layers.3.self_attn.q_proj"),
            32.0 / 8f64.sqrt()
        );
        // Written in their order, read back the same.
        let json = c.adapter_config_json("b");
        let v = json.find("\"v_proj\": 2").unwrap();
        assert!(v < json.find(r#""layers\\.3\\..*": 8"#).unwrap(), "{json}");
        let read: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(read["layers_to_transform"], serde_json::json!([1, 3]));
        assert_eq!(read["alpha_pattern"], serde_json::json!({"q_proj": 32.0}));
        // What PEFT refuses, and what no adapter has.
        for (bad, says) in [
            (
                LoraConfig {
                    target_pattern: Some(".*q_proj".into()),
                    ..c.clone()
                },
                "layers_to_transform [1, 3] beside target_modules given as a pattern",
            ),
            (
                LoraConfig {
                    layers_to_transform: vec![],
                    layers_pattern: vec!["layers".into()],
                    ..c.clone()
                },
                "layers_pattern [\"layers\"] without layers_to_transform",
            ),
            (
                LoraConfig {
                    rank_pattern: vec![("q_proj".into(), 0)],
                    ..c.clone()
                },
                "rank_pattern gives \"q_proj\" the rank 0",
            ),
            (
                LoraConfig {
                    alpha_pattern: vec![("q_proj".into(), f64::NAN)],
                    ..c.clone()
                },
                "alpha_pattern gives \"q_proj\" the alpha NaN",
            ),
            (
                LoraConfig {
                    rank_pattern: vec![("(q".into(), 2)],
                    ..c.clone()
                },
                "rank_pattern key \"(q\" is no regular expression",
            ),
        ] {
            let err = bad.check("cfg").unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn default_targets_are_pefts_by_model_type() {
        let dir = std::env::temp_dir().join(format!("zrt-lora-targets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (model_type, want) in [
            ("gpt2", vec!["c_attn"]),
            ("gpt_neox", vec!["query_key_value"]),
            ("phi", vec!["q_proj", "v_proj", "fc1", "fc2"]),
            ("phi3", vec!["qkv_proj"]),
            ("persimmon", vec!["query_key_value"]),
            ("qwen2", vec!["q_proj", "v_proj"]),
            ("starcoder2", vec!["q_proj", "v_proj"]),
            ("deepseek_v3", vec!["q_b_proj", "kv_b_proj"]),
            ("deepseek_v2", vec!["q_b_proj", "kv_b_proj"]),
            ("longcat_flash", vec!["q_b_proj", "kv_b_proj"]),
            ("gpt_neox_japanese", vec!["query_key_value"]),
            ("aria_text", vec!["q_proj", "v_proj"]),
            ("ctrl", vec!["Wq", "Wv"]),
            ("openai-gpt", vec!["c_attn"]),
            ("mamba", vec!["in_proj", "x_proj"]),
            ("falcon_mamba", vec!["in_proj", "x_proj"]),
            ("mamba2", vec!["in_proj"]),
            ("zamba2", vec!["in_proj"]),
            ("zamba", vec!["in_proj"]),
            ("xlstm", vec!["q", "v"]),
            ("rwkv", vec!["key", "value", "receptance", "output"]),
            ("jetmoe", vec!["kv_proj"]),
            (
                "recurrent_gemma",
                vec!["q_proj", "v_proj", "linear_x", "linear_y"],
            ),
            (
                r#"deepseek_v3", "q_lora_rank": null, "_": ""#,
                vec!["q_proj", "kv_b_proj"],
            ),
        ] {
            let config = format!(r#"{{"model_type": "{model_type}"}}"#);
            std::fs::write(dir.join("config.json"), config).unwrap();
            assert_eq!(default_targets(&dir).unwrap(), want, "{model_type}");
        }
        std::fs::remove_file(dir.join("config.json")).unwrap();
        let err = default_targets(&dir).unwrap_err().to_string();
        assert!(err.contains("config.json"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn settings_no_adapter_computes_with_are_refused_naming_the_field() {
        let base = LoraConfig::new(4, 8.0, &["q_proj"]);
        for (bad, field) in [
            (
                LoraConfig {
                    r: 0,
                    ..base.clone()
                },
                "rank r = 0",
            ),
            (
                LoraConfig {
                    dropout: 1.0,
                    ..base.clone()
                },
                "lora_dropout 1",
            ),
            (LoraConfig::new(4, 8.0, &[]), "target_modules []"),
            (
                LoraConfig::new(4, 8.0, &["all-linear", "q_proj"]),
                "all-linear alone",
            ),
        ] {
            let err = bad.check("--lora").unwrap_err().to_string();
            assert!(err.contains(field) && err.contains("--lora"), "{err}");
        }
        assert!(base.check("--lora").is_ok());
    }

    #[test]
    fn saved_modules_match_as_peft_matches_them_and_train_whole() {
        let c = LoraConfig {
            modules_to_save: vec!["lm_head".into(), "model.norm".into(), "mlp".into()],
            ..LoraConfig::new(2, 4.0, &["q_proj"])
        };
        assert_eq!(c.saved_by("lm_head.weight"), ["lm_head"]);
        assert_eq!(c.saved_by("model.norm.weight"), ["model.norm"]);
        // By the end of any module the variable is in.
        assert_eq!(c.saved_by("model.layers.0.mlp.up_proj.weight"), ["mlp"]);
        assert!(c
            .saved_by("model.layers.0.input_layernorm.weight")
            .is_empty());
        assert!(c.saved_by("norm.weight").is_empty());
        // A model: an embedding, one adapted projection, a norm; the head
        // tied to the embedding (it has no variable of its own).
        let build = |saved: &[&str], tying: bool, tokens: &[i64]| {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let cfg = LoraConfig {
                modules_to_save: saved.iter().map(|m| m.to_string()).collect(),
                ensure_weight_tying: tying,
                ..LoraConfig::new(2, 4.0, &["q_proj"])
            };
            let root = vs.root();
            let embed = &root / "model" / "embed_tokens";
            let _ = embed.var("weight", &[10, 4], nn::Init::Const(0.));
            let _ = TrainableTokens::new(&embed, (10, 4), tokens);
            let _ = (&root / "model" / "norm").var("weight", &[4], nn::Init::Const(1.));
            let q = &root / "model" / "layers" / 0 / "self_attn" / "q_proj";
            let _ = Adapted::new(&q, (4, 4, false), Some(&cfg), &Training::default());
            let tied = TiedHead {
                embedding: "model.embed_tokens",
                head: "lm_head",
            };
            let got = freeze_base_under(&vs, &cfg, ("", Some(tied)), &|_| false);
            let mut trainable: Vec<String> = (vs.variables().into_iter())
                .filter(|(_, t)| t.requires_grad())
                .map(|(n, _)| n)
                .collect();
            trainable.sort();
            got.map(|n| (n, trainable)).map_err(|e| e.to_string())
        };
        let (adapters, trainable) = build(&["embed_tokens", "norm"], true, &[]).unwrap();
        assert_eq!(adapters, 2);
        assert_eq!(
            trainable,
            [
                "model.embed_tokens.weight",
                "model.layers.0.self_attn.q_proj.lora_A.weight",
                "model.layers.0.self_attn.q_proj.lora_B.weight",
                "model.norm.weight",
            ]
        );
        for (saved, tying, says) in [
            (&["embed_tokens"][..], false, "set ensure_weight_tying"),
            (&["lm_head"], true, "`lm_head` is the token embedding `model.embed_tokens`"),
            (&["q_proj"], true, "`model.layers.0.self_attn.q_proj.weight` is in a module that also takes an adapter"),
            (&["self_attn"], true, "also takes an adapter"),
            (&["embed_tokens", "tokens too"], true, "`model.embed_tokens.weight` is in a module that also takes an adapter"),
            (&["nothing"], true, "`nothing` matches no module of the model: name modules by the end of their names (model.embed_tokens, model.norm, or a layer's)"),
        ] {
            // A saved embedding some of whose rows train apart too.
            let tokens: &[i64] = if saved.contains(&"tokens too") { &[2, 1] } else { &[] };
            let saved: Vec<&str> = saved.iter().copied().filter(|s| *s != "tokens too").collect();
            let err = build(&saved, tying, tokens).unwrap_err();
            assert!(err.contains(says) && err.contains("modules_to_save"), "{saved:?}: {err}");
        }
    }

    #[test]
    fn a_fresh_adapter_computes_the_base_layer_and_its_update_is_b_a_scaled() {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let c = LoraConfig::new(2, 6.0, &["proj"]);
        let training = Training::default();
        let l = Adapted::new(&(vs.root() / "proj"), (5, 3, true), Some(&c), &training);
        let x = Tensor::randn([4, 5], (tch::Kind::Float, tch::Device::Cpu));
        assert!(l.forward(&x).equal(&l.base.forward(&x)));
        let names: Vec<String> = vs.variables().into_keys().collect();
        assert!(
            names.contains(&"proj.lora_A.weight".to_string()),
            "{names:?}"
        );
        let ad = l.adapter.as_ref().unwrap();
        let _ = tch::no_grad(|| ad.b.shallow_clone().fill_(0.5));
        let want = l.base.forward(&x) + x.matmul(&ad.a.tr()).matmul(&ad.b.tr()) * 3.0;
        assert!(l.forward(&x).allclose(&want, 1e-6, 1e-6, false));
        assert_eq!(freeze_base(&vs, &c).unwrap(), 2);
        let trainable: Vec<String> = (vs.variables().into_iter())
            .filter(|(_, t)| t.requires_grad())
            .map(|(n, _)| n)
            .collect();
        assert!(trainable.iter().all(|n| is_adapter(n)) && trainable.len() == 2);
        let none = LoraConfig::new(2, 6.0, &["q_proj"]);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _ = Adapted::new(&(vs.root() / "proj"), (5, 3, true), Some(&none), &training);
        let err = freeze_base(&vs, &none).unwrap_err().to_string();
        assert!(err.contains("match none"), "{err}");
    }
}

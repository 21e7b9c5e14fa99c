//! The linear layers zrt builds without a LoRA adapter in families where
//! PEFT's adapter on them would not work: a router that is no linear
//! layer (GPT-OSS's, and the grouped routers of DeepSeek-V2/V3, GLM-4-MoE
//! and dots.llm1), one whose weight its class reads directly, so that
//! an adapter never runs (LongCat-Flash's classifier), one whose forward
//! returns a pair, on which PEFT's LoRA layer fails (Llama 4's router).
//! Naming one is refused, saying why; where `all-linear` reaches it in
//! PEFT, zrt's `adapter_config.json` lists it in `exclude_modules`, so
//! that PEFT builds from zrt's file the adapters zrt trained.

use super::{Family, LlamaConfig};
use crate::hf::HfError;
use crate::lora::LoraConfig;

/// A linear layer left bare: the families that have it, its name under
/// a layer (of a mixture), why, and whether PEFT's `all-linear` reaches
/// it (and so it is written excluded).
struct Bare {
    family: fn(Family) -> bool,
    module: &'static str,
    why: &'static str,
    linear: bool,
}

const BARE: &[Bare] = &[
    Bare {
        family: |f| f == Family::GptOss,
        module: "mlp.router",
        why: "GPT-OSS's router is no linear layer (`GptOssTopKRouter` holds its weight and bias as parameters), and PEFT refuses an adapter on it (its experts take adapters through target_parameters)",
        linear: false,
    },
    Bare {
        family: |f| f == Family::LongcatFlash,
        module: "mlp.router.classifier",
        why: "LongCat-Flash's router reads the classifier's weight directly (`F.linear(h, classifier.weight)`), so an adapter there would never run nor train",
        linear: true,
    },
    Bare {
        family: |f| f == Family::Llama4,
        module: "feed_forward.router",
        why: "Llama 4's router (`Llama4Router`) returns its scores and logits as a pair, and PEFT's LoRA layer on it fails in forward",
        linear: true,
    },
    // PEFT refuses these by name ("Target module DeepseekV3TopkRouter()
    // is not supported"), where zrt, which builds the router's weight as
    // a plain parameter, would otherwise train the other targets alone.
    Bare {
        family: Family::deepseek_experts,
        module: "mlp.gate",
        why: "this family's router holds its weight as a parameter of a module of its own (`DeepseekV3TopkRouter`, `DeepseekV2MoEGate`, `Glm4MoeTopkRouter`, `Dots1TopkRouter`), no linear layer, and PEFT refuses an adapter on it",
        linear: false,
    },
];

/// Whether the linear layer `module` (its full name) is one of
/// `family`'s bare ones, which the layer builds without an adapter
/// whatever the targets.
pub(crate) fn is_bare(family: Family, module: &str) -> bool {
    (BARE.iter()).any(|b| (b.family)(family) && module.ends_with(&format!(".{}", b.module)))
}

/// Refuses `lora` naming one of `c`'s bare linear layers; returns those
/// its targets reach otherwise (`all-linear`), by their names under a
/// layer, for `exclude_modules`.
pub(crate) fn check(c: &LlamaConfig, lora: &LoraConfig) -> Result<Vec<String>, HfError> {
    let mut excluded = Vec::new();
    // Each is a mixture's: named on a layer that has one.
    let layers = || (0..c.layers).filter(|&l| c.moe_layer(l));
    for b in BARE.iter().filter(|b| (b.family)(c.family)) {
        let name = |l: i64| format!("model.layers.{l}.{}", b.module);
        if let Some(l) = layers().find(|&l| lora.targets_by_name(&name(l))) {
            return Err(HfError::Lora(format!(
                "target_modules name `{}`: {}; leave it out",
                name(l),
                b.why
            )));
        }
        if b.linear && layers().any(|l| lora.targets(&name(l))) {
            excluded.push(b.module.to_string());
        }
    }
    Ok(excluded)
}

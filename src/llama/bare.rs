//! The linear layers zrt builds without a LoRA adapter in families where
//! PEFT's adapter on them would not work: a router that is no linear
//! layer (GPT-OSS's), one whose weight its class reads directly, so that
//! an adapter never runs (LongCat-Flash's classifier), one whose forward
//! returns a pair, on which PEFT's LoRA layer fails (Llama 4's router).
//! Naming one is refused, saying why; where `all-linear` reaches it in
//! PEFT, zrt's `adapter_config.json` lists it in `exclude_modules`, so
//! that PEFT builds from zrt's file the adapters zrt trained.

use super::{Family, LlamaConfig};
use crate::hf::HfError;
use crate::lora::LoraConfig;

/// A linear layer left bare: its name under a layer, why, and whether
/// PEFT's `all-linear` reaches it (and so it is written excluded).
struct Bare {
    family: Family,
    module: &'static str,
    why: &'static str,
    linear: bool,
}

const BARE: &[Bare] = &[
    Bare {
        family: Family::GptOss,
        module: "mlp.router",
        why: "GPT-OSS's router is no linear layer (`GptOssTopKRouter` holds its weight and bias as parameters), and PEFT refuses an adapter on it (its experts take adapters through target_parameters)",
        linear: false,
    },
    Bare {
        family: Family::LongcatFlash,
        module: "mlp.router.classifier",
        why: "LongCat-Flash's router reads the classifier's weight directly (`F.linear(h, classifier.weight)`), so an adapter there would never run nor train",
        linear: true,
    },
    Bare {
        family: Family::Llama4,
        module: "feed_forward.router",
        why: "Llama 4's router (`Llama4Router`) returns its scores and logits as a pair, and PEFT's LoRA layer on it fails in forward",
        linear: true,
    },
];

/// Whether the linear layer `module` (its full name) is one of
/// `family`'s bare ones, which the layer builds without an adapter
/// whatever the targets.
pub(super) fn is_bare(family: Family, module: &str) -> bool {
    (BARE.iter()).any(|b| b.family == family && module.ends_with(&format!(".{}", b.module)))
}

/// Refuses `lora` naming one of `c`'s bare linear layers; returns those
/// its targets reach otherwise (`all-linear`), by their names under a
/// layer, for `exclude_modules`.
pub(crate) fn check(c: &LlamaConfig, lora: &LoraConfig) -> Result<Vec<String>, HfError> {
    let mut excluded = Vec::new();
    for b in BARE.iter().filter(|b| b.family == c.family) {
        let name = |l: i64| format!("model.layers.{l}.{}", b.module);
        if let Some(l) = (0..c.layers).find(|&l| lora.targets_by_name(&name(l))) {
            return Err(HfError::Lora(format!(
                "target_modules name `{}`: {}; leave it out",
                name(l),
                b.why
            )));
        }
        if b.linear && (0..c.layers).any(|l| lora.targets(&name(l))) {
            excluded.push(b.module.to_string());
        }
    }
    Ok(excluded)
}

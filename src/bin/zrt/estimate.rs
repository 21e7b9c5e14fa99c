//! `zrt estimate`: model-state bytes per rank for each ZeRO stage (fp32
//! master, Adam's m and v, Lion's m or SGD's momentum buffer): what zrt holds, and in mixed precision also
//! DESIGN.md's table, whose gradients are 16-bit. Frozen parameters (a
//! LoRA model's base: `--frozen`) add their values alone, sharded at
//! stage 3 and packed as int8 with `--quantize-frozen`. And what building
//! the model holds before an engine shards it. With `--seq`, what a
//! rank holds in all while it trains at the config's stage (stage 3
//! without a config): the model state, the largest unit in flight, the
//! activations, and at stage 1 the reduced gradients' shard held to the
//! step.

use anyhow::{bail, Result};
use clap::Args;
use zrt::lora::LoraConfig;

/// Options of `zrt estimate`.
#[derive(Args, Debug)]
pub struct EstimateArgs {
    /// Parameters in the model (5e9 is fine).
    #[arg(
        long,
        required_unless_present = "hf_config",
        conflicts_with = "hf_config"
    )]
    params: Option<f64>,
    /// A Hugging Face checkpoint's `config.json` (or its directory) of a
    /// model zrt builds (GPT-2, GPT-NeoX, Phi, and the Llama family's
    /// eighty-two `model_type`s, from Llama to xLSTM): its
    /// parameters are counted from it (the buffers it holds as frozen
    /// parameters, MiniMax's decays, as frozen), and the largest unit
    /// stage 3 gathers is named.
    #[arg(long)]
    hf_config: Option<std::path::PathBuf>,
    /// Ranks the model is sharded over.
    #[arg(long)]
    world: u64,
    /// Compute dtype: fp32, bf16 or fp16 (default bf16, or the config's).
    #[arg(long, conflicts_with = "config")]
    dtype: Option<String>,
    /// Frozen parameters besides `--params` (a LoRA model's base): no
    /// gradient nor optimizer state, their values only.
    #[arg(long, default_value_t = 0.0)]
    frozen: f64,
    /// Stage 3 holds the frozen shards as int8
    /// (`zero_quantized_nontrainable_weights`).
    #[arg(long)]
    quantize_frozen: bool,
    /// The optimizer (`optimizer.type`): adam, adamw, lamb, muon (AdamW's
    /// two moments, one for the share `--muon-share` of matrices),
    /// rmsprop-momentum (RMSprop with `momentum` above 0) and
    /// rmsprop-centered keep two fp32 moments per trained parameter, lion, adagrad, rmsprop and
    /// sgd-momentum (SGD with `momentum` above 0) one, sgd (torch's
    /// default, no momentum) none (default adam, or the config's).
    #[arg(long, conflicts_with = "config")]
    optimizer: Option<String>,
    /// With Muon: the share of the trained parameters it steps (the
    /// hidden matrices; the engine logs it, `Engine::num_muon_params`),
    /// whose second moment is not kept in memory (default 0.9; the main
    /// job's GPT: 0.96).
    #[arg(long)]
    muon_share: Option<f64>,
    /// With `--hf-config`: the tokens of a row. Prints what a training
    /// forward holds for its backward on each rank (the tensors autograd
    /// saves), for the models whose layers it counts (GPT-2's, GPT-NeoX's, Phi's, Llama's, Mistral's,
    /// Ministral's, Qwen2's, Qwen3's, Granite's, Seed-OSS's, Arcee's,
    /// StarCoder2's, Nemotron's, ERNIE 4.5's (with experts too),
    /// Helium's, GLM's and GLM-4's, Hunyuan's, Cohere 1's and 2's,
    /// StableLM's, Persimmon's, Gemma 1-3's, VaultGemma's, Phi-3's,
    /// SmolLM3's, OLMo 1-3's, EXAONE 4's, Mixtral's, Qwen2-MoE's,
    /// Qwen3-MoE's, OLMoE's, FlexOlmo's, Granite-MoE's (shared too),
    /// Hunyuan-MoE's, GLM-4-MoE's, dots.llm1's, DeepSeek-V2's and V3's,
    /// Llama 4's, Apertus's, LFM2's, DBRX's, Falcon's, OPT's, BioGPT's,
    /// XGLM's, GPT-BigCode's, GPT-J's, CodeGen's, GPT-Neo's, MPT's,
    /// BLOOM's, OpenAI GPT's, CTRL's, GPT-NeoX-Japanese's,
    /// ModernBERT-decoder's, BitNet's trained unrounded, DiffLlama's,
    /// Doge's, Mamba's, Falcon-Mamba's, Jamba's, Mamba-2's, Bamba's and
    /// Granite 4.0's (rows longer than a chunk), GPT-OSS's).
    #[arg(long)]
    seq: Option<u64>,
    /// With `--seq`: the rows each rank computes at once
    /// (`train_micro_batch_size_per_gpu`).
    #[arg(long, default_value_t = 1, requires = "seq")]
    micro_batch: u64,
    /// With `--seq`: each layer recomputed in backward, its input alone
    /// kept (`finetune_hf --checkpoint-activations`).
    #[arg(long, requires = "seq")]
    checkpoint_activations: bool,
    /// With `--seq`: the loss takes the head's logits whole
    /// (`finetune_hf --unfused-loss`), which it then keeps for backward.
    /// Without it the head is fused with the loss, as the loss methods
    /// run it by default (`HfModel::set_fused_loss`), and keeps no
    /// logits.
    #[arg(long, requires = "seq")]
    unfused_loss: bool,
    /// With `--hf-config`: LoRA adapters of this rank train on the frozen
    /// model (`finetune_hf --lora-r`): the adapters are the trained
    /// parameters, the model the frozen ones, and `--seq`'s activations
    /// are LoRA's. Counted on the layers of GPT-2, GPT-NeoX, Phi, Llama,
    /// Mistral, Ministral, Qwen2, Qwen3, Granite, Seed-OSS, Arcee,
    /// StarCoder2, Nemotron, ERNIE 4.5 (with experts too), Helium, GLM
    /// and GLM-4, Hunyuan, Cohere 1 and 2, StableLM, Persimmon, Gemma
    /// 1-3, VaultGemma, Phi-3, SmolLM3, OLMo 1-3, EXAONE 4, Mixtral,
    /// PhiMoE, Aria, Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo, Granite-MoE
    /// (shared too), Hunyuan-MoE, GLM-4-MoE, dots.llm1, DeepSeek-V2 and
    /// V3, Llama 4, Apertus, LFM2, DBRX, Falcon, OPT (OPT-350m's
    /// projections in and out too), BioGPT, XGLM, GPT-BigCode, GPT-J,
    /// CodeGen, GPT-Neo, MPT, BLOOM, OpenAI GPT, CTRL, GPT-NeoX-Japanese,
    /// ModernBERT-decoder (its dense layer before the head too), BitNet
    /// trained unrounded, DiffLlama, Doge (its `dt_proj` too, where each
    /// layer's queries need a gradient), Mamba, Falcon-Mamba and Jamba
    /// (their scans' `in_proj`, `x_proj`, `dt_proj`, `out_proj` too),
    /// Mamba-2, Bamba, Granite 4.0 and Falcon-H1 (their scans' `in_proj`
    /// and `out_proj` too, Granite 4.0's dense shared MLP) and GPT-OSS
    /// (not on a mixture's router or experts, shared or routed).
    #[arg(long)]
    lora_r: Option<i64>,
    /// With `--lora-r`: the linear layers that take adapters,
    /// comma-separated (`all-linear` for every one of the layers'; PEFT's
    /// default for the model's type without it).
    #[arg(long, requires = "lora_r")]
    lora_targets: Option<String>,
    /// With `--lora-r`: the rate of LoRA's dropout of each adapter's
    /// input (`lora_dropout`, `finetune_hf --lora-dropout`), which keeps
    /// each adapter's dropped copy of its input, and its mask.
    #[arg(long, default_value_t = 0.0, requires = "lora_r")]
    lora_dropout: f64,
    /// A DeepSpeed config to take the dtype, the optimizer and
    /// `zero_quantized_nontrainable_weights` from; its stage's row is
    /// marked.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
}

/// What `--config` decides: (dtype, optimizer, frozen shards packed, stage).
fn from_config(path: &std::path::Path) -> Result<(String, String, bool, u8)> {
    use zrt::zero::config::{OptimizerKind, Precision};
    let c = zrt::zero::Config::from_file(path)?;
    let dtype = match c.precision {
        Precision::Fp32 => "fp32",
        Precision::Bf16 { .. } => "bf16",
        _ => "fp16",
    };
    let optimizer = match c.optimizer.kind {
        OptimizerKind::Lion => "lion",
        OptimizerKind::Sgd if c.optimizer.momentum > 0.0 => "sgd-momentum",
        OptimizerKind::Sgd => "sgd",
        OptimizerKind::Lamb => "lamb",
        OptimizerKind::Adagrad => "adagrad",
        OptimizerKind::Rmsprop if c.optimizer.momentum > 0.0 => "rmsprop-momentum",
        OptimizerKind::Rmsprop if c.optimizer.centered => "rmsprop-centered",
        OptimizerKind::Rmsprop => "rmsprop",
        OptimizerKind::Adam | OptimizerKind::AdamW => "adam",
        OptimizerKind::Muon => "muon",
    };
    let packed = c.zero.zero_quantized_nontrainable_weights;
    Ok((dtype.into(), optimizer.into(), packed, c.zero.stage))
}

/// Bytes per element of a frozen shard packed as int8: a code each and a
/// 4-byte scale per 2048 (more where a parameter's bounds cut a group
/// short: a few per parameter, left out).
const PACKED_BYTES: f64 = 1.0 + 4.0 / 2048.0;

/// Bytes per rank `f` frozen parameters take at `stage` on `n` shards in
/// `c`-byte compute params: whole on every rank below stage 3, sharded
/// at stage 3 (packed with `quantized`). Stage 3 shards those of more
/// than `stage3_param_persistence_threshold` elements inside wrapped
/// blocks; this counts them all so.
pub fn frozen_bytes(stage: u8, f: f64, n: f64, c: f64, quantized: bool) -> f64 {
    match (stage, quantized) {
        (0..=2, _) => c * f,
        (_, false) => c * f / n,
        (_, true) => PACKED_BYTES * f / n,
    }
}

/// Bytes per rank zrt holds for `psi` parameters on `n` shards at
/// `stage`, with `c`-byte compute params (2 for bf16/fp16, 4 for fp32) and
/// an optimizer keeping `moments` fp32 moments (Adam 2, Lion 1, SGD 1 or
/// 0).
/// Gradients are fp32 whatever the compute dtype (DESIGN.md "Numerics"),
/// so mixed precision holds 2 bytes per parameter more than DESIGN.md's
/// table (DeepSpeed's, with 16-bit gradients): see [`table_bytes`].
pub fn model_state_bytes(stage: u8, psi: f64, n: f64, c: f64, moments: f64) -> f64 {
    by_stage(stage, psi, n, (c, 4.0, optimizer_bytes(c, moments)))
}

/// DESIGN.md's table: gradients in the compute dtype.
pub fn table_bytes(stage: u8, psi: f64, n: f64, c: f64, moments: f64) -> f64 {
    by_stage(stage, psi, n, (c, c, optimizer_bytes(c, moments)))
}

/// Optimizer-state bytes per parameter: the fp32 moments and, in mixed
/// precision, the fp32 master (in fp32 training the master is the params).
fn optimizer_bytes(c: f64, moments: f64) -> f64 {
    let master = if c == 4.0 { 0.0 } else { 4.0 };
    master + 4.0 * moments
}

/// Which of params, grads and optimizer state (bytes per parameter) each
/// stage shards.
fn by_stage(stage: u8, psi: f64, n: f64, (p, g, opt): (f64, f64, f64)) -> f64 {
    match stage {
        0 => (p + g + opt) * psi,
        1 => (p + g) * psi + opt * psi / n,
        2 => p * psi + (g + opt) * psi / n,
        _ => (p + g + opt) * psi / n,
    }
}

/// What the model of `zrt estimate` holds.
struct Counted {
    /// Its parameters, `--params`' or counted.
    params: f64,
    /// `--hf-config`'s model's largest unit: its name and parameters.
    largest: Option<(String, u64)>,
    /// The values of the buffers `--hf-config`'s model holds as frozen
    /// variables (MiniMax's decays).
    buffers: u64,
    /// With `--lora-r`: the adapters (their parameters are `params`) and
    /// the frozen model's parameters.
    lora: Option<(LoraConfig, u64)>,
}

/// The parameters `--params` gives or `--hf-config`'s model holds, and
/// for the latter its largest unit and frozen buffers.
fn params_of(a: &EstimateArgs) -> Result<Counted> {
    let Some(path) = &a.hf_config else {
        if a.lora_r.is_some() {
            bail!("--lora-r counts the adapters from the layers' widths, which --params does not give: give the model's config.json as --hf-config, or the adapters' count as --params and the model's as --frozen");
        }
        return Ok(Counted {
            params: a.params.unwrap_or(f64::NAN),
            largest: None,
            buffers: 0,
            lora: None,
        });
    };
    let buffers = zrt::hf::frozen_buffers(path)?;
    let units = zrt::hf::unit_params(path)?;
    let total: u64 = units.iter().map(|(_, n)| n).sum();
    let largest = (units.iter())
        .filter(|(name, _)| !name.is_empty())
        .max_by_key(|(_, n)| *n)
        .cloned();
    println!(
        "{}: {total} params in {} units and the root",
        path.display(),
        units.len() - 1
    );
    if let Some(wrapper) = zrt::hf::language_model_of(path)? {
        println!(
            "the language model of a {wrapper:?} checkpoint, which zrt trains alone: the image or audio encoder beside it is neither built nor counted"
        );
    }
    if buffers > 0 {
        println!(
            "and {buffers} values of buffers its class writes into its files, which zrt holds as frozen parameters (counted below as frozen)"
        );
    }
    if let Some(r) = a.lora_r {
        let targets = match &a.lora_targets {
            Some(list) => list.split(',').map(str::to_string).collect(),
            None => zrt::lora::default_targets(path)?,
        };
        let lora = LoraConfig {
            target_modules: targets,
            dropout: a.lora_dropout,
            ..LoraConfig::new(r, 2.0 * r as f64, &[])
        };
        lora.check("--lora-r, --lora-targets and --lora-dropout")?;
        let Some(adapters) = zrt::hf::adapter_params(path, &lora)? else {
            bail!("--lora-r counts the adapters of the layers of {} (not on a mixture's router or experts); for this model give the adapters' count as --params and the model's as --frozen", zrt::llama::COUNTED_FAMILIES);
        };
        println!(
            "LoRA r {r} on {}: {adapters} adapter params train, the {total} of the model frozen",
            lora.target_modules.join(",")
        );
        return Ok(Counted {
            params: adapters as f64,
            largest,
            buffers,
            lora: Some((lora, total)),
        });
    }
    Ok(Counted {
        params: total as f64,
        largest,
        buffers,
        lora: None,
    })
}

/// Runs `zrt estimate`.
pub fn run(a: &EstimateArgs) -> Result<()> {
    // Refused before anything is printed.
    if let Some(seq) = a.seq {
        if a.hf_config.is_none() {
            bail!("--seq counts activations from the layers' widths, which --params does not give: give the model's config.json as --hf-config instead");
        }
        if seq == 0 || a.micro_batch == 0 {
            bail!("--seq and --micro-batch must be at least 1 (e.g. --seq 2048 --micro-batch 1)");
        }
    }
    let Counted {
        params,
        largest,
        buffers,
        lora,
    } = params_of(a)?;
    let (dtype, optimizer, quantize_frozen, marked) = match &a.config {
        Some(path) => {
            let (d, o, q, stage) = from_config(path)?;
            (d, o, q || a.quantize_frozen, Some(stage))
        }
        None => (
            a.dtype.clone().unwrap_or_else(|| "bf16".into()),
            a.optimizer.clone().unwrap_or_else(|| "adam".into()),
            a.quantize_frozen,
            None,
        ),
    };
    let c = match dtype.as_str() {
        "fp32" => 4.0,
        "bf16" | "fp16" => 2.0,
        other => bail!("--dtype must be fp32, bf16 or fp16, got {other}"),
    };
    // NaN and infinity are not a count of parameters.
    if a.world == 0 || !params.is_finite() || params <= 0.0 {
        bail!("--params and --world must be positive numbers (e.g. --params 7e9 --world 8)");
    }
    if !a.frozen.is_finite() || a.frozen < 0.0 {
        bail!("--frozen must be a count of parameters, 0 or more (e.g. --frozen 7e9)");
    }
    let share = a.muon_share.unwrap_or(0.9);
    if !(0.0..=1.0).contains(&share) {
        bail!("--muon-share is a share of the parameters, from 0 to 1 (e.g. --muon-share 0.9)");
    }
    if a.muon_share.is_some() && !optimizer.eq_ignore_ascii_case("muon") {
        bail!("--muon-share is for Muon, and the optimizer is {optimizer}: give --optimizer muon (or a config whose optimizer.type is \"Muon\"), or leave --muon-share out");
    }
    let muon = format!(
        "Muon over {}% of the parameters (one moment for those, AdamW's two for the rest)",
        (share * 1000.0).round() / 10.0
    );
    let (optimizer, moments) = match optimizer.to_ascii_lowercase().as_str() {
        "adam" | "adamw" => ("Adam", 2.0),
        "lamb" => ("Lamb", 2.0),
        "muon" => (muon.as_str(), 2.0 - share),
        "lion" => ("Lion", 1.0),
        "adagrad" => ("Adagrad", 1.0),
        "rmsprop-momentum" => ("RMSprop with momentum", 2.0),
        "rmsprop-centered" => ("RMSprop centered", 2.0),
        "rmsprop" => ("RMSprop without momentum", 1.0),
        "sgd-momentum" => ("SGD with momentum", 1.0),
        "sgd" => ("SGD without momentum", 0.0),
        other => {
            bail!("--optimizer must be adam, adamw, lamb, muon, rmsprop-momentum, rmsprop-centered, lion, adagrad, rmsprop, sgd-momentum or sgd, got {other}")
        }
    };
    println!("{params:.3e} params, {} ranks, {dtype} compute, {optimizer}: model-state bytes per rank (excluding activations and gathered units in flight)", a.world);
    // The model's frozen buffers join the frozen parameters given, and
    // under LoRA the model itself.
    let base = lora.as_ref().map_or(0, |(_, n)| *n);
    let frozen = a.frozen + buffers as f64 + base as f64;
    if frozen > 0.0 {
        println!(
            "with {frozen:.3e} frozen params (values only; stage 3 shards them{})",
            match quantize_frozen {
                true => " as int8 codes and scales",
                false => "",
            }
        );
    }
    let mixed = c != 4.0;
    if mixed {
        println!("             {:>14}  {:>14}", "zrt", "16-bit grads");
    }
    for stage in 0..=3u8 {
        let (psi, n) = (params, a.world as f64);
        let frozen = frozen_bytes(stage, frozen, n, c, quantize_frozen);
        let mark = match marked == Some(stage) {
            true => "  <- the config's stage",
            false => "",
        };
        let b = model_state_bytes(stage, psi, n, c, moments) + frozen;
        match mixed {
            true => println!(
                "  stage {stage}: {:>14}  {:>14}{mark}",
                human(b),
                human(table_bytes(stage, psi, n, c, moments) + frozen)
            ),
            false => println!("  stage {stage}: {:>14}{mark}", human(b)),
        }
    }
    if mixed {
        println!("zrt reduces and accumulates gradients in fp32 (a 16-bit accumulation drifts); the second column is DESIGN.md's table, DeepSpeed's, which keeps them in {dtype}");
    }
    // The stage summed in all: the config's, else stage 3.
    let stage = marked.unwrap_or(3);
    let unit = match (largest, lora.is_some(), stage) {
        (Some((name, n)), false, 3) => {
            // Gathered values and their gradient in the compute dtype,
            // and the fp32 buffer the gradient is reduced from.
            let peak = (2.0 * c + 4.0) * n as f64;
            println!(
                "stage 3 gathers a unit at a time: the largest, `{name}` ({n} params), adds up to {} at its backward (its gathered values, their gradient, the fp32 buffer it is reduced from), besides activations",
                human(peak)
            );
            Some(peak)
        }
        (Some((name, n)), true, 3) => {
            let peak = c * n as f64;
            println!(
                "stage 3 gathers a unit at a time: the largest, `{name}` ({n} params, frozen), adds {} of gathered values, besides its adapters and activations",
                human(peak)
            );
            Some(peak)
        }
        (Some((name, n)), false, _) => {
            // Below stage 3 every rank holds the values: a unit's
            // gradient in the compute dtype, and the fp32 buffer it is
            // reduced from, live while backward goes on.
            let peak = (c + 4.0) * n as f64;
            println!(
                "stage {stage} reduces a unit at a time: the largest, `{name}` ({n} params), adds up to {} at its backward (its gradient in {dtype}, the fp32 buffer it is reduced from), besides activations",
                human(peak)
            );
            Some(peak)
        }
        // Below stage 3 the frozen model is every rank's (counted in the
        // model state); only the adapters' gradients are reduced.
        (Some(_), true, _) => Some(0.0),
        (None, _, _) => None,
    };
    let state_at = |stage: u8| {
        model_state_bytes(stage, params, a.world as f64, c, moments)
            + frozen_bytes(stage, frozen, a.world as f64, c, quantize_frozen)
    };
    if let (Some(seq), Some(path)) = (a.seq, &a.hf_config) {
        let held = activations(
            path,
            (a.micro_batch, seq),
            (&dtype, a.checkpoint_activations, !a.unfused_loss),
            lora.as_ref().map(|(l, _)| l),
        )?;
        if let (Some(held), Some(unit)) = (held, unit) {
            let in_flight = match stage {
                3 => "the largest unit in flight",
                1 => "the largest unit's gradients in flight, the reduced gradients' shard held to the step",
                _ => "the largest unit's gradients in flight",
            };
            // Stage 1 keeps the accumulated gradients whole until the
            // step, and reduces them into shards of their own beside
            // them in the last backward before it.
            let reduced = match stage {
                1 => 4.0 * params / a.world as f64,
                _ => 0.0,
            };
            println!(
                "stage {stage} in all: {} a rank while it trains (the model state, {in_flight}, the activations); the program, libtorch's own memory, {} and the allocator's slack come on top (0.35-1.4 GiB a rank in the 0.4B-1.1B runs of the README's Benchmarks)",
                human(state_at(stage) + unit + reduced + held as f64),
                match stage {
                    3 => "the units prefetched beside it",
                    _ => "the reductions in flight beside it (two reduce buckets)",
                }
            );
        }
    }
    let stage3 = state_at(3);
    let built = build_bytes(params, frozen);
    println!(
        "building the model: {} on every rank (its weights in fp32, as tch's layers make them), or on rank 0 alone under ShardPlan::weights_on_first_rank_only (the other ranks hold one block), or on no rank under ShardPlan::weights_from_file (each loads its shard of a file) or weights_on_disk_while_built (rank 0 writes it to disk as it is made){}",
        human(built),
        match built > stage3 {
            true => "; more than stage 3 holds",
            false => "",
        }
    );
    Ok(())
}

/// Prints what a forward of `rows` rows of `seq` tokens of the model
/// `path` describes holds for its backward, or why it is not counted,
/// and returns it.
fn activations(
    path: &std::path::Path,
    (rows, seq): (u64, u64),
    (dtype, recompute, fused_loss): (&str, bool, bool),
    lora: Option<&LoraConfig>,
) -> Result<Option<u64>> {
    let kind = match dtype {
        "fp32" => tch::Kind::Float,
        "fp16" => tch::Kind::Half,
        _ => tch::Kind::BFloat16,
    };
    let how = match recompute {
        true => ", each layer recomputed in backward",
        false => "",
    };
    let how = match lora {
        Some(l) => format!("{how}, LoRA r {} adapters training", l.r),
        None => how.to_string(),
    };
    let held = zrt::hf::held_for_backward(path, (rows, seq), kind, (recompute, fused_loss), lora)?;
    let keeps_logits = fused_loss && zrt::hf::fused_loss_keeps_logits(path, rows * seq)?;
    let loss = match (fused_loss, keeps_logits) {
        (true, false) if lora.is_some() => "the head fused with the loss, no logits kept but the gradient of the frozen head's input in fp32, which forward computes; `--unfused-loss` counts the logits",
        (true, false) => "the head fused with the loss, no logits kept; `--unfused-loss` counts them",
        // Its blocks' size bounds what it keeps: the time of computing
        // them again is not worth so little memory.
        (true, true) => "the head fused with the loss, which keeps the logits' log-probabilities in fp32 as one of its blocks of 8M logits holds them all",
        (false, _) => "the logits the loss keeps among them",
    };
    match held {
        Some(b) => println!(
            "activations: a forward of {rows} x {seq} tokens in {dtype}{how} holds {} a rank for its backward (the tensors autograd saves, {loss}), on top of the above",
            human(b as f64)
        ),
        None => println!(
            "activations: not counted for this model (zrt counts the layers of {} with their own dropouts, but not the attention weights' of attentions other than the fused kernel; nor adapters on experts); measure them: `memory_breakdown` logs what libtorch holds at its peak",
            zrt::llama::COUNTED_FAMILIES
        ),
    }
    Ok(held)
}

/// What a rank holds once it has built the whole model: every weight in
/// fp32, trained (`psi`) and frozen (`frozen`) alike, before an engine
/// shards any.
pub fn build_bytes(psi: f64, frozen: f64) -> f64 {
    4.0 * (psi + frozen)
}

/// `b` bytes in GiB, or in MiB below one GiB (small models would show
/// every stage as 0.04 GiB).
fn human(b: f64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_design_table() {
        // Mixed precision: 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N.
        assert_eq!(table_bytes(0, 1.0, 4.0, 2.0, 2.0), 16.0);
        assert_eq!(table_bytes(1, 1.0, 4.0, 2.0, 2.0), 4.0 + 3.0);
        assert_eq!(table_bytes(2, 1.0, 4.0, 2.0, 2.0), 2.0 + 3.5);
        assert_eq!(table_bytes(3, 1.0, 4.0, 2.0, 2.0), 4.0);
        // fp32: params are the master copy: 16 Psi as well, 4-byte grads.
        assert_eq!(table_bytes(2, 1.0, 2.0, 4.0, 2.0), 4.0 + 6.0);
        assert_eq!(model_state_bytes(2, 1.0, 2.0, 4.0, 2.0), 4.0 + 6.0);
    }

    #[test]
    fn mixed_precision_counts_fp32_gradients() {
        // What tests/engine_behaviour.rs measures the engine holding in bf16.
        assert_eq!(model_state_bytes(0, 1.0, 2.0, 2.0, 2.0), 18.0);
        assert_eq!(model_state_bytes(1, 1.0, 2.0, 2.0, 2.0), 12.0);
        assert_eq!(model_state_bytes(2, 1.0, 2.0, 2.0, 2.0), 10.0);
        assert_eq!(model_state_bytes(3, 1.0, 2.0, 2.0, 2.0), 9.0);
        // Lion's one moment: 4 bytes less per parameter, sharded with the
        // optimizer state (stage 0: all of it; stage 2 on 2 ranks: half).
        assert_eq!(model_state_bytes(0, 1.0, 2.0, 2.0, 1.0), 14.0);
        assert_eq!(model_state_bytes(2, 1.0, 2.0, 2.0, 1.0), 8.0);
        assert_eq!(model_state_bytes(0, 1.0, 2.0, 4.0, 1.0), 12.0);
        // SGD without momentum in fp32: the parameters and gradients alone.
        assert_eq!(model_state_bytes(0, 1.0, 2.0, 4.0, 0.0), 8.0);
        assert_eq!(model_state_bytes(3, 1.0, 2.0, 2.0, 0.0), 5.0);
    }

    #[test]
    fn frozen_parameters_hold_their_values_only() {
        // Replicated below stage 3, sharded at 3, packed: a byte and a
        // 2048th of a scale each.
        assert_eq!(frozen_bytes(2, 8.0, 4.0, 2.0, true), 16.0);
        assert_eq!(frozen_bytes(3, 8.0, 4.0, 2.0, false), 4.0);
        assert_eq!(frozen_bytes(3, 8.0, 4.0, 4.0, false), 8.0);
        assert_eq!(frozen_bytes(3, 2048.0, 2.0, 2.0, true), 1026.0);
    }

    #[test]
    fn building_holds_every_weight_in_fp32() {
        assert_eq!(build_bytes(7e9, 0.0), 28e9);
        assert_eq!(build_bytes(1e9, 3e9), 16e9);
    }

    #[test]
    fn small_models_print_in_mib() {
        assert_eq!(human((1u64 << 30) as f64 * 16.0), "16.00 GiB");
        assert_eq!(human(39.2e6), "37.38 MiB");
    }
}

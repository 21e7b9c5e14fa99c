//! `zrt generate`: a Hugging Face checkpoint (a fine-tune's export, say)
//! continues a prompt, greedily or sampled, in this one process
//! ([`HfModel::greedy`], [`HfModel::sample`]).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use zrt::chat_template::{Ending, Extras};
use zrt::collectives::local;
use zrt::generate::SamplingArgs;
use zrt::hf::{eos_token_ids, HfModel, HfOptions};
use zrt::lora::LoraConfig;
use zrt::tokenize::HfTokenizer;
use zrt::zero::{AutoHints, Config, Engine, ShardPlan};

/// Options of `zrt generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The checkpoint: a `save_pretrained` directory (`config.json`, its
    /// safetensors files, `tokenizer.json`), such as `finetune_hf
    /// --out`'s.
    #[arg(long)]
    model: PathBuf,
    /// The text to continue (encoded as `tokenizer(text)` encodes it,
    /// special tokens added), or with `--chat` a user's message.
    #[arg(long, required_unless_present = "messages")]
    prompt: Option<String>,
    /// A conversation to answer, instead of `--prompt`: a JSON file
    /// holding a list of messages (`{"role": ..., "content": ...}`), or
    /// an object with it as `messages` (and the functions' schemas as
    /// `tools`, a retrieval template's documents as `documents`), as a
    /// line of TRL's conversational data holds them; rendered with the
    /// checkpoint's chat template with the assistant's turn opened
    /// (`apply_chat_template(messages, tools=tools, documents=documents,
    /// add_generation_prompt=True)`).
    #[arg(long, conflicts_with_all = ["prompt", "chat"])]
    messages: Option<PathBuf>,
    /// With `--messages`: the model goes on with the conversation's final
    /// message (an assistant's reply begun for it) instead of opening a
    /// new turn (`apply_chat_template(..., continue_final_message=True)`).
    #[arg(long, requires = "messages")]
    continue_final_message: bool,
    /// The prompt is a user's message to an instruction-tuned model:
    /// rendered with the checkpoint's chat template with the assistant's
    /// turn opened (`apply_chat_template([{"role": "user", "content":
    /// PROMPT}], add_generation_prompt=True)`), no special token added
    /// (the template writes them).
    #[arg(long)]
    chat: bool,
    /// With `--chat`: a system message before the user's.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens the continuation holds at most (it stops after the
    /// checkpoint's `eos_token_id`).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Greedy, or sampled.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// With `--do-sample`: the draws' seed.
    #[arg(long, default_value_t = 0, requires = "do_sample")]
    seed: u64,
    /// Hold the weights and compute in bf16 (half the memory of fp32;
    /// the checkpoint's values rounded to bf16, as `from_pretrained`
    /// with `dtype=torch.bfloat16` rounds them).
    #[arg(long)]
    bf16: bool,
    /// A LoRA adapter on the checkpoint: PEFT's directory
    /// (`adapter_config.json`, `adapter_model.safetensors`), such as
    /// `finetune_hf --lora-r`'s `--out` (`zrt lora merge` folds one in
    /// for good).
    #[arg(long)]
    adapter: Option<PathBuf>,
}

/// Runs `zrt generate`: the model built on one rank at stage 0, every
/// parameter frozen (no gradients, no optimizer state; in bf16 with
/// `--bf16`, as the engine makes frozen parameters its compute dtype),
/// its weights read from the checkpoint's files as the engine is built.
pub fn run(a: &GenerateArgs) -> Result<()> {
    let tokenizer = HfTokenizer::open(&a.model)?;
    let prompt = match (&a.messages, a.prompt.as_deref()) {
        (Some(path), _) => {
            let ending = match a.continue_final_message {
                true => Ending::ContinueFinalMessage,
                false => Ending::GenerationPrompt,
            };
            conversation(&tokenizer, path, ending)?
        }
        (None, Some(text)) if a.chat => {
            let messages: Vec<(&str, &str)> = (a.system.iter())
                .map(|s| ("system", s.as_str()))
                .chain([("user", text)])
                .collect();
            tokenizer.encode_chat(&messages)?
        }
        (None, Some(text)) => tokenizer.encode(text)?,
        (None, None) => anyhow::bail!("give --prompt TEXT or --messages FILE"),
    };
    let prompt: Vec<i64> = prompt.into_iter().map(i64::from).collect();
    let stop = eos_token_ids(&a.model)?;
    let sampling = a.sampling.sampling(&a.model, a.seed)?;
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let plan = ShardPlan::new();
    let options = HfOptions {
        lora: match &a.adapter {
            Some(dir) => Some(LoraConfig::from_adapter_dir(dir)?),
            None => None,
        },
        ..Default::default()
    };
    let (model, _) = HfModel::from_pretrained_with(&vs, &plan, &a.model, &options)?;
    for t in vs.variables().values() {
        let _ = t.set_requires_grad(false);
    }
    // An optimizer named, though nothing trains, so that the config is
    // not warned of as lacking one.
    let bf16 = if a.bf16 { "true" } else { "false" };
    let cfg = Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}, "bf16": {{"enabled": {bf16}}}, "zero_optimization": {{"stage": 0}}}}"#
    ))?;
    let group = (local::world(1).remove(0))
        .new_group(&[0])
        .context("a group of this one process")?;
    let engine = Engine::new(&vs, &plan, &cfg, group, &AutoHints::default())?;
    if let Some(dir) = &a.adapter {
        zrt::lora::load_adapter(&engine, dir)?;
    }
    let new = match &sampling {
        Some(s) => model.sample(&prompt, a.max_new_tokens, &stop, s)?,
        None => model.greedy(&prompt, a.max_new_tokens, &stop)?,
    };
    engine.pending_error()?;
    let new: Vec<u32> = new.iter().map(|&id| id as u32).collect();
    println!("{}", tokenizer.decode(&new)?);
    Ok(())
}

/// The ids of `--messages`' conversation (with the file's `tools` and
/// `documents`), ended as `ending` says.
fn conversation(
    tokenizer: &HfTokenizer,
    path: &std::path::Path,
    ending: Ending,
) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--messages {}: reading it", path.display()))?;
    // In the file's own key order, which a template's `tojson` shows.
    let json: minijinja::Value = serde_json::from_str(&text)
        .with_context(|| format!("--messages {}: not JSON", path.display()))?;
    let field = |name: &str| json.get_attr(name).ok().filter(|v| !v.is_undefined());
    let (messages, tools, documents) = match json.kind() {
        minijinja::value::ValueKind::Seq => (json.clone(), None, None),
        _ => match field("messages") {
            Some(m) => (m, field("tools"), field("documents")),
            None => anyhow::bail!(
                "--messages {}: neither a list of messages nor an object with one as \"messages\"",
                path.display()
            ),
        },
    };
    let extras = Extras {
        tools: tools.as_ref(),
        documents: documents.as_ref(),
    };
    let ids = tokenizer.encode_conversation(&messages, &extras, ending);
    ids.with_context(|| format!("--messages {}", path.display()))
}

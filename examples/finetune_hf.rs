//! Fine-tunes a Hugging Face checkpoint (GPT-2, GPT-NeoX/Pythia, Phi-1/2, or Llama and its kin:
//! Mistral, Ministral, Qwen2/3, Gemma 1-3, Phi-3/4, Granite, OLMo 2/3, SmolLM3,
//! StarCoder2, StableLM, Cohere 1/2, GLM/GLM-4, Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4-MoE, GPT-OSS, Granite-MoE, DeepSeek-V2, ERNIE 4.5 (dense and MoE), Seed-OSS, EXAONE 4, Arcee, dots.llm1, Granite-MoE-shared, Helium, Apertus, Hunyuan, Hunyuan-MoE, VaultGemma, FlexOlmo, Nemotron, OLMo 1, Llama 4, DBRX, Falcon, GPT-J, CodeGen, GPT-BigCode, OPT, GPT-Neo, MPT, BLOOM, Persimmon, BioGPT, XGLM, PhiMoE, Granite 4.0, Bamba, Jamba, Mamba, Falcon-Mamba, Mamba-2, Falcon-H1, LFM2, MiniMax, Qwen3-Next, DiffLlama, BitNet, JetMoE, RecurrentGemma, LongCat-Flash, GPT-NeoX-Japanese, Aria, CTRL, OpenAI GPT, ModernBERT-decoder, Doge, RWKV, Zamba2, Zamba, xLSTM; as
//! `save_pretrained` wrote it) across ranks with ZeRO, and writes the
//! result back in its own layout for `transformers`:
//!
//! ```sh
//! cargo build --release --example finetune_hf --bin zrt
//! target/release/zrt tokenize --tokenizer path/to/llama --out train.bin --eos corpus.jsonl
//! target/release/zrt launch --nproc-per-node 4 -- target/release/examples/finetune_hf \
//!     --model path/to/llama --data train.bin --seq 512 --steps 1000 --out tuned
//! ```
//!
//! No rank holds the model while it is built: each rank builds it
//! without memory and the engine loads each rank's shard of the
//! checkpoint's files ([`HfModel::from_pretrained`]). The data is a flat
//! file of token ids already tokenized, little-endian `u16` (nanoGPT's
//! `train.bin`) or with `--u32` `u32`, as `zrt tokenize` writes it from
//! text with the checkpoint's tokenizer ([`zrt::tokenize`]); each rank reads its own windows
//! of `--seq + 1` tokens from it (with `--packed-documents`, each
//! window's documents attend only within themselves: [`zrt::packing`]).
//! The DeepSpeed config is
//! `examples/ds_finetune.json` unless `--config` names another. The
//! export (`--out`) is `config.json` and safetensors files of at most
//! `--max-shard-mb` MB, which `AutoModelForCausalLM.from_pretrained`
//! reads. With `--save-dir` it checkpoints (every `--save-every` steps
//! and at the end), and a run started again goes on from the latest
//! checkpoint there, reading the windows the first run would have read.
//! The first rank prints each step's loss over its counted tokens, and
//! beside it (`aux`) the auxiliary losses the config adds (the routers'
//! load-balancing loss with `output_router_logits`, Bamba's z-loss),
//! which train with it ([`HfModel::plus_aux_losses`]).
//! With `--eval-data` the first rank prints the mean loss of held-out
//! windows (`transformers`' loss given labels: the auxiliary ones in
//! it) before training, every `--eval-every` steps and at the end;
//! with `--prompt TEXT`, the text's greedy continuation before training
//! and at the end (`HfModel::greedy`, the checkpoint's tokenizer; with
//! `--do-sample`, sampled: `HfModel::sample`; with `--chat`, the text
//! is a user's message rendered with the checkpoint's chat template).
//! With `--lora-r R` (any layout) it trains LoRA adapters on the
//! frozen base (with `--lora-modules-to-save` whole modules beside them,
//! with `--lora-trainable-tokens` some tokens' embedding rows, with
//! `--lora-layers` on some layers only, with `--lora-bias all` every
//! bias beside them, with `--lora-target-parameters` on stacked
//! experts: GPT-OSS's, Granite-MoE's), and `--out` is PEFT's adapter
//! directory.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use tch::{nn, Device, Kind, Tensor};
use zrt::collectives::{init_from_env, ProcessGroup, ReduceOp};
use zrt::generate::SamplingArgs;
use zrt::hf::{counted_targets, eos_token_ids, items_per_micro_step, HfModel, HfOptions};
use zrt::lora::LoraConfig;
use zrt::packing::{document_positions, positions_from_starts};
use zrt::tokenize::HfTokenizer;
use zrt::zero::{AutoHints, Config, Engine, ShardPlan};

/// Fine-tunes a Hugging Face GPT-2, GPT-NeoX, Phi or Llama checkpoint with ZeRO (run it
/// under `zrt launch`).
#[derive(Parser)]
struct Args {
    /// The checkpoint: a `save_pretrained` directory (`config.json` and
    /// `model.safetensors` or its index).
    #[arg(long)]
    model: PathBuf,
    /// Training tokens: a flat file of little-endian token ids.
    #[arg(long)]
    data: PathBuf,
    /// The ids are `u32` (a vocabulary past 65536), not `u16`.
    #[arg(long)]
    u32: bool,
    /// Which of `--data`'s tokens the loss counts: a byte a token, 0
    /// for a prompt's (`zrt tokenize --completion-only` writes it as
    /// `DATA.mask`); without it every token counts.
    #[arg(long)]
    mask: Option<PathBuf>,
    /// Each window's documents, each ended by the checkpoint's
    /// `eos_token_id` (as `zrt tokenize --eos` writes them), attend only
    /// within themselves, their positions counted from their own start,
    /// and no document's first token is predicted from the one before
    /// (TRL's `padding_free` packing: `zrt::packing`); in training and
    /// in the evaluation. Without it a window is one causal sequence.
    #[arg(long)]
    packed_documents: bool,
    /// Where `--data`'s documents start (`zrt tokenize --document-starts`
    /// writes `DATA.docs`, a byte a token): packs them as
    /// `--packed-documents` does, their bounds read from this file rather
    /// than found at the end-of-sequence token, which in a conversation
    /// also ends each turn.
    #[arg(long)]
    documents: Option<PathBuf>,
    /// Where `--eval-data`'s documents start, as `--documents` for
    /// `--data` (without it, a packed run's held-out documents end at the
    /// end-of-sequence token).
    #[arg(long, requires = "eval_data")]
    eval_documents: Option<PathBuf>,
    /// The DeepSpeed config.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/ds_finetune.json"))]
    config: PathBuf,
    /// Tokens a sequence predicts (each window holds one more).
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Where the fine-tuned model is written, in the checkpoint's layout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The largest safetensors file of the export, in MB (fractions too).
    #[arg(long, default_value_t = 5000.0)]
    max_shard_mb: f64,
    /// Recompute every block's activations in backward (less memory).
    #[arg(long)]
    checkpoint_activations: bool,
    /// Take the head's logits whole for the loss, as `transformers`
    /// does, instead of the head fused with the loss (the default, where
    /// the model allows it: `HfModel::set_fused_loss`), which holds no
    /// `[tokens, vocabulary]` logits and runs the head's product once
    /// more (where they take more than one of its blocks, 8M logits, and
    /// the head trains: under LoRA it runs none more).
    #[arg(long)]
    unfused_loss: bool,
    /// Where checkpoints go (`save_checkpoint`, tag `stepN`); a run given
    /// one goes on from the latest there, if any (`resume_from`).
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end).
    #[arg(long, default_value_t = 0)]
    save_every: u64,
    /// Steps between the first rank's loss lines.
    #[arg(long, default_value_t = 10)]
    print_every: u64,
    /// Train without the model's dropout (GPT-2's `*_pdrop`, Llama's
    /// `attention_dropout`), which is on otherwise, as in Hugging Face's
    /// `Trainer`.
    #[arg(long)]
    no_dropout: bool,
    /// NEFTune: noise on the token embeddings while training, uniform in
    /// ±alpha / sqrt(seq * width) (TRL's `neftune_noise_alpha`; 5 in its
    /// paper), as `transformers` draws it; never in the evaluation or a
    /// prompt's continuation. It needs the model in training, which
    /// `--no-dropout` turns off.
    #[arg(long, conflicts_with = "no_dropout", allow_negative_numbers = true)]
    neftune_alpha: Option<f64>,
    /// libtorch's seed (dropout's masks), the same on every rank; a run
    /// that goes on from a checkpoint takes the generator's state saved
    /// there. `--do-sample` draws from it too, with a generator of its
    /// own (the masks stay as they are).
    #[arg(long, default_value_t = 42)]
    seed: i64,
    /// Held-out token ids, as `--data` holds them: the first rank prints
    /// their mean loss and perplexity before training, every
    /// `--eval-every` steps and at the end (dropout off meanwhile).
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Which of `--eval-data`'s tokens its loss counts, as `--mask` for
    /// `--data` (without it every token counts).
    #[arg(long, requires = "eval_data")]
    eval_mask: Option<PathBuf>,
    /// Steps between evaluations (0: before training and at the end).
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// Windows of `--seq + 1` tokens each rank evaluates: the held-out
    /// file's, one after another, rank by rank (wrapping around a short
    /// file).
    #[arg(long, default_value_t = 8)]
    eval_windows: usize,
    /// Text the model continues greedily before training and at the end
    /// (the first rank prints both): the checkpoint's `tokenizer.json`
    /// encodes it and decodes the continuation.
    #[arg(long)]
    prompt: Option<String>,
    /// The `--prompt` is a user's message to an instruction-tuned
    /// model: rendered with the checkpoint's chat template, the
    /// assistant's turn opened (`zrt generate --chat`'s).
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// Tokens a `--prompt` continuation holds at most (it stops at the
    /// checkpoint's `eos_token_id`).
    #[arg(long, default_value_t = 32)]
    sample_tokens: usize,
    /// How the `--prompt` continuation is picked: greedily, or sampled
    /// (`--do-sample`, drawn from `--seed`).
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Train LoRA adapters of this rank on a frozen base (PEFT's `r`;
    /// any layout): `--out` is then PEFT's adapter
    /// directory (`adapter_model.safetensors`, `adapter_config.json`).
    #[arg(long)]
    lora_r: Option<i64>,
    /// The adapters' `lora_alpha` (the update is scaled by alpha / r).
    #[arg(long, default_value_t = 8.0, requires = "lora_r")]
    lora_alpha: f64,
    /// The rate at which the adapters' input is dropped in training.
    #[arg(long, default_value_t = 0.0, requires = "lora_r")]
    lora_dropout: f64,
    /// The linear layers that take adapters, comma-separated (PEFT's
    /// `target_modules`; `all-linear` for every one of the layers').
    /// Without it, PEFT's default for the checkpoint's `model_type`
    /// (`zrt::lora::default_targets`: the query and value projections
    /// of Llama and its kin, GPT-2's `c_attn`, ...).
    #[arg(long, requires = "lora_r")]
    lora_targets: Option<String>,
    /// Stacked experts' parameters that take adapters too,
    /// comma-separated (PEFT's `target_parameters`:
    /// `mlp.experts.gate_up_proj,mlp.experts.down_proj` for GPT-OSS,
    /// `input_linear.weight,output_linear.weight` for Granite-MoE). Not
    /// with `--lora-dropout`, which PEFT refuses beside them.
    #[arg(long, requires = "lora_r", value_delimiter = ',')]
    lora_target_parameters: Vec<String>,
    /// DoRA (PEFT's `use_dora`): each adapted layer's rows rescaled to a
    /// trained magnitude, starting at the base's row norms.
    #[arg(long, requires = "lora_r")]
    lora_dora: bool,
    /// Modules that train whole beside the adapters, comma-separated
    /// (PEFT's `modules_to_save`: `lm_head`, `embed_tokens`), written
    /// into the adapter's file. On a model whose head is its embedding,
    /// name `embed_tokens`: the two train as one (PEFT's
    /// `ensure_weight_tying`, which this sets).
    #[arg(long, requires = "lora_r")]
    lora_modules_to_save: Option<String>,
    /// Tokens whose rows of the input embedding train beside the
    /// adapters, comma-separated ids or tokens' texts as the checkpoint's
    /// tokenizer holds them (`<|im_start|>,<|im_end|>`): PEFT's
    /// `trainable_token_indices`, for a chat template's new tokens.
    #[arg(long, requires = "lora_r")]
    lora_trainable_tokens: Option<String>,
    /// Tokens whose rows of an untied head train too, as
    /// `--lora-trainable-tokens` names them: their logits come from
    /// the trained rows, so the model learns to write them (PEFT's dict
    /// form of `trainable_token_indices`, naming both ends).
    #[arg(long, requires = "lora_r")]
    lora_trainable_head_tokens: Option<String>,
    /// The layers whose targeted modules take adapters, comma-separated
    /// indices from 0 (PEFT's `layers_to_transform`): `--lora-layers
    /// 10,11` adapts the last two of twelve. Without it, every layer.
    #[arg(long, requires = "lora_r", value_delimiter = ',')]
    lora_layers: Vec<i64>,
    /// Which of the model's biases train beside the adapters (PEFT's
    /// `bias`): `none` (without it) or `all`, every bias, written into
    /// the adapter's file. (`lora_only` is refused: PEFT 0.18 trains the
    /// adapted layers' biases, then leaves them out of its file.)
    #[arg(long, requires = "lora_r", value_parser = ["none", "all", "lora_only"])]
    lora_bias: Option<String>,
    /// Each adapter's B has a bias of its own (PEFT's `lora_bias`, not
    /// its `bias`, which is `--lora-bias`), trained and written into
    /// the adapter's file; a merge adds it to the adapted layer's bias
    /// (a layer without one cannot be merged).
    #[arg(long, requires = "lora_r")]
    lora_b_bias: bool,
    /// Go on training the LoRA adapter in this directory (PEFT's, or a
    /// `--lora-r` run's `--out`): its rank, alpha, dropout and targets
    /// are its `adapter_config.json`'s, its matrices the start (the
    /// optimizer afresh).
    #[arg(long, conflicts_with = "lora_r")]
    lora_from: Option<PathBuf>,
}

/// The ids of `list`'s comma-separated tokens: each an id, or a token's
/// text in the tokenizer of the checkpoint `model`.
fn token_ids(model: &std::path::Path, list: &str) -> Result<Vec<i64>> {
    let mut tokenizer: Option<HfTokenizer> = None;
    let mut ids = Vec::new();
    for t in list.split(',') {
        if let Ok(id) = t.parse::<i64>() {
            ids.push(id);
            continue;
        }
        let k = match tokenizer.take() {
            Some(k) => k,
            None => HfTokenizer::open(model)?,
        };
        ids.push(i64::from(k.token_id(t)?));
        tokenizer = Some(k);
    }
    Ok(ids)
}

/// The file at `path`, mapped.
fn map(path: &std::path::Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the data and mask files are read, never written, while
    // mapped.
    unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))
}

/// The token ids of a data file, mapped (a corpus of billions of tokens
/// is read window by window, never whole into memory).
struct Tokens {
    bytes: memmap2::Mmap,
    /// Bytes an id takes: 2 (u16) or 4 (u32); 1 in a mask.
    width: usize,
}

impl Tokens {
    /// Maps `path` and checks every id is below `vocab` (one pass over
    /// the file, so that data tokenized for another model is refused
    /// before training, not at the step that first reads a bad id).
    fn open(path: &std::path::Path, wide: bool, vocab: i64) -> Result<Self> {
        let bytes = map(path)?;
        let width = if wide { 4 } else { 2 };
        if bytes.len() % width != 0 {
            bail!(
                "{}: {} bytes is not a whole number of {width}-byte token ids (is it {}?)",
                path.display(),
                bytes.len(),
                if wide {
                    "u16: drop --u32"
                } else {
                    "u32: pass --u32"
                }
            );
        }
        let t = Self { bytes, width };
        if let Some((i, id)) = (0..t.len())
            .map(|i| (i, t.id(i)))
            .find(|&(_, id)| id >= vocab)
        {
            bail!(
                "{}: token {i} is {id}, past the model's vocabulary of {vocab}: data tokenized for another model{}",
                path.display(),
                if wide { "" } else { " (or u32 ids read as u16: pass --u32)" }
            );
        }
        Ok(t)
    }

    /// Maps the mask file `path` of `data`'s tokens (`tokens` of them).
    fn mask(path: &std::path::Path, data: &std::path::Path, tokens: usize) -> Result<Self> {
        Self::bytes(
            path,
            data,
            tokens,
            "a mask has a byte a token (zrt tokenize --completion-only writes the two together)",
        )
    }

    /// Maps the file `path` of where `data`'s documents start.
    fn starts(path: &std::path::Path, data: &std::path::Path, tokens: usize) -> Result<Self> {
        Self::bytes(path, data, tokens, "a file of documents' starts has a byte a token (zrt tokenize --document-starts writes the two together)")
    }

    /// Maps `path`, a byte for each of `data`'s `tokens` (`what` says
    /// what it is when it has another length).
    fn bytes(
        path: &std::path::Path,
        data: &std::path::Path,
        tokens: usize,
        what: &str,
    ) -> Result<Self> {
        let bytes = map(path)?;
        if bytes.len() != tokens {
            bail!(
                "{}: {} bytes, and {} holds {tokens} tokens: {what}",
                path.display(),
                bytes.len(),
                data.display()
            );
        }
        Ok(Self { bytes, width: 1 })
    }

    /// How many ids it holds.
    fn len(&self) -> usize {
        self.bytes.len() / self.width
    }

    /// Id `i`.
    fn id(&self, i: usize) -> i64 {
        let c = &self.bytes[i * self.width..(i + 1) * self.width];
        match self.width {
            4 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
            2 => u16::from_le_bytes([c[0], c[1]]) as i64,
            _ => c[0] as i64,
        }
    }
}

/// The window of `len` tokens micro-batch `(step, micro, rank, row)`
/// starts at: a splitmix64 draw, the same for a run however it is
/// resumed.
fn window_start(key: [u64; 4], room: usize) -> usize {
    let mut z = key.iter().fold(0x9E37_79B9_7F4A_7C15u64, |h, &k| {
        (h ^ k).wrapping_mul(0xBF58_476D_1CE4_E5B9)
    });
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) % room as u64) as usize
}

fn main() -> Result<()> {
    zrt::init_logging();
    let a = Args::parse();
    // Counting what libtorch allocates (it begins before the model is
    // built: memory from before it is never counted).
    zrt::zero::glue::track_allocations()?;
    // Refused before anything is built, not after training.
    if a.max_shard_mb.is_nan() || a.max_shard_mb <= 0.0 {
        bail!(
            "--max-shard-mb {} is no file size: give a positive number of MB (5000 is 5 GB)",
            a.max_shard_mb
        );
    }
    if a.print_every == 0 {
        bail!("--print-every 0: give the number of steps between loss lines (1 for every step)");
    }
    if a.eval_windows == 0 {
        bail!("--eval-windows 0: give the windows each rank evaluates (8 by default)");
    }
    tch::set_num_threads(1);
    let mut dist = init_from_env().context("joining the job (start ranks with `zrt launch`)")?;
    let rank = dist.env().rank;
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    let lora = match (&a.lora_from, a.lora_r) {
        (Some(dir), _) => Some(LoraConfig::from_adapter_dir(dir)?),
        (None, Some(r)) => {
            let targets = match &a.lora_targets {
                Some(list) => list.split(',').map(str::to_string).collect(),
                None => zrt::lora::default_targets(&a.model)?,
            };
            Some(LoraConfig {
                dropout: a.lora_dropout,
                target_modules: targets,
                use_dora: a.lora_dora,
                modules_to_save: (a.lora_modules_to_save.iter())
                    .flat_map(|list| list.split(',').map(str::to_string))
                    .collect(),
                ensure_weight_tying: a.lora_modules_to_save.is_some(),
                trainable_token_indices: match (&a.lora_trainable_tokens, &a.lora_trainable_head_tokens) {
                    (Some(list), None) => token_ids(&a.model, list)?,
                    _ => Vec::new(),
                },
                trainable_tokens_modules: match &a.lora_trainable_head_tokens {
                    Some(head_list) => {
                        let (embedding, head) = zrt::lora::ends_names(&a.model)?;
                        let mut by_module = Vec::new();
                        if let Some(list) = &a.lora_trainable_tokens {
                            by_module.push((embedding, token_ids(&a.model, list)?));
                        }
                        by_module.push((head, token_ids(&a.model, head_list)?));
                        by_module
                    }
                    None => Vec::new(),
                },
                layers_to_transform: a.lora_layers.clone(),
                train_biases: match a.lora_bias.as_deref() {
                    Some("lora_only") => bail!(
                        "--lora-bias lora_only: PEFT 0.18 trains the adapted layers' biases, then leaves them out of its adapter file; give all (every bias trains and is written) or none"
                    ),
                    Some(b) => b == "all",
                    None => false,
                },
                lora_bias: a.lora_b_bias,
                target_parameters: a.lora_target_parameters.clone(),
                ..LoraConfig::new(r, a.lora_alpha, &[])
            })
        }
        (None, None) => None,
    };
    let adapters = lora.is_some();
    let options = HfOptions {
        checkpoint_activations: a.checkpoint_activations,
        lora,
    };
    // A LoRA model's adapters are drawn (rank 0's kept): from --seed.
    tch::manual_seed(a.seed);
    let (model, layout) = HfModel::from_pretrained_with(&vs, &plan, &a.model, &options)?;
    model.set_training(!a.no_dropout);
    model.set_fused_loss(!a.unfused_loss);
    if let Some(alpha) = a.neftune_alpha {
        model.set_neftune_alpha(alpha)?;
    }
    // The prompt's ids and what stops its continuation, read before
    // anything trains: a checkpoint without a tokenizer fails now.
    let prompt = match &a.prompt {
        Some(text) => {
            let tokenizer = HfTokenizer::open(&a.model)?;
            let ids = match a.chat {
                true => tokenizer.encode_chat(&[("user", text)])?,
                false => tokenizer.encode(text)?,
            };
            let ids: Vec<i64> = ids.into_iter().map(i64::from).collect();
            Some((text, tokenizer, ids, eos_token_ids(&a.model)?))
        }
        None => None,
    };
    // Packed windows' documents start where a file says, or after the
    // tokens that end one (read only when some data has no such file).
    let packed = a.packed_documents || a.documents.is_some() || a.eval_documents.is_some();
    let by_eos = a.documents.is_none() || (a.eval_data.is_some() && a.eval_documents.is_none());
    let eos = match packed && by_eos {
        true => Some(eos_token_ids(&a.model)?),
        false => None,
    };
    // A window's positions in its documents, when packed.
    let positions_of = |x: &Tensor, starts: Option<Tensor>| match (starts, &eos) {
        (Some(starts), _) => Some(positions_from_starts(&starts)),
        (None, Some(eos)) => Some(document_positions(x, eos)),
        (None, None) => None,
    };
    let loss_of = |x: &Tensor, mask: Option<Tensor>, starts: Option<Tensor>| -> Result<Tensor> {
        Ok(match (positions_of(x, starts), mask) {
            (Some(positions), mask) => model.loss_packed(x, &positions, mask.as_ref())?,
            // The loss over the completions' tokens only.
            (None, Some(mask)) => model.loss_masked(x, &mask),
            (None, None) => model.loss(x),
        })
    };
    let sampling = a.sampling.sampling(&a.model, a.seed as u64)?;
    tch::manual_seed(a.seed);
    let data = Tokens::open(&a.data, a.u32, model.vocab())?;
    let mask = match &a.mask {
        Some(path) => Some(Tokens::mask(path, &a.data, data.len())?),
        None => None,
    };
    let starts = match &a.documents {
        Some(path) => Some(Tokens::starts(path, &a.data, data.len())?),
        None => None,
    };
    let held_out = match &a.eval_data {
        Some(path) => {
            let t = Tokens::open(path, a.u32, model.vocab())?;
            if t.len() < a.seq + 1 {
                bail!(
                    "{} holds {} tokens: fewer than one window of --seq {} + 1",
                    path.display(),
                    t.len(),
                    a.seq
                );
            }
            let mask = match &a.eval_mask {
                Some(m) => Some(Tokens::mask(m, path, t.len())?),
                None => None,
            };
            let starts = match &a.eval_documents {
                Some(s) => Some(Tokens::starts(s, path, t.len())?),
                None => None,
            };
            Some((t, mask, starts))
        }
        None => None,
    };
    if data.len() <= a.seq + 1 {
        bail!(
            "{} holds {} tokens: fewer than one window of --seq {} + 1",
            a.data.display(),
            data.len(),
            a.seq
        );
    }
    let cfg = Config::from_file(&a.config)?;
    // Hugging Face's `"auto"` bucket sizes and thresholds derive from
    // the model's width, as its Trainer fills them in.
    let hints = AutoHints {
        hidden_size: Some(model.hidden_size() as u64),
        ..Default::default()
    };
    let engine = Engine::from_config(&vs, &plan, &cfg, &mut dist, &hints)?;
    if let Some(dir) = &a.lora_from {
        let n = zrt::lora::load_adapter(&engine, dir)?;
        if rank == 0 {
            println!("adapter: {} tensors from {}", n, dir.display());
        }
    }
    let batch = engine.config().batch;
    // Every rank's peak resident memory so far, in MiB, as a list.
    let world = dist.world();
    // Each rank's `bytes`, in MiB.
    let each_rank = |bytes: f64| -> Result<String> {
        let mine = vec![bytes / (1u64 << 20) as f64];
        let each = world.all_gather(mine, Vec::new()).wait()?.1;
        let each: Vec<String> = each.iter().map(|m| format!("{m:.0}")).collect();
        Ok(each.join(", "))
    };
    let peak_rss = || each_rank(zrt::peak_rss_bytes());
    let built = peak_rss()?;
    // libtorch's peak from here on is the training's: activations and
    // autograd's temporaries.
    zrt::zero::glue::reset_peak_allocated();
    if rank == 0 {
        println!(
            "zrt finetune_hf: {} ({:.2}M params) on {} ranks, ZeRO stage {}, {} tokens of data",
            a.model.display(),
            engine.num_params() as f64 / 1e6,
            dist.env().world_size,
            engine.config().config.zero.stage,
            data.len()
        );
        println!("built: peak RSS per rank (MiB): {built} (no rank holding the weights)");
        if let Some(path) = &a.mask {
            println!(
                "the loss counts the tokens {} marks (a completion's, not its prompt's)",
                path.display()
            );
        }
    }
    let room = data.len() - a.seq - 1;
    // Go on from the latest checkpoint, if the run was started before.
    let mut first = 0;
    if let Some(dir) = &a.save_dir {
        if let Some((tag, saved)) = engine.resume_from(dir)? {
            first = saved["steps"].as_u64().unwrap_or(engine.global_step());
            if rank == 0 {
                println!(
                    "resumed from {} (tag {tag}) after {first} steps",
                    dir.display()
                );
            }
        }
    }
    let save = |done: u64| -> Result<()> {
        if let Some(dir) = &a.save_dir {
            let state = serde_json::json!({ "steps": done });
            let path = engine.save_checkpoint_with(dir, &format!("step{done}"), &state)?;
            if rank == 0 {
                println!("checkpoint saved to {}", path.display());
            }
        }
        Ok(())
    };
    // The held-out windows' mean loss over every rank, in evaluation
    // (no dropout, no gradient: it draws nothing from the generator, so
    // training goes on as it would have without it).
    let len = a.seq + 1;
    let evaluate =
        |(held_out, mask, starts): &(Tokens, Option<Tokens>, Option<Tokens>)| -> Result<f64> {
            model.set_training(false);
            let whole = held_out.len() / len;
            let windows: Vec<usize> = (0..a.eval_windows)
                .map(|i| (rank * a.eval_windows + i) % whole)
                .collect();
            let mut sum = 0.0;
            for chunk in windows.chunks(batch.micro.max(1) as usize) {
                let rows = |file: &Tokens| {
                    let ids: Vec<i64> = (chunk.iter())
                        .flat_map(|&w| (w * len..(w + 1) * len).map(|i| file.id(i)))
                        .collect();
                    Tensor::from_slice(&ids).view([chunk.len() as i64, len as i64])
                };
                let x = rows(held_out);
                let (mask, starts) = (mask.as_ref().map(rows), starts.as_ref().map(rows));
                let loss = tch::no_grad(|| loss_of(&x, mask, starts))?;
                let loss = loss.to_kind(Kind::Double);
                sum += loss.double_value(&[]) * chunk.len() as f64;
            }
            model.set_training(!a.no_dropout);
            let mine = vec![sum / a.eval_windows as f64];
            let each = world.all_gather(mine, Vec::new()).wait()?.1;
            Ok(each.iter().sum::<f64>() / each.len() as f64)
        };
    let eval_at = |done: u64| -> Result<()> {
        if let Some(held_out) = &held_out {
            let loss = evaluate(held_out)?;
            engine.pending_error()?;
            if rank == 0 {
                println!(
                    "eval  after {done:>5} steps  loss {loss:.6}  ppl {:.3}",
                    loss.exp()
                );
            }
        }
        Ok(())
    };
    // The prompt's continuation, greedy or sampled (every rank computes
    // it: each forward gathers the parameters with all of them; sampled
    // alike from one seed), which the first rank prints.
    let sample_at = |done: u64| -> Result<()> {
        if let Some((text, tokenizer, ids, stop)) = &prompt {
            let new = match &sampling {
                Some(s) => model.sample(ids, a.sample_tokens, stop, s)?,
                None => model.greedy(ids, a.sample_tokens, stop)?,
            };
            // Forwards alone (as the evaluation's): a failed gather
            // would leave zeros, not an error, in them.
            engine.pending_error()?;
            if rank == 0 {
                let new: Vec<u32> = new.iter().map(|&id| id as u32).collect();
                let continued = tokenizer.decode(&new)?;
                println!("sample after {done:>5} steps  {text:?} -> {continued:?}");
            }
        }
        Ok(())
    };
    if first < a.steps {
        eval_at(first)?;
        sample_at(first)?;
    }
    // Each step's windows are drawn from its number: a resumed run reads
    // what the run it goes on from would have read.
    for step in first..a.steps {
        // The step's micro-batches, each with its windows' documents (when
        // packed) and the predictions its loss counts.
        let mut micro_batches = Vec::with_capacity(batch.gas as usize);
        for micro in 0..batch.gas {
            // The micro-batch's windows of a file of `data`'s length.
            let windows = |file: &Tokens| -> Tensor {
                let ids: Vec<i64> = (0..batch.micro)
                    .flat_map(|row| {
                        let at = window_start([step, micro, rank as u64, row], room);
                        (at..at + a.seq + 1).map(|i| file.id(i))
                    })
                    .collect();
                Tensor::from_slice(&ids).view([batch.micro as i64, a.seq as i64 + 1])
            };
            let x = windows(&data);
            let positions = positions_of(&x, starts.as_ref().map(windows));
            let mask = mask.as_ref().map(windows);
            let counted = counted_targets(&x, positions.as_ref(), mask.as_ref());
            micro_batches.push((x, positions, counted));
        }
        // Every counted token of the step weighs alike, however the
        // micro-batches and ranks share them: each micro-batch's sum over
        // the step's count (transformers' Trainer, `num_items_in_batch`
        // counted across devices), times what the engine divides by (the
        // ranks it averages over, the micro-steps).
        let mine: f64 = (micro_batches.iter())
            .map(|(_, _, c)| c.sum(Kind::Int64).int64_value(&[]) as f64)
            .sum();
        let items = world.all_reduce(vec![mine], ReduceOp::Sum).wait()?[0];
        let per = items_per_micro_step(items, world.size(), batch.gas);
        let (mut loss_sum, mut aux_sum) = (0.0, 0.0);
        for (x, positions, counted) in &micro_batches {
            let lm = model.loss_over(x, positions.as_ref(), counted, per)?;
            let lm_value = lm.to_kind(Kind::Double).double_value(&[]);
            loss_sum += lm_value * per;
            // The auxiliary losses the config asks for (the routers'
            // load-balancing loss, Bamba's z-loss) join each
            // micro-batch's loss, averaged as the engine averages them:
            // printed apart from the language model's.
            let loss = model.plus_aux_losses(lm);
            aux_sum += loss.to_kind(Kind::Double).double_value(&[]) - lm_value;
            engine.backward(&loss)?;
            engine.step()?;
        }
        if step % a.print_every == 0 || step + 1 == a.steps {
            // The step's loss over every counted token of every rank.
            let all = world
                .all_reduce(vec![loss_sum, aux_sum], ReduceOp::Sum)
                .wait()?;
            let mean = all[0] / items.max(1.0);
            // The auxiliary terms' mean over the step's micro-batches.
            let aux = match all[1] {
                0.0 => String::new(),
                sum => format!(
                    "  aux {:.6}",
                    sum / (world.size() as f64 * batch.gas as f64)
                ),
            };
            if rank == 0 {
                println!(
                    "step {step:>5}  loss {mean:.6}{aux}  lr {:.3e}",
                    engine.lr()
                );
            }
        }
        let done = step + 1;
        if a.eval_every > 0 && done % a.eval_every == 0 && done < a.steps {
            eval_at(done)?;
        }
        if a.save_every > 0 && done % a.save_every == 0 && done < a.steps {
            save(done)?;
        }
    }
    if first < a.steps {
        eval_at(a.steps)?;
        sample_at(a.steps)?;
        save(a.steps)?;
    }
    let trained = peak_rss()?;
    let torch = each_rank(zrt::zero::glue::allocated().peak as f64)?;
    // What the engine holds, beside the peak: the model state it
    // allocated and the gather and reduction buffers it keeps for reuse.
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let (state, pooled) = (mib(engine.model_state_bytes()?), mib(engine.pooled_bytes()));
    if rank == 0 {
        println!("trained: peak RSS per rank (MiB): {trained}; on rank 0 now: model state {state:.0} MiB, pooled buffers {pooled:.0} MiB");
        println!("libtorch's peak per rank (MiB): {torch} (activations and autograd's temporaries; the model state is the engine's own memory)");
    }
    match (&a.out, adapters) {
        (Some(out), true) => {
            std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
            let file = out.join(zrt::lora::ADAPTER_FILE);
            engine.save_16bit_model_as(&file, None, &layout)?;
            if rank == 0 {
                println!(
                    "wrote {} (peft: PeftModel.from_pretrained(base, it))",
                    out.display()
                );
            }
        }
        (Some(out), false) => {
            let max = (a.max_shard_mb * 1e6) as u64;
            engine.save_16bit_model_as(out, Some(max), &layout)?;
            if rank == 0 {
                println!(
                    "wrote {} (transformers: from_pretrained on it)",
                    out.display()
                );
            }
        }
        (None, _) => {}
    }
    Ok(())
}

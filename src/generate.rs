//! Continuing a prompt with a [`HfModel`]: greedy decoding
//! ([`HfModel::greedy`]) and sampling ([`HfModel::sample`]), as
//! `transformers`' `generate` computes them. Every layout's layers keep
//! each token's keys and values (a key-value cache:
//! each new token costs a forward over itself, attending to the cache),
//! but where rotary frequencies change with the length within the
//! generation (`dynamic` past `max_position_embeddings`, LongRoPE past
//! its original length), which runs as `generate(use_cache=False)` does,
//! a full forward for each new token.
//!
//! Sampling draws from the distribution `transformers`' logits
//! processors give (repetition penalty, temperature, top-k, top-p, in
//! its order, on fp32 logits), with a generator of its own seeded by
//! [`Sampling::seed`]: every rank that samples with the same seed draws
//! the same tokens, and the draws never touch libtorch's generator, so
//! a sample in the middle of a training run leaves its dropout masks as
//! they were. The draws are not `torch.multinomial`'s: the same seed
//! gives other tokens than `transformers` does, from the same
//! distribution ([`Sampling::distribution`] is tested against its
//! processors).

use std::path::Path;

use tch::{Kind, Tensor};

use crate::hf::{HfError, HfJson, HfModel};

/// How [`HfModel::sample`] picks each next token: `transformers`'
/// `GenerationConfig` fields of the same names.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// The logits are divided by it (1: as they are; higher: flatter).
    pub temperature: f64,
    /// Only the `top_k` most likely tokens (and those tied with the
    /// last of them) are drawn from; 0 turns it off.
    pub top_k: usize,
    /// Only the most likely tokens whose probabilities add up to
    /// `top_p` are drawn from (nucleus sampling; at least one); 1 turns
    /// it off.
    pub top_p: f64,
    /// A token already in the sequence has its logit divided by it
    /// (multiplied when negative); 1 turns it off.
    pub repetition_penalty: f64,
    /// The draws' seed.
    pub seed: u64,
}

impl Default for Sampling {
    /// `GenerationConfig`'s defaults: temperature 1, top-k 50, top-p 1,
    /// no repetition penalty; seed 0.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

/// `generation_config.json` fields that change what `transformers`
/// samples from, which zrt does not compute, and the value that turns
/// each off.
const NOT_COMPUTED: &[(&str, Option<f64>)] = &[
    ("min_p", None),
    ("typical_p", Some(1.0)),
    ("epsilon_cutoff", Some(0.0)),
    ("eta_cutoff", Some(0.0)),
    ("no_repeat_ngram_size", Some(0.0)),
    ("encoder_repetition_penalty", Some(1.0)),
    ("min_length", Some(0.0)),
    ("min_new_tokens", None),
    ("bad_words_ids", None),
    ("suppress_tokens", None),
    ("begin_suppress_tokens", None),
    ("sequence_bias", None),
    ("forced_bos_token_id", None),
    ("forced_eos_token_id", None),
    ("exponential_decay_length_penalty", None),
];

impl Sampling {
    /// The settings of the checkpoint in `dir`: its
    /// `generation_config.json`'s `temperature`, `top_k`, `top_p` and
    /// `repetition_penalty`, each `GenerationConfig`'s default when left
    /// out and off when null (`None` there), all of them defaults without
    /// the file (seed 0: set
    /// [`Sampling::seed`]). A file asking for what zrt does not sample
    /// with (`min_p`, `no_repeat_ngram_size`, ...) is refused naming the
    /// field, not sampled from otherwise.
    pub fn from_generation_config(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        let path = dir.as_ref().join("generation_config.json");
        let mut s = Self::default();
        if !path.is_file() {
            return Ok(s);
        }
        let j = HfJson::read(&path, None)?;
        for &(key, off) in NOT_COMPUTED {
            let Some(v) = j.get(key) else { continue };
            if off.is_none() || v.as_f64() != off {
                return Err(j.field(format!(
                    "{key} {v}: zrt samples with temperature, top_k, top_p and repetition_penalty only (remove it to sample without it)"
                )));
            }
        }
        // Left out, `GenerationConfig`'s default; null (`None` there),
        // the processor off.
        let off = |key: &str| j.has(key) && j.get(key).is_none();
        // A float processor off is its neutral value, 1.0.
        let float = |key: &str, default: f64| match off(key) {
            true => Ok(1.0),
            false => j.number_or(key, default),
        };
        s.temperature = float("temperature", s.temperature)?;
        s.top_k = match j.get("top_k") {
            None if off("top_k") => 0,
            None => s.top_k,
            Some(v) => (v.as_u64())
                .and_then(|k| usize::try_from(k).ok())
                .ok_or_else(|| j.field(format!("top_k {v}: a number of tokens, or 0")))?,
        };
        s.top_p = float("top_p", s.top_p)?;
        s.repetition_penalty = float("repetition_penalty", s.repetition_penalty)?;
        s.check().map_err(|e| j.field(e.to_string()))?;
        Ok(s)
    }

    /// Refuses settings `transformers` refuses too.
    fn check(&self) -> Result<(), HfError> {
        let bad = |what: String| Err(HfError::Sampling(what));
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "temperature {}: a positive number (greedy decoding is HfModel::greedy)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {}: a share in (0, 1]", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty {}: a positive number (1: none)",
                self.repetition_penalty
            ));
        }
        Ok(())
    }

    /// The next token's probabilities `[1, vocab]` (fp32) after a
    /// sequence `ids` whose last position's logits are `logits` `[1,
    /// vocab]`: `transformers`' processors in its order (repetition
    /// penalty, temperature, top-k, top-p, each when on), then a softmax.
    pub fn distribution(&self, logits: &Tensor, ids: &[i64]) -> Result<Tensor, HfError> {
        self.check()?;
        let vocab = match logits.size()[..] {
            [1, v] if v > 0 => v,
            ref shape => {
                return Err(HfError::Sampling(format!(
                    "logits of shape {shape:?}: give one row, [1, vocab]"
                )))
            }
        };
        if let Some(id) = ids.iter().find(|&&id| !(0..vocab).contains(&id)) {
            return Err(HfError::Sampling(format!(
                "token {id} of the sequence is not an id of the {vocab} logits"
            )));
        }
        let mut scores = logits.to_kind(Kind::Float);
        if self.repetition_penalty != 1.0 && !ids.is_empty() {
            let seen = Tensor::from_slice(ids)
                .view([1, -1])
                .to_device(scores.device());
            let score = scores.gather(1, &seen, false);
            let lowered = (&score * self.repetition_penalty)
                .where_self(&score.lt(0.0), &(&score / self.repetition_penalty));
            scores = scores.scatter(1, &seen, &lowered);
        }
        if self.temperature != 1.0 {
            // Not in place: `scores` may be the caller's `logits` itself.
            scores = scores.divide_scalar(self.temperature);
        }
        if self.top_k != 0 {
            let k = (self.top_k as i64).min(vocab);
            let kth = scores.topk(k, -1, true, true).0.narrow(-1, k - 1, 1);
            scores = scores.masked_fill(&scores.lt_tensor(&kth), f64::NEG_INFINITY);
        }
        if self.top_p < 1.0 {
            let (sorted, order) = scores.sort(-1, false);
            let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
            let drop = cumulative.le(1.0 - self.top_p);
            // The most likely token stays.
            let _ = drop.narrow(-1, vocab - 1, 1).fill_(0);
            let drop = drop.scatter(1, &order, &drop);
            scores = scores.masked_fill(&drop, f64::NEG_INFINITY);
        }
        Ok(scores.softmax(-1, Kind::Float))
    }
}

/// Command-line options choosing between greedy decoding and sampling
/// (`--do-sample`, `--temperature`, `--top-k`, `--top-p`), as
/// `zrt generate` and `examples/finetune_hf.rs` take them (flatten them
/// into a clap parser).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Sample (`generate(do_sample=True)`) rather than decode greedily:
    /// with the checkpoint's `generation_config.json` settings
    /// (temperature, top-k, top-p, repetition penalty; `transformers`'
    /// defaults without it), those below overriding them.
    #[arg(long)]
    pub do_sample: bool,
    /// With `--do-sample`: the logits' temperature.
    #[arg(long, requires = "do_sample")]
    pub temperature: Option<f64>,
    /// With `--do-sample`: draw from the K most likely tokens (0: all).
    #[arg(long, requires = "do_sample")]
    pub top_k: Option<usize>,
    /// With `--do-sample`: draw from the most likely tokens holding this
    /// share of the probability (1: all).
    #[arg(long, requires = "do_sample")]
    pub top_p: Option<f64>,
}

impl SamplingArgs {
    /// `None` for greedy decoding; with `--do-sample`, the settings of
    /// the checkpoint in `dir` ([`Sampling::from_generation_config`])
    /// with the options' overrides, drawn from `seed`.
    pub fn sampling(&self, dir: impl AsRef<Path>, seed: u64) -> Result<Option<Sampling>, HfError> {
        if !self.do_sample {
            return Ok(None);
        }
        let mut s = Sampling::from_generation_config(dir)?;
        s.temperature = self.temperature.unwrap_or(s.temperature);
        s.top_k = self.top_k.unwrap_or(s.top_k);
        s.top_p = self.top_p.unwrap_or(s.top_p);
        s.seed = seed;
        s.check()?;
        Ok(Some(s))
    }
}

/// SplitMix64: a small, well-mixed generator, enough to draw a token a
/// step; one per [`HfModel::sample`] call.
struct SplitMix64(u64);

impl SplitMix64 {
    /// A uniform draw in [0, 1), of 53 bits.
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The token a uniform `u` in [0, 1) picks from probabilities `probs`:
/// the first whose running sum passes `u` times their total (never one
/// of probability 0).
fn pick(probs: &[f32], u: f64) -> usize {
    let total: f64 = probs.iter().map(|&p| p as f64).sum();
    let target = u * total;
    let mut sum = 0.0;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p <= 0.0 {
            continue;
        }
        sum += p as f64;
        last = i;
        if sum > target {
            return i;
        }
    }
    last
}

impl HfModel {
    /// Its layers' key-value caches.
    fn decoding(&self) -> &crate::kv_cache::Decoding {
        match self {
            Self::Gpt2(m) => m.decoding(),
            Self::GptNeox(m) => m.decoding(),
            Self::Phi(m) => m.decoding(),
            Self::Llama(m) => m.decoding(),
        }
    }

    /// Greedy decoding, as `transformers`' `generate(do_sample=False,
    /// use_cache=False)` computes it: up to `max_new` times, the logits
    /// of the whole sequence so far, and the last position's largest
    /// (the first of equals, in fp32) appended; it stops after a token of
    /// `stop` (the model's `eos_token_id`s, say), which ends the result.
    /// Returns the new tokens. Dropout is off while it runs (and as it
    /// was after). The `k`-th token costs a forward over itself with a
    /// key-value cache (see the [module](crate::generate)'s doc), or,
    /// when the prompt and `max_new` tokens could outgrow the length a
    /// `dynamic` or LongRoPE rotary embedding keeps its frequencies for,
    /// a forward over the prompt and the `k - 1` before it.
    ///
    /// At stage 3 each forward gathers the parameters with every rank:
    /// call it on every rank with the same prompt (the same tokens
    /// follow, and every rank stops together), or with no `stop` (every
    /// rank runs `max_new` forwards), and then
    /// [`Engine::pending_error`](crate::zero::Engine::pending_error): a
    /// gather that failed (a rank gone) leaves zeros, not an error, in
    /// the forward. A prompt that is empty, holds an id
    /// past the vocabulary or would outgrow GPT-2's `n_positions` is
    /// refused before any forward, on every rank alike.
    pub fn greedy(
        &self,
        prompt: &[i64],
        max_new: usize,
        stop: &[i64],
    ) -> Result<Vec<i64>, HfError> {
        self.continued(prompt, max_new, stop, |last, _| {
            Ok(last.argmax(-1, false).int64_value(&[0]))
        })
    }

    /// Sampling, as `transformers`' `generate(do_sample=True,
    /// use_cache=False)` does with `sampling`'s settings
    /// ([`Sampling::from_generation_config`] reads a checkpoint's): each
    /// new token drawn from [`Sampling::distribution`] of the last
    /// position's logits, with a generator seeded by `sampling.seed` (see
    /// the [module](crate::generate)'s doc). Otherwise as
    /// [`HfModel::greedy`]: the same refusals and cache, every rank
    /// calls it at stage 3, with the same prompt and seed (so that every
    /// rank draws the same tokens and stops together).
    pub fn sample(
        &self,
        prompt: &[i64],
        max_new: usize,
        stop: &[i64],
        sampling: &Sampling,
    ) -> Result<Vec<i64>, HfError> {
        sampling.check()?;
        let mut draws = SplitMix64(sampling.seed);
        self.continued(prompt, max_new, stop, |last, ids| {
            let probs = sampling.distribution(last, ids)?;
            let probs = Vec::<f32>::try_from(probs.flatten(0, -1))
                .map_err(|e| HfError::Sampling(format!("reading the probabilities: {e}")))?;
            Ok(pick(&probs, draws.uniform()) as i64)
        })
    }

    /// Up to `max_new` tokens after `prompt`, each the one `next` picks
    /// from the last position's fp32 logits `[1, vocab]` and the ids so
    /// far, stopping after one of `stop`; dropout off meanwhile.
    fn continued(
        &self,
        prompt: &[i64],
        max_new: usize,
        stop: &[i64],
        mut next: impl FnMut(&Tensor, &[i64]) -> Result<i64, HfError>,
    ) -> Result<Vec<i64>, HfError> {
        let vocab = self.vocab();
        if prompt.is_empty() {
            return Err(HfError::Prompt(
                "it is empty: give at least one token".into(),
            ));
        }
        if let Some(id) = prompt.iter().find(|&&id| !(0..vocab).contains(&id)) {
            return Err(HfError::Prompt(format!(
                "token {id} is not an id of the model's vocabulary (0 to {})",
                vocab - 1
            )));
        }
        if let Self::Gpt2(m) = self {
            let longest = m.config().positions;
            if (prompt.len() + max_new) as i64 > longest {
                return Err(HfError::Prompt(format!(
                    "{} tokens and {max_new} new ones are more than GPT-2's n_positions {longest}: shorten the prompt or ask for fewer",
                    prompt.len()
                )));
            }
        }
        let was = self.is_training();
        self.set_training(false);
        let mut ids = prompt.to_vec();
        // The layers keep each token's keys and values: a forward takes
        // the tokens after those it ran.
        let cached = self.decoding().start((prompt.len() + max_new) as i64);
        let mut fed = 0;
        let done = tch::no_grad(|| {
            for _ in 0..max_new {
                let x = Tensor::from_slice(&ids[fed..]).view([1, -1]);
                if cached {
                    fed = ids.len();
                }
                let last = self.forward(&x).select(1, -1).to_kind(Kind::Float);
                let token = next(&last, &ids)?;
                ids.push(token);
                if stop.contains(&token) {
                    break;
                }
            }
            Ok(())
        });
        self.decoding().end();
        self.set_training(was);
        done.map(|()| ids.split_off(prompt.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draw_never_picks_a_token_of_probability_zero_and_follows_the_running_sum() {
        let probs = [0.0, 0.25, 0.0, 0.5, 0.25, 0.0];
        for (u, want) in [
            (0.0, 1),
            (0.2499, 1),
            (0.25, 3),
            (0.7499, 3),
            (0.75, 4),
            (0.999_999, 4),
        ] {
            assert_eq!(pick(&probs, u), want, "u {u}");
        }
        // Each draw is in [0, 1), and a seed gives its stream again.
        let (mut a, mut b) = (SplitMix64(7), SplitMix64(7));
        for _ in 0..1000 {
            let u = a.uniform();
            assert!((0.0..1.0).contains(&u) && u == b.uniform());
        }
        assert_ne!(SplitMix64(7).uniform(), SplitMix64(8).uniform());
    }

    #[test]
    fn settings_transformers_refuses_are_refused() {
        let logits = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).view([1, 3]);
        for (s, says) in [
            (
                Sampling {
                    temperature: 0.0,
                    ..Default::default()
                },
                "temperature 0",
            ),
            (
                Sampling {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p 0",
            ),
            (
                Sampling {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p 1.5",
            ),
            (
                Sampling {
                    repetition_penalty: -1.0,
                    ..Default::default()
                },
                "repetition_penalty -1",
            ),
        ] {
            let err = s.distribution(&logits, &[]).unwrap_err().to_string();
            assert!(
                err.starts_with("cannot sample: ") && err.contains(says),
                "{err}"
            );
        }
        // Logits of another shape, and a sequence's id past them, are
        // refused, not a libtorch panic.
        let s = Sampling {
            repetition_penalty: 1.2,
            ..Default::default()
        };
        for (logits, ids, says) in [
            (logits.view([3]), vec![], "logits of shape [3]"),
            (logits.view([3, 1]), vec![], "logits of shape [3, 1]"),
            (
                logits.shallow_clone(),
                vec![0, 3],
                "token 3 of the sequence",
            ),
        ] {
            let err = s.distribution(&logits, &ids).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }
}

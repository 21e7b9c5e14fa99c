//! Text to the flat token files the examples train on, with a
//! checkpoint's own tokenizer: no Python in the loop.
//!
//! [`tokenize_files`] reads a Hugging Face fast tokenizer (`tokenizer.json`,
//! what `AutoTokenizer.save_pretrained` writes beside a checkpoint) with
//! the Rust library under Python's `tokenizers`, and writes one flat file
//! of little-endian token ids, `u16` (nanoGPT's `train.bin`) or `u32`,
//! which `examples/finetune_hf.rs` reads. Each document becomes the ids
//! `tokenizer(text)["input_ids"]` gives in Python (the tokenizer's special
//! tokens added, a Llama's `<s>` or `<|begin_of_text|>` before it; no
//! truncation, whatever the file says), and with
//! [`TokenizeOptions::eos`] its end-of-text token after it (nanoGPT's
//! convention); the documents follow one another, as `run_clm.py`
//! concatenates them before cutting windows.
//!
//! A document is a whole `.txt` file, or the `text` field (or
//! [`TokenizeOptions::field`]) of each line of a `.jsonl` file (a
//! dataset's dump: `Dataset.to_json`). The file is written beside its
//! name and renamed into place at the end, so an error leaves no file
//! half written.
//!
//! With [`TokenizeOptions::completion_only`] each `.jsonl` line is TRL's
//! `prompt` and `completion`, and a mask file beside the ids
//! ([`mask_path`]) marks the completion's tokens, the only ones
//! [`HfModel::loss_masked`](crate::hf::HfModel::loss_masked) counts.
//!
//! Conversations are TRL's conversational formats: a line whose
//! `messages` is a list of `{"role", "content"}` messages (when it has no
//! text field), or, completion-only, whose `prompt` and `completion` are
//! such lists. They are rendered with the tokenizer's chat template
//! ([`crate::chat_template`]) and their ids are those
//! `apply_chat_template(..., tools=..., tokenize=True)` gives (`tools`,
//! the line's, TRL's column of function schemas): the template writes
//! the special tokens, none is added, and `eos` adds no end-of-text token
//! after them (the template ends each turn; TRL adds none either). A
//! conversational prompt is rendered with the assistant's turn opened
//! (`add_generation_prompt=True`), the completion is what the whole
//! conversation adds to it. With [`TokenizeOptions::assistant_only`] the
//! mask marks what the template's `{% generation %}` blocks rendered (the
//! assistant's turns: `return_assistant_tokens_mask`, TRL's
//! `assistant_only_loss`).
//! [`HfTokenizer`] is the tokenizer alone: encode a prompt, decode what
//! [`HfModel::greedy`](crate::hf::HfModel::greedy) continued it with.
//!
//! ```no_run
//! use zrt::tokenize::{tokenize_files, TokenizeOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let opts = TokenizeOptions { eos: true, ..TokenizeOptions::default() };
//! let done = tokenize_files("llama".as_ref(), &["corpus.jsonl".into()], "train.bin".as_ref(), &opts)?;
//! println!("{} documents, {} tokens", done.documents, done.tokens);
//! # Ok(()) }
//! ```

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use minijinja::value::ValueKind;
use tokenizers::{Encoding, Tokenizer};

use crate::chat_template::{token_text, tokenizer_config, ChatTemplate, Ending, Extras};

/// Documents encoded at a time from a `.jsonl` file (in parallel, on
/// `tokenizers`' threads): enough to keep two cores busy, few enough
/// that a batch's text and ids stay small.
const BATCH: usize = 1024;

/// How [`tokenize_files`] writes its documents.
#[derive(Debug, Clone)]
pub struct TokenizeOptions {
    /// `u32` ids (a vocabulary past 65536 needs them), not `u16`.
    pub u32: bool,
    /// The tokenizer's end-of-text token after each document
    /// (`tokenizer_config.json`'s `eos_token`), but a conversation, which
    /// its chat template ends.
    pub eos: bool,
    /// The field of a `.jsonl` line holding its text.
    pub field: String,
    /// Each `.jsonl` line is a `prompt` and its `completion` (TRL's
    /// prompt-completion format): the document is their concatenation,
    /// and a mask file beside the output ([`mask_path`]) says which
    /// tokens the loss counts (1: the completion's and the end-of-text
    /// token; 0: the prompt's, `tokenizer(prompt)`'s many first ones),
    /// TRL's `completion_only_loss`. Conversational lines' `prompt` and
    /// `completion` are lists of messages (the module docs).
    pub completion_only: bool,
    /// Each `.jsonl` line is a conversation (`messages`), and the mask
    /// file marks the tokens its chat template's `{% generation %}`
    /// blocks rendered, the assistant's turns (TRL's
    /// `assistant_only_loss`); a template without such blocks is refused.
    pub assistant_only: bool,
    /// A file beside the output ([`documents_path`]) marks each
    /// document's first token (a byte a token, 1 there, 0 elsewhere), for
    /// training on packed documents ([`crate::packing`]) whose ends no
    /// token id tells: a chat template ends every turn with the token
    /// that may end the conversation too.
    pub document_starts: bool,
}

impl Default for TokenizeOptions {
    fn default() -> Self {
        Self {
            u32: false,
            eos: false,
            field: "text".into(),
            completion_only: false,
            assistant_only: false,
            document_starts: false,
        }
    }
}

impl TokenizeOptions {
    /// Whether a mask file is written.
    fn masked(&self) -> bool {
        self.completion_only || self.assistant_only
    }
}

/// Where a completion-only output's mask goes: `out` with `.mask`
/// added (`train.bin.mask`), one byte a token.
pub fn mask_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".mask");
    PathBuf::from(name)
}

/// Where the file of documents' first tokens goes
/// ([`TokenizeOptions::document_starts`]): `out` with `.docs` added
/// (`train.bin.docs`), one byte a token.
pub fn documents_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".docs");
    PathBuf::from(name)
}

/// What [`tokenize_files`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// Documents read.
    pub documents: u64,
    /// Token ids written.
    pub tokens: u64,
    /// The largest id the tokenizer gives, plus one: the vocabulary a
    /// model reading the file needs.
    pub vocab: u64,
    /// Completion- or assistant-only: the tokens the mask counts.
    pub counted: u64,
    /// Completion-only: the documents whose tokens do not begin with
    /// their prompt's (the tokenizer merged across the seam); their
    /// mask still leaves out as many tokens as the prompt has, as TRL's.
    pub merged_seams: u64,
}

/// Why [`tokenize_files`] wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The tokenizer could not be read.
    #[error("{path}: {msg}")]
    Tokenizer {
        /// The file or directory given.
        path: PathBuf,
        /// What went wrong, and the fix.
        msg: String,
    },
    /// The ids do not fit in `u16`.
    #[error("the tokenizer's ids go up to {}, past u16's 65535: pass --u32 (TokenizeOptions::u32), and --u32 to the program reading the file", vocab - 1)]
    TooWide {
        /// The largest id plus one.
        vocab: u64,
    },
    /// An input or output file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// An input is neither `.txt` nor `.jsonl`, or a line of it is not
    /// what it must be.
    #[error("{path}{}: {msg}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Input {
        /// The file.
        path: PathBuf,
        /// The line (from 1) of a `.jsonl` file.
        line: Option<u64>,
        /// What is wrong, and the fix.
        msg: String,
    },
}

/// Tokenizes `inputs` (`.txt` files, one document each, and `.jsonl`
/// files, one a line) with the tokenizer at `tokenizer` (a directory
/// holding `tokenizer.json`, or the file) into `out`, as the module
/// docs say.
pub fn tokenize_files(
    tokenizer: &Path,
    inputs: &[PathBuf],
    out: &Path,
    opts: &TokenizeOptions,
) -> Result<Tokenized, TokenizeError> {
    let tok = HfTokenizer::open(tokenizer)?;
    let eos = match opts.eos {
        true => Some(tok.eos().map_err(|e| match e {
            TokenizeError::Tokenizer { path, msg } => TokenizeError::Tokenizer {
                path,
                msg: format!("{msg} (--eos asks for it; leave it out for none)"),
            },
            e => e,
        })?),
        false => None,
    };
    if !opts.u32 && tok.vocab > 1 << 16 {
        return Err(TokenizeError::TooWide { vocab: tok.vocab });
    }
    if opts.completion_only && opts.assistant_only {
        return Err(TokenizeError::Input {
            path: out.to_path_buf(),
            line: None,
            msg: "completion-only and assistant-only masks are two ways to choose what the loss counts: pass one".into(),
        });
    }
    // Every input checked before anything is read: a typo fails at once.
    for path in inputs {
        if let (Kind::Text, true) = (kind(path)?, opts.masked()) {
            let msg = match opts.completion_only {
                true => "a .txt file is one document without a prompt: completion-only tokenizing reads .jsonl lines holding \"prompt\" and \"completion\"",
                false => "a .txt file is one document, not a conversation: assistant-only tokenizing reads .jsonl lines holding \"messages\"",
            };
            return Err(TokenizeError::Input {
                path: path.to_path_buf(),
                line: None,
                msg: msg.into(),
            });
        }
        std::fs::metadata(path).map_err(io(path))?;
    }
    // The chat template is read when the first conversation needs it
    // (a broken one does not stop text from tokenizing); assistant-only
    // needs it at once.
    let mut template = Template::Unread;
    if opts.assistant_only {
        let t = template.get(&tok)?.ok_or_else(|| TokenizeError::Tokenizer {
            path: tokenizer.to_path_buf(),
            msg: "no chat template (chat_template.jinja, or tokenizer_config.json's chat_template): assistant-only masks are what its {% generation %} blocks render".into(),
        })?;
        if !t.marks_generation() {
            return Err(TokenizeError::Tokenizer {
                path: t.path().to_path_buf(),
                msg: "the chat template has no {% generation %} blocks, which mark the assistant's text an assistant-only mask counts: add them around each assistant turn (as TRL's assistant_only_loss asks), or use --completion-only with prompt/completion lines".into(),
            });
        }
    }
    let hidden = |path: &Path| {
        path.with_file_name(format!(
            ".{}.partial",
            (path.file_name()).map_or("out".into(), |n| n.to_string_lossy())
        ))
    };
    let mut files = vec![(hidden(out), out.to_path_buf())];
    if opts.masked() {
        files.push((hidden(&mask_path(out)), mask_path(out)));
    }
    if opts.document_starts {
        files.push((hidden(&documents_path(out)), documents_path(out)));
    }
    let wrote = write(&tok, &mut template, eos, inputs, &files, opts);
    if wrote.is_err() {
        for (partial, _) in &files {
            let _ = std::fs::remove_file(partial);
        }
    }
    wrote
}

/// Writes `inputs`' ids (and, completion- or assistant-only, their
/// mask) into `files`' hidden names, and renames them into place.
fn write(
    tok: &HfTokenizer,
    template: &mut Template,
    eos: Option<u32>,
    inputs: &[PathBuf],
    files: &[(PathBuf, PathBuf)],
    opts: &TokenizeOptions,
) -> Result<Tokenized, TokenizeError> {
    let mut outs = Vec::new();
    for (partial, _) in files {
        outs.push(BufWriter::new(File::create(partial).map_err(io(partial))?));
    }
    let mut writer = Writer {
        outs,
        paths: files.iter().map(|f| f.0.clone()).collect(),
        wide: opts.u32,
        masked: opts.masked(),
        starts: opts.document_starts,
        done: Tokenized {
            documents: 0,
            tokens: 0,
            vocab: tok.vocab,
            counted: 0,
            merged_seams: 0,
        },
    };
    let fields = match (opts.completion_only, opts.assistant_only) {
        (true, _) => Fields::PromptCompletion,
        (false, true) => Fields::Messages,
        (false, false) => Fields::Text(&opts.field),
    };
    for path in inputs {
        match kind(path)? {
            // Not under completion- or assistant-only (refused before).
            Kind::Text => {
                let text = std::fs::read_to_string(path).map_err(io(path))?;
                let doc = Doc {
                    text,
                    chat: false,
                    counted: Counted::All,
                };
                writer.documents(tok, eos, path, vec![doc])?;
            }
            Kind::Lines => each_batch(path, &fields, tok, template, |docs| {
                writer.documents(tok, eos, path, docs)
            })?,
        }
    }
    for (out, path) in writer.outs.iter_mut().zip(&writer.paths) {
        out.flush().map_err(io(path))?;
    }
    // The mask (and the documents' starts) first: an output is never
    // there without them; and one whose output cannot follow it is taken
    // back, not left beside another run's output.
    let mut moved: Vec<&PathBuf> = Vec::new();
    for (partial, path) in files.iter().rev() {
        if let Err(e) = std::fs::rename(partial, path) {
            for m in moved {
                let _ = std::fs::remove_file(m);
            }
            return Err(io(path)(e));
        }
        moved.push(path);
    }
    if writer.done.merged_seams > 0 {
        tracing::warn!(
            documents = writer.done.merged_seams,
            "some documents' tokens do not begin with their prompt's (the tokenizer merged across the seam); their masks leave out as many tokens as the prompt has, as TRL's do"
        );
    }
    Ok(writer.done)
}

/// A checkpoint's fast tokenizer (`tokenizer.json`), run as Python's
/// `tokenizer(text)` runs it: its special tokens added, no truncation
/// nor padding whatever the file says.
pub struct HfTokenizer {
    tokenizer: Tokenizer,
    /// Where `tokenizer_config.json` would be.
    dir: PathBuf,
    /// The given path, named in errors.
    path: PathBuf,
    vocab: u64,
}

impl HfTokenizer {
    /// The tokenizer at `path`: a checkpoint's directory (its
    /// `tokenizer.json`), or the file.
    pub fn open(path: &Path) -> Result<Self, TokenizeError> {
        let err = |msg: String| TokenizeError::Tokenizer {
            path: path.to_path_buf(),
            msg,
        };
        let (dir, file) = match path.is_dir() {
            true => (path.to_path_buf(), path.join("tokenizer.json")),
            false => (
                path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                path.to_path_buf(),
            ),
        };
        if !file.is_file() {
            return Err(err(format!(
                "no {}: zrt reads fast tokenizers; in Python, AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes one beside a tokenizer.model",
                file.display()
            )));
        }
        let mut tokenizer = Tokenizer::from_file(&file).map_err(|e| err(e.to_string()))?;
        // transformers turns both off for a call that does not ask
        // for them, whatever the file says.
        tokenizer
            .with_truncation(None)
            .map_err(|e| err(e.to_string()))?;
        tokenizer.with_padding(None);
        let vocab = (tokenizer.get_vocab(true).values())
            .max()
            .map_or(0, |&m| u64::from(m) + 1);
        Ok(Self {
            tokenizer,
            dir,
            path: path.to_path_buf(),
            vocab,
        })
    }

    /// The largest id it gives, plus one.
    pub fn vocab(&self) -> u64 {
        self.vocab
    }

    /// The ids of `text`: `tokenizer(text)["input_ids"]`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let e = (self.tokenizer.encode_fast(text, true)).map_err(|e| self.failed(e))?;
        Ok(e.get_ids().to_vec())
    }

    /// Its chat template (`chat_template.jinja` beside it, or
    /// `tokenizer_config.json`'s), if it has one.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>, TokenizeError> {
        ChatTemplate::open(&self.dir)
    }

    /// The ids of `messages` (`(role, content)`, a user's last) rendered
    /// by its chat template with the assistant's turn opened, for a
    /// model to answer: `apply_chat_template(messages,
    /// add_generation_prompt=True)`.
    pub fn encode_chat(&self, messages: &[(&str, &str)]) -> Result<Vec<u32>, TokenizeError> {
        let list: Vec<minijinja::Value> = (messages.iter())
            .map(|&(role, content)| {
                minijinja::Value::from_iter([("role", role), ("content", content)])
            })
            .collect();
        let list = minijinja::Value::from(list);
        self.encode_conversation(&list, &Extras::default(), Ending::GenerationPrompt)
    }

    /// The ids of a conversation (a list of messages, each a map with
    /// `role` and `content` as the template reads them; `extras`, the
    /// functions' JSON schemas and a retrieval template's documents)
    /// rendered by its chat template and ended as `ending` says (the
    /// assistant's turn opened: `apply_chat_template(messages,
    /// tools=tools, documents=documents, add_generation_prompt=True)`;
    /// or the final message left open: `continue_final_message=True`).
    pub fn encode_conversation(
        &self,
        messages: &minijinja::Value,
        extras: &Extras<'_>,
        ending: Ending,
    ) -> Result<Vec<u32>, TokenizeError> {
        let err = |msg: String| TokenizeError::Tokenizer {
            path: self.path.clone(),
            msg,
        };
        let template = self.chat_template()?.ok_or_else(|| {
            err("no chat template (chat_template.jinja, or tokenizer_config.json's chat_template) to render the prompt as a conversation with; give the prompt as text".into())
        })?;
        let rendered = template.render_conversation(messages, extras, ending);
        let rendered = rendered.map_err(|e| err(e.to_string()))?;
        self.encode_rendered(&rendered.text)
    }

    /// The ids of a conversation rendered by its chat template
    /// ([`ChatTemplate::render`]): `apply_chat_template(messages,
    /// tokenize=True)`, no special token added (the template writes
    /// them).
    pub fn encode_rendered(&self, rendered: &str) -> Result<Vec<u32>, TokenizeError> {
        let e = (self.tokenizer.encode_fast(rendered, false)).map_err(|e| self.failed(e))?;
        Ok(e.get_ids().to_vec())
    }

    /// The id of the token `token` (its text in the vocabulary, added
    /// tokens too: `tokenizer.convert_tokens_to_ids(token)`), refused
    /// when the vocabulary lacks it.
    pub fn token_id(&self, token: &str) -> Result<u32, TokenizeError> {
        (self.tokenizer.token_to_id(token)).ok_or_else(|| TokenizeError::Tokenizer {
            path: self.path.clone(),
            msg: format!("{token:?} is no token of its vocabulary: give a token's text as the vocabulary holds it (<|im_start|>), or its id"),
        })
    }

    /// The text of `ids`, special tokens left out
    /// (`tokenizer.decode(ids, skip_special_tokens=True)`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        (self.tokenizer.decode(ids, true)).map_err(|e| self.failed(e))
    }

    /// The id of its `tokenizer_config.json`'s `eos_token` (for a legacy
    /// checkpoint, `special_tokens_map.json`'s, as `transformers` reads
    /// it).
    pub fn eos(&self) -> Result<u32, TokenizeError> {
        let err = |msg: String| TokenizeError::Tokenizer {
            path: self.path.clone(),
            msg,
        };
        let name = token_text(&tokenizer_config(&self.dir)?["eos_token"]).ok_or_else(|| {
            err(format!(
                "no eos_token in {} (nor in its special_tokens_map.json): the end-of-text token is read from there",
                self.dir.join("tokenizer_config.json").display()
            ))
        })?;
        (self.tokenizer.token_to_id(&name)).ok_or_else(|| {
            err(format!(
                "eos_token {name:?} is not in the tokenizer's vocabulary"
            ))
        })
    }

    /// `tokenizers`' error `e`, as this crate's.
    fn failed(&self, e: tokenizers::Error) -> TokenizeError {
        TokenizeError::Tokenizer {
            path: self.path.clone(),
            msg: format!("the tokenizer failed: {e}"),
        }
    }
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab", &self.vocab)
            .finish()
    }
}

/// An I/O error on `path`, as this crate's.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TokenizeError {
    let path = path.to_path_buf();
    move |source| TokenizeError::Io { path, source }
}

/// What an input file holds.
enum Kind {
    /// One document.
    Text,
    /// One JSON object a line.
    Lines,
}

/// The kind of `path`, by its extension.
fn kind(path: &Path) -> Result<Kind, TokenizeError> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("txt") => Ok(Kind::Text),
        Some("jsonl") => Ok(Kind::Lines),
        _ => Err(TokenizeError::Input {
            path: path.to_path_buf(),
            line: None,
            msg: "neither .txt (one document) nor .jsonl (one JSON object a line): rename it"
                .into(),
        }),
    }
}

/// What a `.jsonl` line's document is made of.
enum Fields<'a> {
    /// The text of this field, or a conversation (`messages`).
    Text(&'a str),
    /// Its `prompt` and `completion`: texts, or lists of messages.
    PromptCompletion,
    /// A conversation (`messages`) whose assistant turns are counted.
    Messages,
}

/// A document: its text, whether a chat template wrote it, and which of
/// its tokens a mask counts.
struct Doc {
    text: String,
    /// Rendered by the chat template: encoded with no special token
    /// added and no end-of-text token after.
    chat: bool,
    counted: Counted,
}

/// Which of a document's tokens a mask counts.
enum Counted {
    /// All (no mask is written).
    All,
    /// Those after the tokens of this prompt, which the text begins with.
    AfterPrompt(String),
    /// Those of these character ranges (`{% generation %}` blocks').
    Spans(Vec<std::ops::Range<usize>>),
}

/// A `.jsonl` line's conversation: the chat template, the lists of
/// messages of its fields (`messages`; or `prompt` and `completion`),
/// and its `tools`.
struct Conversation<'t> {
    template: &'t ChatTemplate,
    lists: Vec<Vec<minijinja::Value>>,
    tools: Option<minijinja::Value>,
}

/// The tokenizer's chat template, read when first needed.
enum Template {
    Unread,
    Read(Option<Box<ChatTemplate>>),
}

impl Template {
    /// The template, read the first time.
    fn get(&mut self, tok: &HfTokenizer) -> Result<Option<&ChatTemplate>, TokenizeError> {
        if let Template::Unread = self {
            *self = Template::Read(tok.chat_template()?.map(Box::new));
        }
        match self {
            Template::Read(t) => Ok(t.as_deref()),
            Template::Unread => Ok(None),
        }
    }
}

/// Calls `each` with the documents of `path`'s lines, [`BATCH`] at a
/// time, in order (blank lines skipped).
fn each_batch(
    path: &Path,
    fields: &Fields,
    tok: &HfTokenizer,
    template: &mut Template,
    mut each: impl FnMut(Vec<Doc>) -> Result<(), TokenizeError>,
) -> Result<(), TokenizeError> {
    let input = |line: u64, msg: String| TokenizeError::Input {
        path: path.to_path_buf(),
        line: Some(line),
        msg,
    };
    let file = File::open(path).map_err(io(path))?;
    let mut batch = Vec::with_capacity(BATCH);
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let n = i as u64 + 1;
        let line = line.map_err(|e| input(n, e.to_string()))?;
        if line.trim().is_empty() {
            continue;
        }
        // In the line's own key order, which a conversation's `tojson`
        // and `.items()` show.
        let json: minijinja::Value =
            serde_json::from_str(&line).map_err(|e| input(n, format!("not JSON: {e}")))?;
        let get = |name: &str| json.get_attr(name).ok().filter(|v| !v.is_undefined());
        let field = |name: &str, fix: &str| {
            (get(name).and_then(|t| t.as_str().map(str::to_string)))
                .ok_or_else(|| input(n, format!("no string field {name:?} ({fix})")))
        };
        // A field is a conversation when it is a list (TRL's
        // `is_conversational` looks at its messages' roles too; a list of
        // anything else is refused by the template's rendering).
        let is_conversation = |name: &str| get(name).is_some_and(|v| v.kind() == ValueKind::Seq);
        // The fields holding a conversation's messages, if the line is
        // one, and their lists, with the template.
        let keys: &[&str] = match fields {
            Fields::Text(name) if get(name).is_none() => &["messages"],
            Fields::Text(_) => &[],
            Fields::PromptCompletion => &["prompt", "completion"],
            Fields::Messages => &["messages"],
        };
        let mut chat = None;
        if !keys.is_empty() && keys.iter().all(|k| is_conversation(k)) {
            let t = template.get(tok)?.ok_or_else(|| {
                input(n, "a conversation, but the tokenizer has no chat template (chat_template.jinja, or tokenizer_config.json's chat_template) to render it with".into())
            })?;
            // TRL's `tools` column: the functions' schemas, which the
            // template writes (Qwen's into its system turn).
            let tools = match get("tools") {
                Some(t) if t.kind() == ValueKind::Seq => Some(t),
                Some(t) if t.is_none() => None,
                None => None,
                _ => {
                    return Err(input(
                        n,
                        "\"tools\" is not a list of the functions' JSON schemas".into(),
                    ))
                }
            };
            let mut lists = Vec::new();
            for key in keys {
                let list = (json.get_attr(key))
                    .and_then(|l| l.try_iter().map(|i| i.collect::<Vec<_>>()))
                    .map_err(|e| input(n, e.to_string()))?;
                lists.push(list);
            }
            chat = Some(Conversation {
                template: t,
                lists,
                tools,
            });
        }
        let render = |c: &Conversation, messages: &[minijinja::Value], opened: bool| {
            (c.template.render(
                &minijinja::Value::from(messages.to_vec()),
                c.tools.as_ref(),
                opened,
            ))
            .map_err(|e| input(n, e.to_string()))
        };
        batch.push(match (fields, &chat) {
            (Fields::Text(_), Some(c)) => Doc {
                text: render(c, &c.lists[0], false)?.text,
                chat: true,
                counted: Counted::All,
            },
            (Fields::Text(name), None) => Doc {
                text: field(name, "--field names the one holding the text; a conversation is a list under \"messages\"")?,
                chat: false,
                counted: Counted::All,
            },
            // TRL's conversational prompt-completion: the prompt with the
            // assistant's turn opened, then the whole conversation.
            (Fields::PromptCompletion, Some(c)) => {
                let prompt = render(c, &c.lists[0], true)?.text;
                Doc {
                    text: render(c, &c.lists.concat(), false)?.text,
                    chat: true,
                    counted: Counted::AfterPrompt(prompt),
                }
            }
            (Fields::PromptCompletion, None) => {
                let fix = "completion-only lines hold \"prompt\" and \"completion\", both texts or both lists of messages";
                let prompt = field("prompt", fix)?;
                Doc {
                    text: format!("{prompt}{}", field("completion", fix)?),
                    chat: false,
                    counted: Counted::AfterPrompt(prompt),
                }
            }
            (Fields::Messages, Some(c)) => {
                let r = render(c, &c.lists[0], false)?;
                Doc {
                    text: r.text,
                    chat: true,
                    counted: Counted::Spans(r.generated),
                }
            }
            (Fields::Messages, None) => {
                let msg = "no list \"messages\" (assistant-only lines are conversations)";
                return Err(input(n, msg.into()));
            }
        });
        if batch.len() == BATCH {
            each(std::mem::take(&mut batch))?;
        }
    }
    match batch.is_empty() {
        true => Ok(()),
        false => each(batch),
    }
}

/// The tokens of `e` that the character ranges `spans` cover, as
/// `apply_chat_template(..., return_assistant_tokens_mask=True)` marks
/// them: from the token of a range's first character to the token of its
/// last (to the end when that is the first token or none), stopping at
/// a range whose first character is in no token.
fn generated_mask(e: &Encoding, spans: &[std::ops::Range<usize>]) -> Vec<u8> {
    let n = e.get_ids().len();
    let mut mask = vec![0u8; n];
    for span in spans.iter().filter(|s| !s.is_empty()) {
        let Some(start) = e.char_to_token(span.start, 0) else {
            break;
        };
        let stop = match e.char_to_token(span.end - 1, 0) {
            Some(end) if end > 0 => end + 1,
            _ => n,
        };
        for m in mask.iter_mut().take(stop).skip(start) {
            *m = 1;
        }
    }
    mask
}

/// The output files being written: the ids, under completion- or
/// assistant-only the mask, and when asked the documents' starts.
struct Writer {
    outs: Vec<BufWriter<File>>,
    /// The files `outs` write, named in their errors.
    paths: Vec<PathBuf>,
    wide: bool,
    /// Whether a file holds the mask (the second).
    masked: bool,
    /// Whether a file holds the documents' starts (the last).
    starts: bool,
    done: Tokenized,
}

impl Writer {
    /// Encodes `docs` (from `path`), each followed by `eos` when given,
    /// and writes their ids (and mask).
    fn documents(
        &mut self,
        tok: &HfTokenizer,
        eos: Option<u32>,
        path: &Path,
        mut docs: Vec<Doc>,
    ) -> Result<(), TokenizeError> {
        let failed = |e: tokenizers::Error| TokenizeError::Input {
            path: path.to_path_buf(),
            line: None,
            msg: format!("the tokenizer failed: {e}"),
        };
        // Texts get the tokenizer's special tokens (`tokenizer(text)`);
        // what a chat template wrote gets none (it wrote them).
        let encode = |texts: Vec<(String, bool)>| -> Result<Vec<Encoding>, TokenizeError> {
            let n = texts.len();
            let (mut chat, mut plain) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
            for (i, (text, is_chat)) in texts.into_iter().enumerate() {
                let (at, strings) = if is_chat { &mut chat } else { &mut plain };
                at.push(i);
                strings.push(text);
            }
            let plain_ids = (tok.tokenizer.encode_batch_fast(plain.1, true)).map_err(failed)?;
            // Character offsets: a `{% generation %}` block's range is in
            // characters, as Python's `char_to_token` reads it.
            let chat_ids =
                (tok.tokenizer.encode_batch_char_offsets(chat.1, false)).map_err(failed)?;
            let mut got: Vec<Option<Encoding>> = vec![None; n];
            for (i, e) in plain
                .0
                .into_iter()
                .chain(chat.0)
                .zip(plain_ids.into_iter().chain(chat_ids))
            {
                got[i] = Some(e);
            }
            Ok(got.into_iter().flatten().collect())
        };
        let prompts: Vec<(String, bool)> = (docs.iter())
            .filter_map(|d| match &d.counted {
                Counted::AfterPrompt(p) => Some((p.clone(), d.chat)),
                _ => None,
            })
            .collect();
        let mut prompts = encode(prompts)?.into_iter();
        // The texts moved out (the documents keep how they are counted).
        let texts: Vec<(String, bool)> = (docs.iter_mut())
            .map(|d| (std::mem::take(&mut d.text), d.chat))
            .collect();
        let encoded = encode(texts)?;
        let (mut bytes, mut mask, mut starts) = (Vec::new(), Vec::new(), Vec::new());
        for (doc, e) in docs.iter().zip(&encoded) {
            let end = eos.filter(|_| !doc.chat);
            let ids: Vec<u32> = e.get_ids().iter().chain(end.as_ref()).copied().collect();
            for &id in &ids {
                match self.wide {
                    true => bytes.extend_from_slice(&id.to_le_bytes()),
                    // Every id fits: the vocabulary was checked.
                    false => bytes.extend_from_slice(&(id as u16).to_le_bytes()),
                }
            }
            let counted: Vec<u8> = match &doc.counted {
                Counted::All => Vec::new(),
                Counted::AfterPrompt(_) => {
                    let prompt = prompts
                        .next()
                        .map(|p| p.get_ids().to_vec())
                        .unwrap_or_default();
                    if !ids.starts_with(&prompt) {
                        self.done.merged_seams += 1;
                    }
                    let left_out = prompt.len().min(ids.len());
                    (0..ids.len()).map(|j| u8::from(j >= left_out)).collect()
                }
                Counted::Spans(spans) => generated_mask(e, spans),
            };
            self.done.counted += counted.iter().map(|&c| u64::from(c)).sum::<u64>();
            mask.extend(counted);
            if self.starts {
                starts.extend((0..ids.len()).map(|j| u8::from(j == 0)));
            }
            self.done.tokens += ids.len() as u64;
            self.done.documents += 1;
        }
        // The ids, the mask when there is one, then the starts when
        // asked for: `outs` holds their files in that order.
        let mut data = vec![bytes];
        data.extend(self.masked.then_some(mask));
        data.extend(self.starts.then_some(starts));
        for (out, (data, path)) in (self.outs.iter_mut()).zip(data.iter().zip(&self.paths)) {
            out.write_all(data).map_err(io(path))?;
        }
        Ok(())
    }
}

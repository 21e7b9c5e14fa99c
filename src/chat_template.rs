//! A checkpoint's chat template (the Jinja `transformers`'
//! `apply_chat_template` renders), rendered in Rust with MiniJinja.
//!
//! [`ChatTemplate::open`] reads it where `transformers` 4.57 does: the
//! directory's `chat_template.jinja`, else `tokenizer_config.json`'s
//! `chat_template` (a string, or named templates of which `default` is
//! taken). [`ChatTemplate::render`] renders a conversation in the
//! environment `transformers` compiles it in: Jinja2's syntax with
//! `trim_blocks` and `lstrip_blocks`, `break` and `continue`, Python's
//! string and dict methods (`.strip()`, `.items()`, ...), `tojson` as
//! Python's `json.dumps` writes (not HTML-escaped), `raise_exception`
//! (the template refusing a conversation), `strftime_now` (in UTC), values
//! printed as Python's `str` prints them, the tokenizer's special tokens
//! (`bos_token`, `eos_token`, ...) as variables, and `tools` when given. `{% generation %}` blocks, which mark the assistant's text,
//! give the character ranges they rendered
//! ([`Rendered::generated`]), as `return_assistant_tokens_mask` reads
//! them.
//!
//! What MiniJinja renders differently from Jinja2 is said by an error,
//! not guessed: an unknown filter or method is an error naming it. A
//! template's text is all the data it is given; nothing is fetched.

use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::tokenize::TokenizeError;

/// Marks where a `{% generation %}` block's text begins in a rendering
/// (a Unicode noncharacter: no text a conversation holds has it, which
/// [`ChatTemplate::render`] checks).
const BEGIN: char = '\u{FDD0}';
/// Marks where it ends.
const END: char = '\u{FDD1}';

/// The special-token fields of `tokenizer_config.json` a template sees
/// (`special_tokens_map`'s).
const SPECIAL: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A chat template compiled, with the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token` and the others that are set, and
    /// `additional_special_tokens`.
    specials: Vec<(String, Value)>,
    /// Whether it has `{% generation %}` blocks.
    marks_generation: bool,
    /// Where it was read, named in errors.
    path: PathBuf,
}

/// A conversation the chat template did not render: its
/// `raise_exception` message, or what MiniJinja could not do.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the chat template ({}) refused the conversation: {msg}", template.display())]
pub struct RenderError {
    /// Where the template was read.
    pub template: PathBuf,
    /// What it said.
    pub msg: String,
}

/// A conversation rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The text.
    pub text: String,
    /// The ranges of `text`, in characters (Python's string indices), that
    /// `{% generation %}` blocks rendered, in order.
    pub generated: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// The chat template of the tokenizer in `dir`, or `None` if it has
    /// none.
    pub fn open(dir: &Path) -> Result<Option<Self>, TokenizeError> {
        let err = |path: &Path, msg: String| TokenizeError::Tokenizer {
            path: path.to_path_buf(),
            msg,
        };
        let config_path = dir.join("tokenizer_config.json");
        let config = tokenizer_config(dir)?;
        let jinja = dir.join("chat_template.jinja");
        let (source, path) = match std::fs::read_to_string(&jinja) {
            Ok(source) => (source, jinja),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match named_template(&config["chat_template"]) {
                    Ok(Some(source)) => (source, config_path.clone()),
                    Ok(None) => return Ok(None),
                    Err(msg) => return Err(err(&config_path, msg)),
                }
            }
            Err(e) => return Err(err(&jinja, e.to_string())),
        };
        let mut specials = Vec::new();
        for key in SPECIAL {
            if let Some(token) = token_text(&config[key]) {
                specials.push((key.to_string(), Value::from(token)));
            }
        }
        if let Some(extra) = config["additional_special_tokens"].as_array() {
            let extra: Vec<Value> = extra
                .iter()
                .filter_map(token_text)
                .map(Value::from)
                .collect();
            specials.push(("additional_special_tokens".into(), Value::from(extra)));
        }
        let (source, marks_generation) = mark_generation(&source);
        let env = environment(source)
            .map_err(|e| err(&path, format!("the chat template does not compile: {e:#}")))?;
        Ok(Some(Self {
            env,
            specials,
            marks_generation,
            path,
        }))
    }

    /// Whether it marks the assistant's text with `{% generation %}`
    /// blocks (what an assistant-only loss needs).
    pub fn marks_generation(&self) -> bool {
        self.marks_generation
    }

    /// Where it was read: `chat_template.jinja` or
    /// `tokenizer_config.json`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `messages` (a list of `{"role", "content"}` maps) rendered as
    /// `apply_chat_template(messages, tools=tools, tokenize=False,
    /// add_generation_prompt=...)` renders them (`tools`, the functions'
    /// JSON schemas, or none).
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<Rendered, RenderError> {
        let ending = match add_generation_prompt {
            true => Ending::GenerationPrompt,
            false => Ending::Closed,
        };
        self.render_conversation(
            messages,
            &Extras {
                tools,
                documents: None,
            },
            ending,
        )
    }

    /// As [`Self::render`], with `extras` (`tools`, and `documents` for
    /// a retrieval template: `apply_chat_template(..., documents=...)`,
    /// a list of `{"title", "text"}` maps) and how it ends: closed, the
    /// assistant's turn opened, or the final message left open for the
    /// model to go on with (`continue_final_message=True`: rendered
    /// with the last text of the final message marked, everything after
    /// the mark cut, and the whitespace before it too where the template
    /// trimmed the message, as `transformers` does). A final message the
    /// template drops is refused.
    pub fn render_conversation(
        &self,
        messages: &Value,
        extras: &Extras<'_>,
        ending: Ending,
    ) -> Result<Rendered, RenderError> {
        let refused = |msg: String| RenderError {
            template: self.path.clone(),
            msg,
        };
        if messages.kind() != ValueKind::Seq {
            return Err(refused("the conversation is not a list of messages".into()));
        }
        let (messages, last_text) = match ending {
            Ending::ContinueFinalMessage => {
                let (marked, text) = mark_final(messages).map_err(refused)?;
                (marked, Some(text))
            }
            _ => (messages.clone(), None),
        };
        let add_generation_prompt = ending == Ending::GenerationPrompt;
        let none = || Value::from(());
        let mut context: Vec<(String, Value)> = self.specials.clone();
        context.extend([
            ("messages".to_string(), messages),
            (
                "add_generation_prompt".into(),
                Value::from(add_generation_prompt),
            ),
            ("tools".into(), extras.tools.cloned().unwrap_or_else(none)),
            (
                "documents".into(),
                extras.documents.cloned().unwrap_or_else(none),
            ),
        ]);
        let mut rendered = self.render_context(context)?;
        if let Some(text) = last_text {
            cut_at_mark(&mut rendered, &text).map_err(refused)?;
        }
        Ok(rendered)
    }

    /// The template rendered over `context`, its `{% generation %}`
    /// blocks' ranges found.
    fn render_context(&self, context: Vec<(String, Value)>) -> Result<Rendered, RenderError> {
        let refused = |msg: String| RenderError {
            template: self.path.clone(),
            msg,
        };
        let template =
            (self.env.get_template("chat_template")).map_err(|e| refused(describe(&e)))?;
        let out =
            (template.render(Value::from_iter(context))).map_err(|e| refused(describe(&e)))?;
        let mut text = String::with_capacity(out.len());
        let (mut generated, mut open, mut at) = (Vec::new(), None, 0);
        for c in out.chars() {
            match (c, open) {
                (BEGIN, None) => open = Some(at),
                (END, Some(start)) => {
                    generated.push(start..at);
                    open = None;
                }
                (BEGIN | END, _) => {
                    return Err(refused(format!(
                        "the conversation holds U+{:04X}, a Unicode noncharacter zrt marks {{% generation %}} blocks with, or the blocks nest",
                        c as u32
                    )))
                }
                _ => {
                    text.push(c);
                    at += 1;
                }
            }
        }
        Ok(Rendered { text, generated })
    }
}

/// What a conversation is rendered with besides its messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras<'a> {
    /// The functions' JSON schemas (`tools`).
    pub tools: Option<&'a Value>,
    /// A retrieval template's documents (`documents`: `{"title", "text"}`
    /// maps).
    pub documents: Option<&'a Value>,
}

/// How a rendered conversation ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// As it is (`add_generation_prompt=False`): a conversation to train on.
    Closed,
    /// With the assistant's turn opened (`add_generation_prompt=True`).
    GenerationPrompt,
    /// With the final message left open, for the model to go on with it
    /// (`continue_final_message=True`): a reply begun for it.
    ContinueFinalMessage,
}

/// What marks the final message's end while it renders (`transformers`'
/// own tag).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// `messages` with [`CONTINUE_TAG`] after the final message's text (its
/// `content`, or the last text part of a list of parts), and that text.
fn mark_final(messages: &Value) -> Result<(Value, String), String> {
    let items: Vec<Value> = (messages.try_iter()).map_err(|e| e.to_string())?.collect();
    let Some((last, before)) = items.split_last() else {
        return Err("continue_final_message: the conversation has no message to continue".into());
    };
    let content = last.get_attr("content").unwrap_or_default();
    let (content, text) = match content.as_str() {
        Some(text) => (
            Value::from(format!("{text}{CONTINUE_TAG}")),
            text.to_string(),
        ),
        None => {
            let parts: Vec<Value> = content.try_iter().map_err(|e| e.to_string())?.collect();
            let at = (parts.iter())
                .rposition(|p| p.get_attr("text").is_ok_and(|t| t.as_str().is_some()));
            let Some(at) = at else {
                return Err(
                    "continue_final_message: the final message has no text to continue".into(),
                );
            };
            let text = parts[at]
                .get_attr("text")
                .ok()
                .and_then(|t| t.as_str().map(String::from));
            let text = text.unwrap_or_default();
            let mut parts = parts;
            parts[at] = with_item(
                &parts[at],
                "text",
                Value::from(format!("{text}{CONTINUE_TAG}")),
            )?;
            (Value::from(parts), text)
        }
    };
    let mut items = before.to_vec();
    items.push(with_item(last, "content", content)?);
    Ok((Value::from(items), text))
}

/// The map `map` with `key` set to `value`, its keys in their order.
fn with_item(map: &Value, key: &str, value: Value) -> Result<Value, String> {
    let keys: Vec<Value> = map.try_iter().map_err(|e| e.to_string())?.collect();
    let pairs = keys.into_iter().map(|k| {
        let v = match k.as_str() == Some(key) {
            true => value.clone(),
            false => map.get_item(&k).unwrap_or_default(),
        };
        (k, v)
    });
    Ok(Value::from_iter(pairs))
}

/// Cuts `rendered` at the last [`CONTINUE_TAG`] (and the whitespace
/// before it when the template did not keep the tag's trailing space),
/// refusing a rendering that dropped `text` or the tag.
fn cut_at_mark(rendered: &mut Rendered, text: &str) -> Result<(), String> {
    let tag = CONTINUE_TAG.trim();
    let (Some(at), true) = (
        rendered.text.rfind(tag),
        rendered.text.contains(text.trim()),
    ) else {
        return Err("continue_final_message: the final message does not appear in the conversation the template rendered (the template drops part of it)".into());
    };
    let kept = match rendered.text[at..].starts_with(CONTINUE_TAG) {
        true => &rendered.text[..at],
        false => rendered.text[..at].trim_end(),
    };
    let len = kept.len();
    rendered.text.truncate(len);
    let chars = rendered.text.chars().count();
    rendered.generated.retain(|r| r.start < chars);
    for r in &mut rendered.generated {
        r.end = r.end.min(chars);
    }
    Ok(())
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .field("marks_generation", &self.marks_generation)
            .finish()
    }
}

/// A MiniJinja environment holding `source` as `chat_template`, set as
/// `transformers`' `_compile_jinja_template` sets Jinja2's: its block
/// whitespace rules, loop controls, and its own globals and `tojson`.
/// What `{{ x }}`, `|string` and `|trim` print is Python's `str(x)`
/// (MiniJinja's own prints `None` and `True` as Python does, but the
/// strings inside a list in Rust's quoting): a template printing a
/// multimodal message's parts prints `[{'type': 'text', ...}]`.
fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.set_formatter(|out, _, value| {
        (out.write_str(&python_str(value))).map_err(|_| Error::from(ErrorKind::WriteFailure))
    });
    env.add_filter("string", |v: &Value| python_str(v));
    env.add_filter("trim", |v: &Value, chars: Option<String>| {
        let s = python_str(v);
        match chars {
            Some(chars) => s.trim_matches(|c| chars.contains(c)).to_string(),
            None => s.trim().to_string(),
        }
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned("chat_template", source)?;
    Ok(env)
}

/// A MiniJinja error with its causes, on one line.
fn describe(e: &Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

/// `tokenizer_config.json`'s `chat_template`: a string, or a list of
/// `{"name", "template"}` of which `default` is the one taken without
/// tools (`get_chat_template`'s choice).
fn named_template(v: &serde_json::Value) -> Result<Option<String>, String> {
    match v {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Array(named) => {
            let default = named.iter().find(|t| t["name"] == "default");
            match default.and_then(|t| t["template"].as_str()) {
                Some(s) => Ok(Some(s.to_string())),
                None => Err("chat_template names its templates but none `default`, the one a conversation without tools takes".into()),
            }
        }
        _ => Err("chat_template is neither a string nor a list of named templates".into()),
    }
}

/// `tokenizer_config.json` in `dir` (null when there is none) with its
/// special tokens as `transformers` 4.57's `from_pretrained` sets them: a
/// legacy checkpoint, whose config has no `added_tokens_decoder`, has
/// them from `special_tokens_map.json` where that file names them (its
/// `additional_special_tokens` added to the config's list).
pub(crate) fn tokenizer_config(dir: &Path) -> Result<serde_json::Value, TokenizeError> {
    let read = |path: PathBuf| -> Result<serde_json::Value, TokenizeError> {
        let err = |msg: String| TokenizeError::Tokenizer {
            path: path.clone(),
            msg,
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| err(e.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(serde_json::Value::Null),
            Err(e) => Err(err(e.to_string())),
        }
    };
    let mut config = read(dir.join("tokenizer_config.json"))?;
    if config.get("added_tokens_decoder").is_some() {
        return Ok(config);
    }
    let serde_json::Value::Object(map) = read(dir.join("special_tokens_map.json"))? else {
        return Ok(config);
    };
    if !config.is_object() {
        config = serde_json::Value::Object(Default::default());
    }
    for (key, value) in map {
        config[&key] = match (key.as_str(), value) {
            ("additional_special_tokens", serde_json::Value::Array(extra)) => {
                let mut list = config[&key].as_array().cloned().unwrap_or_default();
                for token in extra {
                    let text = token_text(&token);
                    if !list.iter().any(|t| token_text(t) == text) {
                        list.push(token);
                    }
                }
                serde_json::Value::Array(list)
            }
            (_, value) => value,
        };
    }
    Ok(config)
}

/// A special token's text in `tokenizer_config.json`: a string, or an
/// AddedToken's `content`.
pub(crate) fn token_text(v: &serde_json::Value) -> Option<String> {
    (v.as_str().or_else(|| v["content"].as_str())).map(str::to_string)
}

/// `source` with each `{% generation %}` block's begin and end tags made
/// to print [`BEGIN`] and [`END`] (MiniJinja has no such tag), and
/// whether it had any. Each tag becomes an `if` block around the mark,
/// so that the whitespace rules (`-`, `trim_blocks`, `lstrip_blocks`)
/// act on the text around it as they acted on the tag.
fn mark_generation(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let (mut rest, mut any) = (source, false);
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return (out, any);
        };
        let inner = &tag[2..close];
        let (left, inner) = match inner.strip_prefix('-') {
            Some(i) => ("-", i),
            None => ("", inner),
        };
        let (right, inner) = match inner.strip_suffix('-') {
            Some(i) => ("-", i),
            None => ("", inner),
        };
        let mark = match inner.trim() {
            "generation" => Some(BEGIN),
            "endgeneration" => Some(END),
            _ => None,
        };
        match mark {
            Some(m) => {
                any = true;
                out.push_str(&format!("{{%{left} if true %}}{m}{{% endif {right}%}}"));
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, any)
}

/// The template's `raise_exception(message)`: it refuses the
/// conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as `transformers` defines it: Python's `json.dumps(x,
/// ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// those four arguments taken by name.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson's indent is a number or a string",
                ))
            }
        },
    };
    let (item, key) = match (separators.as_deref(), &indent) {
        (Some([item, key]), _) => (item.clone(), key.clone()),
        (Some(_), _) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson's separators are two strings",
            ))
        }
        (None, None) => (", ".into(), ": ".into()),
        (None, Some(_)) => (",".into(), ": ".into()),
    };
    let dumps = Dumps {
        ascii: ensure_ascii.unwrap_or(false),
        indent,
        item,
        key,
        sort: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    dumps.value(value, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Python's `json.dumps` settings.
struct Dumps {
    ascii: bool,
    indent: Option<String>,
    item: String,
    key: String,
    sort: bool,
}

impl Dumps {
    /// Writes `v` at nesting `depth` into `out`.
    fn value(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
            ValueKind::Number => out.push_str(&python_float(f64::try_from(v.clone())?)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(('[', ']'), items.len(), depth, out, |i, out| {
                    self.value(&items[i], depth + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort {
                    keys.sort();
                }
                self.container(('{', '}'), keys.len(), depth, out, |i, out| {
                    let k = &keys[i];
                    match k.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&k.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.value(&v.get_item(k)?, depth + 1, out)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson cannot write a {}", v.kind()),
                ))
            }
        }
        Ok(())
    }

    /// Writes `n` items between `brackets`, separated and indented as
    /// `json.dumps` does.
    fn container(
        &self,
        brackets: (char, char),
        n: usize,
        depth: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(brackets.0);
        if n == 0 {
            out.push(brackets.1);
            return Ok(());
        }
        for i in 0..n {
            if i > 0 {
                out.push_str(&self.item);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth + 1));
            }
            item(i, out)?;
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
        out.push(brackets.1);
        Ok(())
    }

    /// A JSON string as Python writes it.
    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// `str(v)` in Python: a string as it is, nothing for undefined, else
/// [`python_repr`].
fn python_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => {
            let mut out = String::new();
            python_repr(v, &mut out);
            out
        }
    }
}

/// `repr(v)` in Python, for the values JSON holds: `None`, `True`, numbers
/// as Python writes them, strings quoted and escaped as `repr` does,
/// lists and dicts of those.
fn python_repr(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => match f64::try_from(v.clone()) {
            Ok(f) if f.is_nan() => out.push_str("nan"),
            Ok(f) if f.is_infinite() => out.push_str(if f > 0.0 { "inf" } else { "-inf" }),
            Ok(f) => out.push_str(&python_float(f)),
            Err(_) => out.push_str(&v.to_string()),
        },
        ValueKind::String => python_str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out);
                out.push_str(": ");
                python_repr(&v.get_item(&key).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
}

/// A string as Python's `repr` quotes it: in single quotes unless it
/// holds one and no double quote; backslashes, the quote and what is not
/// printable escaped.
fn python_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !printable(c) => match c as u32 {
                n if n < 0x100 => out.push_str(&format!("\\x{n:02x}")),
                n if n < 0x10000 => out.push_str(&format!("\\u{n:04x}")),
                n => out.push_str(&format!("\\U{n:08x}")),
            },
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Whether Python's `str.isprintable` holds for `c`: not a control, format,
/// separator (but the space) or surrogate character; the common ones
/// listed, unassigned code points taken as printable.
fn printable(c: char) -> bool {
    let n = c as u32;
    !matches!(n,
        0..=0x1f | 0x7f..=0xa0 | 0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x1680 | 0x180e
        | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064 | 0x2066..=0x206f | 0x3000
        | 0xfeff | 0xfff9..=0xfffb | 0xe000..=0xf8ff | 0xf0000..)
}

/// A float as Python's `repr` writes it: the shortest digits that read
/// back, in exponent form below 1e-4 and from 1e16.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-tripping digits.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..16).contains(&exp) {
        return format!(
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        );
    }
    let plain = format!("{f}");
    match plain.contains('.') {
        true => plain,
        false => format!("{plain}.0"),
    }
}

/// The template's `strftime_now(format)`: the time now in UTC (Python's
/// is local; zrt's machines run in UTC), for `%Y %m %d %y %b %B %a %A %H
/// %M %S %j %%`; another code is refused naming it.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&format, secs).map(Value::from)
}

/// `format` of the UTC time `secs` after the Unix epoch.
fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 3).rem_euclid(7) as usize;
    let year_day = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(MONTHS[m as usize - 1]),
            Some('b') => out.push_str(&MONTHS[m as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('j') => out.push_str(&format!("{year_day:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: zrt does not write %{}",
                        other.map_or(String::new(), String::from)
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// The proleptic Gregorian date of day `z` after 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The day after 1970-01-01 of a proleptic Gregorian date (the inverse
/// of [`civil_from_days`]).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_the_calendars() {
        // 2024-07-26 12:34:56 UTC, a Friday, day 208.
        let secs = 1_721_997_296;
        let got = strftime("%d %b %Y, %A %H:%M:%S, %j %y %B %a %m %%", secs).unwrap();
        assert_eq!(got, "26 Jul 2024, Friday 12:34:56, 208 24 July Fri 07 %");
        // Leap days and the epoch.
        assert_eq!(strftime("%Y-%m-%d", 951_782_400).unwrap(), "2000-02-29");
        assert_eq!(strftime("%Y-%m-%d %A", 0).unwrap(), "1970-01-01 Thursday");
        let e = strftime("%Z", 0).unwrap_err().to_string();
        assert!(e.contains("does not write %Z"), "{e}");
    }

    #[test]
    fn floats_are_written_as_python_writes_them() {
        for (f, py) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (-2.5, "-2.5"),
            (123456789.125, "123456789.125"),
        ] {
            assert_eq!(python_float(f), py, "{f}");
        }
    }

    #[test]
    fn values_print_as_python_prints_them() {
        let v: Value = serde_json::from_str(
            r#"[{"b": true, "a": null}, "it's", "say \"hi\"", "q'\"", 2, 1.5, "\u00a0\u0007\\", "é😀"]"#,
        )
        .unwrap();
        let env = environment("{{ v }}|{{ v | trim }}|{{ v[1] }}|{{ v[0].a }}".into()).unwrap();
        let out = env
            .get_template("chat_template")
            .unwrap()
            .render(Value::from_iter([("v", v)]))
            .unwrap();
        let py =
            r#"[{'b': True, 'a': None}, "it's", 'say "hi"', 'q\'"', 2, 1.5, '\xa0\x07\\', 'é😀']"#;
        assert_eq!(out, format!("{py}|{py}|it's|None"));
    }

    #[test]
    fn a_config_names_its_templates_and_default_is_taken() {
        let named = serde_json::json!([
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"}
        ]);
        assert_eq!(named_template(&named), Ok(Some("D".into())));
        assert_eq!(
            named_template(&serde_json::json!("S")),
            Ok(Some("S".into()))
        );
        assert_eq!(named_template(&serde_json::Value::Null), Ok(None));
        let e = named_template(&serde_json::json!([{"name": "rag", "template": "R"}])).unwrap_err();
        assert!(e.contains("none `default`"), "{e}");
        assert!(named_template(&serde_json::json!(3)).is_err());
    }

    #[test]
    fn generation_tags_become_marks_keeping_their_whitespace_rules() {
        let (s, any) =
            mark_generation("a{%- generation %}b{% endgeneration -%} c{% if x %}{% endif %}");
        assert!(any);
        assert_eq!(
            s,
            "a{%- if true %}\u{FDD0}{% endif %}b{% if true %}\u{FDD1}{% endif -%} c{% if x %}{% endif %}"
        );
        assert_eq!(
            mark_generation("{{ add_generation_prompt }}"),
            ("{{ add_generation_prompt }}".into(), false)
        );
    }
}

#[cfg(test)]
mod continue_tests {
    use super::*;

    /// A template of `source`, read from a directory of its own.
    fn template(name: &str, source: &str) -> ChatTemplate {
        let dir = std::env::temp_dir().join(format!("zrt-continue-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), source).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
        let t = ChatTemplate::open(&dir).unwrap().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        t
    }

    #[test]
    fn a_final_message_the_template_drops_cannot_be_continued() {
        let messages: Value = serde_json::from_str(
            r#"[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]"#,
        )
        .unwrap();
        let roles = template("roles", "{% for m in messages %}<{{ m.role }}>{% endfor %}");
        let err = roles
            .render_conversation(&messages, &Extras::default(), Ending::ContinueFinalMessage)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not appear in the conversation"), "{err}");
        let kept = template(
            "kept",
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}",
        );
        let out = kept
            .render_conversation(&messages, &Extras::default(), Ending::ContinueFinalMessage)
            .unwrap();
        assert_eq!(out.text, "<user>a</><assistant>b");
        let none: Value = serde_json::from_str("[]").unwrap();
        let err = kept
            .render_conversation(&none, &Extras::default(), Ending::ContinueFinalMessage)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no message to continue"), "{err}");
    }
}

//! A trained adapter folded into its base checkpoint: PEFT's
//! `merge_and_unload()` then `save_pretrained`, done on the files (one
//! of the base's safetensors files in memory at a time, no model built,
//! no rank), so that the result loads and serves as a plain model.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::LoraConfig;
use crate::hf::{HfError, HfJson};

/// PEFT's name of an adapter's file in its directory.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// PEFT's name of an adapter's settings in its directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// The index of a base checkpoint in several files.
pub(crate) const INDEX: &str = "model.safetensors.index.json";

/// What [`merge`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merged {
    /// The matrices that took an update, by name, sorted.
    pub matrices: Vec<String>,
    /// The biases B's biases went into (`lora_bias`), by name, sorted.
    pub biases: Vec<String>,
    /// The tensors of `modules_to_save` that replaced the base's, and
    /// the embeddings trainable tokens' rows went into, by name, sorted.
    pub replaced: Vec<String>,
    /// The safetensors files written.
    pub files: usize,
}

impl LoraConfig {
    /// Reads PEFT's `adapter_config.json` in the adapter directory `dir`,
    /// refusing what this crate does not compute with (another
    /// `peft_type`, repeated layers, `bias` other
    /// than `"none"` or `"all"`, QALoRA, aLoRA, a `lora_bias` that is no
    /// boolean), naming the field: built anyway, the model
    /// would hold other adapters than the file. `rank_pattern` and
    /// `alpha_pattern` keep the file's order, which decides between keys
    /// that match one module.
    pub fn from_adapter_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        let path = dir.as_ref().join(ADAPTER_CONFIG);
        let j = HfJson::read(&path, None)?;
        let text = |k: &str| j.get(k).and_then(|v| v.as_str()).map(str::to_string);
        if let Some(t) = text("peft_type").filter(|t| t != "LORA") {
            return Err(j.field(format!("peft_type {t:?}: zrt reads LoRA adapters only")));
        }
        let on = |k: &str| j.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
        let patterns: super::per_module::Patterns = std::fs::read(&path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .ok_or_else(|| {
                j.field("`rank_pattern` and `alpha_pattern` are objects of module names (or patterns) and numbers, ranks whole".into())
            })?;
        // Settings PEFT leaves off (null, false, empty) that change which
        // tensors train or what they compute.
        for (key, what) in [
            ("layer_replication", "repeats layers"),
            ("use_qalora", "pools the adapters' input (QALoRA)"),
            (
                "alora_invocation_tokens",
                "turns the adapters on after some tokens only (aLoRA)",
            ),
        ] {
            let set = match j.get(key) {
                None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {
                    false
                }
                Some(serde_json::Value::Array(a)) => !a.is_empty(),
                Some(_) => true,
            };
            if set {
                return Err(j.field(format!(
                    "`{key}` is set, which {what}: zrt builds plain LoRA adapters on the targeted modules (leave it out, or null)"
                )));
            }
        }
        let lora_bias = match j.get("lora_bias") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(v) => {
                return Err(j.field(format!(
                    "`lora_bias` is {v}: true (each adapter's B has a bias) or false"
                )))
            }
        };
        let train_biases = match text("bias").as_deref() {
            None | Some("none") => false,
            Some("all") => true,
            Some("lora_only") => {
                return Err(j.field(
                    "`bias` is \"lora_only\": PEFT 0.18 trains the adapted layers' biases then leaves them out of the adapter's file, so what trained would be lost; zrt takes \"all\" (every bias trains and is saved) or \"none\"".into(),
                ))
            }
            Some(b) => {
                return Err(j.field(format!(
                    "`bias` is {b:?}: PEFT's are \"none\", \"all\" and \"lora_only\""
                )))
            }
        };
        // A list of names, or a string: PEFT's regular expression (or
        // `all-linear`).
        let names_or_pattern = |key: &str| match j.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some((Vec::new(), Some(s.clone())))),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .map(|list| Some((list, None)))
                .ok_or_else(|| j.field(format!("`{key}` holds a non-string"))),
            Some(v) => Err(j.field(format!(
                "`{key}` is {v}: a list of module names, or a regular expression"
            ))),
        };
        // A list of names (`what`), or null for none.
        let names_or_null = |key: &str, what: &str| match j.get(key) {
            None | Some(serde_json::Value::Null) => Ok(Vec::new()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| j.field(format!("`{key}` holds a non-string"))),
            Some(v) => Err(j.field(format!("`{key}` is {v}: a list of {what} (or null)"))),
        };
        // Stacked experts' parameters.
        let target_parameters = names_or_null("target_parameters", "parameters' names")?;
        let (targets, target_pattern) = match names_or_pattern("target_modules")? {
            Some((_, Some(all))) if all == "all-linear" => (vec![all], None),
            Some(found) => found,
            // PEFT's null beside parameters: no module takes an adapter.
            None if !target_parameters.is_empty() => (Vec::new(), None),
            None => return Err(j.field("no `target_modules` list".into())),
        };
        let (exclude_modules, exclude_pattern) =
            names_or_pattern("exclude_modules")?.unwrap_or_default();
        let saved = names_or_null("modules_to_save", "module names")?;
        // PEFT's list form (the input embedding's rows), or its dict form:
        // modules (the input embedding, an untied head) and their rows.
        let ids = |a: &[serde_json::Value]| {
            (a.iter().map(|v| v.as_i64()).collect::<Option<Vec<_>>>())
                .ok_or_else(|| j.field("`trainable_token_indices` holds a non-integer".into()))
        };
        let (tokens, tokens_modules) = match j.get("trainable_token_indices") {
            None | Some(serde_json::Value::Null) => (Vec::new(), Vec::new()),
            Some(serde_json::Value::Array(a)) => (ids(a)?, Vec::new()),
            Some(serde_json::Value::Object(o)) if !o.is_empty() => {
                let by_module = o.iter().map(|(key, v)| {
                    let list = v.as_array().ok_or_else(|| {
                        j.field(format!("`trainable_token_indices` maps {key:?} to {v}, not a list of token ids"))
                    })?;
                    Ok((key.clone(), ids(list)?))
                });
                (Vec::new(), by_module.collect::<Result<Vec<_>, HfError>>()?)
            }
            Some(v) => {
                return Err(j.field(format!(
                    "`trainable_token_indices` is {v}: zrt takes token ids whose rows of the input embedding train, as a list, or PEFT's dict form of modules (the input embedding, an untied head) and their token ids"
                )))
            }
        };
        // PEFT's `layers_to_transform`: one index or a list; its
        // `layers_pattern`: one name or a list (an empty one: any).
        let layers = match j.get("layers_to_transform") {
            None | Some(serde_json::Value::Null) => Some(Vec::new()),
            Some(serde_json::Value::Number(n)) => n.as_i64().map(|i| vec![i]),
            Some(serde_json::Value::Array(a)) => a.iter().map(|v| v.as_i64()).collect(),
            Some(_) => None,
        }
        .ok_or_else(|| {
            j.field("`layers_to_transform` is a layer's index or a list of them".into())
        })?;
        let layers_pattern = match j.get("layers_pattern") {
            None | Some(serde_json::Value::Null) => Some(Vec::new()),
            Some(serde_json::Value::String(s)) if s.is_empty() => Some(Vec::new()),
            Some(serde_json::Value::String(s)) => Some(vec![s.clone()]),
            Some(serde_json::Value::Array(a)) => {
                a.iter().map(|v| v.as_str().map(str::to_string)).collect()
            }
            Some(_) => None,
        }
        .ok_or_else(|| j.field("`layers_pattern` is the name of the model's list of layers (`layers`, `h`) or a list of names".into()))?;
        let cfg = LoraConfig {
            r: j.size("r")?,
            alpha: j.number_or("lora_alpha", 8.0)?,
            dropout: j.rate_or("lora_dropout", 0.0)?,
            target_modules: targets,
            target_pattern,
            exclude_modules,
            exclude_pattern,
            use_rslora: on("use_rslora"),
            fan_in_fan_out: on("fan_in_fan_out"),
            use_dora: on("use_dora"),
            modules_to_save: saved,
            ensure_weight_tying: on("ensure_weight_tying"),
            trainable_token_indices: tokens,
            trainable_tokens_modules: tokens_modules,
            train_biases,
            lora_bias,
            layers_to_transform: layers,
            layers_pattern,
            rank_pattern: patterns.rank_pattern.0,
            alpha_pattern: patterns.alpha_pattern.0,
            target_parameters,
        };
        cfg.check(&path.display().to_string())?;
        Ok(cfg)
    }
}

/// An adapter's matrices `(A, B)` by the module they adapt, DoRA's
/// magnitudes by module, trainable tokens' rows, the tensors of its
/// saved modules by name, and (with `ensure_weight_tying`) the other
/// tensors, which must be copies of a saved one a tied base holds once
/// (PEFT writes a saved, tied embedding as the head too).
struct Adapters {
    pairs: BTreeMap<String, (Tensor, Tensor)>,
    /// `B`'s biases (`lora_bias`) by the module they adapt.
    b_biases: BTreeMap<String, Tensor>,
    magnitudes: HashMap<String, Tensor>,
    /// The matrices of adapted token embeddings, whose update goes in
    /// transposed (`lora_embedding_A` `[r, vocab]`).
    embeddings: std::collections::HashSet<String>,
    /// Copies of the base's matrices of an adapted embedding or head
    /// (PEFT's `save_embedding_layers`), by the matrix's name.
    base_copies: HashMap<String, Tensor>,
    /// Trainable tokens' rows by the embedding they stand in.
    rows: BTreeMap<String, Tensor>,
    whole: BTreeMap<String, Tensor>,
    copies: BTreeMap<String, Tensor>,
}

/// Where a multimodal base ([`crate::hf::MULTIMODAL`]) holds its
/// language model, whose names an adapter zrt trained on it carries
/// (zrt builds the language model alone).
#[derive(Debug, Clone, Copy, PartialEq)]
enum LanguageModel {
    /// A text model's checkpoint: the adapter's names are the base's.
    Alone,
    /// Under `language_model.` (the files `transformers` 4.57 writes:
    /// `language_model.model.layers.0...`, `language_model.lm_head`).
    Prefixed,
    /// Under `model.language_model.` (later versions' files) or
    /// `model.text_model.` (Idefics3's, SmolVLM's) in place of `model.`,
    /// the head where it is: the prefix.
    Nested(&'static str),
}

impl LanguageModel {
    /// Where the base whose tensors are `held` keeps it.
    fn of(held: &Held) -> Self {
        let any = |prefix: &str| held.keys().any(|n| n.starts_with(prefix));
        let nested = ["model.language_model.", "model.text_model."]
            .into_iter()
            .find(|p| any(p));
        match (any("language_model."), nested) {
            (true, _) => Self::Prefixed,
            (false, Some(prefix)) => Self::Nested(prefix),
            (false, None) => Self::Alone,
        }
    }

    /// The base's name of the language model's tensor (or module) `name`.
    fn in_base(self, name: &str) -> String {
        match (self, name.strip_prefix("model.")) {
            (Self::Prefixed, _) => format!("language_model.{name}"),
            (Self::Nested(prefix), Some(rest)) => format!("{prefix}{rest}"),
            _ => name.to_string(),
        }
    }
}

/// The adapter file in `dir`, read as `cfg` describes it, its names
/// the base's (`lm`).
fn adapters(dir: &Path, cfg: &LoraConfig, lm: LanguageModel) -> Result<Adapters, HfError> {
    let path = dir.join(ADAPTER_FILE);
    let bad = |msg: String| HfError::Read {
        path: path.clone(),
        msg,
    };
    let tensors =
        Tensor::read_safetensors(&path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let mut a = HashMap::new();
    let mut b = HashMap::new();
    let mut magnitudes = HashMap::new();
    let mut b_biases = BTreeMap::new();
    let mut rows = BTreeMap::new();
    let mut embeddings = std::collections::HashSet::new();
    let mut base_copies = HashMap::new();
    let (mut whole, mut copies) = (BTreeMap::new(), BTreeMap::new());
    for (name, t) in tensors {
        let module = lm.in_base(name.strip_prefix("base_model.model.").unwrap_or(&name));
        let module = module.as_str();
        if let Some(m) = module.strip_suffix(".lora_magnitude_vector") {
            magnitudes.insert(m.to_string(), t);
            continue;
        }
        if let Some(m) = module.strip_suffix(".lora_B.bias") {
            b_biases.insert(m.to_string(), t);
            continue;
        }
        if let Some(m) = module.strip_suffix(".base_layer.weight") {
            base_copies.insert(format!("{m}.weight"), t);
            continue;
        }
        if let Some(m) = module.strip_suffix(super::embedding::DELTA) {
            rows.insert(m.trim_end_matches('.').to_string(), t);
            continue;
        }
        // A token embedding's adapter: `A` `[r, vocab]`, `B` `[width,
        // r]`, its update `(B A)^T` as a Conv1D's.
        let a_of = (module.strip_suffix(".lora_A.weight"))
            .or_else(|| module.strip_suffix(".lora_embedding_A"));
        let b_of = (module.strip_suffix(".lora_B.weight"))
            .or_else(|| module.strip_suffix(".lora_embedding_B"));
        if module.ends_with(".lora_embedding_A") {
            embeddings.insert(format!("{}.weight", a_of.unwrap_or(module)));
        }
        match (a_of, b_of) {
            (Some(m), _) => drop(a.insert(m.to_string(), t)),
            (_, Some(m)) => drop(b.insert(m.to_string(), t)),
            _ if !cfg.saved_by(module).is_empty() => drop(whole.insert(module.to_string(), t)),
            // A trained bias (`bias = "all"`): in place of the base's.
            _ if cfg.train_biases && super::is_bias(module) => {
                drop(whole.insert(super::base_name(module), t))
            }
            _ if cfg.ensure_weight_tying => drop(copies.insert(module.to_string(), t)),
            _ => {
                return Err(bad(format!(
                    "`{name}` is no LoRA matrix (`...lora_A.weight`, `...lora_B.weight` and its `...lora_B.bias`, an embedding's `...lora_embedding_A`, DoRA's `...lora_magnitude_vector`) nor in a module of its `modules_to_save` {:?}: zrt merges LoRA and DoRA adapters",
                    cfg.modules_to_save
                )))
            }
        }
    }
    let mut pairs = BTreeMap::new();
    for (m, at) in a {
        let bt = b
            .remove(&m)
            .ok_or_else(|| bad(format!("`{m}` has lora_A and no lora_B")))?;
        pairs.insert(m, (at, bt));
    }
    if let Some(m) = b.keys().next() {
        return Err(bad(format!("`{m}` has lora_B and no lora_A")));
    }
    if pairs.is_empty() {
        return Err(bad("it holds no adapter".into()));
    }
    if let Some(m) = magnitudes.keys().find(|m| !pairs.contains_key(*m)) {
        return Err(bad(format!("`{m}` has a magnitude vector and no lora_A")));
    }
    if let Some(m) = b_biases.keys().find(|m| !pairs.contains_key(*m)) {
        return Err(bad(format!("`{m}` has a lora_B bias and no lora_A")));
    }
    // Biases the config does not say B has (or none it says it has)
    // would be merged other than PEFT merges them.
    if let Some(m) = (pairs.keys()).find(|m| cfg.lora_bias != b_biases.contains_key(*m)) {
        return Err(bad(format!(
            "`lora_bias` is {} in its adapter_config.json but `{m}` {} `lora_B.bias`: the adapter's files do not agree",
            cfg.lora_bias,
            if cfg.lora_bias { "lacks" } else { "has" },
        )));
    }
    Ok(Adapters {
        pairs,
        b_biases,
        magnitudes,
        embeddings,
        base_copies,
        rows,
        whole,
        copies,
    })
}

/// An adapter's tensors `by_module`, under the base's names of their
/// modules where the model holds a module under several (`names` gives
/// the model's one name): the copies PEFT writes under each user's name
/// must be equal (`same`), and go to every name the base holds the
/// module's tensor (`{module}{end}`) under (`dup`). A module the base
/// holds under no name keeps its own, for the caller to refuse.
#[allow(clippy::type_complexity)]
fn to_base_names<T>(
    by_module: impl IntoIterator<Item = (String, T)>,
    (names, held, end): (&super::ModelNames, &Held, &str),
    (same, dup): (impl Fn(&T, &T) -> bool, impl Fn(&T) -> T),
) -> Result<BTreeMap<String, T>, String> {
    let mut base_of: HashMap<String, Vec<&str>> = HashMap::new();
    for name in held.keys() {
        if let Some(m) = name.strip_suffix(end) {
            base_of.entry(names(m)).or_default().push(m);
        }
    }
    // By module name: the first copy read is the one kept.
    let mut by_module: Vec<(String, T)> = by_module.into_iter().collect();
    by_module.sort_by(|a, b| a.0.cmp(&b.0));
    let mut first: HashMap<String, (String, T)> = HashMap::new();
    let mut out = BTreeMap::new();
    for (m, t) in by_module {
        let model = names(&m);
        if let Some((f, kept)) = first.get(&model) {
            if !same(kept, &t) {
                return Err(format!("`{m}` and `{f}` are one module's (the model shares it between layers), and their adapters differ"));
            }
            continue;
        }
        match base_of.get(&model) {
            Some(bases) => {
                for b in bases {
                    out.insert(b.to_string(), dup(&t));
                }
            }
            None => drop(out.insert(m.clone(), dup(&t))),
        }
        first.insert(model, (m, t));
    }
    Ok(out)
}

/// The error for an adapter file whose copies of a shared module differ.
fn bad_copies(adapter: &Path, msg: String) -> HfError {
    HfError::Read {
        path: adapter.join(ADAPTER_FILE),
        msg: format!("{msg}: a file written by one trained model holds them equal"),
    }
}

/// A checkpoint's safetensors files, each with its tensors' names and
/// shapes.
type Files = Vec<(PathBuf, Vec<(String, Vec<i64>)>)>;

/// The base checkpoint's safetensors files (its index's, or its one
/// `model.safetensors`), and the tensors each holds.
pub(crate) fn base_files(base: &Path) -> Result<Files, HfError> {
    let index = base.join(INDEX);
    let files: Vec<PathBuf> = match index.is_file() {
        true => {
            let j = HfJson::read(&index, None)?;
            let map = (j.get("weight_map").and_then(|m| m.as_object()))
                .ok_or_else(|| j.field("no `weight_map`".into()))?;
            let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| base.join(n)).collect()
        }
        false => vec![base.join("model.safetensors")],
    };
    files
        .into_iter()
        .map(|f| {
            let names = header_names(&f)?;
            Ok((f, names))
        })
        .collect()
}

/// The tensors of the safetensors file `path`, from its header: each
/// one's name and shape.
fn header_names(path: &Path) -> Result<Vec<(String, Vec<i64>)>, HfError> {
    let bad = |msg: String| HfError::Read {
        path: path.to_path_buf(),
        msg,
    };
    let (_, json) = read_header(path)?;
    let shape = |v: &serde_json::Value| -> Option<Vec<i64>> {
        let dims = v.get("shape")?.as_array()?;
        dims.iter().map(|d| d.as_i64()).collect()
    };
    (json.iter())
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let s = shape(v).ok_or_else(|| bad(format!("`{k}` has no shape in its header")))?;
            Ok((k.clone(), s))
        })
        .collect()
}

/// Whether `a` and `b` are one existing file or directory (what a
/// rewrite of a checkpoint into another must not write over).
pub(crate) fn same_place(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// The safetensors file `path` opened and its header read: the file,
/// where its data starts, and the header's JSON object.
pub(crate) type Header = (
    (std::fs::File, u64),
    serde_json::Map<String, serde_json::Value>,
);

/// Opens the safetensors file `path` and reads its header ([`Header`]),
/// refusing one that is no safetensors file.
pub(crate) fn read_header(path: &Path) -> Result<Header, HfError> {
    use std::io::Read;
    let bad = |msg: String| HfError::Read {
        path: path.to_path_buf(),
        msg,
    };
    let mut f = std::fs::File::open(path).map_err(|e| bad(format!("cannot open it: {e}")))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| bad(format!("no safetensors header: {e}")))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(bad(format!(
            "a header of {len} bytes: not a safetensors file"
        )));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(format!("its header is cut short: {e}")))?;
    let json = serde_json::from_slice(&header).map_err(|e| bad(format!("its header: {e}")))?;
    Ok(((f, 8 + len), json))
}

/// Refuses the adapter `(a, b)` of rank `r` for the matrix `name` of
/// `shape` (`[in, out]` when `transposed`, a Conv1D's) unless A is
/// `[r, in]` and B `[out, r]`.
fn fits(
    name: &str,
    shape: &[i64],
    transposed: bool,
    (a, b): (&Tensor, &Tensor),
    r: i64,
) -> Result<(), HfError> {
    let (rows, cols) = match (shape, transposed) {
        (&[o, i], false) | (&[i, o], true) => (o, i),
        _ => {
            return Err(HfError::Lora(format!(
                "`{name}` is {shape:?}, not a matrix"
            )))
        }
    };
    if a.size() != [r, cols] || b.size() != [rows, r] {
        return Err(HfError::Lora(format!(
            "`{name}` is [{rows}, {cols}]; its adapter's A is {:?} and B {:?}, where rank {r} wants [{r}, {cols}] and [{rows}, {r}]: an adapter of another model",
            a.size(),
            b.size(),
        )));
    }
    Ok(())
}

/// Refuses the adapter `(a, b)` of rank `r` for the stacked parameter
/// `name` of `shape` unless it is `[experts, p, q]`, A `[r experts, p]`
/// and B `[q, r experts]`.
fn fits_parameter(
    name: &str,
    shape: &[i64],
    (a, b): &(Tensor, Tensor),
    r: i64,
) -> Result<(), HfError> {
    let &[e, p, q] = shape else {
        return Err(HfError::Lora(format!(
            "`{name}` is {shape:?}, not stacked experts' [experts, in, out]"
        )));
    };
    if a.size() != [r * e, p] || b.size() != [q, r * e] {
        return Err(HfError::Lora(format!(
            "`{name}` is [{e}, {p}, {q}]; its adapter's A is {:?} and B {:?}, where rank {r} wants [{}, {p}] and [{q}, {}]: an adapter of another model",
            a.size(),
            b.size(),
            r * e,
            r * e,
        )));
    }
    Ok(())
}

/// A base tensor's name and its shape there.
type Held<'a> = HashMap<&'a str, &'a [i64]>;

/// Trainable tokens' rows by the matrix they go into, with their ids.
type RowsInPlace<'t> = HashMap<String, (&'t Tensor, Tensor)>;

/// What of the base the adapter's whole tensors take the place of: its
/// saved modules' tensors (by name), and the embeddings its trainable
/// tokens' rows go into (by the matrix's name), each checked against
/// the base (`held`), as are its copies of the base's matrices and, for
/// a tied base, the head's copy of a saved embedding.
#[allow(clippy::type_complexity)]
fn whole_tensors<'t>(
    (adapter, base): (&Path, &Path),
    cfg: &LoraConfig,
    held: &Held,
    (whole, base_copies, rows, copies): (
        &'t BTreeMap<String, Tensor>,
        &'t HashMap<String, Tensor>,
        &'t BTreeMap<String, Tensor>,
        &'t BTreeMap<String, Tensor>,
    ),
) -> Result<(HashMap<String, &'t Tensor>, RowsInPlace<'t>), HfError> {
    // A saved module's tensors replace the base's, of their shape.
    let mut replacing = HashMap::new();
    for (name, t) in whole {
        match held.get(name.as_str()) {
            Some(shape) if *shape == t.size().as_slice() => drop(replacing.insert(name.clone(), t)),
            Some(shape) => {
                return Err(HfError::Lora(format!(
                    "{}: the adapter's `{name}` is {:?} and the base's {shape:?}: an adapter of another model",
                    adapter.display(),
                    t.size()
                )))
            }
            None => {
                return Err(HfError::Lora(format!(
                    "{}: the adapter saves `{name}`, which the base {} does not hold: an adapter of another model",
                    adapter.display(),
                    base.display()
                )))
            }
        }
    }
    // Copies of the base's matrices stand in for them, of their shapes
    // (PEFT writes them for a vocabulary it resized; zrt does not
    // resize one).
    for (name, t) in base_copies {
        if held.get(name.as_str()).copied() != Some(t.size().as_slice()) {
            return Err(HfError::Lora(format!(
                "{}: the adapter holds a copy of `{name}` of {:?}, where the base {} holds {:?}: a resized vocabulary, or an adapter of another model",
                adapter.display(),
                t.size(),
                base.display(),
                held.get(name.as_str()),
            )));
        }
    }
    // Trainable tokens' rows go in place of their module's (the input
    // embedding's: the list form's; any: the dict form's).
    let mut in_place = HashMap::new();
    for (m, t) in rows {
        let name = format!("{m}.weight");
        let ids = cfg.trainable_rows(m, true);
        let n = ids.len() as i64;
        let fits = match held.get(name.as_str()).copied() {
            Some(&[vocab, width]) => {
                t.size() == [n, width] && ids.iter().all(|i| (0..vocab).contains(i))
            }
            _ => false,
        };
        if !fits {
            return Err(HfError::Lora(format!(
                "{}: the adapter's trainable tokens {ids:?} ({:?} rows) do not fit the base's `{name}` ({:?}): an adapter of another model",
                adapter.display(),
                t.size(),
                held.get(name.as_str()),
            )));
        }
        in_place.insert(name, (t, Tensor::from_slice(ids)));
    }
    // PEFT writes a saved embedding of a tied model as the head too,
    // which the base does not hold apart: that copy is left out.
    for (name, t) in copies {
        let tied = !held.contains_key(name.as_str()) && replacing.values().any(|o| o.equal(t));
        if !tied {
            return Err(HfError::Lora(format!(
                "{}: the adapter holds `{name}`, which is no LoRA matrix, nor in a module of its modules_to_save {:?}, nor a copy of one its base ties: an adapter zrt does not merge",
                adapter.display(),
                cfg.modules_to_save
            )));
        }
    }
    Ok((replacing, in_place))
}

/// Writes to `out` the base checkpoint `base` (a `save_pretrained`
/// directory) with the adapter directory `adapter` folded into it:
/// each adapted matrix `W` becomes `W + scale B A` (its transpose for
/// GPT-2's Conv1D matrices, `[in, out]`; PEFT's
/// `merge_and_unload`: `B A` computed in fp32, cast to `W`'s dtype, then
/// added), under `lora_bias` its bias `b + scale b_B`, every other
/// tensor as it was, in the base's files (its index too) with its
/// `config.json` and the tokenizer's and generation files beside it. One
/// base file is in memory at a time. Every adapter must find its matrix
/// (and its bias), of its shape, or nothing is written; `out` may not be
/// `base` (the base would be lost).
pub fn merge(base: &Path, adapter: &Path, out: &Path) -> Result<Merged, HfError> {
    if same_place(base, out) {
        return Err(HfError::Lora(format!(
            "{}: the merged checkpoint would overwrite its base: give --out another directory",
            out.display()
        )));
    }
    let cfg = LoraConfig::from_adapter_dir(adapter)?;
    let files = base_files(base)?;
    let held: Held = (files.iter())
        .flat_map(|(_, tensors)| tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())))
        .collect();
    let lm = LanguageModel::of(&held);
    let Adapters {
        pairs,
        b_biases,
        magnitudes,
        embeddings,
        base_copies,
        rows,
        whole,
        copies,
    } = adapters(adapter, &cfg, lm)?;
    // A module the model shares between layers (Zamba's shared blocks):
    // PEFT writes its adapter under each user's name, a base may hold the
    // module under one or more of them.
    let base_config = HfJson::read(base, None)?;
    let (pairs, magnitudes, b_biases) = match crate::llama::model_names(&base_config)? {
        None => (pairs, magnitudes, b_biases),
        Some(names) => {
            let under = |m| (&names, &held, m);
            let same_pair =
                |x: &(Tensor, Tensor), y: &(Tensor, Tensor)| x.0.equal(&y.0) && x.1.equal(&y.1);
            let dup_pair = |x: &(Tensor, Tensor)| (x.0.shallow_clone(), x.1.shallow_clone());
            let one = |x: &Tensor, y: &Tensor| x.equal(y);
            (
                to_base_names(pairs, under(".weight"), (same_pair, dup_pair))
                    .map_err(|e| bad_copies(adapter, e))?,
                to_base_names(magnitudes, under(".weight"), (one, Tensor::shallow_clone))
                    .map_err(|e| bad_copies(adapter, e))?
                    .into_iter()
                    .collect(),
                to_base_names(b_biases, under(".bias"), (one, Tensor::shallow_clone))
                    .map_err(|e| bad_copies(adapter, e))?,
            )
        }
    };
    if let Some(m) = pairs
        .keys()
        .find(|m| cfg.use_dora != magnitudes.contains_key(*m))
    {
        return Err(HfError::Lora(format!(
            "{}: `use_dora` is {} but `{m}` {} a magnitude vector: the adapter's files do not agree",
            adapter.display(),
            cfg.use_dora,
            if cfg.use_dora { "lacks" } else { "has" },
        )));
    }
    let weight = |m: &str| format!("{m}.weight");
    // Adapters on stacked experts' parameters (`target_parameters`), by
    // the parameter, with their module's key in the file.
    let on_params: HashMap<String, &String> = (pairs.keys())
        .filter_map(|m| Some((super::param::parameter_of(m, &held, &cfg)?, m)))
        .collect();
    let on_a_param: std::collections::HashSet<&String> = on_params.values().copied().collect();
    let lacking: Vec<&String> = pairs
        .keys()
        .filter(|m| !held.contains_key(weight(m).as_str()) && !on_a_param.contains(m))
        .collect();
    if !lacking.is_empty() {
        return Err(HfError::Lora(format!(
            "{}: the adapter adapts {lacking:?}, which the base {} does not hold: an adapter of another model",
            adapter.display(),
            base.display()
        )));
    }
    let (replacing, in_place) = whole_tensors(
        (adapter, base),
        &cfg,
        &held,
        (&whole, &base_copies, &rows, &copies),
    )?;
    // GPT-2's and OpenAI GPT's Conv1D matrices are `[in, out]`: the
    // update goes in transposed (PEFT's `fan_in_fan_out`).
    let conv1d = match base_config.model_type().as_deref() {
        Some("gpt2") => true,
        Some(t) => crate::llama::Family::of(t).is_some_and(|f| f.conv1d()),
        None => false,
    };
    let transposed =
        |name: &str| (conv1d && crate::gpt2::is_conv1d_weight(name)) || embeddings.contains(name);
    // Every shape before anything is written.
    for (name, m) in &on_params {
        let shape = held.get(name.as_str()).copied().unwrap_or(&[]);
        fits_parameter(name, shape, &pairs[*m], cfg.rank_of(name))?;
    }
    for (m, (a, b)) in pairs.iter().filter(|(m, _)| !on_a_param.contains(m)) {
        let name = weight(m);
        let shape = held.get(name.as_str()).copied().unwrap_or(&[]);
        fits(&name, shape, transposed(&name), (a, b), cfg.rank_of(m))?;
    }
    // B's biases go into the adapted layers' own, of their length.
    for (m, bias) in &b_biases {
        let name = format!("{m}.bias");
        match held.get(name.as_str()) {
            Some(shape) if *shape == bias.size().as_slice() => {}
            Some(shape) => {
                return Err(HfError::Lora(format!(
                    "{}: `{m}`'s lora_B bias is {:?} and the base's `{name}` {shape:?}: an adapter of another model",
                    adapter.display(),
                    bias.size()
                )))
            }
            None => {
                return Err(HfError::Lora(format!(
                    "{}: the adapter's B has a bias (lora_bias) but the base's `{m}` has none to add it to (PEFT cannot merge it either): load the adapter beside the base instead (zrt::lora::load_adapter, `zrt generate --adapter`)",
                    adapter.display()
                )))
            }
        }
    }
    let io = |path: &Path, what: &str, e: &dyn std::fmt::Display| HfError::Read {
        path: path.to_path_buf(),
        msg: format!("cannot {what} it: {e}"),
    };
    // An adapted layer's bias (the base's, or under `bias = "all"` the
    // trained one) plus B's, scaled (PEFT: `b * scale` in the adapter's
    // dtype, added to the bias).
    let b_bias = |name: &str| {
        let m = name.strip_suffix(".bias")?;
        b_biases.get(m).map(|b| b * cfg.scale_of(m))
    };
    let with_b_bias = |name: &str, w: Tensor| match b_bias(name) {
        Some(b) => (w.to_kind(Kind::Float) + b.to_kind(Kind::Float)).to_kind(w.kind()),
        None => w,
    };
    std::fs::create_dir_all(out).map_err(|e| io(out, "create", &e))?;
    let (mut matrices, mut biases, mut replaced) = (Vec::new(), Vec::new(), Vec::new());
    for (file, _) in &files {
        let tensors = Tensor::read_safetensors(file).map_err(|e| io(file, "read", &e))?;
        let mut merged = Vec::with_capacity(tensors.len());
        for (name, w) in tensors {
            if let Some(t) = replacing.get(&name) {
                if b_bias(&name).is_some() {
                    biases.push(name.clone());
                }
                merged.push((name.clone(), with_b_bias(&name, t.to_kind(w.kind()))));
                replaced.push(name);
                continue;
            }
            if b_bias(&name).is_some() {
                merged.push((name.clone(), with_b_bias(&name, w)));
                biases.push(name);
                continue;
            }
            if let Some((t, ids)) = in_place.get(&name) {
                merged.push((name.clone(), w.index_copy(0, ids, &t.to_kind(w.kind()))));
                replaced.push(name);
                continue;
            }
            let w = match base_copies.get(&name) {
                Some(copy) => copy.to_kind(w.kind()),
                None => w,
            };
            // A stacked parameter: PEFT's update of every expert, in fp32,
            // cast to the parameter's dtype and added.
            if let Some(m) = on_params.get(&name) {
                let pair = &pairs[*m];
                fits_parameter(&name, &w.size(), pair, cfg.rank_of(&name))?;
                let (a, b) = pair;
                let delta = super::param::delta(a, b, cfg.rank_of(&name), cfg.scale_of(&name));
                merged.push((name.clone(), &w + delta.to_kind(w.kind())));
                matrices.push(name);
                continue;
            }
            let module = name.strip_suffix(".weight");
            let Some((m, (a, b))) = module.and_then(|m| pairs.get(m).map(|p| (m, p))) else {
                merged.push((name, w));
                continue;
            };
            let t = transposed(&name);
            fits(&name, &w.size(), t, (a, b), cfg.rank_of(m))?;
            let scale = cfg.scale_of(m);
            let ba = b.to_kind(Kind::Float).mm(&a.to_kind(Kind::Float));
            let ba = if t { ba.tr() } else { ba };
            let delta = (ba * scale).to_kind(w.kind());
            let updated = w + delta;
            let updated = match magnitudes.get(m) {
                None => updated,
                // DoRA (PEFT's merge): each row of `W + s B A` rescaled to
                // its magnitude.
                Some(mag) => {
                    let rows = if t {
                        updated.tr()
                    } else {
                        updated.shallow_clone()
                    };
                    let norms = rows.linalg_norm(2.0, [1i64].as_slice(), false, None::<Kind>);
                    let factor = mag.to_kind(Kind::Float) / norms.to_kind(Kind::Float);
                    let factor = if t {
                        factor.view([1, -1])
                    } else {
                        factor.view([-1, 1])
                    };
                    (factor * updated.to_kind(Kind::Float)).to_kind(updated.kind())
                }
            };
            merged.push((name.clone(), updated));
            matrices.push(name);
        }
        let name = file.file_name().unwrap_or_default();
        let to = out.join(name);
        Tensor::write_safetensors(&merged, &to).map_err(|e| io(&to, "write", &e))?;
    }
    let mut carried: Vec<&str> = vec!["config.json", INDEX];
    carried.extend_from_slice(crate::hf::CARRIED);
    for name in carried {
        let from = base.join(name);
        if from.is_file() {
            std::fs::copy(&from, out.join(name)).map_err(|e| io(&from, "copy", &e))?;
        }
    }
    matrices.sort();
    biases.sort();
    replaced.sort();
    Ok(Merged {
        matrices,
        biases,
        replaced,
        files: files.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multimodal_bases_language_model_is_found_under_either_prefix() {
        let shape: &[i64] = &[2, 2];
        let base = |names: &[&'static str]| -> Held<'static> {
            names.iter().map(|n| (*n, shape)).collect()
        };
        let legacy = base(&["language_model.model.norm.weight", "vision_tower.x"]);
        let nested = base(&["model.language_model.norm.weight", "lm_head.weight"]);
        let alone = base(&["model.norm.weight", "lm_head.weight"]);
        let text = base(&["model.text_model.norm.weight", "model.connector.x"]);
        let name = "model.layers.0.self_attn.q_proj";
        let found: Vec<String> = [legacy, nested, alone, text]
            .iter()
            .map(|held| LanguageModel::of(held).in_base(name))
            .collect();
        assert_eq!(
            found,
            [
                "language_model.model.layers.0.self_attn.q_proj",
                "model.language_model.layers.0.self_attn.q_proj",
                "model.layers.0.self_attn.q_proj",
                "model.text_model.layers.0.self_attn.q_proj",
            ]
        );
        let nested = LanguageModel::of(&base(&["model.language_model.norm.weight"]));
        assert_eq!(nested.in_base("lm_head"), "lm_head");
        assert_eq!(
            LanguageModel::Prefixed.in_base("lm_head"),
            "language_model.lm_head"
        );
    }

    #[test]
    fn a_shared_modules_adapter_copies_go_to_every_name_the_base_holds_it_under() {
        // One module `s` the model holds once, under layers 1 and 4 (a
        // Zamba's shared block): the base holds it under layer 4 only,
        // twice for `t`.
        let names: super::super::ModelNames = Box::new(|n: &str| {
            let n = n.replace("layers.4.", "layers.1.");
            n.replace("layers.7.", "layers.1.")
        });
        let shape: &[i64] = &[1];
        let held: Held = [
            "layers.4.s.weight",
            "layers.4.t.weight",
            "layers.1.t.weight",
            "other.weight",
        ]
        .into_iter()
        .map(|n| (n, shape))
        .collect();
        let t = |v: f32| Tensor::from_slice(&[v]);
        let same = |x: &Tensor, y: &Tensor| x.equal(y);
        let adapter = |pairs: &[(&str, f32)]| {
            pairs
                .iter()
                .map(|(m, v)| (m.to_string(), t(*v)))
                .collect::<Vec<_>>()
        };
        let put = |pairs| {
            to_base_names(
                pairs,
                (&names, &held, ".weight"),
                (same, Tensor::shallow_clone),
            )
        };
        let got = put(adapter(&[
            ("layers.1.s", 2.0),
            ("layers.4.s", 2.0),
            ("layers.7.t", 3.0),
            ("lone", 5.0),
        ]))
        .unwrap();
        let got: Vec<(&str, f64)> = got
            .iter()
            .map(|(n, v)| (n.as_str(), v.double_value(&[0])))
            .collect();
        assert_eq!(
            got,
            [
                ("layers.1.t", 3.0),
                ("layers.4.s", 2.0),
                ("layers.4.t", 3.0),
                ("lone", 5.0)
            ]
        );
        let err = put(adapter(&[("layers.1.s", 2.0), ("layers.4.s", 2.5)])).unwrap_err();
        assert!(
            err.contains("`layers.4.s` and `layers.1.s` are one module's"),
            "{err}"
        );
    }

    #[test]
    fn an_adapter_config_reads_as_peft_writes_it_and_what_zrt_cannot_compute_is_refused() {
        let dir = std::env::temp_dir().join(format!("zrt-adapter-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = LoraConfig {
            dropout: 0.05,
            use_rslora: true,
            fan_in_fan_out: true,
            use_dora: true,
            modules_to_save: vec!["embed_tokens".into(), "model.norm".into()],
            ensure_weight_tying: true,
            trainable_token_indices: vec![5, 2],
            train_biases: true,
            layers_to_transform: vec![1, 0],
            layers_pattern: vec!["layers".into()],
            // Not in sorted order: written and read back in this one.
            rank_pattern: vec![("v_proj".into(), 2), (r"layers\.1\..*".into(), 12)],
            alpha_pattern: vec![("v_proj".into(), 4.5)],
            ..LoraConfig::new(8, 16.0, &["q_proj", "v_proj"])
        };
        let written = cfg.adapter_config_json("base");
        std::fs::write(dir.join(ADAPTER_CONFIG), &written).unwrap();
        assert_eq!(LoraConfig::from_adapter_dir(&dir).unwrap(), cfg);
        let json: serde_json::Value = serde_json::from_str(&written).unwrap();
        for (key, value, says) in [
            ("peft_type", serde_json::json!("IA3"), "peft_type \"IA3\""),
            (
                "rank_pattern",
                serde_json::json!({"q_proj": "4"}),
                "`rank_pattern` and `alpha_pattern` are objects",
            ),
            (
                "rank_pattern",
                serde_json::json!({"q_proj": 0}),
                "rank_pattern gives \"q_proj\" the rank 0",
            ),
            (
                "alpha_pattern",
                serde_json::json!({"(?<=x)q_proj": 4}),
                "alpha_pattern key \"(?<=x)q_proj\" is no regular expression",
            ),
            (
                "r",
                serde_json::json!(0),
                "`r` is missing or not a positive integer",
            ),
            (
                "target_modules",
                serde_json::json!(null),
                "no `target_modules`",
            ),
            (
                "target_modules",
                serde_json::json!(".*(?<!k)_proj"),
                "is no regular expression zrt reads",
            ),
            (
                "target_modules",
                serde_json::json!(3),
                "`target_modules` is 3: a list of module names, or a regular expression",
            ),
            (
                "layers_to_transform",
                serde_json::json!("3"),
                "`layers_to_transform` is a layer's index or a list of them",
            ),
            (
                "layers_to_transform",
                serde_json::json!(null),
                "layers_pattern [\"layers\"] without layers_to_transform",
            ),
            (
                "layers_pattern",
                serde_json::json!(3),
                "`layers_pattern` is the name of the model's list of layers",
            ),
            (
                "modules_to_save",
                serde_json::json!("lm_head"),
                "`modules_to_save` is \"lm_head\": a list of module names",
            ),
            (
                "modules_to_save",
                serde_json::json!(["lm_head", 3]),
                "`modules_to_save` holds a non-string",
            ),
            (
                "modules_to_save",
                serde_json::json!([""]),
                "modules_to_save [\"\"] holds \"\"",
            ),
            (
                "trainable_token_indices",
                serde_json::json!({}),
                "as a list, or PEFT's dict form of modules (the input embedding, an untied head)",
            ),
            (
                "trainable_token_indices",
                serde_json::json!({"embed_tokens": 1}),
                "maps \"embed_tokens\" to 1, not a list of token ids",
            ),
            (
                "trainable_token_indices",
                serde_json::json!([1, "2"]),
                "`trainable_token_indices` holds a non-integer",
            ),
            (
                "trainable_token_indices",
                serde_json::json!([4, 1, 4]),
                "trainable_token_indices name token 4 twice",
            ),
            (
                "trainable_token_indices",
                serde_json::json!([-1]),
                "token ids are 0 or more",
            ),
            (
                "exclude_modules",
                serde_json::json!(["q_proj", 1]),
                "`exclude_modules` holds a non-string",
            ),
            // (`cfg` is DoRA's, whose B PEFT gives no bias.)
            (
                "lora_bias",
                serde_json::json!(true),
                "lora_bias with use_dora",
            ),
            (
                "lora_bias",
                serde_json::json!("yes"),
                "`lora_bias` is \"yes\": true",
            ),
            (
                "bias",
                serde_json::json!("lora_only"),
                "leaves them out of the adapter's file",
            ),
            ("bias", serde_json::json!("some"), "PEFT's are \"none\""),
        ] {
            let mut j = json.clone();
            j[key] = value;
            std::fs::write(dir.join(ADAPTER_CONFIG), j.to_string()).unwrap();
            let err = LoraConfig::from_adapter_dir(&dir).unwrap_err().to_string();
            assert!(
                err.contains(says) && err.contains(ADAPTER_CONFIG),
                "{key}: {err}"
            );
        }
        // What PEFT writes for settings left off reads.
        let mut off = json.clone();
        for key in [
            "layers_to_transform",
            "layers_pattern",
            "exclude_modules",
            "layer_replication",
            "rank_pattern",
        ] {
            off[key] = serde_json::Value::Null;
        }
        off["lora_bias"] = false.into();
        off["target_parameters"] = serde_json::json!([]);
        off["alpha_pattern"] = serde_json::json!({});
        std::fs::write(dir.join(ADAPTER_CONFIG), off.to_string()).unwrap();
        let plain = LoraConfig {
            layers_to_transform: vec![],
            layers_pattern: vec![],
            rank_pattern: vec![],
            alpha_pattern: vec![],
            ..cfg.clone()
        };
        assert_eq!(LoraConfig::from_adapter_dir(&dir).unwrap(), plain);
        // B's biases, written and read back.
        let biased = LoraConfig {
            use_dora: false,
            lora_bias: true,
            ..plain.clone()
        };
        let written = biased.adapter_config_json("base");
        assert!(written.contains("\"lora_bias\": true"), "{written}");
        std::fs::write(dir.join(ADAPTER_CONFIG), written).unwrap();
        assert_eq!(LoraConfig::from_adapter_dir(&dir).unwrap(), biased);
        // Stacked experts' parameters: written and read back, and with
        // PEFT's null targets beside them (no module takes an adapter).
        let on_params = LoraConfig {
            dropout: 0.0,
            use_dora: false,
            fan_in_fan_out: false,
            target_parameters: vec!["mlp.experts.gate_up_proj".into()],
            ..plain.clone()
        };
        let written = on_params.adapter_config_json("base");
        std::fs::write(dir.join(ADAPTER_CONFIG), &written).unwrap();
        assert_eq!(LoraConfig::from_adapter_dir(&dir).unwrap(), on_params);
        let mut null: serde_json::Value = serde_json::from_str(&written).unwrap();
        null["target_modules"] = serde_json::Value::Null;
        std::fs::write(dir.join(ADAPTER_CONFIG), null.to_string()).unwrap();
        let read = LoraConfig::from_adapter_dir(&dir).unwrap();
        assert!(read.target_modules.is_empty() && read.target_pattern.is_none());
        assert_eq!(read.target_parameters, on_params.target_parameters);
        // One layer's index and one pattern's name, as PEFT also takes
        // them; an empty name as none.
        let mut one = json.clone();
        one["layers_to_transform"] = 1.into();
        one["layers_pattern"] = "layers".into();
        std::fs::write(dir.join(ADAPTER_CONFIG), one.to_string()).unwrap();
        let read = LoraConfig::from_adapter_dir(&dir).unwrap();
        assert_eq!(
            (read.layers_to_transform, read.layers_pattern),
            (vec![1], vec!["layers".to_string()])
        );
        one["layers_pattern"] = "".into();
        std::fs::write(dir.join(ADAPTER_CONFIG), one.to_string()).unwrap();
        assert!(LoraConfig::from_adapter_dir(&dir)
            .unwrap()
            .layers_pattern
            .is_empty());
        // Trainable tokens in PEFT's dict form: read, and written back so
        // (by module name: a JSON object's keys are sorted).
        let dict = LoraConfig {
            trainable_token_indices: vec![],
            trainable_tokens_modules: vec![
                ("embed_tokens".into(), vec![5, 2]),
                ("lm_head".into(), vec![7]),
            ],
            ..cfg.clone()
        };
        let written = dict.adapter_config_json("base");
        let j: serde_json::Value = serde_json::from_str(&written).unwrap();
        assert_eq!(
            j["trainable_token_indices"],
            serde_json::json!({"embed_tokens": [5, 2], "lm_head": [7]})
        );
        std::fs::write(dir.join(ADAPTER_CONFIG), &written).unwrap();
        assert_eq!(LoraConfig::from_adapter_dir(&dir).unwrap(), dict);
        assert_eq!(dict.trainable_rows("model.embed_tokens", true), [5, 2]);
        assert_eq!(dict.trainable_rows("lm_head", false), [7]);
        assert!(dict.trainable_rows("model.norm", true).is_empty());
        assert_eq!(cfg.trainable_rows("model.embed_tokens", true), [5, 2]);
        assert!(cfg.trainable_rows("lm_head", false).is_empty());
        let both = LoraConfig {
            trainable_token_indices: vec![1],
            ..dict.clone()
        };
        let err = both.check("here").unwrap_err().to_string();
        assert!(err.contains("given as a list and by module both"), "{err}");
        let twice = LoraConfig {
            trainable_tokens_modules: vec![("lm_head".into(), vec![4, 4])],
            ..dict.clone()
        };
        let err = twice.check("here").unwrap_err().to_string();
        assert!(err.contains("name token 4 twice"), "{err}");
        let mut all = json.clone();
        all["target_modules"] = "all-linear".into();
        std::fs::write(dir.join(ADAPTER_CONFIG), all.to_string()).unwrap();
        all["modules_to_save"] = serde_json::Value::Null;
        all["ensure_weight_tying"] = serde_json::Value::Null;
        all["trainable_token_indices"] = serde_json::Value::Null;
        std::fs::write(dir.join(ADAPTER_CONFIG), all.to_string()).unwrap();
        let read = LoraConfig::from_adapter_dir(&dir).unwrap();
        assert_eq!(read.target_modules, ["all-linear"]);
        assert!(read.modules_to_save.is_empty() && !read.ensure_weight_tying);
        assert!(read.trainable_token_indices.is_empty());
        // Patterns: PEFT's strings, the targets' and the exclusions'.
        // (PEFT takes no layers beside a pattern.)
        all["layers_to_transform"] = serde_json::Value::Null;
        all["layers_pattern"] = serde_json::Value::Null;
        all["target_modules"] = r".*\.(q|v)_proj".into();
        all["exclude_modules"] = r".*\.0\..*".into();
        std::fs::write(dir.join(ADAPTER_CONFIG), all.to_string()).unwrap();
        let read = LoraConfig::from_adapter_dir(&dir).unwrap();
        assert!(read.target_modules.is_empty() && read.exclude_modules.is_empty());
        assert_eq!(read.target_pattern.as_deref(), Some(r".*\.(q|v)_proj"));
        assert_eq!(read.exclude_pattern.as_deref(), Some(r".*\.0\..*"));
        assert!(read.targets("model.layers.1.self_attn.v_proj"));
        assert!(!read.targets("model.layers.0.self_attn.v_proj"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

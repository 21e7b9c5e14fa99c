//! `zrt tokenize` writes the ids `transformers`' `AutoTokenizer` gives
//! the same text (a byte-level BPE tokenizer trained here, with a
//! beginning-of-text token its post-processor adds and a truncation in
//! its file that a call without one ignores), document after document,
//! in `u16` and `u32`; what it cannot tokenize is refused naming the
//! file, the line or the option, and leaves no file behind.

use std::path::Path;

use crate::common;
use common::scratch;

/// Runs `zrt tokenize ARGS`: whether it succeeded, and its stdout and
/// stderr.
fn tokenize(args: &[&std::ffi::OsStr]) -> (bool, String) {
    let all = [std::ffi::OsStr::new("tokenize")]
        .into_iter()
        .chain(args.iter().copied());
    common::zrt_cli(all)
}

/// The files of `dir`.
fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = (std::fs::read_dir(dir).unwrap())
        .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The numbers `script` prints, run in the venv's Python.
fn numbers(script: &str) -> Vec<u64> {
    (common::python(script).split_whitespace())
        .map(|w| w.parse().unwrap())
        .collect()
}

/// Python that trains a byte-level BPE tokenizer (`<s>` added before
/// each text, `</s>` its end-of-text token) and saves it in `tok` with
/// `save_pretrained`, then a truncation into its file; `json` is
/// imported.
fn trained_tokenizer(tok: &Path) -> String {
    format!(
        r#"
import json
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders, processors
from transformers import PreTrainedTokenizerFast, AutoTokenizer
corpus = ["the quick brown fox jumps over the lazy dog " * 3, "naïve café, ünïcödé 😀", "1234567890 tabs\tand spaces"] * 20
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(corpus, trainer)
tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained("{tok}")
# A truncation in the file, which a call that does not ask for one ignores.
path = "{tok}/tokenizer.json"
j = json.load(open(path))
j["truncation"] = {{"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}}
json.dump(j, open(path, "w"))
"#,
        tok = tok.display()
    )
}

#[test]
fn text_tokenizes_to_the_ids_transformers_gives_it() {
    let dir = scratch("tokenize");
    let tok = dir.join("tok");
    let (txt, jsonl) = (dir.join("a.txt"), dir.join("b.jsonl"));
    std::fs::write(
        &txt,
        "Ünïcödé, naïve café 😀 and\ttabs,  spaces\r\nand lines.\n\nThe end 123 4567.",
    )
    .unwrap();
    let script = format!(
        r#"{trained}
docs = ["the lazy fox 😀", "", "naïve\nline\twith \"quotes\" and \\ back", "x" * 300]
with open("{jsonl}", "w") as f:
    for i, d in enumerate(docs):
        f.write(json.dumps({{"id": i, "text": d}}) + "\n")
        if i == 1:
            f.write("\n")
t = AutoTokenizer.from_pretrained("{tok}")
texts = [open("{txt}", newline="").read()] + docs
ids = [t(d)["input_ids"] for d in texts]
assert max(len(i) for i in ids) > 4 and ids[0][0] == t.bos_token_id
import struct
eos = [i + [t.eos_token_id] for i in ids]
open("{dir}/want16.bin", "wb").write(b"".join(struct.pack("<H", x) for d in eos for x in d))
open("{dir}/want32.bin", "wb").write(b"".join(struct.pack("<I", x) for d in ids for x in d))
open("{dir}/want16.docs", "wb").write(bytes(j == 0 for d in eos for j in range(len(d))))
print(len(texts), sum(len(d) for d in eos), sum(len(d) for d in ids), len(t))
"#,
        trained = trained_tokenizer(&tok),
        tok = tok.display(),
        txt = txt.display(),
        jsonl = jsonl.display(),
        dir = dir.display(),
    );
    let n = numbers(&script);
    let (docs, with_eos, without, vocab) = (n[0], n[1], n[2], n[3]);
    for (flags, want, tokens) in [
        (&["--eos"][..], "want16.bin", with_eos),
        (&["--u32"][..], "want32.bin", without),
        (&["--eos", "--document-starts"][..], "want16.bin", with_eos),
    ] {
        let out = dir.join("got.bin");
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "--tokenizer".as_ref(),
            tok.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ];
        args.extend(flags.iter().map(std::ffi::OsStr::new));
        args.extend([txt.as_os_str(), jsonl.as_os_str()]);
        let (ok, said) = tokenize(&args);
        assert!(ok, "{flags:?}: {said}");
        let (got, want) = (
            std::fs::read(&out).unwrap(),
            std::fs::read(dir.join(want)).unwrap(),
        );
        assert!(
            got == want,
            "{flags:?}: {} bytes, transformers' {}",
            got.len(),
            want.len()
        );
        // Each document's first token marked, when asked (the empty
        // line's document is its end token alone).
        let starts = dir.join("got.bin.docs");
        if flags.contains(&"--document-starts") {
            let want = std::fs::read(dir.join("want16.docs")).unwrap();
            assert!(std::fs::read(&starts).unwrap() == want, "{said}");
            let says = format!("where each of the {docs} documents starts");
            assert!(said.contains(&says), "{said}");
            std::fs::remove_file(&starts).unwrap();
        }
        assert!(!starts.exists(), "{flags:?}");
        let width = if flags == ["--u32"] { "u32" } else { "u16" };
        assert!(
            said.contains(&format!(
                "{tokens} tokens of {docs} documents, {width} ids (the model's vocabulary must be at least {vocab})"
            )),
            "{said}"
        );
    }
    std::fs::remove_file(dir.join("got.bin")).unwrap();
    let before = files(&dir);

    // What cannot be tokenized is refused, and nothing is written.
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n").unwrap();
    let missing = dir.join("missing.txt");
    let notes = dir.join("notes.md");
    std::fs::write(&notes, "# not text").unwrap();
    let wide = dir.join("wide");
    common::python(&format!(
        r#"
import os
from tokenizers import Tokenizer, models
os.makedirs("{wide}")
Tokenizer(models.WordLevel({{f"w{{i}}": i for i in range(70000)}}, unk_token="w0")).save("{wide}/tokenizer.json")
"#,
        wide = wide.display()
    ));
    let out = dir.join("never.bin");
    let cases: Vec<(Vec<&std::ffi::OsStr>, String)> = vec![
        (
            vec![tok.as_os_str(), bad.as_os_str()],
            format!(
                "{}:2: no string field \"text\" (--field names the one holding the text;",
                bad.display()
            ),
        ),
        (
            vec![
                tok.as_os_str(),
                "--field".as_ref(),
                "body".as_ref(),
                bad.as_os_str(),
            ],
            format!("{}:1: no string field \"body\"", bad.display()),
        ),
        (
            vec![tok.as_os_str(), txt.as_os_str(), missing.as_os_str()],
            format!("{}: No such file", missing.display()),
        ),
        (
            vec![tok.as_os_str(), txt.as_os_str(), notes.as_os_str()],
            format!(
                "{}: neither .txt (one document) nor .jsonl",
                notes.display()
            ),
        ),
        (
            vec![dir.as_os_str(), txt.as_os_str()],
            format!(
                "no {}: zrt reads fast tokenizers",
                dir.join("tokenizer.json").display()
            ),
        ),
        (
            vec![wide.as_os_str(), txt.as_os_str()],
            "the tokenizer's ids go up to 69999, past u16's 65535: pass --u32".into(),
        ),
        (
            vec![
                wide.as_os_str(),
                "--u32".as_ref(),
                "--eos".as_ref(),
                txt.as_os_str(),
            ],
            format!(
                "no eos_token in {} (nor in its special_tokens_map.json)",
                wide.join("tokenizer_config.json").display()
            ),
        ),
    ];
    for (args, says) in cases {
        let mut all: Vec<&std::ffi::OsStr> =
            vec!["--out".as_ref(), out.as_os_str(), "--tokenizer".as_ref()];
        all.extend(args);
        let (ok, said) = tokenize(&all);
        assert!(!ok && said.contains(&says), "{says}: {said}");
        assert!(!out.exists(), "{says}: wrote {}", out.display());
    }
    let mut after = files(&dir);
    after.retain(|f| !["bad.jsonl", "notes.md", "wide"].contains(&f.as_str()));
    assert_eq!(after, before, "an error left a file behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--completion-only` reads TRL's prompt-completion lines: each
/// document is the prompt and its completion (and the end-of-text
/// token), as `AutoTokenizer` tokenizes their concatenation, and
/// `OUT.mask` leaves out as many tokens as `tokenizer(prompt)` has (also
/// where the tokenizer merges across the seam, as TRL does, which it
/// warns about); lines without the fields, and `.txt` files, are
/// refused.
#[test]
fn prompt_completion_lines_tokenize_with_a_mask_of_the_completions() {
    let dir = scratch("tokenize-completions");
    let tok = dir.join("tok");
    let jsonl = dir.join("sft.jsonl");
    let script = format!(
        r#"{trained}
pairs = [("the lazy dog jumps", " over the fox"), ("naïve café? ", "ünïcödé 😀"), ("the qu", "ick brown fox")]
with open("{jsonl}", "w") as f:
    for p, c in pairs:
        f.write(json.dumps({{"prompt": p, "completion": c}}) + "\n")
t = AutoTokenizer.from_pretrained("{tok}")
import struct
ids, mask, starts, merged = [], [], [], 0
for p, c in pairs:
    prompt, whole = t(p)["input_ids"], t(p + c)["input_ids"] + [t.eos_token_id]
    merged += whole[:len(prompt)] != prompt
    ids += whole
    mask += [0] * len(prompt) + [1] * (len(whole) - len(prompt))
    starts += [1] + [0] * (len(whole) - 1)
open("{dir}/want.bin", "wb").write(b"".join(struct.pack("<H", x) for x in ids))
open("{dir}/want.mask", "wb").write(bytes(mask))
open("{dir}/want.docs", "wb").write(bytes(starts))
print(len(ids), sum(mask), merged)
"#,
        trained = trained_tokenizer(&tok),
        tok = tok.display(),
        jsonl = jsonl.display(),
        dir = dir.display(),
    );
    let n = numbers(&script);
    let (tokens, counted, merged) = (n[0], n[1], n[2]);
    // The second and third pairs' seams merge (a prompt's last space
    // joins the completion's first word; "qu" + "ick"): the case TRL
    // warns of.
    assert_eq!(merged, 2, "the test's tokenizer merges other seams");
    let out = dir.join("sft.bin");
    let os = std::ffi::OsStr::new;
    let (ok, said) = tokenize(&[
        os("--tokenizer"),
        tok.as_os_str(),
        os("--out"),
        out.as_os_str(),
        os("--eos"),
        os("--completion-only"),
        os("--document-starts"),
        jsonl.as_os_str(),
    ]);
    assert!(ok, "{said}");
    for (got, want) in [
        ("sft.bin", "want.bin"),
        ("sft.bin.mask", "want.mask"),
        ("sft.bin.docs", "want.docs"),
    ] {
        let (got, want) = (
            std::fs::read(dir.join(got)).unwrap(),
            std::fs::read(dir.join(want)).unwrap(),
        );
        assert!(got == want, "{said}: {got:?}, transformers' {want:?}");
    }
    assert!(
        said.contains(&format!("the loss counts {counted} of the {tokens} tokens"))
            && said.contains("documents=2")
            && said.contains("do not begin with their prompt's"),
        "{said}"
    );
    // Refused: a line without its completion, and a .txt file.
    let (bad, txt) = (dir.join("bad.jsonl"), dir.join("a.txt"));
    std::fs::write(
        &bad,
        "{\"prompt\": \"p\", \"completion\": \"c\"}\n{\"prompt\": \"p\"}\n",
    )
    .unwrap();
    std::fs::write(&txt, "text").unwrap();
    let never = dir.join("never.bin");
    for (input, says) in [
        (
            &bad,
            format!("{}:2: no string field \"completion\"", bad.display()),
        ),
        (
            &txt,
            format!(
                "{}: a .txt file is one document without a prompt",
                txt.display()
            ),
        ),
    ] {
        let (ok, said) = tokenize(&[
            os("--tokenizer"),
            tok.as_os_str(),
            os("--out"),
            never.as_os_str(),
            os("--completion-only"),
            input.as_os_str(),
        ]);
        assert!(!ok && said.contains(&says), "{says}: {said}");
        assert!(
            !never.exists() && !dir.join("never.bin.mask").exists(),
            "{says}"
        );
    }
    // An output that cannot be renamed into place (a directory there)
    // after its mask was: the mask is taken back, nothing hidden stays.
    let busy = dir.join("busy.bin");
    std::fs::create_dir_all(busy.join("in")).unwrap();
    let (ok, said) = tokenize(&[
        os("--tokenizer"),
        tok.as_os_str(),
        os("--out"),
        busy.as_os_str(),
        os("--completion-only"),
        jsonl.as_os_str(),
    ]);
    assert!(!ok && said.contains(&busy.display().to_string()), "{said}");
    let hidden: Vec<_> = (std::fs::read_dir(&dir).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(
        !dir.join("busy.bin.mask").exists() && hidden.is_empty(),
        "{said}: {hidden:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A ChatML template using what chat templates use: tools' schemas, a namespace, Python's
/// string methods, `trim`, `tojson` (a message's `meta`, key order and
/// all), values printed as Python prints them (a multimodal message's
/// parts, `None`, `False`), `strftime_now`, `raise_exception`, loop controls, the special
/// tokens, indented blocks whose whitespace `trim_blocks` and
/// `lstrip_blocks` take away, and `{% generation %}` blocks around the
/// assistant's turns.
const CHATML: &str = r#"{%- set ns = namespace(system=false) -%}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = true %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- if tools %}
<|im_start|>tools
{% for t in tools %}{{ t | tojson(indent=2) if loop.first else t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- if not ns.system %}
<|im_start|>system
You help. Today is {{ strftime_now("%d %b %Y") }}.<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('roles are system, user and assistant, not ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content | trim }}<|im_end|>{% endgeneration %}

    {%- else %}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content.strip() }}{% else %}{{ message.content }} {{ message.content | trim }} {{ message.content[0].get('missing') }} {{ add_generation_prompt }}{% endif %}
{%- if message.meta is defined %} {{ message.meta | tojson }}{% endif %}<|im_end|>
    {% endif %}
    {%- if loop.last %}{% continue %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"#;

/// A Llama-3-like template without `{% generation %}` blocks, kept in
/// `tokenizer_config.json` as older checkpoints keep theirs, refusing
/// conversations whose roles do not alternate.
const LLAMA3: &str = r#"{{- bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"#;

#[test]
fn conversations_tokenize_as_apply_chat_template_gives_them() {
    let dir = scratch("tokenize-chat");
    let (tok, llama, legacy) = (dir.join("tok"), dir.join("llama"), dir.join("legacy"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("chatml.jinja"), CHATML).unwrap();
    std::fs::write(dir.join("llama3.jinja"), LLAMA3).unwrap();
    let (chats, pcs, convs) = (
        dir.join("chats.jsonl"),
        dir.join("pc.jsonl"),
        dir.join("convs.jsonl"),
    );
    let script = format!(
        r#"{trained}
import os, struct, time
os.environ["TZ"] = "UTC"
time.tzset()
t = AutoTokenizer.from_pretrained("{tok}")
t.add_special_tokens({{"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}})
t.chat_template = open("{dir}/chatml.jinja").read()
t.save_pretrained("{tok}")
t.chat_template = open("{dir}/llama3.jinja").read()
t.save_pretrained("{llama}", save_jinja_files=False)
t = AutoTokenizer.from_pretrained("{tok}")
u, a, s = ({{"role": r, "content": c}} for r, c in [("user", "  hello there  "), ("assistant", "hi! 😀\n"), ("system", "be brief")])
meta = {{"role": "user", "content": "naïve café?", "meta": {{"z": 1, "a": [1.5, None, True, "é\"q", 1e-05], "m": {{}}}}}}
parts = {{"role": "user", "content": [{{"type": "text", "text": "it's \"quoted\"\n\u00a0"}}, {{"type": "image", "n": 1.5, "ok": True, "x": None, "e": 1e-05}}]}}
convs = [[u, a], [s, meta, {{"role": "assistant", "content": "yes"}}, {{"role": "user", "content": "the lazy fox"}}, {{"role": "assistant", "content": " jumps "}}], [parts, {{"role": "assistant", "content": "seen"}}]]
tools = [{{"type": "function", "function": {{"name": "add", "description": "adds é", "parameters": {{"type": "object", "properties": {{"x": {{"type": "number"}}}}, "required": ["x"]}}}}}}, {{"type": "function", "function": {{"name": "now"}}}}]
chats = [{{"messages": convs[0]}}, {{"text": "the quick brown fox"}}, {{"id": 7, "messages": convs[1]}}, {{"messages": convs[2], "tools": tools}}]
pcs = [{{"prompt": [u], "completion": [a], "tools": tools}}, {{"prompt": "the quick", "completion": " brown fox"}}, {{"prompt": convs[1][:2], "completion": convs[1][2:3]}}]
for path, lines in [("{chats}", chats), ("{pcs}", pcs), ("{convs}", [{{"messages": c}} for c in convs])]:
    with open(path, "w") as f:
        for l in lines:
            f.write(json.dumps(l, ensure_ascii=False) + "\n")
def write(name, ids, mask=None):
    open(f"{dir}/{{name}}.bin", "wb").write(b"".join(struct.pack("<H", x) for x in ids))
    if mask is not None:
        open(f"{dir}/{{name}}.mask", "wb").write(bytes(mask))
ids = []
for c in chats:
    if "text" in c:
        ids += t(c["text"])["input_ids"] + [t.eos_token_id]
    else:
        ids += t.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=True)
write("chats", ids)
ids, mask = [], []
for c in pcs:
    if isinstance(c["prompt"], str):
        p, w = t(c["prompt"])["input_ids"], t(c["prompt"] + c["completion"])["input_ids"]
    else:
        p = t.apply_chat_template(c["prompt"], tools=c.get("tools"), add_generation_prompt=True, tokenize=True)
        w = t.apply_chat_template(c["prompt"] + c["completion"], tools=c.get("tools"), tokenize=True)
    assert w[:len(p)] == p
    ids += w
    mask += [0] * len(p) + [1] * (len(w) - len(p))
write("pc", ids, mask)
ids, mask = [], []
for c in convs:
    out = t.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids += out["input_ids"]
    mask += out["assistant_masks"]
assert 0 < sum(mask) < len(mask)
write("convs", ids, mask)
l = AutoTokenizer.from_pretrained("{llama}")
write("llama", l.apply_chat_template(convs[0], tokenize=True))
# A legacy checkpoint: no added_tokens_decoder in its config, whose
# special tokens special_tokens_map.json then overrides.
import shutil
shutil.copytree("{llama}", "{legacy}")
cfg = json.load(open("{legacy}/tokenizer_config.json"))
del cfg["added_tokens_decoder"]
cfg["bos_token"] = "</s>"
del cfg["eos_token"]
json.dump(cfg, open("{legacy}/tokenizer_config.json", "w"))
g = AutoTokenizer.from_pretrained("{legacy}")
assert (g.bos_token, g.eos_token) == ("<s>", "</s>"), (g.bos_token, g.eos_token)
with open("{legacy}.jsonl", "w") as f:
    f.write(json.dumps({{"text": "the lazy fox"}}) + "\n" + json.dumps({{"messages": convs[0]}}) + "\n")
write("legacy", g("the lazy fox")["input_ids"] + [g.eos_token_id] + g.apply_chat_template(convs[0], tokenize=True))
print(int(os.path.exists("{tok}/chat_template.jinja")), int(os.path.exists("{llama}/chat_template.jinja")), sum(mask))
"#,
        trained = trained_tokenizer(&tok),
        tok = tok.display(),
        llama = llama.display(),
        legacy = legacy.display(),
        dir = dir.display(),
        chats = chats.display(),
        pcs = pcs.display(),
        convs = convs.display(),
    );
    let n = numbers(&script);
    // The two places transformers keeps a template.
    assert_eq!((n[0], n[1]), (1, 0), "chat_template.jinja");
    let os = std::ffi::OsStr::new;
    let out = dir.join("got.bin");
    let mask = dir.join("got.bin.mask");
    for (tokenizer, flags, input, want) in [
        (&tok, &["--eos"][..], &chats, "chats"),
        (&tok, &["--completion-only"][..], &pcs, "pc"),
        (&tok, &["--assistant-only"][..], &convs, "convs"),
        (&llama, &[][..], &convs, "llama"),
        (
            &legacy,
            &["--eos"][..],
            &legacy.with_extension("jsonl"),
            "legacy",
        ),
    ] {
        let _ = std::fs::remove_file(&mask);
        let mut args = vec![
            os("--tokenizer"),
            tokenizer.as_os_str(),
            os("--out"),
            out.as_os_str(),
        ];
        args.extend(flags.iter().map(|f| os(f)));
        // The Llama case reads the first conversation only (the second
        // does not alternate: below).
        let first = dir.join("first.jsonl");
        if want == "llama" {
            let text = std::fs::read_to_string(input).unwrap();
            std::fs::write(&first, text.lines().next().unwrap()).unwrap();
            args.push(first.as_os_str());
        } else {
            args.push(input.as_os_str());
        }
        let (ok, said) = tokenize(&args);
        assert!(ok, "{want}: {said}");
        let got = std::fs::read(&out).unwrap();
        let theirs = std::fs::read(dir.join(format!("{want}.bin"))).unwrap();
        assert!(
            got == theirs,
            "{want}: {} bytes, transformers' {}",
            got.len(),
            theirs.len()
        );
        let masked = std::fs::read(dir.join(format!("{want}.mask")));
        match masked {
            Ok(theirs) => {
                assert!(std::fs::read(&mask).unwrap() == theirs, "{want}: the mask");
                if want == "convs" {
                    let counted = format!("the loss counts {} of the", n[2]);
                    assert!(
                        said.contains(&counted) && said.contains("assistant's turns'"),
                        "{said}"
                    );
                }
            }
            Err(_) => assert!(!mask.exists(), "{want}: a mask"),
        }
    }

    // What a template refuses, or cannot do, is said with the line.
    let never = dir.join("never.bin");
    let (odd, roles) = (dir.join("odd.jsonl"), dir.join("roles.jsonl"));
    std::fs::write(
        &roles,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n{\"messages\": [{\"role\": \"tool\", \"content\": \"b\"}]}\n",
    )
    .unwrap();
    std::fs::write(&odd, "{\"messages\": \"not a list\"}\n").unwrap();
    let none = dir.join("none");
    std::fs::create_dir_all(&none).unwrap();
    std::fs::copy(tok.join("tokenizer.json"), none.join("tokenizer.json")).unwrap();
    for (tokenizer, flag, input, says) in [
        (
            &tok,
            None,
            &roles,
            format!("{}:2: the chat template ({}) refused the conversation: invalid operation: roles are system, user and assistant, not tool", roles.display(), tok.join("chat_template.jinja").display()),
        ),
        (
            &llama,
            None,
            &convs,
            format!("{}:2: the chat template ({}) refused the conversation: invalid operation: Conversation roles must alternate", convs.display(), llama.join("tokenizer_config.json").display()),
        ),
        (
            &llama,
            Some("--assistant-only"),
            &convs,
            "the chat template has no {% generation %} blocks".into(),
        ),
        (
            &none,
            None,
            &convs,
            format!("{}:1: a conversation, but the tokenizer has no chat template", convs.display()),
        ),
        (
            &tok,
            Some("--assistant-only"),
            &chats,
            format!("{}:2: no list \"messages\"", chats.display()),
        ),
        (
            &tok,
            None,
            &odd,
            format!("{}:1: no string field \"text\"", odd.display()),
        ),
    ] {
        let mut args = vec![os("--tokenizer"), tokenizer.as_os_str(), os("--out"), never.as_os_str()];
        args.extend(flag.map(os));
        args.push(input.as_os_str());
        let (ok, said) = tokenize(&args);
        assert!(!ok && said.contains(&says), "{says}: {said}");
        assert!(!never.exists() && !dir.join("never.bin.mask").exists(), "{says}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A retrieval template: the documents first, then the messages, each
/// message's text trimmed (a string) or its parts' texts as they are.
const WITH_DOCUMENTS: &str = r#"{%- if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.content is string %}{{ m.content | trim }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

#[test]
fn a_final_message_continued_and_documents_render_as_apply_chat_template_renders_them() {
    use zrt::chat_template::{Ending, Extras};
    let dir = scratch("tokenize-continue");
    let tok = dir.join("tok");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("docs.jinja"), WITH_DOCUMENTS).unwrap();
    // A trimmed final text (the tag's space trimmed too: cut before the
    // whitespace), parts kept as they are (the simple cut), documents,
    // and the assistant's turn opened after them.
    let cases = r#"[
        [[{"role": "user", "content": "what is the fox?"}, {"role": "assistant", "content": "  The fox is  "}], true, false],
        [[{"role": "user", "content": "and?"}, {"role": "assistant", "content": [{"type": "text", "text": "part one "}, {"type": "image"}, {"type": "text", "text": "part two "}]}], false, false],
        [[{"role": "user", "content": "the lazy dog"}], true, true]
    ]"#;
    std::fs::write(dir.join("cases.json"), cases).unwrap();
    let script = format!(
        r#"{trained}
t = AutoTokenizer.from_pretrained("{tok}")
t.add_special_tokens({{"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}})
t.chat_template = open("{dir}/docs.jinja").read()
t.save_pretrained("{tok}")
docs = [{{"title": "A", "text": "the quick"}}, {{"title": "B", "text": "brown fox"}}]
for messages, with_docs, prompt in json.load(open("{dir}/cases.json")):
    ids = t.apply_chat_template(messages, documents=docs if with_docs else None, tokenize=True,
                                add_generation_prompt=prompt, continue_final_message=not prompt)
    print(" ".join(map(str, ids)))
"#,
        trained = trained_tokenizer(&tok),
        tok = tok.display(),
        dir = dir.display(),
    );
    let theirs = common::python(&script);
    // (The training above prints empty lines.)
    let theirs: Vec<Vec<u32>> = (theirs.lines())
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    let t = zrt::tokenize::HfTokenizer::open(&tok).unwrap();
    let docs: minijinja::Value = serde_json::from_str(
        r#"[{"title": "A", "text": "the quick"}, {"title": "B", "text": "brown fox"}]"#,
    )
    .unwrap();
    let cases: Vec<(minijinja::Value, bool, bool)> = serde_json::from_str(cases).unwrap();
    assert_eq!(cases.len(), theirs.len(), "{theirs:?}");
    for (k, ((messages, with_docs, prompt), want)) in cases.iter().zip(&theirs).enumerate() {
        let extras = Extras {
            tools: None,
            documents: with_docs.then_some(&docs),
        };
        let ending = match prompt {
            true => Ending::GenerationPrompt,
            false => Ending::ContinueFinalMessage,
        };
        let got = t.encode_conversation(messages, &extras, ending).unwrap();
        assert_eq!(&got, want, "case {k}: {}", t.decode(&got).unwrap());
    }
    // The continued text ends the rendering: the trimmed reply, no close.
    let (first, _, _) = &cases[0];
    let ids = t
        .encode_conversation(first, &Extras::default(), Ending::ContinueFinalMessage)
        .unwrap();
    let text = t.decode(&ids).unwrap();
    assert!(text.ends_with("The fox is"), "{text:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

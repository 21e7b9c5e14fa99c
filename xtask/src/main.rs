//! zrt's task runner: `cargo xtask <setup|test|demo|bench|ci-check>`.
//!
//! It has no libtorch dependency, so it builds and runs on a fresh machine and
//! is what installs libtorch there: every command first runs `setup`, which is
//! idempotent and cheap once done.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

/// The PyTorch release tch 0.26 is built against.
const TORCH_VERSION: &str = "2.13.0";
/// The Python safetensors the checkpoint tests read zrt's exports with.
const SAFETENSORS_VERSION: &str = "0.5.3";
/// The `transformers` whose GPT-2 the Hugging Face tests compare with (the
/// last 4.x: 5.x would pull a newer safetensors).
const TRANSFORMERS_VERSION: &str = "4.57.6";
/// The `peft` whose LoRA the adapter tests compare with (it loads zrt's
/// adapters and trains its own from them).
const PEFT_VERSION: &str = "0.18.0";

const USAGE: &str = "\
usage: cargo xtask <command> [args...]

commands:
  setup          install libtorch (torch==2.13.0 from PyPI) once per machine and link it as .libtorch
  test [ARGS]    setup, then run every test of the workspace (ARGS go to `cargo test`)
  demo [ARGS]    setup, then run the main job: multi-rank ZeRO-3 training on CPU
  bench [ARGS]   setup, then `zrt bench ARGS` in release mode
  python         print the path of the libtorch venv's Python (for peer benchmarks)
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<ExitCode> {
    let Some((cmd, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        return Ok(ExitCode::from(2));
    };
    let root = repo_root();
    match cmd.as_str() {
        "setup" => {
            let torch = setup(&root)?;
            println!("libtorch {TORCH_VERSION} ready at {}", torch.display());
            Ok(ExitCode::SUCCESS)
        }
        "test" => {
            setup(&root)?;
            let margins = target_dir(&root).join("tmp").join(MARGINS);
            // This run's margins alone (a file the tests append to).
            let _ = std::fs::remove_file(&margins);
            let code = cargo(
                &root,
                &[&["test", "--workspace"], &str_refs(rest)[..]].concat(),
            );
            print_margins(&margins);
            code
        }
        "demo" => {
            setup(&root)?;
            demo(&root, rest)
        }
        "bench" => {
            setup(&root)?;
            let mut a = vec!["run", "--release", "--quiet", "--bin", "zrt", "--", "bench"];
            a.extend(str_refs(rest));
            cargo(&root, &a)
        }
        "python" => {
            setup(&root)?;
            println!("{}", venv_python(&cache_dir()?).display());
            Ok(ExitCode::SUCCESS)
        }
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        other => {
            eprint!("unknown command `{other}`\n\n{USAGE}");
            Ok(ExitCode::from(2))
        }
    }
}

/// The file the parity tests record their margins in
/// (`tests/common`'s `margin`), under `<target>/tmp`.
const MARGINS: &str = "parity-margins.tsv";

/// How many of the closest margins a test run prints.
const CLOSEST: usize = 12;

/// Prints the comparisons with a reference that came closest to their
/// bounds in this run (`MARGINS`, one line each: the share of the bound,
/// the difference, the bound, what was compared), so that a bound tuned
/// on one CPU shows its margin on every other before it fails there.
fn print_margins(path: &Path) {
    let Ok(text) = std::fs::read_to_string(path) else {
        return;
    };
    let mut rows: Vec<(f64, &str)> = (text.lines())
        .filter_map(|l| {
            let (share, rest) = l.split_once('\t')?;
            Some((share.parse().ok()?, rest))
        })
        .collect();
    rows.sort_by(|a, b| b.0.total_cmp(&a.0));
    println!(
        "\nparity margins: the {} of {} comparisons with a reference closest to their bounds ({})",
        CLOSEST.min(rows.len()),
        rows.len(),
        path.display()
    );
    for (share, rest) in rows.iter().take(CLOSEST) {
        let mut cols = rest.splitn(3, '\t');
        let (diff, bound, what) = (
            cols.next().unwrap_or(""),
            cols.next().unwrap_or(""),
            cols.next().unwrap_or(""),
        );
        println!("  {:>6.1}%  {diff} of {bound}  {what}", share * 100.0);
    }
}

fn str_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn repo_root() -> PathBuf {
    // xtask/ sits directly under the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Where libtorch is installed once per machine, shared by every clone:
/// `$ZRT_CACHE`, else `$XDG_CACHE_HOME/zrt`, else `~/.cache/zrt`.
fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("ZRT_CACHE") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("zrt"));
    }
    let home = std::env::var_os("HOME").context("neither ZRT_CACHE nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache").join("zrt"))
}

fn venv_dir(cache: &Path) -> PathBuf {
    cache.join(format!("torch-{TORCH_VERSION}"))
}

fn venv_python(cache: &Path) -> PathBuf {
    venv_dir(cache).join("bin").join("python")
}

/// Asks the venv's Python for torch's version and package dir; `None` when
/// the venv or torch is missing or broken.
fn probe_torch(python: &Path) -> Option<(String, PathBuf)> {
    let out = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(torch.__version__); print(os.path.dirname(torch.__file__))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let mut lines = text.lines();
    let version = lines.next()?.trim().to_string();
    let dir = PathBuf::from(lines.next()?.trim());
    Some((version, dir))
}

/// Installs torch==TORCH_VERSION into a venv in the cache (once per machine)
/// and points `<repo>/.libtorch` at it. Returns the torch package dir.
fn setup(root: &Path) -> Result<PathBuf> {
    let cache = cache_dir()?;
    let python = venv_python(&cache);
    let torch_dir = match probe_torch(&python) {
        Some((v, dir)) if v.split('+').next() == Some(TORCH_VERSION) => dir,
        found => {
            if let Some((v, _)) = found {
                eprintln!(
                    "xtask: the cached venv has torch {v}, reinstalling torch=={TORCH_VERSION}"
                );
            }
            install_torch(&cache)?;
            match probe_torch(&python) {
                Some((v, dir)) if v.split('+').next() == Some(TORCH_VERSION) => dir,
                Some((v, _)) => bail!("pip installed torch {v}, expected {TORCH_VERSION}"),
                None => bail!(
                    "torch was installed into {} but `import torch` fails there; delete that folder and run `cargo xtask setup` again",
                    venv_dir(&cache).display()
                ),
            }
        }
    };
    if !torch_dir.join("lib").join("libtorch_cpu.so").exists() {
        bail!(
            "{} has no lib/libtorch_cpu.so: not a usable libtorch",
            torch_dir.display()
        );
    }
    ensure_python_packages(&cache)?;
    link_libtorch(root, &torch_dir)?;
    Ok(torch_dir)
}

fn install_torch(cache: &Path) -> Result<()> {
    let venv = venv_dir(cache);
    std::fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    let python3 = which("python3").context(
        "python3 is not on PATH: install Python 3 with venv and pip (Debian: apt-get install python3 python3-venv python3-pip)",
    )?;
    if !venv_python(cache).exists() {
        eprintln!("xtask: creating a venv for libtorch at {}", venv.display());
        let st = Command::new(&python3)
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("running python3 -m venv")?;
        if !st.success() {
            bail!("`python3 -m venv {}` failed: install the venv module (Debian: apt-get install python3-venv)", venv.display());
        }
    }
    eprintln!("xtask: installing torch=={TORCH_VERSION} from PyPI (about a minute, about 5 GB; once per machine)");
    pip_install(cache, &[&format!("torch=={TORCH_VERSION}")])
}

/// `pip install SPECS` into the venv, quietly.
fn pip_install(cache: &Path, specs: &[&str]) -> Result<()> {
    let st = Command::new(venv_python(cache))
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
        ])
        .args(specs)
        .status()
        .context("running pip")?;
    if !st.success() {
        let specs = specs.join(" ");
        bail!("`pip install {specs}` failed (see pip's output above); pip must reach PyPI");
    }
    Ok(())
}

/// The Python packages the tests compare with, in the same venv, each
/// installed once: `safetensors` (the checkpoint tests load zrt's
/// consolidated weights with it, as a Python user would; one wheel) and
/// `transformers` (its GPT-2 and Llama write the checkpoints
/// `tests/from_hf.rs` loads and compute the logits and losses zrt's must
/// match, and it reads zrt's exports back; about 15 wheels, 10 seconds),
/// and `peft` (its LoRA reads zrt's adapters; three wheels).
fn ensure_python_packages(cache: &Path) -> Result<()> {
    let want = [
        ("safetensors", SAFETENSORS_VERSION),
        ("transformers", TRANSFORMERS_VERSION),
        ("peft", PEFT_VERSION),
    ];
    // One interpreter start reading the installed versions from the
    // packages' metadata: every xtask command runs this, and importing
    // transformers to ask it costs two seconds.
    let script = "import importlib.metadata as m, sys\nfor p in sys.argv[1:]:\n    try: print(m.version(p))\n    except m.PackageNotFoundError: print()";
    let have: Vec<String> = Command::new(venv_python(cache))
        .args(["-c", script])
        .args(want.map(|(p, _)| p))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let missing: Vec<String> = (want.iter().enumerate())
        .filter(|(k, (_, v))| have.get(*k).map(String::as_str) != Some(*v))
        .map(|(_, (p, v))| format!("{p}=={v}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {} into the venv", missing.join(" "));
    // Every pin in one pip call, so that neither moves the other's
    // (transformers alone would take a newer safetensors).
    let specs: Vec<String> = want.iter().map(|(p, v)| format!("{p}=={v}")).collect();
    pip_install(cache, &specs.iter().map(String::as_str).collect::<Vec<_>>())
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Points `<repo>/.libtorch` (the `LIBTORCH` of `.cargo/config.toml`) at `torch_dir`.
fn link_libtorch(root: &Path, torch_dir: &Path) -> Result<()> {
    let link = root.join(".libtorch");
    if std::fs::read_link(&link).ok().as_deref() == Some(torch_dir) {
        return Ok(());
    }
    if link.symlink_metadata().is_ok() {
        std::fs::remove_file(&link)
            .with_context(|| format!("removing stale {}", link.display()))?;
    }
    std::os::unix::fs::symlink(torch_dir, &link)
        .with_context(|| format!("linking {} -> {}", link.display(), torch_dir.display()))?;
    Ok(())
}

fn cargo(root: &Path, args: &[&str]) -> Result<ExitCode> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let st = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .status()
        .context("running cargo")?;
    Ok(exit_code(st))
}

fn exit_code(st: std::process::ExitStatus) -> ExitCode {
    match st.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => ExitCode::FAILURE,
    }
}

/// The main job: `zrt launch` of examples/train_gpt on 2 processes
/// (shared-memory backend, ZeRO-3 from examples/ds_zero3.json, CPU).
///
/// Built in the dev profile, the one `cargo test` builds every library in,
/// so the demo and the tests share one build: a release build compiled
/// everything a second time (about 4.5 minutes of a fresh CI run on the
/// 2-core machine) for no speed the job shows: 90% of its time is in
/// libtorch's kernels, optimized either way, and the dev profile builds
/// dependencies at -O2, our kernels crate at -O3 (Cargo.toml). Three
/// interleaved pairs of 80 steps ran 3036, 3367 and 3386 tokens/s from the
/// dev build against 3478, 3442 and 3002 from the release one, with the
/// same losses. `cargo xtask bench` stays in release.
fn demo(root: &Path, rest: &[String]) -> Result<ExitCode> {
    let code = cargo(
        root,
        &["build", "--quiet", "--bin", "zrt", "--example", "train_gpt"],
    )?;
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    let debug = target_dir(root).join("debug");
    let mut cmd = Command::new(debug.join("zrt"));
    cmd.args(["launch", "--nproc-per-node", "2", "--"])
        .arg(debug.join("examples").join("train_gpt"))
        .args(rest);
    eprintln!(
        "xtask: zrt launch --nproc-per-node 2 -- target/debug/examples/train_gpt {}",
        rest.join(" ")
    );
    Ok(exit_code(
        cmd.current_dir(root)
            .status()
            .context("running zrt launch")?,
    ))
}

/// The build's target folder: `$CARGO_TARGET_DIR`, else `target` in the
/// workspace.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

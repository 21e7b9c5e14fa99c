//! A peer implementation running in the libtorch venv's Python, driven over
//! stdin/stdout one JSON object a line, so it stays alive between rounds.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The Python of the venv `cargo xtask setup` made: `$ZRT_PYTHON`, else
/// `~/.cache/zrt/torch-2.13.0/bin/python` (or under `$ZRT_CACHE`).
pub fn venv_python() -> PathBuf {
    if let Some(p) = std::env::var_os("ZRT_PYTHON") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("ZRT_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache")
                .join("zrt")
        });
    cache.join("torch-2.13.0").join("bin").join("python")
}

/// `PATH` with the venv's bin first (DeepSpeed JIT-builds with the venv's ninja).
pub fn venv_path() -> std::ffi::OsString {
    let mut path = venv_python()
        .parent()
        .map(|b| b.as_os_str().to_owned())
        .unwrap_or_default();
    if let Some(old) = std::env::var_os("PATH") {
        path.push(":");
        path.push(old);
    }
    path
}

/// A running peer process.
pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The first line the peer printed (what it found available).
    pub hello: Value,
}

impl Peer {
    /// Starts `script` (Python source) with `args` and waits for its hello line.
    pub fn start(script: &str, args: &[String]) -> Result<Self> {
        let python = venv_python();
        if !python.exists() {
            bail!(
                "the peer needs the libtorch venv's Python at {}: run `cargo xtask setup` (or set ZRT_PYTHON)",
                python.display()
            );
        }
        let mut child = Command::new(&python)
            .env("PATH", venv_path())
            .arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", python.display()))?;
        let stdin = child.stdin.take().context("peer stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("peer stdout")?);
        let mut peer = Self {
            child,
            stdin,
            stdout,
            hello: Value::Null,
        };
        peer.hello = peer.read()?;
        Ok(peer)
    }

    /// The next protocol line (`@@zrt {json}`); other lines the peer's
    /// libraries print go to our stderr.
    fn read(&mut self) -> Result<Value> {
        loop {
            let mut line = String::new();
            let n = self
                .stdout
                .read_line(&mut line)
                .context("reading from the peer")?;
            if n == 0 {
                bail!("the Python peer exited (its error is above)");
            }
            match line.strip_prefix("@@zrt ") {
                Some(msg) => {
                    return serde_json::from_str(msg)
                        .with_context(|| format!("peer sent malformed JSON: {msg}"))
                }
                None => eprint!("peer: {line}"),
            }
        }
    }

    /// Sends one request and returns the reply.
    pub fn call(&mut self, req: &Value) -> Result<Value> {
        writeln!(self.stdin, "{req}").context("writing to the peer")?;
        self.stdin.flush().context("writing to the peer")?;
        self.read()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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

/// Why `python` cannot import `module`, or `None` when it can: the last
/// line Python printed (`ModuleNotFoundError: No module named 'deepspeed'`),
/// or why it did not run. Asked once before a benchmark's rounds, so a peer
/// whose package is missing is left out with one line instead of failing
/// with a traceback in every round.
pub fn import_fails(python: &std::path::Path, module: &str) -> Option<String> {
    let out = Command::new(python)
        .env("PATH", venv_path())
        .arg("-c")
        .arg(format!("import {module}"))
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map_or_else(|| format!("exit {}", o.status), |l| l.trim().to_string()),
        ),
        Err(e) => Some(format!("{}: {e}", python.display())),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_module_the_venv_lacks_is_named_with_pythons_own_words() {
        let python = venv_python();
        assert_eq!(import_fails(&python, "json"), None);
        assert_eq!(
            import_fails(&python, "zrt_no_such_module").as_deref(),
            Some("ModuleNotFoundError: No module named 'zrt_no_such_module'")
        );
        let missing = std::path::Path::new("/nonexistent/zrt/python");
        let why = import_fails(missing, "json").unwrap_or_default();
        assert!(why.starts_with("/nonexistent/zrt/python: "), "{why}");
    }
}

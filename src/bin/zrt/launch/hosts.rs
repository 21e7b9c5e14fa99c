//! `zrt launch --hostfile FILE`: a job on several nodes from one command,
//! as DeepSpeed's launcher runs one from its hostfile.
//!
//! The hostfile is DeepSpeed's: one `HOST slots=N` line per node, `#`
//! comments. This launcher is node 0 and must run on the first host (its
//! stores bind to that address); it starts node `k`'s launcher on host
//! `k` over ssh (`ZRT_SSH`, `ssh` by default) with the same arguments
//! plus `--nnodes`, `--node-rank` and `--master-addr`, and from there the
//! launchers meet as any job's on several nodes do (`agents`): a failure,
//! a signal to this launcher or a launcher that ends early ends every
//! node's ranks. The job's token goes to each remote launcher on its ssh
//! stdin, never on a command line another user's `ps` could read.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::LaunchArgs;

/// Environment variables passed on to the remote launchers (by prefix, or
/// whole names), as DeepSpeed passes its `NCCL_` and `PYTHON` ones: what
/// tunes zrt, NCCL, OpenMP and the logs. `ZRT_TOKEN` goes on stdin.
const PASSED_ON: &[&str] = &["ZRT_", "NCCL_", "OMP_NUM_THREADS", "RUST_LOG"];

/// One node of a hostfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Host {
    pub name: String,
    pub slots: usize,
}

/// Reads DeepSpeed's hostfile format: `HOST slots=N` per line, blank
/// lines and `#` comments skipped.
pub(super) fn parse(text: &str, file: &str) -> Result<Vec<Host>> {
    let mut hosts: Vec<Host> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = format!("{file}:{}", i + 1);
        let mut words = line.split_whitespace();
        let (Some(name), Some(slots), None) = (words.next(), words.next(), words.next()) else {
            bail!(
                "{at}: `{line}` is not `HOST slots=N` (one node per line, as DeepSpeed's hostfile)"
            );
        };
        let slots = slots
            .strip_prefix("slots=")
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .with_context(|| {
                format!("{at}: `{slots}` is not `slots=N` with N at least 1 (the ranks to start on {name})")
            })?;
        if let Some(h) = hosts.iter().find(|h| h.name == name) {
            bail!(
                "{at}: host {} is listed twice: give each node one line",
                h.name
            );
        }
        hosts.push(Host {
            name: name.to_string(),
            slots,
        });
    }
    let Some(first) = hosts.first() else {
        bail!("{file} lists no host: write one `HOST slots=N` line per node, this machine's first");
    };
    if let Some(h) = hosts.iter().find(|h| h.slots != first.slots) {
        bail!(
            "{file} gives {} slots={} and {} slots={}: every node runs the same number of ranks (give each host the same slots, or --nproc-per-node N for all)",
            first.name,
            first.slots,
            h.name,
            h.slots
        );
    }
    Ok(hosts)
}

/// The arguments of node 0 of the job `file` lists (this launcher's),
/// and its hosts: `--nnodes` from the hostfile, `--nproc-per-node` from
/// its slots and `--master-addr` its first host unless given, and a job
/// token made here unless `ZRT_TOKEN` gives one.
pub(super) fn resolve(a: &LaunchArgs, file: &std::path::Path) -> Result<(LaunchArgs, Vec<Host>)> {
    let name = file.display().to_string();
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading the hostfile {name}"))?;
    let hosts = parse(&text, &name)?;
    if a.master_addr.is_none() {
        let first = &hosts[0].name;
        // Its stores bind there: said here with the fix, before any
        // remote node is started.
        if let Err(e) = std::net::TcpListener::bind((first.as_str(), 0)) {
            bail!(
                "the first host of {name}, {first}, is not this machine ({e}): the launcher given --hostfile is node 0 and runs on the first host; run it there, or put this machine first"
            );
        }
    }
    let mut r = a.clone();
    r.nnodes = super::Nodes::fixed(hosts.len());
    r.node_rank = 0;
    r.nproc_per_node = a.nproc_per_node.or(Some(hosts[0].slots));
    r.master_addr = a
        .master_addr
        .clone()
        .or_else(|| Some(hosts[0].name.clone()));
    if hosts.len() > 1 {
        r.token = Some(match std::env::var("ZRT_TOKEN") {
            Ok(t) if !t.is_empty() => t,
            _ => super::random_token()?,
        });
    }
    Ok((r, hosts))
}

/// Quotes `s` for a POSIX shell (the remote side of ssh runs one).
pub(super) fn sh_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-./=:,@%+".contains(&b));
    match plain {
        true => s.to_string(),
        false => format!("'{}'", s.replace('\'', r"'\''")),
    }
}

/// The command a remote host's shell runs to start node `node`'s
/// launcher: in this directory, with the token read from stdin, the
/// passed-on environment, and this launcher's own arguments.
pub(super) fn remote_command(
    a: &LaunchArgs,
    node: usize,
    port: u16,
    zrt: &str,
    cwd: &str,
    env: &[(String, String)],
) -> String {
    let mut words: Vec<String> = vec!["exec".into(), "env".into()];
    words.extend(env.iter().map(|(k, v)| format!("{k}={}", sh_quote(v))));
    words.push(sh_quote(zrt));
    words.push("launch".into());
    let mut flag = |f: &str, v: String| {
        words.push(f.into());
        words.push(sh_quote(&v));
    };
    flag("--nnodes", a.nnodes.to_string());
    flag("--node-rank", node.to_string());
    flag("--nproc-per-node", a.nproc().to_string());
    flag("--master-addr", a.master_addr().to_string());
    flag("--master-port", port.to_string());
    flag("--grace", a.grace.to_string());
    flag("--max-restarts", a.max_restarts.to_string());
    if let Some(d) = &a.log_dir {
        flag("--log-dir", d.to_string_lossy().into_owned());
    }
    words.push("--".into());
    words.extend(a.program.iter().map(|w| sh_quote(w)));
    format!(
        "cd {} && read -r ZRT_TOKEN && export ZRT_TOKEN && {}",
        sh_quote(cwd),
        words.join(" ")
    )
}

/// The remote launchers this one started over ssh.
pub(super) struct Remotes {
    /// Node, host and ssh process, while it runs.
    children: Mutex<Vec<(usize, String, Child)>>,
    pumps: Vec<std::thread::JoinHandle<()>>,
}

impl Remotes {
    /// Starts nodes 1.. of `hosts` over ssh, each with `token` on stdin.
    pub(super) fn start(a: &LaunchArgs, hosts: &[Host], port: u16, token: &str) -> Result<Self> {
        let ssh = std::env::var("ZRT_SSH").unwrap_or_else(|_| "ssh".to_string());
        let ssh: Vec<&str> = ssh.split_whitespace().collect();
        let Some((prog, ssh_args)) = ssh.split_first() else {
            bail!("ZRT_SSH is empty: leave it unset for `ssh`, or give the command that runs a command on a host (`ssh -p 2222`)");
        };
        let zrt =
            std::env::current_exe().context("finding this zrt's path for the remote nodes")?;
        let cwd =
            std::env::current_dir().context("reading the directory to run the remote nodes in")?;
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k != "ZRT_TOKEN" && PASSED_ON.iter().any(|p| k.starts_with(p)))
            .collect();
        let mut r = Self {
            children: Mutex::new(Vec::new()),
            pumps: Vec::new(),
        };
        for (node, h) in hosts.iter().enumerate().skip(1) {
            let cmd = remote_command(
                a,
                node,
                port,
                &zrt.to_string_lossy(),
                &cwd.to_string_lossy(),
                &env,
            );
            tracing::debug!("node {node}: {prog} {} {cmd}", h.name);
            let mut c = Command::new(prog);
            c.args(ssh_args)
                .arg(&h.name)
                .arg(cmd)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                // Out of the terminal's process group: a Ctrl-C reaches
                // this launcher, which ends every node's ranks through
                // the launchers' store, and ssh stays to carry their
                // last lines.
                .process_group(0);
            super::die_with_launcher(&mut c);
            let mut child = match c.spawn() {
                Ok(c) => c,
                Err(e) => {
                    r.stop();
                    bail!("cannot start `{prog}` to reach {} (node {node}): {e}; set ZRT_SSH to the command that runs a command on a host", h.name);
                }
            };
            if let Some(mut i) = child.stdin.take() {
                // A host that never reads it fails to join, which is seen.
                let _ = writeln!(i, "{token}");
            }
            if let Some(o) = child.stdout.take() {
                r.pumps.push(super::pump(String::new(), o, false, None));
            }
            if let Some(e) = child.stderr.take() {
                r.pumps.push(super::pump(String::new(), e, true, None));
            }
            r.children().push((node, h.name.clone(), child));
        }
        Ok(r)
    }

    /// The ssh processes still running (a panic elsewhere while one held
    /// the lock leaves the list as it was).
    fn children(&self) -> std::sync::MutexGuard<'_, Vec<(usize, String, Child)>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails naming a remote launcher whose ssh ended with an error before
    /// it joined the job (`joined(node)`): the host unreachable, zrt not
    /// found there. One that joined and then ended is seen by the
    /// launchers' store like any other.
    pub(super) fn check(&self, joined: impl Fn(usize) -> Result<bool>) -> Result<()> {
        let mut children = self.children();
        for (node, host, child) in children.iter_mut() {
            let Ok(Some(st)) = child.try_wait() else {
                continue;
            };
            let code = super::code_of(st);
            if code != 0 && !joined(*node)? {
                bail!(
                    "node {node}'s launcher on {host}, started over ssh, ended with code {code} before joining the job: its lines above say why (ssh exits with 255 when it cannot reach the host; the remote side needs this zrt at the same path and this directory)"
                );
            }
        }
        Ok(())
    }

    /// Waits for the remote launchers to end (they do once the job has,
    /// at most `within`), then stops any left and copies out their last
    /// lines.
    pub(super) fn finish(mut self, within: Duration) {
        let t0 = Instant::now();
        loop {
            let mut children = self.children();
            children.retain_mut(|(_, _, c)| !matches!(c.try_wait(), Ok(Some(_))));
            if children.is_empty() || t0.elapsed() >= within {
                break;
            }
            drop(children);
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
        for p in self.pumps.drain(..) {
            let _ = p.join();
        }
    }

    /// Ends every ssh still running.
    fn stop(&mut self) {
        for (_, _, c) in self.children().iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfiles_read_as_deepspeeds_and_mistakes_name_their_line() {
        let h = parse(
            "# nodes\nworker-1 slots=4\n\n  worker-2   slots=4 # second\n",
            "hf",
        )
        .unwrap();
        assert_eq!(
            h,
            vec![
                Host {
                    name: "worker-1".into(),
                    slots: 4
                },
                Host {
                    name: "worker-2".into(),
                    slots: 4
                }
            ]
        );
        for (text, want) in [
            ("", "hf lists no host"),
            (
                "a slots=2\nb slots=3\n",
                "hf gives a slots=2 and b slots=3: every node runs the same number of ranks",
            ),
            ("a slots=2\nb\n", "hf:2: `b` is not `HOST slots=N`"),
            (
                "a slots=two\n",
                "hf:1: `slots=two` is not `slots=N` with N at least 1",
            ),
            ("a slots=0\n", "hf:1: `slots=0` is not `slots=N`"),
            ("a gpus=1\n", "hf:1: `gpus=1` is not `slots=N`"),
            ("a slots=1\na slots=1\n", "hf:2: host a is listed twice"),
        ] {
            let e = format!("{:#}", parse(text, "hf").unwrap_err());
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn words_are_quoted_for_the_remote_shell() {
        assert_eq!(sh_quote("plain-word_1.2/x=y"), "plain-word_1.2/x=y");
        assert_eq!(sh_quote(""), "''");
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's $HOME"), r"'it'\''s $HOME'");
        // What a shell makes of them again.
        for w in [
            "a b",
            "it's",
            "$HOME `x` \"q\"",
            "",
            "tab\there",
            "new\nline",
        ] {
            let o = std::process::Command::new("sh")
                .args(["-c", &format!("printf %s {}", sh_quote(w))])
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&o.stdout), w);
        }
    }
}
